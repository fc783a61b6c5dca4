"""DeviceStepper: AdamW for some streamed layers on the GPU, their FP32 state streamed through PCIe.

The CPU AdamW over host memory is bandwidth-bound (~30 bytes of host traffic per parameter), and with exact
gradient clipping it can only start once the backward has produced every gradient. Splitting the layers between
two workers that run at the same time halves that critical path: the CPU steps its layers in host memory while
this stepper takes the others through the GPU, pipelined per layer:

    h2d:     [master, m, v of layer j  -> GPU buffers A]      [layer j+2 -> A] ...
    compute:                 [fused AdamW on A with the gradient kept on the GPU][bf16 copy]
    d2h:                                            [master, m, v, bf16 of layer j -> host]

Those layers' gradients never leave the GPU (the executor keeps them in ``unit.grad_device``), so PCIe carries
12 bytes per parameter each way instead of the CPU path's 4 bytes of gradient. The update is the same fused AdamW
kernel with the same hyper-parameters, clip scale and step count, so results match the CPU path to rounding.
On a CPU-only machine the "device" is the CPU and the same code runs synchronously (tested there).
"""

from __future__ import annotations

from typing import Callable

import torch

from .host_store import Unit
from .memory import pin_
from .streams import StreamSet


class DeviceStepper:
    def __init__(self, units: list[Unit], device: torch.device, compute_dtype: torch.dtype) -> None:
        self.units = units
        self.device = device
        self.streams = StreamSet(device)
        self.compute_stream = torch.cuda.Stream(device) if self.streams.is_cuda else None
        n = max((u.numel for u in units), default=0)
        # Two buffer sets: layer j+1's state streams in while layer j's streams out.
        self.bufs = [{k: torch.empty(n, dtype=torch.float32, device=device) for k in ("master", "m", "v")}
                     for _ in range(2)]
        for b in self.bufs:
            b["compute"] = torch.empty(n, dtype=compute_dtype, device=device)
        self.free: list = [None, None]
        # Gradients of these units stay on the device, accumulated in FP32 (one buffer per unit). Their AdamW
        # moments cross PCIe every step, so they must be page-locked like the master (pageable copies run at a
        # sixth of the speed and block the issuing thread).
        for u in units:
            if self.streams.is_cuda:
                pin_(u.exp_avg)
                pin_(u.exp_avg_sq)
            u.grad_device = torch.zeros(u.numel, dtype=torch.float32, device=device)

    def run(self, order: list[Unit], step_fn: Callable[[Unit, list[torch.Tensor]], None],
            done: Callable[[Unit], None]) -> None:
        """Step ``order``'s units; ``step_fn(unit, [master, grad, m, v])`` runs the kernel on device views;
        ``done(unit)`` is called once the unit's new state (and streaming copy) is back in host memory."""
        st = self.streams
        prev: tuple[Unit, object] | None = None
        for j, unit in enumerate(order):
            b = self.bufs[j % 2]
            n = unit.numel
            master, m, v, comp = (b[k][:n] for k in ("master", "m", "v", "compute"))
            with st.on(st.h2d):
                st.wait(st.h2d, self.free[j % 2])
                master.copy_(unit.master, non_blocking=True)
                m.copy_(unit.exp_avg, non_blocking=True)
                v.copy_(unit.exp_avg_sq, non_blocking=True)
                loaded = st.record(st.h2d)
            with st.on(self.compute_stream):
                st.wait(self.compute_stream, loaded)
                step_fn(unit, [master, unit.grad_device, m, v])
                comp.copy_(master)
                stepped = st.record(self.compute_stream)
            with st.on(st.d2h):
                st.wait(st.d2h, stepped)
                unit.master.copy_(master, non_blocking=True)
                unit.exp_avg.copy_(m, non_blocking=True)
                unit.exp_avg_sq.copy_(v, non_blocking=True)
                if unit.compute is not unit.master:
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
