"""The layer gradients' reduce-scatter on a communicator of its own with capped CTAs (parallel/group.py
``cap_reduce``; config ``gradient_reduce_ctas``): only for NCCL, one group per node created by every rank in node
order, the reduce-scatter then runs on it. NCCL is absent on the CPU: its calls are faked here."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from hf_megatrain.config import MegaTrainConfig
from hf_megatrain.parallel.group import DataParallel


def _dp(node: int = 0, nodes: int = 1) -> DataParallel:
    return DataParallel(rank=node * 2, world=2 * nodes, local_rank=0, device=torch.device("cpu"), local_world=2,
                        node=node, nodes=nodes)


def _fake_nccl(monkeypatch, created: list) -> None:
    class Options:
        def __init__(self) -> None:
            self.config = types.SimpleNamespace(max_ctas=None)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def new_group(ranks, backend, pg_options):
        created.append((tuple(ranks), backend, pg_options.config.max_ctas))
        return f"group{len(created)}"

    monkeypatch.setattr(dist, "new_group", new_group)


def test_default_caps_the_reduce_scatter():
    assert MegaTrainConfig().gradient_reduce_ctas == 8


def test_nccl_gets_one_capped_group_per_node_created_in_node_order(monkeypatch):
    created: list = []
    _fake_nccl(monkeypatch, created)
    dp = _dp(node=1, nodes=2)
    dp.all_gather_object = lambda obj: [(0, 0), (0, 1), (1, 2), (1, 3)]  # (node, global rank) of every rank
    assert dp.cap_reduce(8)
    assert created == [((0, 1), "nccl", 8), ((2, 3), "nccl", 8)]
    assert dp.reduce_group == "group2"  # (this rank's node)
    assert dp.cap_reduce(8) and len(created) == 2  # (once)


def test_reduce_scatter_runs_on_the_capped_group(monkeypatch):
    created: list = []
    _fake_nccl(monkeypatch, created)
    dp = _dp()
    dp.all_gather_object = lambda obj: [(0, 0), (0, 1)]
    dp.cap_reduce(4)
    seen = {}

    def reduce_scatter_tensor(out, full, op, group):
        seen["group"] = group
        out.copy_(full[:out.numel()] * 2)

    monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter_tensor)
    out = torch.empty(2)
    dp.reduce_scatter_mean_(out, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert seen["group"] == "group1" and out.tolist() == [1.0, 2.0]


def test_no_group_for_zero_or_another_backend(monkeypatch):
    created: list = []
    _fake_nccl(monkeypatch, created)
    assert not _dp().cap_reduce(0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert not _dp().cap_reduce(8)
    assert created == []
