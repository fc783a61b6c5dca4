"""integration/dp_resume.py (an N-process checkpoint resumed with M processes, through MegaTrainTrainer) end to end on
the CPU with gloo: pairs 2:1 and 1:2 against one process uninterrupted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # spawns 1 + 2 + 1 + 2 processes (~30 s on 2 cores)
def test_dp_resume_script_cpu(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "integration", "dp_resume.py"), "--cpu", "--pairs",
                          "2:1,1:2", "--out", str(tmp_path), "--work", str(tmp_path), "--shm", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    res = json.load(open(tmp_path / "dp_resume.json"))
    assert res["passed"] and res["backend"] == "gloo" and [p["pair"] for p in res["pairs"]] == ["2:1", "1:2"]
    for p in res["pairs"]:
        assert p["passed"] and p["worst_rel"] <= 1e-5, p
        assert p["loss_rel_steps_3_4"] <= 1e-5 and p["grad_norm_rel_steps_3_4"] <= 1e-5, p
        assert p["uninterrupted_vs_1proc"]["2proc"] <= 1e-5, p
    assert min(res["reference_grad_norms"]) > res["max_grad_norm"]  # (every step clipped)
    assert (tmp_path / "dp_resume.md").exists()
    assert [d for d in os.listdir(tmp_path) if d.startswith(("dp_resume_", "megatrain-"))] == []  # (cleaned up)
