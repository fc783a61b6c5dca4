"""integration/full_width_layers.py: its CPU smoke (the GPU check's code at small widths, fp32, tolerance 1e-5) runs
two named configs end to end, and its full-width configs keep every width of the Hub config (meta device only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from integration import full_width_layers as fwl  # noqa: E402


def test_tiny_smoke_matches_for_two_configs(tmp_path):
    """A dense model and an MoE with attention sinks, biases and sliding windows: the plain model and the engine
    (every layer streamed) agree on loss, the first layer's input gradient and every parameter gradient."""
    code = fwl.main(["--tiny", "--models", "mistral-large-2,gpt-oss-120b", "--layers", "1", "--seq", "16",
                     "--out", str(tmp_path)])
    assert code == 0
    for model in ("mistral-large-2", "gpt-oss-120b"):
        rec = json.loads((tmp_path / f"{model}_cpu_tiny.json").read_text())
        assert rec["status"] == "ok" and rec["match"], rec.get("error") or rec.get("checks")
        assert rec["tolerances"]["grad"] == 1e-5 and rec["command"].startswith("python integration/")
        assert rec["loss"]["rel"] <= 1e-5 and rec["input_grad"]["rel"] <= 1e-5
        judged = [v for v in rec["grads"].values() if v.get("rel") is not None]
        assert len(judged) == len(rec["grads"]) > 5  # every parameter compared
        assert len(rec["layer_visit_total_s"]) == 1 and rec["versions"]["torch"]
    summary = json.loads((tmp_path / "summary_cpu_tiny.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["ok", "ok"]


def test_full_width_config_keeps_every_width():
    """Cut to one layer and a 32k vocabulary, gpt-oss-120b keeps its widths and all 128 experts; the token ids that
    would fall outside the cut vocabulary are moved inside it (an embedding's padding row must exist)."""
    values = fwl.config_values("gpt-oss-120b", 1, 32768, tiny=False)
    assert (values["hidden_size"], values["num_local_experts"], values["num_attention_heads"]) == (2880, 128, 64)
    assert values["num_hidden_layers"] == 1 and values["layer_types"] == ["sliding_attention"]
    assert values["vocab_size"] == 32768 and values["pad_token_id"] is None and values["eos_token_id"] < 32768
    scout = fwl.config_values("llama-4-scout", 2, 32768, tiny=False)["text_config"]
    assert scout["num_hidden_layers"] == 2 and scout["moe_layers"] == [0, 1] and len(scout["no_rope_layers"]) == 2
    assert scout["hidden_size"] == 5120 and scout["num_local_experts"] == 16


def test_relative_error_is_chunked_and_exact():
    a, b = torch.randn(1000), torch.randn(1000)
    r, norm = fwl.rel_error(a, b, torch.device("cpu"), chunk=64)
    assert abs(r - float((a.double() - b.double()).norm() / b.double().norm())) < 1e-12
    assert abs(norm - float(b.double().norm())) < 1e-9
