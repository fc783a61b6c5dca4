"""StepState: where each unit is in the training step -- the unit lifecycle, and nothing else.

Per unit: ``EMPTY -> ACCUMULATING -> LANDED -> UPDATING -> READY`` (READY behaves as EMPTY for the next backward),
the squared norm of its gradient when a single layer visit produced it (folded into the gradient's departure from
the GPU, so the global norm needs no pass over host memory), the dtype of a narrow host gradient, a ready event and
a version that changes whenever its master changes. Everyone asks this object instead of each other:

- the gradient path (engine/offload.py, engine/landing.py) reports gradients (``accumulate``, ``landed``) and,
  before it loads a unit's weights, waits for it to be loadable: ready, or its new weights published on the GPU by
  a GPU updater (``publish_copy``: the copies back to host memory may still run); its slot cache is keyed by
  ``version`` (no "invalidate" calls);
- the optimizer moves units through ``begin_update`` / ``finish_update`` (from worker threads); a split host
  update (optim/split_update.py) calls ``finish_weights`` in between, when the unit's new compute copy is written
  in host memory: it is loadable then, while its master, moments and gradient stay the updater's until ready (the
  gradient path waits for ready before it lands the next gradient);
- readers of the masters (checkpoints, exports, PEFT saves) call ``wait_all()``;
- with data-parallel ranks sharing the host's store (each writes its shard of every update), ``peers`` hears of
  each finished update and makes loads and ``wait_all`` wait for every rank's shard (parallel/peer_cells.py).

Nothing registers call-backs here: who lands gradients, who hears of a landing and who joins background work is
decided by the engine when it builds the step (engine/landing.py, optim/adamw.py), and they call each other
directly. Mechanism only: no torch ops besides holding tensors, so it is tested with plain integers and fakes.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Protocol

import torch


class Phase(enum.Enum):
    EMPTY = "empty"
    ACCUMULATING = "accumulating"  # a gradient is being written (first visit overwrites, later ones add)
    LANDED = "landed"  # the gradient is complete where the plan keeps it
    UPDATING = "updating"  # an optimizer worker owns the unit's state
    READY = "ready"  # updated; weights may be loaded (same as EMPTY for the next backward)


_HAS_GRAD = (Phase.ACCUMULATING, Phase.LANDED)


class Peers(Protocol):
    """Other processes writing shards of the same units (parallel/peer_cells.py)."""

    def publish(self, unit: int, count: int) -> None: ...  # this process's updates of ``unit`` so far

    def wait(self, unit: int, count: int) -> None: ...  # until every process has made ``count`` updates of it

    # The same for the updates whose new compute copy (the weights a load reads) is written: a split update's
    # WEIGHTS pass publishes it before its STATE pass completes the update.
    def publish_weights(self, unit: int, count: int) -> None: ...

    def wait_weights(self, unit: int, count: int) -> None: ...


class StepState:
    def __init__(self, num_units: int, peers: Peers | None = None) -> None:
        self.phase = [Phase.EMPTY] * num_units
        self.grad_sq: list[torch.Tensor | None] = [None] * num_units
        # The dtype a unit's host gradient is held in when not its FP32 buffer's own (a narrow gradient: a single
        # whole visit's compute-dtype values, exact; engine/offload.py); None: FP32. Reset by each first visit.
        self.narrow: list[torch.dtype | None] = [None] * num_units
        self.version = [0] * num_units
        self._ready = [threading.Event() for _ in range(num_units)]
        # Set when the unit's weights may be loaded: ready, or its new weights published on the GPU (below).
        self._loadable = [threading.Event() for _ in range(num_units)]
        for e in self._ready + self._loadable:
            e.set()
        self._error: BaseException | None = None
        # Set when a reader reaches the units (a weight load, or a wait that would block): an updater that holds
        # copies back to host memory until then (optim/device_stepper.py) queues them now. Holding them keeps the
        # copy engine free while the forward's preamble reads single values back from the GPU.
        self.readers_arrived = threading.Event()
        self.readers_arrived.set()
        # (compute copy, event, version) of a unit whose updater made the new compute-dtype weights on the GPU:
        # the next forward may take them from there (event: they are written) instead of waiting for the update's
        # copies back to host memory and loading them again. Valid while the unit is at, or on its way to, that
        # version; dropped when another update begins or the master changes outside an update.
        self._early: list[tuple[Any, Any, int] | None] = [None] * num_units
        # The update in flight (or the last one) has written the unit's new compute copy in host memory
        # (``finish_weights``): loads need not wait for the rest of it. Cleared by the next ``begin_update``.
        self._weights_final = [False] * num_units
        # Final updates per unit (not ``version``, which a checkpoint load also moves): what ``peers`` compares. A
        # speculative update counts once judged right (it may still be taken back until then).
        self.updates = [0] * num_units
        # Of those, the updates whose new compute copy is written (a split update's WEIGHTS pass counts here before
        # the update does): what a load needs of the other ranks' shards (``peers.wait_weights``).
        self.weights_out = [0] * num_units
        self._unjudged = [False] * num_units
        self.peers = peers

    def __len__(self) -> int:
        return len(self.phase)

    @property
    def final_backward(self) -> bool:
        raise AttributeError("StepState.final_backward is gone: ask engine.final_backward")

    @final_backward.setter
    def final_backward(self, value: bool) -> None:  # (an old custom loop's write must not pass silently)
        raise AttributeError("hf_megatrain: StepState.final_backward is gone; call "
                             "engine.set_final_backward(True) before the last backward of a step")

    # -- gradients --------------------------------------------------------------------------------------------------
    def has_grad(self, i: int) -> bool:
        return self.phase[i] in _HAS_GRAD

    def updating(self, i: int) -> bool:
        """An optimizer worker owns unit ``i`` (a speculative update of the step's own gradient, still running)."""
        return self.phase[i] is Phase.UPDATING

    def any_grad(self) -> bool:
        return any(p in _HAS_GRAD for p in self.phase)

    def accumulate(self, i: int, sq: torch.Tensor | None = None) -> bool:
        """A gradient for unit ``i`` is on its way. Returns True when it is the step's first (it overwrites the
        buffer and its squared norm ``sq`` stands for the unit); a later one adds and voids the norm."""
        first = not self.has_grad(i)
        self.phase[i] = Phase.ACCUMULATING
        self.grad_sq[i] = sq if first else None
        if first:
            self.narrow[i] = None
        return first

    def landed(self, i: int) -> None:
        """Unit ``i``'s gradient is complete where its plan keeps it."""
        self.phase[i] = Phase.LANDED

    def narrowed(self, i: int, dtype: torch.dtype) -> None:
        """Unit ``i``'s host gradient is held in ``dtype`` (a narrow gradient: engine/offload.py)."""
        self.narrow[i] = dtype

    def widened(self, i: int) -> None:
        """Unit ``i``'s host gradient is FP32 again (``Unit.widen_grad_``)."""
        self.narrow[i] = None

    def void_norm(self, i: int) -> None:
        """Unit ``i``'s gradient changed after its squared norm was taken (a data-parallel all-reduce): the norm is
        computed from the gradient instead."""
        self.grad_sq[i] = None

    # -- updates -----------------------------------------------------------------------------------------------------
    def begin_update(self, i: int) -> None:
        self.phase[i] = Phase.UPDATING
        self._early[i] = None
        self._weights_final[i] = False
        self._ready[i].clear()
        self._loadable[i].clear()

    def publish_copy(self, i: int, copy: Any, event: Any) -> None:
        """Unit ``i``'s update (not speculative: final) has made its new compute-dtype weights in ``copy`` once
        ``event`` has completed; the rest of the update (copies back to host memory) may still run."""
        self._early[i] = (copy, event, self.version[i] + 1)
        self._loadable[i].set()

    def finish_weights(self, i: int) -> None:
        """Unit ``i``'s update (final, not speculative) has written its new compute copy in host memory: its weights
        may be loaded (the version moves now), while master, moments and gradient stay the updater's until
        ``finish_update``."""
        self.version[i] += 1
        self._weights_final[i] = True
        self.weights_out[i] = self.updates[i] + 1
        if self.peers is not None:
            self.peers.publish_weights(i, self.weights_out[i])
        self._loadable[i].set()

    def early_copy(self, i: int) -> tuple[Any, Any, int] | None:
        """(copy, event, version) of unit ``i``'s published weights while they are its current or coming version,
        else None. Safe against the updater finishing concurrently: a torn read answers None."""
        e = self._early[i]
        if e is None:
            return None
        coming = self.phase[i] is Phase.UPDATING and not self._weights_final[i]
        return e if e[2] == self.version[i] + (1 if coming else 0) else None

    def finish_update(self, i: int, changed: bool = True, keep_grad: bool = False, judged: bool = True) -> None:
        """Unit ``i``'s state is final for this step; ``changed``: its master moved (weights must be reloaded).
        ``keep_grad``: a speculative update -- the gradient (and its norm) stays landed for the step to judge.
        ``judged=False``: a speculative update whose gradient is gone (the lean store's): not counted until a later
        ``finish_update`` (judged right) or ``touch`` (taken back) settles it, as with ``keep_grad``."""
        self.phase[i] = Phase.LANDED if keep_grad else Phase.READY
        if not keep_grad:
            self.grad_sq[i] = None
        if changed and not self._weights_final[i]:  # (a split update moved it at finish_weights)
            self.version[i] += 1
        if keep_grad or not judged:
            self._unjudged[i] = self._unjudged[i] or changed
        elif changed or self._unjudged[i]:  # final: a plain update, or a speculative one judged right
            self._unjudged[i] = False
            self.updates[i] += 1
            whole = self.weights_out[i] < self.updates[i]  # (a split update published its weights already)
            self.weights_out[i] = self.updates[i]
            if self.peers is not None:
                if whole:
                    self.peers.publish_weights(i, self.weights_out[i])
                self.peers.publish(i, self.updates[i])
        self._ready[i].set()
        self._loadable[i].set()

    def touch(self, i: int | None = None) -> None:
        """A master changed outside an update (checkpoint load, a lean take-back): cached copies are stale."""
        for j in range(len(self)) if i is None else (i,):
            self.version[j] += 1
            self._early[j] = None
            self._unjudged[j] = False  # (a speculative update taken back never counts)

    def discard(self) -> None:
        """Drop every gradient of the step (``zero_grad``, a skipped step): units become READY, masters unchanged."""
        for i, p in enumerate(self.phase):
            if p in _HAS_GRAD:
                self.phase[i] = Phase.READY
            self.grad_sq[i] = None

    def fail(self, error: BaseException) -> None:
        """A worker failed: remember the error (raised by the next wait) and release every waiter."""
        self._error = error
        for e in self._ready + self._loadable:
            e.set()

    def wait_ready(self, i: int) -> None:
        if not self._ready[i].is_set():
            self.readers_arrived.set()  # (a blocking waiter never waits on copies held back for readers)
        self._ready[i].wait()
        self._raise()

    def wait_state(self, i: int) -> None:
        """Block while a split update of unit ``i`` (``finish_weights`` done) still owns its master, moments and
        gradient: before anyone writes the gradient buffer its second pass reads."""
        if self._weights_final[i]:
            self.wait_ready(i)

    def wait_loadable(self, i: int) -> tuple[Any, Any, int] | None:
        """Block until unit ``i``'s weights may be loaded; returns its published GPU copy (``early_copy``) when
        that is what made it loadable, else None once it is ready."""
        self.readers_arrived.set()
        self._loadable[i].wait()
        self._raise()
        early = self.early_copy(i)
        if early is None and not self._weights_final[i]:
            self.wait_ready(i)
        if self.peers is not None:  # (a shared unit: the other ranks' shards of the same update's weights)
            self.peers.wait_weights(i, self.weights_out[i])
        return early

    def wait_all(self) -> None:
        """Block until no update is in flight; re-raise a worker's failure. (The optimizer's ``wait()`` also
        joins its worker threads first, which re-raises a lean update's failure at once.)"""
        self.readers_arrived.set()
        for e in self._ready:
            e.wait()
        self._raise()
        if self.peers is not None:
            for i, n in enumerate(self.updates):
                self.peers.wait(i, n)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("hf_megatrain: the optimizer step failed") from err
