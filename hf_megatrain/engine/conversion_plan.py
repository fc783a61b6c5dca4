"""The conversion's plan: what an HF causal LM becomes, decided before anything large is allocated.

``plan_conversion`` checks that the model can be converted at all, finds its decoder-layer stack, lays out one unit
per layer and one resident unit (embeddings, final norm, lm_head; ``model.layers.unit_layouts``), builds every
unit's plan (core/plan.py) for this device's GPU budget and checks with the planner that the run fits host RAM (the
one RAM check), then picks the masked batches' attention kernel and the sequence tiling. Of the model it changes
only what the templates must see (``use_cache``, key/value stores no layer reads, the attention implementation);
its weights are untouched until the builder (engine/builder.py) allocates the store from these plans and fills it
(engine/convert.py), so a refusal here leaves a model that can still be used or handed over again.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from .. import planner
from ..config import MegaTrainConfig
from ..core.memory import available_host_bytes, gpu_budget
from ..core.plan import Plans
from ..parallel.group import DataParallel
from ..parallel.setup import data_parallel_config
from ..model import attention
from ..model.cross_layer import drop_unread_kv_stores
from ..model.families import check_row_split, check_supported
from ..model.head_config import head_module_params
from ..model.layers import LayerStack, UnitLayouts, find_layer_stack, unit_layouts
from ..planner.host_layout import LAYOUT_KEYS, auto_layout
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
class ConversionPlan:
    """What conversion will do, decided: the store is allocated from ``layouts`` and ``plans``."""

    stack: LayerStack  # where the decoder layers sit in the model
    layouts: UnitLayouts  # per unit: its trainable and frozen parameters (names, shapes, decay flags)
    plans: Plans  # per unit: where its buffers live and which stepper runs it
    seq_chunk: int  # sequence tiling of the position-wise modules (0: off)
    attention: attention.AttentionChoice  # masked batches' attention kernel (model/attention.py), applied


def host_layout_for(model: nn.Module, config: MegaTrainConfig, device: torch.device, grad_accum: int = 1,
                    dp: DataParallel | None = None) -> tuple[MegaTrainConfig, str | None]:
    """``host_layout="auto"``'s decision for this model on this machine (planner/host_layout.py ``auto_layout``):
    the config to build with and, when it switched to a lean layout, the note saying so (logged at WARNING).
    Data parallel (``dp``, one host): rank 0 decides for the node's ranks and every rank takes its decision (the
    ranks share one store: they must build the same one, whatever RAM each saw free)."""
    if config.host_layout != "auto" or config.explicit_keys & set(LAYOUT_KEYS):
        return config, None  # (before measuring anything: the user chose)
    if dp is not None and dp.nodes > 1:
        return config, None  # (the lean store is refused across hosts: parallel/setup.py)
    # The model's own refusals first, in plan_conversion's order: their messages say what to change.
    _check_not_converted(model)
    check_supported(model, find_layer_stack(model, config.layers_path))
    chosen: tuple[dict[str, object], str | None] = ({}, None)
    if dp is None or dp.rank == 0:
        shape = planner.ModelShape.from_model(model, config.layers_path)
        gpu_free = gpu_budget(device) if device.type == "cuda" else None
        out, note = auto_layout(shape, config, device.type, gpu_free, available_host_bytes(), grad_accum=grad_accum,
                                gpus=1 if dp is None else dp.local_world)
        chosen = ({k: getattr(out, k) for k in LAYOUT_KEYS} if note else {}, note)
    if dp is not None:
        chosen = dp.broadcast_object(chosen)
    keys, note = chosen
    if note:
        logger.warning("hf_megatrain: %s", note)
        config = config.resolved(**keys)
        if dp is not None:
            config = data_parallel_config(config, dp)
    return config, note


def plan_conversion(model: nn.Module, config: MegaTrainConfig, device: torch.device, decay_names: set[str] | None,
                    host_available: int | None = None, data_parallel: bool = False) -> ConversionPlan:
    """``decay_names``: the parameters weight decay applies to (None: Trainer's rule, ``default_decay_names``);
    ``host_available``: the host RAM the fit check measures against (None: available now; data-parallel ranks
    measure against what their node had before any rank allocated: engine/shared_convert.py); ``data_parallel``: one
    of several ranks (a lean store's gradient plane is then FP32: core/plan.py)."""
    if hasattr(model, "config"):
        model.config.use_cache = False
    _check_not_converted(model)
    stack = find_layer_stack(model, config.layers_path)
    check_supported(model, stack)
    check_row_split(stack.layers, config.micro_batch_size)
    _check_plain_head(model)
    if drop_unread_kv_stores(stack.layers):  # (Gemma 4 without KV sharing, transformers >= 5.24)
        logger.info("hf_megatrain: key/value stores no layer reads switched off (model/cross_layer.py)")
    decay = default_decay_names(model) if decay_names is None else set(decay_names)
    layouts = unit_layouts(model, stack, decay)
    shape = planner.ModelShape.from_layouts(model, layouts)
    plans = planner.unit_plans(shape, config, device.type, gpu_budget(device), data_parallel=data_parallel)
    logger.info("hf_megatrain: %s", plans.summary())
    planner.check_fits(shape, config, device_type=device.type, gpu_available=gpu_budget(device),
                       baseline_paid=True, plans=plans, host_available=host_available)
    chunk = planner.seq_chunk(shape, config)
    # Before the templates copy the layers (and the config their attention reads the implementation from).
    attn = attention.choose(model, config.masked_attention, config.compiles(device.type), device.type,
                            config.micro_batch_size)
    attn = attention.apply(model, attn, forced=config.masked_attention == "flex")
    logger.info("hf_megatrain: masked batches' attention: %s", attn.reason)
    return ConversionPlan(stack, layouts, plans, chunk, attn)
