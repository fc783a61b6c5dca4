"""StepCounts: how many AdamW steps each unit -- and, where they differ, each parameter -- has taken.

torch.optim.AdamW counts steps per parameter and skips a parameter whose ``.grad`` is None. Units are updated whole
(one kernel call over flat buffers), so the count is kept per unit, and only for units some of whose parameters
skipped steps (no gradient reached them, core/grad_reach.py) each parameter's skipped steps (``missed``: its own count
is the unit's minus that). An update then runs per distinct count (``by_step``), each over its parameters' spans,
grouped by param group (decayed or not). Bookkeeping on integers only; it travels with checkpoints
(``state_tensors``).
"""

from __future__ import annotations

import torch

from ..core import kernels
from ..core.store import Unit


class StepCounts:
    def __init__(self, units: list[Unit], group_of: dict[int, int]) -> None:
        """``group_of``: 0 (decayed) / 1 (not) -> the index of that param group in the optimizer."""
        self._group_of = group_of
        # unit index -> [(0 = decayed | 1 = not, spans)], and (group, start, end) per parameter
        self._unit_groups: dict[int, list[tuple[int, list[tuple[int, int]]]]] = {}
        self._param_spans: dict[int, list[tuple[int, int, int]]] = {}
        for unit in units:
            per_group: dict[int, list[tuple[int, int]]] = {}
            for p in unit.params:
                g = 0 if p.decay else 1
                per_group.setdefault(g, []).append((p.offset, p.offset + p.numel))
                self._param_spans.setdefault(unit.index, []).append((g, p.offset, p.offset + p.numel))
            self._unit_groups[unit.index] = sorted(per_group.items())
        self._counts = [0] * len(units)
        self._missed: dict[int, list[int]] = {}

    def of(self, i: int) -> int:
        """Unit ``i``'s step count."""
        return self._counts[i]

    def add(self, i: int) -> int:
        """Unit ``i`` takes a step; returns its new count."""
        self._counts[i] += 1
        return self._counts[i]

    def take_back(self, i: int) -> None:
        """Unit ``i``'s last step was taken back (a speculative update the norm proved wrong)."""
        self._counts[i] -= 1

    def skipped_some(self, i: int) -> bool:
        """Some parameter of unit ``i`` skipped a step (it keeps per-parameter counts)."""
        return i in self._missed

    def missed(self) -> dict[int, list[int]]:
        """Per unit that keeps them: each parameter's skipped steps. A copy."""
        return {i: list(m) for i, m in self._missed.items()}

    def groups(self, i: int, hyper: list[kernels.Hyper]) -> kernels.Groups:
        """Unit ``i``'s spans per param group, with that group's hyper-parameters."""
        return [(hyper[self._group_of[g]], spans) for g, spans in self._unit_groups[i]]

    def by_step(self, i: int, hyper: list[kernels.Hyper],
                reached: list[bool] | None) -> list[tuple[int, kernels.Groups]]:
        """(step count, groups) of unit ``i``'s update now (after ``add``): every span at the unit's count, unless
        some parameter got no gradient now (left out, its skip counted) or missed earlier steps (its own, lower
        count)."""
        count = self._counts[i]
        if (reached is None or all(reached)) and i not in self._missed:
            return [(count, self.groups(i, hyper))]
        missed = self._missed.setdefault(i, [0] * len(self._param_spans[i]))
        by_step: dict[int, dict[int, list[tuple[int, int]]]] = {}
        for k, (g, lo, hi) in enumerate(self._param_spans[i]):
            if reached is not None and not reached[k]:
                missed[k] += 1
                continue
            by_step.setdefault(count - missed[k], {}).setdefault(g, []).append((lo, hi))
        return [(step, [(hyper[self._group_of[g]], spans) for g, spans in sorted(per.items())])
                for step, per in sorted(by_step.items())]

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"unit_steps": torch.tensor(self._counts, dtype=torch.float32)}
        for i, missed in self._missed.items():  # (only units that skipped some)
            out[f"missed_steps.{i}"] = torch.tensor(missed, dtype=torch.float32)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._counts = [int(v) for v in tensors["unit_steps"].tolist()]
        self._missed = {i: [int(v) for v in tensors[f"missed_steps.{i}"].tolist()]
                        for i in range(len(self._counts)) if f"missed_steps.{i}" in tensors}
