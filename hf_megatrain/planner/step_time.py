"""Step-time model: how long one optimizer step takes, from measured machine rates and the same unit plans the
engine builds (where each layer's state lives, which stepper updates it).

Per streamed decoder layer (``layer_costs``), for ``T`` tokens of sequences of ``S`` tokens:

- GPU: the forward pass runs the layer once without grad; its backward visit recomputes the forward, then runs the
  backward (engine/executor.py): matmul FLOPs 2N*T (forward) + 2N*T (recompute) + 4N*T (backward: input and weight
  gradients; frozen weights get no weight gradient) = 8N*T for a trainable layer, at ``tflops * gemm_efficiency``;
  causal attention ``A = 2 * attention_dim * S * T`` per forward (QK^T over the q/k head dim and AV over
  the v head dim, half the square; model_shape.py), A + A + 2A at
  ``attention_tflops``; and element-wise memory traffic (norms, RoPE, SiLU*up, residual adds, their gradients) at
  ``hbm_gbps``: bytes per token estimated from the layer's widths, ~4x fewer when the layer is compiled (fused).
- PCIe: the weights cross H2D in the forward and again in the backward (the compute copy, or the FP32 master of a
  lean layer without one), except the ``num_slots`` layers still held when the pass turns; the gradient crosses D2H
  once (bf16 when ``narrow_grads`` applies, else ``grad_offload_dtype``).
- Host: AdamW moves ``kernels.host_bytes_per_param`` bytes per parameter (FP32 master, moments, gradient, the
  compute copy it writes) at ``host_adamw_gbps``.
- Disk (``optimizer_state_dir``): the moments are memory-mapped files. While the RAM beside the plan holds them
  in the page cache a step runs as in RAM (measured, docs/lean_store.md); once it cannot (``moments_cached=False``),
  every step reads them in and writes them back, 16 bytes per parameter at ``disk_gbps``, inside the update that
  faults them in (the worker waits on the disk).

The head (lm_head forward + gradient, 6*H*V*T, and the chunked loss's [chunk, vocab] traffic) and the GPU-stepped
units' AdamW run on the GPU. ``simulate`` then plays the overlap the engine builds, step after step until it
repeats: layer i+1's weights load while i computes (and wait for the slot i-1 frees), a layer's load waits for its
update, gradients land as their D2H ends; host updates run on one worker -- during the backward as gradients land
when the update needs no global norm (``speculative_step`` on a step that does not clip, or lean without
clipping), else from ``step()`` in the next forward's order, so the next forward waits on them; a lean step that
clips runs its forward+backward twice (norm first), unless its layers keep a bf16 gradient plane
(``lean_grad_plane``: then it updates from the plane in ``step()``, as a host layer does). Not modelled: float32
compute, data-parallel ranks, gradient accumulation beyond repeating the micro-step's GPU+PCIe work, activation
offload traffic, recompiles.

A fine-tune's rows (``predict_step(rows=...)``: padded or packed, finetune_rows.py) change two things: the layers'
matmuls, element-wise work and head run over every position of every row (padding included), and the attention is
what its kernel executes (FlexAttention's kept blocks, a dense mask's full square, or the causal half).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..config import MegaTrainConfig
from ..core import kernels
from ..core.plan import SPLIT_SLACK, Plans, StepModes, Stepper, UnitPlan, Where, decide_modes
from .finetune_rows import AttentionKernel, BatchRows, as_the_engine_runs, attention_flops, default_kernel

if TYPE_CHECKING:
    from .model_shape import ModelShape

__all__ = ["MachineProfile", "LayerCost", "StepPrediction", "layer_costs", "predict_step", "predict_steps", "simulate"]

# Element-wise bytes per token per layer forward, in units of the compute dtype's size / 2 (bf16 counted).
# Eager HF layer (counted op by op): each RMSNorm ~36H (fp32 upcast, pow, mean, scale, cast, weight), two residual
# adds 12H, RoPE on q and k ~20(q+kv), q/k/v/o transposes and contiguous copies ~8(q+kv), SiLU(gate)*up 10I.
# Compiled: each fused region reads its inputs and writes its outputs once: norms 8H, RoPE + layouts 8q + 12kv, 6I.
_EAGER = (84, 28, 28, 10)  # (x H, x q_dim, x kv_dim, x intermediate)
_COMPILED = (8, 8, 12, 6)
# Bytes per logit of the chunked loss: compiled, one fused pass (fp32 logits written and read, bf16 gradient
# written and read); eager, autograd's chain of fp32 copies, log-softmax, NLL and casts (model/loss.py: ~100 ms
# more per step at 32k tokens x 152k vocabulary, measured).
_LOSS_BYTES = {True: 12, False: 72}
_GPU_ADAMW_BYTES = 36  # torch's fused AdamW on the GPU: master, grad, m, v read + written, the compute copy
DISK_TIER = "disk tier"  # the busy row of the moments' disk traffic (optimizer_state_dir)


@dataclass(frozen=True)
class MachineProfile:
    """Measured rates of one machine. Defaults: the H100 80GB HBM3 machine of integration/results/."""

    # bf16 GEMM peak measured (shared/reference/h100_limits.json: bf16_gemm_TFLOPs)
    tflops: float = 800.0
    # Fraction of it a decoder layer's GEMMs reach: h100_limits' one 14B-width layer forward+backward, 27.12 ms at
    # 8,192 tokens, less its attention (1.4 ms) and element-wise (6.1 ms) shares by the rates below -> 687 TFLOP/s.
    gemm_efficiency: float = 0.86
    # Flash attention (SDPA), causal FLOPs executed per second: long_context_h100_8layers_262k.json, 1.40 s
    # forward / 4.44 s backward per 7B-width layer at 262,144 tokens (attention ~5x the layer's matmuls): 404 / 368.
    attention_tflops: float = 380.0
    # FlexAttention (padded / packed rows with a BlockMask), FLOPs of the blocks it computes (finetune_rows.py): packed
    # 8 x 4,096 rows 234, causal 2,048-token rows 273 (H200 probes, packed_attention / attention_shapes results).
    flex_tflops: float = 255.0
    # SDPA with a dense mask (nothing skipped): the full square of 8 x 4,096 packed rows in 30.7 ms fwd+bwd: 269.
    dense_mask_tflops: float = 269.0
    # Element-wise kernels: H100 SXM HBM3 3.35 TB/s spec, ~90 % reached by streaming kernels (not measured here).
    hbm_gbps: float = 3000.0
    # Pinned copies measured one way at a time (h100_limits.json: 45.5 H2D, 55.1 D2H GB/s).
    pcie_h2d_gbps: float = 45.5
    pcie_d2h_gbps: float = 55.1
    # Host AdamW DRAM traffic while the step runs (DMA both ways beside it): bench runs of sessions 11-12 report
    # 131-157 GB/s (5.0 G param/s at 28 B/param; e.g. finetune_packed_ds_h100.json 140.0).
    host_adamw_gbps: float = 140.0
    # Checkpoint writes (issue 29): a Trainer checkpoint is written at this rate (integration/bench_checkpoint_io.py);
    # the disk tier's moments stream at it too (0.82 GB/s measured on the CPU box: results/disk_tier/).
    disk_gbps: float = 1.0
    # Host time between the end of the backward and optimizer.step() (Trainer bookkeeping; ~40 ms measured in the
    # session-10 timeline, bench_streamed_native_timeline_h100.json).
    step_overhead_s: float = 0.04

    def with_overrides(self, **over: float | None) -> "MachineProfile":
        return MachineProfile(**{**asdict(self), **{k: v for k, v in over.items() if v is not None}})


@dataclass
class LayerCost:
    """Seconds of one streamed layer's work per step."""

    forward: float  # GPU, forward pass (no grad)
    backward: float  # GPU, recompute + backward
    load: float  # H2D of its weights, one load
    d2h: float  # its gradient to the host
    host_update: float  # host AdamW (0: updated on the GPU)
    gpu_update: float = 0.0  # GPU AdamW (kept / GPU-stepped layers)
    speculative: bool = False  # its update may start as its gradient lands
    saved_graph: bool = False  # its forward kept its graph: the backward neither recomputes nor loads it
    # The halves of its host update run split (optim/split_update.py; 0: it cannot be): new weights, then state.
    split_weights: float = 0.0
    split_state: float = 0.0
    disk: float = 0.0  # of ``host_update`` (or ``load``): its disk-tier moments read and written back


@dataclass
class StepPrediction:
    step_s: float
    tokens_per_s: float
    mfu: float  # 6N model FLOPs (N active) per second over ``tflops``, as the benchmarks report it
    bottleneck: str
    forward_wait_s: float  # the next forward's wait for host updates, per step
    mfu_with_attention: float  # the same with the attention term of ``flops_per_token``
    busy_s: dict[str, float] = field(default_factory=dict)  # per resource, per step
    passes: int = 1  # forward+backward passes per step (2: a lean step that clips)


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _elementwise_bytes(shape: ModelShape, compiled: bool, c: int) -> float:
    a, b, k, i = _COMPILED if compiled else _EAGER
    return (a * shape.hidden + b * shape.q_dim + k * shape.kv_dim + i * shape.intermediate) * c / 2


def layer_costs(shape: ModelShape, config: MegaTrainConfig, plans: Plans, seq_len: int, tokens: int,
                machine: MachineProfile, clipping: bool, grad_accum: int = 1,
                attention_s: float | None = None, modes: StepModes | None = None,
                saved_graphs: int = 0, moments_cached: bool = False) -> list[LayerCost]:
    """One ``LayerCost`` per decoder layer (see the module docstring). ``attention_s``: one forward's attention
    seconds where the rows are not ``tokens / seq_len`` causal sequences (``attention_seconds``); ``modes``: the
    engine's step modes for these plans (decided here when not given); ``saved_graphs``: the last layers that keep
    their forward's graph (planner/saved_graphs.py): their backward skips the recompute; ``moments_cached``: the
    disk tier's moments stay in the page cache (no disk traffic; planner/disk_tier.py decides)."""
    m = machine
    c = _elt(config.torch_compute_dtype)
    gemm, attn = m.tflops * m.gemm_efficiency * 1e12, m.attention_tflops * 1e12
    hbm, h2d, d2h, host = m.hbm_gbps * 1e9, m.pcie_h2d_gbps * 1e9, m.pcie_d2h_gbps * 1e9, m.host_adamw_gbps * 1e9
    total = sum(shape.layer_numels) + sum(shape.layer_frozen)
    active = 1.0 - shape.routed_inactive / total if total else 1.0  # (MoE: a token runs top_k of the experts)
    A = 2.0 * shape.attention_dim * seq_len * tokens  # causal attention FLOPs of one forward
    attn_s = A / attn if attention_s is None else attention_s
    elem = _elementwise_bytes(shape, config.compiles("cuda"), c) * tokens
    o = _elt(config.torch_grad_offload_dtype)
    if modes is None:  # (the engine's own decision)
        modes = decide_modes(config, plans, "cuda", data_parallel=False, probe=False)
    kernel = modes.host_kernel
    whole = not 0 < config.micro_batch_size < tokens // max(seq_len, 1)
    narrow = modes.narrow is not None and grad_accum == 1 and whole
    g = c if narrow else o
    disk = 0.0 if moments_cached else m.disk_gbps * 1e9 / 2  # (bytes on disk per second: each is read and written)
    out = []
    first_saved = len(plans.layers) - saved_graphs
    for li, up in enumerate(plans.layers):
        n, fz = up.numel * active, up.frozen_numel * active
        fwd = 2 * (n + fz) * tokens / gemm + attn_s + elem / hbm
        bwd = (2 * (n + fz) + 2 * (n + fz) + 2 * n) * tokens / gemm + 3 * attn_s + 3 * elem / hbm
        if li >= first_saved:  # (no recompute)
            bwd -= fwd
        kept = up.master is Where.DEVICE
        weights = 0 if kept else (c if up.compute is Where.HOST or c == 4 else 4) * up.numel + c * up.frozen_numel
        host_s = gpu_s = split_w = split_s = 0.0
        if up.stepper in (Stepper.HOST, Stepper.LEAN) and up.numel:
            copy = c if (up.compute is Where.HOST and c < 4) else 0
            host_s = up.numel * kernels.host_bytes_per_param(kernel, clipping, copy, g) / host
            from_plane = up.stepper is Stepper.LEAN and clipping and _plane_used(modes, narrow, up)
            if (up.stepper is Stepper.HOST or from_plane) and copy and modes.split != "off":
                split_w, split_s = (up.numel * kernels.host_bytes_per_param(kernel, clipping, copy, g, part) / host
                                    for part in (kernels.UpdatePart.WEIGHTS, kernels.UpdatePart.STATE))
        elif up.numel:
            gpu_s = up.numel * _GPU_ADAMW_BYTES / hbm
        state = 12 * up.numel if up.stepper is Stepper.DEVICE_STREAMED else 0  # master + moments in and out
        disk_s = up.nbytes(Where.DISK, config.torch_compute_dtype) / disk if disk else 0.0
        if disk_s and host_s:  # (the update faults its moments in and dirties them: the worker waits on the disk)
            host_s += disk_s
            if split_w:  # (the weights half reads the moments, the state half writes them)
                split_w, split_s = split_w + disk_s / 2, split_s + disk_s / 2
        # (a lean layer with a gradient plane and a clip: updated from the plane in step(), like a host one)
        speculative = (up.stepper is Stepper.LEAN and not (clipping and _plane_used(modes, narrow, up))) or (
            up.stepper is Stepper.HOST and modes.speculate and config.overlap_optimizer and not clipping)
        out.append(LayerCost(fwd, bwd, (weights + state) / h2d + (0.0 if host_s else disk_s),
                             (0 if up.grad is Where.DEVICE or kept else g * up.numel + state) / d2h,
                             host_s, gpu_s, speculative, li >= first_saved, split_w, split_s, disk_s))
    return out


def _plane_used(modes: StepModes, narrow: bool, up: UnitPlan) -> bool:
    """A lean layer's step gradient waits on its plane (no re-run when the step clips: optim/grad_plane.py): an
    FP32 plane holds any gradient, a bf16 one a narrow gradient."""
    return bool(up.grad_plane) and modes.grad_plane is not None and (narrow or modes.grad_plane == torch.float32)


def simulate(layers: list[LayerCost], head_s: float, gpu_step_s: float, *, num_slots: int = 2, passes: int = 1,
             overlap: bool = True, overhead_s: float = 0.04, steps: int = 6, split: str = "off",
             split_slack: float = SPLIT_SLACK) -> tuple[float, float]:
    """(step seconds, the forward's wait for host updates per step) in steady state: ``steps`` steps of the engine's
    overlap, timed between the last two starts of layer 0's forward. Resources: the GPU's compute stream, the H2D
    and D2H copy engines, one host AdamW worker; the Python thread blocks where the engine waits for an update.
    ``split``: the optimizer's ``SplitPolicy`` mode: launched updates of splittable layers run as their weights half
    (the forward waits for it) and, after all of those, their state halves in reverse order (a layer's next gradient
    lands after its state half), when their work fits ``split_slack`` of the last interval that waited on whole
    updates, and while split intervals stay shorter than that one (optim/split_update.py)."""
    L = len(layers)
    done = [0.0] * L  # when each layer's last update finished (a split one: its weights half)
    state_done = [0.0] * L  # when a split update's state half finished
    ver = [0] * L
    held: list[tuple[int, int] | None] = [None] * num_slots
    ready, free, tick = [0.0] * num_slots, [0.0] * num_slots, [0] * num_slots
    gpu = h2d = d2h = cpu = py = 0.0
    starts, waits, clock = [], [], [0]
    split_before, whole_interval, split_interval, last_step_call = False, None, None, None

    def acquire(i: int, step: int) -> int:
        nonlocal py, h2d
        slots, protect = [], set()
        for j in (i + k * step for k in range(num_slots)):
            if not 0 <= j < L:
                break
            waited = max(done[j] - py, 0.0)
            py += waited
            acquire.wait += waited
            if (j, ver[j]) in held:
                s = held.index((j, ver[j]))
            else:
                s = min((k for k in range(num_slots) if k not in protect), key=lambda k: tick[k])
                start = max(h2d, py, free[s])
                h2d = ready[s] = start + layers[j].load
                held[s] = (j, ver[j])
            protect.add(s)
            slots.append(s)
        clock[0] += 1
        tick[slots[0]] = clock[0]
        return slots[0]

    for _ in range(steps):
        acquire.wait = 0.0
        for p in range(passes):
            land = [0.0] * L
            for i in range(L):
                s = acquire(i, +1)
                start = max(gpu, ready[s], py)
                if i == 0 and p == 0:
                    starts.append(start)
                gpu = free[s] = start + layers[i].forward
            gpu += head_s
            for i in reversed(range(L)):
                if layers[i].saved_graph:  # (its forward's graph: no load, no recompute)
                    gpu = max(gpu, py) + layers[i].backward
                else:
                    s = acquire(i, -1)
                    gpu = free[s] = max(gpu, ready[s], py) + layers[i].backward
                py = max(py, state_done[i])  # (the gradient path waits for a split update's state half)
                d2h = land[i] = max(d2h, gpu, py) + layers[i].d2h
            py = max(py, land[0])
            if passes > 1 and p < passes - 1:
                continue  # (norm-first: this pass only measures the gradients)
            py += overhead_s  # the training loop reaches optimizer.step()
            gpu = max(gpu, py) + gpu_step_s + sum(c.gpu_update for c in layers)
            todo = {i for i in range(L) if layers[i].host_update}
            halves = [i for i in sorted(todo) if layers[i].split_weights and not layers[i].speculative]
            work = sum(layers[i].split_weights + layers[i].split_state for i in halves)
            if last_step_call is not None:  # (step() to step(), as the policy measures: waited on the last updates)
                if split_before:
                    split_interval = py - last_step_call
                else:
                    whole_interval = py - last_step_call
            last_step_call = py
            worse = split_before and split_interval is not None and split_interval > (whole_interval or 0.0)
            if not (split == "on" or split == "auto" and whole_interval is not None and not worse
                    and work <= split_slack * whole_interval):
                halves = []
            split_before = bool(halves)
            t = cpu
            while todo:  # one worker; a speculative update as its gradient lands (smallest landed index first)
                avail = [i for i in todo if layers[i].speculative and land[i] <= t] or \
                        ([min(todo)] if t >= py else [])
                if not avail:
                    pending = [land[i] for i in todo if layers[i].speculative and land[i] > t]
                    t = min(pending + [py]) if pending else max(t, py)
                    continue
                i = min(avail)
                todo.discard(i)
                t = done[i] = t + (layers[i].split_weights if i in halves else layers[i].host_update)
            for i in reversed(halves):
                t = state_done[i] = t + layers[i].split_state
            cpu = t
            for i in range(L):
                ver[i] += 1
            if not overlap:
                py = max(py, cpu)
        waits.append(acquire.wait)
    return starts[-1] - starts[-2], waits[-1]


def head_seconds(shape: ModelShape, config: MegaTrainConfig, tokens: int, machine: MachineProfile) -> float:
    """lm_head forward + gradients and the chunked loss's traffic, on the GPU."""
    m = machine
    matmul = 6.0 * shape.hidden * shape.vocab * tokens / (m.tflops * m.gemm_efficiency * 1e12)
    fused = config.compiles("cuda") or config.loss_impl in ("liger", "cce")
    return matmul + _LOSS_BYTES[fused] * tokens * shape.vocab / (m.hbm_gbps * 1e9)


def attention_seconds(shape: ModelShape, batch: BatchRows, kernel: AttentionKernel, machine: MachineProfile) -> float:
    """One layer forward's attention over ``batch`` with ``kernel``, at that kernel's measured rate."""
    rate = {AttentionKernel.FLASH: machine.attention_tflops, AttentionKernel.FLEX: machine.flex_tflops,
            AttentionKernel.DENSE_MASK: machine.dense_mask_tflops}[kernel]
    return attention_flops(shape.attention_dim, batch, kernel) / (rate * 1e12)


def predict_steps(shape: ModelShape, config: MegaTrainConfig, plans: Plans, batches: list[BatchRows],
                  machine: MachineProfile | None = None, *, clipping: bool = False, grad_accum: int = 1,
                  kernel: AttentionKernel | None = None, saved_graphs: int = 0,
                  moments_cached: bool = False) -> StepPrediction:
    """The mean of ``predict_step`` over a fine-tune's micro-steps (``finetune_rows.sample_steps``): step seconds
    averaged, tokens/s and MFU over all of their real tokens; the bottleneck and busy shares of the median step."""
    preds = [predict_step(shape, config, plans, 0, 0, machine, clipping=clipping, grad_accum=grad_accum, rows=b,
                          kernel=kernel, saved_graphs=saved_graphs, moments_cached=moments_cached) for b in batches]
    total = sum(p.step_s for p in preds)
    mid = sorted(preds, key=lambda p: p.step_s)[len(preds) // 2]
    return replace(mid, step_s=total / len(preds),
                   tokens_per_s=sum(p.tokens_per_s * p.step_s for p in preds) / total,
                   mfu=sum(p.mfu * p.step_s for p in preds) / total,
                   mfu_with_attention=sum(p.mfu_with_attention * p.step_s for p in preds) / total,
                   forward_wait_s=sum(p.forward_wait_s for p in preds) / len(preds))


def predict_step(shape: ModelShape, config: MegaTrainConfig, plans: Plans, seq_len: int, batch_size: int,
                 machine: MachineProfile | None = None, *, clipping: bool = False,
                 grad_accum: int = 1, rows: BatchRows | None = None,
                 kernel: AttentionKernel | None = None, saved_graphs: int = 0,
                 moments_cached: bool = False) -> StepPrediction:
    """Predicted steady-state optimizer step for ``batch_size`` sequences of ``seq_len`` tokens per micro-step;
    ``clipping``: the global-norm clip applies on every step (updates wait for the norm). ``rows``: a fine-tune's
    micro-step instead (padded or packed rows: finetune_rows.py; ``seq_len`` and ``batch_size`` are then ignored),
    its attention run by ``kernel`` (default: what the engine's defaults choose for its layout); tokens per
    second count its real (non-padding) tokens. ``saved_graphs``: the last layers whose backward skips the
    recompute (``saved_graph_layers``; the planner's count for the step: planner/saved_graphs.py).
    ``moments_cached``: with ``optimizer_state_dir``, the moments fit the page cache beside the plan (else every
    step reads and writes them at ``machine.disk_gbps``: planner/disk_tier.py)."""
    if config.torch_compute_dtype == torch.float32:
        raise ValueError("the step-time model covers bf16 compute only (float32 matmul rates are not measured)")
    m = machine or MachineProfile()
    attention_s = None
    real = tokens = batch_size * seq_len
    if rows is not None:
        rows = as_the_engine_runs(config, rows)
        seq_len, tokens, real = rows.width, rows.total_tokens, rows.real_tokens
        attention_s = attention_seconds(shape, rows, kernel or default_kernel(config, rows.layout), m)
    modes = decide_modes(config, plans, "cuda", data_parallel=False, probe=False)
    layers = layer_costs(shape, config, plans, seq_len, tokens, m, clipping, grad_accum, attention_s, modes,
                         saved_graphs, moments_cached)
    # A lean layer updated as its gradient lands on a clipping step had no gradient plane: the step re-runs.
    rerun = any(up.stepper is Stepper.LEAN and c.speculative for up, c in zip(plans.layers, layers))
    passes = 2 if rerun and clipping else 1
    head = head_seconds(shape, config, tokens, m)
    res = plans.resident
    res_gpu = res.numel * _GPU_ADAMW_BYTES / (m.hbm_gbps * 1e9) if res.master is Where.DEVICE else 0.0
    if res.master is not Where.DEVICE and res.numel:  # resident state on the host: updated first, on the CPU
        head += res.numel * (2 * 2 + 4) / (m.pcie_h2d_gbps * 1e9)
        layers[0].host_update += res.numel * 28 / (m.host_adamw_gbps * 1e9)
        if layers[0].split_weights:  # (the resident unit is updated whole, before layer 0's weights half)
            layers[0].split_weights += res.numel * 28 / (m.host_adamw_gbps * 1e9)
        if not moments_cached:  # (its moments on disk: read and written back by its update)
            res_disk = 2 * res.nbytes(Where.DISK, config.torch_compute_dtype) / (m.disk_gbps * 1e9)
            layers[0].host_update += res_disk
            layers[0].disk += res_disk
            if layers[0].split_weights:
                layers[0].split_weights += res_disk
    step, wait = simulate(layers, head, res_gpu, num_slots=config.num_slots, passes=passes,
                          overlap=config.overlap_optimizer, overhead_s=m.step_overhead_s,
                          split=modes.split)
    if grad_accum > 1:  # the earlier micro-steps: forward + backward and their transfers, no update
        step += (grad_accum - 1) * (sum(max(c.forward, c.load) + max(c.backward, c.load, c.d2h) for c in layers)
                                    + head)
    from .long_context import flops_per_token

    fpt = flops_per_token(shape, seq_len)
    if rows is not None:  # (attention per sequence, not per row: 12 x layers x its width x sum L^2 / real tokens)
        fpt["model"] = fpt["dense_6n"] + 12.0 * shape.num_layers * shape.attention_dim * sum(
            n * n for row in rows.rows for n in row) / real
    peak = m.tflops * 1e12
    host_disk = sum(c.disk for c in layers if c.host_update)  # (the disk's share of the host updates ...)
    load_disk = sum(c.disk for c in layers) - host_disk  # (... and of GPU-stepped layers' state loads)
    busy = {"GPU compute": passes * (sum(c.forward + c.backward for c in layers) + head) + res_gpu
            + sum(c.gpu_update for c in layers),
            "PCIe H2D": passes * 2 * (sum(c.load for c in layers) - load_disk),
            "PCIe D2H": passes * sum(c.d2h for c in layers),
            "host AdamW": sum(c.host_update for c in layers) - host_disk, DISK_TIER: host_disk + load_disk}
    if grad_accum > 1:
        for k in ("GPU compute", "PCIe H2D", "PCIe D2H"):
            busy[k] *= grad_accum
    top = max(busy, key=lambda k: busy[k])
    why = top
    if top == "GPU compute" and wait > 0.05 * step:
        why = f"GPU compute + the forward's wait for the host AdamW ({wait / step:.0%} of the step)"
    elif top == DISK_TIER:
        moved = busy[DISK_TIER] * m.disk_gbps  # (GB read + written per step)
        why = (f"{DISK_TIER} (optimizer_state_dir: {moved:,.0f} GB of AdamW moments read and written back per "
               f"step at {m.disk_gbps:g} GB/s, --disk-gbps; {busy[top] / step:.0%} of the step busy; the GPU "
               f"{busy['GPU compute'] / step:.0%})")
    elif top != "GPU compute":
        why = f"{top} ({busy[top] / step:.0%} of the step busy; the GPU {busy['GPU compute'] / step:.0%})"
    tps = real * grad_accum / step
    return StepPrediction(step, tps, fpt["dense_6n"] * tps / peak, why, wait, fpt["model"] * tps / peak, busy, passes)
