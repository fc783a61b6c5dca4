"""Which cross-entropy implementation computes the head loss: one implementation per module behind ``LossImpl``.

- ``chunked`` (``loss.py``): hf_megatrain's own chunked linear cross-entropy; pure PyTorch, every device, the CPU
  path, bit-for-bit HF in eager fp32; optionally ``torch.compile``d per chunk.
- ``liger`` (``loss_liger.py``): Liger-Kernel's fused linear cross-entropy (Triton, CUDA).
- ``cce`` (``loss_cce.py``): Apple's Cut Cross-Entropy (Triton, CUDA; no lm_head bias).
- ``auto``: the first fused implementation that is installed, runs on the device and honours the model's head
  extras (liger, then cce), else ``chunked``. Explicitly naming one that cannot run is an error, never a silent
  fallback.

Every implementation gets the same inputs from ``prepare_targets`` (HF's shift, ``-100`` ignored, sum divided by
``num_items_in_batch`` or the counted tokens; nan when nothing counts) and the same head extras: logit scaling is
applied to the hidden state before this point, soft-capping is passed to the kernel. The fused ones never form
the logits, so the SFT metrics (``TokenStats``) take one extra no-grad chunked pass with them.

A head whose forward applies parameters of its own besides ``weight`` / ``bias`` (Dory's learned per-token logit
scale after the projection) is no fused kernel's ``weight @ h``: ``choose`` is told why (``unfused``) and the loss
runs the head's own forward chunk by chunk (``loss.module_cross_entropy``), exact, one ``[chunk, vocab]`` block at a
time; the reason is logged with the choice. (A transform *before* the projection -- ModernBERT-decoder's dense ->
act -> norm -- is applied by the model's own forward, model/multimodal.py ``ModelForwardRun``, and stays fusable.)
"""

from __future__ import annotations

import enum
import logging
from types import ModuleType
from typing import Callable

import torch

from . import loss_cce, loss_liger
from .loss import IGNORE_INDEX, TokenStats, linear_cross_entropy, module_cross_entropy, prepare_targets, token_stats

logger = logging.getLogger(__name__)


class LossImpl(str, enum.Enum):
    AUTO = "auto"
    CHUNKED = "chunked"
    LIGER = "liger"
    CCE = "cce"


FUSED: dict[LossImpl, ModuleType] = {LossImpl.LIGER: loss_liger, LossImpl.CCE: loss_cce}
# What ``auto`` may pick, in order. Measured on the H100 (integration/results/bench_loss/2026-11-23_6c2de76_bench_loss_h100.json, hidden 5120,
# vocab 152064, bf16): Liger 245 ms / +4.7 GiB vs the compiled chunked loss's 260 ms / +7.9 GiB at 32k tokens
# (90 vs 65 ms at 8k), gradients as close to fp32 as the chunked loss's. Cut Cross-Entropy used the least memory
# (+1.8 GiB) but took 811 ms at 32k and its hidden-state gradient was 5x further from fp32: only when asked for.
AUTO_ORDER = (LossImpl.LIGER,)


def choose(requested: str | LossImpl, device: torch.device, *, bias: bool, softcap: float | None,
           dtype: torch.dtype = torch.float32, fused: dict[LossImpl, ModuleType] | None = None,
           unfused: str | None = None) -> tuple[LossImpl, str]:
    """(implementation, why) for ``requested`` on ``device`` with this head and compute ``dtype``. ``fused``
    replaces ``FUSED`` (tests; then every entry is auto's candidate, in order). ``unfused``: why this head cannot
    be a fused kernel's ``weight @ h`` (its forward applies parameters of its own): the chunked loss through the
    head's forward (``module_cross_entropy``), and an error where a fused one is named."""
    order = AUTO_ORDER if fused is None else tuple(fused)
    fused = FUSED if fused is None else fused
    want = LossImpl(requested)
    if unfused is not None:
        if want not in (LossImpl.AUTO, LossImpl.CHUNKED):
            raise ValueError(f"loss_impl={want.value!r} cannot be used: {unfused}, which no fused kernel applies. "
                             "Use loss_impl='auto' or 'chunked' (the exact unfused path through the head's forward).")
        return LossImpl.CHUNKED, f"loss_impl={want.value!r}: chunked and unfused ({unfused}: its forward, per chunk)"
    if want is LossImpl.CHUNKED:
        return want, "loss_impl='chunked'"
    if want is not LossImpl.AUTO:
        mod = fused[want]
        why = mod.unavailable(device) or mod.unsupported(bias=bias, softcap=softcap, dtype=dtype)
        if why:
            raise ValueError(f"loss_impl={want.value!r} cannot be used: {why}. Use loss_impl='auto' (a fused loss "
                             "when one can run, else the chunked loss) or 'chunked'.")
        return want, f"loss_impl={want.value!r}"
    skipped = []
    for impl in order:
        mod = fused[impl]
        why = mod.unavailable(device) or mod.unsupported(bias=bias, softcap=softcap, dtype=dtype)
        if why is None:
            return impl, f"loss_impl='auto': {impl.value} ({mod.PACKAGE}) is installed and runs on {device}"
        skipped.append(f"{impl.value}: {why}")
    return LossImpl.CHUNKED, "loss_impl='auto' chose chunked (" + "; ".join(skipped) + ")"


def head_loss(impl: LossImpl, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
              bias: torch.Tensor | None, num_items_in_batch: torch.Tensor | int | None, chunk_tokens: int,
              softcap: float | None, compiled: bool = False, stats: TokenStats | None = None,
              fused: dict[LossImpl, ModuleType] | None = None,
              head_fn: tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]] | None = None,
              shift: bool = True) -> torch.Tensor:
    """Causal-LM loss of ``lm_head(hidden)`` against ``labels`` ([B, T]) by ``impl`` (a ``choose`` result).
    ``head_fn``: ``(fn, params)`` for a head chosen ``unfused``: ``fn`` maps hidden rows to the final logits through
    the head's own forward (``weight``, ``bias`` and ``softcap`` are then not used), ``params`` its trainable
    parameters. ``shift=False``: labels[..., i] is the target of position i (a forward's own unshifted loss,
    head_config.OWN_LOSS_FORMS)."""
    if head_fn is not None:
        return module_cross_entropy(hidden, head_fn[0], head_fn[1], labels, num_items_in_batch=num_items_in_batch,
                                    chunk_tokens=chunk_tokens, stats=stats, shift=shift)
    if impl is LossImpl.CHUNKED:
        return linear_cross_entropy(hidden, weight, labels, bias=bias, num_items_in_batch=num_items_in_batch,
                                    chunk_tokens=chunk_tokens, softcap=softcap, compiled=compiled, stats=stats,
                                    shift=shift)
    mod = (FUSED if fused is None else fused)[impl]
    flat, targets, normalizer = prepare_targets(hidden, labels, num_items_in_batch, shift)
    if stats is not None:
        token_stats(flat.detach(), weight.detach(), targets, stats,
                    bias=bias.detach() if bias is not None else None, chunk_tokens=chunk_tokens, softcap=softcap)
    if not normalizer or not bool((targets != IGNORE_INDEX).any()):
        # Nothing counts: nan loss and nan gradients (the optimizer skips the step), as the chunked loss and HF;
        # the kernels are not asked to reduce over zero rows.
        nan = float("nan")
        return (flat.sum() * nan + weight.sum() * nan + (bias.sum() * nan if bias is not None else 0.0)).float()
    return mod.loss_sum(flat, weight, bias, targets, softcap) / normalizer
