"""`megatrain` console script: one combined yaml -> accelerate launch + MEGATRAIN_CONFIG; clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_megatrain import MegaTrainConfig, cli
from hf_megatrain.config import resolve_config

ROOT = Path(__file__).resolve().parents[1]
COMBINED = ROOT / "examples" / "megatrain_combined.yaml"
SMALL = ["--max_steps", "3", "--logging_steps", "1", "--eval_strategy", "no", "--block_size", "32",
         "--per_device_train_batch_size", "2", "--max_eval_samples", "4", "--save_strategy", "no"]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def megatrain(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    # `python -m hf_megatrain.cli` is exactly what the `megatrain` console script runs.
    return subprocess.run([sys.executable, "-m", "hf_megatrain.cli", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_example_combined_yaml_is_valid():
    accel, config, section = cli.split_combined(str(COMBINED))
    assert set(section) <= set(MegaTrainConfig.valid_keys())
    assert config == MegaTrainConfig.from_dict(section)
    assert accel["distributed_type"] == "NO" and accel["mixed_precision"] == "no" and "megatrain" not in accel


def test_bad_section_key_is_a_clear_error(tmp_path, capsys):
    bad = yaml.safe_load(COMBINED.read_text())
    bad["megatrain"]["num_slot"] = 3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert cli.main(["launch", "--config", str(path), "examples/train.py"]) == 2
    err = capsys.readouterr().err
    assert "num_slot" in err and "valid keys" in err and "num_slots" in err and str(path) in err


def test_stray_top_level_key_is_a_clear_error(tmp_path, capsys):
    data = yaml.safe_load(COMBINED.read_text())
    data["compute_dtype"] = "float32"  # belongs under megatrain:
    path = tmp_path / "stray.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli.main(["launch", "--config", str(path), "examples/train.py"]) == 2
    err = capsys.readouterr().err
    assert "compute_dtype" in err and "Move hf_megatrain keys under 'megatrain:'" in err


def test_missing_config_file(capsys):
    assert cli.main(["launch", "--config", "/nonexistent.yaml", "examples/train.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_split_config_arg_stops_at_the_script():
    path, rest = cli.split_config_arg(["--config", "a.yaml", "--num_processes", "1", "train.py", "--config", "x"])
    assert path == "a.yaml" and rest == ["--num_processes", "1", "train.py", "--config", "x"]
    path, rest = cli.split_config_arg(["--config=b.yaml", "train.py"])
    assert path == "b.yaml" and rest == ["train.py"]


def test_estimate_delegates_to_planner(tmp_path, capsys):
    """`megatrain estimate` runs the planner: the host/GPU/disk table with its rows and a verdict; --json parses."""
    from hf_megatrain.hf import default_job

    default_job.tiny_llama_config().save_pretrained(str(tmp_path))
    # Every layer streamed, a fixed 80 GiB target GPU: the host rows are the same on any machine.
    args = ["estimate", str(tmp_path), "--seq-len", "128", "--device-layers", "0", "--gpu-memory", "80"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for row in ("Host RAM", "master fp32", "compute copy", "total (peak)", "GPU memory (per GPU)",
                "weight slots", "step peak = ", "Disk", "model export", "bfloat16 compute, seq_len=128"):
        assert row in out, out
    # (a GPU named on the command line: the verdict names the machine checked, not "this machine")
    verdict = re.findall(r"^verdict: (fits|does NOT fit) a machine with .* of host RAM available and an 80\.0 GiB GPU"
                         r"(?: \(.*\))?$", out, re.M)
    assert len(verdict) == 1, out
    assert cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_total"] > 0 and data["gpu_total"] > 0 and data["disk_total"] > 0
    assert data["host_total"] >= sum(data["host"].values())
    streamed = data["params"]["trainable"] - data["shape"]["resident_numel"]
    assert streamed > 0 and data["host"]["master fp32"] == 4 * streamed  # streamed layers' fp32 master on the host
    fits = data["host_fits"] and data["gpu_fits"]
    assert verdict[0] == ("fits" if fits else "does NOT fit")


def test_keys_lists_valid_keys(capsys):
    assert cli.main(["keys"]) == 0
    out = capsys.readouterr().out
    assert all(f"{k}:" in out for k in MegaTrainConfig.valid_keys())


def _effective(stdout: str) -> str:
    m = re.search(r"effective MegaTrainConfig: (.*)", stdout)
    assert m, stdout[-3000:]
    return m.group(1)


@pytest.mark.slow  # subprocess: megatrain launch -> accelerate launch
def test_launch_example_yaml_end_to_end(tmp_path):
    """The shipped combined yaml: accelerate launches train.py, which receives the section via MEGATRAIN_CONFIG."""
    r = megatrain("launch", "--config", str(COMBINED), "examples/train.py", *SMALL, "--output_dir", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sent = re.search(r"MEGATRAIN_CONFIG=(\S+)", r.stderr).group(1)
    line = _effective(r.stdout)
    assert f"env MEGATRAIN_CONFIG={sent}" in line  # the child read the section of the yaml the launcher named
    expected = resolve_config(str(COMBINED), environ={})
    assert f"compute_dtype='{expected.compute_dtype}'" in line and f"num_slots={expected.num_slots}" in line
    assert "checkpoint:" in r.stdout


@pytest.mark.slow  # subprocess: megatrain launch -> accelerate launch
def test_launch_passes_non_default_section(tmp_path):
    data = yaml.safe_load(COMBINED.read_text())
    data["megatrain"].update(compute_dtype="float32", num_slots=3, loss_chunk_tokens=48, micro_batch_size=1)
    path = tmp_path / "combined.yaml"
    path.write_text(yaml.safe_dump(data))
    r = megatrain("launch", "--config", str(path), "examples/train.py", *SMALL, "--output_dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = _effective(r.stdout)
    for frag in ("compute_dtype='float32'", "num_slots=3", "loss_chunk_tokens=48", "micro_batch_size=1"):
        assert frag in line, line


@pytest.mark.slow  # subprocess: megatrain launch -> accelerate launch
def test_launch_failure_propagates_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nassert os.environ['MEGATRAIN_CONFIG']\nsys.exit(3)\n")
    r = megatrain("launch", "--config", str(COMBINED), str(script))
    assert r.returncode == 3, r.stderr[-2000:]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "mistral3"])
def test_estimate_plans_a_multimodal_checkpoint(tmp_path, capsys, family):
    """A ``...ForConditionalGeneration`` config (no causal-LM auto class) is planned as the model it trains as: its
    language model's layers streamed, the towers resident; from a saved config and from one without
    ``architectures``."""
    from tests.multimodal_models import tiny_multimodal

    model = tiny_multimodal(family)
    VISION_TOWER_MIN = sum(p.numel() for n, p in model.named_parameters() if "vision" in n)  # noqa: N806
    cfg = model.config
    cfg.save_pretrained(str(tmp_path / "saved"))
    cfg.architectures = None
    cfg.save_pretrained(str(tmp_path / "bare"))
    for where in ("saved", "bare"):
        args = ["estimate", str(tmp_path / where), "--seq-len", "32", "--device-layers", "0", "--gpu-memory", "80",
                "--json"]
        assert cli.main(args) == 0
        data = json.loads(capsys.readouterr().out)
        streamed = data["params"]["trainable"] - data["shape"]["resident_numel"]
        assert streamed > 0 and data["host"]["master fp32"] == 4 * streamed
        assert data["shape"]["resident_numel"] > VISION_TOWER_MIN  # the tower and projector are resident
