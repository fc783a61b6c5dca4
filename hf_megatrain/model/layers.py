"""Find a model's decoder-layer stack and group its layers by structure.

hf_megatrain streams the repeated decoder layers and keeps everything else (embeddings, final norm, lm_head,
rotary tables) resident. Where the model's own structure tells us which ``nn.ModuleList`` holds the layers we
use it; no per-family table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .head_config import is_composite
from .shared_blocks import shared_ids

_SCALARS = (int, float, str, bool, type(None))
# Attributes that differ per layer but do not change what a training forward computes.
_IGNORED_ATTRS = {"layer_idx", "training"}


@dataclass(frozen=True)
class LayerStack:
    """Where the decoder layers live: ``parent.<attr>`` is the ``nn.ModuleList``; ``path`` is its dotted name."""

    parent: nn.Module
    attr: str
    path: str

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.parent, self.attr)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_layer_stack(model: nn.Module, layers_path: str | None = None) -> LayerStack:
    """Return the decoder-layer stack of ``model``.

    With ``layers_path`` ("model.layers") that exact ModuleList is used. Otherwise the ModuleList holding the most
    parameters is chosen among the lists of one layer class and the model's main layer list even where it mixes
    classes (hybrid stacks; see ``_is_stack_candidate``): the decoder stack dominates any HF decoder-only LM.
    Parameters several layers share (one block at several depths) are trained once (model/shared_blocks.py).
    """
    if layers_path:
        parent_path, _, attr = layers_path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path) if parent_path else model
            target = getattr(parent, attr)
        except AttributeError as e:
            raise ValueError(f"layers_path={layers_path!r} does not exist in {type(model).__name__}") from e
        if not isinstance(target, nn.ModuleList):
            raise ValueError(f"layers_path={layers_path!r} is a {type(target).__name__}, not an nn.ModuleList")
        return LayerStack(parent, attr, layers_path)

    best: tuple[int, str] | None = None
    within, decoder = _language_model_modules(model)
    total = max(_numel(decoder if decoder is not None else model), 1)  # (a multimodal model: its language model)
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0 or not _is_stack_candidate(model, name, module):
            continue
        if within is not None and id(module) not in within:
            continue
        size = _numel(module)
        if best is None or size > best[0]:
            best = (size, name)
    # The stack must be a real part of the model (meta models have numel too, so this also works on meta).
    if best is None or best[0] < 0.05 * total:
        raise ValueError(
            f"hf_megatrain could not find the decoder-layer stack of {type(model).__name__}: no nn.ModuleList of "
            "decoder layers holds a large share of the parameters. Point hf_megatrain at it with "
            "MegaTrainConfig(layers_path='model.layers') (the dotted path of the nn.ModuleList of decoder layers).")
    parent_path, _, attr = best[1].rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    return LayerStack(parent, attr, best[1])


def _language_model_modules(model: nn.Module) -> tuple[set[int] | None, nn.Module | None]:
    """A multimodal model (its config holds a ``text_config``): ids of the modules of its language model
    (``get_decoder()``), where the decoder stack is looked for -- a vision tower's encoder layers may outweigh a
    small language model's, but it is the language model whose layers are streamed (model/multimodal.py) -- and
    that module. ``(None, None)`` (look everywhere) for other models, or where the language model holds no layer
    list."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # (PEFT)
    if not is_composite(base) or not callable(getattr(base, "get_decoder", None)):
        return None, None
    try:
        decoder = base.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None, None
    if not isinstance(decoder, nn.Module) or decoder is base:
        return None, None
    lists = [m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return ({id(m) for m in decoder.modules()}, decoder) if lists else (None, None)


# Attribute names HF gives its decoder-layer lists (``model.layers``, ``transformer.h``, ``transformer.blocks``...).
_STACK_NAMES = {"layers", "layer", "h", "blocks", "block", "decoder_layers"}


def _is_stack_candidate(model: nn.Module, name: str, module: nn.ModuleList) -> bool:
    """Whether ``model.<name>`` may be the decoder stack. A list of one layer class always may. A list mixing
    classes (hybrid attention / SSM stacks: Jamba, Zamba2, Bamba...) only where it is the model's main layer list:
    named like one, or a direct child of the base model. This keeps heterogeneous helper lists (a list of heads,
    the parts of one shared block) from being taken for the stack."""
    if not any(True for _ in module[0].parameters()):
        return False
    if len({type(m).__name__ for m in module}) == 1:
        return True
    parent_path, _, attr = name.rpartition(".")
    base = getattr(model, "base_model", model)
    parent = model.get_submodule(parent_path) if parent_path else model
    return attr in _STACK_NAMES or parent is base


def _attr_signature(module: nn.Module) -> tuple:
    items = []
    for mname, sub in module.named_modules():
        for k, v in sorted(vars(sub).items()):
            if k.startswith("_") or k in _IGNORED_ATTRS:
                continue
            if isinstance(v, _SCALARS) or (isinstance(v, (tuple, list)) and all(isinstance(x, _SCALARS) for x in v)):
                items.append((mname, k, repr(v)))
    return tuple(items)


def layer_signature(layer: nn.Module) -> tuple:
    """Structure key: layers with equal keys can share one stateless template."""
    # requires_grad is structure too: a template binds trainable and frozen parameters differently.
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in layer.named_buffers())
    return (type(layer).__qualname__, params, buffers, _attr_signature(layer))


def group_layers(layers: nn.ModuleList) -> list[int]:
    """Return ``kind[i]`` for each layer: layers of equal structure share a kind (and a template)."""
    kinds: dict[tuple, int] = {}
    out = []
    for layer in layers:
        out.append(kinds.setdefault(layer_signature(layer), len(kinds)))
    return out


def copy_plain_attributes(src: nn.Module, dst: nn.Module) -> None:
    """Copy public scalar attributes (``attention_type``, ``layer_idx``...) the HF loop may read off a layer: the
    instance's, and plain values its class declares (``attention_type = "sliding_attention"`` as a class
    attribute), which the proxy's own class does not have."""
    for klass in reversed(type(src).__mro__):
        if klass in nn.Module.__mro__ or isinstance(dst, klass):
            continue
        for k, v in vars(klass).items():
            if not k.startswith("_") and isinstance(v, _SCALARS) and not hasattr(dst, k):
                setattr(dst, k, v)
    for k, v in vars(src).items():
        if not k.startswith("_") and k != "training" and not isinstance(v, (nn.Module, torch.Tensor)):
            setattr(dst, k, v)


Layout = list[tuple[str, str, tuple[int, ...], bool]]  # (model name, name inside the unit, shape, decay)
FrozenLayout = list[tuple[str, str, tuple[int, ...]]]  # (model name, name inside the unit, shape)


@dataclass
class UnitLayouts:
    """What the host store holds for ``model``: one unit per decoder layer, then the resident unit (embeddings,
    final norm, lm_head); trainable and frozen (``requires_grad=False``) parameters listed apart. Pure shapes,
    so the engine (to allocate) and the planner (to predict, on a meta model) share one definition."""

    layouts: list[Layout]
    frozen: list[FrozenLayout]

    @property
    def numels(self) -> list[int]:
        return [sum(math.prod(s) for _, _, s, _ in lay) for lay in self.layouts]

    @property
    def frozen_numels(self) -> list[int]:
        return [sum(math.prod(s) for _, _, s in lay) for lay in self.frozen]


def unit_layouts(model: nn.Module, stack: LayerStack, decay: set[str] | None = None) -> UnitLayouts:
    """Unit layouts of ``model`` (works on the meta device). Parameters shared by tying appear once, under their
    first name (``named_parameters`` order), as in the store; those several layers share are resident
    (model/shared_blocks.py)."""
    decay = decay or set()
    layers = stack.layers
    shared = shared_ids(layers)
    layouts: list[Layout] = []
    frozen: list[FrozenLayout] = []
    for i, layer in enumerate(layers):
        prefix = f"{stack.path}.{i}."
        named = [(n, p) for n, p in layer.named_parameters() if id(p) not in shared]
        layouts.append([(prefix + n, n, tuple(p.shape), prefix + n in decay) for n, p in named if p.requires_grad])
        frozen.append([(prefix + n, n, tuple(p.shape)) for n, p in named if not p.requires_grad])
    layer_ids = {id(p) for p in layers.parameters()} - shared
    resident = [(n, p) for n, p in model.named_parameters() if id(p) not in layer_ids]
    layouts.append([(n, n, tuple(p.shape), n in decay) for n, p in resident if p.requires_grad])
    frozen.append([(n, n, tuple(p.shape)) for n, p in resident if not p.requires_grad])
    return UnitLayouts(layouts, frozen)
