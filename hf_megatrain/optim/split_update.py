"""Split host updates: the next forward waits for a layer's new weights, not for its whole new state.

Where the host AdamW runs after the global gradient norm (clipping active: a norm-first step, optim/adamw.py), the
next forward waits for each layer's update in its order, and a whole update moves 28-30 bytes of host DRAM per
parameter; the forward reads only the layer's new compute copy. Split, a layer's update runs in two passes over the
same inputs (core/kernels.py ``UpdatePart``):

    WEIGHTS  in the forward's order: reads master, gradient and moments, writes only the compute copy (16-18 bytes
             per parameter); the layer is loadable after it (``StepState.finish_weights``)
    STATE    once every layer's weights are out, in the *backward's* order (the last layer first): the same
             expressions again, writing master and moments (26-28 bytes), while the next forward and backward run

Both passes evaluate the same float expressions on the same inputs: the pair writes exactly the bits one whole pass
writes (tests/test_split_update.py). Until its STATE pass a layer stays UPDATING: the gradient path waits for it
before landing the next gradient into the buffer the pass reads (engine/offload.py; the backward lands the last layer
first, hence the reverse order), and readers of the state (checkpoints, exports, the next step) wait for ready as
for any update.

A split moves more bytes in all (42-46 instead of 28-30 per parameter), so it pays only while the host has time for
them: whole, a step that waits on its updates takes about the whole update W plus the backward B; split, the forward
waits ~0.57 W and the step takes max(0.57 W + B, 1.5 W): better while 1.5 W < W + B. ``SplitPolicy`` splits a step's
updates when their split work, at the host rate measured over the last step, fits ``slack`` (core/plan.py
``SPLIT_SLACK``, 0.9) of the last step's interval; the first step that launches updates runs them whole. The
step-time model (planner/step_time.py) plays the same rule. Measured: integration/PERF.md, lever 46.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.plan import SPLIT_SLACK


@dataclass
class SplitPolicy:
    """Whether a step's host layer updates run split. ``mode``: "auto" (the rule below), "on", "off". Pure bookkeeping
    over numbers the optimizer hands it (tested with made-up times).

    "auto" compares against the interval of the last step whose updates ran *whole* (the W + B above): split when the
    split work at the measured host rate fits ``slack`` of it; back to whole when a split step took longer than that
    whole one, and for one step after ``refresh`` split ones in a row (the whole interval is re-measured: sequence
    lengths and the machine's rates move)."""

    mode: str = "auto"
    slack: float = SPLIT_SLACK
    refresh: int = 50
    rate: float | None = None  # host DRAM bytes per second of the updates of the last step (None: none measured)
    whole_interval: float | None = None  # seconds of the last step that waited on whole updates
    split_interval: float | None = None  # ... on split ones
    _split_run = 0  # split steps since the last whole one
    _last: tuple[float, int, float] | None = None  # (time, host bytes, host seconds) at the last observe()

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"split_host_update={self.mode!r}: use 'auto', 'on' or 'off'")

    def observe(self, now: float, host_bytes: int, host_seconds: float, split: bool) -> None:
        """At each step(), once the last step's updates are finished: the optimizer's running totals of host update
        bytes and seconds, the time, and whether the updates the ending interval waited on ran split."""
        if self._last is not None:
            t, b, s = self._last
            if split:
                self.split_interval = now - t
            else:
                self.whole_interval = now - t
            if host_seconds > s and host_bytes > b:
                self.rate = (host_bytes - b) / (host_seconds - s)
        self._last = (now, host_bytes, host_seconds)

    def decide(self, split_bytes: int, last_split: bool) -> bool:
        """Split this step's updates, which would move ``split_bytes`` of host DRAM split? ``last_split``: the
        updates the last interval waited on ran split."""
        if self.mode != "auto" or split_bytes <= 0:
            return self.mode == "on" and split_bytes > 0
        split = (self.rate is not None and self.whole_interval is not None and self._split_run < self.refresh
                 and not (last_split and self.split_interval is not None
                          and self.split_interval > self.whole_interval)
                 and split_bytes / self.rate <= self.slack * self.whole_interval)
        self._split_run = self._split_run + 1 if split else 0
        return split

    def describe(self) -> str:
        if self.mode != "auto":
            return self.mode
        if self.rate is None or self.whole_interval is None:
            return "auto (not measured yet)"
        return (f"auto (host {self.rate / 1e9:.0f} GB/s, whole step {self.whole_interval:.3f} s, slack "
                f"{self.slack:.0%})")


class SplitUpdates:
    """The optimizer's split updates, one owner for their state: which units may split (``candidates``), the policy,
    whether this step's updates run split (``last_step``) and each split update's step counts and spans between its
    two passes (``remember`` / ``take``)."""

    def __init__(self, policy: SplitPolicy, candidates: frozenset[int]) -> None:
        self.policy = policy
        self.candidates = candidates
        self.last_step = False  # some update launched by the current step runs split
        self._before = False  # the updates the current interval waited on ran split
        self._steps: dict[int, list] = {}  # unit -> the (step, groups) of its split update, until the second pass

    def begin_step(self, now: float, host_bytes: int, host_seconds: float) -> None:
        """At ``step()``, once the last step's updates are joined: the policy measures the interval that ended."""
        self.policy.observe(now, host_bytes, host_seconds, self.last_step)
        self._before, self.last_step = self.last_step, False

    def choose(self, ids: list[int], split_bytes: Callable[[int], int]) -> list[int]:
        """The units of ``ids`` (in order) whose updates run split this step: its candidates, when the policy says
        their split work (``split_bytes(unit)`` host bytes each) fits; else none."""
        split = [i for i in ids if i in self.candidates]
        if not split or not self.policy.decide(sum(split_bytes(i) for i in split), self._before):
            return []
        self.last_step = True
        return split

    def remember(self, unit: int, steps: list) -> None:
        self._steps[unit] = steps

    def take(self, unit: int) -> list:
        return self._steps.pop(unit)
