"""Every entry point takes a config the same way, and says what it decided.

- ``MegaTrainEngine`` takes what the Trainer, the plugin and ``from_pretrained_streamed`` take: a
  ``MegaTrainConfig``, a dict, a JSON string or a yaml path, read by the one resolution (unknown keys refused);
- the Trainer logs a start-of-training summary (precision, placement, host bytes, loss, optimizer, config source)
  and files it as ``_megatrain_run.json`` in ``output_dir`` (out of what push_to_hub uploads).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, MegaTrainTrainer, MegaTrainTrainingArguments
from hf_megatrain.engine.summary import format_summary, run_summary

from .models import tiny


@pytest.mark.parametrize("form", ["config", "dict", "json", "yaml"])
def test_engine_takes_every_config_form(tmp_path, form):
    keys = {"compute_dtype": "float32", "device_layers": 0, "micro_batch_size": 1}
    if form == "config":
        source = MegaTrainConfig(**keys)
    elif form == "dict":
        source = dict(keys)
    elif form == "json":
        source = json.dumps(keys)
    else:
        source = tmp_path / "megatrain.yaml"
        source.write_text("".join(f"{k}: {v}\n" for k, v in keys.items()))
        source = str(source)
    engine = MegaTrainEngine(tiny("llama"), source, device="cpu")
    assert engine.config.device_layers == 0 and engine.config.micro_batch_size == 1
    assert engine.compute_dtype == torch.float32
    assert set(keys) <= engine.config.explicit_keys


def test_engine_refuses_unknown_keys_and_reads_no_env(monkeypatch):
    with pytest.raises(ValueError, match="unknown MegaTrain config keys.*devce_layers"):
        MegaTrainEngine(tiny("llama"), {"devce_layers": 0}, device="cpu")
    monkeypatch.setenv("MEGATRAIN_MICRO_BATCH_SIZE", "3")  # for the launch-level entry points, not the engine
    assert MegaTrainEngine(tiny("llama"), None, device="cpu").config.micro_batch_size == 0


def test_engine_summary_says_what_was_decided():
    engine = MegaTrainEngine(tiny("llama"), {"compute_dtype": "float32", "device_layers": 0}, device="cpu")
    engine.create_optimizer(lr=1e-3, max_grad_norm=1.0)
    s = run_summary(engine, config_source="a test")
    assert s["compute_dtype"] == "float32" and s["layers"] == 3 and s["layers_stepped_on_host"] == 3
    assert s["trainable_parameters"] == engine.num_parameters() and s["host_bytes"] == engine.store.nbytes
    assert s["loss_impl"] == "chunked" and s["max_grad_norm"] == 1.0
    text = format_summary(s)
    assert "compute float32" in text and "from a test" in text
    assert "placement: no GPU in this run: 3 decoder layers and AdamW on the CPU" in text and "kept on the GPU" not in text


def _trainer(tmp_path, **over):
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (8, 12), generator=g).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    kw = dict(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[], per_device_train_batch_size=4,
              save_strategy="no", disable_tqdm=True)
    kw.update(over)
    return MegaTrainTrainer(model=tiny("llama"), args=MegaTrainTrainingArguments(**kw), train_dataset=data)


def test_trainer_files_and_logs_the_run_summary(tmp_path, caplog):
    trainer = _trainer(tmp_path, megatrain_config={"micro_batch_size": 2})
    with caplog.at_level(logging.INFO, logger="hf_megatrain"):
        trainer.train()
    with open(tmp_path / "_megatrain_run.json") as f:
        s = json.load(f)
    assert s["compute_dtype"] == "float32"  # a float32 model without bf16=True trains in float32, as plain Trainer
    assert "bf16 not set" in s["config_source"] and "megatrain_config (a dict)" in s["config_source"]
    assert s["micro_batch_size"] == 2 and s["versions"]["transformers"]
    assert any("compute float32" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # (spawns processes)
def test_import_does_not_pull_in_accelerate_or_the_trainer():
    import subprocess
    import sys

    code = ("import sys, hf_megatrain; print('accelerate' in sys.modules, 'transformers.trainer' in sys.modules); "
            "hf_megatrain.MegaTrainPlugin; print('accelerate' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]
