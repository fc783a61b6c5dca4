"""examples/: the embedded default job end to end, accelerate launch, the custom Accelerate loop, the assets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hf_megatrain.hf import default_job
from tests.test_cli import SMALL, child_env

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    return r


def first_last(stdout: str) -> tuple[float, float]:
    m = re.search(r"training loss: first ([\d.]+) -> last ([\d.]+)", stdout)
    assert m, stdout[-3000:]
    return float(m.group(1)), float(m.group(2))


def checkpoint(stdout: str) -> str:
    m = re.search(r"\[train.py\] checkpoint: (\S+)", stdout)
    assert m, stdout[-3000:]
    return m.group(1)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The default job (no model/data arguments), fewer steps: the shipped tokenizer, corpus and tiny Llama."""
    out = tmp_path_factory.mktemp("default")
    r = run([sys.executable, "examples/train.py", "--max_steps", "40", "--eval_strategy", "no",
             "--max_eval_samples", "8", "--output_dir", str(out)])
    return r, out


@pytest.mark.slow  # subprocess: examples/train.py as a script
def test_default_job_trains_and_exports(default_run):
    r, out = default_run
    assert "compute_dtype='float32'" in r.stdout  # fp32 model, no --bf16: fp32 compute, as plain Trainer
    first, last = first_last(r.stdout)
    assert last < first - 1.0, (first, last)  # 40 steps at the default LR: from ~6.3 to well under 5
    ckpt = checkpoint(r.stdout)
    assert Path(ckpt) == out.resolve()
    # Plain transformers loads it: weights, config and tokenizer.
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert model.dtype == torch.float32 and len(tok) == model.config.vocab_size
    text = "Once upon a time, there was a little dog named Tom."
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        trained = model(input_ids=ids, labels=ids).loss
    fresh = default_job.build_model()
    with torch.no_grad():
        untrained = fresh(input_ids=ids, labels=ids).loss
    assert trained < untrained - 1.0
    metrics = json.loads((out / "all_results.json").read_text())
    assert "eval_perplexity" in metrics and 0.0 < metrics["eval_accuracy"] <= 1.0


@pytest.mark.slow  # subprocess: examples/train.py as a script
def test_finetune_from_local_checkpoint_and_own_files(default_run, tmp_path):
    """--model_name_or_path <dir> (streamed load) and --train_file/--validation_file (jsonl)."""
    _, ckpt = default_run
    rows = [{"text": line} for line in Path(default_job.data_files()["validation"]).read_text().splitlines()]
    for name, part in (("train.jsonl", rows[:40]), ("val.jsonl", rows[40:])):
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in part) + "\n")
    r = run([sys.executable, "examples/train.py", "--model_name_or_path", str(ckpt), "--train_file",
             str(tmp_path / "train.jsonl"), "--validation_file", str(tmp_path / "val.jsonl"), *SMALL,
             "--learning_rate", "1e-3", "--output_dir", str(tmp_path / "ft")])
    assert f"model: {ckpt}" in r.stdout
    first, _ = first_last(r.stdout)
    assert first < 5.5  # starts from the trained checkpoint, not from random init (~6.3)
    transformers.AutoModelForCausalLM.from_pretrained(checkpoint(r.stdout))


@pytest.mark.slow  # subprocess: accelerate launch
def test_accelerate_launch_with_example_config(tmp_path):
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]  # what the `accelerate launch` CLI runs
    r = run([*accelerate, "--config_file", "examples/megatrain.yaml", "examples/train.py", *SMALL,
             "--output_dir", str(tmp_path)])
    assert "effective MegaTrainConfig" in r.stdout and (tmp_path / "model.safetensors").is_file()


@pytest.mark.slow  # subprocess: examples/accelerate_loop.py as a script
def test_accelerate_loop_example(tmp_path):
    r = run([sys.executable, "examples/accelerate_loop.py", "--steps", "12", "--gradient_accumulation_steps", "2",
             "--output_dir", str(tmp_path)])
    m = re.search(r"loss: first ([\d.]+) -> last ([\d.]+); checkpoint: (\S+)", r.stdout)
    assert m, r.stdout[-2000:]
    assert float(m.group(2)) < float(m.group(1))
    transformers.AutoModelForCausalLM.from_pretrained(m.group(3))


def test_shipped_assets_are_reproducible():
    """The tokenizer is what `python -m hf_megatrain.hf.default_job --regenerate` builds from the shipped corpus."""
    corpus = default_job.generate_corpus(900, seed=0)
    assert Path(default_job.data_files()["train"]).read_text() == "\n".join(corpus) + "\n"
    rebuilt = json.loads(default_job.train_tokenizer(corpus).to_str())
    shipped = json.loads(default_job.TOKENIZER_FILE.read_text())
    assert rebuilt["model"] == shipped["model"]
    tok = default_job.load_tokenizer()
    assert len(tok) == default_job.VOCAB_SIZE and tok.eos_token == tok.pad_token == default_job.EOS
    assert default_job.tiny_llama_config(tok).vocab_size == len(tok)


def test_offline_accuracy_metric():
    import evaluate

    metric = evaluate.load(str(default_job.ACCURACY_METRIC))
    assert metric.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0]) == {"accuracy": 0.5}
