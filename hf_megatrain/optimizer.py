"""CPUAdamW: AdamW over the host store's FP32 master, one fused kernel call per unit.

A real ``torch.optim.Optimizer``: ``param_groups`` hold the master views (group 0 decayed, group 1 not, as
Trainer splits them), so LR schedulers drive it unchanged. The kernel is torch's fused CPU AdamW
(``aten::_fused_adamw_``); global gradient-norm clipping is folded into it as ``grad_scale`` (the kernel divides
each gradient by it) instead of a separate pass that rewrites the gradients, and a non-finite norm skips the step
with master weights and moments untouched.

With ``overlap=True``, ``step()`` computes the norm, snapshots the hyper-parameters and returns; a worker thread
then steps units in the order the next forward consumes them (resident first, then layer 0, 1, ...) and the
executor waits per layer for its unit only. The math is identical: every unit uses the same norm and LR.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Iterable

import torch

from .host_store import HostStore, Unit

logger = logging.getLogger(__name__)


class CPUAdamW(torch.optim.Optimizer):
    def __init__(self, store: HostStore, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = None,
                 unit_order: list[int] | None = None, skip_nonfinite: bool = True, overlap: bool = False,
                 before_step: Callable[[], None] | None = None,
                 after_unit: Callable[[Unit], None] | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        self.store = store
        decay, no_decay = [], []
        # unit index -> [(group index, masters, grads, exp_avgs, exp_avg_sqs)]
        self._unit_lists: dict[int, list[tuple[int, list, list, list, list]]] = {}
        for unit in store.units:
            per_group: dict[int, tuple[list, list, list, list]] = {}
            for p in unit.params:
                g = 0 if p.decay else 1
                view = unit.view(unit.master, p)
                view.grad = unit.view(unit.grad, p)
                (decay if g == 0 else no_decay).append(view)
                lists = per_group.setdefault(g, ([], [], [], []))
                lists[0].append(view)
                lists[1].append(view.grad)
                lists[2].append(unit.view(unit.exp_avg, p))
                lists[3].append(unit.view(unit.exp_avg_sq, p))
            self._unit_lists[unit.index] = [(g, *lists) for g, lists in sorted(per_group.items())]
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if not decay and not no_decay:
            raise ValueError("CPUAdamW: the host store holds no trainable parameters")
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
        # AdamW step count per unit, on the unit's device (the fused CUDA kernel reads it there).
        self._steps = [torch.zeros(1, dtype=torch.float32, device=u.master.device) for u in store.units]
        self.skipped_steps = 0
        self.last_step_seconds = 0.0
        self.last_norm_seconds = 0.0  # wall time of the last step's unit updates (worker thread when overlapped)
        self.last_grad_norm: float | None = None
        self._done = [threading.Event() for _ in store.units]
        for e in self._done:
            e.set()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- gradient norm -------------------------------------------------------------------------------------------------
    def grad_norm(self) -> float:
        """Global L2 norm of all gradients (fp64 accumulation of per-unit fp32 norms, like clip_grad_norm_)."""
        norms = torch.stack([(u.grad_sq.sqrt() if u.grad_sq is not None else torch.linalg.vector_norm(u.grad)).cpu()
                             for u in self.store.units])
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
                u.grad.zero_()
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
        scale = 1.0
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            coef = self.max_grad_norm / (norm + 1e-6)
            scale = min(coef, 1.0)
        hyper = [dict(lr=float(g["lr"]), betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
                 for g in self.param_groups]
        grad_scale = 1.0 / scale if scale < 1.0 else None
        if self.overlap:
            for e in self._done:
                e.clear()
            self._worker = threading.Thread(target=self._run, args=(hyper, grad_scale), daemon=True)
            self._worker.start()
        else:
            self._run(hyper, grad_scale)
        return loss

    def _run(self, hyper: list[dict], grad_scale: float | None) -> None:
        t0 = time.perf_counter()
        try:
            for i in self.unit_order:
                self._step_unit(self.store.units[i], hyper, grad_scale)
                self._done[i].set()
            self.last_step_seconds = time.perf_counter() - t0
        except BaseException as e:  # surfaced by wait()
            self._error = e
            for ev in self._done:
                ev.set()

    def _step_unit(self, unit: Unit, hyper: list[dict], grad_scale: float | None) -> None:
        step = self._steps[unit.index]
        step += 1
        scale_t = None if grad_scale is None else torch.full((), grad_scale, dtype=torch.float32,
                                                             device=unit.master.device)
        for g, params, grads, exp_avgs, exp_avg_sqs in self._unit_lists[unit.index]:
            h = hyper[self._group_of[g]]
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params),
                                lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1],
                                weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False, maximize=False,
                                grad_scale=scale_t, found_inf=None)
        unit.grad_valid = False
        unit.grad_sq = None
        self.store.sync_compute_(unit)
        if self.after_unit is not None:
            self.after_unit(unit)

    def _invalidate_grads(self) -> None:
        for u in self.store.units:
            u.grad_valid = False
            u.grad_sq = None

    def wait_unit(self, index: int) -> None:
        self._done[index].wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("hf_megatrain: the CPU optimizer step failed") from err

    def wait(self) -> None:
        """Block until the last (possibly overlapped) step has finished every unit."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("hf_megatrain: the CPU optimizer step failed") from err

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        # Gradients are overwritten by the first backward of the next step; nothing to clear.
        self._invalidate_grads()

    # -- state (per unit flat buffers, see checkpoint.py) -------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        self.wait()
        out = {"unit_steps": self.unit_steps}
        for u in self.store.units:
            out[f"exp_avg.{u.index}"] = u.exp_avg
            out[f"exp_avg_sq.{u.index}"] = u.exp_avg_sq
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.wait()
        for st, v in zip(self._steps, tensors["unit_steps"]):
            st.fill_(float(v))
        for u in self.store.units:
            for key, dst in ((f"exp_avg.{u.index}", u.exp_avg), (f"exp_avg_sq.{u.index}", u.exp_avg_sq)):
                src = tensors[key]
                if src.shape != dst.shape:
                    raise ValueError(f"optimizer state {key}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
                dst.copy_(src)

    @property
    def unit_steps(self) -> torch.Tensor:
        """AdamW step count per unit (host tensor)."""
        return torch.cat([s.cpu() for s in self._steps])

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
