"""ModelShape: what the planner knows of a model -- per-unit parameter counts from the engine's own unit layouts,
and the layer dimensions activations are sized from (the largest layer's, for per-layer-type configs).

Built from an HF model (the meta device is fine), from layouts the engine already computed, or from a built
engine; the memory prediction (predict.py), the step-time model (step_time.py) and ``megatrain estimate`` read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..core.engine_view import EngineView
from ..model.layers import UnitLayouts, find_layer_stack, unit_layouts
from .active import routed_inactive_numel

__all__ = ["ModelShape"]


@dataclass
class ModelShape:
    """Everything the planner needs about a model: per-unit sizes (from the unit layouts) + layer dimensions."""

    layer_numels: list[int]  # trainable parameters per streamed layer
    layer_frozen: list[int]  # frozen parameters per streamed layer (stream in the slot, no optimizer state)
    resident_numel: int  # trainable resident parameters (embeddings, final norm, lm_head; ties counted once)
    resident_frozen: int
    vocab: int
    hidden: int
    q_dim: int  # num_attention_heads * the q/k head dim (MLA: qk_nope_head_dim + qk_rope_head_dim)
    kv_dim: int  # num_key_value_heads * head_dim (MLA / v_head_dim: the mean of the k and v head dims)
    intermediate: int  # MLP width one token goes through (MoE: top_k experts + shared expert)
    max_weight: int  # largest single weight of a layer (its gradient is one transient of the recompute)
    tied: bool = False  # lm_head shares the input embedding
    # parameters of routed experts a token does not go through (active.py; 0: dense): FLOPs count the others
    routed_inactive: int = 0
    # num_attention_heads * (q/k head dim + v head dim) / 2: QK^T runs over the q/k head dim, AV over the v head dim
    # (MLA, DeepSeek-V2/V3: 192 and 128, where head_dim is the 64-wide RoPE part); 0: q_dim (the two are equal)
    attn_dim: int = 0

    @property
    def attention_dim(self) -> int:
        """The width causal attention's FLOPs scale with: 2 * attention_dim * S * T per forward."""
        return self.attn_dim or self.q_dim

    @property
    def num_layers(self) -> int:
        return len(self.layer_numels)

    @property
    def active(self) -> int:
        """Parameters one token runs through (trainable + frozen less the routed experts it is not sent to)."""
        return self.trainable + self.frozen - self.routed_inactive

    @property
    def trainable(self) -> int:
        return sum(self.layer_numels) + self.resident_numel

    @property
    def frozen(self) -> int:
        return sum(self.layer_frozen) + self.resident_frozen

    @classmethod
    def from_model(cls, model: torch.nn.Module, layers_path: str | None = None) -> "ModelShape":
        """From an HF causal LM (meta device is fine), with the engine's own layout code."""
        return cls.from_layouts(model, unit_layouts(model, find_layer_stack(model, layers_path)))

    @classmethod
    def from_layouts(cls, model: torch.nn.Module, ul: UnitLayouts) -> "ModelShape":
        """From layouts already computed (the engine's own, before it allocates: no second walk of the model)."""
        numels, frozen = ul.numels, ul.frozen_numels
        layer_weights = [math.prod(x[2]) for lay in ul.layouts[:-1] + ul.frozen[:-1] for x in lay]
        return cls._with_dims(model, numels[:-1], frozen[:-1], numels[-1], frozen[-1], max(layer_weights, default=0),
                              routed_inactive_numel([model], getattr(model, "config", None)))

    @classmethod
    def from_engine(cls, engine: EngineView) -> "ModelShape":
        units, res = engine.layer_units, engine.resident_unit
        frozen = [getattr(u, "frozen_numel", 0) for u in units]
        weights = [p.numel for u in units for p in list(u.params) + list(getattr(u, "frozen_params", []))]
        layer_modules = engine.layer_templates()  # (the layers' modules: the model keeps only proxies)
        inactive = routed_inactive_numel([engine.model, *layer_modules], getattr(engine.model, "config", None))
        return cls._with_dims(engine.model, [u.numel for u in units], frozen, res.numel,
                              getattr(res, "frozen_numel", 0), max(weights, default=0), inactive)

    @classmethod
    def _with_dims(cls, model: Any, layers: list[int], frozen: list[int], resident: int, resident_frozen: int,
                   max_weight: int, routed_inactive: int = 0) -> "ModelShape":
        cfg = getattr(model, "config", None)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        head = model.get_output_embeddings().weight
        vocab, hidden = head.shape
        tied = model.get_input_embeddings().weight is head
        # Per-layer-type configs (a per-layer intermediate_size list, head_dim overridden for some layers through
        # HF's per_layer_config): the planner plans for the largest layer, so each dimension is the largest value
        # any layer has. Every layer's own sizes still come from the unit layouts; only activations use these.
        layer_cfgs = _per_layer_configs(cfg) or [cfg]  # per-layer configs carry every value of their layer
        q_dim = kv_dim = attn = inter = 0
        for c in layer_cfgs:
            get = lambda k, d=None, c=c: _largest(_config_attr(c, k)) or d  # noqa: E731
            heads = get("num_attention_heads", max(1, hidden // 128))
            qk_dim, v_dim = _head_dims(get, hidden // heads)
            kv_heads = get("num_key_value_heads", heads)
            q_dim, kv_dim = max(q_dim, heads * qk_dim), max(kv_dim, kv_heads * (qk_dim + v_dim) // 2)
            attn = max(attn, heads * (qk_dim + v_dim) // 2)
            width = get("intermediate_size", 4 * hidden)
            if get("num_experts_per_tok") and get("moe_intermediate_size"):
                width = (get("num_experts_per_tok") * get("moe_intermediate_size")
                         + get("shared_expert_intermediate_size", 0))
            inter = max(inter, width)
        return cls(layers, frozen, resident, resident_frozen, int(vocab), int(hidden), int(q_dim), int(kv_dim),
                   int(inter), max_weight, tied, routed_inactive, int(attn) if attn != q_dim else 0)


def _head_dims(get: Any, default: int) -> tuple[int, int]:
    """(q/k head dim, v head dim) of one layer config. Multi-head latent attention (DeepSeek-V2/V3 and the models
    built on it) sets ``qk_nope_head_dim`` + ``qk_rope_head_dim`` for q and k and ``v_head_dim`` for v; its
    ``head_dim`` is the RoPE part alone (64 of 192), so it must not size the attention."""
    nope, rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    qk = nope + rope if nope and rope else get("head_dim", default)
    return qk, get("v_head_dim", qk)


def _largest(value: Any) -> int | None:
    """A config dimension as one number: an int as is; a per-layer list / tuple or per-type dict: its largest
    entry (the planner plans for the largest layer); anything else (unset, a non-number): None."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        nums = [v for v in (_largest(x) for x in value) if v is not None]
        return max(nums, default=None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return None


def _config_attr(cfg: Any, key: str) -> Any:
    """``cfg.<key>`` or None. A heterogeneous HF config raises (AmbiguousGlobalPerLayerAttributeError) on the
    global read of an attribute that varies by layer: the per-layer configs, also read, carry it then."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # noqa: BLE001 -- transformers' ambiguity error has no stable import path across versions
        return None


def _per_layer_configs(cfg: Any) -> list[Any]:
    """HF's heterogeneous configs hold one config per layer in ``per_layer_config`` (an iterable view of configs
    once built; a sparse ``{layer: {attr: value}}`` mapping in a raw one): both as attribute namespaces."""
    per = _config_attr(cfg, "per_layer_config")
    if isinstance(per, dict):  # sparse: the layers not listed have the global values
        per = [{}, *per.values()]
    elif per is not None and hasattr(per, "__iter__") and not isinstance(per, str):
        per = list(per)  # transformers' per-layer view: iterates one config per layer
    else:
        return []
    return [SimpleNamespace(**{**vars(cfg), **c}) if isinstance(c, dict) else c for c in per]
