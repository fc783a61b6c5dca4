"""``loss_impl="cce"``: Apple's Cut Cross-Entropy (Triton, CUDA only).

CCE never writes the [tokens, vocab] logits to memory: it computes the log-sum-exp and the label logit in SRAM and
recomputes blocks of logits in the backward. Called with ``reduction="sum"`` (the caller divides by HF's
normalizer), ``ignore_index=-100``, ``shift=False`` (targets come shifted) and ``filter_eps=None``: CCE's default
gradient filtering skips vocabulary blocks whose softmax is below a threshold, an approximation that would make the
gradients differ from HF's; off, they are exact up to rounding. Soft-capping is supported; an lm_head *bias* is
not (CCE's API has none), so a biased head is refused here (``auto`` then keeps the chunked loss). Logit scaling is
applied to the hidden state by the caller. The import is lazy: hf_megatrain's core needs only torch.
"""

from __future__ import annotations

import torch

from . import fused_install
from .loss import IGNORE_INDEX

NAME = "cce"
PACKAGE = "cut-cross-entropy"


def unavailable(device: torch.device) -> str | None:
    """Why this implementation cannot run on ``device`` (None when it can)."""
    return fused_install.unavailable(device, NAME, PACKAGE, "cut_cross_entropy", _function)


def unsupported(*, bias: bool, softcap: float | None, dtype: torch.dtype = torch.float32) -> str | None:
    """Which head extra or compute dtype this implementation cannot honour (None: all of them)."""
    if bias:
        return "the lm_head has a bias, which Cut Cross-Entropy's linear_cross_entropy does not take"
    if dtype == torch.float32:
        # Measured on the H100: fp32 inputs gave a loss and gradients ~1e-3..1e-2 off the chunked fp32 loss
        # (tests/test_loss_impl_gpu.py): an fp32 run would train with bf16-grade head gradients without saying so.
        return "its kernels compute in reduced precision, so an fp32 model (compute_dtype float32) would get " \
               "head gradients ~1e-2 off the exact loss; use it with compute_dtype bfloat16"
    return None


def _function():
    from cut_cross_entropy import linear_cross_entropy
    return linear_cross_entropy


def loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
             softcap: float | None) -> torch.Tensor:
    """Sum of the per-token losses over counted targets; hidden [N, H], weight [V, H], targets [N] (shifted)."""
    if bias is not None:
        raise NotImplementedError(unsupported(bias=True, softcap=softcap))
    # CCE takes one dtype for both operands (the lm_head GEMM's compute dtype)
    loss = _function()(hidden.contiguous(), weight.to(hidden.dtype), targets, ignore_index=IGNORE_INDEX,
                       softcap=softcap, reduction="sum", shift=False, filter_eps=None, impl="cce")
    return loss.float()
