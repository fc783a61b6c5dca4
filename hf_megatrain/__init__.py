"""hf_megatrain: full-precision training of Hugging Face LLMs larger than GPU memory, on one GPU."""

from .config import MegaTrainConfig
from .engine import MegaTrainEngine, MegaTrainOutput
from .host_store import HostStore
from .loss import linear_cross_entropy
from .optimizer import CPUAdamW
from .plugin import MegaTrainPlugin

__version__ = "0.1.0"

__all__ = ["MegaTrainConfig", "MegaTrainEngine", "MegaTrainOutput", "HostStore", "CPUAdamW",
           "linear_cross_entropy", "__version__"]
__all__ += ["MegaTrainPlugin"]

_LAZY_TRAINER = ("MegaTrainTrainingArguments", "MegaTrainTrainer", "from_pretrained_streamed")
__all__ += list(_LAZY_TRAINER)


def __getattr__(name: str):  # the Trainer integration imports transformers.Trainer: load it on first use only
    if name in _LAZY_TRAINER:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_megatrain' has no attribute {name!r}")
