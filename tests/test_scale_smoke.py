"""CPU smoke test of the 123B-width scaling script (integration/scale_123b.py): the plumbing, at tiny width.

On the H100 the script trains a few Mistral-Large-width layers and extrapolates to 88; here the same code runs a
tiny width on the CPU (two subprocess runs, layer-visit timers, fit, extrapolation, JSON + mirror), and the
layer-count planning is checked at full width on the meta device (nothing allocated).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

import scale_123b  # noqa: E402

GIB = 2 ** 30
FULL = {"tiny": False, "batch": 4, "seq": 4096, "host_fraction": 1.0, "megatrain_config": {}}


@pytest.mark.slow  # subprocess: two scaling runs
def test_tiny_run_writes_results(tmp_path):
    out, mirror = tmp_path / "out", tmp_path / "mirror"
    assert scale_123b.main(["--tiny", "--out", str(out), "--mirror", str(mirror)]) == 0
    path = out / "scale_123b_cpu_tiny.json"
    doc = json.loads(path.read_text())
    assert (mirror / path.name).exists() and (mirror / "logs" / "scale_123b_L3.log").exists()
    for key in ("command", "commit", "date", "versions", "machine", "spec", "layer_counts", "runs", "fit", "events_fit",
                "extrapolation"):
        assert key in doc, key
    assert doc["layer_counts"] == [3, 1] and doc["machine"]["mem_total_gib"] > 0
    runs = {r["layers"]: r for r in doc["runs"]}
    assert set(runs) == {1, 3}
    for layers, r in runs.items():
        assert r["status"] == "ok", r.get("error")
        assert len(r["step_times_s"]) == 3 and r["step_time_s"] > 0 and r["tokens_per_step"] == 2 * 64
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["vm_hwm_gib"] > 0
        assert r["n_params"] == scale_123b.count_params(doc["spec"], layers)
        assert set(r["setup"]) == {"model_build_s", "engine_build_s", "fill_layers_s", "sync_s"}
        assert r["planner"]["host_need_gib"] > 0 and r["planner"]["host_gib"]["master fp32"] > 0
        assert len(r["events"]["layer_forward_s"]) == layers and r["events"]["per_layer_s"] > 0
        assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in r["steps"])
    fit = doc["fit"]
    assert fit["points"] == [[1, runs[1]["step_time_s"]], [3, runs[3]["step_time_s"]]]
    assert fit["intercept_s"] + 3 * fit["per_layer_s"] == pytest.approx(runs[3]["step_time_s"])
    x = doc["extrapolation"]
    assert x["layers"] == 88 and x["method"] == fit["method"]
    assert x["step_time_s"] == pytest.approx(fit["intercept_s"] + 88 * fit["per_layer_s"])
    assert x["n_params"] == scale_123b.count_params(doc["spec"], 88)
    assert x["planner"]["host_need_gib"] > 0 and x["gpu"]["measured_at_layers"] == 3
    assert doc["extrapolation_from_events"]["method"] == doc["events_fit"]["method"]
    assert "| 3 |" in (out / "scale_123b_cpu_tiny.md").read_text()


def test_full_width_plan():
    """Mistral Large 2 at 88 layers is ~122.6B parameters at ~18 B/param of host RAM; 123 GiB holds 4 layers."""
    assert scale_123b.count_params(FULL, 88) == pytest.approx(122.6e9, rel=1e-3)
    layers, table = scale_123b.auto_layers(FULL, 123 * GIB, 8 * GIB, "cuda", 79 * GIB, 88)
    assert layers == 4 and [r["fits"] for r in table] == [True] * 4 + [False]
    plan = scale_123b.plan_record(scale_123b.plan_for(FULL, 88, "cuda", 79 * GIB),
                                  scale_123b.count_params(FULL, 88))
    assert 17.5 < plan["host_bytes_per_param"] < 18.5
    with pytest.raises(SystemExit, match="not even one layer"):
        scale_123b.auto_layers(FULL, 10 * GIB, 8 * GIB, "cuda", 79 * GIB, 88)


def test_fit_uses_finished_runs_only():
    runs = [{"layers": 4, "status": "ok", "step_time_s": 5.0}, {"layers": 2, "status": "ok", "step_time_s": 3.0},
            {"layers": 3, "status": "error"}]
    line = scale_123b.fit(runs)
    assert line["per_layer_s"] == pytest.approx(1.0) and line["intercept_s"] == pytest.approx(1.0)
    assert scale_123b.fit(runs[:1]) is None
    assert scale_123b.out_of_memory({"error": "exited with code -9", "returncode": -9})
    assert not scale_123b.out_of_memory({"error": "ValueError: bad"})
