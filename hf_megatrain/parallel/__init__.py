"""Data parallel over the processes of one host (issue 19) or several (issue 45): one shared FP32 store per host
(node), sharded AdamW over the node's processes, the nodes' stores stepping identically.

``group`` (the ranks and their collectives), ``shards`` (who steps which range), ``shared_alloc`` (host buffers
in shared memory), ``setup`` (what the data-parallel path supports; conversion into the shared store). The
engine (``MegaTrainEngine(dp=...)``), the gradient offload and the optimizer take a ``DataParallel``; the
integration builds it from torch.distributed (``DataParallel.from_process_group``). Design and what is built:
integration/MULTI_GPU_DESIGN.md.
"""

from .group import DataParallel

__all__ = ["DataParallel"]
