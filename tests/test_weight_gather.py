"""The training forward's weight loads by shards plus an all-gather (engine/weight_gather.py), on the CPU with gloo:
the same weights as whole copies, 1/N of the host reads, and the same collective sequence on every rank whatever
the ranks' slots hold or what one rank runs alone."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from hf_megatrain.core.plan import Where
from hf_megatrain.engine.weight_gather import WeightGather
from tests import dp_workers as W


def _gather(eligible: list[bool]) -> WeightGather:
    """A WeightGather over fake units: those marked eligible are shared host units with an fp32 compute source."""
    dp = SimpleNamespace(local_world=2, local_rank=0)
    units = [SimpleNamespace(numel=10, plan=SimpleNamespace(master=Where.HOST if ok else Where.DEVICE),
                             source=torch.zeros(10)) for ok in eligible]
    return WeightGather(units, dp, torch.float32)  # type: ignore[arg-type]


def test_a_pass_gathers_every_eligible_unit_once_in_order():
    g = _gather([True, False, True, True, True])
    assert g.order == [0, 2, 3, 4]
    assert g.due(0) == [] and g.end_pass() == []  # (no pass: nothing owed)
    g.begin_pass(True)
    assert g.due(0) == [0]
    assert g.due(0) == []  # (a second visit in one forward: a whole copy, no collective)
    assert g.due(1) == []  # (not eligible)
    assert g.due(3) == [2, 3]  # (reached out of order: the ones before it first)
    assert g.end_pass() == [4]  # (never reached: owed at the end)
    assert not g.active and g.due(4) == []
    g.begin_pass(False)  # evaluation / generation: no gathers
    assert g.due(0) == [] and g.end_pass() == []
    g.begin_pass(True)  # the next training forward owes them all again
    assert g.due(4) == [0, 2, 3, 4]


def _worker(rank: int, world: int, tmp: str) -> None:
    """Three steps with gathered loads and three without, same data: each rank's final weights and the bytes its
    forwards copied from host memory. Between the first two steps rank 0 alone runs a no-grad forward (a sample
    generation on the main process), which must make no collective; the third step skips the last two layers."""
    with W.ranks(rank, world, tmp) as dp:
        out = {}
        for gather in (True, False):
            engine, opt = W.make_engine(dp, tmp, weight_gather=gather)
            assert (engine.executor.weights.gather is not None) == gather
            W.run_steps(engine, opt, 0, 1, rank, world)
            if rank == 0:
                with torch.no_grad():
                    engine(input_ids=W.batches()[0][0][0][:1])
            W.run_steps(engine, opt, 1, 2, rank, world)
            # A step whose forward never reaches the last layers (as LayerDrop skips some): their gathers are owed
            # at the forward's end, on every rank alike.
            config = engine.model.config
            config.num_hidden_layers -= 2  # (the layer after the last one run is prefetched, so gathered, anyway)
            owed: list[int] = []
            if gather:
                g = engine.executor.weights.gather
                real_end = g.end_pass
                g.end_pass = lambda: (lambda r: owed.extend(r) or r)(real_end())  # type: ignore[method-assign]
            try:
                W.run_steps(engine, opt, 2, 3, rank, world)
            finally:
                config.num_hidden_layers += 2
            opt.wait()
            out[gather] = (W.weights(engine), engine.executor.h2d_bytes, owed, config.num_hidden_layers)
        torch.save(out, os.path.join(tmp, f"gather_rank{rank}.pt"))


@pytest.mark.slow  # (spawns processes)
def test_gathered_loads_are_the_whole_copies(tmp_path):
    tmp = str(tmp_path)
    mp.spawn(_worker, args=(2, tmp), nprocs=2, join=True)
    for rank in (0, 1):
        out = torch.load(os.path.join(tmp, f"gather_rank{rank}.pt"))
        (gathered, bytes_gathered, owed, layers), (whole, bytes_whole, _, _) = out[True], out[False]
        assert owed == [layers - 1] * W.GA  # (each micro-batch's forward of step 3 owed the last, never prefetched, layer)
        assert gathered.keys() == whole.keys()
        for n in whole:  # bit for bit: the same host bytes, moved another way
            assert torch.equal(gathered[n], whole[n]), n
        # Each training forward (2 steps x 2 micro-batches) copied half of each layer; backward and the
        # no-grad forward whole ones.
        assert bytes_gathered < bytes_whole, (bytes_gathered, bytes_whole)
