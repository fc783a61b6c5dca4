"""The replicated gradients' mean over data-parallel ranks, on the CPU with gloo: the output head's started beside
the layers' backward (optim/adamw.py ``first_layer_gradient``, optim/ranks.py ``reduce_early``; none where the head
is tied to the embeddings), an embedding table's over the rows some rank touched (``_reduce_rows``). The same
weights as one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from hf_megatrain.optim.ranks import ranges_outside
from tests import dp_workers as W
from tests.parity import rel


def test_rest_is_the_complement_of_the_parts():
    flat = torch.zeros(10)
    assert ranges_outside(flat, []) == [(0, 10)]
    assert ranges_outside(flat, [flat[6:10]]) == [(0, 6)]
    assert ranges_outside(flat, [flat[2:4], flat[0:1]]) == [(1, 2), (4, 10)]
    assert ranges_outside(flat, [torch.zeros(3)]) == [(0, 10)]  # (another tensor's view: not a part of this one)


def run_final_steps(engine, opt, rank: int = 0, world: int = 1) -> list[int]:
    """W.run_steps with each step's last backward marked final (as Trainer marks it); how many head views each
    step reduced early."""
    data = W.batches()
    early = []
    for step in range(W.STEPS):
        micro = data[step]
        n_items = sum(int((labels != -100).sum()) for _, labels in micro)
        for k, (ids, labels) in enumerate(micro):
            engine.set_final_backward(k == len(micro) - 1)
            rows = slice(rank * W.BATCH // world, (rank + 1) * W.BATCH // world)
            out = engine(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items)
            (out.loss * world).backward()
        early.append(opt.early_reductions)
        opt.step()
        opt.zero_grad()
    return early


VOCAB = {"vocab_size": 2048}  # (an embedding table of >= ROWS_MIN rows; the batches use 96 of them)


def _worker(rank: int, world: int, tmp: str) -> None:
    """(a) the tiny llama: how many head views each step reduced early, the final weights; (b) with a 2048-row
    vocabulary, its embedding table reduced by rows and (ROWS_MIN out of reach) whole: both final weights."""
    import hf_megatrain.optim.ranks as ranks_module

    with W.ranks(rank, world, tmp) as dp:
        engine, opt = W.make_engine(dp, tmp)
        early = run_final_steps(engine, opt, rank, world)
        opt.wait()
        by_rows = {}
        for rows_min in (ranks_module.ROWS_MIN, 10 ** 9):
            ranks_module.ROWS_MIN = rows_min
            big, big_opt = W.make_engine(dp, tmp, model_over=VOCAB)
            run_final_steps(big, big_opt, rank, world)
            big_opt.wait()
            by_rows[rows_min] = (W.weights(big), list(big_opt.ranks.rows_reduced))
        # Two backwards of one step both marked final: refused, not averaged twice.
        ids, labels = W.batches()[0][0]
        rows = slice(rank * W.BATCH // world, (rank + 1) * W.BATCH // world)
        refused = ""
        for _ in range(2):
            engine.set_final_backward(True)
            try:
                engine(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=10).loss.backward()
            except RuntimeError as e:
                refused = str(e)
                break
        opt.zero_grad()
        torch.save((W.weights(engine), early, by_rows, refused), os.path.join(tmp, f"early_rank{rank}.pt"))


@pytest.mark.slow  # (spawns processes)
def test_replicated_gradients_reduced_early_and_by_rows_match(tmp_path):
    tmp = str(tmp_path)
    engine, opt = W.make_engine(None, tmp)
    assert engine.landing.early_names == {"lm_head.weight"}
    assert run_final_steps(engine, opt) == [0] * W.STEPS  # (one process: nothing to reduce)
    ref = W.weights(engine)
    mp.spawn(_worker, args=(2, tmp), nprocs=2, join=True)
    for rank in (0, 1):
        got, early, by_rows, refused = torch.load(os.path.join(tmp, f"early_rank{rank}.pt"))
        assert "marked as the step's last" in refused, refused
        assert early == [1] * W.STEPS  # (the head's view, started in each step's last backward)
        worst = max((rel(got[n], ref[n]), n) for n in ref)
        assert worst[0] <= 1e-5, worst
        (rows_w, rows), (whole_w, whole) = by_rows.values()
        # each step's embedding table reduced over the rows the two ranks' batches touched (<= 96 of 2048) ...
        assert len(rows) == W.STEPS and all(0 < k <= 96 and n == 2048 for k, n in rows), rows
        assert not whole
        # ... to the very values of the whole table's mean
        for n in whole_w:
            assert torch.equal(rows_w[n], whole_w[n]), n


def test_a_tied_head_is_not_reduced_early():
    from hf_megatrain import MegaTrainConfig, MegaTrainEngine
    from tests.models import tiny

    model = tiny("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # (tied: its gradient is final only at the end)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    assert engine.landing.early_names == frozenset()


def test_head_mean_starts_after_the_first_layer_gradients_collective():
    """The ranks' collectives run one after another on one communicator: the head's mean (GBs) issued before the
    first layer gradient's reduce-scatter would hold that gradient's landing behind it (engine/offload.py ``send``)."""
    import types

    from hf_megatrain.core.plan import Where
    from hf_megatrain.core.streams import StreamSet
    from hf_megatrain.engine.offload import GradientOffload

    calls: list[str] = []
    units = [types.SimpleNamespace(index=i, numel=4, plan=types.SimpleNamespace(grad=Where.HOST)) for i in (0, 1)]
    g = GradientOffload(units, types.SimpleNamespace(has_grad=lambda i: False), StreamSet(torch.device("cpu")),
                        device=torch.device("cpu"), compute_dtype=torch.float32, offload_dtype=torch.float32,
                        pin=False)
    g.route = [lambda k, unit, off, first: calls.append("layer collective")] * 2  # (where each gradient goes)
    g.attach(types.SimpleNamespace(first_layer_gradient=lambda: calls.append("head mean")))
    g.final_backward = True  # (the step's last backward: its first layer gradient starts the head's mean)
    g.send(1, 0)
    g.send(0, 1)
    assert calls == ["layer collective", "head mean", "layer collective"]
