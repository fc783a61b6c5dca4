"""What the data-parallel path of one host supports (the conversion into one shared store: engine/shared_convert.py).

``data_parallel_config`` says which placements the data-parallel path supports and refuses the others with what to
change: every decoder layer is host-stepped (sharded over the ranks; with ``lean_store`` each rank consumes its shard
of every reduced layer gradient as it lands: optim/lean.py), the resident unit stays on each rank's device
(replicated); ``check_plans`` is the safety net behind it.
"""

from __future__ import annotations

import logging

import torch

from ..config import MegaTrainConfig
from ..core.plan import Plans, Stepper, Where
from .group import DataParallel

logger = logging.getLogger(__name__)


def data_parallel_config(config: MegaTrainConfig, dp: DataParallel) -> MegaTrainConfig:
    """``config`` for a data-parallel run of ``dp.world`` processes: automatic GPU layer placement resolved to
    none (every layer sharded on the host); unsupported options raise, naming the change to make."""
    n = f"{dp.world} processes"
    if config.lean_store and getattr(dp, "nodes", 1) > 1:
        raise ValueError(f"lean_store=True is not supported with {n} on {dp.nodes} hosts (data parallel across "
                         "hosts: not tested with the lean store). Use lean_store=False, or one host.")
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
    return config.resolved(device_layers=0, device_step_layers=0)


def check_plans(plans: Plans) -> None:
    """Refuse plans the data-parallel path would run wrongly (a safety net behind ``data_parallel_config``)."""
    for p in plans.layers:
        # (host-stepped layers, with a gradient buffer or consuming each gradient as it lands: master on the host)
        if p.numel > 0 and (p.master is not Where.HOST or p.stepper is Stepper.DEVICE_STREAMED):
            raise ValueError(f"data parallel: layer {p.index} is planned {p.stepper.value}; only host-stepped "
                             "layers are supported (device_layers=0, device_step_layers=0)")
    if plans.resident.numel > 0 and plans.resident.master is not Where.DEVICE:
        raise ValueError("data parallel: the resident parts (embeddings, final norm, lm_head) were planned on the "
                         "host (they do not fit resident_device_fraction of the GPU); set "
                         "resident_placement='device' or raise resident_device_fraction")
