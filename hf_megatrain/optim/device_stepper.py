"""DeviceStepper: AdamW for some streamed layers on the GPU, their FP32 state streamed through PCIe.

The CPU AdamW over host memory is bound by host memory bandwidth (30-38 bytes of host traffic per parameter, and
the box moves ~120 GB/s in all, DMA included), and with exact gradient clipping it can only start once the
backward has produced every gradient. So the layers are split between two workers that run at the same time: the
CPU steps its layers in host memory while this stepper takes the others through the GPU. Those layers' plan
(core/plan.py, ``Stepper.DEVICE_STREAMED``) keeps their FP32 gradient on the GPU (the executor accumulates it in
place: it never crosses PCIe); where their AdamW moments live is ``device_step_state``:

- "device": the moments stay on the GPU (12 bytes per parameter there); the master streams through two buffers,
  pipelined per layer (10 bytes of PCIe per parameter: 4 in, 6 out)::

    h2d:     [master of layer j -> GPU buffer A]      [layer j+2 -> A] ...
    compute:              [fused AdamW on A with the gradient and moments on the GPU][bf16 copy]
    d2h:                                     [master, bf16 copy of layer j -> host]

- "host": master and moments stay in pinned host memory and nothing of the layer is on the GPU between steps (a
  model many times the GPU's size). Each layer has its own buffer set; ``prefetch`` copies master and moments in
  during the step's last backward (they do not change before the update), so when the last gradient lands the
  update is a GPU kernel, and master, moments and the bf16 copy go back (12 bytes in, 14 out per parameter); the
  copies in are spread over the backward's landings (``prefetch(budget)``), never queued all at once ahead of the
  next layers' weights on the H2D stream (which stalled the backward for their whole duration). The
  first layers in forward order are the ones stepped here: they land last in the backward and the next forward
  needs them first, which is where the CPU would make the forward wait.

The update is the same fused AdamW kernel with the same hyper-parameters, clip scale and step count, so results
match the CPU path to rounding. Checkpoints read the moments wherever they live. On a CPU-only machine the
"device" is the CPU and the same code runs synchronously (tested there). It is the ``DEVICE_STREAMED`` kind's
stepper (optim/steppers.py): ``prepare`` / ``run(units, update)``, each unit moved through the step state here.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.plan import Where
from ..core.step_state import StepState
from ..core.store import Unit
from ..core.streams import StreamSet
from .steppers import Update


# The longest the copies back to host memory wait for the next forward to reach the layers (run): a bound, so a
# run that never reads the units again (no next forward, no waiter) still finishes its update.
HOLD_COPIES_S = 0.5


class DeviceStepper:
    def __init__(self, units: list[Unit], device: torch.device, compute_dtype: torch.dtype, state: StepState) -> None:
        self.units = units
        # Each unit's master version (a prefetched copy taken at another version is stale); its updates finish here.
        self.state = state
        self.device = device
        self.streams = StreamSet(device)
        self.compute_stream = torch.cuda.Stream(device) if self.streams.is_cuda else None
        # The moments live where the plan put them (the store allocated them there): off the device, they stream.
        self.host_state = bool(units) and units[0].plan.moments is not Where.DEVICE
        n = max((u.numel for u in units), default=0)

        def buffers(n: int, moments: bool) -> dict[str, torch.Tensor]:
            names = ("master", "exp_avg", "exp_avg_sq") if moments else ("master",)
            out = {k: torch.empty(n, dtype=torch.float32, device=device) for k in names}
            out["compute"] = torch.empty(n, dtype=compute_dtype, device=device)
            return out

        # "host": one set per layer (all are copied in during the backward); "device": two, used in turn.
        self.bufs = [buffers(u.numel, True) for u in units] if self.host_state else [buffers(n, False)
                                                                                      for _ in range(2)]
        self.free: list = [None] * len(self.bufs)
        # unit position -> (event, master version): its state is in its buffers (host state)
        self.loaded: dict[int, tuple[object, int]] = {}
        self._partial: dict[int, list[int]] = {}  # unit position -> [elements queued, master version]
        self._after: Any = None  # (prepare)

    def _slot(self, j: int) -> int:
        return j if self.host_state else j % 2

    def prefetch(self, budget: int | None = None) -> None:
        """Host state: copy the layers' master and moments into their buffers (the step's last backward: they do
        not change before the update); at most ``budget`` elements now (None: all that is left). Each call queues
        its pieces behind the weight loads already on the H2D stream, so a caller that spreads the state over the
        backward's landings never puts seconds of copies ahead of the next layer's weights. Idempotent within a
        step; no-op for the device state."""
        if not self.host_state:
            return
        st = self.streams
        left = budget
        for j, unit in enumerate(self.units):
            version = self.state.version[unit.index]
            if j in self.loaded and self.loaded[j][1] == version:
                continue
            done = self._partial.get(j)
            if done is None or done[1] != version:
                done = self._partial[j] = [0, version]  # (elements of master, m, v, in that order, queued)
            b, n = self.bufs[j], unit.numel
            with st.on(st.h2d):
                if done[0] == 0:
                    st.wait(st.h2d, self.free[j])  # the previous update's copies out of these buffers
                while done[0] < 3 * n and (left is None or left > 0):
                    k, lo = divmod(done[0], n)
                    hi = n if left is None else min(n, lo + left)
                    name = ("master", "exp_avg", "exp_avg_sq")[k]
                    b[name][lo:hi].copy_(getattr(unit, name)[lo:hi], non_blocking=True)
                    done[0] += hi - lo
                    left = None if left is None else left - (hi - lo)
                if done[0] < 3 * n:
                    return
                self.loaded[j] = (st.record(st.h2d), version)
                del self._partial[j]

    def queued(self, j: int) -> int:
        """Elements of the ``j``-th unit's state (master, m, v, in that order) queued by ``prefetch`` so far, while
        it is partly in (0 before its first piece and once it is loaded: see ``loaded``)."""
        done = self._partial.get(j)
        return 0 if done is None else done[0]

    def state_numel(self) -> int:
        """Elements ``prefetch`` copies in per step (host state; 0 for the device state)."""
        return 3 * sum(u.numel for u in self.units) if self.host_state else 0

    def forget(self) -> None:
        """The host copies may have changed (a checkpoint was loaded): prefetched buffers are stale."""
        self.loaded.clear()
        self._partial.clear()

    def prepare(self) -> None:
        """Main thread, at launch: an event on the compute stream once the backward was queued (the gradients, and
        the last forward's reads of the published copies, come before the kernels of ``run``)."""
        self._after = self.streams.record(self.streams.compute)
        if self.host_state and self.streams.is_cuda:
            self.state.readers_arrived.clear()  # (main thread, before the worker starts: see run)

    def run(self, order: list[Unit], update: Update) -> None:
        """Step ``order``'s units; ``update(unit, [master, grad, m, v], False)`` runs the kernel on device views
        (this stepper writes the compute copy); each unit's update finishes (step state) once its new state (and
        compute copy) is back in host memory. Host state: the new weights are published (``publish_copy``) as soon
        as they are queued on the GPU (each layer's buffers are its own until its next update, so the next forward
        may copy them from there)."""
        st = self.streams
        after, self._after = self._after, None
        st.wait(self.compute_stream, after)
        position = {u.index: j for j, u in enumerate(self.units)}
        prev: tuple[Unit, object] | None = None
        back: list[tuple[Unit, int, list[tuple[torch.Tensor, torch.Tensor]], object]] = []
        self.prefetch()
        for k, unit in enumerate(order):
            j = self._slot(position[unit.index] if self.host_state else k)
            b, n = self.bufs[j], unit.numel
            master, comp = b["master"][:n], b["compute"][:n]
            if self.host_state:
                m, v = b["exp_avg"][:n], b["exp_avg_sq"][:n]
                loaded = self.loaded.pop(j)[0]
            else:
                m, v = unit.exp_avg, unit.exp_avg_sq
                with st.on(st.h2d):
                    st.wait(st.h2d, self.free[j])
                    master.copy_(unit.master, non_blocking=True)
                    loaded = st.record(st.h2d)
            with st.on(self.compute_stream):
                st.wait(self.compute_stream, loaded)
                update(unit, [master, unit.grad, m, v], False)
                comp.copy_(master)
                stepped = st.record(self.compute_stream)
            # the compute copy first: the next forward reads it
            pairs = ([(unit.compute, comp)] if unit.compute is not None else []) + [(unit.master, master)]
            if self.host_state:
                if unit.frozen is None:  # (a frozen part loads from host)
                    self.state.publish_copy(unit.index, comp, stepped)
                back.append((unit, j, pairs + [(unit.exp_avg, m), (unit.exp_avg_sq, v)], stepped))
                continue  # (copied back below)
            with st.on(st.d2h):  # device state: two buffers used in turn, each copied back before its reuse
                st.wait(st.d2h, stepped)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                self.free[j] = st.record(st.d2h)
            if prev is not None:  # the previous unit's copies were queued before this one's: finish it now
                with torch.profiler.record_function("megatrain.optimizer.device_unit_wait"):
                    st.synchronize(prev[1])
                self.state.finish_update(prev[0].index)
            prev = (unit, self.free[j])
        if prev is not None:
            st.synchronize(prev[1])
            self.state.finish_update(prev[0].index)
        if not back:
            return
        # Host state: every layer's new weights are published on the GPU, and its state goes back to host memory
        # once the next forward reaches the layers (or anyone waits on these units): a copy engine runs the copies
        # queued on it in order, whatever their stream, so GBs of state queued now would hold the one-element
        # device-to-host reads of the forward's preamble (transformers' packed-sequence check in
        # ``create_causal_mask``) behind them: ~75 ms a layer, measured, with the GPU idle meanwhile.
        self.state.readers_arrived.wait(timeout=HOLD_COPIES_S)
        with st.on(st.d2h):
            for unit, j, pairs, stepped in back:
                st.wait(st.d2h, stepped)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                self.free[j] = st.record(st.d2h)
        for unit, j, _, _ in back:
            st.synchronize(self.free[j])
            self.state.finish_update(unit.index)
