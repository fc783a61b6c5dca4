"""Standard HF checkpoints streamed from the FP32 masters, training state, atomic folders (torch + safetensors)."""

from . import safetensors_io
from .folders import *  # noqa: F401,F403
from .folders import __all__ as _folders_all
from .names import MANIFEST, MASTER_PREFIX, OPTIMIZER_HYPER, OPTIMIZER_TENSORS, WEIGHTS_PREFIX
from .space import CheckpointBytes, trainer_checkpoint_bytes

__all__ = ["safetensors_io", "MANIFEST", "MASTER_PREFIX", "OPTIMIZER_HYPER", "OPTIMIZER_TENSORS", "WEIGHTS_PREFIX",
           "CheckpointBytes", "trainer_checkpoint_bytes", *_folders_all]
