"""integration/full_32b.py: CPU smoke of the 32B run script at tiny width (train through MegaTrainTrainer, save,
reload with plain from_pretrained, every tensor verified), and its planner verdicts."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

import full_32b  # noqa: E402

GIB = 2 ** 30


@pytest.mark.slow  # subprocesses: training, then the reload
def test_tiny_run_trains_saves_and_reloads(tmp_path):
    assert full_32b.main(["--tiny", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "full_32b_cpu_tiny.json").read_text())
    assert (tmp_path / "full_32b_cpu_tiny.md").exists()
    train, reload = doc["train"], doc["reload"]
    assert train["status"] == "ok", train.get("error")
    assert reload["status"] == "ok", reload.get("error")
    assert doc["acceptance"]["trained"] and doc["acceptance"]["reload_verified"]
    assert len(train["step_times_s"]) == 2 and len(train["losses"]) == 3 and train["loss_finite"]
    assert train["tokens_per_step"] == 4 * 64 and train["megatrain_config"]["micro_batch_size"] == 2
    assert train["saved_shards"] >= 1 and train["save_s"] > 0
    assert reload["tensors_compared"] == train["master_tensors"] == 2 * 12 + 3  # untied: embed, norm, lm_head
    assert reload["loaded_dtype"] == "torch.float32" and not reload["mismatched"]
    for key in ("tokens_per_s", "model_tflops", "mfu", "train_vm_hwm_gib", "host_rss_over_planner", "planner"):
        assert train[key] is not None, key
    assert not (tmp_path / "full_32b_checkpoint").exists()  # removed unless --keep-checkpoint


def test_prediction_verdicts_and_depth():
    spec = full_32b.make_spec(full_32b.parse_args(["--tiny"]))
    row = full_32b.prediction_row(spec, 64 * GIB, None, "cpu", 0)
    assert row["verdict"] == "fits" and row["fits_host"] and row["host_total_bytes"] > 0
    small = full_32b.prediction_row(spec, row["host_total_bytes"] // 2, None, "cpu", 0)
    assert small["verdict"] == "does not fit: host"
    # The deepest tiny model under a host that holds two layers' plan but not three's.
    two = full_32b.plan_for({**spec, "layers": 2}, "cpu", None).host_total
    three = full_32b.plan_for({**spec, "layers": 3}, "cpu", None).host_total
    avail = int((two + three) / 2 / spec["host_fraction"]) + 1
    assert two < three and full_32b.deepest(spec, avail, None, "cpu", 0, cap=8) == 2
