"""``host_layout="auto"``: a model whose full store does not fit this host's RAM trains with the fastest exact lean
layout that fits, said at WARNING; the user's own layout keys, ``host_layout="full"`` and gradient accumulation keep
the full store (the fit check then refuses as before)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner
from hf_megatrain.planner.host_layout import auto_layout
from tests.models import tiny

GIB = 1 << 30


def _shape() -> planner.ModelShape:
    """A 1.3B-parameter Qwen2 shape (meta device: nothing allocated)."""
    from accelerate import init_empty_weights
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000)
    with init_empty_weights():
        return planner.ModelShape.from_model(Qwen2ForCausalLM(cfg))


GPU = 8 * GIB  # (a GPU that keeps few of the shape's layers: most stream, as a model beyond the GPU does)


def _host_total(shape: planner.ModelShape, cfg: MegaTrainConfig, device_type: str = "cuda") -> int:
    """The host plan's total, as the policy plans it."""
    gpu = GPU if device_type == "cuda" else None
    plans = planner.unit_plans(shape, cfg, device_type, gpu, host_free=1 << 50)
    return planner.estimate(shape, cfg, 2048, 8, device_type=device_type, gpu_free=gpu, plans=plans).host_total


def test_auto_takes_a_lean_layout_only_where_the_full_store_does_not_fit():
    shape, cfg = _shape(), MegaTrainConfig(compute_dtype="bfloat16")
    full = _host_total(shape, cfg)
    lean = _host_total(shape, MegaTrainConfig(compute_dtype="bfloat16", lean_store=True, lean_grad_plane="off"))
    assert lean < full
    between = int((full + lean) / 2 / cfg.host_memory_fraction)  # RAM for the lean store, not the full one
    out, note = auto_layout(shape, cfg, "cuda", GPU, between)
    assert out.lean_store and note and "host_layout='auto'" in note and "host_layout='full'" in note
    assert out.explicit_keys == cfg.explicit_keys  # (resolved: the run summary lists only what the user set)
    # The full store fits: unchanged.
    assert auto_layout(shape, cfg, "cuda", GPU, 4 * full) == (cfg, None)
    # The user chose: never overridden.
    for given in (MegaTrainConfig(compute_dtype="bfloat16", host_layout="full"),
                  MegaTrainConfig(compute_dtype="bfloat16", lean_store=False),
                  MegaTrainConfig(compute_dtype="bfloat16", lean_grad_plane="off")):
        assert auto_layout(shape, given, "cuda", GPU, between) == (given, None)
    # Gradient accumulation: the lean store takes one backward per step.
    assert auto_layout(shape, cfg, "cuda", GPU, between, grad_accum=2) == (cfg, None)
    # Nothing fits: unchanged (the engine's fit check refuses with what to change).
    assert auto_layout(shape, cfg, "cuda", GPU, lean // 4) == (cfg, None)


def test_host_layout_is_validated():
    with pytest.raises(ValueError, match="host_layout='lean'; use 'auto'"):
        MegaTrainConfig(host_layout="lean")


def test_engine_trains_with_the_chosen_layout_exactly_as_asked_for(monkeypatch, caplog):
    """Through the engine: with less RAM reported than the full store needs, it builds the lean store, says so at
    WARNING, and trains bit for bit as an engine given the same lean keys explicitly."""
    import hf_megatrain.engine.conversion_plan as cp

    model = tiny("llama")
    shape = planner.ModelShape.from_model(model)
    cfg = MegaTrainConfig(compute_dtype="float32")
    full = _host_total(shape, cfg, "cpu")
    monkeypatch.setattr(cp, "available_host_bytes", lambda: int(full / cfg.host_memory_fraction) - 1)
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        auto = MegaTrainEngine(tiny("llama"), cfg, device="cpu")
    assert auto.config.lean_store and auto.host_layout_note
    assert any("host_layout='auto'" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    keys = {k: getattr(auto.config, k) for k in ("lean_store", "lean_compute_copy", "lean_grad_plane")}
    asked = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", **keys), device="cpu")
    assert asked.host_layout_note is None
    losses = []
    for engine in (auto, asked):
        opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
        torch.manual_seed(0)
        run = []
        for _ in range(2):
            ids = torch.randint(0, engine.model.config.vocab_size, (2, 16))
            loss = engine(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss))
        losses.append(run)
    assert losses[0] == losses[1]
    for (n, a), (_, b) in zip(auto.named_master_tensors(), asked.named_master_tensors()):
        assert torch.equal(a, b), n
    # Gradient accumulation keeps the full store (and the fit check would then speak).
    ga = MegaTrainEngine(tiny("llama"), cfg, device="cpu", grad_accum=2)
    assert not ga.config.lean_store and ga.host_layout_note is None
