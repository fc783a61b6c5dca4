"""What the files of a checkpoint folder are called, and the one error a folder that cannot be used raises.

The ground floor of ``checkpoint/``: every other module names these files or raises this error (the writers, the
manifest's check, recovery of interrupted saves, the loads), so they live below all of them.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "WEIGHTS_PREFIX", "MASTER_PREFIX", "OPTIMIZER_TENSORS", "OPTIMIZER_HYPER", "MANIFEST"]


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file, has a truncated/corrupt file, or does not match the model."""


WEIGHTS_PREFIX = "model"  # HF: model.safetensors / model-0000x-of-0000y.safetensors
MASTER_PREFIX = "megatrain_master"  # FP32 master, written only when the exported weights are not FP32
OPTIMIZER_TENSORS = "megatrain_optimizer.safetensors"
OPTIMIZER_HYPER = "megatrain_optimizer.json"
MANIFEST = "megatrain_manifest.json"  # every file with its size and CRC-32, written last (manifest.py)
