"""SpeculativeStep: the part of ``UnitAdamW`` that updates HOST units during the step's last backward.

In the step's last backward (``engine.set_final_backward``) each HOST unit whose gradient lands
with a known squared norm (its first visit) is updated on a worker right away, with no clip factor; ``step()`` then
asks the policy (optim/speculation.py) which of those updates the true global norm proves wrong, takes them back
bit-exactly (restores the copy optim/take_back.py made before the update; the gradient is still in the unit's
buffer) and launches them again with everything else, so a skipped step leaves the state untouched and a redone
one equals a step that never speculated. A unit whose copy does not fit the host's memory is not speculated on.
After a step that clipped, the next one does not speculate, so a run that clips throughout never takes anything
back. Units some of whose parameters skip steps (no gradient now or earlier: per-parameter step counts) are left
to the normal path.
"""

from __future__ import annotations

import heapq
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..core import kernels
from ..core.plan import Stepper
from .speculation import Act, Key, LeanPolicy
from .take_back import TakeBackCopies


class SpeculativeStep:
    """Mixed into ``UnitAdamW`` (it uses the optimizer's store, step state, kernels and step counts)."""

    step_state: Any
    store: Any

    def _init_speculation(self: Any, speculate: bool, exact_take_back: bool = False) -> None:
        self.speculate = speculate
        self.exact_take_back = exact_take_back
        self.policy = LeanPolicy(norm_first=bool(self.max_grad_norm and self.max_grad_norm > 0))
        self._spec_pool = ThreadPoolExecutor(1, thread_name_prefix="megatrain-spec") \
            if speculate and self.overlap else None
        self._spec_jobs: list[Future] = []
        # Landed units waiting for the worker, (position in the next forward, unit, squared norm): the worker takes
        # the one the next forward needs first. Gradients land in backward order (last layer first), so in the
        # backward it takes the newest landing, and once the backward is over the rest go in forward order: the
        # next forward starts after one update instead of all of them, and the CPU works through the forward too.
        self._spec_queue: list[tuple[int, int, list[kernels.Hyper]]] = []
        self._spec_lock = threading.Lock()
        # Speculative updates that finished before step() judged them (their gradient kept), and those judged
        # right while still running (they finish as ready); both under ``_spec_lock``.
        self._spec_done: set[int] = set()
        self._spec_final: set[int] = set()
        self._forward_pos = {u: k for k, u in enumerate(self.unit_order)}
        # The GPU-stepped layers' state, spread over the landings before theirs (they are the first in forward order:
        # the CPU's layers land first), so each share rides behind one layer's weight load.
        ds = self.device_stepper
        cpu_layers = sum(1 for u in self.store.units if u.streamed and u.plan.stepper is Stepper.HOST)
        self._prefetch_share = -(-ds.state_numel() // max(cpu_layers, 1)) if ds is not None else None
        # What each speculative update overwrites, so a take-back restores it bit-exactly (optim/take_back.py);
        # only with ``exact_take_back``: the copies cost 12 host bytes per parameter and as much host memory traffic
        # as the update itself (measured 0.43x tokens/s at 8k tokens/step streamed, where the host AdamW bounds the
        # step). Without them a take-back is the arithmetic inverse, within an ulp.
        self.take_back_copies = TakeBackCopies(budget=None if exact_take_back else 0,
                                               ranks_on_host=self.dp.world if self.dp is not None else 1)
        self.speculated = 0  # units updated during a backward
        self.taken_back = 0  # speculative updates taken back and redone (steps that clipped after one that did not)

    def _on_landed(self: Any, i: int, sq: float | None) -> None:
        """Main thread, the step's last backward (``UnitAdamW.landed``): unit ``i``'s gradient is final. A HOST unit whose squared norm
        is known (its first visit) goes to the speculative worker, with the hyper-parameters of this moment (the
        LR scheduler may move them after ``step()`` returns, while the update still waits in the queue)."""
        if self.device_stepper is not None:  # (the GPU-stepped layers' state comes in, a share per landing)
            self.device_stepper.prefetch(self._prefetch_share)
        if sq is None or self.store.units[i].plan.stepper is not Stepper.HOST:
            return
        # A unit some of whose parameters skip steps (no gradient now or before) keeps per-parameter step counts:
        # it is stepped the normal way, where take-back never applies.
        flags = self.grad_reach.peek(i) if self.grad_reach is not None else None
        if (flags is not None and not all(flags)) or i in self._missed:
            return
        if self.exact_take_back and self.policy.would_update(sq):
            lo, hi = self.own(self.store.units[i])
            if not self.take_back_copies.reserve(i, hi - lo):
                return  # (no room for an exact copy: the unit is stepped after the backward, as if not speculating)
        hyper = self._hyper()
        if self.policy.first_pass(i, sq, self._key(hyper, None)) is not Act.UPDATE:
            return  # (norm-first step, or a non-finite gradient: the unit waits for step())
        self.step_state.begin_update(i)
        with self._spec_lock:
            heapq.heappush(self._spec_queue, (self._forward_pos[i], i, hyper))
        if self._spec_pool is None:
            self._speculate_next()
        else:
            self._spec_jobs.append(self._spec_pool.submit(self._speculate_next))

    def _speculate_next(self: Any) -> None:
        """One job per landing; each takes whichever queued unit the next forward needs first."""
        with self._spec_lock:
            _, i, hyper = heapq.heappop(self._spec_queue)
        self._speculate(i, hyper)

    def _speculate(self: Any, i: int, hyper: list[kernels.Hyper]) -> None:
        try:
            with torch.no_grad(), torch.profiler.record_function("megatrain.optimizer.speculative_unit"):
                u = self.store.units[i]
                if self.take_back_copies.reserved(i):
                    self.take_back_copies.save(i, u.master, u.exp_avg, u.exp_avg_sq, *self.own(u))
                self.update_(u, [u.master, self.grad_of(u), u.exp_avg, u.exp_avg_sq], hyper, None)
            self.speculated += 1
        except BaseException as e:  # surfaced by the next wait
            self.step_state.fail(e)
        finally:
            with self._spec_lock:
                # Judged right already (step() returned while this ran): the unit is ready for the next forward.
                # Otherwise its gradient stays landed for step() to judge.
                final = i in self._spec_final
                self._spec_final.discard(i)
                if not final:
                    self._spec_done.add(i)
                self.step_state.finish_update(i, changed=True, keep_grad=not final)

    def _sync_spec(self) -> None:
        jobs, self._spec_jobs = self._spec_jobs, []
        for f in jobs:
            f.result()

    @staticmethod
    def _key(hyper: list[kernels.Hyper], grad_scale: float | None) -> Key:
        return grad_scale, tuple(hyper)

    def _judge_speculation(self: Any, skip: bool, hyper: list[kernels.Hyper], grad_scale: float | None) -> set[int]:
        """Take back the speculative updates the true norm proves wrong; returns the units already stepped right.
        Updates judged right may still be running: ``step()`` does not wait for them (the next forward waits per
        unit, so it starts after the first layer's update instead of all of them)."""
        if not self.speculate or not self.policy.seen:
            self._end_speculation(None if skip else grad_scale is not None)
            return set()
        d = self.policy.decide(skip, self._key(hyper, grad_scale), self.skip_nonfinite)
        if d.take_back:  # (rare: a step that clips after one that did not) the updates to undo must be finished
            self._sync_spec()
        for i in d.take_back:
            self._take_back(i, self.policy.applied.pop(i))
        done = set(self.policy.applied)
        with self._spec_lock:
            for i in done:  # their update stands: the unit is ready for the next forward once it has run
                if i in self._spec_done:
                    self.step_state.finish_update(i, changed=False)
                else:
                    self._spec_final.add(i)
        self._end_speculation(None if skip else grad_scale is not None)
        return done

    def _end_speculation(self: Any, clipped: bool | None) -> None:
        """The step's speculation is settled (judged, or taken back by ``zero_grad``): forget which updates
        finished early, so a later step never mistakes a stale entry for its own finished update."""
        with self._spec_lock:
            self._spec_done.clear()
        self.take_back_copies.clear()
        self.policy.end(clipped)

    def _take_back(self: Any, i: int, key: Key) -> None:
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
            kernels.undo_master_(u.master, u.exp_avg, u.exp_avg_sq, groups, self._counts[i])
            kernels.undo_moments_(self.grad_of(u), u.exp_avg, u.exp_avg_sq, groups, self._counts[i], key[0])
        self._counts[i] -= 1
        u.refresh_compute_(self.own(u))
        self.step_state.touch(i)
        self.taken_back += 1
