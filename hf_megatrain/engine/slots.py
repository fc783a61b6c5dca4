"""WeightSlots: the GPU slots decoder layers run from, and how each unit's weights get into one.

Each unit's plan (core/plan.py) picks, once, at construction, how its weights come in:

    master on the device (kept layer)     cast into the slot on the compute stream: no PCIe
    compute copy on the host              one H2D copy on the H2D stream
    FP32 master on the host (lean, fp32)  H2D; when the compute dtype differs, cast on the GPU in chunks through a
                                          small FP32 staging buffer (a non-blocking copy with a dtype change would
                                          allocate a full FP32 temporary of the layer on the GPU)

Before loading a unit the slots wait until the step state says it is ready (its update may still run on an
optimizer thread), unless its updater published the new weights on the GPU (``StepState.early_copy``: a layer
stepped on the GPU with its state in host memory), which are then copied device to device; a slot is reused only
while it holds the unit's current version, so nobody has to tell the slots that weights changed. Slots are
filled least-recently-used first, the ones the pass needs next protected.

The next layers of a pass are prefetched in ``release``, once the current layer's compute is queued, not in
``acquire`` before it: after a clipping step the forward meets layers whose updates are still running on the host,
and a prefetch that waits for layer i+1's update before layer i's compute is queued leaves the GPU idle for that
wait although layer i's weights are in. Prefetched after the queueing, the wait runs beside layer i's compute.

So the host's wait (``wait_optimizer_s``) overstates what the GPU loses: ``gpu_wait_optimizer_s`` is the GPU's own
idle for each load that waited for an update -- an event on the compute stream before the host's wait, and one where
the compute stream has waited for that load (``acquire``); the time between the GPU reaching the two is the time it
had nothing queued because of the update: its wait *and* the copy after it (zero when the queued work outlasted
both). Measured on an H100 (integration/PERF.md, lever 61), an event right after the host's wait missed the copy:
0.6-1 % of the step against ~6-11 % in the profiler's gaps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..core.plan import CAST_STAGING_BYTES, Where
from ..core.step_state import StepState
from ..core.store import Unit
from ..core.streams import StreamSet

if TYPE_CHECKING:
    from .weight_gather import WeightGather

NOTED_WAIT_S = 50e-6  # host waits shorter than this are not timed on the GPU (a ready update's bookkeeping)


class WeightSlots:
    def __init__(self, units: list[Unit], state: StepState, streams: StreamSet, *, device: torch.device,
                 compute_dtype: torch.dtype, num_slots: int, gather: WeightGather | None = None) -> None:
        self.units, self.state, self.streams = units, state, streams
        # Data parallel: the training forward's loads by shards plus an all-gather (engine/weight_gather.py).
        self.gather = gather
        slot_numel = max(max(u.numel + u.frozen_numel for u in units), gather.slot_numel(units) if gather else 0)
        self.slots = [torch.empty(slot_numel, dtype=compute_dtype, device=device) for _ in range(num_slots)]
        self.held: list[tuple[int, int] | None] = [None] * num_slots  # (layer, version) in each slot
        self.ready: list[Any] = [None] * num_slots  # event: the slot's load finished
        self.free: list[Any] = [None] * num_slots  # event: the last compute reading the slot finished
        self.tick = [0] * num_slots
        self._tick = 0
        self.from_device = [u.plan.master is Where.DEVICE for u in units]  # the load strategy, per layer
        cast_numel = max((u.numel for u, dev in zip(units, self.from_device)
                          if not dev and u.source.dtype != compute_dtype), default=0)
        self.cast_stage = (torch.empty(min(cast_numel, CAST_STAGING_BYTES // 4), dtype=torch.float32, device=device)
                           if cast_numel and device.type == "cuda" else None)
        self.h2d_bytes = 0
        self.wait_optimizer_s = 0.0  # host time the passes spent waiting for optimizer updates
        self._gpu_wait_s = 0.0
        self._gpu_waits: list[tuple[Any, Any]] = []  # (compute-stream events before, after) a wait of the host
        # Per slot: (layer, compute-stream event recorded before the host waited for that layer's update), until the
        # compute stream waits for the load (``acquire``): the GPU's wait is the update *and* the copy after it.
        self._waited_from: dict[int, tuple[int, Any]] = {}
        self._next: tuple[int, int] | None = None  # (layer, pass direction) whose successors release() prefetches

    def acquire(self, index: int, step: int) -> int:
        """Make layer ``index`` resident (the compute stream waits for its load) and have ``release`` prefetch the
        next ones in pass direction ``step`` (+1 / -1). Returns the slot."""
        s = self._load(index, protect=set())
        self._tick += 1
        self.tick[s] = self._tick
        self._next = (index, step)
        self.streams.wait(self.streams.compute, self.ready[s])
        waited = self._waited_from.pop(s, None)
        if waited is not None and waited[0] == index:  # (its weights are usable on the compute stream from here)
            self._gpu_waits.append((waited[1], self.streams.record(self.streams.compute, timing=True)))
            if len(self._gpu_waits) > 64:  # (folded as they complete, so a run nobody reads stays bounded)
                self._fold_gpu_waits()
        # A measurement of a load this pass will not use next (it turned, or skips layers) is dropped: its compute
        # stream interval would span other work.
        ahead = {index + k * step for k in range(1, len(self.slots))}
        self._waited_from = {k: w for k, w in self._waited_from.items() if w[0] in ahead}
        return s

    def release(self, s: int) -> None:
        """The compute stream's work on slot ``s`` is queued: the slot may be refilled once it has run. Then the
        layers after it in the pass are loaded (waiting for their updates while that work runs)."""
        self.free[s] = self.streams.record(self.streams.compute)
        if self._next is None:
            return
        (index, step), self._next = self._next, None
        protect = {s}
        for k in range(1, len(self.slots)):
            j = index + k * step
            if not 0 <= j < len(self.units):
                break
            protect.add(self._load(j, protect))

    def prefetch(self, index: int) -> None:
        """Start loading layer ``index`` now: the pass reaches it after layers that run from no slot (a kept
        forward graph: engine/executor.py), whose backward is the time to copy it in."""
        if 0 <= index < len(self.units):
            self._load(index, protect=set())

    def begin_pass(self, training_forward: bool) -> None:
        """A forward of the layer stack starts (``training_forward``: every rank runs it alike)."""
        if self.gather is not None:
            self.gather.begin_pass(training_forward)

    def end_pass(self) -> None:
        """The forward ended: the gathers it still owes the other ranks (units it never loaded)."""
        if self.gather is not None:
            for k in self.gather.end_pass():
                self._load_one(k, protect=set(), gathered=True)

    def _load(self, index: int, protect: set[int]) -> int:
        """Make layer ``index`` loaded in some slot not in ``protect`` (a gathered pass first gathers the units it
        owes before it); returns the slot."""
        if self.gather is not None:
            for k in self.gather.due(index):
                s = self._load_one(k, protect, gathered=True)
                if k == index:
                    return s
        return self._load_one(index, protect, gathered=False)

    def _load_one(self, index: int, protect: set[int], gathered: bool) -> int:
        unit = self.units[index]
        t0 = time.perf_counter()
        before = self.streams.record(self.streams.compute, timing=True)
        with torch.profiler.record_function("megatrain.wait_optimizer"):
            early = self.state.wait_loadable(unit.index)
        waited = time.perf_counter() - t0
        self.wait_optimizer_s += waited
        # ``early``: updated on the GPU, its new weights are there already (the copies to the host may still run)
        held = (index, self.state.version[unit.index] if early is None else early[2])
        if held in self.held and not gathered:
            s = self.held.index(held)
        else:
            # (a gathered load takes part in the collective even when a slot holds the unit: the same bytes again;
            # that slot is not in use, its last reader is before its ``free`` event)
            s = self.held.index(held) if held in self.held else min(
                (k for k in range(len(self.slots)) if k not in protect), key=lambda k: self.tick[k])
            self._waited_from.pop(s, None)  # (refilled: a measurement its old load carried is void)
            self._fill(s, index, held, early, gathered)
        if before is not None and waited > NOTED_WAIT_S and self._waited_from.get(s, (None,))[0] != index:
            self._waited_from[s] = (index, before)  # (a wait measured since this load began counts from there)
        return s

    def _fill(self, s: int, index: int, held: tuple[int, int], early: Any, gathered: bool = False) -> None:
        """Load layer ``index`` (version ``held``) into slot ``s``: from the GPU copy its updater published, the
        device master, the host, or (``gathered``) this rank's shard from the host and the others' from their GPUs."""
        unit = self.units[index]
        st = self.streams
        self.held[s] = held
        slot = self.slots[s]
        if gathered:
            assert early is None and self.gather is not None and not self.from_device[index]
            with st.on(st.h2d):
                st.wait(st.h2d, self.free[s])
                self.h2d_bytes += self.gather.fill(st, slot, unit)
                if unit.frozen is not None:  # (after the gather: it may have written padding over their place)
                    slot[unit.numel:unit.numel + unit.frozen_numel].copy_(unit.frozen, non_blocking=True)
                self.ready[s] = st.record(st.h2d)
            self.h2d_bytes += unit.frozen_numel * slot.element_size()
            return
        if early is not None:
            st.wait(st.compute, self.free[s])
            st.wait(st.compute, early[1])
            slot[:unit.numel].copy_(early[0][:unit.numel])  # device to device, no PCIe
            self.ready[s] = None
            return
        if self.from_device[index]:
            st.wait(st.compute, self.free[s])
            slot[:unit.numel].copy_(unit.master)  # device cast, no PCIe
            self.ready[s] = None
            return
        with st.on(st.h2d):
            st.wait(st.h2d, self.free[s])
            self._copy_in(slot[:unit.numel], unit.source)
            if unit.frozen is not None:
                slot[unit.numel:unit.numel + unit.frozen_numel].copy_(unit.frozen, non_blocking=True)
            self.ready[s] = st.record(st.h2d)
        self.h2d_bytes += unit.numel * unit.source.element_size() + unit.frozen_numel * slot.element_size()

    def _fold_gpu_waits(self) -> None:
        pending = []
        for before, after in self._gpu_waits:
            if after.query():
                self._gpu_wait_s += before.elapsed_time(after) / 1e3
            else:
                pending.append((before, after))
        self._gpu_waits = pending

    @property
    def gpu_wait_optimizer_s(self) -> float | None:
        """Seconds the GPU sat idle for loads that waited for optimizer updates -- the wait and the copy after it
        (those whose events have run); None without a GPU (nothing measured, not zero)."""
        if self.streams.compute is None:
            return None
        self._fold_gpu_waits()
        return self._gpu_wait_s

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host -> slot on the current (H2D) stream; an FP32 master cast through the staging buffer chunk by chunk
        (chunks reuse the buffer in stream order)."""
        if src.dtype == dst.dtype or self.cast_stage is None:
            dst.copy_(src, non_blocking=True)  # (on the CPU a cast copy: same rounding as the GPU cast)
            return
        c = self.cast_stage.numel()
        for a in range(0, src.numel(), c):
            b = min(a + c, src.numel())
            stage = self.cast_stage[:b - a]
            stage.copy_(src[a:b], non_blocking=True)
            dst[a:b].copy_(stage)
