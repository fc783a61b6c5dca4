"""GradReach: which parameters of each unit autograd gave a gradient since the unit's gradient was last consumed.

``torch.optim.AdamW`` skips a parameter whose ``.grad`` is None (unused in the forward, an expert no token was
routed to in any micro-batch of the step): no weight decay, no moment decay, no step count. Our gradients are flat
per-unit buffers, where "no gradient" and "a zero gradient" look the same, so whoever produces a unit's gradient
records per parameter whether autograd reached it: the executor for layers (hooks on the recompute's leaves), the
engine for the resident unit (its ``.grad`` is None or not), and the optimizer for units no backward reached
(nothing reached). The optimizer takes each unit's flags when it steps it and skips the spans not reached
(optim/adamw.py). A unit with no record (a gradient written some other way) is stepped whole, as before.
"""

from __future__ import annotations

from typing import Sequence


class GradReach:
    def __init__(self) -> None:
        self._flags: dict[int, list[bool]] = {}

    def record(self, unit: int, reached: Sequence[bool], first: bool) -> None:
        """This backward's flags for ``unit`` (one per parameter, in unit order); ``first``: the step's first
        gradient of the unit (replaces older flags), else OR-ed with the earlier ones (accumulation, chunks)."""
        old = self._flags.get(unit)
        if first or old is None or len(old) != len(reached):
            self._flags[unit] = [bool(r) for r in reached]
        else:
            self._flags[unit] = [a or bool(b) for a, b in zip(old, reached)]

    def peek(self, unit: int) -> list[bool] | None:
        """The flags of ``unit`` so far (None: unknown), kept."""
        return self._flags.get(unit)

    def take(self, unit: int) -> list[bool] | None:
        """The flags of ``unit`` (None: unknown, step every parameter), forgotten afterwards."""
        return self._flags.pop(unit, None)

    def clear(self) -> None:
        self._flags.clear()
