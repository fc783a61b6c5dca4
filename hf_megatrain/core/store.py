"""UnitStore: every unit's FP32 state in flat buffers, allocated where its plan says.

Per unit (core/plan.py says where each lives, or that it does not exist):

    master      fp32          the weights (truth)
    grad        fp32          gradient accumulated over the step's micro-batches (none in a lean unit)
    exp_avg     fp32          AdamW m
    exp_avg_sq  fp32          AdamW v
    compute     compute dtype copy that streams (none: fp32 compute, lean and kept layers read the master)
    frozen      compute dtype frozen parameters (PEFT base, frozen layers): streamed after the trainable ones

Flat buffers make every host->GPU transfer one copy per unit and let the optimizer run one fused kernel call per
unit. The store only allocates and names; nothing here decides placement or checks RAM (the planner does both,
before this runs, from the same plans).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .memory import alloc_host, alloc_host_zeros, alloc_on_disk, check_disk_space
from .prefault import prefault_in_background
from .plan import Plans, Stepper, UnitPlan, Where, host_layer_plan


@dataclass
class ParamSlice:
    """One parameter inside a unit's flat buffers."""

    name: str  # full model name, e.g. "model.layers.3.mlp.up_proj.weight"
    local: str  # name inside the unit's module, e.g. "mlp.up_proj.weight"
    shape: tuple[int, ...]
    offset: int
    numel: int
    decay: bool = True  # weight decay applies (Trainer's rule: not biases/norms)


@dataclass
class Unit:
    index: int
    plan: UnitPlan
    params: list[ParamSlice]
    numel: int
    master: torch.Tensor
    grad: torch.Tensor | None  # None where the plan keeps no gradient (lean)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    compute: torch.Tensor | None  # None where the plan keeps no separate compute-dtype copy
    by_name: dict[str, ParamSlice] = field(default_factory=dict)
    frozen_params: list[ParamSlice] = field(default_factory=list)
    frozen: torch.Tensor | None = None

    @property
    def streamed(self) -> bool:
        return self.plan.streamed

    @property
    def frozen_numel(self) -> int:
        return 0 if self.frozen is None else self.frozen.numel()

    @property
    def source(self) -> torch.Tensor:
        """What a reader of the current weights copies from: the compute copy, else the master."""
        return self.master if self.compute is None else self.compute

    def view(self, flat: torch.Tensor, p: ParamSlice) -> torch.Tensor:
        return flat[p.offset:p.offset + p.numel].view(p.shape)

    def grad_as(self, dtype: torch.dtype | None) -> torch.Tensor:
        """The unit's host gradient as the step state says it is held: ``None``, the FP32 buffer itself; a 2-byte
        dtype, the first half of the buffer's bytes holding ``numel`` values of it (a narrow gradient: see
        ``widen_grad_``)."""
        assert self.grad is not None
        return self.grad if dtype is None else self.grad.view(dtype)[:self.numel]

    def widen_grad_(self, dtype: torch.dtype) -> None:
        """Turn a narrow gradient (``grad_as(dtype)``) into FP32 values in place. Back to front in halving pieces:
        FP32 elements [lo, hi) overwrite bytes [4 lo, 4 hi), which only held narrow elements at or beyond 2 lo >= hi,
        already read; the last few go through a copy. The caller makes sure nothing else reads it meanwhile."""
        assert self.grad is not None
        narrow, wide = self.grad.view(dtype), self.grad
        hi = self.numel
        while hi > 64:
            lo = (hi + 1) // 2
            wide[lo:hi].copy_(narrow[lo:hi])
            hi = lo
        wide[:hi].copy_(narrow[:hi].clone())

    def refresh_compute_(self, span: tuple[int, int] | None = None) -> None:
        """Copy the master into the compute copy (after the master changed); ``span``: only that range of the flat
        buffers (a data-parallel rank's shard: the other ranks write theirs)."""
        if self.compute is not None:
            lo, hi = span if span is not None else (0, self.numel)
            self.compute[lo:hi].copy_(self.master[lo:hi])


def bytes_per_param(compute_dtype: torch.dtype, lean: bool = False, lean_copy: bool = False) -> int:
    """Host bytes per trainable parameter of a host-stepped streamed unit (``lean``: a lean unit; ``lean_copy``:
    one that keeps its compute copy), from the same ``UnitPlan.buffers`` formula the store and the planner use."""
    return host_layer_plan(lean, lean_copy, compute_dtype).nbytes(Where.HOST, compute_dtype)


Layout = list[tuple[str, str, tuple[int, ...], bool]]  # (model name, name inside the unit, shape, decay)
FrozenLayout = list[tuple[str, str, tuple[int, ...]]]


def _slices(layout: list, decay: bool = True) -> tuple[list[ParamSlice], int]:
    out, off = [], 0
    for item in layout:
        name, local, shape = item[:3]
        n = math.prod(shape)
        out.append(ParamSlice(name, local, tuple(shape), off, n, item[3] if len(item) > 3 else False))
        off += n
    return out, off


class UnitStore:
    """Flat buffers for every unit, placed by ``plans``. Built from layouts, so it can be filled from a live model
    or shard by shard from a checkpoint without ever holding a second full copy."""

    def __init__(self, plans: Plans, layouts: list[Layout], frozen_layouts: list[FrozenLayout], *,
                 compute_dtype: torch.dtype, device: torch.device, pin: bool, state_dir: str | None = None,
                 host_alloc: Callable[[int, torch.dtype, bool], torch.Tensor] = alloc_host) -> None:
        # ``host_alloc(numel, dtype, pin)`` makes every host buffer: private memory, or memory shared by the
        # data-parallel ranks of a host (parallel/shared_alloc.py).
        self.compute_dtype = compute_dtype
        self.plans = plans
        disk = sum(4 * p.numel * 2 for p in plans.units if p.moments is Where.DISK)
        if disk:
            check_disk_space(disk, state_dir, f"the AdamW state of {disk // 8 / 1e6:.1f}M parameters")

        def alloc(where: Where, n: int, dtype: torch.dtype, moment: bool = False,
                  streams: bool = False) -> torch.Tensor | None:
            if where is Where.NONE:
                return None
            if where is Where.DISK:
                return alloc_on_disk(n, dtype, state_dir)  # sparse file: zeros
            # Moments in private, unpinned host memory (a CPU engine's "device" buffers are host memory too; not
            # memory shared by the ranks): zeros without a pass over them, see alloc_host_zeros.
            host = device.type == "cpu" if where is Where.DEVICE else host_alloc is alloc_host
            if moment and host and not (pin and streams):
                lazy.append(alloc_host_zeros(n, dtype))
                return lazy[-1]
            if where is Where.DEVICE:
                t = torch.empty(n, dtype=dtype, device=device)
            else:  # moments cross PCIe only for GPU-stepped layers: pinning others would only cost time and RAM
                t = host_alloc(n, dtype, pin and (not moment or streams))
            return t.zero_() if moment else t

        lazy: list[torch.Tensor] = []  # zeros the kernel fills on first touch: prefaulted below
        self.units: list[Unit] = []
        self.by_name: dict[str, tuple[Unit, ParamSlice]] = {}
        self.frozen_by_name: dict[str, tuple[Unit, ParamSlice]] = {}
        for plan, layout, frozen_layout in zip(plans.units, layouts, frozen_layouts):
            params, n = _slices(layout)
            f32 = torch.float32
            streams = plan.stepper is Stepper.DEVICE_STREAMED
            unit = Unit(plan.index, plan, params, n, alloc(plan.master, n, f32), alloc(plan.grad, n, f32),
                        alloc(plan.moments, n, f32, True, streams), alloc(plan.moments, n, f32, True, streams),
                        alloc(plan.compute, n, compute_dtype))
            unit.by_name = {p.name: p for p in params}
            self.by_name.update({p.name: (unit, p) for p in params})
            if plan.streamed:  # frozen resident parameters stay in the model, on the device
                unit.frozen_params, nf = _slices(frozen_layout)
                self.frozen_by_name.update({p.name: (unit, p) for p in unit.frozen_params})
                if nf:
                    unit.frozen = host_alloc(nf, compute_dtype, pin)
            self.units.append(unit)
        # The moments' pages faulted in while the model loads and the first step runs, not by the first update
        # (which the next forward waits for): core/prefault.py.
        # A quarter of the cores, at most 4: the kernel's page zeroing is bound by memory writes, not by threads.
        self.prefault = prefault_in_background(lazy, threads=min(4, max(1, (os.cpu_count() or 1) // 4)))
        self.numel = sum(u.numel for u in self.units)
        self.frozen_numel = sum(u.frozen_numel for u in self.units)

    @property
    def nbytes(self) -> int:
        """Host bytes of every buffer the store allocated (trainable state + frozen copies)."""
        seen, total = set(), 0
        for u in self.units:
            for t in (u.master, u.grad, u.exp_avg, u.exp_avg_sq, u.compute, u.frozen):
                if t is not None and t.data_ptr() not in seen and t.device.type == "cpu":
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total

    @property
    def frozen_nbytes(self) -> int:
        return sum(u.frozen.numel() * u.frozen.element_size() for u in self.units if u.frozen is not None)

    def load_(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one parameter (any dtype/device) into its FP32 master slice (frozen: its compute-dtype copy)."""
        unit, p = self.by_name[name] if name in self.by_name else self.frozen_by_name[name]
        if tuple(tensor.shape) != p.shape:
            raise ValueError(f"parameter {name}: checkpoint shape {tuple(tensor.shape)} != model shape {p.shape}")
        unit.view(unit.master if name in self.by_name else unit.frozen, p).copy_(tensor)

    def frozen_tensor(self, name: str) -> torch.Tensor:
        unit, p = self.frozen_by_name[name]
        return unit.view(unit.frozen, p)

    def master_tensor(self, name: str) -> torch.Tensor:
        unit, p = self.by_name[name]
        return unit.view(unit.master, p)

    def refresh_all_compute_(self) -> None:
        for u in self.units:
            u.refresh_compute_()

    def names(self) -> list[str]:
        return list(self.by_name)
