"""Planner rules for long sequences: the in-layer sequence chunk, where layer-boundary activations live, FLOPs.

- ``seq_chunk`` resolves ``seq_chunk_tokens=-1`` (auto) to the chunk whose MLP intermediates (gate, up, act(gate)
  * up and their gradients: ~6 x intermediate per token in the compute dtype) take about ``TILE_TRANSIENT_BYTES``;
  a sequence no longer than the chunk runs untiled (model/seq_tiling.py).
- ``offload_layers`` is how many layers' saved inputs go to pinned host memory (engine/activations.py): none
  with ``activation_offload="off"``, all with "on", and with "auto" the fewest that make the step's GPU peak fit
  the budget (none without a GPU: there the device *is* host memory). The first layers are the offloaded ones.
- ``flops_per_token``: 6N for the weights (N: the parameters one token runs through; an MoE's routed experts
  count top_k / num_experts of theirs: active.py) plus attention, 12 x layers x (heads x head_dim) x seq per token (the
  QK^T and AV products, forward + backward, full T x T as in PaLM's MFU convention; a causal kernel does half;
  MLA's q/k and v head dims differ, 192 and 128 in DeepSeek-V3: their mean, ``ModelShape.attention_dim``).
  At 512k tokens and 7B width that term is ~14x the 6N one. The hardware also runs the layer recompute (one
  more forward: +2N and a third more attention), reported apart.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from ..config import MegaTrainConfig

if TYPE_CHECKING:
    from .model_shape import ModelShape

TILE_TRANSIENT_BYTES = 2 * 1024 ** 3
MIN_AUTO_CHUNK = 1024


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def seq_chunk(shape: ModelShape, config: MegaTrainConfig) -> int:
    """Tokens per chunk of the tiled position-wise modules (0: untiled)."""
    if config.seq_chunk_tokens >= 0:
        return config.seq_chunk_tokens
    per_token = 6 * max(shape.intermediate, shape.hidden) * _elt(config.torch_compute_dtype)
    return max(MIN_AUTO_CHUNK, 2 ** int(math.log2(max(TILE_TRANSIENT_BYTES // per_token, 1))))


def tiled(chunk: int, tokens: int) -> bool:
    return 0 < chunk < tokens


def positionwise_bytes(shape: ModelShape, tokens: int, compute_dtype: torch.dtype, chunk: int) -> int:
    """Recompute + backward bytes of the MLP and the norms: whole-sequence intermediates untiled (6 x intermediate
    per token, + the fp32 norm upcasts in bf16), one chunk's when tiled, plus the tiler's FP32 sums of the MLP
    weight gradients and one chunk's weight gradients."""
    c, H, inter = _elt(compute_dtype), shape.hidden, shape.intermediate
    per_token = c * 6 * inter + (8 * H if c < 4 else 0)
    if not tiled(chunk, tokens):
        return tokens * per_token
    mlp_weights = 3 * H * inter
    return chunk * per_token + mlp_weights * (4 + c)


def attention_workspace_bytes(shape: ModelShape, tokens: int) -> int:
    """GPU attention backward beyond its saved tensors: the flash kernel's FP32 dq accumulator ([tokens, q_dim])."""
    return 4 * tokens * shape.q_dim


def activation_bytes(shape: ModelShape, tokens: int, compute_dtype: torch.dtype) -> int:
    """One layer-boundary activation (a layer's saved input): tokens x hidden in the compute dtype."""
    return tokens * shape.hidden * _elt(compute_dtype)


def offload_layers(config: MegaTrainConfig, num_layers: int, device_type: str, gpu_free: int | None,
                   device_total: Callable[[int], int]) -> int:
    """How many layers' inputs go to host memory; ``device_total(n)`` is the planned GPU peak with n offloaded."""
    mode = config.activation_offload
    if mode == "off" or num_layers == 0:
        return 0
    if mode == "on":
        return num_layers
    if device_type != "cuda" or gpu_free is None or device_total(0) <= gpu_free:
        return 0
    for n in range(1, num_layers + 1):  # (the peak falls by one activation per layer: a short walk)
        if device_total(n) <= gpu_free:
            return n
    return num_layers  # does not fit even so: offload all, the fit check reports it


def flops_per_token(shape: ModelShape, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (see the module docstring). N is the *active* parameter count: an MoE token runs
    through top_k of num_experts routed experts (planner/active.py), not all of them."""
    n = shape.active
    dense = 6.0 * n
    attention = 12.0 * shape.num_layers * shape.attention_dim * seq_len
    return {"params_active": float(n), "params_total": float(shape.trainable + shape.frozen),
            "dense_6n": dense, "attention": attention, "model": dense + attention,
            "attention_over_6n": attention / dense if dense else 0.0,
            # executed: forward, recompute, backward (8N); causal attention: half of the 16/12 x full term
            "hardware_with_recompute_causal": 8.0 * n + attention * (16.0 / 12.0) / 2}
