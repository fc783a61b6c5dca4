"""hf_megatrain: full-precision training of Hugging Face LLMs larger than GPU memory, on one GPU.

Sub-packages: ``core`` (placement plans, the unit store, the step state, AdamW kernels), ``model`` (finding and
templating an HF model's layers, the loss), ``engine`` (conversion, the streaming executor, the runtime engine),
``optim`` (the AdamW steppers), ``planner`` (memory prediction), ``checkpoint`` (standard HF checkpoints), ``export``
(full / adapter / merged model exports), ``hf`` (Trainer, TrainingArguments, Accelerate plugin: the only modules
importing transformers' Trainer/accelerate).
"""

from .config import MegaTrainConfig
from .core.store import UnitStore
from .engine import MegaTrainEngine, MegaTrainOutput
from .model.loss import linear_cross_entropy
from .optim.adamw import CPUAdamW, UnitAdamW

__version__ = "0.1.0"

__all__ = ["MegaTrainConfig", "MegaTrainEngine", "MegaTrainOutput", "UnitStore", "UnitAdamW", "CPUAdamW",
           "linear_cross_entropy", "MegaTrainPlugin", "__version__"]

_LAZY_TRAINER = ("MegaTrainTrainingArguments", "MegaTrainTrainer", "from_pretrained_streamed")
_LAZY_MODULES = ("trainer", "default_job", "peft_support", "training_args", "plugin", "pretrained")
__all__ += list(_LAZY_TRAINER)


def __getattr__(name: str):  # the Trainer integration imports transformers.Trainer and accelerate: on first use only
    import importlib

    if name == "MegaTrainPlugin":  # (accelerate: imported on first use, like the Trainer integration)
        return importlib.import_module(".hf.plugin", __name__).MegaTrainPlugin
    if name in _LAZY_TRAINER:
        return getattr(importlib.import_module(".hf.trainer", __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{'export' if name == 'peft_support' else 'hf'}.{name}", __name__)
    raise AttributeError(f"module 'hf_megatrain' has no attribute {name!r}")
