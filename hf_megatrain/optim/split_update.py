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

A split moves more bytes in all (46 instead of 30 per parameter), so it pays only where the host has time to spare
beside the GPU: ``SplitPolicy`` splits a step's updates when their split work, at the host rate measured over the
last step, fits in ``slack`` of the last step's interval (the first step that launches updates runs them whole).
Measured on the H100 host: integration/PERF.md, lever 46.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SplitPolicy:
    """Whether a step's host layer updates run split. ``mode``: "auto" (by the measured rule above), "on", "off".
    Pure bookkeeping over numbers the optimizer hands it (tested with made-up times)."""

    mode: str = "auto"
    slack: float = 0.75  # share of the step interval the split host work may fill
    rate: float | None = None  # host DRAM bytes per second of the updates of the last step (None: none measured)
    interval: float | None = None  # seconds between the last two step() calls
    _last: tuple[float, int, float] | None = None  # (time, host bytes, host seconds) at the last observe()

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"split_host_update={self.mode!r}: use 'auto', 'on' or 'off'")

    def observe(self, now: float, host_bytes: int, host_seconds: float) -> None:
        """At each step(), once the last step's updates are finished: the optimizer's running totals of host update
        bytes and seconds, and the time."""
        if self._last is not None:
            t, b, s = self._last
            self.interval = now - t
            if host_seconds > s and host_bytes > b:
                self.rate = (host_bytes - b) / (host_seconds - s)
        self._last = (now, host_bytes, host_seconds)

    def decide(self, split_bytes: int) -> bool:
        """Split this step's updates, which would move ``split_bytes`` of host DRAM split?"""
        if self.mode != "auto" or split_bytes <= 0:
            return self.mode == "on" and split_bytes > 0
        if self.rate is None or self.interval is None:
            return False
        return split_bytes / self.rate <= self.slack * self.interval

    def describe(self) -> str:
        if self.mode != "auto":
            return self.mode
        if self.rate is None or self.interval is None:
            return "auto (not measured yet)"
        return f"auto (host {self.rate / 1e9:.0f} GB/s, step {self.interval:.3f} s, slack {self.slack:.0%})"
