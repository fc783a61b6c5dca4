"""Saved graphs (``saved_graph_layers``): the last layers keep their forward's graph and skip the recompute.

CPU, fp32, against plain HF with torch AdamW (tests/parity.py), and against the same engine recomputing every
layer (the same operations: the same bits). The recompute is observed through the layer templates' modules: a
forward hook counts each call of a layer kind's module (forward + recompute).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.planner import SAVED_GRAPH_MARGIN, saved_graph_count

from .models import tiny
from .parity import rel, run_parity


def _count_calls(engine: MegaTrainEngine) -> list[int]:
    calls = [0]
    for t in engine.executor.templates:
        t.module.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_saved_graph_layers_train_like_plain_hf(family):
    cfg = MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2)
    worst, engine, _ = run_parity(tiny(family, num_hidden_layers=4), config=cfg)
    assert engine.executor.graph_layers == frozenset({2, 3})


def test_saved_graphs_skip_the_recompute_and_change_no_bit():
    model = tiny("llama", num_hidden_layers=4)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    results = {}
    for k in (0, 3):
        engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32",
                                                                       saved_graph_layers=k), device="cpu")
        opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
        calls = _count_calls(engine)
        for _ in range(2):
            engine(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        engine.wait_updates()
        results[k] = (calls[0], {n: t.clone() for n, t in engine.named_master_tensors()})
    assert results[0][0] == 2 * (4 + 4)  # two steps: every layer's forward and its recompute
    assert results[3][0] == 2 * (4 + 1)  # the last three layers are not run again
    for name, w in results[0][1].items():
        assert torch.equal(w, results[3][1][name]), name


def test_saved_graphs_with_accumulation_moe_and_clipping_steps():
    """Gradient accumulation (several forwards' graphs alive at once), an MoE model's router logits (a side
    output of each layer that the aux loss differentiates through the kept graph), clipping on and off."""
    cfg = MegaTrainConfig(compute_dtype="float32", saved_graph_layers=1)
    run_parity(tiny("mixtral"), config=cfg, ga=2, steps=3, clip_schedule=[1e6, 0.3, 1e6])


def test_a_split_visit_or_a_stochastic_layer_recomputes():
    cfg = MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2, micro_batch_size=1)
    worst, engine, _ = run_parity(tiny("llama", num_hidden_layers=3), config=cfg, ga=1, batch=2,
                                  split_in_layer=True)
    ids = torch.randint(0, 96, (2, 12))
    calls = _count_calls(engine)
    engine(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] == 2 * 3 * 2  # two chunks per visit, every layer recomputed
    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=2, attention_dropout=0.1),
                             MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2), device="cpu")
    calls = _count_calls(engine)
    engine(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] == 4  # dropout: recomputed with the forward's RNG, as before


def test_second_backward_through_a_kept_graph_recomputes():
    engine = MegaTrainEngine(tiny("qwen2"), MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2),
                             device="cpu")
    ids = torch.randint(0, 96, (1, 10))
    loss = engine(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    engine.finish_backward()
    first = engine.store.units[1].grad.clone()
    loss.backward()
    engine.finish_backward()
    assert rel(engine.store.units[1].grad, 2 * first) < 1e-6


def test_eval_forward_keeps_nothing():
    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=2),
                             MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2), device="cpu")
    calls = _count_calls(engine)
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)
    engine.model.eval()  # (an evaluation loop with grad enabled)
    engine(input_ids=ids, labels=ids)
    assert calls[0] == 4


def test_count_rule():
    cfg = MegaTrainConfig(saved_graph_layers=-1)
    gib = 1 << 30
    kw = dict(device_type="cuda", split=False, offloaded=0, budget=80 * gib, planned_peak=40 * gib,
              per_layer=5 * gib)
    spare = (1 - SAVED_GRAPH_MARGIN) * 80 - 40
    assert saved_graph_count(cfg, 48, **kw) == int(spare // 5)
    assert saved_graph_count(cfg, 3, **kw) == 3  # at most every layer
    assert saved_graph_count(cfg, 48, **{**kw, "planned_peak": 79 * gib}) == 0
    assert saved_graph_count(cfg, 48, **{**kw, "offloaded": 2}) == 0  # the GPU is short already
    assert saved_graph_count(cfg, 48, **{**kw, "split": True}) == 0
    assert saved_graph_count(cfg, 48, **{**kw, "device_type": "cpu"}) == 0
    assert saved_graph_count(MegaTrainConfig(saved_graph_layers=0), 48, **kw) == 0
    assert saved_graph_count(MegaTrainConfig(saved_graph_layers=60), 48, **kw) == 48
    with pytest.raises(ValueError, match="saved_graph_layers"):
        MegaTrainConfig(saved_graph_layers=-2)


@pytest.mark.parametrize("over", [dict(lean_store=True), dict(device_step_layers=1, device_step_state="host"),
                                  dict(activation_offload="on")])
def test_saved_graphs_beside_other_modes(over):
    """The lean store (a clipping step re-runs its forward+backward, each keeping its graphs), host-state GPU
    stepping, and offloaded layer inputs (an explicit count keeps graphs of layers whose input is not offloaded:
    none here, every input is)."""
    cfg = MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2, **over)
    run_parity(tiny("qwen2", num_hidden_layers=3), config=cfg, ga=1, batch=2, steps=3,
               clip_schedule=[1e6, 0.3, 0.3])


def test_a_second_forward_before_the_backward_recomputes():
    """One forward's worth of graphs is what the planner fits: a second training forward before the backward
    (two losses summed) keeps none; both backwards are right, and the count returns to zero."""
    model = tiny("llama", num_hidden_layers=3)
    engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2),
                             device="cpu")
    calls = _count_calls(engine)
    a, b = torch.randint(0, 96, (1, 10)), torch.randint(0, 96, (1, 10))
    loss = engine(input_ids=a, labels=a).loss + engine(input_ids=b, labels=b).loss
    assert engine.executor.live_graphs == 2
    loss.backward()
    engine.finish_backward()
    assert calls[0] == 3 + 3 + 1 + 3  # forwards, then the recompute of the first one's layer 0 and all of the second's
    assert engine.executor.live_graphs == 0
    ref = copy.deepcopy(model)
    (ref(input_ids=a, labels=a).loss + ref(input_ids=b, labels=b).loss).backward()
    for i, unit in enumerate(engine.layer_units):
        expect = torch.cat([p.grad.flatten() for p in ref.model.layers[i].parameters()])
        assert rel(unit.grad, expect) < 1e-5


def test_a_kept_forward_prefetches_the_next_layer_after_its_compute():
    """As on the recomputed path: layer i+1 is loaded (which after a clipping step waits for its host update) only
    once layer i's compute is queued, so that wait runs beside it. Seen from inside each layer call: no later
    layer is in a slot yet."""
    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=4),
                             MegaTrainConfig(compute_dtype="float32", saved_graph_layers=4, device_layers=0,
                                             device_step_layers=0), device="cpu")
    slots, held_at_call = engine.executor.weights, []
    for t in engine.executor.templates:
        t.module.register_forward_hook(lambda *a: held_at_call.append({h[0] for h in slots.held if h is not None}))
    ids = torch.randint(0, 96, (1, 10))
    loss = engine(input_ids=ids, labels=ids).loss
    assert engine.executor.live_graphs == 4  # (every layer kept its graph, alive while the loss is)
    assert [max(h) for h in held_at_call] == [0, 1, 2, 3]
