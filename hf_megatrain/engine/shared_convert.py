"""Conversion of the data-parallel ranks into one store per node in shared memory (``convert_shared``).

On each node the followers (local ranks > 0) convert first, then local rank 0, so whatever each rank's copy of the
model held, the node's store ends up with its local rank 0's weights; with several nodes, each rank then receives its
shard of node 0's store (a broadcast among the ranks of its local rank), so every store holds global rank 0's
weights (what DDP's initial broadcast guarantees); the replicated device state is broadcast from rank 0 too. Every
rank must have mapped the same buffers in the same order (checked), then the files are removed. The host-RAM fit
check of every rank measures against what its node had available before any rank allocated the store (it counts
the one store once; the ranks' private buffers, a few layers each, are not multiplied by the ranks). What the
data-parallel path supports is decided in parallel/setup.py.
"""

from __future__ import annotations

import shutil
from typing import Callable

import torch

from ..core.memory import available_host_bytes
from ..parallel import liveness
from ..parallel.group import DataParallel, sharded
from ..parallel.setup import check_plans
from ..parallel.shared_alloc import SharedHostAllocator, new_run_dir
from .convert import Converted

HostAlloc = Callable[[int, torch.dtype, bool], torch.Tensor]  # (numel, dtype, pin) -> a host buffer


def _in_turn(dp: DataParallel, fn: Callable[[], Converted], mine: bool) -> Converted | None:
    """``fn()`` on the ranks where ``mine``, then every rank learns whether it failed anywhere (a rank that failed
    alone would leave the others waiting at the next collective)."""
    out, error = None, None
    if mine:
        try:
            out = fn()
        except Exception as e:  # (re-raised below, after the others heard of it)
            error = e
    failed = [r for r, ok in enumerate(dp.all_gather_object(error is None)) if not ok]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"data parallel: conversion failed on rank(s) {failed} (their error is in their log)")
    return out


def convert_shared(dp: DataParallel, root: str, convert: Callable[[HostAlloc, int], Converted]) -> Converted:
    """``convert(host_alloc, host_available)`` (plan, store and templates: engine/builder.py) on every rank of
    ``dp`` into one store per node in shared memory under ``root`` (the config's ``shared_memory_dir``, each
    node's own)."""
    run_dir, avail, room = dp.node_broadcast_object(
        (new_run_dir(root), available_host_bytes(), shutil.disk_usage(root).free) if dp.is_leader else None)
    alloc = SharedHostAllocator(run_dir, capacity=room)
    run = lambda: convert(alloc, avail)  # noqa: E731
    try:
        with alloc.removed_on_failure():  # (any rank: a failed conversion leaves no RAM held in shared_memory_dir)
            conv = _in_turn(dp, run, not dp.is_leader)  # the followers map (and write) every buffer first
            conv = _in_turn(dp, run, dp.is_leader) or conv
            # Each rank's counts per unit (parallel/peer_cells.py), zeros as the files start: [ranks, 2 x units],
            # the final updates, then the updates whose compute copy is written (split updates publish it first).
            units = len(conv.store.units)
            conv.peer_cells = alloc(dp.local_world * 2 * units, torch.int64, False).view(dp.local_world, 2 * units)
            # Each rank's row of the host's liveness cells: a rank that dies or fails ends the others, naming it.
            ranks = conv.peer_cells.shape[0]  # (the host's)
            cells = alloc(ranks * liveness.WORDS, torch.int64, False).view(ranks, liveness.WORDS)
            conv.liveness = liveness.Liveness(cells, dp.local_rank, dp.rank)
            conv.liveness.register()
            dp.barrier()  # (every rank has mapped the cells before their file goes)
            conv.liveness.start()
    finally:
        if dp.is_leader:
            alloc.release()
    signatures = dp.all_gather_object(alloc.signature())
    if any(s != signatures[0] for s in signatures):
        raise RuntimeError("data parallel: the ranks built different stores (a different model or config per rank?); "
                           "every rank must convert the same model with the same config")
    check_plans(conv.plans)
    with torch.no_grad():  # replicated state: rank 0's values everywhere (as DDP broadcasts at wrap time)
        res = conv.store.units[-1]
        if res.numel:
            dp.broadcast_(res.master)
            res.refresh_compute_()
        for p in {id(p): p for p in conv.frozen_resident.values()}.values():
            dp.broadcast_(p.data)
        for bufs in conv.buffers:
            for b in bufs.values():
                if b.is_floating_point():
                    dp.broadcast_(b)
        if dp.nodes > 1:
            _same_store_on_every_node(conv, dp)
    dp.barrier()
    return conv


def _same_store_on_every_node(conv: Converted, dp: DataParallel) -> None:
    """Each rank's shard of every host unit's master and frozen copy from node 0 (global rank 0's weights on every
    node: the nodes' stores step identically from there); then its shard's compute copy refreshed."""
    for u in conv.store.units:
        if sharded(u) and u.numel:
            lo, hi = dp.shard(u.numel)
            if hi > lo:
                dp.broadcast_across_nodes_(u.master[lo:hi])
                u.refresh_compute_((lo, hi))
        if u.frozen is not None and u.frozen.numel():
            lo, hi = dp.shard(u.frozen.numel())
            if hi > lo:
                dp.broadcast_across_nodes_(u.frozen[lo:hi])
