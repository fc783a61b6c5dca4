"""SpeculationPolicy: when to update a unit before the global norm is known, and what to take back or re-run.

One policy decides for both modes that update a unit as soon as its gradient is final (the step's last backward):
the speculative host step (``speculative_step``: optim/speculative_step.py) and the lean store, whose gradients have
no buffer and must be consumed as they land (optim/lean.py). Each carries the decisions out; neither decides.

A step that does not clip needs no correction, so after an unclipped step the next one *speculates*: each unit is
updated as its gradient lands (with no clip factor). When ``step()`` finds that the global norm clips (or is
non-finite, or the hyper-parameters changed since), every speculated update is taken back (restored from the
copy optim/take_back.py made before it, bit-exact; else arithmetically, within an ulp) and redone with the true
factor -- for the lean store from a *re-run* of the step's forward+backward, since its gradients are gone. After a
step that clipped, the next one takes its *norm first* (no speculation; the lean store then re-runs every such
step), so a run that clips throughout never takes anything back. Decisions are made on unit indices, squared norms
and keys only (tested with fakes: tests/test_components.py).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

GA_MESSAGE = ("lean_store: {what} before optimizer.step(). The lean store consumes each layer's gradient as its "
              "backward ends, so it supports exactly one backward per optimizer step: no gradient accumulation. "
              "Use micro_batch_size (splits the batch inside each layer visit: same math, one backward) with "
              "gradient_accumulation_steps=1, or lean_store=False.")

Key = tuple  # (grad_scale or None, Hyper per param group): what a unit's update assumed


class Act(enum.Enum):
    KEEP = "keep"  # nothing to do (norm recorded; or the applied update was right)
    UPDATE = "update"  # apply the whole update
    UNDO = "undo"  # undo the applied moments (master taken back already); no new update
    REDO = "redo"  # undo the applied moments, then apply the right update


class Settle(enum.Enum):
    """How the lean store settles a step's decision (optim/lean.py ``_rerun``)."""

    NOTHING = "nothing"  # nothing speculated to take back, nothing left to update
    REPLAY = "replay"  # from the gradient plane: every gradient of the step is there
    RESTORE = "restore"  # a skipped step whose speculated updates all have take-back copies
    RERUN = "rerun"  # re-run the step's forward+backward (collective with data parallel)


@dataclass
class StepDecision:
    rerun: bool  # the forward+backward must run again
    take_back: list[int]  # units whose applied update was wrong: take their masters back before the re-run
    expected: set[int]  # units the re-run must bring a gradient for


def settle_path(d: StepDecision, skip: bool, plane_holds: bool, copies_all: bool) -> Settle:
    """How one process settles ``d``: ``plane_holds``, every gradient it needs is on the plane; ``copies_all``,
    every update to take back has an exact copy. (Data parallel: the ranks of a skipped step may answer differently
    -- a non-finite shard stops speculation on its rank only, copies are per rank -- and then agree on RERUN if any
    rank needs it: the re-run is collective.)"""
    if not d.take_back and not d.expected:
        return Settle.NOTHING
    if plane_holds:
        return Settle.REPLAY
    if skip and copies_all:
        return Settle.RESTORE
    return Settle.RERUN


@dataclass
class SpeculationPolicy:
    """Speculation decisions for one optimizer (the host speculative step, or the lean store), on unit indices,
    squared norms and keys only."""

    norm_first: bool  # the next step's mode
    mode: bool | None = None  # the mode of the step in progress (fixed by its first gradient); True = norm first
    seen: set[int] = field(default_factory=set)
    sq: dict[int, float] = field(default_factory=dict)
    applied: dict[int, Key] = field(default_factory=dict)  # unit -> what its applied update assumed
    nonfinite: set[int] = field(default_factory=set)
    rerun: tuple | None = None  # (grad_scale, skip, key) while the step re-runs
    corrected: set[int] = field(default_factory=set)
    max_sq_error: float = 0.0  # largest relative change of a layer's squared norm in a re-run

    def first_pass(self, i: int, sq: float, key_now: Key) -> Act:
        """A gradient of the step's own backward arrived for unit ``i`` with squared norm ``sq``."""
        if i in self.seen:
            raise RuntimeError(GA_MESSAGE.format(what=f"layer unit {i} received a second gradient"))
        if self.mode is None:
            self.mode = self.norm_first
        self.seen.add(i)
        self.sq[i] = sq
        if not math.isfinite(sq):  # the global norm is non-finite too: the step is skipped, nothing to take back
            self.nonfinite.add(i)
            return Act.KEEP
        if self.mode or self.nonfinite:  # (a non-finite gradient landed: the step will be skipped, apply no more)
            return Act.KEEP
        self.applied[i] = key_now
        return Act.UPDATE

    def would_update(self, sq: float) -> bool:
        """Whether ``first_pass`` with squared norm ``sq`` would return UPDATE now (asked before it, so a unit that
        cannot get an exact take-back copy can be left to ``step()`` without entering the policy)."""
        return math.isfinite(sq) and not self.nonfinite and not (self.norm_first if self.mode is None else self.mode)

    def decide(self, skip: bool, want: Key, skip_nonfinite: bool) -> StepDecision:
        """At ``step()``: which speculated updates are wrong and whether the step must re-run."""
        take_back = [i for i, k in self.applied.items() if skip or k != want]
        pending = not skip and any(i not in self.applied for i in self.seen)  # norm first, or NaN layers
        expected = set(self.applied) | (set() if skip else self.seen - self.nonfinite)
        if not skip and not skip_nonfinite:
            expected |= self.nonfinite
        return StepDecision(bool(take_back or pending), take_back, expected)

    def regenerated(self, i: int, sq: float) -> Act:
        """A gradient of the re-run arrived for unit ``i``."""
        grad_scale, skip, want = self.rerun
        ref = self.sq.get(i)
        if ref is not None and math.isfinite(ref) and ref > 0:
            self.max_sq_error = max(self.max_sq_error, abs(sq - ref) / ref)
        self.corrected.add(i)
        if i in self.applied:
            if self.applied[i] == want and not skip:
                return Act.KEEP
            if not math.isfinite(sq):
                raise RuntimeError(f"lean_store: the re-run gave layer unit {i} a non-finite gradient where the "
                                   "first run's was finite (nondeterministic kernels?); its AdamW state cannot be "
                                   "corrected")
            del self.applied[i]
            if skip:
                return Act.UNDO
            self.applied[i] = want
            return Act.REDO
        if skip:
            return Act.KEEP
        self.applied[i] = want
        return Act.UPDATE

    def end(self, clipped: bool | None) -> None:
        """The step's gradients are spent; ``clipped`` (None: skipped/discarded) sets the next step's mode."""
        if clipped is not None:
            self.norm_first = clipped
        self.seen.clear()
        self.sq.clear()
        self.applied.clear()
        self.nonfinite.clear()
        self.mode = None
