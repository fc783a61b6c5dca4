"""Memory planner: host RAM, GPU memory and disk a run needs, as sums over the same unit plans the engine builds."""

from .cli import *  # noqa: F401,F403
from .cli import __all__ as _cli_all
from .predict import *  # noqa: F401,F403
from .predict import __all__ as _predict_all
from .saved_graphs import *  # noqa: F401,F403
from .saved_graphs import __all__ as _saved_all

__all__ = [*_predict_all, *_cli_all, *_saved_all]
