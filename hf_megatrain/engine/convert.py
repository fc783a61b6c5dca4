"""Conversion: an HF causal LM -> unit plans, a filled unit store, layer templates and weightless proxies.

Everything that happens once, before the first step: find the decoder-layer stack, lay out one unit per layer and
one resident unit (embeddings, final norm, lm_head; ``model.layers.unit_layouts``), build every unit's plan
(core/plan.py) for this device's GPU budget, check with the planner that the run fits host RAM (the one RAM check,
before anything large is allocated), allocate the store from the plans, copy each layer's weights into it and free
the layer (peak = store + one layer), and rebind the resident parameters to device copies (views of the unit's
device buffers when its plan keeps it there). ``install_proxies`` then swaps each decoder layer for a
``StreamedLayer`` run by the executor. The runtime (engine/runtime.py) never decides placement.

Frozen parameters (``requires_grad=False``: a PEFT base, frozen layers) get no FP32 master or optimizer state: in
layers they stream from a compute-dtype host copy, outside layers they stay on the device in compute dtype.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import planner
from ..config import MegaTrainConfig
from ..core.memory import alloc_host, gpu_budget
from ..core.plan import Plans, Where
from ..core.progress import progress_over, tensor_bytes
from ..core.store import UnitStore
from ..model import attention
from ..model.cross_layer import drop_unread_kv_stores
from ..model.families import check_supported
from ..model.head_config import head_module_params
from ..model.layers import LayerStack, find_layer_stack, group_layers, unit_layouts
from ..model.seq_tiling import tile_positionwise
from ..model.shared_blocks import SharedParams, shared_by_layer
from ..model.template import LayerTemplate, is_stochastic
from ..parallel.liveness import Liveness
from .executor import StreamingExecutor
from .kv_cache import CachingStreamedLayer
from .proxy import StreamedLayer

logger = logging.getLogger(__name__)

# transformers.Trainer.get_decay_parameter_names: no decay for biases and norm weights.
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def default_decay_names(model: nn.Module) -> set[str]:
    """Names Trainer would weight-decay (same rule as ``Trainer.get_decay_parameter_names``)."""
    out = set()
    for mname, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            continue
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if not any(p.search(full.lower()) for p in _NO_DECAY):
                out.add(full)
    return out


def _check_not_converted(model: nn.Module) -> None:
    """A model whose layers are already streamed proxies (converted before ``get_peft_model`` wrapped it) has no
    layer weights left to adapt or train: say what to do instead."""
    if any(isinstance(m, StreamedLayer) for m in model.modules()):
        raise ValueError(
            f"this {type(model).__name__} holds a model already converted by hf_megatrain (its decoder layers are "
            "streamed proxies). Call peft.get_peft_model(model, config) on the plain model *before* handing it to "
            "MegaTrainEngine / MegaTrainTrainer / MegaTrainPlugin; an existing engine is reused by passing "
            "engine.model (or the engine) itself.")


def _check_plain_head(model: nn.Module) -> None:
    """The chunked loss multiplies by ``lm_head.weight`` (+ bias): an adapter wrapped around lm_head (LoRA on it)
    would be silently skipped, so refuse it."""
    head = model.get_output_embeddings()
    # (the family's own head parameters -- Dory's learned logit scale -- are trained: its forward runs per chunk)
    own = set(head_module_params(head))
    extra = [n for n, _ in head.named_parameters() if n not in ("weight", "bias") and n not in own]
    if extra:
        raise ValueError(
            f"the output embeddings ({type(head).__name__}) carry extra parameters {extra[:3]}: hf_megatrain computes "
            "the loss from lm_head.weight directly, so adapters on lm_head are not supported. Leave lm_head out of "
            "the PEFT target_modules (train it fully with requires_grad_(True) instead, or keep it frozen).")


@dataclass
class Converted:
    """What conversion leaves for the runtime."""

    stack: LayerStack
    plans: Plans
    store: UnitStore
    kinds: list[int]  # template index per layer
    templates: list[LayerTemplate]
    buffers: list[dict[str, torch.Tensor]]  # each layer's buffers, on the device
    persistent_buffers: list[list[str]]  # names (inside the layer) of each layer's buffers that checkpoints hold
    originals: list[nn.Module]  # the HF layers (weights freed: meta), for the proxies' plain attributes
    resident_params: dict[str, nn.Parameter]  # trainable parameters outside the layers (device working copies)
    frozen_resident: dict[str, nn.Parameter]  # frozen ones (device, compute dtype)
    peer_cells: torch.Tensor | None = None  # data parallel: [ranks, units] update counts in shared memory
    liveness: Liveness | None = None  # data parallel: this rank's watch over the host's others (parallel/liveness.py)
    shared: list[SharedParams] | None = None  # per layer: the parameters it shares with others (resident)
    attention: attention.AttentionChoice | None = None  # masked batches' attention kernel (model/attention.py)


def convert(model: nn.Module, config: MegaTrainConfig, device: torch.device, decay_names: set[str] | None,
            host_alloc: Callable[[int, torch.dtype, bool], torch.Tensor] = alloc_host,
            host_available: int | None = None) -> Converted:
    """``host_alloc``: the store's host allocator (shared memory for data-parallel ranks: engine/shared_convert.py);
    ``host_available``: the host RAM the fit check measures against (default: available now)."""
    compute_dtype = config.torch_compute_dtype
    if hasattr(model, "config"):
        model.config.use_cache = False
    _check_not_converted(model)
    stack = find_layer_stack(model, config.layers_path)
    check_supported(model, stack)
    _check_plain_head(model)
    if drop_unread_kv_stores(stack.layers):  # (Gemma 4 without KV sharing, transformers >= 5.24)
        logger.info("hf_megatrain: key/value stores no layer reads switched off (model/cross_layer.py)")
    decay = default_decay_names(model) if decay_names is None else set(decay_names)
    ul = unit_layouts(model, stack, decay)
    shape = planner.ModelShape.from_layouts(model, ul)
    plans = planner.unit_plans(shape, config, device.type, gpu_budget(device))
    logger.info("hf_megatrain: %s", plans.summary())
    planner.check_fits(shape, config, device_type=device.type, gpu_available=gpu_budget(device),
                       baseline_paid=True, plans=plans, host_available=host_available)
    chunk = planner.seq_chunk(shape, config)  # sequence tiling of the position-wise modules (0: off)
    # Before the templates copy the layers (and the config their attention reads the implementation from).
    attn = attention.choose(model, config.masked_attention, config.compiles(device.type), device.type,
                            config.micro_batch_size)
    attn = attention.apply(model, attn, forced=config.masked_attention == "flex")
    logger.info("hf_megatrain: masked batches' attention: %s", attn.reason)
    store = UnitStore(plans, ul.layouts, ul.frozen, compute_dtype=compute_dtype, device=device,
                      pin=config.pin_memory and device.type == "cuda", state_dir=config.optimizer_state_dir,
                      host_alloc=host_alloc)

    # Layers -> store + templates. One layer at a time, so peak memory grows by one layer.
    layers = stack.layers
    kinds = group_layers(layers)
    # Parameters several layers share are resident (model/shared_blocks.py); taken before ``to("meta")`` below
    # replaces the layers' parameters, so these objects keep their values.
    shared = shared_by_layer(layers)
    shared_ids = {id(p) for s in shared for p in s.values()}
    shared_first = {n: p for n, p in model.named_parameters() if id(p) in shared_ids}
    templates: dict[int, LayerTemplate] = {}
    buffers: list[dict[str, torch.Tensor]] = []
    persistent: list[list[str]] = []
    originals = list(layers)
    for i, layer in enumerate(progress_over(originals, "Converting model", lambda m: tensor_bytes(
            p for p in m.parameters() if id(p) not in shared_ids))):  # (a bar only for real, not meta, weights)
        unit = store.units[i]
        if kinds[i] not in templates:
            templates[kinds[i]] = LayerTemplate(layer, unit.params, unit.frozen_params, compile=config.compiles(device.type),
                                                seq_chunk_tokens=chunk)
        own = (p for p in layer.parameters() if id(p) not in shared_ids)  # (shared: resident, maybe real already)
        if not next(own, torch.empty(0, device="meta")).is_meta:
            for n, p in layer.named_parameters():
                if id(p) not in shared_ids:
                    store.load_(f"{stack.path}.{i}.{n}", p.detach())
        buffers.append({n: b.to(device) for n, b in layer.named_buffers()})
        persistent.append([n for n in layer.state_dict() if n in buffers[-1]])  # state_dict: persistent ones
        layer.to("meta")  # free this layer's weights now that the store holds them
        unit.refresh_compute_()

    # Resident parameters: FP32 master + a compute-dtype working copy on the device; where the plan keeps the unit
    # on the device the working parameters are views of its buffers (the optimizer's refresh updates them).
    layer_ids = {id(p) for p in layers.parameters()}
    outside = [(n, p) for n, p in model.named_parameters() if id(p) not in layer_ids] + list(shared_first.items())
    resident_params = {n: p for n, p in outside if p.requires_grad}
    frozen_resident = {n: p for n, p in outside if not p.requires_grad}
    res = store.units[-1]
    for name, p in resident_params.items():
        if not p.is_meta:
            store.load_(name, p.detach())
    res.refresh_compute_()
    for sl in res.params:
        param = resident_params[sl.name]
        if res.plan.master is Where.DEVICE:
            param.data = res.view(res.source, sl)
        else:
            param.data = torch.empty(sl.shape, dtype=compute_dtype, device=device)
    for p in {id(p): p for p in frozen_resident.values()}.values():
        if not p.is_meta:
            p.data = p.data.to(device, compute_dtype)
    if chunk > 0:  # the final norm (and any other position-wise child of the decoder module) too
        tile_positionwise(stack.parent, chunk, is_stochastic)
    for mod in model.modules():  # rotary tables and other buffers follow to the device, dtype unchanged
        for bname, b in list(mod._buffers.items()):
            if b is not None and not b.is_meta:
                mod._buffers[bname] = b.to(device)
    return Converted(stack, plans, store, kinds, [templates[k] for k in range(len(templates))], buffers, persistent,
                     originals, resident_params, frozen_resident, shared=shared, attention=attn)


def install_proxies(conv: Converted, executor: StreamingExecutor) -> None:
    """Swap each decoder layer of the model for a weightless proxy run by ``executor`` (one that also runs with a
    KV cache, for ``generate()``: engine/kv_cache.py)."""
    layers = conv.stack.layers
    for i, layer in enumerate(conv.originals):
        layers[i] = CachingStreamedLayer(executor, i, layer)
        layers[i].shared_params = conv.shared[i] if conv.shared else {}
