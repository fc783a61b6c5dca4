"""LeanAdamW: exact AdamW with global-norm clipping for a lean host store (12 bytes per streamed parameter).

Why this exists: the normal store keeps an FP32 gradient per parameter until ``optimizer.step()`` (4 of its 16-18
bytes), because global-norm clipping needs every gradient before any update. In a lean store (host_store.py) the
streamed layers have no gradient buffer: with one backward per step a layer's gradient is final when its backward
visit ends, so it is consumed right there, from one of the executor's two staging slabs, and dropped.

Each step runs in one of two modes, chosen from the previous step (host memory bandwidth is the cost that matters:
one pass over a parameter's master, gradient, m and v is the floor):

* **speculate** (the previous step did not clip): as each layer's backward ends, the whole AdamW update runs on it
  (the fused kernel, no clip factor, on a worker thread when ``overlap``): one pass, nothing left for ``step()``.
  When ``step()`` finds the global norm clips (or is non-finite, or the hyper-parameters changed since), each
  speculated layer is taken back: the master algebraically from its new moments (p = (p' + lr/bc1 m /
  (sqrt(v)/sqrt(bc2) + eps)) / (1 - lr wd), within an ulp), then the engine re-runs the step's forward+backward
  (same inputs, RNG, autocast, weights) and each regenerated gradient undoes the moments (m = (m' - (1-b1) g) /
  b1, v likewise) and redoes the update with the true clip factor (or only undoes, when the step is skipped).
* **norm first** (the previous step clipped; the first step when clipping is on): the backward only collects each
  layer's squared gradient norm (reduced on the device); ``step()`` then knows the clip factor and re-runs the
  forward+backward, each gradient getting its exact update as it lands. Twice the GPU work, one host pass.

A clipping step's forward+backward runs twice (counted in ``regenerated_steps``), a non-clipping step's once
(after the first step). Results match CPUAdamW to rounding, except after a speculated step turned out to clip:
its taken-back masters are within an ulp, so the re-run's gradients (and Adam's sign-like early updates of
near-zero gradient entries) may differ from an untouched run by ~1e-6 relative. A layer whose gradient is
non-finite is never updated (the step will be skipped), so a NaN loss leaves every weight and moment bit-identical
without a re-run. The resident unit (embeddings, final norm, lm_head) keeps its gradient buffer and steps exactly
as in ``CPUAdamW``.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Callable, Iterator

import torch

from ..core.store import HostStore, Unit
from .adamw import CPUAdamW

logger = logging.getLogger(__name__)

# Elements per chunk of the host-side undo / apply passes: bounds their temporaries to a few MiB per thread.
CHUNK = 1 << 22

GA_MESSAGE = ("lean_store: {what} before optimizer.step(). The lean store consumes each layer's gradient as its "
              "backward ends, so it supports exactly one backward per optimizer step: no gradient accumulation. "
              "Use micro_batch_size (splits the batch inside each layer visit: same math, one backward) with "
              "gradient_accumulation_steps=1, or lean_store=False.")

Key = tuple  # (grad_scale or None, (betas, lr, weight_decay, eps) per param group): what a unit's update assumed


def _noop() -> None:
    return None


class StepReplay:
    """One training forward kept until its step ends, so the step's forward+backward can run again exactly:
    the inputs, the RNG states and autocast state it started with, train/eval mode, and the gradients the backward
    fed into its outputs (the loss as the user scaled it, or the logits)."""

    def __init__(self, kwargs: dict[str, Any], device: torch.device, training: bool) -> None:
        self.kwargs = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        self.device = device
        self.training = training
        self.cpu_rng = torch.get_rng_state()
        self.dev_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                         for t in dict.fromkeys(("cpu", device.type))}
        self.grads: dict[str, torch.Tensor] = {}

    def watch(self, outputs: dict[str, torch.Tensor | None], on_backward: Callable[["StepReplay"], None]) -> None:
        """Capture the gradient each output receives; ``on_backward(self)`` runs when the first one arrives."""
        for name, t in outputs.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(partial(self._capture, name, on_backward))

    def _capture(self, name: str, on_backward: Callable[["StepReplay"], None], grad: torch.Tensor) -> None:
        on_backward(self)
        self.grads[name] = grad.detach().clone()

    @contextmanager
    def replaying(self, model: torch.nn.Module) -> Iterator[None]:
        """Run with the recorded RNG / autocast / mode and gradients on; the caller's RNG state is restored after,
        so the re-run draws no random numbers from the training's stream."""
        cuda = self.dev_rng is not None
        was_training = model.training
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[self.device] if cuda else [],
                                                      device_type="cuda" if cuda else "cpu"))
            torch.set_rng_state(self.cpu_rng)
            if cuda:
                torch.cuda.set_rng_state(self.dev_rng, self.device)
            for t, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(t, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            model.train(self.training)
            try:
                yield
            finally:
                model.train(was_training)

    def backward(self, outputs: dict[str, torch.Tensor | None]) -> None:
        pairs = [(outputs[n], g) for n, g in self.grads.items() if outputs.get(n) is not None]
        if not pairs:
            raise RuntimeError("lean_store: the recorded forward received no gradient; nothing to re-run")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class LeanAdamW(CPUAdamW):
    """``CPUAdamW`` for a lean store (see the module docstring). ``regenerate()`` re-runs the step's
    forward+backward (the engine's); the executor hands each layer gradient to ``lean_sink``; ``end_step()`` is
    called when a step's gradients are spent (applied, skipped or discarded)."""

    def __init__(self, store: HostStore, *, regenerate: Callable[[], None],
                 end_step: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        if self.device_stepper is not None:
            raise ValueError("lean_store: AdamW on the GPU (DeviceStepper) needs each layer's gradient until the "
                             "step; use device_step_layers=0")
        if any(g["eps"] <= 0 for g in self.param_groups):
            raise ValueError("lean_store needs eps > 0 (taking back a speculated update divides by sqrt(v) + eps)")
        self.regenerate = regenerate
        self.end_step = end_step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megatrain-lean") if self.overlap else None
        self._futures: list[Future] = []
        self._seen: set[int] = set()  # units whose gradient arrived this step (main thread)
        self._sq: dict[int, float] = {}  # unit -> squared norm of this step's gradient
        self._spec: dict[int, Key] = {}  # unit -> what its applied update assumed (absent: not updated this step)
        self._nonfinite: set[int] = set()  # units whose gradient was non-finite (never updated)
        # The next step's mode (module docstring): norm first after a step that clipped, and on the first step when
        # clipping is on, so a run that clips from the start never takes a master back.
        self.norm_first = bool(self.max_grad_norm and self.max_grad_norm > 0)
        self._step_mode: bool | None = None  # the mode of the step in progress (fixed by its first gradient)
        self._phase: tuple | None = None  # None: first pass; else (grad_scale, skip, hyper) of a re-run
        self._corrected: set[int] = set()
        self.regenerated_steps = 0  # steps whose forward+backward ran twice (clipped / skipped / discarded)
        self.max_regenerated_sq_error = 0.0  # largest relative change of a layer's squared norm in a re-run
        self._warned = False

    # -- gradients in -------------------------------------------------------------------------------------------------
    def lean_sink(self, unit: Unit, grad: torch.Tensor, sq: torch.Tensor, ready: Any) -> Callable[[], None]:
        """Called by the executor (main thread) when ``unit``'s gradient is on its way into the host slab ``grad``
        (``ready``: the D2H event). Returns a wait() that returns once the slab may be reused."""
        phase = self._phase
        if phase is None:
            if unit.index in self._seen:
                raise RuntimeError(GA_MESSAGE.format(what=f"layer unit {unit.index} received a second gradient"))
            if self._step_mode is None:
                self._step_mode = self.norm_first
            self._seen.add(unit.index)
        job = partial(self._consume, phase, self._step_mode, unit, grad, sq, ready)
        if self._pool is None:
            job()
            return _noop
        fut = self._pool.submit(job)
        self._futures.append(fut)
        return fut.result

    def _consume(self, phase: tuple | None, norm_only: bool, unit: Unit, grad: torch.Tensor, sq: torch.Tensor,
                 ready: Any) -> None:
        if ready is not None:
            ready.synchronize()  # the slab and the squared norm have landed
        s = float(sq)
        with torch.no_grad(), torch.profiler.record_function("megatrain.optimizer.lean_unit"):
            if phase is not None:
                self._correct(unit, grad, s, *phase)
                return
            self._sq[unit.index] = s
            if not math.isfinite(s):  # the global norm is non-finite too: the step is skipped, nothing to take back
                self._nonfinite.add(unit.index)
            elif not norm_only:
                hyper = self._hyper()
                self._update(unit, grad, hyper, None)
                self._spec[unit.index] = self._key(hyper, None)

    def _correct(self, unit: Unit, grad: torch.Tensor, sq: float, grad_scale: float | None, skip: bool,
                 hyper: list[dict]) -> None:
        """Re-run: ``grad`` is the regenerated gradient of ``unit``; give it the update the step really makes."""
        i = unit.index
        ref = self._sq.get(i)
        if ref is not None and math.isfinite(ref) and ref > 0:
            self.max_regenerated_sq_error = max(self.max_regenerated_sq_error, abs(sq - ref) / ref)
        self._corrected.add(i)
        want = self._key(hyper, grad_scale)
        if i in self._spec:
            if self._spec[i] == want and not skip:
                return  # this layer was updated right
            if not math.isfinite(sq):
                raise RuntimeError(f"lean_store: the re-run gave layer unit {i} a non-finite gradient where the "
                                   "first run's was finite (nondeterministic kernels?); its AdamW state cannot be "
                                   "corrected")
            self._undo_moments(unit, grad, self._spec.pop(i))  # (its master was taken back before the re-run)
        if not skip:  # (a non-finite layer reaches here only with skip_nonfinite=False: NaN propagates, as in CPUAdamW)
            self._update(unit, grad, hyper, grad_scale)
            self._spec[i] = want

    # -- the AdamW pieces --------------------------------------------------------------------------------------------
    @staticmethod
    def _key(hyper: list[dict], grad_scale: float | None) -> Key:
        return grad_scale, tuple((tuple(h["betas"]), h["lr"], h["weight_decay"], h["eps"]) for h in hyper)

    def _update(self, unit: Unit, grad: torch.Tensor, hyper: list[dict], grad_scale: float | None) -> None:
        """The whole AdamW update of ``unit`` (CPUAdamW's fused kernel; with ``grad_scale`` it unscales ``grad``
        in place)."""
        self._kernel(unit, [unit.master, grad, unit.exp_avg, unit.exp_avg_sq], hyper, grad_scale)

    def _ranges(self, unit: Unit, per_group: list[Any]) -> Iterator[tuple[int, int, Any]]:
        """(start, end, per_group[group]) over ``unit``'s flat buffers, adjacent slices merged, in CHUNK pieces."""
        spans = sorted((p.offset, p.offset + p.numel, self._group_of[g])
                       for g, slices in self._unit_groups[unit.index] for p in slices)
        merged: list[list[int]] = []
        for a, b, g in spans:
            if merged and merged[-1][1] == a and per_group[merged[-1][2]] == per_group[g]:
                merged[-1][1] = b
            else:
                merged.append([a, b, g])
        for a, b, g in merged:
            for c in range(a, b, CHUNK):
                yield c, min(c + CHUNK, b), per_group[g]

    def _undo_master(self, unit: Unit, key: Key) -> None:
        """Take back the master half of an update from the moments it used (before they are undone):
        p = (p' + lr/bc1 m / (sqrt(v)/sqrt(bc2) + eps)) / (1 - lr wd), the inverse of torch AdamW's formula."""
        t = float(self._counts[unit.index])
        per_group = []
        for betas, lr, wd, eps in key[1]:
            b1, b2 = betas
            per_group.append((lr, wd, eps, lr / (1 - b1 ** t), (1 - b2 ** t) ** 0.5))
        for a, b, (lr, wd, eps, step_size, bc2_sqrt) in self._ranges(unit, per_group):
            p, m, v = unit.master[a:b], unit.exp_avg[a:b], unit.exp_avg_sq[a:b]
            p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=step_size)
            if wd != 0:
                p.div_(1 - lr * wd)

    def _undo_moments(self, unit: Unit, grad: torch.Tensor, key: Key) -> None:
        """Invert a moments update: same float expressions as the fused CPU kernel (m b1 + g (1-b1);
        v b2 + g g (1-b2)), so an update from zero moments inverts to exactly zero."""
        grad_scale = key[0]
        if self._counts[unit.index] == 1:
            # First update of this unit: the moments were zero (the step count and the moments only ever change
            # together, checkpoints included), so undo exactly. (The rounding of the algebraic inverse would
            # otherwise be amplified by (applied / true clip factor)^2, largest on a first step that clips.)
            unit.exp_avg.zero_()
            unit.exp_avg_sq.zero_()
            self._counts[unit.index] = 0
            return
        for a, b, (b1, b2) in self._ranges(unit, [h[0] for h in key[1]]):
            g = grad[a:b] if grad_scale is None else grad[a:b] / grad_scale
            m, v = unit.exp_avg[a:b], unit.exp_avg_sq[a:b]
            if b1 > 0:
                m.sub_(g * (1 - b1)).div_(b1)
            else:
                m.zero_()
            if b2 > 0:
                v.sub_((g * g).mul_(1 - b2)).div_(b2).clamp_min_(0.0)
            else:
                v.zero_()
        self._counts[unit.index] -= 1

    # -- step ---------------------------------------------------------------------------------------------------------
    def grad_norm(self) -> float:
        norms = []
        for u in self.store.units:
            if u.grad is None:
                norms.append(torch.tensor(self._sq.get(u.index, 0.0), dtype=torch.float32).sqrt())
            else:
                norms.append((u.grad_sq.sqrt() if u.grad_sq is not None else
                              torch.linalg.vector_norm(self._grad(u))).cpu())
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def _sync(self) -> None:
        """Wait for every queued layer update; re-raise the first failure."""
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.wait()
        if self.before_step is not None:
            self.before_step()  # land the resident gradient; the executor releases its slabs
        self._sync()
        for u in self.store.units:
            if u.grad is not None and not u.grad_valid:
                u.grad.zero_()
                u.grad_sq = None
        norm = self.grad_norm()
        self.last_grad_norm = norm
        hyper = self._hyper()
        skip = not math.isfinite(norm) and self.skip_nonfinite
        grad_scale = None if skip else self._grad_scale(norm)
        want = self._key(hyper, grad_scale)
        stale = [i for i, k in self._spec.items() if skip or k != want]  # updated with the wrong assumptions
        pending = not skip and any(i not in self._spec for i in self._seen)  # not updated yet (norm first, NaN)
        if stale or pending:
            self._regenerate(grad_scale, skip, hyper, stale)
        if skip:
            self.skipped_steps += 1
            logger.warning("hf_megatrain: non-finite gradient norm (%s); optimizer step skipped, weights and "
                           "AdamW state untouched (%d skipped so far)", norm, self.skipped_steps)
            self._end()
            return loss
        for u in self.store.units:  # lean units no backward reached: zero gradient (as CPUAdamW)
            if u.grad is None and u.index not in self._seen:
                self._update(u, torch.zeros(u.numel, dtype=torch.float32), hyper, None)
        self.norm_first = grad_scale is not None
        self._end()
        self._launch(hyper, grad_scale)  # the resident unit (lean units are done)
        return loss

    def _regenerate(self, grad_scale: float | None, skip: bool, hyper: list[dict], stale: list[int]) -> None:
        self.regenerated_steps += 1
        if not self._warned:
            self._warned = True
            logger.warning("hf_megatrain: lean_store: this step clips (or is skipped): re-running its "
                           "forward+backward to give every layer its exact update. Every clipping step runs its "
                           "forward+backward twice (see README, 'Lean host store'); counted in "
                           "optimizer.regenerated_steps")
        logger.debug("lean_store: re-run %d (grad_scale %s, skip=%s, norm first=%s)", self.regenerated_steps,
                     grad_scale, skip, self._step_mode)
        for i in stale:  # the re-run must see the weights the first pass saw
            self._undo_master(self.store.units[i], self._spec[i])
        expected = set(self._spec) | (set() if skip else self._seen - self._nonfinite)
        if not skip and not self.skip_nonfinite:
            expected |= self._nonfinite
        self._corrected = set()
        self._phase = (grad_scale, skip, hyper)
        try:
            self.regenerate()
            self._sync()
        finally:
            self._phase = None
        missing = expected - self._corrected
        if missing:
            raise RuntimeError(f"lean_store: the re-run produced no gradient for layer units {sorted(missing)}; "
                               "their AdamW state could not be corrected")

    def _end(self) -> None:
        self._seen.clear()
        self._sq.clear()
        self._spec.clear()
        self._nonfinite.clear()
        self._step_mode = None
        self._invalidate_grads()
        if self.end_step is not None:
            self.end_step()

    def _run_host(self, order: list[int], hyper: list[dict], grad_scale: float | None) -> None:
        for i in order:
            u = self.store.units[i]
            if u.grad is not None:  # lean units were updated as their gradients arrived
                with torch.profiler.record_function("megatrain.optimizer.host_unit"):
                    self._kernel(u, [u.master, u.grad, u.exp_avg, u.exp_avg_sq], hyper, grad_scale)
                    self.store.sync_compute_(u)
            self._finish_unit(u)

    def hyper_state(self) -> dict:
        # The mode travels with checkpoints, so a resumed run takes the same path (bit-exact resume).
        return {**super().hyper_state(), "lean_norm_first": self.norm_first}

    def load_hyper_state(self, state: dict) -> None:
        super().load_hyper_state(state)
        self.norm_first = bool(state.get("lean_norm_first", state.get("lean_spec_grad_scale") is not None))

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Dropping a backward's gradients without a step: take back the updates it made."""
        if self._seen:
            with torch.no_grad():
                self.wait()
                if self.before_step is not None:
                    self.before_step()
                self._sync()
                if self._spec:
                    self._regenerate(None, True, self._hyper(), list(self._spec))
                self._end()
        super().zero_grad(set_to_none)
