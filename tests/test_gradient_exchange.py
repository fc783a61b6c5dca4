"""``gradient_exchange='all_to_all'`` (engine/offload.py, parallel/group.py ``exchange_mean_``): a whole layer
gradient crosses to each shard's rank in the compute dtype and is summed there in FP32. For two processes that is
the same one FP32 rounding of the same two values as the FP32 reduce-scatter, so training is bit-identical; a
gradient summed over micro-batch chunks crosses in FP32 as before."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

import tests.dp_workers as W
from hf_megatrain import MegaTrainConfig


def exchange_worker(rank: int, world: int, tmp: str) -> None:
    with W.ranks(rank, world, tmp) as dp:
        for exchange in ("reduce_scatter", "all_to_all"):
            for mb in (0, 1):  # (1: each layer's gradient summed over chunks, FP32 on the wire either way)
                engine, opt = W.make_engine(dp, tmp, "bfloat16", micro_batch_size=mb, gradient_exchange=exchange)
                wire = engine.executor.grads.wire
                assert wire == (torch.bfloat16 if exchange == "all_to_all" else None), wire
                norms = W.run_steps(engine, opt, 0, W.STEPS, rank, world)
                if rank == 0:
                    torch.save((W.weights(engine), norms), os.path.join(tmp, f"{exchange}_{mb}.pt"))
                del engine, opt


@pytest.mark.slow  # (spawns processes)
def test_all_to_all_exchange_matches_the_reduce_scatter(tmp_path):
    tmp = str(tmp_path)
    mp.spawn(exchange_worker, args=(2, tmp), nprocs=2, join=True)
    for mb in (0, 1):
        (a, na), (b, nb) = (torch.load(os.path.join(tmp, f"{e}_{mb}.pt")) for e in ("reduce_scatter", "all_to_all"))
        assert na == nb
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), mb


def test_exchange_is_a_known_choice():
    with pytest.raises(ValueError, match="gradient_exchange"):
        MegaTrainConfig(gradient_exchange="ring")


def test_all_to_all_says_when_it_cannot_apply(caplog):
    """FP32 compute has nothing narrower to send: the FP32 reduce-scatter runs, and the log says so."""
    import types

    from hf_megatrain.core.plan import Where
    from hf_megatrain.core.streams import StreamSet
    from hf_megatrain.engine.offload import GradientOffload

    unit = types.SimpleNamespace(numel=8, plan=types.SimpleNamespace(grad=Where.HOST))
    dp = types.SimpleNamespace(local_world=2, shard_size=lambda n: (n + 1) // 2)
    streams = StreamSet(torch.device("cpu"))
    for dtype, wire in ((torch.bfloat16, torch.bfloat16), (torch.float32, None)):
        caplog.clear()
        g = GradientOffload([unit], None, streams, device=torch.device("cpu"), compute_dtype=dtype,
                            offload_dtype=torch.float32, pin=False, dp=dp, exchange="all_to_all")
        assert g.wire == wire
        assert ("needs 16-bit compute" in caplog.text) == (wire is None)
