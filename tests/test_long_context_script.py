"""integration/long_context.py: CPU smoke of the run script (tiny width, short sequence) and its search rule."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

import long_context  # noqa: E402


@pytest.mark.slow  # subprocess: one training run
def test_tiny_run_writes_results(tmp_path):
    cfg = json.dumps({"activation_offload": "on", "seq_chunk_tokens": 64})
    assert long_context.main(["--tiny", "--seq", "256", "--steps", "2", "--out", str(tmp_path),
                              "--megatrain-config", cfg]) == 0
    doc = json.loads((tmp_path / "long_context_cpu_tiny.json").read_text())
    (run,) = doc["runs"]
    assert run["status"] == "ok", run.get("error")
    assert run["loss_finite"] and run["offloaded_layers"] == 3 and run["seq_chunk_tokens"] == 64
    assert run["activation_d2h_gb"] == run["activation_h2d_gb"] > 0
    assert len(run["steps"][-1]["layer_backward_s"]) == 3 and run["per_layer_backward_s"] > 0
    assert run["flops_per_token"]["attention"] == 12 * 3 * 64 * 256
    for key in ("planner", "vm_hwm_gib", "host_hwm_over_planner", "model_tflops_with_attention", "step_time_s"):
        assert run[key] is not None, key


def test_search_doubles_then_bisects():
    step, cap = 32, 1024
    assert long_context.next_search({256: True}, step, cap) == 512
    assert long_context.next_search({256: True, 512: False}, step, cap) == 384
    assert long_context.next_search({256: True, 512: False, 384: True}, step, cap) == 448
    assert long_context.next_search({256: True, 288: False}, step, cap) is None  # adjacent: done
    assert long_context.next_search({256: False}, step, cap) == 128
    assert long_context.next_search({1024: True}, step, cap) is None  # the cap trained
    assert long_context.next_search({32: False}, step, cap) is None  # not even one step
