"""Conversion for data-parallel ranks of one host: what the first version supports, and one shared store.

``data_parallel_config`` says which placements the data-parallel path supports and refuses the others with what to
change: every decoder layer is host-stepped (sharded over the ranks), the resident unit stays on each rank's device
(replicated). ``convert_shared`` converts the model on every rank into one store in shared memory: the followers
(local ranks > 0) convert first, then local rank 0, so whatever each rank's copy of the model held, the store ends
up with rank 0's weights (what DDP's initial broadcast guarantees); the replicated device state is broadcast from
rank 0 too. Every rank must have mapped the same buffers in the same order (checked), then the files are removed.
The host-RAM fit check of every rank measures against what was available before any rank allocated the store (it
counts the one store once; the ranks' private buffers, a few layers each, are not multiplied by the ranks).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from typing import Callable

import torch
from torch import nn

from ..config import MegaTrainConfig
from ..core.memory import available_host_bytes
from ..core.plan import Plans, Stepper, Where
from ..engine.convert import Converted, convert
from .group import DataParallel
from .shared_alloc import SharedHostAllocator, new_run_dir

logger = logging.getLogger(__name__)


def data_parallel_config(config: MegaTrainConfig, dp: DataParallel) -> MegaTrainConfig:
    """``config`` for a data-parallel run of ``dp.world`` processes: automatic GPU layer placement resolved to
    none (every layer sharded on the host); unsupported options raise, naming the change to make."""
    n = f"{dp.world} processes"
    if config.lean_store:
        raise ValueError(f"lean_store=True is not supported with {n} (data parallel): each layer's update needs "
                         "every rank's gradient. Use lean_store=False.")
    if config.optimizer_state_dir:
        raise ValueError(f"optimizer_state_dir (AdamW state on disk) is not supported with {n} (data parallel): "
                         "the host's one copy of the state lives in shared memory. Unset optimizer_state_dir.")
    for key in ("device_layers", "device_step_layers"):
        if getattr(config, key) > 0:
            raise ValueError(f"{key}={getattr(config, key)} is not supported with {n} (data parallel): every layer "
                             f"is stepped on the host, sharded over the ranks. Use {key}=0 (or -1).")
    if config.torch_grad_offload_dtype != torch.float32:
        raise ValueError(f"grad_offload_dtype={config.grad_offload_dtype!r} is not supported with {n} (data parallel): "
                         "the ranks' gradients would be summed in that dtype by the reduce-scatter. Use 'float32'.")
    if config.resident_placement == "host":
        raise ValueError(f"resident_placement='host' is not supported with {n} (data parallel): the embeddings, "
                         "final norm and lm_head are replicated on each rank's device. Use 'device' or 'auto'.")
    return dataclasses.replace(config, device_layers=0, device_step_layers=0)


def check_plans(plans: Plans) -> None:
    """Refuse plans the data-parallel path would run wrongly (a safety net behind ``data_parallel_config``)."""
    for p in plans.layers:
        if p.numel > 0 and p.stepper is not Stepper.HOST:
            raise ValueError(f"data parallel: layer {p.index} is planned {p.stepper.value}; only host-stepped "
                             "layers are supported (device_layers=0, device_step_layers=0, lean_store=False)")
    if plans.resident.numel > 0 and plans.resident.master is not Where.DEVICE:
        raise ValueError("data parallel: the resident parts (embeddings, final norm, lm_head) were planned on the "
                         "host (they do not fit resident_device_fraction of the GPU); set "
                         "resident_placement='device' or raise resident_device_fraction")


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


def convert_shared(model: nn.Module, config: MegaTrainConfig, device: torch.device, decay_names: set[str] | None,
                   dp: DataParallel) -> Converted:
    """``convert`` on every rank of ``dp`` into one store in shared memory under ``config.shared_memory_dir``."""
    root = config.shared_memory_dir
    run_dir, avail, room = dp.broadcast_object(
        (new_run_dir(root), available_host_bytes(), shutil.disk_usage(root).free) if dp.is_leader else None)
    alloc = SharedHostAllocator(run_dir, capacity=room)
    run = lambda: convert(model, config, device, decay_names, host_alloc=alloc, host_available=avail)  # noqa: E731
    try:
        with alloc.removed_on_failure():  # (any rank: a failed conversion leaves no RAM held in shared_memory_dir)
            conv = _in_turn(dp, run, not dp.is_leader)  # the followers map (and write) every buffer first
            conv = _in_turn(dp, run, dp.is_leader) or conv
            # Each rank's count of finished updates per unit (parallel/peer_cells.py): zeros, as the files start.
            units = len(conv.store.units)
            conv.peer_cells = alloc(dp.world * units, torch.int64, False).view(dp.world, units)
            dp.barrier()  # (every rank has mapped the cells before their file goes)
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
    dp.barrier()
    return conv
