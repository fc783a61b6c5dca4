"""GradPlane: the lean store's gradient plane -- each layer's gradient of the step, kept on the host.

Why: a lean layer has no gradient buffer (optim/lean.py), so a step whose clip factor is known only after the
whole backward has had to re-run its forward+backward to regenerate each gradient (twice the GPU work). Where a
layer's visit is computed whole in the compute dtype (one backward per step, no micro-batch split: the condition of
narrow gradients, engine/offload.py), the gradient autograd produced *is* a bf16 tensor, so keeping it costs 2
bytes per parameter and loses nothing (without narrow gradients the plane is FP32, 4 bytes, as they cross): the
offload copies it straight here (in place of the staging slab),
its squared norm rides along as before, and once ``step()`` knows the global norm each layer is updated from its
slice with the clip factor -- in the next forward's order, overlapping that forward, like the full store's
launch. A speculative update that turns out wrong is taken back from the same slice (the arithmetic take-back
needs the gradient), so nothing ever re-runs.

A step whose gradients did not land here (a bf16 plane, a visit split into micro-batches: an FP32 sum) re-runs,
with a log line saying why (``why_not``). Allocated by ``LeanAdamW`` where its plan says
(``UnitPlan.grad_plane``: core/plan.py decides ``lean_grad_plane``; the planner counts the bytes).
"""

from __future__ import annotations

import torch

from typing import Callable

from ..core.memory import alloc_host
from ..core.store import Unit


class GradPlane:
    """One flat host buffer of ``dtype`` holding a slice per unit given (the lean layers).

    Data parallel: each rank keeps the plane of its own shards (``span``: the range of a unit it steps; the slice
    holds that range from its element 0), in its own memory: the host holds each gradient once over its ranks, as
    one process would, and no rank reads another's."""

    def __init__(self, units: list[Unit], dtype: torch.dtype, pin: bool,
                 span: Callable[[Unit], tuple[int, int]] | None = None) -> None:
        self.dtype = dtype
        self._at: dict[int, tuple[int, int]] = {}
        n = 0
        for u in units:
            lo, hi = span(u) if span is not None else (0, u.numel)
            self._at[u.index] = (n, hi - lo)
            n += hi - lo
        self.buffer = alloc_host(max(n, 1), dtype, pin)
        self.landed: set[int] = set()  # units whose gradient of the step in progress is here
        self.missed: set[int] = set()  # units whose gradient of the step went elsewhere (not narrow)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def has(self, i: int) -> bool:
        return i in self._at

    def of(self, i: int) -> torch.Tensor:
        """Unit ``i``'s slice (its gradient of the step, once landed; data parallel: of this rank's shard)."""
        lo, n = self._at[i]
        return self.buffer[lo:lo + n]

    def slab(self, i: int, dtype: torch.dtype | None) -> torch.Tensor | None:
        """Where the offload copies unit ``i``'s gradient arriving in ``dtype`` (None: FP32): its slice when the
        gradient is in the plane's dtype, else None (the FP32 staging slab; the step cannot use the plane)."""
        return self.of(i) if (dtype or torch.float32) == self.dtype and i in self._at else None

    def note(self, i: int, slab: torch.Tensor) -> None:
        """A first-pass gradient of unit ``i`` arrives in ``slab``: on the plane or not."""
        on = i in self._at and slab.data_ptr() == self.of(i).data_ptr()
        (self.landed if on else self.missed).add(i)

    def holds(self, units: set[int]) -> bool:
        """Every gradient of ``units`` (the step's) landed here."""
        return not self.missed and units <= self.landed

    def why_not(self) -> str:
        return (f"layer units {sorted(self.missed)[:4]} received an FP32 gradient (a layer visit split into "
                "micro-batches by micro_batch_size sums them in FP32, not exact in bf16)")

    def end_step(self) -> None:
        self.landed.clear()
        self.missed.clear()
