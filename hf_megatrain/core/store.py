"""HostStore: the FP32 truth of every trainable parameter, in flat per-unit host buffers.

A *unit* is what moves as one: each decoder layer is a unit, and all resident parameters (embeddings, final
norm, lm_head) form one more. Per unit the store holds, each as one flat buffer:

    master      fp32  [numel]  the weights (truth)
    grad        fp32  [numel]  gradient accumulated over the step's micro-batches
    exp_avg     fp32  [numel]  AdamW m
    exp_avg_sq  fp32  [numel]  AdamW v
    compute     bf16  [numel]  pinned streaming copy (absent in fp32 compute: the master is streamed)

= 18 host bytes per parameter in bf16 compute (16 in fp32 compute). Flat buffers make every host->GPU transfer
one copy per unit and let the optimizer run one fused kernel call per unit.

Lean store (``lean=True``): streamed units hold only master, exp_avg and exp_avg_sq = 12 bytes per parameter.
``grad`` is None (each layer's gradient goes from a staging slab straight into the optimizer, lean_step.py) and
``compute`` is the master itself (the executor casts to compute dtype on the GPU). The resident unit keeps its
normal buffers.

A unit may also hold *frozen* parameters (``requires_grad=False``: a PEFT/LoRA base, layers or embeddings the user
froze). They get no master, gradient or optimizer state, only ``frozen`` = one pinned flat buffer in compute
dtype (2 host bytes per parameter in bf16) that streams with the unit; ``names()``/``by_name`` and the optimizer
see trainable parameters only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .memory import alloc_host, alloc_on_disk, check_disk_space, check_host_memory


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
    params: list[ParamSlice]
    numel: int
    master: torch.Tensor
    grad: torch.Tensor | None  # None in a lean store's streamed units (no host gradient buffer)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    compute: torch.Tensor
    streamed: bool = True
    grad_valid: bool = False  # grad holds this step's data (else it must be overwritten, not added to)
    # Squared gradient norm computed on the device as the gradient left it (valid when the step's gradient came
    # from a single layer visit), so the global norm needs no extra pass over host memory.
    grad_sq: torch.Tensor | None = None
    # Set for units whose AdamW runs on the GPU (DeviceStepper): their FP32 gradient accumulates there instead.
    grad_device: torch.Tensor | None = None
    by_name: dict[str, ParamSlice] = field(default_factory=dict)
    # Frozen parameters: compute-dtype values only, streamed after the trainable copy (offsets into ``frozen``).
    frozen_params: list[ParamSlice] = field(default_factory=list)
    frozen: torch.Tensor | None = None

    @property
    def frozen_numel(self) -> int:
        return 0 if self.frozen is None else self.frozen.numel()

    def view(self, flat: torch.Tensor, p: ParamSlice) -> torch.Tensor:
        return flat[p.offset:p.offset + p.numel].view(p.shape)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {p.local: self.view(flat, p) for p in self.params}


def bytes_per_param(compute_dtype: torch.dtype, lean: bool = False) -> int:
    """Host bytes per trainable parameter the store allocates (``lean``: a lean store's streamed units)."""
    if lean:
        return 12
    return 16 + (0 if compute_dtype == torch.float32 else torch.empty((), dtype=compute_dtype).element_size())


class HostStore:
    """Flat host buffers for every unit. Built from a layout, so it can be filled from a live model or shard by
    shard from a checkpoint without ever holding a second full copy."""

    def __init__(self, layouts: list[list[tuple[str, str, tuple[int, ...], bool]]], *, compute_dtype: torch.dtype,
                 pin: bool, memory_fraction: float = 0.9, streamed: list[bool] | None = None,
                 devices: list[torch.device | None] | None = None,
                 frozen_layouts: list[list[tuple[str, str, tuple[int, ...]]]] | None = None,
                 state_dir: str | None = None, moment_devices: list[torch.device | None] | None = None,
                 lean: bool = False, compute_copy: list[bool] | None = None) -> None:
        """``devices[i]`` places unit i's buffers on an accelerator instead of the host (resident parts whose
        optimizer runs on the GPU); ``None`` = host. ``frozen_layouts[i]`` lists unit i's frozen parameters
        (name, local name, shape): host compute-dtype buffer only. ``state_dir`` puts the AdamW moments of host
        units in memory-mapped files there (the disk tier), taking 8 bytes per parameter off host RAM.
        ``moment_devices[i]`` puts only unit i's AdamW moments on that device (layers stepped on the GPU, see
        device_stepper.py): 8 bytes per parameter off host RAM. ``lean``: streamed host units get no gradient
        buffer and no compute-dtype copy (see the module docstring). ``compute_copy[i] = False``: unit i gets no
        compute-dtype copy (``compute`` is the master; layers kept on the GPU, cast per visit by the executor)."""
        self.compute_dtype = compute_dtype
        devices = devices or [None] * len(layouts)
        frozen_layouts = frozen_layouts or [[] for _ in layouts]
        sizes = [sum(math.prod(s) for _, _, s, _ in layout) for layout in layouts]
        frozen_sizes = [sum(math.prod(s) for _, _, s in layout) for layout in frozen_layouts]
        self.numel = sum(sizes)
        self.frozen_numel = sum(frozen_sizes)
        elt = torch.empty((), dtype=compute_dtype).element_size()
        streamed = streamed or [True] * len(layouts)
        on_host_units = [d is None or d.type == "cpu" for d in devices]
        host_numel = sum(n for n, h in zip(sizes, on_host_units) if h)
        moment_devices = moment_devices or [None] * len(layouts)
        dev_moment = [md is not None and md.type != "cpu" for md in moment_devices]
        self.state_dir = state_dir
        self.lean = lean
        # Lean units: streamed ones on the host (the resident unit keeps its gradient and streaming copy).
        self._lean_unit = [lean and s and h for s, h in zip(streamed, on_host_units)]
        copy = compute_copy or [True] * len(layouts)
        disk = 8 if state_dir else 0
        # Moments on disk or on the GPU take their 8 bytes per parameter off host RAM.
        ram = sum(n * (bytes_per_param(compute_dtype, lean=ln) - (8 if dm else disk)
                       - (0 if cp or ln or compute_dtype == torch.float32 else elt))
                  for n, h, ln, dm, cp in zip(sizes, on_host_units, self._lean_unit, dev_moment, copy) if h)
        ram_per_param = ram / host_numel if host_numel else 0.0
        if state_dir:
            check_disk_space(8 * host_numel, state_dir, f"the AdamW state of {host_numel / 1e6:.1f}M parameters")
        check_host_memory(ram + self.frozen_numel * elt, memory_fraction,
                          what=f"the host store for {host_numel / 1e6:.1f}M trainable parameters "
                               f"({ram_per_param:g} bytes each) and {self.frozen_numel / 1e6:.1f}M "
                               f"frozen ones ({elt} bytes each)")
        self.units: list[Unit] = []
        self.by_name: dict[str, tuple[Unit, ParamSlice]] = {}
        self.frozen_by_name: dict[str, tuple[Unit, ParamSlice]] = {}
        for i, layout in enumerate(layouts):
            params, off = [], 0
            for name, local, shape, decay in layout:
                n = math.prod(shape)
                params.append(ParamSlice(name, local, tuple(shape), off, n, decay))
                off += n
            dev = devices[i]
            on_host = dev is None or dev.type == "cpu"
            if on_host:
                alloc = lambda n, dt, pinned=pin: alloc_host(n, dt, pinned)  # noqa: E731
            else:
                alloc = lambda n, dt, pinned=False: torch.empty(n, dtype=dt, device=dev)  # noqa: E731
            if dev_moment[i]:
                moment = lambda n, md=moment_devices[i]: torch.zeros(n, dtype=torch.float32, device=md)  # noqa: E731
            elif on_host and state_dir:
                moment = lambda n: alloc_on_disk(n, torch.float32, state_dir)  # noqa: E731  (sparse file: zeros)
            else:
                moment = lambda n: alloc(n, torch.float32, False).zero_()  # noqa: E731
            master = alloc(off, torch.float32)
            lean_unit = self._lean_unit[i]
            compute = (master if compute_dtype == torch.float32 or lean_unit or not copy[i]
                       else alloc(off, compute_dtype))
            grad = None if lean_unit else alloc(off, torch.float32)
            unit = Unit(i, params, off, master, grad, moment(off), moment(off), compute, streamed=streamed[i])
            unit.by_name = {p.name: p for p in params}
            for p in params:
                self.by_name[p.name] = (unit, p)
            off = 0
            for name, local, shape in frozen_layouts[i]:
                n = math.prod(shape)
                unit.frozen_params.append(ParamSlice(name, local, tuple(shape), off, n, False))
                self.frozen_by_name[name] = (unit, unit.frozen_params[-1])
                off += n
            if off:
                unit.frozen = alloc_host(off, compute_dtype, pin)
            self.units.append(unit)

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
        """Host bytes of the frozen parameters (compute-dtype copies only)."""
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

    def sync_compute_(self, unit: Unit) -> None:
        """Refresh the streaming copy from the master (no-op in fp32 compute, where they are one buffer)."""
        if unit.compute is not unit.master:
            unit.compute.copy_(unit.master)

    def sync_all_compute_(self) -> None:
        for u in self.units:
            self.sync_compute_(u)

    def master_tensor(self, name: str) -> torch.Tensor:
        unit, p = self.by_name[name]
        return unit.view(unit.master, p)

    def names(self) -> list[str]:
        return list(self.by_name)
