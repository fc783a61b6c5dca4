"""The family table of docs/families.md is what integration/family_table.py renders from the sweep's JSONL (no
drift), and the sweep's null-gradient criterion (integration/family_sweep.py ``_compare``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from integration import family_sweep, family_table  # noqa: E402


def test_readme_table_matches_sweep_results():
    text = family_table.DOC.read_text()
    block = text.split(family_table.START, 1)[1].split(family_table.END, 1)[0]
    assert block.strip("\n") == family_table.render(family_table.load()), \
        "docs/families.md's family table is stale: run python integration/family_table.py"


def test_table_lists_every_family_once():
    recs = family_table.load()
    table = family_table.render(recs)
    summary = table.split("| model type | status | why |")[0]
    for r in recs:
        assert summary.count(f"`{r['family']}`") == 1, r["family"]
    counts = {line.split(" | ")[0][2:]: int(line.split(" | ")[1]) for line in summary.splitlines()
              if line.startswith("| ") and line.split(" | ")[1].isdigit()}
    assert sum(counts.values()) == len(recs)


def _run(grads, weights):
    return [[torch.tensor(1.0, dtype=torch.float64)]] * len(grads), grads, weights


def test_null_gradient_moves_within_its_noise_only():
    # a parameter whose true gradient is zero (1e-10: rounding noise) next to a real one; Adam turns the noise into
    # ~|g|/eps = 1e-2 of a step, so runs with different noise may differ by that much, not by a weight-decay step
    real, lr = torch.ones(4), 1e-3
    ref = _run([{"w": real, "z": torch.full((4,), 1e-10)}], [{"w": real, "z": torch.zeros(4)}])
    ok = _run([{"w": real, "z": torch.full((4,), 2e-10)}], [{"w": real, "z": torch.full((4,), 0.01 * lr)}])
    bad = _run([{"w": real, "z": torch.full((4,), 2e-10)}], [{"w": real, "z": torch.full((4,), 0.2 * lr)}])
    assert family_sweep._compare(ok, ref, lr)["null_grad_excess"] <= 1.0
    assert family_sweep._compare(bad, ref, lr)["null_grad_excess"] > 1.0
    # a real gradient where the reference has none is a gradient error, not noise
    wrong = _run([{"w": real, "z": torch.full((4,), 1e-2)}], [{"w": real, "z": torch.zeros(4)}])
    assert family_sweep._compare(wrong, ref, lr)["grad"] > 1.0


def test_null_gradient_elements_move_within_their_noise_only():
    # a parameter with a real gradient in some entries and only rounding noise (1e-10) in others (DeepSeek-V4's
    # hyper-connection 'pre' entries): the noisy entries are held to what their noise allows, the rest relative
    lr, t = 1e-3, torch.tensor
    ref = _run([{"w": t([1.0, 1.0, 1e-10, 1e-10])}], [{"w": t([1.0, 1.0, 0.0, 0.0])}])
    ok = _run([{"w": t([1.0, 1.0, 2e-10, -1e-10])}], [{"w": t([1.0, 1.0, 0.01 * lr, -0.01 * lr])}])
    bad = _run([{"w": t([1.0, 1.0, 2e-10, -1e-10])}], [{"w": t([1.0, 1.0, 0.2 * lr, 0.0])}])
    off = _run([{"w": t([1.0, 1.0, 2e-10, -1e-10])}], [{"w": t([1.0, 1.1, 0.0, 0.0])}])
    assert family_sweep._compare(ok, ref, lr)["weight"] == 0.0
    assert family_sweep._compare(ok, ref, lr)["null_grad_excess"] <= 1.0
    assert family_sweep._compare(bad, ref, lr)["null_grad_excess"] > 1.0
    assert family_sweep._compare(off, ref, lr)["weight"] > 0.05
