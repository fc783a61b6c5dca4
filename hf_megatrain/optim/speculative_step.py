"""SpeculativeStep: the part of ``UnitAdamW`` that updates HOST units during the step's last backward.

In the step's last backward (``engine.set_final_backward``) each HOST unit whose gradient lands with a known squared
norm (its first visit) is handed to the optimizer (``UnitAdamW.landed``: the offload calls it as it lands the
gradient) and updated on the ``SpeculativeWorker`` right away, with no clip factor; ``step()`` then asks the policy
(optim/speculation.py) which of those updates the true global norm proves wrong, takes them back (restores the copy
optim/take_back.py made before the update, bit-exact; else the arithmetic inverse; the gradient is still in the
unit's buffer) and launches them again with everything else, so a skipped step leaves the state untouched and a
redone one equals a step that never speculated. A unit whose copy does not fit the host's memory is not speculated
on. After a step that clipped, the next one does not speculate, so a run that clips throughout never takes anything
back. Units some of whose parameters skip steps (no gradient now or earlier: per-parameter step counts) are left
to the normal path.
"""

from __future__ import annotations

import heapq
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core import kernels
from ..core.plan import StepModes, Stepper
from ..core.step_state import StepState
from ..core.store import Unit, UnitStore
from .jobs import Jobs
from .speculation import Act, Key, SpeculationPolicy
from .take_back import TakeBackCopies

if TYPE_CHECKING:
    from ..core.grad_reach import GradReach
    from .ranks import Ranks
    from .step_counts import StepCounts
    from .device_stepper import DeviceStepper


class SpeculativeWorker:
    """Runs the speculative updates of one optimizer on one background thread (in the caller's thread without
    ``overlap``), always the queued unit the next forward needs first, and settles each with the step state.

    Gradients land in backward order (last layer first), so in the backward the worker takes the newest landing, and
    once the backward is over the rest go in forward order: the next forward starts after one update instead of all
    of them, and the CPU works through the forward too. An update that finishes before ``step()`` judged it keeps
    its gradient landed (``finish_update(keep_grad=True)``); one judged right while still running finishes as
    ready. Mechanism only: tested with a real ``StepState`` and a fake update."""

    def __init__(self, state: StepState, unit_order: list[int], overlap: bool) -> None:
        self.state = state
        self._pos = {u: k for k, u in enumerate(unit_order)}
        self._jobs = Jobs("megatrain-spec", overlap)
        self._queue: list[tuple[int, int, Any, Callable[[int, Any], None]]] = []  # (forward position, unit, ...)
        self._lock = threading.Lock()
        # Updates that finished before step() judged them (their gradient kept), and those judged right while
        # still running (they finish as ready); both under ``_lock``.
        self._done: set[int] = set()
        self._final: set[int] = set()

    @property
    def overlapped(self) -> bool:
        """Whether updates run on a background thread (``overlap_optimizer``)."""
        return self._jobs.overlapped

    def submit(self, i: int, hyper: Any, update: Callable[[int, Any], None]) -> None:
        """Unit ``i``'s gradient is final: ``update(i, hyper)`` runs on the worker (the unit is UPDATING now)."""
        self.state.begin_update(i)
        with self._lock:
            heapq.heappush(self._queue, (self._pos[i], i, hyper, update))
        self._jobs.submit(self._run_next)

    def hold(self) -> Callable[[], None]:
        """Keep the worker busy (what it is given queues) until the returned release() is called; for tests and
        diagnostics. Without overlap there is no worker: a no-op."""
        return self._jobs.hold()

    def _run_next(self) -> None:
        """One job per landing; each takes whichever queued unit the next forward needs first."""
        with self._lock:
            _, i, hyper, update = heapq.heappop(self._queue)
        try:
            update(i, hyper)
        except BaseException as e:  # surfaced by the next wait
            self.state.fail(e)
        finally:
            with self._lock:
                # Judged right already (step() returned while this ran): the unit is ready for the next forward.
                # Otherwise its gradient stays landed for step() to judge.
                final = i in self._final
                self._final.discard(i)
                if not final:
                    self._done.add(i)
                self.state.finish_update(i, changed=True, keep_grad=not final)

    def sync(self) -> None:
        """Wait for every submitted update."""
        self._jobs.sync()

    def stands(self, units: set[int]) -> None:
        """``step()`` judged these units' updates right: each is ready for the next forward once it has run."""
        with self._lock:
            for i in units:
                if i in self._done:
                    self.state.finish_update(i, changed=False)
                else:
                    self._final.add(i)

    def forget(self) -> None:
        """The step's speculation is settled: forget which updates finished early, so a later step never mistakes
        a stale entry for its own finished update."""
        with self._lock:
            self._done.clear()


def _not_speculating(i: int, sq: float | None) -> None:
    pass


class SpeculativeStep:
    """Mixed into ``UnitAdamW``: what it uses of the optimizer is declared here."""

    store: UnitStore
    step_state: StepState
    unit_order: list[int]
    overlap: bool
    max_grad_norm: float | None
    skip_nonfinite: bool
    device_stepper: DeviceStepper | None
    grad_reach: GradReach | None
    ranks: Ranks
    counts: StepCounts
    _hyper: Callable[[], list[kernels.Hyper]]
    own: Callable[[Unit], tuple[int, int]]
    owned: Callable[[Unit, kernels.Groups], kernels.Groups]
    groups_of: Callable[[Unit, list[kernels.Hyper]], kernels.Groups]
    grad_of: Callable[[Unit], torch.Tensor]
    update_: Callable[..., None]

    def _init_speculation(self, modes: StepModes, exact_take_back: bool = False) -> None:
        speculate = self.speculate = modes.speculate  # (decided once: core/plan.py decide_modes)
        # What the gradient sink's ``landed`` does, chosen here once: start a speculative update, or nothing.
        self._landed: Callable[[int, float | None], None] = self._on_landed if speculate else _not_speculating
        self.exact_take_back = exact_take_back
        self.policy = SpeculationPolicy(norm_first=bool(self.max_grad_norm and self.max_grad_norm > 0))
        self.speculation = SpeculativeWorker(self.step_state, self.unit_order, speculate and self.overlap)
        # The GPU-stepped layers' state, spread over the landings before theirs (they are the first in forward order:
        # the CPU's layers land first), so each share rides behind one layer's weight load: elements per landing.
        ds = self.device_stepper
        cpu_layers = sum(1 for u in self.store.units if u.streamed and u.plan.stepper is Stepper.HOST)
        self.prefetch_share = -(-ds.state_numel() // max(cpu_layers, 1)) if ds is not None else None
        # What each speculative update overwrites, so a take-back restores it bit-exactly (optim/take_back.py);
        # only with ``exact_take_back``: the copies cost 12 host bytes per parameter and as much host memory traffic
        # as the update itself (measured 0.43x tokens/s at 8k tokens/step streamed, where the host AdamW bounds the
        # step). Without them a take-back is the arithmetic inverse, within an ulp.
        self.take_back_copies = TakeBackCopies(budget=None if exact_take_back else 0,
                                               ranks_on_host=self.ranks.on_host)
        self.speculated = 0  # units updated during a backward
        self.taken_back = 0  # speculative updates taken back and redone (steps that clipped after one that did not)

    def landed(self, i: int, sq: float | None) -> None:
        """The gradient sink (optim/gradient_path.py), the step's last backward: unit ``i``'s gradient is final (the
        offload, or the landing, calls this as it lands it); with speculation its update may start now."""
        self._landed(i, sq)

    def _on_landed(self, i: int, sq: float | None) -> None:
        """Main thread, the step's last backward (``UnitAdamW.landed``): unit ``i``'s gradient is final. A HOST unit
        whose squared norm is known (its first visit) goes to the speculative worker, with the hyper-parameters of
        this moment (the LR scheduler may move them after ``step()`` returns, while the update still waits)."""
        if self.device_stepper is not None:  # (the GPU-stepped layers' state comes in, a share per landing)
            self.device_stepper.prefetch(self.prefetch_share)
        if sq is None or self.store.units[i].plan.stepper is not Stepper.HOST:
            return
        # A unit some of whose parameters skip steps (no gradient now or before) keeps per-parameter step counts:
        # it is stepped the normal way, where take-back never applies.
        flags = self.grad_reach.peek(i) if self.grad_reach is not None else None
        if (flags is not None and not all(flags)) or self.counts.skipped_some(i):
            return
        if self.exact_take_back and self.policy.would_update(sq):
            lo, hi = self.own(self.store.units[i])
            if not self.take_back_copies.reserve(i, hi - lo):
                return  # (no room for an exact copy: the unit is stepped after the backward, as if not speculating)
        hyper = self._hyper()
        if self.policy.first_pass(i, sq, self._key(hyper, None)) is not Act.UPDATE:
            return  # (norm-first step, or a non-finite gradient: the unit waits for step())
        self.speculation.submit(i, hyper, self._speculate)

    def _speculate(self, i: int, hyper: list[kernels.Hyper]) -> None:
        """On the worker: unit ``i``'s whole update, with no clip factor (copied first with exact_take_back)."""
        with torch.no_grad(), torch.profiler.record_function("megatrain.optimizer.speculative_unit"):
            u = self.store.units[i]
            if self.take_back_copies.reserved(i):
                self.take_back_copies.save(i, u.master, u.exp_avg, u.exp_avg_sq, *self.own(u))
            self.update_(u, [u.master, self.grad_of(u), u.exp_avg, u.exp_avg_sq], hyper, None)
        self.speculated += 1

    @staticmethod
    def _key(hyper: list[kernels.Hyper], grad_scale: float | None) -> Key:
        return grad_scale, tuple(hyper)

    def _judge_speculation(self, skip: bool, hyper: list[kernels.Hyper], grad_scale: float | None) -> set[int]:
        """Take back the speculative updates the true norm proves wrong; returns the units already stepped right.
        Updates judged right may still be running: ``step()`` does not wait for them (the next forward waits per
        unit, so it starts after the first layer's update instead of all of them)."""
        if not self.policy.seen:  # (nothing speculated: no speculation, or a norm-first step)
            self._end_speculation(None if skip else grad_scale is not None)
            return set()
        d = self.policy.decide(skip, self._key(hyper, grad_scale), self.skip_nonfinite)
        if d.take_back:  # (rare: a step that clips after one that did not) the updates to undo must be finished
            self.speculation.sync()
        for i in d.take_back:
            self._take_back(i, self.policy.applied.pop(i))
        done = set(self.policy.applied)
        self.speculation.stands(done)
        self._end_speculation(None if skip else grad_scale is not None)
        return done

    def _end_speculation(self, clipped: bool | None) -> None:
        """The step's speculation is settled (judged, or taken back by ``zero_grad``)."""
        self.speculation.forget()
        self.take_back_copies.clear()
        self.policy.end(clipped)

    def _take_back(self, i: int, key: Key) -> None:
        """Undo unit ``i``'s speculative update (its gradient is still in its buffer: the kernel without a clip
        factor leaves it untouched), so the normal launch redoes it with the true factor."""
        u = self.store.units[i]
        copies = self.take_back_copies
        if copies.has(i):  # (exact_take_back: restored from the copy, bit-exact)
            copies.restore_master(i, u.master)
            copies.restore_moments(i, u.exp_avg, u.exp_avg_sq)
            copies.forget(i)
        else:  # the arithmetic inverse, within an ulp
            groups = self.owned(u, self.groups_of(u, list(key[1])))  # (data parallel: this rank's shard)
            kernels.undo_master_(u.master, u.exp_avg, u.exp_avg_sq, groups, self.counts.of(i))
            kernels.undo_moments_(self.grad_of(u), u.exp_avg, u.exp_avg_sq, groups, self.counts.of(i), key[0])
        self.counts.take_back(i)
        u.refresh_compute_(self.own(u))
        self.step_state.touch(i)
        self.taken_back += 1
