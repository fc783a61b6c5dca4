"""How many bytes a Trainer checkpoint takes, and how many of them a run keeps on its disk at once.

A full-state checkpoint is large (a 32B model's FP32 master + AdamW moments + export: ~393 GB, more than a 235 GiB
disk), and a save that does not fit fails only when it is written, hours into a run. So its size is known up front,
from one formula for both callers: ``megatrain estimate`` (a model config's parameter counts, planner/predict.py)
and a built engine (its store's exact element counts: ``export.weights.checkpoint_bytes``, which the run summary
prints and the Trainer checks against the output folder's free space before the first step, hf/disk_check.py).

A Trainer checkpoint (``checkpoint-N``) holds
- the export in ``save_dtype`` (``model*.safetensors``): every trainable parameter, and outside PEFT the frozen
  parameters and persistent buffers (floating ones cast to ``save_dtype`` as the writer casts them);
- the FP32 master (``megatrain_master*.safetensors``) when the export is not FP32, and always for PEFT adapters;
- AdamW's two FP32 moments per trainable parameter (``megatrain_optimizer.safetensors``).
Not counted: safetensors headers, step counts, the scheduler / RNG / trainer-state / tokenizer files (kilobytes to
megabytes beside the tensors). ``save_only_model=True`` writes the export alone.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

import torch

__all__ = ["CheckpointBytes", "trainer_checkpoint_bytes", "checkpoints_at_once", "existing_checkpoints",
           "free_bytes"]


@dataclass(frozen=True)
class CheckpointBytes:
    """Tensor bytes of one Trainer checkpoint, by file group."""

    export: int  # model*.safetensors: the standard export in save_dtype
    master: int  # megatrain_master*.safetensors: the FP32 master (0 when the export is it)
    moments: int  # megatrain_optimizer.safetensors: AdamW m, v

    @property
    def total(self) -> int:
        return self.export + self.master + self.moments

    def saved(self, model_only: bool) -> int:
        """Bytes one save writes: the export alone with ``save_only_model``, else everything."""
        return self.export if model_only else self.total


def trainer_checkpoint_bytes(trainable: int, extra_bytes: int, save_dtype: torch.dtype, *,
                             master: bool | None = None) -> CheckpointBytes:
    """The one formula: ``trainable`` parameters' elements, ``extra_bytes`` of the export's other tensors (frozen
    parameters, persistent buffers, already at ``save_dtype``), the export dtype; ``master``: whether the FP32
    master is written beside the export (default: when the export is not FP32; PEFT passes True)."""
    elt = torch.empty((), dtype=save_dtype).element_size()
    keep = save_dtype != torch.float32 if master is None else master
    return CheckpointBytes(export=trainable * elt + extra_bytes, master=4 * trainable if keep else 0,
                           moments=8 * trainable)


def checkpoints_at_once(save_total_limit: int | None, saves: int | None, existing: int, keep_best: bool) -> int:
    """How many new checkpoints the disk must hold at the same time, beyond the ``existing`` ones of the folder.

    A checkpoint is written before the oldest is removed (checkpoint/atomic.py ``rotate_checkpoints``), so with
    ``save_total_limit`` k, k + 1 coexist at the peak (k >= 2 while the best model is kept beside the newest), the
    folder's existing checkpoints among them (they are rotated too). Without a limit every save stays: ``saves``,
    the run's planned saves (None when unknown, e.g. save_strategy="best": at least one)."""
    if saves is not None and saves <= 0:
        return 0
    if save_total_limit is not None and save_total_limit > 0:
        kept = max(save_total_limit, 2) if keep_best else save_total_limit
        new = max(kept - existing, 0) + 1
        return new if saves is None else min(new, saves)
    return 1 if saves is None else saves


def existing_checkpoints(folder: str) -> int:
    """``checkpoint-N`` folders already in ``folder`` (what rotation counts)."""
    if not os.path.isdir(folder):
        return 0
    return sum(1 for f in os.listdir(folder)
               if re.fullmatch(r"checkpoint-\d+", f) and os.path.isdir(os.path.join(folder, f)))


def free_bytes(folder: str) -> int:
    """Free bytes of the filesystem ``folder`` is (or will be created) on: its nearest existing ancestor's."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free
