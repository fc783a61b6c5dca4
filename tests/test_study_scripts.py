"""CPU smoke tests of the GPU study scripts: integration/precision_study.py (--tiny) and integration/bench_loss.py
(--quick): the plumbing and the output files, not the numbers (those come from the GPU machine)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

pytestmark = pytest.mark.slow


def test_precision_study_tiny(tmp_path):
    import precision_study

    result = precision_study.main(["--tiny", "--steps", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "precision_study.json").read_text())
    assert len(data["runs"]) == 9 and {r["system"] for r in data["runs"]} == set(precision_study.SYSTEMS)
    for r in data["runs"]:
        assert len(r["train_loss"]) == 2 and r["eval_loss"] and r["final_eval_loss"] > 0
    per = result["summary"]["per_system"]
    assert set(per) == set(precision_study.SYSTEMS) and all(len(v["values"]) == 3 for v in per.values())
    # the same initial weights and data: after two steps the three systems are within bf16 rounding
    assert abs(per["megatrain_lean"]["mean"] - per["hf_autocast_bf16"]["mean"]) < 0.01
    assert "Verdict" in (tmp_path / "precision_study.md").read_text()


def test_bench_loss_quick(tmp_path):
    import bench_loss

    out = tmp_path / "b.json"
    bench_loss.main(["--quick", "--impls", "chunked,liger,cce", "--json", str(out)])
    data = json.loads(out.read_text())
    impls = data["cases"][0]["impls"]
    assert impls["chunked"]["loss_rel_err"] < 1e-3 and impls["chunked"]["fwd_bwd_s"] > 0
    assert "CUDA" in impls["liger"]["skipped"] and "CUDA" in impls["cce"]["skipped"]
