"""Memory planner: host RAM, GPU memory and disk a run needs, as sums over the same unit plans the engine builds."""

from .predict import *  # noqa: F401,F403
from .predict import __all__  # noqa: F401
