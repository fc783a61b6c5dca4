"""Causal-LM loss without ever materialising the full [tokens, vocab] logits.

The forward walks the tokens in chunks of ``chunk_tokens``; for each chunk it forms the logits, the loss terms
and, when gradients are needed, the chunk's gradients w.r.t. the hidden states and the lm_head weight, which it
keeps. The backward only scales them by the incoming gradient. Peak extra memory is one [chunk, vocab] block.

Semantics follow transformers' ``ForCausalLMLoss``: labels shifted left by one, ``-100`` ignored, logits upcast
to fp32, sum / ``num_items_in_batch`` when given (Trainer's normalisation across gradient accumulation), mean
over counted tokens otherwise (nan when no token counts, as HF). Gemma-style final logit soft-capping is applied
when ``softcap`` is set.

``compiled``: the chunk's loss and logit gradient come from one ``torch.compile``d function (``_ce_chunk``) that
reads the [chunk, vocab] logits once and writes their gradient once, instead of autograd's chain of fp32 copies,
log-softmax, NLL and casts (~8x the memory traffic; ~100 ms per step at 32k tokens and a 152k vocabulary).
Same math, fp32 throughout; eager mode keeps the autograd chain (bit-for-bit HF). The chunk's token count is a
dynamic dimension (core/compiling.py): the last, shorter chunk of every batch length runs the same graph.

``module_cross_entropy``: the same chunking for a head whose forward applies parameters of its own besides the
projection (Dory's learned per-token logit scale): per chunk, autograd over the head's own forward (exact, unfused),
the gradients of the hidden chunk and of those parameters kept. ``shift=False`` everywhere: labels already aligned
with the positions (a forward's own unshifted loss, head_config.OWN_LOSS_FORMS).

``stats``: a ``TokenStats`` to fill, per counted token, with what TRL's SFT trainer logs from its logits (entropy
of the next-token distribution, whether the label is its first argmax): read off each chunk's logits while they
exist, so no second lm_head pass. ``token_stats`` is that pass on its own, for the fused implementations
(``loss_impl``) that never form the logits.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from ..core.compiling import CompiledCall, mark_token_dims

IGNORE_INDEX = -100
logger = logging.getLogger(__name__)


class TokenStats:
    """Sums over counted tokens (fp32, on the loss's device): entropy, top-1 hits, count. No gradient."""

    def __init__(self) -> None:
        self.entropy_sum: torch.Tensor | float = 0.0
        self.correct: torch.Tensor | float = 0.0
        self.count: torch.Tensor | float = 0.0

    @torch.no_grad()
    def add(self, zf: torch.Tensor, t: torch.Tensor) -> None:
        """zf [n, V] final fp32 logits (soft-capped), t [n] targets (-100 ignored)."""
        zf = zf.detach().float()
        valid = t != IGNORE_INDEX
        lse = torch.logsumexp(zf, dim=-1)
        entropy = lse - (torch.softmax(zf, dim=-1) * zf).sum(-1)  # H = log Z - E_p[z]
        # argmax returns the first maximum: a tie with an earlier token is not a hit (as TRL's is_top1)
        hit = zf.argmax(-1) == t
        self.entropy_sum = self.entropy_sum + (entropy * valid).sum()
        self.correct = self.correct + (hit & valid).sum().float()
        self.count = self.count + valid.sum().float()


def _final_logits(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    zf = z.float()
    return torch.tanh(zf / softcap) * softcap if softcap else zf


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """[B, T] labels -> [B, T] targets where position t predicts token t+1 (last position ignored)."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
    z = torch.nn.functional.linear(h, weight, bias)  # [n, V] compute dtype, like the HF lm_head
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z


def _ce_chunk(z: torch.Tensor, t: torch.Tensor, inv_norm: torch.Tensor,
              softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum over one chunk and d(loss * inv_norm)/dz. z [n, V] compute dtype, t [n], inv_norm [] fp32."""
    zf = z.float()
    if softcap:
        th = torch.tanh(zf / softcap)
        zf = th * softcap
    valid = t != IGNORE_INDEX
    tc = torch.where(valid, t, 0)
    lse = torch.logsumexp(zf, dim=-1)  # [n]
    loss = ((lse - zf.gather(1, tc[:, None]).squeeze(1)) * valid).sum()
    onehot = torch.arange(zf.shape[1], device=z.device)[None, :] == tc[:, None]  # [n, V]
    g = (torch.exp(zf - lse[:, None]) - onehot.float()) * (valid.float() * inv_norm)[:, None]
    if softcap:
        g = g * (1 - th * th)
    return loss, g.to(z.dtype)


_ce_chunk_compiled = CompiledCall(_ce_chunk, _ce_chunk, "the loss's compiled chunk", logger.warning)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, normalizer, chunk, softcap, compiled,  # type: ignore[override]
                stats):
        # hidden [N, H], weight [V, H], bias [V] | None, targets [N]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # a tensor (no recompiles); inf where no token counts (the loss is then nan: see linear_cross_entropy)
        inv_norm = torch.full((), 1.0 / normalizer if normalizer else math.inf, dtype=torch.float32,
                              device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        grad_b = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                  if need_grad and bias is not None else None)
        for a in range(0, hidden.shape[0], chunk):
            t = targets[a:a + chunk]
            if not need_grad:
                z = _logits(hidden[a:a + chunk], weight, bias, softcap).float()
                total += torch.nn.functional.cross_entropy(z, t, ignore_index=IGNORE_INDEX, reduction="sum")
                if stats is not None:
                    stats.add(z, t)
                continue
            if compiled:
                h = hidden[a:a + chunk]
                z = _logits(h, weight, bias, None)
                mark_token_dims(z.shape[0], z.shape[0], (z, t))  # (the vocab dim stays static)
                part, gz = _ce_chunk_compiled(z, t, inv_norm, softcap)  # gz [n, V]
                total += part
                if stats is not None:
                    stats.add(_final_logits(z, softcap), t)
                grad_h[a:a + chunk] = gz @ weight
                grad_w.add_(gz.t() @ h)  # compute-dtype GEMM, FP32 accumulation across chunks (as autograd's)
                if grad_b is not None:
                    grad_b.add_(gz.sum(0))
                continue
            # Per chunk, autograd over exactly the ops HF's loss runs (so fp32 results match it bit for bit
            # when one chunk covers the batch); the graph dies with the chunk.
            with torch.enable_grad():
                h = hidden[a:a + chunk].detach().requires_grad_()
                w = weight.detach().requires_grad_()
                b = bias.detach().requires_grad_() if bias is not None else None
                z = _logits(h, w, b, softcap).float()  # [n, V]
                part = torch.nn.functional.cross_entropy(z, t, ignore_index=IGNORE_INDEX, reduction="sum")
                grads = torch.autograd.grad(part / normalizer, [h, w] + ([b] if b is not None else []))
            total += part.detach()
            if stats is not None:
                stats.add(z, t)
            grad_h[a:a + chunk] = grads[0]
            grad_w.add_(grads[1])
            if grad_b is not None:
                grad_b.add_(grads[2])
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        gh = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * scale).to(ctx.dtypes[0]) if grad_w is not None else None
        gb = (grad_b * scale).to(ctx.dtypes[1]) if grad_b is not None else None
        return gh, gw, gb, None, None, None, None, None, None


def prepare_targets(hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None,
                    shift: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(hidden [N, H], targets [N], normalizer): HF's shift and normalisation, shared by every ``loss_impl``.

    No counted token (every label -100) gives a normalizer of 0, so the loss is 0 / 0 = nan, as HF's loss gives
    (mean over nothing, or a sum over a num_items_in_batch of 0), never a "perfect" 0.0; the gradients are nan
    too, so the optimizer skips the step."""
    targets = shift_labels(labels) if shift else labels
    targets = targets.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        normalizer = float((targets != IGNORE_INDEX).sum().item())
    else:
        normalizer = float(num_items_in_batch.item() if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return flat, targets, normalizer


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, num_items_in_batch: torch.Tensor | int | None = None,
                         chunk_tokens: int = 4096, softcap: float | None = None,
                         shift: bool = True, compiled: bool = False, stats: TokenStats | None = None) -> torch.Tensor:
    """Loss of ``lm_head(hidden)`` against ``labels`` ([B, T] hidden [B, T, H]); see the module docstring."""
    flat, targets, normalizer = prepare_targets(hidden, labels, num_items_in_batch, shift)
    return _LinearCrossEntropy.apply(flat, weight, bias, targets, normalizer, chunk_tokens, softcap, compiled, stats)


class _HeadCrossEntropy(torch.autograd.Function):
    """The loss through a head *function* ``z = fn(h)`` (the output embeddings' own forward and what follows it),
    chunk by chunk: autograd over exactly the ops the model's head runs, per chunk, with the gradients of the
    hidden chunk and of every parameter ``fn`` reads kept (FP32-accumulated across chunks) and the chunk's graph
    freed. ``params`` are inputs of the Function, so its backward hands their gradients to autograd."""

    @staticmethod
    def forward(ctx, hidden, targets, normalizer, chunk, fn, stats, *params):  # type: ignore[override]
        need_grad = any(ctx.needs_input_grad[i] for i in [0] + list(range(6, 6 + len(params))))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad else None
        grad_p = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params] if need_grad else []
        for a in range(0, hidden.shape[0], chunk):
            t = targets[a:a + chunk]
            with torch.enable_grad() if need_grad else torch.no_grad():
                h = hidden[a:a + chunk].detach().requires_grad_(need_grad)
                z = fn(h).float()  # [n, V]
                part = torch.nn.functional.cross_entropy(z, t, ignore_index=IGNORE_INDEX, reduction="sum")
                grads = torch.autograd.grad(part / normalizer, [h, *params], allow_unused=True) if need_grad else ()
            total += part.detach()
            if stats is not None:
                stats.add(z, t)
            if need_grad:
                grad_h[a:a + chunk] = grads[0]
                for acc, g in zip(grad_p, grads[1:]):
                    if g is not None:
                        acc.add_(g)
        ctx.save_for_backward(grad_h, *grad_p)
        ctx.dtypes = [p.dtype for p in params]
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grad_h, *grad_p = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        gh = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        gp = [(g * scale).to(dt) for g, dt in zip(grad_p, ctx.dtypes)] if grad_p else [None] * len(ctx.dtypes)
        return (gh, None, None, None, None, None, *gp)


def module_cross_entropy(hidden: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
                         params: list[torch.Tensor], labels: torch.Tensor, *,
                         num_items_in_batch: torch.Tensor | int | None = None, chunk_tokens: int = 4096,
                         stats: TokenStats | None = None, shift: bool = True) -> torch.Tensor:
    """Loss of ``fn(hidden)`` against ``labels`` ([B, T], hidden [B, T, H]) where ``fn`` maps hidden rows to final
    logits through the model's own head (Dory's ``logit_scale`` after the projection) and reads ``params`` (its
    trainable parameters): the exact unfused path, one ``[chunk, vocab]`` block at a time (``_HeadCrossEntropy``).
    Same shift and normalisation as ``linear_cross_entropy``."""
    flat, targets, normalizer = prepare_targets(hidden, labels, num_items_in_batch, shift)
    return _HeadCrossEntropy.apply(flat, targets, normalizer, chunk_tokens, fn, stats, *params)


@torch.no_grad()
def token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, stats: TokenStats, *,
                bias: torch.Tensor | None = None, chunk_tokens: int = 4096, softcap: float | None = None) -> None:
    """Fill ``stats`` from ``hidden`` [N, H] and shifted ``targets`` [N] in one no-grad chunked lm_head pass."""
    for a in range(0, hidden.shape[0], chunk_tokens):
        t = targets[a:a + chunk_tokens]
        if bool((t != IGNORE_INDEX).any()):
            stats.add(_logits(hidden[a:a + chunk_tokens], weight, bias, softcap), t)
