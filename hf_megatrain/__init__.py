"""hf_megatrain: full-precision training of Hugging Face LLMs larger than GPU memory, on one GPU."""

from .config import MegaTrainConfig
from .engine import MegaTrainEngine, MegaTrainOutput
from .host_store import HostStore
from .loss import linear_cross_entropy
from .optimizer import CPUAdamW

__version__ = "0.1.0"

__all__ = ["MegaTrainConfig", "MegaTrainEngine", "MegaTrainOutput", "HostStore", "CPUAdamW",
           "linear_cross_entropy", "__version__"]
