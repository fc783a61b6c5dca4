"""Building an engine: its parts in one place, in named phases that ``build_engine`` calls in order.

    plan       the model checked, its decoder-layer stack and units, every unit's plan for this device's GPU budget
               and the one host-RAM fit check, before anything large is allocated (engine/conversion_plan.py)
    store      the unit store, allocated from the plans (core/store.py)
    templates  each layer's weights into the store and its weightless template, one layer at a time; the resident
               parameters on the device (engine/convert.py)
    executor   how the step runs (core/plan.py ``decide_modes``), the step state, the streaming executor, and the
               proxies that run it in the model's layer places
    head       the HF head's family extras and loss (model/families.py), and whether padded batches run as one
               packed row (engine/unpad.py)
    landing    the one place gradients land (engine/landing.py)

Data parallel (``dp``): plan, store and templates run on the ranks of each node in turn, into one store per node
in shared memory, and the replicated state is made rank 0's (engine/shared_convert.py); the phases are the same.
The builder decides nothing the plans and the config do not say; the runtime (engine/runtime.py) takes its parts
and runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..config import MegaTrainConfig
from ..core.memory import alloc_host
from ..core.plan import Plans, StepModes, decide_modes
from ..core.step_state import StepState
from ..core.store import UnitStore
from ..model import attention
from ..model.families import ModelHead
from ..model.layers import LayerStack
from ..model.skeleton import materialize_resident, resident_meta_names
from ..parallel.group import DataParallel
from ..parallel.peer_cells import PeerCells
from . import unpad
from .conversion_plan import ConversionPlan, plan_conversion
from .convert import Converted, convert
from .executor import StreamingExecutor
from .kv_cache import CachingStreamedLayer
from .landing import GradientLanding
from .shared_convert import HostAlloc, convert_shared
from .weight_gather import WeightGather


@dataclass
class EngineParts:
    """What ``build_engine`` leaves for the runtime."""

    stack: LayerStack  # where the decoder layers sit in the model (now the executor's proxies)
    plans: Plans
    store: UnitStore
    resident_params: dict[str, nn.Parameter]  # trainable parameters outside the layers (device working copies)
    frozen_resident: dict[str, nn.Parameter]  # frozen ones (device, compute dtype)
    layer_buffer_names: list[list[str]]  # per layer: its persistent buffers (checkpoints hold them)
    attention: attention.AttentionChoice | None  # masked batches' attention kernel (model/attention.py)
    modes: StepModes  # host kernel, narrow gradients, speculation, lean units: decided once
    state: StepState
    executor: StreamingExecutor
    head: ModelHead
    unpadding: unpad.Unpadding
    landing: GradientLanding


def build_engine(model: nn.Module, config: MegaTrainConfig, device: torch.device,
                 decay_names: set[str] | None = None, dp: DataParallel | None = None,
                 show_progress: bool = True) -> EngineParts:
    """Every phase, in order. ``config`` resolved (data parallel: ``data_parallel_config``'s); ``decay_names``: the
    parameters weight decay applies to (None: Trainer's rule); ``dp``: None alone; ``show_progress``: the
    conversion's bar of bytes."""
    # (data parallel: ranks > 0 start from rank 0's weights whatever their model holds; engine/shared_convert.py)
    convert_in = partial(_convert, model, config, device, decay_names, show_progress=show_progress,
                         data_parallel=dp is not None, weights_from_rank0=dp is not None and dp.rank != 0)
    if dp is None:
        conv = convert_in(alloc_host, None)
    else:  # (each rank in turn, into its node's shared store)
        conv = convert_shared(dp, config.shared_memory_dir, convert_in)
    modes, state, executor = _executor(conv, config, device, dp)
    head, unpadding = _head(model, conv, executor, config, device)
    landing = _landing(model, conv, state, executor)
    return EngineParts(conv.stack, conv.plans, conv.store, conv.resident_params, conv.frozen_resident,
                       conv.persistent_buffers, conv.attention, modes, state, executor, head, unpadding, landing)


def _meta_weights(model: nn.Module, config: MegaTrainConfig, weights_from_rank0: bool, data_parallel: bool) -> None:
    """A model on the meta device (``accelerate.init_empty_weights``, ``device_map="meta"``): with several processes
    every one but rank 0 may pass one (``weights_from_rank0``), so that only one of them holds the weights in RAM --
    the store and the replicated state take rank 0's whatever the others held (engine/shared_convert.py); its
    resident parameters get empty storage here for that. Rank 0, or one process alone, is refused where a resident
    parameter is meta: nothing would fill it. (Meta decoder layers alone are ``from_pretrained_streamed``'s
    skeleton, which fills the store after this.)"""
    if weights_from_rank0:
        materialize_resident(model, config.layers_path)
        return
    resident = resident_meta_names(model, config.layers_path)
    if resident:
        where = "the first process (rank 0) of this launch holds" if data_parallel else "this model holds"
        raise ValueError(
            f"hf_megatrain: {where} {len(resident)} parameters outside the decoder layers on the meta device (e.g. "
            f"{resident[0]!r}): nothing would fill them. Load real weights (from_pretrained), or use "
            "hf_megatrain.from_pretrained_streamed(path, config), which fills the store from the checkpoint. With "
            "several processes only rank 0 needs real weights: the others may build theirs on the meta device.")


def _convert(model: nn.Module, config: MegaTrainConfig, device: torch.device, decay_names: set[str] | None,
             host_alloc: HostAlloc, host_available: int | None, *, show_progress: bool = True,
             data_parallel: bool = False, weights_from_rank0: bool = False) -> Converted:
    """plan -> store -> templates: the model into a filled store (data parallel: what each rank runs in turn).
    ``host_alloc`` makes the store's host buffers; ``host_available``: the RAM the fit check counts on (None: now);
    ``weights_from_rank0``: this rank's store and replicated state are rank 0's (its model may be on meta)."""
    plan = _plan(model, config, device, decay_names, host_available, data_parallel)
    _meta_weights(model, config, weights_from_rank0, data_parallel)  # (after the fit check: a meta model may ask)
    store = _store(plan, config, device, host_alloc)
    return _templates(model, plan, store, config, device, show_progress)


# -- the phases -------------------------------------------------------------------------------------------------------
def _plan(model: nn.Module, config: MegaTrainConfig, device: torch.device, decay_names: set[str] | None,
          host_available: int | None, data_parallel: bool = False) -> ConversionPlan:
    return plan_conversion(model, config, device, decay_names, host_available, data_parallel)


def _store(plan: ConversionPlan, config: MegaTrainConfig, device: torch.device, host_alloc: HostAlloc) -> UnitStore:
    return UnitStore(plan.plans, plan.layouts.layouts, plan.layouts.frozen, compute_dtype=config.torch_compute_dtype,
                     device=device, pin=config.pin_memory and device.type == "cuda",
                     state_dir=config.optimizer_state_dir, host_alloc=host_alloc)


def _templates(model: nn.Module, plan: ConversionPlan, store: UnitStore, config: MegaTrainConfig,
               device: torch.device, show_progress: bool = True) -> Converted:
    return convert(model, plan, store, device, compile=config.compiles(device.type), show_progress=show_progress)


def _executor(conv: Converted, config: MegaTrainConfig, device: torch.device,
              dp: DataParallel | None) -> tuple[StepModes, StepState, StreamingExecutor]:
    modes = decide_modes(config, conv.plans, device.type, data_parallel=dp is not None)
    # (data parallel: loads wait for every rank's shard of an update, not for a barrier per step)
    peers = None
    if dp is not None:  # ([ranks, 2 x units]: the final updates, then those whose compute copy is written)
        dp.cap_reduce(config.gradient_reduce_ctas)  # (the layer gradients' collective: its own communicator, NCCL)
        finished, weights = conv.peer_cells.chunk(2, dim=1)
        peers = PeerCells(finished, dp.local_rank, weights=weights, liveness=conv.liveness)
    state = StepState(len(conv.store.units), peers=peers)
    # (data parallel: the training forward's loads by shards + all-gather, where some unit qualifies)
    gather = WeightGather(conv.store.units[:-1], dp, config.torch_compute_dtype) \
        if dp is not None and config.weight_gather else None
    executor = StreamingExecutor(
        conv.store.units[:-1], state, conv.kinds, conv.templates, conv.buffers, device=device,
        compute_dtype=config.torch_compute_dtype, grad_offload_dtype=config.torch_grad_offload_dtype,
        num_slots=config.num_slots, micro_batch_size=config.micro_batch_size,
        pin=config.pin_memory and device.type == "cuda", activation_prefetch=config.activation_prefetch, dp=dp,
        narrow=modes.narrow, gather=gather if gather is not None and gather.order else None,
        exchange=config.gradient_exchange)
    # Each decoder layer's place: a weightless proxy run by the executor (one that also runs with a KV cache, for
    # ``generate()``: engine/kv_cache.py).
    layers = conv.stack.layers
    for i, layer in enumerate(conv.originals):
        layers[i] = CachingStreamedLayer(executor, i, layer)
        layers[i].shared_params = conv.shared[i] if conv.shared else {}
    return modes, state, executor


def _head(model: nn.Module, conv: Converted, executor: StreamingExecutor, config: MegaTrainConfig,
          device: torch.device) -> tuple[ModelHead, unpad.Unpadding]:
    # Family extras of the HF head (soft-capping, logit scaling, MoE router aux loss): model/families.py.
    head = ModelHead(model, conv.stack, executor, loss_impl=config.loss_impl, device=device,
                     compute_dtype=config.torch_compute_dtype)
    flex = bool(conv.attention is not None and conv.attention.flex)
    unpadding = unpad.decide(config.padding_free, flex, runs_model=head.run.runs_model, unshifted=head.unshifted,
                             router=head.router is not None,
                             windowed=unpad.windowed_attention(getattr(model, "config", None)),
                             masks_packed=bool(getattr(model, "_supports_flex_attn", False)))
    return head, unpadding


def _landing(model: nn.Module, conv: Converted, state: StepState, executor: StreamingExecutor) -> GradientLanding:
    # (the optimizer's land phase calls it; so do accumulation and parameters())
    return GradientLanding(state, executor, conv.store.units[-1], conv.resident_params,
                           early_names=_head_names(model, conv.resident_params))


def _head_names(model: nn.Module, resident: dict[str, nn.Parameter]) -> frozenset[str]:
    """The resident parameters of the output head, unless tied to the input embeddings: the loss's backward makes
    their whole gradient before any layer's (autograd runs a leaf's accumulation first), so it can land early."""
    get_head, get_embed = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        return frozenset()
    embed = get_embed() if callable(get_embed) else None
    tied = {id(p) for p in embed.parameters()} if isinstance(embed, nn.Module) else set()
    mine = {id(p) for p in head.parameters()} - tied
    return frozenset(n for n, p in resident.items() if id(p) in mine)
