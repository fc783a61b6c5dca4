"""What a user meets on the documented path (issue 47): the example resumes, the launcher keeps the yaml's section,
the run summary says what happened in plain words and stays out of what is uploaded."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--max_steps", "4", "--logging_steps", "1", "--eval_strategy", "no", "--block_size", "32",
        "--per_device_train_batch_size", "2", "--max_eval_samples", "2", "--save_strategy", "steps",
        "--save_steps", "2", "--use_cpu", "--disable_tqdm", "true"]


def example():
    """examples/train.py as a module: its ``main(argv)`` is the command line without a new interpreter."""
    spec = importlib.util.spec_from_file_location("megatrain_example_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def fingerprint(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every file's md5, inode and mtime: an atomic re-save (new files renamed in) changes the inodes even when it
    writes the same bytes."""
    out = {}
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            st = f.stat()
            out[str(f.relative_to(folder))] = (hashlib.md5(f.read_bytes()).hexdigest(), st.st_ino, st.st_mtime_ns)
    return out


@pytest.mark.slow  # three short runs of the example (~10 s)
def test_example_resumes_from_checkpoint_and_leaves_it_alone(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("MEGATRAIN_")]:
        monkeypatch.delenv(k)
    train = example()
    out = tmp_path / "run"
    first = train.main([*TINY, "--output_dir", str(out)])
    assert first["global_step"] == 4 and first["start_step"] == 0
    ckpt2, ckpt4 = out / "checkpoint-2", out / "checkpoint-4"
    before = fingerprint(ckpt2)

    # An explicit path: training goes on from its step; the checkpoint it started from is not written again.
    second = train.main([*TINY, "--max_steps", "6", "--output_dir", str(out), "--resume_from_checkpoint", str(ckpt2)])
    assert second["start_step"] == 2 and second["global_step"] == 6
    assert fingerprint(ckpt2) == before
    assert (out / "checkpoint-6").is_dir()

    # "true", as Trainer.train(resume_from_checkpoint=True): the last checkpoint of output_dir.
    marks = fingerprint(out / "checkpoint-6")
    third = train.main([*TINY, "--max_steps", "8", "--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert third["start_step"] == 6 and third["global_step"] == 8 and fingerprint(out / "checkpoint-6") == marks

    # Left out, a folder with checkpoints resumes from the last one (run_clm.py's "Detecting last checkpoint") ...
    fourth = train.main([*TINY, "--max_steps", "10", "--output_dir", str(out)])
    assert fourth["start_step"] == 8 and fourth["global_step"] == 10
    # ... unless --overwrite_output_dir: then it starts again from step 0.
    fresh = train.main([*TINY, "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(out),
                        "--overwrite_output_dir"])
    assert fresh["start_step"] == 0 and fresh["global_step"] == 2
    assert ckpt4.is_dir()


# -- item 4: the launch yaml's megatrain: section and the script's megatrain_config, merged key by key ---------------
COMBINED = "distributed_type: 'NO'\nmixed_precision: 'no'\nmegatrain:\n  num_slots: 3\n  loss_chunk_tokens: 48\n"


def _clean_env(monkeypatch) -> None:
    for k in [k for k in os.environ if k.startswith("MEGATRAIN_")]:
        monkeypatch.delenv(k)


def test_script_config_merges_over_the_launch_section(tmp_path, monkeypatch, caplog):
    """What the training process of ``megatrain launch --config combined.yaml`` resolves (MEGATRAIN_CONFIG names the
    yaml): a script passing megatrain_config ({} as the README's snippet may, or its own keys) keeps the section's
    keys; its own keys win a conflict, which is logged with both values and sources, never dropped silently."""
    import logging

    from hf_megatrain import MegaTrainTrainingArguments

    _clean_env(monkeypatch)
    y = tmp_path / "combined.yaml"
    y.write_text(COMBINED)
    monkeypatch.setenv("MEGATRAIN_CONFIG", str(y))
    monkeypatch.setenv("MEGATRAIN_MICRO_BATCH_SIZE", "2")
    common = dict(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
    cfg = MegaTrainTrainingArguments(**common, megatrain_config={}).megatrain_base_config()
    assert (cfg.num_slots, cfg.loss_chunk_tokens, cfg.micro_batch_size) == (3, 48, 2)
    with caplog.at_level(logging.INFO, logger="hf_megatrain.config"):
        args = MegaTrainTrainingArguments(**common, megatrain_config={"num_slots": 4, "save_dtype": "bfloat16"})
    cfg = args.megatrain_base_config()
    assert (cfg.num_slots, cfg.loss_chunk_tokens, cfg.save_dtype, cfg.micro_batch_size) == (4, 48, "bfloat16", 2)
    assert cfg.key_sources == {"loss_chunk_tokens": f"env MEGATRAIN_CONFIG={y}", "num_slots": "megatrain_config (a dict)",
                               "save_dtype": "megatrain_config (a dict)",
                               "micro_batch_size": "env MEGATRAIN_MICRO_BATCH_SIZE"}
    conflict = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(conflict) == 1 and "num_slots=4 from megatrain_config (a dict) overrides num_slots=3 from env " \
        f"MEGATRAIN_CONFIG={y}" in conflict[0].getMessage()
    assert any(r.levelno == logging.INFO and "loss_chunk_tokens" in r.getMessage() for r in caplog.records)
    source = args.megatrain_config_source(torch.float32)
    assert f"env MEGATRAIN_CONFIG={y}: loss_chunk_tokens" in source and "overrides num_slots=3" in source


@pytest.mark.slow  # subprocess: megatrain launch -> accelerate launch -> examples/train.py
def test_megatrain_launch_keeps_the_section_when_the_script_passes_a_config(tmp_path):
    import subprocess

    from tests.test_cli import SMALL, child_env

    y = tmp_path / "combined.yaml"
    y.write_text(COMBINED)
    r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "launch", "--config", str(y), "examples/train.py",
                        *SMALL, "--max_steps", "1", "--output_dir", str(tmp_path / "o"),
                        "--megatrain_config", '{"micro_batch_size": 1, "num_slots": 4}'],
                       cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if "effective MegaTrainConfig" in x)
    for frag in ("loss_chunk_tokens=48", "micro_batch_size=1", "num_slots=4"):  # the yaml's and the script's
        assert frag in line, line
    assert "num_slots=4 from megatrain_config (JSON) overrides num_slots=3" in r.stdout + r.stderr


# -- item 9: the run summary's words, its log level, its file; "did you mean" ----------------------------------------
def test_run_summary_says_float32_no_gpu_at_info_and_is_not_uploaded(tmp_path, monkeypatch, caplog):
    """A float32 checkpoint loaded with from_pretrained_streamed (what examples/train.py does) on a CPU run: the
    summary names float32 (not "None"), speaks of no GPU placement, is logged at INFO, and its file stays in
    output_dir but out of what push_to_hub uploads."""
    import json
    import logging

    import datasets
    import huggingface_hub
    import transformers.utils.hub as hf_hub_utils

    from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments, from_pretrained_streamed

    from .hubstub import HubStub
    from .models import tiny

    _clean_env(monkeypatch)
    tiny("llama").save_pretrained(str(tmp_path / "ckpt"))  # float32
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(0)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    with HubStub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(hf_hub_utils, "_hf_api", None)  # transformers' shared HfApi picks up the endpoint
        monkeypatch.setenv("HF_TOKEN", "hf_local_stub")
        out = tmp_path / "run"
        args = MegaTrainTrainingArguments(output_dir=str(out), max_steps=1, use_cpu=True, report_to=[],
                                          per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
                                          push_to_hub=True, hub_model_id="user/tiny-run")
        model = from_pretrained_streamed(str(tmp_path / "ckpt"), device="cpu",
                                         config=args.megatrain_resolved_config(model_dtype=torch.float32))
        trainer = MegaTrainTrainer(model=model, args=args, train_dataset=data)
        with caplog.at_level(logging.DEBUG, logger="hf_megatrain.hf.trainer"):
            trainer.train()
        trainer.push_to_hub()
    records = [r for r in caplog.records if r.getMessage().startswith("hf_megatrain: ")
               and "parameters" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    text = records[0].getMessage()
    assert "None" not in text and "compute dtype float32" in text, text
    placement = next(line for line in text.splitlines() if "placement:" in line)
    assert placement.strip() == "placement: no GPU in this run: 3 decoder layers and AdamW on the CPU", text
    summary = json.loads((out / "_megatrain_run.json").read_text())
    assert summary["compute_dtype"] == "float32" and "None" not in summary["config_source"]
    uploaded = set(hub.repos["user/tiny-run"])
    assert "config.json" in uploaded and not [f for f in uploaded if "megatrain_run" in f], uploaded


def test_unknown_keys_say_did_you_mean(tmp_path, monkeypatch):
    from hf_megatrain import MegaTrainTrainingArguments

    _clean_env(monkeypatch)
    with pytest.raises(ValueError, match=r"'num_slot' \(did you mean 'num_slots'\?\).*valid keys"):
        MegaTrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                   megatrain_config={"num_slot": 3})
    monkeypatch.setenv("MEGATRAIN_MICRO_BATCH", "1")
    with pytest.raises(ValueError, match=r"MEGATRAIN_MICRO_BATCH;.*did you mean 'MEGATRAIN_MICRO_BATCH_SIZE'"):
        MegaTrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])


def test_docs_say_what_the_code_does():
    """The shipped accelerate yaml does not claim a bf16 default, the example's docstring and the README give the
    same time for the default job, and the README's MFU says what peak it is against."""
    import re

    yaml_text = (ROOT / "examples" / "megatrain.yaml").read_text()
    assert "bf16 by default" not in yaml_text and "the model's dtype" in yaml_text
    readme = (ROOT / "README.md").read_text()
    seconds = re.search(r"(\d+) s wall on a 2-core CPU", readme).group(1)
    doc = example().__doc__
    assert f"{seconds} s" in doc and "~1 minute" not in doc
    perf = readme[readme.index("## Performance"):readme.index("## Supported models")]
    assert "MFU" in perf and "800 TFLOP/s" in perf
