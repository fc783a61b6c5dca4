"""Placement plans: where each unit's state lives and who steps it, decided once by one pure function.

A *unit* is what moves as one: each decoder layer, and the resident parts (embeddings, final norm, lm_head) as
one more. Its ``UnitPlan`` says where the FP32 master, the FP32 gradient, the AdamW moments and the compute-dtype
copy live, and which stepper runs its AdamW. ``build_plans`` is the only code that reads the placement options
(``resident_placement``, ``device_layers``, ``device_step_layers``, ``optimizer_state_dir``, ``lean_store``,
``lean_compute_copy``); the
store allocates from the plans, the executor and the optimizer pick their strategy per plan, and the planner's
byte counts are sums of ``UnitPlan.nbytes`` over the same plans.

    plan              master  grad    moments      compute copy  stepper
    host layer        host    host    host / disk  host (bf16)   HOST: fused AdamW on the CPU
    GPU-stepped layer host    device  device       host (bf16)   DEVICE_STREAMED: master streams to the GPU for it
      (state "host")  host    device  host         host (bf16)   DEVICE_STREAMED: master and moments stream
    kept layer        device  device  device       none          DEVICE: everything on the GPU, cast per visit
    lean layer        host    none    host / disk  none          LEAN: update as each gradient lands
      (lean_compute_copy) host none   host / disk  host (bf16)   LEAN: the update writes the copy too
      (lean_grad_plane)   + the step's gradient on the host as it crossed (bf16 when narrow, else FP32:
                          optim/grad_plane.py): a clipping step updates from it, no re-run of its forward+backward
    resident (device) device  device  device       device (bf16) DEVICE
    resident (host)   host    host    host / disk  host (bf16)   HOST, then published to the device parameters

"device" is the engine's device; on a CPU-only machine that is host memory too (tests run every plan there).

``decide_modes`` decides, once per engine and from the same config and plans, how the step runs: the host AdamW
kernel (``host_kernel``, its ``auto`` included), narrow gradients, speculation and whether lean units make the
engine record each training forward for a re-run. The result (``StepModes``) is handed to the executor and the
optimizer at construction; they carry it out without reading the options again.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import logging

import torch

from ..config import MegaTrainConfig
from . import kernels

logger = logging.getLogger(__name__)


class Where(enum.Enum):
    NONE = "none"
    HOST = "host"  # pinned host RAM
    DEVICE = "device"  # the engine's device
    DISK = "disk"  # memory-mapped file (optimizer_state_dir)


class Stepper(enum.Enum):
    HOST = "host"  # fused AdamW on the CPU over host buffers
    DEVICE_STREAMED = "device_streamed"  # fused AdamW on the GPU; master streamed in and out (device_stepper.py)
    DEVICE = "device"  # fused AdamW on the GPU over state that lives there
    LEAN = "lean"  # whole update as the gradient lands, no gradient buffer (optim/lean.py)


# FP32 masters cast to the compute dtype on the GPU (lean units) go through a staging buffer of at most this size,
# so no full FP32 copy of a layer ever sits in GPU memory (executor and planner).
CAST_STAGING_BYTES = 128 * 1024 ** 2

# GPU bytes per parameter of the two GPU placements of a streamed layer (planner and build_plans share them).
KEPT_LAYER_DEVICE_BYTES = 16  # FP32 master, gradient, m, v
STEPPED_LAYER_DEVICE_BYTES = 12  # FP32 gradient, m, v


GRAD_PLANE_ROW = "lean grad plane"  # a lean unit's gradient plane (optim/grad_plane.py, allocated by LeanAdamW)


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class UnitPlan:
    index: int
    streamed: bool  # a decoder layer (streams through the weight slots) or the resident unit
    numel: int  # trainable parameters
    frozen_numel: int  # frozen parameters (compute-dtype copy on the host, streamed with the unit)
    master: Where
    grad: Where
    moments: Where
    compute: Where  # separate compute-dtype copy; NONE: the master is what is read (fp32, or cast on the device)
    stepper: Stepper
    grad_plane: int = 0  # a lean unit's gradient plane: bytes per parameter (2: bf16, 4: FP32; 0: none)

    def buffers(self, compute_dtype: torch.dtype) -> dict[str, tuple[Where, int]]:
        """Every buffer this unit allocates: name -> (where, bytes)."""
        c = _elt(compute_dtype)
        out = {"master fp32": (self.master, 4 * self.numel), "grad fp32": (self.grad, 4 * self.numel),
               "exp_avg fp32": (self.moments, 4 * self.numel), "exp_avg_sq fp32": (self.moments, 4 * self.numel),
               "compute copy": (self.compute, c * self.numel)}
        # Frozen parameters of layers stream from the host; frozen resident ones stay on the device.
        out["frozen params (compute dtype)"] = (Where.HOST if self.streamed else Where.DEVICE, c * self.frozen_numel)
        out[GRAD_PLANE_ROW] = (Where.HOST if self.grad_plane else Where.NONE, self.grad_plane * self.numel)
        return {k: v for k, v in out.items() if v[0] is not Where.NONE}

    def nbytes(self, where: Where, compute_dtype: torch.dtype) -> int:
        return sum(n for w, n in self.buffers(compute_dtype).values() if w is where)


@dataclass(frozen=True)
class PlanInputs:
    """What ``build_plans`` decides from: unit sizes (layers first, the resident unit last), the device type and
    the GPU memory this process may use (``None``: unknown / no GPU)."""

    numels: list[int]
    frozen_numels: list[int]
    device_type: str
    gpu_budget: int | None = None
    plane_fits: bool = False  # lean_grad_plane="auto": the host has room for the gradient plane (the planner's)
    data_parallel: bool = False  # one of several data-parallel ranks (gradients reduced in FP32: no narrow ones)


@dataclass(frozen=True)
class Plans:
    units: list[UnitPlan] = field(default_factory=list)
    grad_plane_why: str = ""  # lean store: whether its layers keep a gradient plane, and why

    @property
    def layers(self) -> list[UnitPlan]:
        return self.units[:-1]

    @property
    def resident(self) -> UnitPlan:
        return self.units[-1]

    def indices(self, stepper: Stepper, streamed: bool = True) -> list[int]:
        return [p.index for p in self.units if p.stepper is stepper and p.streamed == streamed and p.numel > 0]

    @property
    def kept(self) -> list[int]:
        """Layers kept whole on the device."""
        return self.indices(Stepper.DEVICE)

    @property
    def device_stepped(self) -> list[int]:
        """Layers whose AdamW runs on the device with their master streamed."""
        return self.indices(Stepper.DEVICE_STREAMED)

    @property
    def resident_on_device(self) -> bool:
        return self.resident.master is Where.DEVICE

    def nbytes(self, where: Where, compute_dtype: torch.dtype) -> int:
        return sum(p.nbytes(where, compute_dtype) for p in self.units)

    def summary(self) -> str:
        n = sum(1 for p in self.layers if p.numel > 0)
        kept, stepped = len(self.kept), len(self.device_stepped)
        lean = len(self.indices(Stepper.LEAN))
        return (f"of {n} streamed layers, {kept} stay on the GPU, {stepped} run AdamW on the GPU, "
                f"{n - kept - stepped - lean} on the CPU{f', {lean} lean' if lean else ''}; resident parts "
                f"{'on the device' if self.resident_on_device else 'on the host'}"
                + (f"; {self.grad_plane_why}" if self.grad_plane_why else ""))


def resident_device_bytes(numel: int, compute_dtype: torch.dtype) -> int:
    """GPU bytes of resident parts stepped on the device: FP32 master, grad, m, v + a compute-dtype copy."""
    c = _elt(compute_dtype)
    return numel * (16 + (c if c < 4 else 0))


def device_step_bytes(k: int, max_numel: int, compute_dtype: torch.dtype, host_state: bool = False) -> int:
    """GPU bytes of ``k`` GPU-stepped layers: FP32 gradient + AdamW moments each (the gradient alone with
    ``host_state``) and the stepper's buffers (``stepper_buffer_bytes``)."""
    if k == 0:
        return 0
    per_layer = 4 if host_state else STEPPED_LAYER_DEVICE_BYTES
    return per_layer * k * max_numel + stepper_buffer_bytes(k, max_numel, compute_dtype, host_state)


def stepper_buffer_bytes(k: int, max_numel: int, compute_dtype: torch.dtype, host_state: bool) -> int:
    """GPU bytes of the DeviceStepper's buffers for ``k`` layers: two master + compute-copy sets (the master
    streams through them in turn), or with ``host_state`` one master + moments + compute-copy set per layer (all
    of them are copied in during the backward)."""
    c = _elt(compute_dtype)
    return (k * (12 + c) if host_state else 2 * (4 + c)) * max_numel if k else 0


def _resident_on_device(numel: int, config: MegaTrainConfig, device_type: str, budget: int | None) -> bool:
    place = config.resident_placement
    if place == "host" or device_type != "cuda":
        return device_type == "cpu" and place != "host"
    if place == "device":
        return True
    return resident_device_bytes(numel, config.torch_compute_dtype) <= config.resident_device_fraction * (budget or 0)


def _layer_choice(numels: list[int], frozen: list[int], config: MegaTrainConfig, device_type: str,
                  budget: int | None) -> tuple[list[int], list[int]]:
    """(kept, device-stepped) layers for ``device_layers`` / ``device_step_layers`` (-1 = auto). Auto gives
    ``device_step_fraction`` of the GPU budget left after the resident parts to the first layers in forward order
    (needed first by the next forward; the CPU's layers, needed last, get the most time): whole layers while they
    fit (no PCIe at all), then GPU-stepped ones with what remains."""
    trainable = [i for i, n in enumerate(numels) if n > 0]
    if config.lean_store:
        return [], []  # every layer streams; its gradient is consumed as it lands (config validation refuses > 0)
    auto_off = device_type != "cuda" or bool(config.optimizer_state_dir)
    left = config.device_step_fraction * (budget or 0)
    eligible = [i for i in trainable if not frozen[i]]  # frozen parameters stream with the unit's slot
    if config.device_layers == -1:
        kept: list[int] = []
        if not auto_off:
            for i in eligible:
                if KEPT_LAYER_DEVICE_BYTES * numels[i] > left:
                    break
                left -= KEPT_LAYER_DEVICE_BYTES * numels[i]
                kept.append(i)
    else:
        kept = eligible[:config.device_layers]
        left -= sum(KEPT_LAYER_DEVICE_BYTES * numels[i] for i in kept)
    rest = [i for i in trainable if i not in kept]
    k = config.device_step_layers
    if k == -1:
        k = 0
        if not auto_off and rest:
            n_max = max(numels[i] for i in rest)
            k = len(rest)
            host_state = config.device_step_state == "host"
            while k > 0 and device_step_bytes(k, n_max, config.torch_compute_dtype, host_state) > left:
                k -= 1
    return kept, rest[:k]


def build_plans(inputs: PlanInputs, config: MegaTrainConfig) -> Plans:
    """Every unit's plan (layers in order, then the resident unit) from the model's sizes, the config and the GPU
    budget. Pure: the engine and the planner call it with the same inputs and get the same placement."""
    *layer_numels, resident_numel = inputs.numels
    *layer_frozen, resident_frozen = inputs.frozen_numels
    fp32 = config.torch_compute_dtype == torch.float32
    host_copy = Where.NONE if fp32 else Where.HOST
    host_moments = Where.DISK if config.optimizer_state_dir else Where.HOST
    on_dev = _resident_on_device(resident_numel, config, inputs.device_type, inputs.gpu_budget)
    budget = inputs.gpu_budget
    if budget is not None and on_dev:
        budget = max(budget - resident_device_bytes(resident_numel, config.torch_compute_dtype), 0)
    kept, stepped = _layer_choice(layer_numels, layer_frozen, config, inputs.device_type, budget)
    units = []
    for i, (n, f) in enumerate(zip(layer_numels, layer_frozen)):
        if i in kept:
            where = (Where.DEVICE, Where.DEVICE, Where.DEVICE, Where.NONE, Stepper.DEVICE)
        elif i in stepped:
            moments = host_moments if config.device_step_state == "host" else Where.DEVICE
            where = (Where.HOST, Where.DEVICE, moments, host_copy, Stepper.DEVICE_STREAMED)
        elif config.lean_store:
            where = (Where.HOST, Where.NONE, host_moments, host_copy if config.lean_compute_copy else Where.NONE,
                     Stepper.LEAN)
        else:
            where = (Where.HOST, Where.HOST, host_moments, host_copy, Stepper.HOST)
        units.append(UnitPlan(i, True, n, f, *where))
    if on_dev:
        where = (Where.DEVICE, Where.DEVICE, Where.DEVICE, Where.NONE if fp32 else Where.DEVICE, Stepper.DEVICE)
    else:
        where = (Where.HOST, Where.HOST, host_moments, host_copy, Stepper.HOST)
    units.append(UnitPlan(len(layer_numels), False, resident_numel, resident_frozen, *where))
    plane, why = _grad_plane(config, inputs)
    if plane:
        units = [dataclasses.replace(p, grad_plane=plane) if p.stepper is Stepper.LEAN else p for p in units]
    return Plans(units, why)


def _grad_plane(config: MegaTrainConfig, inputs: PlanInputs) -> tuple[int, str]:
    """``lean_grad_plane``: the bytes per parameter of the lean layers' gradient plane (optim/grad_plane.py; 0:
    none), and why. It holds each gradient as it crosses: bf16 where ``decide_modes`` makes them narrow (exact for
    a visit computed whole), else FP32 (data-parallel ranks: the reduce-scatter's mean of the ranks' gradients is an
    FP32 value)."""
    if not config.lean_store:
        return 0, ""
    choice = config.lean_grad_plane
    if choice == "off":
        return 0, "no gradient plane (lean_grad_plane='off'): a step that clips re-runs its forward+backward"
    narrow = decide_modes(config, Plans(), inputs.device_type, data_parallel=inputs.data_parallel, probe=False).narrow
    size = 4 if narrow is None else narrow.itemsize
    if choice == "auto" and narrow is not None and config.micro_batch_size > 0:
        return 0, ("no gradient plane: micro_batch_size splits each layer visit, whose gradient is then an FP32 "
                   "sum (not exact in bf16); a step that clips re-runs its forward+backward")
    if choice == "auto" and not inputs.plane_fits:
        return 0, (f"no gradient plane: its {size} B/param do not fit the host's RAM (host_memory_fraction); a "
                   "step that clips re-runs its forward+backward")
    return size, (f"{'bf16' if narrow is not None else 'FP32'} gradient plane (lean_grad_plane={choice!r}, +{size} "
                  "B/param): a step that clips updates every layer from it, no second forward+backward")


def host_layer_plan(lean: bool, lean_copy: bool, compute_dtype: torch.dtype) -> UnitPlan:
    """The plan of one host-stepped streamed layer of one parameter (``lean``: a lean one; ``lean_copy``: that keeps
    its compute copy): what per-parameter byte formulas evaluate (core/store.py ``bytes_per_param``)."""
    copy = Where.NONE if (lean and not lean_copy) or compute_dtype == torch.float32 else Where.HOST
    grad, stepper = (Where.NONE, Stepper.LEAN) if lean else (Where.HOST, Stepper.HOST)
    return UnitPlan(0, True, 1, 0, Where.HOST, grad, Where.HOST, copy, stepper)


# A split host update moves ~1.5x the bytes of a whole one (optim/split_update.py) and shortens the forward's wait by
# ~0.43x of them: it wins while the split work fits the step (host-bound, split the step is that work; whole, the
# step is the whole update plus the backward). Split when it fits this share of the last step: a 10 % margin, so a
# host-bound step stops splitting instead of staying at the break-even.
SPLIT_SLACK = 0.9


@dataclass(frozen=True)
class StepModes:
    """How the step runs, decided once per engine (``decide_modes``) and handed to whoever carries it out.

    ``host_kernel``: the AdamW kernel over host units (core/kernels.py). ``narrow``: the dtype in which a host
    gradient that is its step's only, whole visit crosses PCIe and lands (engine/offload.py), or None.
    ``speculate``: host units are updated as their gradients land in the step's last backward
    (optim/speculative_step.py). ``consume``: some units have no gradient buffer and consume each gradient as it
    lands (optim/lean.py ``LeanAdamW``); the engine then records each training forward for a re-run.
    ``grad_plane``: the dtype in which those units keep the step's gradient on the host (optim/grad_plane.py), or
    None. ``split``: whether host layer updates launched after the norm may run split ("auto" / "on" / "off";
    optim/split_update.py): needs the native kernel and bf16 compute copies."""

    host_kernel: kernels.HostKernel = kernels.HostKernel.FUSED
    narrow: torch.dtype | None = None
    speculate: bool = False
    consume: bool = False
    grad_plane: torch.dtype | None = None
    split: str = "off"

    def describe(self) -> dict[str, object]:
        """What the run summary reports of these modes (engine/summary.py), under the config's names."""
        return {"host_kernel": self.host_kernel.value, "speculative_step": self.speculate,
                "narrow_grads": self.narrow is not None, "split_host_update": self.split}


def _host_kernel(choice: str, device_type: str, probe: bool) -> kernels.HostKernel:
    """``host_kernel``: "auto" is the native kernel when training on a GPU and it builds here (same math either
    way, only the speed differs: a failed build is said and the fused kernel used), else torch's fused one.
    Without ``probe`` (the planner, predicting another machine) the native kernel is assumed to build."""
    if choice != "auto":
        return kernels.HostKernel(choice)
    if device_type != "cuda":
        return kernels.HostKernel.FUSED
    if not probe:
        return kernels.HostKernel.NATIVE
    try:  # (built once per process; the optimizer's own warm-up then finds it ready)
        kernels.warm_up_native()
    except RuntimeError as e:
        logger.warning("%s; host_kernel='auto' uses the fused kernel", e)
        return kernels.HostKernel.FUSED
    return kernels.HostKernel.NATIVE


def decide_modes(config: MegaTrainConfig, plans: Plans, device_type: str, data_parallel: bool,
                 probe: bool = True) -> StepModes:
    """The step's modes for an engine with these plans on ``device_type`` (``data_parallel``: one of several
    ranks; ``probe``: build the native kernel to see that "auto" may use it -- the planner passes False). Narrow
    gradients where they are exact and the host kernel reads them (not on data-parallel ranks, whose host gradients
    are reduce-scattered in FP32); speculation for host units (lean units consume their gradients as they land
    anyway)."""
    kernel = _host_kernel(config.host_kernel, device_type, probe)
    consume = any(p.stepper is Stepper.LEAN for p in plans.units)
    compute = config.torch_compute_dtype
    narrow = (config.narrow_grads and not data_parallel
              and kernel in (kernels.HostKernel.COMPILED, kernels.HostKernel.NATIVE)
              and config.torch_grad_offload_dtype == torch.float32 and compute.itemsize == 2)
    planned = max((p.grad_plane for p in plans.units), default=0)
    crosses = compute if narrow else torch.float32  # (a lean gradient computed whole, as it lands on the host)
    if planned and planned != crosses.itemsize:  # (planned for a native kernel that did not build here)
        logger.warning("hf_megatrain: lean_grad_plane: the layer gradients cross in %s (host kernel %s), not what "
                       "the plan sized the plane for: no gradient plane; a step that clips re-runs its "
                       "forward+backward", crosses, kernel.value)
    split = config.split_host_update
    # (data parallel too: a rank's load waits for every rank's WEIGHTS pass of its shard, parallel/peer_cells.py)
    if split != "off" and (kernel is not kernels.HostKernel.NATIVE or compute != torch.bfloat16):
        if split == "on":
            raise ValueError(f"split_host_update='on' needs host_kernel 'native' (here {kernel.value}) and bf16 "
                             f"compute (here {compute}); use 'auto' (splits where it can) or 'off'")
        split = "off"
    return StepModes(host_kernel=kernel, narrow=compute if narrow else None, split=split,
                     speculate=config.speculative_step and not consume, consume=consume,
                     grad_plane=crosses if planned == crosses.itemsize else None)
