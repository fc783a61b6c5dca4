"""AdamW on flat tensors: the update and its exact undo, shared by every stepper.

A unit's state is four flat FP32 buffers (master, grad, exp_avg, exp_avg_sq) wherever they live; its parameters
are spans of them, each in one hyper-parameter group (decayed or not, as Trainer splits them). Global-norm clipping
is folded in as ``grad_scale`` (each gradient is divided by it). Two implementations of the update (``HostKernel``):

- ``FUSED``: torch's fused AdamW kernel (``aten::_fused_adamw_``, CPU or CUDA by where the buffers are), then the
  compute copy as a second pass. On the host that is 34 bytes of DRAM traffic per parameter (38 when clipping: the
  kernel writes the unscaled gradient back).
- ``COMPILED``: the same formula (ATen's CPU expressions: lerp for the first moment, ``sqrt(v)/bc2_sqrt + eps``)
  as one inductor-generated vectorised OpenMP loop that also writes the compute copy: 30 bytes per parameter
  whatever the clipping (28 with a narrow gradient: a whole layer visit's bf16 values, read as the exact FP32
  they stand for; engine/offload.py), and one pass (the host AdamW is memory-bound: integration/host_adamw_rate.py). Compiled
  once for every size (dynamic shapes); hyper-parameters enter as 0-d tensors so an LR schedule never recompiles.

- ``NATIVE``: the same single pass as a C loop (core/native_adamw.py) called without the GIL: the overlapped
  optimizer then never stalls the Python thread that drives the backward (inductor's binding holds the GIL for
  the whole call).

A host update whose new weights the next forward waits for can be split in two (``UpdatePart``; NATIVE only):
``WEIGHTS`` computes the update and writes only the compute copy (reads 16 bytes per parameter, writes 2: ~60 % of
the whole pass's DRAM traffic), ``STATE`` later runs the same expressions again and writes master and moments, no
copy. Both halves evaluate the same float expressions on the same inputs, so the pair writes exactly the bits one
whole pass writes (tests/test_split_update.py); ``STATE`` must run before anything else reads or writes the unit's
master, moments or gradient (optim/split_update.py).

The undo functions invert the update for the lean store and speculative steps (optim/lean.py,
optim/speculative_step.py): the master from the new moments, the moments from the gradient they took.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from . import native_adamw
from .compiling import is_concurrent_trace

logger = logging.getLogger(__name__)

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


class HostKernel(enum.Enum):
    FUSED = "fused"
    COMPILED = "compiled"
    NATIVE = "native"  # core/native_adamw.py: the compiled kernel's pass as a C loop that releases the GIL


class UpdatePart(enum.Enum):
    WHOLE = "whole"  # master, moments and the compute copy in one pass
    WEIGHTS = "weights"  # the compute copy of the new master only (state untouched)
    STATE = "state"  # master and moments only (after WEIGHTS, with the same inputs)


def host_bytes_per_param(impl: HostKernel, clip: bool, copy_bytes: int, grad_bytes: int = 4,
                         part: UpdatePart = UpdatePart.WHOLE) -> int:
    """Host DRAM bytes one update moves per parameter (``copy_bytes``: the compute copy's element size, 0 if none;
    ``grad_bytes``: the gradient's, 2 when narrow): read master, grad, exp_avg, exp_avg_sq, write master and
    moments; the fused kernel writes the unscaled gradient back when clipping and its copy pass reads the master
    again. ``part``: a half of a split update (NATIVE)."""
    if part is UpdatePart.WEIGHTS:
        return 12 + grad_bytes + copy_bytes
    if part is UpdatePart.STATE:
        return 24 + grad_bytes
    if impl in (HostKernel.COMPILED, HostKernel.NATIVE):
        return 24 + grad_bytes + copy_bytes
    return 28 + (4 if clip else 0) + (4 + copy_bytes if copy_bytes else 0)


def adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           groups: Groups, step: int, grad_scale: float | None = None, compute: torch.Tensor | None = None,
           impl: HostKernel = HostKernel.FUSED, part: UpdatePart = UpdatePart.WHOLE,
           threads: int | None = None) -> None:
    """One AdamW update of every span (step count ``step``, already incremented), then ``compute`` (the unit's
    compute copy, if any) refreshed over the same spans. ``grad_scale``: the gradients are divided by it
    (clipping). ``COMPILED`` and ``NATIVE`` apply to host buffers; on a GPU the fused kernel runs. ``part``: one
    half of a split update (host buffers, ``NATIVE``; ``WEIGHTS`` needs ``compute``, ``STATE`` writes none).
    ``threads``: the native kernel's thread count for this update (None: torch's intra-op count)."""
    if part is not UpdatePart.WHOLE:
        if impl is not HostKernel.NATIVE or master.device.type != "cpu" or (part is UpdatePart.WEIGHTS) != (
                compute is not None):
            raise ValueError(f"a {part.value} half-update needs the native kernel on host buffers, with a compute "
                             f"copy for the weights half and none for the state half (got {impl.value}, "
                             f"{master.device.type}, copy {compute is not None})")
        for lo, hi, h, c, small in _spans_with_constants(groups, step, grad_scale):
            native_adamw.adamw_span_(master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                                     None if compute is None else compute[lo:hi], c, small,
                                     write_state=part is UpdatePart.STATE, threads=threads)
        return
    if impl is HostKernel.COMPILED and master.device.type == "cpu":
        _compiled_adamw_(master, grad, exp_avg, exp_avg_sq, groups, step, grad_scale, compute)
        return
    if impl is HostKernel.NATIVE and master.device.type == "cpu":
        for lo, hi, h, c, small in _spans_with_constants(groups, step, grad_scale):
            native_adamw.adamw_span_(master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                                     None if compute is None else compute[lo:hi], c, small, threads=threads)
        return
    device = master.device
    step_t = torch.full((1,), float(step), dtype=torch.float32, device=device)
    scale_t = None if grad_scale is None else torch.full((), grad_scale, dtype=torch.float32, device=device)
    for h, spans in groups:
        parts = [(lo, hi) for lo, hi in spans if hi > lo]
        if not parts:
            continue
        p, g, m, v = ([f[lo:hi] for lo, hi in parts] for f in (master, grad, exp_avg, exp_avg_sq))
        torch._fused_adamw_(p, g, m, v, [], [step_t] * len(parts), lr=h.lr, beta1=h.betas[0], beta2=h.betas[1],
                            weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False,
                            grad_scale=scale_t, found_inf=None)
    if compute is not None:
        for lo, hi, _ in _merged(groups):
            compute[lo:hi].copy_(master[lo:hi])


def _merged(groups: Groups, chunk: int = 0) -> Iterator[tuple[int, int, Hyper]]:
    """(start, end, hyper) over the spans, adjacent spans of equal hyper-parameters merged; ``chunk`` > 0 cuts
    them into pieces of at most that many elements."""
    spans = sorted((lo, hi, i) for i, (_, sp) in enumerate(groups) for lo, hi in sp if hi > lo)
    merged: list[list[int]] = []
    for lo, hi, i in spans:
        if merged and merged[-1][1] == lo and groups[merged[-1][2]][0] == groups[i][0]:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi, i])
    for lo, hi, i in merged:
        for c in range(lo, hi, chunk or (hi - lo)):
            yield c, min(c + (chunk or hi - lo), hi), groups[i][0]


# -- the compiled single-pass host kernel ------------------------------------------------------------------------------
def _adamw_math(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
                c: torch.Tensor, lerp_small: bool) -> None:
    """ATen's CPU AdamW expressions on one span; ``c`` = [wd_mul, 1-b1, b2, 1-b2, bc2_sqrt, eps, -step_size,
    grad_scale] (float32, narrowed from double as ATen does)."""
    g = g.to(torch.float32) / c[7]  # (a narrow gradient: its exact FP32 value first, as the FP32 buffer holds it)
    if lerp_small:  # exp_avg.lerp_(grad, 1 - b1) from the nearer endpoint, as ATen switches at weight 0.5
        m_new = m + c[1] * (g - m)
    else:
        m_new = g + (c[1] - 1) * (g - m)
    v_new = v * c[2] + c[3] * g * g
    p_new = p * c[0] + c[6] * m_new / (v_new.sqrt() / c[4] + c[5])
    m.copy_(m_new)
    v.copy_(v_new)
    p.copy_(p_new)
    if out is not None:
        out.copy_(p_new)


_compiled: Any = None
_compile_lock = threading.Lock()


def compiled_kernel() -> Any:
    """The inductor-compiled span update (``_adamw_math``), compiled on first use: what ``HostKernel.COMPILED``
    calls per span."""
    global _compiled
    with _compile_lock:  # (first use may come from an optimizer worker thread)
        if _compiled is None:
            _compiled = torch.compile(_adamw_math, dynamic=True, fullgraph=True)
        return _compiled


def warm_up(compute_dtype: torch.dtype | None) -> None:
    """Compile the host kernel now (main thread, seconds), for a unit with a compute copy of ``compute_dtype``
    (and a gradient in FP32 or, narrow, in that dtype);
    a RuntimeError that says what to do when it cannot be compiled here (no C++ compiler, ...)."""
    n = 64
    p, g, m, v = (torch.ones(n) for _ in range(4))
    out = None if compute_dtype is None else torch.empty(n, dtype=compute_dtype)
    try:
        for grad in (g, g.to(compute_dtype)) if compute_dtype is not None else (g,):  # (FP32 and narrow gradients)
            _compiled_adamw_(p, grad, m, v, [(Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0), [(0, n)])], 1, None, out)
    except Exception as e:
        raise RuntimeError(f"hf_megatrain: host_kernel='compiled' cannot be compiled on this machine "
                           f"({type(e).__name__}: {str(e)[:300]}); install a C++ compiler (g++) or use "
                           "host_kernel='fused'") from e


def warm_up_native() -> None:
    """Build the native kernel now and check it on a few elements against the fused one; a RuntimeError that says
    what to do when it cannot be built or disagrees."""
    n = 67
    h = [(Hyper(1e-3, (0.9, 0.999), 1e-8, 0.1), [(0, n)])]
    try:
        states = [[torch.linspace(-1, 1, n), torch.linspace(2, -2, n), torch.full((n,), 0.1), torch.full((n,), 0.2)]
                  for _ in range(2)]
        for impl, st in zip((HostKernel.FUSED, HostKernel.NATIVE), states):
            adamw_(*st, h, 3, None, None, impl)
        if not all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*states)):
            raise RuntimeError("its results differ from torch's fused AdamW")
    except Exception as e:
        raise RuntimeError(f"hf_megatrain: host_kernel='native' cannot run on this machine ({type(e).__name__}: "
                           f"{str(e)[:300]}); install a C compiler with OpenMP (gcc) or use host_kernel='fused'") from e


def _spans_with_constants(groups: Groups, step: int, grad_scale: float | None
                          ) -> Iterator[tuple[int, int, Hyper, torch.Tensor, bool]]:
    """The merged spans with each group's kernel constants (made once per group)."""
    consts: dict[Hyper, tuple[torch.Tensor, bool]] = {}
    for lo, hi, h in _merged(groups):
        c, small = consts.get(h) or consts.setdefault(h, _constants(h, step, grad_scale))
        yield lo, hi, h, c, small


def _constants(h: Hyper, step: int, grad_scale: float | None) -> tuple[torch.Tensor, bool]:
    b1, b2 = h.betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step  # (double, as ATen's prologue)
    c = torch.tensor([1 - h.lr * h.weight_decay, 1 - b1, b2, 1 - b2, bc2 ** 0.5, h.eps, -(h.lr / bc1),
                      1.0 if grad_scale is None else grad_scale], dtype=torch.float32)
    return c, abs(float(c[1])) < 0.5


def _compiled_adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     groups: Groups, step: int, grad_scale: float | None, compute: torch.Tensor | None) -> None:
    kernel = compiled_kernel()
    for lo, hi, h, c, small in _spans_with_constants(groups, step, grad_scale):
        out = None if compute is None else compute[lo:hi]
        try:
            kernel(master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], out, c, small)
        except RuntimeError as e:
            if not is_concurrent_trace(e):
                raise
            # The main thread is compiling a layer (core/compiling.py): this span, untouched, with torch's kernel,
            # on a copy of the gradient when clipping (that kernel writes the unscaled gradient back; this one's
            # callers may undo the update from the gradient later).
            g = grad[lo:hi]
            g = g.float() if g.dtype != torch.float32 else g.clone() if grad_scale is not None else g
            adamw_(master[lo:hi], g, exp_avg[lo:hi], exp_avg_sq[lo:hi], [(h, [(0, hi - lo)])], step, grad_scale,
                   None if compute is None else compute[lo:hi])


def undo_master_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, groups: Groups,
                 step: int) -> None:
    """Take back the master half of update number ``step`` from the moments it produced (call before the moments
    are undone): p = (p' + lr/bc1 m / (sqrt(v)/sqrt(bc2) + eps)) / (1 - lr wd), the inverse of torch AdamW's
    formula, within an ulp."""
    t = float(step)
    for a, b, h in _merged(groups, UNDO_CHUNK):
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
    for a, b, h in _merged(groups, UNDO_CHUNK):
        b1, b2 = h.betas
        g = grad[a:b].float()  # (a narrow gradient: its FP32 value, as the update took it)
        g = g if grad_scale is None else g / grad_scale
        m, v = exp_avg[a:b], exp_avg_sq[a:b]
        if b1 > 0:
            m.sub_(g * (1 - b1)).div_(b1)
        else:
            m.zero_()
        if b2 > 0:
            v.sub_((g * g).mul_(1 - b2)).div_(b2).clamp_min_(0.0)
        else:
            v.zero_()
