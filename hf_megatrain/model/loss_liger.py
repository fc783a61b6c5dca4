"""``loss_impl="liger"``: Liger-Kernel's fused linear cross-entropy (Triton, CUDA only).

Like the chunked loss it forms [chunk, vocab] logits tile by tile and computes the hidden / weight gradients in the
forward, so the backward only scales them. Called with ``reduction="sum"`` (the caller divides by HF's normalizer,
``num_items_in_batch`` or the counted tokens), ``ignore_index=-100``, no label smoothing or z-loss, and
``accum_dtype=float32`` so the lm_head gradient accumulates across chunks in FP32 as the chunked loss does.
Final-logit soft-capping and an lm_head bias are supported by the kernel; logit scaling is applied to the hidden
state by the caller (``families.ModelHead``). The import is lazy: hf_megatrain's core needs only torch.
"""

from __future__ import annotations

import torch

from . import fused_install
from .loss import IGNORE_INDEX

NAME = "liger"
PACKAGE = "liger-kernel"


def unavailable(device: torch.device) -> str | None:
    """Why this implementation cannot run on ``device`` (None when it can)."""
    return fused_install.unavailable(device, NAME, PACKAGE, "liger_kernel", _function)


def unsupported(*, bias: bool, softcap: float | None, dtype: torch.dtype = torch.float32) -> str | None:
    """Which head extra this implementation cannot honour (None: all of them)."""
    return None


def _function():
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    return LigerFusedLinearCrossEntropyFunction


def loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
             softcap: float | None) -> torch.Tensor:
    """Sum of the per-token losses over counted targets; hidden [N, H], weight [V, H], targets [N] (shifted)."""
    out = _function().apply(hidden.contiguous(), weight, targets, bias, None, IGNORE_INDEX, 0.0, 0.0, "sum",
                            softcap, False, torch.float32)
    return (out[0] if isinstance(out, tuple) else out).float()
