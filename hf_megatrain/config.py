"""MegaTrainConfig: the one policy dataclass behind the engine, the Trainer and the Accelerate plugin.

Mechanism modules take explicit arguments; only this file decides defaults, validates user input and
knows the names users type (in yaml, in ``MEGATRAIN_*`` env vars, in ``TrainingArguments``).
``resolve_config`` is the one place a config is assembled from what the user gave (see its docstring for the
order); the Trainer arguments, the Accelerate plugin, ``from_pretrained_streamed`` and ``megatrain launch`` call it.
What an ``auto`` value or a mode becomes where that needs the model or the machine (placement, the host kernel,
narrow gradients, speculation, lean units) is decided once per engine from this config by core/plan.py
(``build_plans``, ``decide_modes``); nothing else reads those options (tests/test_mode_readers.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype, what: str, allowed: tuple[str, ...] = ("float32", "bfloat16")) -> torch.dtype:
    """Map a user-typed dtype name to a torch dtype, rejecting anything not in ``allowed`` with a clear message."""
    if isinstance(name, torch.dtype):
        name = str(name).replace("torch.", "")
    dtype = _DTYPES.get(str(name).lower())
    if dtype is None or str(dtype).replace("torch.", "") not in allowed:
        raise ValueError(f"{what}={name!r} is not supported; use one of {list(allowed)}")
    return dtype


def did_you_mean(name: str, choices: list[str]) -> str:
    """" (did you mean 'x'?)" for the closest of ``choices`` to a mistyped ``name`` (difflib), else ""."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_keys_error(keys: list[str], where: str = "") -> ValueError:
    """The error for config keys ``MegaTrainConfig`` does not have: each with its closest valid key, then all."""
    named = ", ".join(repr(k) + did_you_mean(k, MegaTrainConfig.valid_keys()) for k in sorted(keys))
    return ValueError(f"unknown MegaTrain config keys [{named}]{where}; valid keys: {MegaTrainConfig.valid_keys()}")


LOSS_IMPLS = ("auto", "chunked", "liger", "cce")  # model/loss_impl.LossImpl (config stays free of model imports)

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_value(key: str, value: Any, kind: str, where: str = "") -> Any:
    """``value`` of config key ``key`` as its field's type ``kind`` ("bool", "int", "float", "str", "str | None"),
    read the way a user means it: "false" / "0" / "no" / "off" are False, "4" is 4, "0.5" is 0.5. Anything else
    (a typo such as "ture", "2.5" for an integer, a number for a name) raises naming the key and ``where`` it came
    from (" (env MEGATRAIN_<KEY>)"); a bool is never taken for a number."""
    given = value

    def bad(expected: str) -> ValueError:
        return ValueError(f"{key}{where}={given!r} is not {expected}")

    text = value.strip().lower() if isinstance(value, str) else None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise bad("a boolean; use true or false (1/0, yes/no, on/off are read too)")
    if kind in ("int", "float"):
        if isinstance(value, str):
            try:
                value = float(text) if kind == "float" or "." in text or "e" in text else int(text)
            except ValueError:
                raise bad(f"a number ({kind})") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"a number ({kind})")
        if kind == "float":
            return float(value)
        if float(value).is_integer():
            return int(value)
        raise bad("an integer")
    if kind == "bool | str":  # (a switch with an "auto" setting: torch_compile)
        return "auto" if text == "auto" else parse_value(key, value, "bool", where)
    if value is None and kind == "str | None":
        return None
    if isinstance(value, torch.dtype) and key.endswith("_dtype"):
        return str(value).replace("torch.", "")
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str):
        raise bad("a string")
    return value


@dataclass
class MegaTrainConfig:
    """Policy for streamed full-precision training.

    Attributes:
        compute_dtype: dtype layer weights are streamed and computed in ("bfloat16" or "float32").
            Master weights, gradients and AdamW state are always FP32 on the host.
        micro_batch_size: split each batch into chunks of this many sequences *inside* each layer visit,
            so a layer's weights cross PCIe once per pass however many micro-batches the step has.
            0 = no split (the whole batch runs through a layer at once).
        num_slots: GPU weight slots (>= 2 for double buffering).
        loss_chunk_tokens: tokens per chunk of the fused linear cross-entropy (bounds [chunk, vocab] logits).
        loss_impl: which cross-entropy computes the head loss (model/loss_impl.py): "chunked" (hf_megatrain's own,
            every device), "liger" (Liger-Kernel's fused linear cross-entropy), "cce" (Apple's Cut Cross-Entropy),
            or "auto": a fused one when it is installed, the device is CUDA and it honours the model's head extras
            (liger, then cce), else chunked. Naming a fused one that cannot run is an error when the engine is
            built.
        layers_path: dotted path to the decoder-layer ``nn.ModuleList`` when it cannot be found automatically,
            e.g. "model.layers".
        host_memory_fraction: refuse to build a host store needing more than this fraction of available RAM.
        pin_memory: pin host buffers (only honoured when CUDA is available).
        overlap_optimizer: step each layer in a background thread while the next forward streams earlier layers.
        grad_offload_dtype: dtype gradients cross PCIe in ("float32" exact accumulation, or "bfloat16").
        narrow_grads: with "float32" above, a layer's gradient that is the step's only one and computed whole (one
            backward per step, or the step's last backward of a first visit; no ``micro_batch_size`` split) crosses
            PCIe and waits on the host in the compute dtype: exactly the values autograd produced, half the bytes
            of its D2H and of the host AdamW's gradient read (engine/offload.py). Needs ``host_kernel`` native or
            compiled (the fused kernel reads FP32 only); one process (data parallel reduces in FP32).
        save_dtype: dtype of exported standard checkpoints ("float32" default, "bfloat16").
        skip_nonfinite: skip the optimizer step (state untouched) when the gradient norm is not finite.
        resident_placement: where the FP32 master and AdamW state of the resident parts (embeddings, final norm,
            lm_head) live: "device" (stepped on the GPU; no PCIe traffic for them), "host", or "auto" (device
            when it takes at most ``resident_device_fraction`` of free GPU memory).
        device_layers: how many decoder layers stay whole on the GPU: FP32 master, gradient and AdamW moments live
            there (16 bytes per parameter, none on the host), each visit casts the master into a weight slot, and
            AdamW steps them on the GPU, so they never cross PCIe. The first ones in forward order (the next forward
            needs them first). Layers holding frozen parameters always stream. -1 = auto: as many as fit in
            ``device_step_fraction`` of the GPU memory left after the resident parts (none on CPU-only machines,
            with ``lean_store`` or ``optimizer_state_dir``); the rest of that share goes to ``device_step_layers``.
            0 = stream every layer (the behaviour for models far larger than the GPU).
        device_step_layers: how many streamed layers run AdamW on the GPU while the CPU steps the others at the same
            time (the first ones in forward order: the CPU's layers are needed last); their FP32 gradient and AdamW
            moments stay on the GPU (12 bytes per parameter there, 8 fewer on the host), the master streams through
            PCIe. -1 = auto: as many as fit in ``device_step_fraction`` of the GPU memory left after the resident
            parts (none on CPU-only machines).
        device_step_state: where the AdamW moments of the GPU-stepped layers (``device_step_layers``) live between
            steps: "device" (on the GPU: 12 bytes per parameter there, the master alone streams), or "host" (pinned
            host memory: master and moments stream in for each update, 12 bytes in and 12 out per parameter over
            PCIe; the GPU holds only the gradient during a step and one buffer set per such layer). With "host" no
            per-parameter state of a streamed layer stays on the GPU between steps, as with a model many times the
            GPU's size; their state is copied in during the step's last backward (before their gradients land),
            so the update waits for PCIe only where the backward left no time, and copied back under the next
            forward. Measured with clipping on every step (32k tokens, 8 streamed 14B-width layers, H100): 4 such
            layers 68.6 % MFU, none 62.5 % (integration/PERF.md, lever 44).
        device_step_fraction: share of that free GPU memory the auto rules may give to GPU-kept and GPU-stepped
            layers together (the rest
            is for activations, the loss and the weight slots; lower it if large batches run out of memory).
        placement_tokens: tokens per micro-batch (sequences x sequence length) the auto rules plan the GPU for.
            When set, auto placement keeps as many layers on the GPU (then GPU-steps as many) as the planner's peak
            for a step of that size leaves room for, instead of ``device_step_fraction`` of the memory: a model
            that fits trains like plain GPU training, and a large batch gets fewer kept layers rather than an
            out-of-memory error. 0: the fraction rule. Left unset, ``MegaTrainTrainer`` (and the TRL trainers built
            on it) set it to per_device_train_batch_size x the train dataset's longest ``input_ids`` row when the
            dataset is a ``datasets.Dataset`` with that column (hf/placement_hint.py; the run summary says so);
            otherwise set it to per_device_train_batch_size x your longest sequence.
        optimizer_state_dir: disk tier: keep the AdamW moments (8 of the 18 host bytes per parameter) in
            memory-mapped files in this directory (a fast local NVMe) instead of host RAM, for models beyond RAM.
            Exact, slower (docs/lean_store.md, "Disk tier"); with it, ``device_step_layers=-1`` steps every layer on
            the CPU.
        lean_store: streamed layers keep only FP32 master + AdamW moments on the host (12 instead of 18 bytes per
            parameter): weights stream as FP32 and are cast on the GPU, each layer's gradient gets its AdamW update
            as soon as its backward ends (a step that clips re-runs its forward+backward for the exact clipped
            update; taken back and redone when an unclipped guess turns out to clip). One backward per
            optimizer step: gradient accumulation is refused (use ``micro_batch_size``). See optim/lean.py.
        lean_compute_copy: with ``lean_store``, each layer also keeps its compute-dtype copy on the host (14 instead
            of 12 bytes per parameter), written by the same AdamW pass: weights stream in the compute dtype, half
            the PCIe bytes of FP32 (a layer's forward at 123B width is bound by that transfer otherwise). Needs
            bfloat16 compute.
        lean_grad_plane: with ``lean_store``, keep each layer's gradient of the step on the host (a *gradient
            plane*), so a step that clips updates every layer from it with the clip factor after the backward instead
            of re-running its forward+backward (optim/grad_plane.py). bf16 where the gradients cross narrow (the
            ``narrow_grads`` condition: one backward per step, no ``micro_batch_size`` split, a bf16-reading
            ``host_kernel``; such a gradient is exactly a bf16 tensor): +2 bytes per parameter, 14 with
            ``lean_store`` alone, 16 with ``lean_compute_copy``; else FP32, +4 (always with data-parallel processes,
            whose reduced gradients are FP32; each keeps the plane of its shards). "auto": on where the host plan with
            it fits ``host_memory_fraction`` of the RAM, and not with a bf16 plane and ``micro_batch_size`` (a split
            visit's gradient is an FP32 sum); ``megatrain estimate`` says which layout and why. "on": always (a step
            whose gradients cannot land on it still re-runs, with a log line saying why). "off": never.
        host_layout: "auto" (default): when the full store (18 bytes per streamed parameter) does not fit
            ``host_memory_fraction`` of this host's RAM, the engine trains with the fastest exact lean layout that
            fits (``megatrain estimate``'s *Host layouts* choice: lean store, with the compute copy and gradient
            plane where they fit) and says so at WARNING; never when ``lean_store``, ``lean_compute_copy``,
            ``lean_grad_plane`` or ``optimizer_state_dir`` is set, nor with gradient accumulation (the lean store
            takes one backward per step). "full": keep the full store and refuse a run it does not fit.
        torch_compile: run each layer template and the loss's per-chunk softmax/gradient through ``torch.compile``
            (fuses the elementwise work: ~17% faster steps at 14B width on fixed-length data, ~10 % on packed
            fine-tuning batches; one compilation per layer kind, tens of seconds at start; any sequence length
            without a new graph). Same math, different fp32 rounding (parity ~1e-5..1e-4 instead of bit-exact
            ops). Falls back to eager, with a warning, for a layer dynamo cannot trace; MoE layers whose router
            logits are recorded stay eager. "auto" (default): on when training on a GPU in bf16 / fp16 (where the
            compute dtype's rounding dwarfs the fused kernels' other fp32 rounding), off with float32 compute (kept
            bit-comparable to the eager model) and on a CPU (compilation costs more than it saves); true / false
            force it.
        masked_attention: what runs the attention of masked batches: padded ones (``attention_mask`` with zeros)
            and packed ones (``position_ids`` restarting at each sequence). "auto" (default): FlexAttention with a
            ``BlockMask`` (skips the masked blocks; one kernel for every width) in training forwards -- packed rows
            outside the layers' compiled graphs (inside them FlexAttention computes packed rows wrong on torch
            2.11) -- and SDPA for everything else (unmasked batches, evaluation, generation; model/attention.py),
            where the layers run compiled on a GPU and the model was loaded with transformers' default ``"sdpa"``
            (or ``"flex_attention"``) and supports flex_attention (a power-of-two head_dim of 16-128, no attention
            dropout or logit soft-capping, no ``micro_batch_size`` split, a text-only config); else the model's
            own. Measured on an H100 at 14B width, 32k real tokens per step: packed rows 1.43 s vs ~1.6 s with
            SDPA's dense block-causal mask, which computes every masked block (and, for padded batches, rebuilds a
            cuDNN graph for every new width). "flex": the same, refused (saying why) where it cannot run, and
            tried on eager layers and other head sizes too. "model": the
            model's ``attn_implementation`` always (refused for a ``"flex_attention"`` model with compiled layers,
            as is one "auto" cannot route).
        padding_free: run a right-padded training batch as one packed row (its real tokens end to end,
            ``position_ids`` restarting at each sequence, as ``DataCollatorWithFlattening`` gives), so the layers
            never compute the padding; the same targets, loss and gradients (engine/unpad.py: every padded label
            must be -100, else the batch runs padded). "auto" (default): where packed rows run FlexAttention
            (``masked_attention``), not where they would run SDPA's dense mask over the whole step (measured on an
            H100, 14B width, 32k real tokens of length-grouped padded batches: 1.69 -> 1.45 s); "on":
            also there (refused, saying why, for a multimodal forward, an unshifted loss or a MoE router auxiliary
            loss, which read the padded rows, and for a model whose masks are not transformers' -- a model without
            flex_attention support -- which might not keep the packed sequences apart); "off": never.
        speculative_step: in the step's last backward (Trainer tells the engine which one that is), update each
            CPU-stepped layer as soon as its gradient lands instead of after the backward, overlapping the CPU AdamW
            with the GPU's backward; when the step turns out to clip (or the norm is non-finite) those updates are
            taken back and redone exactly (optim/speculation.py). After a clipping step the next one does not
            speculate. Needs ``overlap_optimizer`` to overlap anything; custom loops set
            ``engine.set_final_backward(True)`` before their last backward of a step to use it.
        exact_take_back: make taking back a speculative update (``speculative_step``, the lean store) bit-exact: each
            speculative update first copies the master and moments it overwrites (12 host bytes per parameter, held
            until ``step()``, within the host's available memory; a layer without room is not speculated on), so a
            skipped step leaves every layer untouched and a clipped redo equals a step that never speculated, bit for
            bit. Off (the default), a take-back is the arithmetic inverse: within an ulp of the untouched state on
            the speculated layers. The copies double the host AdamW's memory traffic for those layers (measured
            0.43x tokens/s at 8k tokens/step streamed, where the host update bounds the step), and take-backs are
            rare: a step that clips after one that did not (the next ones take their norm first), or one whose
            non-finite gradient lands after others were updated (a non-finite gradient stops further updates, so
            the usual overflow, a non-finite loss, updates nothing and is skipped exactly either way).
        host_kernel: how the CPU runs AdamW over host units (core/kernels.py): "fused" (torch's fused AdamW kernel,
            then the compute copy as a second pass), "compiled" (one inductor-generated pass that also writes the
            compute copy: fewer bytes over host memory, which bounds this step; needs a C++ compiler, compiled once
            at start, seconds; its call holds the GIL, which stalls the backward that the overlapped optimizer runs
            beside), "native" (the same single pass as a C loop built with the system C compiler at start, called
            without the GIL: core/native_adamw.py; bf16 compute copies) or "auto" (native when training on a GPU
            with a bf16 or FP32 compute dtype and a C compiler, else fused).
        split_host_update: how host AdamW updates that the next forward waits for (those launched after the
            gradient norm: clipping active) run: "auto" splits each layer's update in two passes where the host has
            time to spare -- first the new bf16 weights alone (~60 % of a whole pass's memory traffic: the layer can
            be loaded then), later master and moments, under the next forward and backward -- judged from the last
            step's measured host rate and step time (optim/split_update.py); "on": always; "off": whole updates.
            Same bits either way. Needs host_kernel native and bf16 compute ("auto" is off otherwise); with
            several processes each splits its shards' updates, and a load waits for every rank's new weights.
        seq_chunk_tokens: run each decoder layer's position-wise parts (the MLP, the norms) over chunks of this many
            tokens of the sequence, each chunk recomputed on its own in the backward (model/seq_tiling.py), so their
            intermediates ([tokens, intermediate] gate/up, fp32 norm upcasts) never exist for the whole sequence:
            long-context training. 0 = off; -1 = auto (the planner picks a chunk from the MLP width; sequences no
            longer than the chunk run untiled). Same math (fp32 sums in another order).
        activation_offload: where each layer's saved input (the layer-boundary activation, batch x seq x hidden in
            compute dtype, kept for the backward's recompute) lives: "off" (on the device, the default behaviour),
            "on" (every layer's in pinned host memory, copied out after the forward uses it and prefetched back
            for the backward), "auto" (the planner keeps the last layers' inputs on the GPU while they fit its
            budget for the step's sequence length and offloads the first ones; nothing is offloaded on a CPU).
        activation_prefetch: offloaded layer inputs copied back this many layers ahead of the backward (>= 1).
        saved_graph_layers: how many of the last decoder layers keep their training forward's autograd graph (its
            activations and a compute-dtype copy of the layer's weights) on the GPU, so their backward runs without
            recomputing the forward -- a quarter of a layer's matmuls saved per such layer. The last ones in forward
            order: their backward comes first, so their memory is held the shortest. -1 = auto: as many as the
            planner fits beside the step's planned GPU peak for its (batch, seq) shape (none where layer inputs are
            offloaded, a visit is split by ``micro_batch_size``, or on a CPU); 0 = recompute every layer; n > 0:
            the last n (a CPU too; all of them when n exceeds the layers). Either way a visit split by
            ``micro_batch_size``, a layer whose input is offloaded or that draws random numbers (dropout), and a
            second forward before the backward recompute as before. Same math (the backward differentiates the
            forward's own graph).
        host_threads: CPU threads of the host AdamW (torch's intra-op threads of the process). 0 = auto: this
            process's share of its cores (data-parallel processes of one host split them, each leaving 4 of its share
            to its other busy threads: core/threads.py ``share_threads``; the weights half of a split update,
            which the next forward waits for while those threads idle, takes the whole share), raised to that when a
            launcher left fewer (``accelerate launch`` and torchrun set OMP_NUM_THREADS=1 unless told otherwise),
            never lowered. > 0: exactly that many. With ``host_affinity='auto'`` binding the process: its cores.
        host_affinity: ``auto`` (default): on a GPU, when the host's processes have GPUs on every NUMA node, each
            runs its threads on its GPU's node (sysfs) and the processes of a node split its cores, so the pages they
            first touch (moments, shard, pinned staging) sit there too; otherwise (one process, one node, every GPU
            on one node) no process is bound: each runs its share's count of threads (``host_threads``) on every core,
            keeping every node's memory bandwidth for the host AdamW (bound to a share of one node's cores, a
            rank's other threads preempt its AdamW threads: 4 ms scheduler-tick stalls, measured). No
            oversubscription either way.
            ``none``: keep the launcher's affinity and only split the thread count. The run summary says which node
            and cores each process uses.
        shared_memory_dir: several processes of one host (data parallel, parallel/): the directory on a RAM file system
            where the host's one copy of the FP32 store is created (files removed once every rank mapped them).
        weight_gather: several processes of one host: in the training forward each process copies only its shard of
            a layer's weights from host memory and an all-gather between the GPUs (NVLink) brings the others', so
            the host's memory is read once per layer instead of once per process (engine/weight_gather.py). The
            backward, evaluation and generation copy whole layers. ``False``: every load copies the whole layer.
        gradient_reduce_ctas: several processes on GPUs (NCCL): the most SMs (CTAs) each layer gradient's
            reduce-scatter may take, on a communicator of its own. It runs beside the backward's GEMMs, which lose
            the SMs it holds for as long as it runs, waiting for a slower rank included; a few CTAs move a layer's
            gradient well within one layer's backward. ``0``: NCCL's own choice, on the gradient group.
        gradient_exchange: several processes: how a layer's gradient becomes each rank's shard of the ranks' mean.
            ``reduce_scatter`` (default): cast to FP32 on the compute stream, an FP32 reduce-scatter. ``all_to_all``
            (bf16/fp16 compute, a layer's gradient computed whole): the compute-dtype values themselves cross to
            the rank owning each shard (half the bytes on the GPUs' links, no cast on the compute stream) and that
            rank sums them in FP32 beside the backward; the same mean up to FP32 summation order.
    """

    compute_dtype: str = "bfloat16"
    micro_batch_size: int = 0
    num_slots: int = 2
    loss_chunk_tokens: int = 4096
    loss_impl: str = "auto"
    layers_path: str | None = None
    host_memory_fraction: float = 0.9
    pin_memory: bool = True
    overlap_optimizer: bool = True
    grad_offload_dtype: str = "float32"
    narrow_grads: bool = True
    save_dtype: str = "float32"
    skip_nonfinite: bool = True
    resident_placement: str = "auto"
    device_layers: int = -1
    device_step_layers: int = -1
    optimizer_state_dir: str | None = None
    resident_device_fraction: float = 0.5
    device_step_fraction: float = 0.5
    placement_tokens: int = 0
    device_step_state: str = "device"
    lean_store: bool = False
    lean_compute_copy: bool = False
    lean_grad_plane: str = "auto"
    host_layout: str = "auto"
    torch_compile: bool | str = "auto"
    masked_attention: str = "auto"
    padding_free: str = "auto"
    speculative_step: bool = True
    exact_take_back: bool = False
    host_kernel: str = "auto"
    split_host_update: str = "auto"
    seq_chunk_tokens: int = 0
    activation_offload: str = "auto"
    activation_prefetch: int = 2
    saved_graph_layers: int = -1
    host_threads: int = 0
    host_affinity: str = "auto"
    shared_memory_dir: str = "/dev/shm"
    weight_gather: bool = True
    gradient_reduce_ctas: int = 8
    gradient_exchange: str = "reduce_scatter"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # every source (dict, JSON, yaml, env, keyword) is read the same way
            if f.name != "extra":
                setattr(self, f.name, parse_value(f.name, getattr(self, f.name), str(f.type)))
        parse_dtype(self.compute_dtype, "compute_dtype")
        parse_dtype(self.grad_offload_dtype, "grad_offload_dtype")
        parse_dtype(self.save_dtype, "save_dtype")
        if self.device_step_state not in ("device", "host"):
            raise ValueError(f"device_step_state={self.device_step_state!r}: use 'device' (AdamW moments of the "
                             "GPU-stepped layers on the GPU) or 'host' (streamed in and out for each update)")
        if self.host_kernel not in ("auto", "fused", "compiled", "native"):
            raise ValueError(f"host_kernel={self.host_kernel!r}: use 'auto', 'native', 'compiled' or 'fused'")
        if self.num_slots < 2:
            raise ValueError(f"num_slots={self.num_slots}: need at least 2 GPU slots for double buffering")
        if self.micro_batch_size < 0:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 0 (0 = no split)")
        if self.loss_chunk_tokens <= 0:
            raise ValueError(f"loss_chunk_tokens={self.loss_chunk_tokens} must be > 0")
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl={self.loss_impl!r}; use one of {list(LOSS_IMPLS)}")
        if not 0.0 < self.host_memory_fraction <= 1.0:
            raise ValueError(f"host_memory_fraction={self.host_memory_fraction} must be in (0, 1]")
        if self.device_step_layers < -1:
            raise ValueError(f"device_step_layers={self.device_step_layers}: use -1 (auto), 0 (all on the CPU) "
                             "or a number of layers")
        if self.saved_graph_layers < -1:
            raise ValueError(f"saved_graph_layers={self.saved_graph_layers}: use -1 (auto), 0 (recompute every layer) "
                             "or a number of layers")
        if self.device_layers < -1:
            raise ValueError(f"device_layers={self.device_layers}: use -1 (auto), 0 (stream every layer) or a number "
                             "of layers")
        if self.lean_store and self.device_layers > 0:
            raise ValueError(f"lean_store=True streams every layer (device_layers={self.device_layers}); use "
                             "device_layers=-1 or 0")
        if self.optimizer_state_dir is not None and not os.path.isdir(self.optimizer_state_dir):
            raise ValueError(f"optimizer_state_dir={self.optimizer_state_dir!r} is not an existing directory; create "
                             "it on a local disk with room for 8 bytes per parameter, or leave it unset")
        for frac in ("device_step_fraction", "resident_device_fraction"):
            if not 0.0 <= getattr(self, frac) <= 1.0:  # (nan fails too)
                raise ValueError(f"{frac}={getattr(self, frac)} must be in [0, 1]")
        if not 0 <= self.gradient_reduce_ctas <= 64:  # (NCCL's range for a communicator's CTAs)
            raise ValueError(f"gradient_reduce_ctas={self.gradient_reduce_ctas} must be in [0, 64]: the most SMs a "
                             "layer gradient's reduce-scatter may take (0: NCCL's own choice)")
        if self.gradient_exchange not in ("reduce_scatter", "all_to_all"):
            raise ValueError(f"gradient_exchange={self.gradient_exchange!r}; use 'reduce_scatter' (FP32 collective) or "
                             "'all_to_all' (compute-dtype values to each shard's rank, summed there in FP32)")
        if self.host_affinity not in ("auto", "none"):
            raise ValueError(f"host_affinity={self.host_affinity!r}; use 'auto' (each process on its GPU's NUMA node "
                             "and its share of the cores) or 'none' (keep the launcher's affinity)")
        if self.host_threads < 0:
            raise ValueError(f"host_threads={self.host_threads} must be >= 0 (0: auto, the process's share of its cores)")
        if self.placement_tokens < 0:
            raise ValueError(f"placement_tokens={self.placement_tokens} must be >= 0 (0: the fraction rule)")
        if self.resident_placement not in ("auto", "device", "host"):
            raise ValueError(f"resident_placement={self.resident_placement!r}; use 'auto', 'device' or 'host'")
        if self.lean_store and self.torch_grad_offload_dtype != torch.float32:
            raise ValueError("lean_store=True needs grad_offload_dtype='float32': the optimizer consumes each "
                             "layer's gradient straight from the FP32 offload slab")
        if self.lean_compute_copy and not self.lean_store:
            raise ValueError("lean_compute_copy=True is an option of the lean store: set lean_store=True too (the "
                             "other host layers keep their compute copy anyway)")
        if self.lean_compute_copy and self.torch_compute_dtype == torch.float32:
            raise ValueError("lean_compute_copy=True needs compute_dtype='bfloat16': with float32 compute the "
                             "master is what streams")
        if self.host_layout not in ("auto", "full"):
            raise ValueError(f"host_layout={self.host_layout!r}; use 'auto' (a lean layout when the full store does "
                             "not fit the RAM) or 'full' (refuse instead)")
        if self.lean_grad_plane not in ("auto", "on", "off"):
            raise ValueError(f"lean_grad_plane={self.lean_grad_plane!r}; use 'auto', 'on' or 'off'")
        if self.lean_grad_plane == "on" and not self.lean_store:
            raise ValueError("lean_grad_plane='on' is an option of the lean store: set lean_store=True too (the "
                             "other host layers keep an FP32 gradient anyway)")
        if self.lean_store and self.device_step_layers > 0:
            raise ValueError(f"lean_store=True cannot run AdamW on the GPU (device_step_layers="
                             f"{self.device_step_layers}): that path keeps each layer's gradient until the step. "
                             "Use device_step_layers=-1 or 0")
        if self.seq_chunk_tokens < -1:
            raise ValueError(f"seq_chunk_tokens={self.seq_chunk_tokens}: use 0 (off), -1 (auto) or a number of tokens")
        if self.masked_attention not in ("auto", "flex", "model"):
            raise ValueError(f"masked_attention={self.masked_attention!r}; use 'auto', 'flex' or 'model'")
        if self.padding_free not in ("auto", "on", "off"):
            raise ValueError(f"padding_free={self.padding_free!r}; use 'auto', 'on' or 'off'")
        if self.split_host_update not in ("auto", "on", "off"):
            raise ValueError(f"split_host_update={self.split_host_update!r}; use 'auto', 'on' or 'off'")
        if self.activation_offload not in ("auto", "on", "off"):
            raise ValueError(f"activation_offload={self.activation_offload!r}; use 'auto', 'on' or 'off'")
        if self.activation_prefetch < 1:
            raise ValueError(f"activation_prefetch={self.activation_prefetch} must be >= 1 (layers fetched ahead)")
        if self.extra:
            raise unknown_keys_error(list(self.extra))

    # -- typed views -------------------------------------------------------------------------------------------------
    def compiles(self, device_type: str) -> bool:
        """Whether layers and the loss run compiled when training on ``device_type`` (``torch_compile``: "auto"
        compiles on a GPU with a 16-bit compute dtype only)."""
        if self.torch_compile == "auto":
            return device_type == "cuda" and self.torch_compute_dtype != torch.float32
        return bool(self.torch_compile)

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return parse_dtype(self.compute_dtype, "compute_dtype")

    @property
    def torch_grad_offload_dtype(self) -> torch.dtype:
        return parse_dtype(self.grad_offload_dtype, "grad_offload_dtype")

    @property
    def torch_save_dtype(self) -> torch.dtype:
        return parse_dtype(self.save_dtype, "save_dtype")

    # -- construction from user input --------------------------------------------------------------------------------
    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "MegaTrainConfig":
        data = dict(data or {})
        known = {k: data.pop(k) for k in list(data) if k in cls.valid_keys()}
        return cls(**known, extra=data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = "MEGATRAIN_") -> dict[str, Any]:
        """Collect ``MEGATRAIN_<KEY>`` variables as a dict, each read as its field's type (``parse_value``) and
        checked on its own, so a bad value raises naming the variable. Unknown keys raise."""
        environ = dict(os.environ if environ is None else environ)
        out: dict[str, Any] = {}
        types = {f.name: f for f in fields(cls)}
        skip = {CONFIG_ENV, "MEGATRAIN_ENABLED"}
        for key, raw in environ.items():
            if not key.startswith(prefix) or key in skip:
                continue
            name = key[len(prefix):].lower()
            if name not in types or name == "extra":
                valid = [prefix + k.upper() for k in cls.valid_keys()]
                raise ValueError(f"unknown environment variable {key};{did_you_mean(key, valid)} valid: {valid}")
            kind = str(types[name].type)
            value = parse_value(name, None if raw == "" and kind == "str | None" else raw, kind, f" (env {key})")
            try:
                cls(**{name: value})  # range / choice checks of this key alone
            except ValueError as e:
                raise ValueError(f"env {key}: {e}") from None
            out[name] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d

    @property
    def explicit_keys(self) -> frozenset[str]:
        """The keys given when this config was built (keyword or positional arguments, ``from_dict`` keys,
        ``resolve_config``'s source and env keys); the others hold their defaults. Entry points that choose a
        value from context when the user left a key unset (the compute dtype from Trainer's ``bf16`` flag and
        the model's dtype, see ``MegaTrainTrainingArguments.megatrain_resolved_config``) read this.
        ``dataclasses.replace`` counts every key as given."""
        return self.__dict__.get("_explicit", frozenset(self.valid_keys()))

    @property
    def key_sources(self) -> dict[str, str]:
        """Where each key ``resolve_config`` assembled came from (``{key: "env MEGATRAIN_CONFIG=a.yaml"}``, in the
        order of its layers); empty for a config built otherwise."""
        return dict(self.__dict__.get("_sources", {}))

    @property
    def key_overrides(self) -> list[str]:
        """Keys a higher ``resolve_config`` layer set to another value than a lower one did, in words."""
        return list(self.__dict__.get("_overrides", []))

    def resolved(self, **values: Any) -> "MegaTrainConfig":
        """A copy with ``values`` the library chose (an automatic setting resolved for this run), what the user set
        unchanged: ``explicit_keys`` and the key sources stay this config's (``dataclasses.replace`` alone would
        count every key as given, and the run summary would list them all as set)."""
        out = dataclasses.replace(self, **values)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k in ("_explicit", "_sources", "_overrides")})
        return out

    def explicit_dict(self) -> dict[str, Any]:
        """``to_dict()`` restricted to ``explicit_keys``: rebuilding from it gives an equal config with the same
        explicit keys (how ``MegaTrainTrainingArguments`` stores a config object given to it)."""
        return {k: v for k, v in self.to_dict().items() if k in self.explicit_keys}


def _record_explicit(init):
    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        names = MegaTrainConfig.valid_keys()
        self.__dict__["_explicit"] = frozenset(names[:len(args)]) | frozenset(k for k in kwargs if k in names)
    return __init__


MegaTrainConfig.__init__ = _record_explicit(MegaTrainConfig.__init__)


# -- the one config resolution -----------------------------------------------------------------------------------------
CONFIG_ENV = "MEGATRAIN_CONFIG"  # yaml path; ``megatrain launch`` sets it to the section of its combined yaml
SECTION = "megatrain"  # the MegaTrainConfig section of a combined accelerate + megatrain launch yaml


class ConfigFileNotFoundError(FileNotFoundError, ValueError):
    """A config path that does not exist (a ``ValueError`` too: argument validation reports it like a bad key)."""


def read_launch_yaml(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Read a yaml file -> (its top-level mapping without the ``megatrain:`` section, that section or None).

    A combined accelerate + megatrain launch yaml yields (accelerate keys, section); a plain MegaTrainConfig
    yaml yields (its keys, None). A ``megatrain:`` key left empty is an empty section."""
    import yaml  # only needed when a yaml path is given

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigFileNotFoundError(f"config file {path!r} does not exist (a config given as a string is a JSON "
                                      "object or the path of an existing yaml file; this is neither)")
    with open(path) as f:
        data = yaml.safe_load(f)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping (MegaTrainConfig keys, or accelerate keys plus a "
                         f"'{SECTION}:' section), got {type(data).__name__}")
    if SECTION not in data:
        return data, None
    section = data.pop(SECTION)
    section = {} if section is None else section
    if not isinstance(section, dict):
        raise ValueError(f"{path}: '{SECTION}:' must be a mapping of MegaTrainConfig keys, valid keys: "
                         f"{MegaTrainConfig.valid_keys()}")
    return data, section


def _source_values(source: Any) -> dict[str, Any]:
    """The keys an explicit config source sets (see ``resolve_config``)."""
    if source is None:
        return {}
    if isinstance(source, MegaTrainConfig):
        return source.explicit_dict()  # (its other keys are defaults: rebuilding gives the same values)
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if not text.strip():
            return {}
        if text.lstrip().startswith("{"):
            values = json.loads(text)
            if not isinstance(values, dict):
                raise ValueError(f"config JSON {text!r} is not an object of MegaTrainConfig keys")
            return values
        rest, section = read_launch_yaml(text)
        return rest if section is None else section
    raise TypeError(f"cannot build a MegaTrainConfig from {type(source).__name__}; pass a MegaTrainConfig, a dict, "
                    "a JSON string or a yaml path")


def _label(source: Any, name: str) -> str:
    """How the key sources name an explicit config source (the run summary, the log)."""
    if isinstance(source, MegaTrainConfig):
        return f"{name} (a MegaTrainConfig)"
    if isinstance(source, Mapping):
        return f"{name} (a dict)"
    text = os.fspath(source) if isinstance(source, (str, os.PathLike)) else str(source)
    return f"{name} (JSON)" if text.lstrip().startswith("{") else f"{name}={text}"


def resolve_config(source: Any = None, environ: Mapping[str, str] | None = None,
                   name: str = "the given config") -> MegaTrainConfig:
    """THE config resolution, used by every entry point that takes a config from the user. Three layers, merged
    key by key, a later one winning:

    1. the yaml named by env ``MEGATRAIN_CONFIG`` (a MegaTrainConfig yaml or a combined launch yaml's
       ``megatrain:`` section: what ``megatrain launch --config`` passes to the training process);
    2. ``source`` when given (``name`` says what the caller calls it, e.g. "megatrain_config"): a
       ``MegaTrainConfig`` (its explicit keys), a dict, a JSON object string, a yaml path, or a combined launch
       yaml (its ``megatrain:`` section); the script's own keys override the launch yaml's, as
       ``Accelerator(mixed_precision=...)`` in code overrides ``accelerate launch``'s config;
    3. single ``MEGATRAIN_<KEY>`` env variables (typed by the field, see ``MegaTrainConfig.from_env``): a one-key
       override given at launch, over both.

    A path that does not exist raises ``ConfigFileNotFoundError``. ``environ`` defaults to ``os.environ``; pass
    ``{}`` for the explicit source alone. Unknown keys (in any layer) raise, naming the layer, the closest valid
    key and all valid ones. The result's ``explicit_keys`` are the keys any layer set (all others hold their
    defaults), ``key_sources`` which layer each came from; every key is logged with its layer at INFO, and a key
    a later layer sets to another value than an earlier one at WARNING (``key_overrides``)."""
    environ = os.environ if environ is None else environ
    types = {f.name: str(f.type) for f in fields(MegaTrainConfig) if f.name != "extra"}
    layers: list[tuple[str, dict[str, Any]]] = []
    env_path = environ.get(CONFIG_ENV) or None
    if env_path is not None:
        try:
            layers.append((f"env {CONFIG_ENV}={env_path}", _source_values(env_path)))
        except ConfigFileNotFoundError as e:
            raise ConfigFileNotFoundError(f"env {CONFIG_ENV}: {e}") from e
    if source is not None:
        layers.append((_label(source, name), _source_values(source)))
    for key, value in MegaTrainConfig.from_env(environ).items():
        layers.append((f"env MEGATRAIN_{key.upper()}", {key: value}))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    overrides: list[str] = []
    for label, layer in layers:
        unknown = [k for k in layer if k not in types]
        if unknown:
            raise unknown_keys_error(unknown, f" in {label}")
        for key, value in layer.items():
            try:
                value = parse_value(key, value, types[key])
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
            if key in values and not _same(key, values[key], value):
                overrides.append(f"{key}={value!r} from {label} overrides {key}={values[key]!r} from {sources[key]}")
            values[key] = value
            sources.pop(key, None)  # (listed in the order of the layer that set it last)
            sources[key] = label
    config = MegaTrainConfig.from_dict(values)
    config.__dict__["_sources"] = sources
    config.__dict__["_overrides"] = overrides
    # (one record per resolution: an entry point resolves once and hands the MegaTrainConfig down; tests count these)
    logger.debug("hf_megatrain: config resolved from %s", " < ".join(label for label, _ in layers) or "the defaults")
    for line in overrides:
        logger.warning("hf_megatrain: config: %s (precedence: MEGATRAIN_CONFIG yaml < %s < MEGATRAIN_<KEY> env; "
                       "docs/configuration.md)", line, name)
    if sources:
        logger.info("hf_megatrain: config keys: %s", describe_sources(config))
    return config


def _same(key: str, a: Any, b: Any) -> bool:
    """Whether two layers' values of ``key`` mean the same ("bf16" and "bfloat16" do)."""
    if key.endswith("_dtype") and isinstance(a, str) and isinstance(b, str):
        return _DTYPES.get(a.lower(), a) == _DTYPES.get(b.lower(), b)
    return a == b


def describe_sources(config: MegaTrainConfig) -> str:
    """``key_sources`` in words, grouped by layer: "env MEGATRAIN_CONFIG=a.yaml: num_slots, save_dtype;
    megatrain_config (a dict): micro_batch_size"; "the defaults" when no layer set a key."""
    groups: dict[str, list[str]] = {}
    for key, label in config.key_sources.items():
        groups.setdefault(label, []).append(key)
    return "; ".join(f"{label}: {', '.join(keys)}" for label, keys in groups.items()) or "the defaults"
