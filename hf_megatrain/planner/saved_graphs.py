"""Saved graphs: how many of the last decoder layers keep their forward's graph instead of being recomputed.

The streamed backward recomputes each layer's forward from its saved input (engine/proxy.py): a quarter of a
layer's matmul work again (2N of 8N per token), paid so that the GPU holds one layer's activations at a time. Where
the GPU has room beside the step's planned peak, the last layers in forward order keep their training forward's
graph -- activations plus their own compute-dtype copy of the weights (their slot is refilled long before their
backward) -- and their backward differentiates it (``saved_graph_layers``; engine/executor.py). The last ones:
their backward comes first, so their memory is held the shortest, and the forward's end is where the GPU holds the
least else.

Per kept layer this charges its saved activations (``saved_graph_bytes``: measured per token for compiled dense
layers, else a whole recompute peak) plus its weight copy, on top of the whole step's planned peak -- not only on
the phases where the graphs are alive, so the count errs low. ``SAVED_GRAPH_MARGIN``
of the GPU budget stays free for what the plan does not see (the compiled graphs' own buffers, fragmentation past
the planned share).
"""

from __future__ import annotations

import logging

import torch

from ..config import MegaTrainConfig
from ..core.engine_view import EngineView
from ..core.memory import format_bytes, gpu_budget
from .model_shape import ModelShape
from .predict import estimate, layer_recompute_bytes

logger = logging.getLogger("hf_megatrain")

__all__ = ["SAVED_GRAPH_MARGIN", "saved_graph_bytes", "saved_graph_count", "saved_graph_layers_for"]

SAVED_GRAPH_MARGIN = 0.05  # of the GPU budget, never planned for kept graphs


def saved_graph_bytes(shape: ModelShape, config: MegaTrainConfig, tokens: int, chunk: int = 0) -> int:
    """GPU bytes one kept layer graph holds until its backward: its own weight copy, and its saved activations for
    ``tokens`` tokens. A compiled dense layer (untiled) saves per token, in the compute dtype, ~3 MLP-wide tensors
    (gate, up and their product's input), 4 hidden-wide ones (the norms' inputs and outputs, residuals), the
    attention's q / k / v and output (2 q + 2 kv): measured on an H100 at 14B width (bf16, compiled), 140-143 KB
    per token against 148.5 KB so counted (integration/PERF.md, lever 64). Any other layer (eager: fp32 norm
    upcasts saved; MoE; tiled position-wise parts) is charged its whole recompute peak (``layer_recompute_bytes``),
    an upper bound."""
    c = config.torch_compute_dtype.itemsize
    slot = max((a + b for a, b in zip(shape.layer_numels, shape.layer_frozen)), default=0)
    if config.compiles("cuda") and not shape.routed_inactive and not chunk:
        per_token = c * (3 * shape.intermediate + 4 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim)
        return tokens * per_token + c * slot
    return layer_recompute_bytes(shape, tokens, config.torch_compute_dtype, chunk) + c * slot


def saved_graph_count(config: MegaTrainConfig, num_layers: int, *, device_type: str, split: bool, offloaded: int,
                      budget: int | None, planned_peak: int, per_layer: int) -> int:
    """The rule, on numbers only: an explicit ``saved_graph_layers`` as asked (at most every layer); auto keeps
    none on a CPU, where layer inputs are offloaded (the GPU is short already) or a visit is split by
    ``micro_batch_size``, else as many as fit ``budget`` less its margin beside ``planned_peak``."""
    asked = config.saved_graph_layers
    if asked >= 0:
        return min(asked, num_layers)
    if device_type != "cuda" or budget is None or offloaded or split or per_layer <= 0:
        return 0
    spare = (1.0 - SAVED_GRAPH_MARGIN) * budget - planned_peak
    return max(0, min(num_layers, int(spare // per_layer)))


def saved_graph_layers_for(engine: EngineView, seq_len: int, batch_size: int, offloaded: int,
                           gpu_available: int | None = None) -> int:
    """How many of ``engine``'s last layers keep their forward graph for a step of this shape, ``offloaded``
    layers' inputs going to host memory (the activation rule's count for the same shape)."""
    config, dev = engine.config, engine.device
    shape = ModelShape.from_engine(engine)
    split = 0 < config.micro_batch_size < batch_size
    if config.saved_graph_layers >= 0 or dev.type != "cuda" or offloaded or split:
        return saved_graph_count(config, shape.num_layers, device_type=dev.type, split=split, offloaded=offloaded,
                                 budget=None, planned_peak=0, per_layer=0)
    if gpu_available is None and torch.cuda.is_available():
        gpu_available = gpu_budget(dev) + torch.cuda.memory_allocated(dev)  # (its own buffers are in the plan)
    plan = estimate(shape, config, seq_len, batch_size, device_type=dev.type, gpu_free=gpu_available,
                    plans=engine.plans, offloaded_layers=0)
    per = saved_graph_bytes(shape, config, batch_size * seq_len, plan.seq_chunk_tokens)
    n = saved_graph_count(config, shape.num_layers, device_type=dev.type, split=split, offloaded=offloaded,
                          budget=gpu_available, planned_peak=plan.device_total, per_layer=per)
    logger.debug("hf_megatrain: batch %d x seq %d: the last %d of %d layers keep their forward graph (%s each, "
                 "planned peak %s of %s)", batch_size, seq_len, n, shape.num_layers, format_bytes(per),
                 format_bytes(plan.device_total), format_bytes(gpu_available or 0))
    return n
