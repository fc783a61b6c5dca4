"""AdamW on flat tensors: the update and its exact undo, shared by every stepper.

A unit's state is four flat FP32 buffers (master, grad, exp_avg, exp_avg_sq) wherever they live; its parameters
are spans of them, each in one hyper-parameter group (decayed or not, as Trainer splits them). The update is torch's
fused AdamW kernel (``aten::_fused_adamw_``, CPU or CUDA by where the buffers are), with global-norm clipping
folded in as ``grad_scale`` (the kernel divides each gradient by it). The undo functions invert it for the lean
store (optim/lean.py): the master from the new moments, the moments from the gradient they took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

# Elements per piece of the undo passes: bounds their temporaries to a few MiB per thread.
UNDO_CHUNK = 1 << 22


@dataclass(frozen=True)
class Hyper:
    """One param group's hyper-parameters as a step used them (snapshotted: the scheduler may move them)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, group: dict) -> "Hyper":
        return cls(float(group["lr"]), tuple(group["betas"]), float(group["eps"]), float(group["weight_decay"]))


Spans = Sequence[tuple[int, int]]  # (start, end) element ranges of a flat buffer
Groups = Sequence[tuple[Hyper, Spans]]  # per param group of one unit: its hyper-parameters and spans


def adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           groups: Groups, step: int, grad_scale: float | None = None, chunk: int = 0,
           after_chunk: Callable[[int, int], None] | None = None) -> None:
    """One fused AdamW update of every span (step count ``step``, already incremented). ``grad_scale``: the
    gradients are divided by it (clipping; the kernel unscales ``grad`` in place). ``chunk`` > 0 updates in
    ranges of that many elements and calls ``after_chunk(a, b)`` after each (a copy written while the new master
    is still in cache)."""
    numel = master.numel()
    device = master.device
    step_t = torch.full((1,), float(step), dtype=torch.float32, device=device)
    scale_t = None if grad_scale is None else torch.full((), grad_scale, dtype=torch.float32, device=device)
    chunk = chunk if chunk > 0 else max(numel, 1)
    for a in range(0, numel, chunk):
        b = min(a + chunk, numel)
        for h, spans in groups:
            parts = [(max(lo, a), min(hi, b)) for lo, hi in spans]
            parts = [(lo, hi) for lo, hi in parts if hi > lo]
            if not parts:
                continue
            p, g, m, v = ([f[lo:hi] for lo, hi in parts] for f in (master, grad, exp_avg, exp_avg_sq))
            torch._fused_adamw_(p, g, m, v, [], [step_t] * len(parts), lr=h.lr, beta1=h.betas[0], beta2=h.betas[1],
                                weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False,
                                grad_scale=scale_t, found_inf=None)
        if after_chunk is not None:
            after_chunk(a, b)


def _pieces(groups: Groups) -> Iterator[tuple[int, int, Hyper]]:
    """(start, end, hyper) over the spans, adjacent spans of equal hyper-parameters merged, in UNDO_CHUNK pieces."""
    spans = sorted((lo, hi, i) for i, (_, sp) in enumerate(groups) for lo, hi in sp)
    merged: list[list[int]] = []
    for lo, hi, i in spans:
        if merged and merged[-1][1] == lo and groups[merged[-1][2]][0] == groups[i][0]:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi, i])
    for lo, hi, i in merged:
        for c in range(lo, hi, UNDO_CHUNK):
            yield c, min(c + UNDO_CHUNK, hi), groups[i][0]


def undo_master_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, groups: Groups,
                 step: int) -> None:
    """Take back the master half of update number ``step`` from the moments it produced (call before the moments
    are undone): p = (p' + lr/bc1 m / (sqrt(v)/sqrt(bc2) + eps)) / (1 - lr wd), the inverse of torch AdamW's
    formula, within an ulp."""
    t = float(step)
    for a, b, h in _pieces(groups):
        b1, b2 = h.betas
        step_size, bc2_sqrt = h.lr / (1 - b1 ** t), (1 - b2 ** t) ** 0.5
        p, m, v = master[a:b], exp_avg[a:b], exp_avg_sq[a:b]
        p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(h.eps), value=step_size)
        if h.weight_decay != 0:
            p.div_(1 - h.lr * h.weight_decay)


def undo_moments_(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, groups: Groups,
                  step: int, grad_scale: float | None) -> None:
    """Invert the moments half of update number ``step`` that took ``grad`` (divided by ``grad_scale``). The
    first update started from zero moments (step counts and moments only ever change together, checkpoints
    included), so it is undone exactly; later ones with the fused CPU kernel's own float expressions
    (m b1 + g (1-b1); v b2 + g g (1-b2))."""
    if step == 1:
        exp_avg.zero_()
        exp_avg_sq.zero_()
        return
    for a, b, h in _pieces(groups):
        b1, b2 = h.betas
        g = grad[a:b] if grad_scale is None else grad[a:b] / grad_scale
        m, v = exp_avg[a:b], exp_avg_sq[a:b]
        if b1 > 0:
            m.sub_(g * (1 - b1)).div_(b1)
        else:
            m.zero_()
        if b2 > 0:
            v.sub_((g * g).mul_(1 - b2)).div_(b2).clamp_min_(0.0)
        else:
            v.zero_()
