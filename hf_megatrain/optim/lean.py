"""LeanAdamW: exact AdamW with global-norm clipping for lean units (12 host bytes per streamed parameter).

Why: a normal unit keeps an FP32 gradient until ``optimizer.step()`` (4 of its 16-18 bytes), because global-norm
clipping needs every gradient before any update. A lean unit (core/plan.py, ``Stepper.LEAN``) has no gradient
buffer: with one backward per step a layer's gradient is final when its backward visit ends, so it is consumed
right there, from one of the executor's two staging slabs, and dropped.

``SpeculationPolicy`` (optim/speculation.py) makes every decision, on plain numbers (tested with fakes); ``LeanAdamW``
carries them out with the kernels of core/kernels.py, inside ``UnitAdamW.step``'s phases (``_settle``: take back,
re-run). Each step runs in one of two modes, chosen from the previous step:

* **speculate** (the previous step did not clip): each layer gets its whole AdamW update as its gradient lands
  (one pass over master, m, v; nothing left for ``step()``). When ``step()`` finds the global norm clips (or is
  non-finite, or the hyper-parameters changed since), each speculated layer is taken back: restored from the copy
  of master, m, v made before its update (optim/take_back.py: bit-exact). A skipped step is then done; a clipping
  one re-runs its forward+backward (same inputs, RNG, autocast, weights: ``StepReplay``) and each regenerated
  gradient gets the update with the true factor. A layer whose copy did not fit the host's memory is taken back
  arithmetically instead (the master from its new moments, the moments from the regenerated gradient: within an
  ulp), which needs the re-run for a skipped step too; the first such layer logs a warning.
* **norm first** (the previous step clipped; the first step when clipping is on): the backward only collects each
  layer's squared gradient norm; ``step()`` then knows the clip factor and re-runs the forward+backward, each
  gradient getting its exact update as it lands. Twice the GPU work, one host pass.

With a gradient plane (``lean_grad_plane``: optim/grad_plane.py; bf16 where the gradients cross narrow) each
gradient also stays on the host, so nothing re-runs: a norm-first step updates every layer from the plane with the
clip factor (in the next forward's order, overlapping it: ``_replay``), and a speculated step that turns out to clip
(or is skipped, or is dropped) is taken back and redone from it. The mode choice is unchanged: after an unclipped
step the next speculates (its updates overlap the backward, the fastest when it does not clip); after a clipped one
the next takes its norm first (one update per layer, no take-back). A step whose gradients missed the plane (a bf16
plane, a visit split into micro-batches) re-runs as above.

A layer whose gradient is non-finite is never updated (the step will be skipped), so a NaN loss leaves every
weight and moment bit-identical without a re-run. The resident unit keeps its gradient buffer and steps as in
``UnitAdamW``.

Data parallel (optim/ranks.py): each layer gradient is reduce-scattered before it lands (engine/offload.py), so a
rank consumes only its shard -- the staging slab and its plane hold that shard, and every update, take-back and copy
works on the state cut to its range (``own``; ``update_(local=True)``); the norm sums the shards' squared norms.
The ranks' loads of a layer wait for every rank's count of its updates (parallel/peer_cells.py), so a speculative
update counts only once ``step()`` judges it right (a taken-back one never counts), a re-run starts once every
rank's take-backs are written, and a skipped step ends with every rank's (barriers: both are rare). Every rank
decides alike from the global norm except on a skipped step, where they agree on what runs collectively
(``_rerun``).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any, Callable

import torch

from ..core import kernels
from ..core.plan import StepModes, Stepper
from ..core.step_state import StepState
from ..core.store import UnitStore
from .adamw import UnitAdamW
from .grad_plane import GradPlane
from .gradient_path import GradientPath
from .jobs import Jobs
from .speculation import Act, Key, Settle, SpeculationPolicy, StepDecision, settle_path

logger = logging.getLogger(__name__)


def optimizer_for(modes: StepModes) -> type[UnitAdamW]:
    """The optimizer class of an engine whose step runs in ``modes`` (core/plan.py ``decide_modes``): LeanAdamW
    where some units consume their gradients as they land, else UnitAdamW."""
    return LeanAdamW if modes.consume else UnitAdamW


class LeanAdamW(UnitAdamW):
    """``UnitAdamW`` whose LEAN units are updated as their gradients land (see the module docstring)."""

    def __init__(self, store: UnitStore, state: StepState, grads: GradientPath, **kwargs: Any) -> None:
        super().__init__(store, state, grads, **kwargs)
        if self.device_stepper is not None:
            raise ValueError("lean_store: AdamW on the GPU (device_step_layers) needs each layer's gradient until the "
                             "step; use device_step_layers=0")
        if any(g["eps"] <= 0 for g in self.param_groups):
            raise ValueError("lean_store needs eps > 0 (taking back a speculated update divides by sqrt(v) + eps)")
        self.lean = set(i for i, u in enumerate(store.units) if u.plan.stepper is Stepper.LEAN)
        self.policy = SpeculationPolicy(norm_first=bool(self.max_grad_norm and self.max_grad_norm > 0))
        self._jobs = Jobs("megatrain-lean", self.overlap)  # the layer updates, in landing order
        self.regenerated_steps = 0  # steps whose forward+backward ran twice (clipped / skipped / discarded)
        self._warned = False
        self._warned_inexact = False
        # Observers of each consumed layer gradient (tests, diagnostics), called on the worker before the update:
        # fn(unit index, first pass?, gradient slab, squared-norm cell); they may read (or, in tests, poison) both.
        self.gradient_hooks: list[Callable[[int, bool, torch.Tensor, torch.Tensor], None]] = []
        # The gradient plane where the plans keep one (core/plan.py; decided there, allocated here), and only
        # when clipping is on: without a clip factor no step needs the gradients after their update.
        modes: StepModes = kwargs.get("modes", StepModes())
        units = [u for u in store.units if u.index in self.lean]
        clipping = bool(self.max_grad_norm and self.max_grad_norm > 0)
        self.plane = GradPlane(units, modes.grad_plane, pin=any(u.master.is_pinned() for u in units), span=self.own) \
            if modes.grad_plane is not None and units and clipping else None
        if modes.grad_plane is not None and not clipping:
            logger.info("hf_megatrain: lean_grad_plane: no clipping (max_grad_norm=%s): the gradient plane is not "
                        "allocated", self.max_grad_norm)
        self.plane_steps = 0  # steps settled from the plane (clipped, skipped or taken back, without a re-run)
        # Lean layers updated from the plane may run split too (``_replay``; optim/split_update.py).
        self.splits.candidates = self.splits.candidates | self._split_candidates(modes, Stepper.LEAN)
        self._warned_plane = False

    @property
    def max_regenerated_sq_error(self) -> float:
        return self.policy.max_sq_error

    # -- gradients in -------------------------------------------------------------------------------------------------
    def plane_slab(self, i: int, dtype: torch.dtype | None) -> torch.Tensor | None:
        """Where the offload should copy unit ``i``'s gradient of the step's own backward, arriving in ``dtype``
        (None: FP32): its slice of the gradient plane when it can hold it exactly, else None (a staging slab)."""
        if self.plane is None or self.policy.rerun is not None:
            return None
        return self.plane.slab(i, dtype)

    def consume(self, i: int, slab: torch.Tensor, sq: torch.Tensor, ready: Any) -> Callable[[], None]:
        """The gradient sink (called by engine/offload.py): the executor's D2H of unit ``i``'s gradient into host
        ``slab`` is queued (``ready``: its event); returns a wait() that returns once the slab may be reused."""
        if self.plane is not None and self.policy.rerun is None:
            self.plane.note(i, slab)
        self.step_state.begin_update(i)
        return self._jobs.submit(partial(self._apply, self.policy.rerun is None, i, slab, sq, ready))

    def _apply(self, first: bool, i: int, grad: torch.Tensor, sq: torch.Tensor, ready: Any) -> None:
        changed = False
        try:
            if ready is not None:
                ready.synchronize()  # the slab and the squared norm have landed
            for hook in self.gradient_hooks:
                hook(i, first, grad, sq)
            s = float(sq)
            u = self.store.units[i]
            with torch.no_grad(), torch.profiler.record_function("megatrain.optimizer.lean_unit"):
                if first:
                    hyper = self._hyper()
                    act = self.policy.first_pass(i, s, self._key(hyper, None))
                    if act is Act.UPDATE:
                        self._copy_before_update(i)
                        self.update_(u, self._flats(u, grad), hyper, None, local=True)
                        changed = True
                    return
                grad_scale, skip, want = self.policy.rerun
                act = self.policy.regenerated(i, s)
                if act in (Act.UNDO, Act.REDO):
                    self._undo_moments(i, grad, self._applied_before[i])
                if act in (Act.REDO, Act.UPDATE):
                    self.update_(u, self._flats(u, grad), self._rerun_hyper, grad_scale, local=True)
                changed = act in (Act.REDO, Act.UPDATE)  # (an undo's master was taken back, and touched, before)
        finally:
            # A speculative update counts as one of the unit's updates only once ``step()`` judges it right (data
            # parallel: the other ranks' loads wait on the counts; one taken back must never have counted).
            self.step_state.finish_update(i, changed, judged=not first)

    # -- the AdamW pieces --------------------------------------------------------------------------------------------
    # A lean gradient (staging slab or plane slice) holds the range of the unit this process steps (``own``: all of
    # it alone, its shard with data parallel), so every piece works on the state cut to that range.
    def _flats(self, u: Any, grad: torch.Tensor) -> list[torch.Tensor]:
        """[master, grad, exp_avg, exp_avg_sq] over this process's range of unit ``u`` (``update_(local=True)``)."""
        lo, hi = self.own(u)
        return [u.master[lo:hi], grad, u.exp_avg[lo:hi], u.exp_avg_sq[lo:hi]]

    def _copy_before_update(self, i: int) -> None:
        """Keep what a speculative update of unit ``i`` overwrites, so its take-back is a restore; without room for
        the copy the update still runs (its gradient is consumed now) and a take-back is arithmetic."""
        u = self.store.units[i]
        if not self.exact_take_back:
            return  # (the default: a take-back is the arithmetic inverse, within an ulp; no copy traffic)
        lo, hi = self.own(u)
        if self.take_back_copies.reserve(i, hi - lo):
            self.take_back_copies.save(i, u.master, u.exp_avg, u.exp_avg_sq, lo, hi)
        elif not self._warned_inexact:
            self._warned_inexact = True
            logger.warning("hf_megatrain: lean_store: not enough free host memory to keep an exact copy of layer "
                           "unit %d's state during its speculative update (12 bytes per parameter); if this step "
                           "is skipped or clips, such layers are taken back within an ulp instead of bit-exactly. "
                           "Free host memory for exact_take_back=True", i)

    def _undo_master(self, i: int, key: Key) -> None:
        u = self.store.units[i]
        if self.take_back_copies.has(i):
            self.take_back_copies.restore_master(i, u.master)
        else:
            master, _, m, v = self._flats(u, u.master)
            kernels.undo_master_(master, m, v, self.local_groups(u, list(key[1])), self.counts.of(i))
        u.refresh_compute_(self.own(u))  # (lean_compute_copy: the re-run streams the copy; its shard only)
        self.step_state.touch(i)

    def _undo_moments(self, i: int, grad: torch.Tensor | None, key: Key) -> None:
        """The moments half of the take-back (after ``_undo_master``); ``grad``: the regenerated gradient, needed
        only without a copy."""
        u = self.store.units[i]
        if self.take_back_copies.has(i):
            self.take_back_copies.restore_moments(i, u.exp_avg, u.exp_avg_sq)
            self.take_back_copies.forget(i)
        else:  # (cut to this process's range: the first update's undo zeroes the moments it covers, no more)
            _, _, m, v = self._flats(u, u.master)
            kernels.undo_moments_(grad, m, v, self.local_groups(u, list(key[1])), self.counts.of(i), key[0])
        self.counts.take_back(i)

    # -- step ---------------------------------------------------------------------------------------------------------
    def _unit_norm(self, u: Any) -> torch.Tensor:
        if u.index in self.lean:
            return torch.tensor(self.policy.sq.get(u.index, 0.0), dtype=torch.float32).sqrt()
        return super()._unit_norm(u)

    def join(self) -> None:
        super().join()
        self._sync()

    def _sync(self) -> None:
        """Wait for every queued layer update; re-raise the first failure."""
        self._jobs.sync()

    # -- step: UnitAdamW.step's phases, with the lean units settled in between --------------------------------------
    def _join_before_step(self) -> None:
        self.wait()  # every consumed layer's update: their squared norms are the lean units' part of the norm

    def _settle(self, skip: bool, hyper: list[kernels.Hyper], grad_scale: float | None) -> set[int]:
        """After *decide*: the policy's decision -- take back what the true norm proves wrong and, when a lean unit
        still needs its right update (norm first, clipped, ...), re-run the step's forward+backward; lean units no
        backward reached get a zero-gradient update. Returns the lean units (the launch steps the others)."""
        decision = self.policy.decide(skip, self._key(hyper, grad_scale), self.skip_nonfinite)
        for i in self.policy.applied:  # speculative updates the true norm proves right count from now on
            if i not in decision.take_back:
                self.step_state.finish_update(i, changed=False)
        # (data parallel, a non-finite norm: ranks may have speculated on different layers -- a non-finite shard
        # stops only its own rank -- so each goes through ``_rerun``, where they agree on what runs collectively)
        if decision.rerun or self._ranks_may_differ(skip):
            self._rerun(grad_scale, skip, hyper, decision)
        if skip:
            self._end(None)
            return self.lean
        missing = sorted(self.lean - self.policy.seen)  # lean units no backward reached: zero gradient
        # (sized for those only: a layer-sized FP32 zero tensor every step was 5.2 GiB of RSS at 123B, filled)
        zero = torch.zeros(max((self.store.units[i].numel for i in missing), default=0), dtype=torch.float32)
        for i in missing:
            u = self.store.units[i]
            lo, hi = self.own(u)
            self.step_state.begin_update(i)  # (counted, as every update: data-parallel loads wait on the counts)
            self.update_(u, self._flats(u, zero[:hi - lo]), hyper, None, local=True)
            self.step_state.finish_update(i)
        self._end(grad_scale is not None)
        return self.lean

    def _zero_missing(self) -> None:
        for u in self.store.units:
            if u.index not in self.lean and not self.step_state.has_grad(u.index):
                u.grad.zero_()
                self.step_state.accumulate(u.index, None)
                self.step_state.landed(u.index)

    def _rerun(self, grad_scale: float | None, skip: bool, hyper: list[kernels.Hyper], d: StepDecision) -> None:
        """Settle what the decision ``d`` leaves: from the plane (``_replay``), from take-back copies (a skipped
        step), or by re-running the forward+backward (``_regenerate``).

        Data parallel: the re-run is collective (each regenerated gradient is reduce-scattered), so the ranks must
        agree on it. They decide alike except on a non-finite norm (a non-finite shard stops speculation on its rank
        only; take-back copies are per rank): then if any rank must re-run, every rank does (the re-run settles
        whatever the plane or the copies would have). A skipped step's take-backs count no update, so no rank leaves
        it before every rank's are written (a barrier): the next forward's loads could not tell."""
        holds = self.plane is not None and self.plane.holds(d.expected | set(d.take_back))
        if self.plane is not None and not holds and (d.take_back or d.expected) and not self._warned_plane:
            self._warned_plane = True
            logger.warning("hf_megatrain: lean_grad_plane: this step's gradients are not all on the gradient "
                           "plane (%s): re-running its forward+backward instead", self.plane.why_not())
        path = settle_path(d, skip, holds, all(self.take_back_copies.has(i) for i in d.take_back))
        if self._ranks_may_differ(skip) and self.ranks.any_rank(path is Settle.RERUN):
            path = Settle.RERUN
        if path is Settle.REPLAY:
            self._replay(grad_scale, skip, hyper, d)
        elif path is Settle.RESTORE:  # a skipped (or dropped) step whose updates all have copies: restored whole
            for i in d.take_back:
                self._undo_master(i, self.policy.applied[i])
                self._undo_moments(i, None, self.policy.applied.pop(i))
        elif path is Settle.RERUN:
            self._regenerate(grad_scale, skip, hyper, d)
        if skip:
            self.ranks.barrier()

    def _ranks_may_differ(self, skip: bool) -> bool:
        """Whether data-parallel ranks may have decided this step differently: only where the global norm (the same
        on every rank) is non-finite -- skipped, or kept with ``skip_nonfinite=False`` -- or a backward is dropped."""
        return self.ranks.world > 1 and (skip or not math.isfinite(self.last_grad_norm or 0.0))

    def _regenerate(self, grad_scale: float | None, skip: bool, hyper: list[kernels.Hyper],
                    d: StepDecision) -> None:
        """Re-run the step's forward+backward; each regenerated gradient settles its layer as it lands."""
        self.regenerated_steps += 1
        if not self._warned:
            self._warned = True
            logger.warning("hf_megatrain: lean_store: this step clips (or is skipped): re-running its "
                           "forward+backward to give every layer its exact update. Every clipping step runs its "
                           "forward+backward twice (see docs/lean_store.md); counted in "
                           "optimizer.regenerated_steps")
        self._applied_before = dict(self.policy.applied)
        for i in d.take_back:  # the re-run must see the weights the first pass saw
            self._undo_master(i, self.policy.applied[i])
        # (data parallel: every rank's take-backs are written before any rank's re-run loads a layer; a take-back
        # counts no update for those loads to wait on)
        self.ranks.barrier()
        self.policy.corrected = set()
        self.policy.rerun = (grad_scale, skip, self._key(hyper, grad_scale))
        self._rerun_hyper = hyper
        try:
            self.grads.rerun()
            self._sync()
        finally:
            self.policy.rerun = None
        missing = d.expected - self.policy.corrected
        if missing:
            raise RuntimeError(f"lean_store: the re-run produced no gradient for layer units {sorted(missing)}; "
                               "their AdamW state could not be corrected")

    def _replay(self, grad_scale: float | None, skip: bool, hyper: list[kernels.Hyper], d: StepDecision) -> None:
        """``_rerun`` without the second forward+backward: every gradient of the step is on the plane. The policy's
        decisions and the take-backs run here; the updates go to the worker in the next forward's order, which waits
        for each layer's own (``step()`` returns at once, as after the full store's launch)."""
        self.plane_steps += 1
        applied = dict(self.policy.applied)
        for i in d.take_back:
            self._undo_master(i, applied[i])
        self.policy.corrected = set()
        self.policy.rerun = (grad_scale, skip, self._key(hyper, grad_scale))
        todo = []
        try:
            for i in (j for j in self.unit_order if j in d.expected):
                act = self.policy.regenerated(i, self.policy.sq[i])
                if act in (Act.UNDO, Act.REDO):  # (its master was taken back above)
                    self._undo_moments(i, self.plane.of(i), applied[i])
                if act in (Act.REDO, Act.UPDATE):
                    todo.append(i)
        finally:
            self.policy.rerun = None
        # Split where the host has time to spare (optim/split_update.py): new weights first, in this order, then
        # master and moments in the backward's order; the next landing on the plane waits for a layer's second pass.
        halves = self.splits.choose(todo, lambda i: self.split_update_bytes(self.store.units[i],
                                                                        self.plane.of(i).element_size()))
        for i in todo:
            self.step_state.begin_update(i)
            part = kernels.UpdatePart.WEIGHTS if i in halves else kernels.UpdatePart.WHOLE
            self._jobs.submit(partial(self._update_from_plane, i, hyper, grad_scale, part))
        for i in reversed(halves):
            self._jobs.submit(partial(self._update_from_plane, i, hyper, grad_scale, kernels.UpdatePart.STATE))

    def _update_from_plane(self, i: int, hyper: list[kernels.Hyper], grad_scale: float | None,
                           part: kernels.UpdatePart = kernels.UpdatePart.WHOLE) -> None:
        weights_out = False
        try:
            u = self.store.units[i]
            with torch.no_grad(), torch.profiler.record_function("megatrain.optimizer.lean_unit"):
                self.update_(u, self._flats(u, self.plane.of(i)), hyper, grad_scale,
                             refresh=part is not kernels.UpdatePart.STATE, part=part, local=True)
            weights_out = part is kernels.UpdatePart.WEIGHTS
        finally:
            if weights_out:
                self.step_state.finish_weights(i)
            else:  # (a failed weights half too: waiters are released, the failure surfaces at the next join)
                self.step_state.finish_update(i, True)

    def _end(self, clipped: bool | None) -> None:
        if self.plane is not None:
            self.plane.end_step()
        self.take_back_copies.clear()
        self.policy.end(clipped)
        self.grads.discard()

    def hyper_state(self) -> dict:
        # The mode travels with checkpoints, so a resumed run takes the same path (bit-exact resume).
        return {**super().hyper_state(), "lean_norm_first": self.policy.norm_first}

    def load_hyper_state(self, state: dict) -> None:
        super().load_hyper_state(state)
        self.policy.norm_first = bool(state.get("lean_norm_first", False))

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Dropping a backward's gradients without a step: take back the updates it made."""
        if self.policy.seen:
            with torch.no_grad():
                self.wait()
                self.grads.land()
                if self.policy.applied or self.ranks.world > 1:  # (data parallel: the ranks agree in _rerun)
                    decision = StepDecision(True, list(self.policy.applied), set(self.policy.applied))
                    self._rerun(None, True, self._hyper(), decision)
                self._end(None)
        super().zero_grad(set_to_none)
