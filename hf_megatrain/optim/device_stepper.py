"""DeviceStepper: AdamW for some streamed layers on the GPU, their FP32 master streamed through PCIe.

The CPU AdamW over host memory is bound by host memory bandwidth (~34 bytes of host traffic per parameter, and
the box moves ~100 GB/s in all, DMA included), and with exact gradient clipping it can only start once the
backward has produced every gradient. So the layers are split between two workers that run at the same time: the
CPU steps its layers in host memory while this stepper takes the others through the GPU, pipelined per layer:

    h2d:     [master of layer j -> GPU buffer A]      [layer j+2 -> A] ...
    compute:              [fused AdamW on A with the gradient and moments kept on the GPU][bf16 copy]
    d2h:                                     [master, bf16 copy of layer j -> host]

Those layers' plan (core/plan.py, ``Stepper.DEVICE_STREAMED``) keeps their FP32 gradient and AdamW moments on the
GPU (the store allocates them there; the executor accumulates the gradient in place), so a stepped parameter costs 10 bytes of host traffic (4 in, 6 out) instead of the CPU path's 34, for 12
bytes of GPU memory. The update is the same fused AdamW kernel with the same hyper-parameters, clip scale and
step count, so results match the CPU path to rounding. Checkpoints read the moments wherever they live. On a
CPU-only machine the "device" is the CPU and the same code runs synchronously (tested there).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core.store import Unit
from ..core.streams import StreamSet


class DeviceStepper:
    def __init__(self, units: list[Unit], device: torch.device, compute_dtype: torch.dtype) -> None:
        self.units = units
        self.device = device
        self.streams = StreamSet(device)
        self.compute_stream = torch.cuda.Stream(device) if self.streams.is_cuda else None
        n = max((u.numel for u in units), default=0)
        # Two buffer sets: layer j+1's master streams in while layer j's streams out.
        self.bufs = [{"master": torch.empty(n, dtype=torch.float32, device=device),
                      "compute": torch.empty(n, dtype=compute_dtype, device=device)} for _ in range(2)]
        self.free: list = [None, None]

    def run(self, order: list[Unit], step_fn: Callable[[Unit, list[torch.Tensor]], None],
            done: Callable[[Unit], None]) -> None:
        """Step ``order``'s units; ``step_fn(unit, [master, grad, m, v])`` runs the kernel on device views;
        ``done(unit)`` is called once the unit's new state (and streaming copy) is back in host memory."""
        st = self.streams
        prev: tuple[Unit, object] | None = None
        for j, unit in enumerate(order):
            b = self.bufs[j % 2]
            n = unit.numel
            master, comp = b["master"][:n], b["compute"][:n]
            with st.on(st.h2d):
                st.wait(st.h2d, self.free[j % 2])
                master.copy_(unit.master, non_blocking=True)
                loaded = st.record(st.h2d)
            with st.on(self.compute_stream):
                st.wait(self.compute_stream, loaded)
                step_fn(unit, [master, unit.grad, unit.exp_avg, unit.exp_avg_sq])
                comp.copy_(master)
                stepped = st.record(self.compute_stream)
            with st.on(st.d2h):
                st.wait(st.d2h, stepped)
                unit.master.copy_(master, non_blocking=True)
                if unit.compute is not None:
                    unit.compute.copy_(comp, non_blocking=True)
                self.free[j % 2] = st.record(st.d2h)
            if prev is not None:  # the previous unit's copies were queued before this one's: finish it now
                with torch.profiler.record_function("megatrain.optimizer.device_unit_wait"):
                    st.synchronize(prev[1])
                done(prev[0])
            prev = (unit, self.free[j % 2])
        if prev is not None:
            st.synchronize(prev[1])
            done(prev[0])
