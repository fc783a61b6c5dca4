"""Memory planner: host RAM, GPU memory and disk a run needs, predicted from the model's parameter shapes.

Every number comes from the same unit layout the engine allocates (``layers.unit_layouts``: one unit per decoder
layer + one resident unit; ``core/plan.py``: the bytes of every buffer of every unit plan), the executor's buffer sizes, and the same placement
rules (resident parts on the GPU or not, how many layers AdamW-step on the GPU). ``megatrain estimate`` prints the
plan for a config (the model is built on the meta device: nothing is allocated); ``check_fits`` raises before
training starts when it cannot fit. Activations follow a documented Llama-style formula (``layer_recompute_bytes``),
calibrated on CPU against the allocator; CUDA context sizes are named constants to recalibrate from
``integration/measure_memory.py`` runs. Core module: imports torch only (transformers lazily, for ``main``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..checkpoint.space import CheckpointBytes, trainer_checkpoint_bytes
from ..config import MegaTrainConfig
from ..core.engine_view import EngineView
from ..core.memory import CUDA_CONTEXT_GPU_BYTES, available_host_bytes, format_bytes, gpu_budget
from ..core.plan import (CAST_STAGING_BYTES, GRAD_PLANE_ROW, PlanInputs, Plans, Stepper, Where, build_plans,
                         stepper_buffer_bytes)
from .long_context import (activation_bytes, attention_workspace_bytes, flops_per_token, offload_layers,
                           positionwise_bytes, seq_chunk, tiled)
from ..parallel.shards import shard_size
from .model_shape import ModelShape

__all__ = ["HOST_BASELINE_BYTES", "CUDA_CONTEXT_HOST_BYTES", "CUDA_CONTEXT_GPU_BYTES", "GiB", "ModelShape",
           "layer_recompute_bytes", "step_reserve_bytes", "placement_budget", "unit_plans", "MemoryPlan", "estimate",
           "check_fits", "sum_values", "offloaded_layers_for", "seq_chunk", "flops_per_token", "activation_bytes"]

logger = logging.getLogger(__name__)

GiB = 1024 ** 3
# Host RSS of python + torch + transformers + hf_megatrain imported (394 MiB measured, torch 2.13 CPU build), plus
# the tokenizer/data-loader and allocator slack a training script adds.
HOST_BASELINE_BYTES = 512 * 1024 ** 2
# Host side of a CUDA process: CUDA runtime + driver state, cuBLAS/cuDNN/NCCL images loaded into memory
# (0.5-1 GB observed on H100 hosts; the upper end is taken so "fits" errs on the safe side).
CUDA_CONTEXT_HOST_BYTES = 1 * GiB
# Caching-allocator fragmentation / rounding on top of the live tensors (block splitting, per-stream pools).
GPU_FRAGMENTATION_FRACTION = 0.10
# CPU device only: glibc keeps freed allocations below its mmap threshold (at most 32 MiB each) in the heap, so
# the transients of a step stay in RSS up to about this much.
CPU_MALLOC_RETENTION = 32 * 1024 ** 2
# placement_tokens: shares of the GPU the auto rules are tried with (1/50 steps: finer than one layer of any model
# large enough to need streaming).
PLACEMENT_STEPS = 50
LOSS_CHUNK_FACTOR = 4.5  # live [chunk, V] fp32-sized blocks in one loss chunk (bf16/fp32 logits, log-softmax, grad)
# ... when the chunk is compiled (one fused pass) or a fused loss never forms the logits: measured on the H100
# (integration/results/bench_loss/2026-11-23_6c2de76_bench_loss_h100.json, hidden 5120, vocab 152064, 8k tokens) 1.32 blocks beside the lm_head
# gradient for the compiled chunk; Liger and CCE less.
FUSED_LOSS_CHUNK_FACTOR = 1.5


def sum_values(d: dict[str, int]) -> int:
    return sum(d.values())


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_recompute_bytes(shape: ModelShape, tokens: int, compute_dtype: torch.dtype, chunk: int = 0) -> int:
    """Peak of one decoder layer's recompute + backward for ``tokens`` tokens (SDPA/flash: no T x T term).

    Saved activations per token: 2 norms (normalised + scaled: 4H), q/k/v after RoPE and the attention output
    (+ its contiguous copy: 3Q + 2KV), MLP gate, up, act(gate), act*up (4I); backward transients: ~2I of
    activation gradients less the H-sized ones already freed, and one weight gradient before it is accumulated
    into the slot's gradient buffer. In bf16 the norms upcast to fp32 (+8H bytes). Calibrated on CPU (Llama, fp32
    and bf16, GQA and MHA): within +2..+6 % of the allocator's peak. With ``chunk`` tokens per tile of the
    position-wise modules (seq_chunk_tokens), the MLP and norm terms are one chunk's (long_context.py).
    """
    c, H = _elt(compute_dtype), shape.hidden
    per_token = c * (3 * H + 3 * shape.q_dim + 2 * shape.kv_dim)
    return tokens * per_token + positionwise_bytes(shape, tokens, compute_dtype, chunk) + c * shape.max_weight


def step_reserve_bytes(shape: ModelShape, config: MegaTrainConfig) -> int:
    """GPU bytes every step needs whatever the model's placement: the CUDA context and the executor's buffers
    (weight slots, one layer's compute-dtype gradient, two offload buffers), with the
    allocator's fragmentation on top. Placement spends its fractions of what is left (the rest of it is for
    activations and the loss), so auto placement does not plan the GPU full before a step's own buffers."""
    c, o = _elt(config.torch_compute_dtype), _elt(config.torch_grad_offload_dtype)
    n_max = max(shape.layer_numels, default=0)
    slot = max((a + b for a, b in zip(shape.layer_numels, shape.layer_frozen)), default=0)
    executor = config.num_slots * slot * c + n_max * c + 2 * n_max * o
    return CUDA_CONTEXT_GPU_BYTES + int((1 + GPU_FRAGMENTATION_FRACTION) * executor)


def placement_budget(shape: ModelShape, config: MegaTrainConfig, gpu_free: int | None) -> int | None:
    """What placement may give to GPU-kept state: the GPU budget less ``step_reserve_bytes`` (None: no GPU)."""
    return None if gpu_free is None else max(gpu_free - step_reserve_bytes(shape, config), 0)


def unit_plans(shape: ModelShape, config: MegaTrainConfig, device_type: str, gpu_free: int | None,
               host_free: int | None = None, data_parallel: bool = False) -> Plans:
    """The engine's plans for ``shape`` (core/plan.py ``build_plans``, same inputs as the engine's conversion).

    With ``placement_tokens`` the auto rules' share of the GPU is the largest ``device_step_fraction`` whose plan
    this planner predicts to fit a step of that many tokens (every layer input kept on the device): the fraction
    stands in for the activations the rule cannot see, so here they are counted instead of guessed.

    ``lean_grad_plane="auto"``: the lean layers keep a gradient plane when the whole host plan with it fits
    ``host_memory_fraction`` of ``host_free`` (default: this machine's available RAM, for a running process).
    ``data_parallel``: the plans of one of several ranks (their lean gradients are reduced in FP32: an FP32 plane)."""
    plans = _unit_plans(shape, config, device_type, gpu_free, True, data_parallel)
    if config.lean_grad_plane != "auto" or not any(p.grad_plane for p in plans.units):
        return plans  # (no plane, or one asked for: no RAM question)
    baseline = 0 if host_free is not None else HOST_BASELINE_BYTES  # (a running process has paid its own)
    host = available_host_bytes() if host_free is None else host_free
    need = estimate(shape, config, 1, 1, device_type=device_type, gpu_free=gpu_free, plans=plans,
                    offloaded_layers=0).host_total - baseline
    if need <= config.host_memory_fraction * host:
        return dataclasses.replace(plans, grad_plane_why=f"{plans.grad_plane_why}; the host plan with it fits "
                                   f"({format_bytes(need)} of {config.host_memory_fraction:g} x {format_bytes(host)})")
    return _unit_plans(shape, config, device_type, gpu_free, False, data_parallel)


def _unit_plans(shape: ModelShape, config: MegaTrainConfig, device_type: str, gpu_free: int | None,
                plane_fits: bool, data_parallel: bool = False) -> Plans:
    inputs = PlanInputs(shape.layer_numels + [shape.resident_numel], shape.layer_frozen + [shape.resident_frozen],
                        device_type, placement_budget(shape, config, gpu_free), plane_fits, data_parallel)
    auto = config.device_layers == -1 or config.device_step_layers == -1
    if not (config.placement_tokens and auto and device_type == "cuda" and gpu_free is not None):
        return build_plans(inputs, config)
    plans = Plans()
    for step in range(PLACEMENT_STEPS, -1, -1):  # largest share first; the rules give more layers to a larger one
        plans = build_plans(inputs, dataclasses.replace(config, device_step_fraction=step / PLACEMENT_STEPS))
        need = estimate(shape, config, config.placement_tokens, 1, device_type=device_type, gpu_free=gpu_free,
                        plans=plans, offloaded_layers=0).device_total
        if need <= gpu_free:
            break
    return plans  # (none fits: the smallest share; check_fits / activation offload speak for the step itself)


DISK_MOMENTS_ROW = "AdamW moments while training (optimizer_state_dir)"  # the disk tier's row (disk_tier.py)

# The host rows that are the unit store: once per host however many data-parallel processes share it.
STORE_ROWS = ("master fp32", "grad fp32", "exp_avg fp32", "exp_avg_sq fp32", "compute copy",
              "frozen params (compute dtype)")


@dataclass
class MemoryPlan:
    """Bytes per component. ``device`` lists what the engine puts on its device (host RAM when it is the CPU)."""

    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # device memory alive in each step phase
    device_type: str = "cuda"
    construction_extra: int = 0  # host bytes only alive while the engine converts the model (the source copy)
    pinned: bool = False  # page-locking faults every store page in at allocation (else grad/copy pages come later)
    notes: list[str] = field(default_factory=list)
    seq_chunk_tokens: int = 0  # tokens per tile of the position-wise modules (0: untiled at this length)
    offloaded_layers: int = 0  # layers whose saved input lives in pinned host memory
    flops_per_token: dict[str, float] = field(default_factory=dict)
    checkpoint: CheckpointBytes = CheckpointBytes(0, 0, 0)  # one Trainer checkpoint's tensor bytes

    @property
    def host_total(self) -> int:
        """Host peak: the training peak or the conversion peak, whichever is higher. With the CPU as the device the
        device buffers are host RAM too; unpinned store pages are first touched when written (gradients in the
        backward), so the loss phases, which run before, do not coincide with them."""
        steady = sum(self.host.values())
        later = 0 if self.pinned else self.host.get("grad fp32", 0) + self.host.get("compute copy", 0)
        construct = steady - later + self.construction_extra
        if self.device_type != "cpu":
            return max(steady, construct)
        fixed = steady + sum(self.device.values())
        ph = {k: sum_values(v) for k, v in self.phases.items()}
        grad = 0 if self.pinned else self.host.get("grad fp32", 0)
        train = max(fixed - grad + max(ph.get("loss forward", 0), ph.get("loss backward", 0)),
                    fixed + max(ph.get("layer backward", 0), ph.get("gradients to host", 0)))
        return max(train + min(max(ph.values(), default=0), CPU_MALLOC_RETENTION), construct)

    @property
    def store_host_bytes(self) -> int:
        """Host bytes of the unit store (trainable state + frozen copies), without baseline and staging."""
        return sum(v for k, v in self.host.items() if k in STORE_ROWS)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum_values(self.phases[k])) if self.phases else ""

    @property
    def device_total(self) -> int:
        """Fixed device buffers + the largest phase of a step."""
        return sum(self.device.values()) + (sum_values(self.phases[self.peak_phase]) if self.phases else 0)


def estimate(shape: ModelShape, config: MegaTrainConfig, seq_len: int, batch_size: int, *, device_type: str = "cuda",
             gpu_free: int | None = None, grad_accum: int = 1, source_bytes: int = 0, gpus: int = 1,
             plans: Plans | None = None, offloaded_layers: int | None = None) -> MemoryPlan:
    """Predict what ``MegaTrainEngine`` allocates for ``shape`` under ``config`` on ``device_type``.

    ``gpu_free``: the target GPU's budget (``core.memory.gpu_budget``; drives placement); ``source_bytes``: the
    live HF model handed to the engine (freed during conversion; 0 for ``from_pretrained_streamed``); ``plans``:
    unit plans an engine already built (else built here from ``gpu_free``, as the engine would);
    ``offloaded_layers``: layers whose saved input is offloaded (default: ``activation_offload``'s rule, from
    ``gpu_free``: long_context.py). The store's bytes
    are sums of ``UnitPlan.buffers`` over the plans: one formula for the engine and the planner. ``gpus`` > 1:
    that many data-parallel processes of one host (parallel/), the placement they run and one shared store."""
    if gpus > 1:
        from ..parallel.setup import data_parallel_config
        config = data_parallel_config(config, SimpleNamespace(world=gpus))
    cdt, odt = config.torch_compute_dtype, config.torch_grad_offload_dtype
    c, o, cuda = _elt(cdt), _elt(odt), device_type == "cuda"
    plan = MemoryPlan(device_type=device_type, construction_extra=source_bytes, pinned=cuda and config.pin_memory)
    plans = plans or unit_plans(shape, config, device_type, gpu_free, data_parallel=gpus > 1)
    n_max = max(shape.layer_numels, default=0)
    slot = max((a + b for a, b in zip(shape.layer_numels, shape.layer_frozen)), default=0)
    h, d = plan.host, plan.device
    h["baseline (python, torch, transformers)"] = HOST_BASELINE_BYTES + (CUDA_CONTEXT_HOST_BYTES if cuda else 0)
    # The store, buffer by buffer: host rows, device rows by placement, disk (memory-mapped moments: page cache).
    for name in STORE_ROWS + (GRAD_PLANE_ROW,):
        h[name] = 0
    on_disk, layer_dev = 0, {Stepper.DEVICE: 0, Stepper.DEVICE_STREAMED: 0}
    for up in plans.units:
        for name, (where, nbytes) in up.buffers(cdt).items():
            if where is Where.HOST:
                h[name] += nbytes
            elif where is Where.DISK:
                on_disk += nbytes
            elif up.streamed:
                layer_dev[up.stepper] += nbytes
            elif name.startswith("frozen"):  # frozen resident parameters stay in the model (host RAM on a CPU)
                d["frozen resident params (compute dtype)"] = nbytes if cuda else 0
                h[name] += 0 if cuda else nbytes
            else:
                d["resident master, grad, AdamW, copy"] = d.get("resident master, grad, AdamW, copy", 0) + nbytes
    kept, stepped = plans.kept, plans.device_stepped
    if kept:
        d[f"{len(kept)} layers kept on the GPU (fp32 master, grad, moments)"] = layer_dev[Stepper.DEVICE]
    if stepped:  # + the stepper's buffers
        host_state = config.device_step_state == "host"
        what = ("fp32 grads, master/moments/copy buffers" if host_state
                else "fp32 grads + moments, 2 master/copy buffers")
        d[f"GPU AdamW: {len(stepped)} layers' {what}"] = layer_dev[Stepper.DEVICE_STREAMED] + stepper_buffer_bytes(
            len(stepped), max(shape.layer_numels[i] for i in stepped), cdt, host_state)
    lean = any(up.stepper is Stepper.LEAN for up in plans.units)
    # Staging is touched only when pinned (CUDA) or used: a second accumulation step or a non-fp32 offload.
    staged = plan.pinned or grad_accum > 1 or o != 4 or lean
    # (data parallel: each process lands only its shard of a gradient, so its staging holds the largest shard)
    n_stage = n_max if gpus <= 1 else shard_size(n_max, gpus)
    h["executor staging (2 x layer, offload dtype)"] = 2 * n_stage * o if staged else 0
    tokens, V, H, L = batch_size * seq_len, shape.vocab, shape.hidden, shape.num_layers
    chunk_seqs = config.micro_batch_size if 0 < config.micro_batch_size < batch_size else batch_size
    if cuda:
        d["CUDA context"] = CUDA_CONTEXT_GPU_BYTES
    res, cc = shape.resident_numel, (c if c < 4 else 0)  # cc: a separate compute-dtype copy exists
    if not plans.resident_on_device:
        d["resident params (compute dtype)"] = c * res
    d["weight slots"] = config.num_slots * slot * c
    d["grad_param (1 x layer)"] = n_max * c
    d["grad offload (2 x layer)"] = 2 * n_max * o
    if lean and c < 4 and not config.lean_compute_copy:
        d["lean FP32 H2D cast staging"] = min(4 * n_max, CAST_STAGING_BYTES)
    # Activations and gradients: the phases of a step follow each other; the peak is the largest one.
    chunk = seq_chunk(shape, config)
    tile = chunk if tiled(chunk, chunk_seqs * seq_len) else 0
    plan.seq_chunk_tokens, plan.flops_per_token = tile, flops_per_token(shape, seq_len)
    act = activation_bytes(shape, tokens, cdt)
    fixed = sum(v for n, v in d.items() if n != "CUDA context")
    frag = GPU_FRAGMENTATION_FRACTION if cuda else 0.0

    def phases(n_off: int) -> dict[str, dict[str, int]]:
        # The loss runs with every kept input + the last layer's output alive; a layer's backward frees the kept
        # input of the layer above, and once it reaches the offloaded ones, holds its own + the prefetched ones.
        final = tokens * H * (2 * c + (0 if tile else 4))  # (a tiled final norm keeps no fp32 upcast)
        loss_acts = {f"boundary activations ({L + 1 - n_off} x B x T x H on the device)": (L + 1 - n_off) * act,
                     "final norm + loss input/grad": final}
        alive = max(L + 1 - n_off if not n_off else L - n_off, 1 + config.activation_prefetch if n_off else 0)
        layer_acts = {f"boundary activations ({alive} x B x T x H on the device"
                      + (", incl. prefetched" if n_off else "") + ")": alive * act}
        if not n_off:  # (calibrated as before: the whole-model layout of the unchanged default)
            layer_acts["final norm + loss input/grad"] = final
        loss_chunk = min(config.loss_chunk_tokens, tokens)
        # ('auto' may still pick the eager loss)
        fused = config.compiles(device_type) or config.loss_impl in ("liger", "cce")
        blocks = FUSED_LOSS_CHUNK_FACTOR if fused else LOSS_CHUNK_FACTOR
        attention = {"attention backward workspace (flash dq fp32)": attention_workspace_bytes(
            shape, chunk_seqs * seq_len)} if cuda else {}
        return {
            "loss forward": {**loss_acts,
                             "loss chunk ([chunk, V] fp32 blocks)": int(blocks * loss_chunk * V * 4),
                             "lm_head grad fp32 + chunk grad": V * H * (4 + c)},
            "loss backward": {**loss_acts, "lm_head grad fp32, scaled, cast": V * H * (8 + cc)},
            "layer backward": {**layer_acts, "lm_head grad (compute dtype)": V * H * c,
                               "one layer's recompute (micro-batch chunk)": layer_recompute_bytes(
                                   shape, chunk_seqs * seq_len, cdt, tile), **attention,
                               "backward grad_out / grad_in": 2 * tokens * H * c},
            "gradients to host": {"resident grads (compute dtype)": c * res,
                                  "tied embedding grad temp": V * H * c if shape.tied else 0},
        }

    def device_total(n_off: int) -> int:
        peak = max(map(sum_values, phases(n_off).values()))
        return (CUDA_CONTEXT_GPU_BYTES if cuda else 0) + fixed + peak + int(frag * (fixed + peak))

    n_off = offload_layers(config, L, device_type, gpu_free, device_total) if offloaded_layers is None \
        else min(offloaded_layers, L)
    plan.offloaded_layers = n_off
    plan.phases = phases(n_off)
    h["offloaded activations (pinned, layer inputs)"] = n_off * act
    if n_off:
        plan.notes.append(f"activations: {n_off} of {L} layers' inputs offloaded to pinned host memory "
                          f"({format_bytes(act)} each), {L - n_off} kept on the device")
    if tile:
        plan.notes.append(f"sequence tiling: MLP and norms run in chunks of {tile} tokens "
                          f"({format_bytes(positionwise_bytes(shape, chunk_seqs * seq_len, cdt, tile))} "
                          "in the layer backward)")
    if cuda:
        d["allocator fragmentation"] = int(GPU_FRAGMENTATION_FRACTION * (
            sum(v for n, v in d.items() if n != "CUDA context") + max(map(sum_values, plan.phases.values()))))
    s = config.torch_save_dtype
    if on_disk:
        plan.disk[DISK_MOMENTS_ROW] = on_disk
    # (the one checkpoint formula, checkpoint/space.py; frozen parameters are exported in save_dtype, as written)
    plan.checkpoint = trainer_checkpoint_bytes(shape.trainable, shape.frozen * _elt(s), s)
    plan.disk["model export (save_dtype)"] = plan.checkpoint.export
    plan.disk["training state (AdamW m, v [+ fp32 master])"] = plan.checkpoint.master + plan.checkpoint.moments
    if lean and c < 4 and not config.lean_compute_copy:
        n_lean = sum(up.numel for up in plans.units if up.stepper is Stepper.LEAN)
        plan.notes.append(f"lean_compute_copy=True would add {format_bytes(c * n_lean)} of host RAM (a {c}-byte copy "
                          "per streamed parameter) and stream the layers in the compute dtype instead of FP32: half "
                          "the PCIe bytes (measured at 123B width on an H100: 0.40 -> 0.32 s per layer)")
    if plans.grad_plane_why:
        plan.notes.append(f"lean store: {plans.grad_plane_why}")
    if lean and grad_accum > 1:
        plan.notes.append(f"lean_store refuses gradient accumulation ({grad_accum} steps): put the sequences in one "
                          "batch and set micro_batch_size (in-layer split, same math)")
    if gpus > 1:
        plan.notes.append(f"{gpus} data-parallel processes of one host: the store is in shared memory, once (it "
                          f"needs {format_bytes(plan.store_host_bytes)} free in shared_memory_dir, /dev/shm by "
                          "default); each process adds its own baseline, staging and offloaded activations (the "
                          "device rows are per GPU)")
        for key in list(h):
            # (a lean gradient plane: each process holds the plane of its shards, the host the whole plane once)
            if key not in STORE_ROWS and key != GRAD_PLANE_ROW:
                h[key] *= gpus
        plan.construction_extra *= gpus  # (every process holds its copy of the model while it converts)
    return plan


def check_fits(engine_or_shape: EngineView | ModelShape, config: MegaTrainConfig | None = None,
               seq_len: int | None = None, batch_size: int = 1, *, host_available: int | None = None,
               gpu_available: int | None = None,
               device_type: str | None = None, baseline_paid: bool = False, plans: Plans | None = None) -> None:
    """Raise ``MemoryError`` with what to change when the run cannot fit. Accepts a ``MegaTrainEngine`` (after
    construction: GPU need is compared with free + what this process's allocator already holds) or a
    ``ModelShape`` (before anything is allocated). ``seq_len=None`` checks host RAM only.

    ``baseline_paid``: the caller is a running process (python, torch, the model already imported), so that part
    of the host baseline is in use already and MemAvailable reflects it (the engine's pre-allocation check);
    ``plans``: the unit plans the caller already built (an engine's are read off it)."""
    engine = None if isinstance(engine_or_shape, ModelShape) else engine_or_shape
    shape = engine_or_shape if engine is None else ModelShape.from_engine(engine)
    config = config or (engine.config if engine is not None else MegaTrainConfig())
    if device_type is None:
        device_type = engine.device.type if engine is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if gpu_available is None and device_type == "cuda" and torch.cuda.is_available():
        dev = engine.device if engine is not None else torch.device("cuda", torch.cuda.current_device())
        # An engine's own buffers are allocated already and counted by its plan: add them back to the budget.
        gpu_available = gpu_budget(dev) + (torch.cuda.memory_allocated(dev) if engine is not None else 0)
    if engine is not None:  # what the engine placed, not what the rules would pick for today's free memory
        plans = engine.plans
    plan = estimate(shape, config, seq_len or 1, batch_size, device_type=device_type, gpu_free=gpu_available,
                    plans=plans)
    errors = []
    if engine is None:  # before the store exists: the whole host plan must fit the reserve
        host_available = available_host_bytes() if host_available is None else host_available
        need = plan.host_total - (HOST_BASELINE_BYTES if baseline_paid else 0)
        if need > config.host_memory_fraction * host_available:
            per_param = plan.store_host_bytes / max(shape.trainable, 1)
            errors.append(f"needs {format_bytes(need)} host RAM, {format_bytes(host_available)} available "
                          f"(host_memory_fraction={config.host_memory_fraction}; {shape.trainable / 1e6:.1f}M "
                          f"trainable parameters at {per_param:.3g} B each, {shape.frozen / 1e6:.1f}M frozen); reduce "
                          "the model size, freeze parameters (PEFT/LoRA: frozen ones cost only their compute "
                          "dtype), use compute_dtype='float32' (no separate streaming copy, -2 B/param), "
                          "optimizer_state_dir (AdamW moments on disk, -8 B/param), lean_store=True (12 B/param "
                          "for the streamed layers) or a machine with more RAM")
    if seq_len is not None and device_type == "cuda" and gpu_available is not None:
        need = plan.device_total
        if need > gpu_available:
            errors.append(f"needs {format_bytes(need)} GPU memory for seq_len={seq_len}, batch_size={batch_size}, "
                          f"{format_bytes(gpu_available)} available (step peak: {plan.peak_phase}); reduce "
                          f"seq_len or batch_size, set micro_batch_size (now {config.micro_batch_size}; splits "
                          f"the layer recompute), lower loss_chunk_tokens (now {config.loss_chunk_tokens}), "
                          f"or num_slots=2 (now {config.num_slots})")
    if errors:
        raise MemoryError("hf_megatrain: this run does not fit: " + "; ".join(errors))


def offloaded_layers_for(engine: EngineView, seq_len: int, batch_size: int, gpu_available: int | None = None,
                         pooled_host_bytes: int = 0) -> int:
    """How many of ``engine``'s layers offload their saved input for a step of this shape (``activation_offload``'s
    rule against the engine's GPU budget; long_context.py). Raises ``MemoryError`` when the offloaded inputs
    cannot fit the host memory left (the pinned buffers would be taken from the running process).
    ``pooled_host_bytes``: pinned host memory the engine's activation pool already holds (reused, so available)."""
    config, dev = engine.config, engine.device
    if gpu_available is None and dev.type == "cuda" and torch.cuda.is_available():
        gpu_available = gpu_budget(dev) + torch.cuda.memory_allocated(dev)  # (its own buffers are in the plan)
    shape = ModelShape.from_engine(engine)
    plan = estimate(shape, config, seq_len, batch_size, device_type=dev.type, gpu_free=gpu_available,
                    plans=engine.plans)
    n = plan.offloaded_layers
    if n and config.activation_offload == "auto":  # say why, with the numbers a measured peak can refute
        kept = estimate(shape, config, seq_len, batch_size, device_type=dev.type, gpu_free=gpu_available,
                        plans=engine.plans, offloaded_layers=0)
        logger.info("hf_megatrain: batch %d x seq %d (%d tokens): planned GPU peak %s with every layer input kept "
                    "(%s), budget %s: %d layers offload their input (planned peak %s)", batch_size, seq_len,
                    batch_size * seq_len, format_bytes(kept.device_total), kept.peak_phase,
                    format_bytes(gpu_available or 0), n, format_bytes(plan.device_total))
    if n:
        need = plan.host["offloaded activations (pinned, layer inputs)"]
        avail = available_host_bytes() + pooled_host_bytes
        if need > config.host_memory_fraction * avail:
            raise MemoryError(
                f"hf_megatrain: this run does not fit: {n} layers' inputs offloaded for seq_len={seq_len}, "
                f"batch_size={batch_size} need {format_bytes(need)} pinned host memory, {format_bytes(avail)} "
                f"available (host_memory_fraction={config.host_memory_fraction}); shorten the sequence, use "
                "lean_store=True (less host memory for the weights) or a GPU with more memory")
    return n
