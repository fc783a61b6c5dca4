"""Compiled layers take any sequence length (issue 31, "no recompile storms"): with ``torch_compile=True`` the batch
and token dimensions are dynamic (core/compiling.py), so batches of many lengths -- padded to their longest, or packed
rows of varying total -- run a bounded number of graphs, with the same results as eager; and a hit recompile limit
is never a silent fall back to eager."""

from __future__ import annotations

import copy
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import DataCollatorWithFlattening

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.core import compiling
from hf_megatrain.core.compiling import CompiledCall

from .models import tiny
from .parity import rel, run_parity

LENGTHS = [12, 20, 9, 33, 17]  # one per step: every step a length no earlier step had


def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # graphs other tests compiled (other shapes, other models) would hide or add counts
    counters.clear()


@pytest.mark.slow  # (8 s with a warm inductor cache, ~60 s cold on 2 cores)
def test_compiled_layers_train_every_length_with_bounded_graphs():
    """Five steps, five lengths: exact against plain HF within the compiled parity bound (1e-4, as
    test_core_parity.test_parity_compiled_layers), and three graphs in all -- the layer's forward (no grad), its
    recompute (grad) and the loss chunk -- where one graph per shape made 14 and hit the recompile limit."""
    _fresh_dynamo()
    cfg = MegaTrainConfig(compute_dtype="float32", torch_compile=True)
    worst, engine, _ = run_parity(tiny("qwen2"), ga=1, steps=len(LENGTHS), seq=LENGTHS, config=cfg, tol=1e-4)
    assert all(t.compiled is not None and t.compiled.limit_hits == 0 for t in engine.executor.templates)
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


def _packed(lengths: tuple[int, ...], vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
    return DataCollatorWithFlattening()([{"input_ids": s, "labels": s} for s in seqs])


@pytest.mark.slow  # (~30 s: inductor compiles on CPU)
def test_compiled_packed_rows_of_varying_total_reuse_one_graph():
    """Packed rows (DataCollatorWithFlattening: one row, position_ids restarting, no mask) of three different
    totals, trained compiled and eager side by side: losses, gradients and updated weights agree, and no graph is
    made after the first row's."""
    _fresh_dynamo()
    model = tiny("llama")
    engines = [MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32", torch_compile=c),
                               device="cpu") for c in (False, True)]
    opts = [e.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0) for e in engines]
    names = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight")
    graphs = []
    for step, lengths in enumerate([(5, 9, 7), (11, 3, 6, 4), (8, 13)]):
        batch = _packed(lengths, model.config.vocab_size, step)
        losses = []
        for engine in engines:
            loss = engine(**batch).loss
            loss.backward()
            engine.finish_backward()
            losses.append(loss.detach())
        assert rel(losses[1], losses[0]) <= 1e-5
        for n in names:
            g = [opt.grad_of(e.store.by_name[n][0]) for e, opt in zip(engines, opts)]
            ps = engines[0].store.by_name[n][1]
            assert rel(engines[1].store.by_name[n][0].view(g[1], ps), engines[0].store.by_name[n][0].view(g[0], ps)
                       ) <= 1e-4, n
        for opt in opts:
            opt.step()
            opt.wait()
            opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    for n in names:
        assert rel(engines[1].store.master_tensor(n), engines[0].store.master_tensor(n)) <= 1e-4, n
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs


def test_recompile_limit_is_never_a_silent_fall_back(monkeypatch):
    """One graph per shape (compiling.DYNAMIC_SHAPES = False) and recompile_limit=1: the second shape would be
    run eagerly by dynamo in silence; here it runs eagerly with one warning naming the limit, the results are the
    function's, and the first shape still runs its graph."""
    _fresh_dynamo()
    monkeypatch.setattr(compiling, "DYNAMIC_SHAPES", False)
    warned: list[str] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * x.sum(-1, keepdim=True)

    call = CompiledCall(f, f, "toy", warned.append)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (3, 5, 7, 3):
            x = torch.randn(2, n)
            assert torch.allclose(call(x), f(x), rtol=1e-6, atol=1e-6)
    assert call.limit_hits == 2 and len(warned) == 1 and "recompile_limit (1)" in warned[0]
    assert counters["stats"]["unique_graphs"] == 1


def _padded(shapes: list[tuple[int, int]], vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches (as DataCollatorWithPadding makes them): every batch has one full-width row and some
    padded ones, so each carries an attention mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, width in shapes:
        lens = torch.randint(2, width, (rows,), generator=g)
        lens[0] = width
        mask = (torch.arange(width)[None] < lens[:, None]).long()
        ids = torch.randint(4, vocab, (rows, width), generator=g) * mask
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


# (rows, width): the fine-tune benchmark's padded steps scaled down -- rows and width both change every step, and
# the widths cover every residue mod 8 class that a stride-alignment guard would split on (odd, 2, 4, 0 mod 8).
PADDED_SHAPES = [(13, 31), (6, 42), (4, 60), (2, 64), (3, 37), (7, 20), (5, 48), (2, 51)]


@pytest.mark.slow  # (~25 s: inductor compiles on CPU)
def test_compiled_padded_batches_of_every_shape_reuse_the_first_graphs():
    """Padded batches of a new (rows, width) every step, with padding masks, trained compiled and eager side by
    side: the losses and gradients agree, and after the first step no graph is made (the 16.9 s step of
    session 12 was a recompile for a width of another alignment class)."""
    _fresh_dynamo()
    model = tiny("qwen2")
    engines = [MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32", torch_compile=c),
                               device="cpu") for c in (False, True)]
    opts = [e.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0) for e in engines]
    graphs = []
    for batch in _padded(PADDED_SHAPES, model.config.vocab_size, 0):
        losses = []
        for engine in engines:
            loss = engine(**batch).loss
            loss.backward()
            engine.finish_backward()
            losses.append(loss.detach())
        assert rel(losses[1], losses[0]) <= 1e-5
        n = "model.layers.1.mlp.down_proj.weight"
        g = [opt.grad_of(e.store.by_name[n][0]) for e, opt in zip(engines, opts)]
        ps = engines[0].store.by_name[n][1]
        assert rel(engines[1].store.by_name[n][0].view(g[1], ps), engines[0].store.by_name[n][0].view(g[0], ps)) <= 1e-4
        for opt in opts:
            opt.step()
            opt.wait()
            opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert all(t.compiled is not None and t.compiled.limit_hits == 0 for t in engines[1].executor.templates)
    assert 1 <= graphs[0] <= 4 and graphs[-1] == graphs[0], graphs


def test_alignment_check_never_guards_on_symbolic_sizes():
    """compile_fn replaces inductor's SDPA-bias alignment check by one that answers from static knowledge only:
    inside it ``guard_or_false`` is ``statically_known_true`` (no guard, so no recompile per width class), and
    outside it the size-variable object is untouched. Installed once: a second compile_fn keeps it."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    compiling.compile_fn(lambda x: x)
    patched = ir.is_aligned_realized_tensor
    assert patched.__module__ == compiling.__name__
    compiling.compile_fn(lambda x: x)
    assert ir.is_aligned_realized_tensor is patched
    calls: list[str] = []

    class SizeVars:
        def guard_or_false(self, expr):
            calls.append("guard")
            return True

        def statically_known_true(self, expr):
            calls.append("static")
            return False

    class Graph:
        sizevars = SizeVars()

    def probe(x, alignment):  # stands for inductor's check: it asks the size variables once
        return V.graph.sizevars.guard_or_false(x % alignment == 0)

    import sympy
    monkey = pytest.MonkeyPatch()
    try:  # compile_fn wraps what inductor has: here the probe
        monkey.setattr(ir, "is_aligned_realized_tensor", probe)
        compiling.compile_fn(lambda x: x)
        assert ir.is_aligned_realized_tensor is not probe
        with V.set_graph_handler(Graph()):
            assert ir.is_aligned_realized_tensor(sympy.Symbol("s", positive=True, integer=True), 8) is False
            assert V.graph.sizevars.guard_or_false(True) is True  # (restored after the call)
    finally:
        monkey.undo()
    assert calls == ["static", "guard"], calls
