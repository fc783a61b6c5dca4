"""The family parity sweep (integration/family_sweep.py, issue 16) on two small families: one subprocess each,
a JSON line each with the documented schema, both ``pass`` against plain HF + torch.optim.AdamW."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_sweep_two_families_pass_with_schema(tmp_path):
    out = tmp_path / "sweep.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "integration", "family_sweep.py"),
                        "--families", "llama,gpt_neo", "--jobs", "2", "--timeout", "120", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert sorted(r["family"] for r in recs) == ["gpt_neo", "llama"]
    for r in recs:
        assert r["status"] == "pass", r
        assert r["model_class"] in ("LlamaForCausalLM", "GPTNeoForCausalLM")
        for key in ("error", "noise"):
            assert {"loss", "grad", "weight"} <= set(r[key])
            assert all(isinstance(v, float) and v >= 0 for v in r[key].values())
        assert r["tol"] >= 1e-5 and max(r["error"][k] for k in ("loss", "grad", "weight")) <= r["tol"]
        assert r["noise_method"] and r["params"] > 0 and r["wall_s"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| llama | `LlamaForCausalLM` | pass |" in md and "| gpt_neo | `GPTNeoForCausalLM` | pass |" in md
