"""CPUAdamW: AdamW over the host store's FP32 master, one fused kernel call per unit.

A real ``torch.optim.Optimizer``: ``param_groups`` hold the master views (group 0 decayed, group 1 not, as
Trainer splits them), so LR schedulers drive it unchanged. The kernel is torch's fused AdamW
(``aten::_fused_adamw_``, CPU or CUDA by where the unit lives); global gradient-norm clipping is folded into it as
``grad_scale`` (the kernel divides each gradient by it) instead of a separate pass that rewrites the gradients,
and a non-finite norm skips the step with master weights and moments untouched.

With ``overlap=True``, ``step()`` computes the norm, snapshots the hyper-parameters and returns; worker threads
then step units in the order the next forward consumes them (resident first, then layer 0, 1, ...) and the
executor waits per layer for its unit only. Units handed to a ``DeviceStepper`` are stepped on the GPU by a
second worker at the same time. The math is identical: every unit uses the same norm, LR and kernel.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Iterable

import torch

from .device_stepper import DeviceStepper
from ..core.store import HostStore, ParamSlice, Unit

logger = logging.getLogger(__name__)


class CPUAdamW(torch.optim.Optimizer):
    def __init__(self, store: HostStore, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = None,
                 unit_order: list[int] | None = None, skip_nonfinite: bool = True, overlap: bool = False,
                 before_step: Callable[[], None] | None = None,
                 after_unit: Callable[[Unit], None] | None = None,
                 device_stepper: DeviceStepper | None = None, host_chunk: int = 0) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        self.store = store
        decay, no_decay = [], []
        # unit index -> [(0 = decayed | 1 = not, slices)]: the kernel runs on views of whichever flat buffers
        # hold the unit's state at step time (host, or the device stepper's).
        self._unit_groups: dict[int, list[tuple[int, list[ParamSlice]]]] = {}
        for unit in store.units:
            per_group: dict[int, list[ParamSlice]] = {}
            for p in unit.params:
                g = 0 if p.decay else 1
                view = unit.view(unit.master, p)
                if unit.grad is not None:  # (a lean store's streamed units have no host gradient: lean_step.py)
                    view.grad = unit.view(unit.grad, p)
                (decay if g == 0 else no_decay).append(view)
                per_group.setdefault(g, []).append(p)
            self._unit_groups[unit.index] = sorted(per_group.items())
        if not decay and not no_decay:
            raise ValueError("CPUAdamW: the host store holds no trainable parameters")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self._group_of = {}  # 0 = decayed, 1 = not decayed -> index into self.param_groups
        for g, group in enumerate(groups):
            if group["params"]:
                self._group_of[g] = len(self._group_of)
        super().__init__([g for g in groups if g["params"]], defaults)
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.unit_order = unit_order or list(range(len(store.units)))
        self.overlap = overlap
        self.before_step = before_step
        self.after_unit = after_unit
        self.device_stepper = device_stepper
        # Host units may be stepped in chunks of this many elements, each chunk's compute-dtype copy written right
        # after its update while the new master is still in cache (one pass over host memory instead of two).
        # Measured on the H100 box (integration/PERF.md) it is slower from the overlap thread: every chunk pays
        # OpenMP fork/join for ~10 small kernel calls. 0 = whole unit, then one copy pass (the default).
        self.host_chunk = host_chunk
        self._on_device = {u.index for u in device_stepper.units} if device_stepper else set()
        self._counts = [0] * len(store.units)  # AdamW step count per unit
        self.skipped_steps = 0
        # Wall time of the last *finished* step's unit updates (worker threads when overlapped); published by
        # wait(), so reading it right after step() returns gives the previous step, never a partial figure.
        self.last_step_seconds = 0.0
        self._running_seconds = 0.0
        self.last_norm_seconds = 0.0
        self.last_grad_norm: float | None = None
        self._done = [threading.Event() for _ in store.units]
        for e in self._done:
            e.set()
        self._workers: list[threading.Thread] = []
        self._error: BaseException | None = None

    # -- gradient norm -------------------------------------------------------------------------------------------------
    @staticmethod
    def _grad(u: Unit) -> torch.Tensor:
        return u.grad_device if u.grad_device is not None else u.grad

    def grad_norm(self) -> float:
        """Global L2 norm of all gradients (per-unit norms, then the norm of norms, like clip_grad_norm_)."""
        norms = torch.stack([(u.grad_sq.sqrt() if u.grad_sq is not None else
                              torch.linalg.vector_norm(self._grad(u))).cpu() for u in self.store.units])
        return float(torch.linalg.vector_norm(norms))

    # -- step --------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.wait()
        if self.before_step is not None:
            self.before_step()  # land in-flight gradients
        for u in self.store.units:
            if not u.grad_valid:  # no backward touched this unit since the last step: its gradient is zero
                self._grad(u).zero_()
                u.grad_sq = None
        t0 = time.perf_counter()
        norm = self.grad_norm()
        self.last_norm_seconds = time.perf_counter() - t0
        self.last_grad_norm = norm
        if not math.isfinite(norm) and self.skip_nonfinite:
            self.skipped_steps += 1
            logger.warning("hf_megatrain: non-finite gradient norm (%s); optimizer step skipped, weights and "
                           "AdamW state untouched (%d skipped so far)", norm, self.skipped_steps)
            self._invalidate_grads()
            return loss
        self._launch(self._hyper(), self._grad_scale(norm))
        return loss

    def _grad_scale(self, norm: float) -> float | None:
        """The kernel's ``grad_scale`` for global-norm clipping at ``norm`` (None: no clipping applies)."""
        scale = 1.0
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            scale = min(self.max_grad_norm / (norm + 1e-6), 1.0)
        return 1.0 / scale if scale < 1.0 else None

    def _hyper(self) -> list[dict]:
        """Snapshot of each param group's hyper-parameters (the LR scheduler may change them mid-step)."""
        return [dict(lr=float(g["lr"]), betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
                for g in self.param_groups]

    def _launch(self, hyper: list[dict], grad_scale: float | None) -> None:
        """Step every unit (host worker + device worker), overlapped or not."""
        host = [i for i in self.unit_order if i not in self._on_device]
        dev = [i for i in self.unit_order if i in self._on_device]
        jobs = [(self._run_host, host)] + ([(self._run_device, dev)] if dev else [])
        t0 = time.perf_counter()
        self._running_seconds = 0.0
        if self.overlap:
            for e in self._done:
                e.clear()
            self._workers = [threading.Thread(target=self._guard, args=(fn, order, hyper, grad_scale, t0),
                                              daemon=True) for fn, order in jobs]
            for w in self._workers:
                w.start()
        else:
            for fn, order in jobs:
                self._guard(fn, order, hyper, grad_scale, t0)
            self.last_step_seconds = self._running_seconds

    def _guard(self, fn: Callable, order: list[int], hyper: list[dict], grad_scale: float | None,
               t0: float) -> None:
        try:
            fn(order, hyper, grad_scale)
            self._running_seconds = max(self._running_seconds, time.perf_counter() - t0)
        except BaseException as e:  # surfaced by wait()
            self._error = e
            for ev in self._done:
                ev.set()

    def _run_host(self, order: list[int], hyper: list[dict], grad_scale: float | None) -> None:
        for i in order:
            u = self.store.units[i]
            with torch.profiler.record_function("megatrain.optimizer.host_unit"):
                copy = u.compute is not u.master
                chunk = self.host_chunk if self.host_chunk > 0 else u.numel
                after = (lambda a, b, u=u: u.compute[a:b].copy_(u.master[a:b])) if copy else None
                self._kernel(u, [u.master, u.grad, u.exp_avg, u.exp_avg_sq], hyper, grad_scale, chunk, after)
            self._finish_unit(u)

    def _run_device(self, order: list[int], hyper: list[dict], grad_scale: float | None) -> None:
        assert self.device_stepper is not None
        self.device_stepper.run([self.store.units[i] for i in order],
                                lambda u, flats: self._kernel(u, flats, hyper, grad_scale), self._finish_unit)

    def _kernel(self, unit: Unit, flats: list[torch.Tensor], hyper: list[dict], grad_scale: float | None,
                chunk: int | None = None, after_chunk: Callable[[int, int], None] | None = None) -> None:
        """One fused AdamW update of ``unit`` on flat [master, grad, exp_avg, exp_avg_sq] buffers, in ranges of
        ``chunk`` elements (default: all at once); ``after_chunk(a, b)`` runs after each range is updated."""
        self._counts[unit.index] += 1
        device = flats[0].device
        step = torch.full((1,), float(self._counts[unit.index]), dtype=torch.float32, device=device)
        scale_t = None if grad_scale is None else torch.full((), grad_scale, dtype=torch.float32, device=device)
        chunk = chunk or max(unit.numel, 1)
        for a in range(0, unit.numel, chunk):
            b = min(a + chunk, unit.numel)
            for g, slices in self._unit_groups[unit.index]:
                parts = [(max(p.offset, a), min(p.offset + p.numel, b)) for p in slices]
                parts = [(lo, hi) for lo, hi in parts if hi > lo]
                if not parts:
                    continue
                h = hyper[self._group_of[g]]
                master, grad, m, v = ([f[lo:hi] for lo, hi in parts] for f in flats)
                torch._fused_adamw_(master, grad, m, v, [], [step] * len(parts), lr=h["lr"], beta1=h["betas"][0],
                                    beta2=h["betas"][1], weight_decay=h["weight_decay"], eps=h["eps"],
                                    amsgrad=False, maximize=False, grad_scale=scale_t, found_inf=None)
            if after_chunk is not None:
                after_chunk(a, b)

    def _finish_unit(self, unit: Unit) -> None:
        unit.grad_valid = False
        unit.grad_sq = None
        if self.after_unit is not None:
            self.after_unit(unit)
        self._done[unit.index].set()

    def _invalidate_grads(self) -> None:
        for u in self.store.units:
            u.grad_valid = False
            u.grad_sq = None

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("hf_megatrain: the optimizer step failed") from err

    def wait_unit(self, index: int) -> None:
        self._done[index].wait()
        self._raise_pending()

    def wait(self) -> None:
        """Block until the last (possibly overlapped) step has finished every unit."""
        for w in self._workers:
            w.join()
        self._workers = []
        self.last_step_seconds = self._running_seconds
        self._raise_pending()

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        # Gradients are overwritten by the first backward of the next step; nothing to clear.
        self._invalidate_grads()

    # -- state (per unit flat buffers, see checkpoint.py) -------------------------------------------------------------
    @property
    def unit_steps(self) -> torch.Tensor:
        """AdamW step count per unit."""
        return torch.tensor(self._counts, dtype=torch.float32)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        self.wait()
        out = {"unit_steps": self.unit_steps}
        for u in self.store.units:
            out[f"exp_avg.{u.index}"] = u.exp_avg
            out[f"exp_avg_sq.{u.index}"] = u.exp_avg_sq
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.wait()
        self._counts = [int(v) for v in tensors["unit_steps"].tolist()]
        for u in self.store.units:
            for key, dst in ((f"exp_avg.{u.index}", u.exp_avg), (f"exp_avg_sq.{u.index}", u.exp_avg_sq)):
                src = tensors[key]
                if src.shape != dst.shape:
                    raise ValueError(f"optimizer state {key}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
                dst.copy_(src)

    def hyper_state(self) -> dict:
        """Scheduler-visible state (LRs etc.), JSON-serialisable."""
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "skipped_steps": self.skipped_steps}

    def load_hyper_state(self, state: dict) -> None:
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def parameters_iter(self) -> Iterable[torch.Tensor]:
        for g in self.param_groups:
            yield from g["params"]
