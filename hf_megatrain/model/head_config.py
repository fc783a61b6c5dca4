"""Head extras as configs spell them: one table of aliases, and a refusal for the ones hf_megatrain does not apply.

hf_megatrain replaces ``*ForCausalLM.forward`` (lm_head + loss), so whatever that forward applies after the decoder
must be applied by ``families.ModelHead``. Families name the same extra differently (Gemma
``final_logit_softcapping``, RecurrentGemma ``logits_soft_cap``, xLSTM ``output_logit_soft_cap``; Cohere
``logit_scale``, Falcon-H1 ``lm_head_multiplier``; Granite ``logits_scaling``; Mixtral ``router_aux_loss_coef``,
JetMoe ``aux_loss_coef``...). Each extra is resolved here through its aliases; a config attribute that looks like a
head extra but is in no table (Bamba's ``z_loss_coefficient``, a new family's name) and is set to an active value
is refused at conversion, naming it: silently training without it would give another loss than plain HF.

Heads that do more than ``weight @ h (+ bias)`` (issue 32): parameters of the output embeddings besides the
projection (``head_module_params``: the loss runs the head's forward per chunk), head transforms before it and MoE
aux-loss functions hf_megatrain cannot call (``own_forward_reason``: the model's own forward runs up to the
projection's input, model/multimodal.py), further layer stacks (``other_layer_lists``: refused as multi-stack), and
the own-loss forms a forward computes that hf_megatrain reproduces (``OWN_LOSS_FORMS``) or refuses (``NOT_CAUSAL_LM``).
"""

from __future__ import annotations

import re
from typing import Any

# extra -> the config attribute names that mean it, with the same semantics in every family listed.
HEAD_ALIASES: dict[str, tuple[str, ...]] = {
    # logits = tanh(logits / cap) * cap
    "softcap": ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"),
    # logits = lm_head(h) * s
    "scale_mul": ("logit_scale", "lm_head_multiplier", "output_multiplier"),
    # logits = lm_head(h) / s  (or lm_head(h / s))
    "scale_div": ("logits_scaling", "logits_mup_width_multiplier"),
    # loss += coef * load_balancing_loss(router_logits)
    "router_coef": ("router_aux_loss_coef", "aux_loss_coef"),
}

# Names matching the pattern that HF applies *inside* the decoder (attention, MLP, embeddings, routers), which
# hf_megatrain runs as HF's own modules: nothing to do at the head.
IN_DECODER = frozenset({
    "attn_logit_softcapping", "moe_router_logit_softcapping", "mlp_up_softcap", "mlp_gate_softcap",
    "gate_soft_cap", "output_router_logits",
    # DeepSeek-V2/V3's Hub configs: transformers' own deepseek_v2/v3 never read it; DeepSeek's remote code adds that
    # loss inside the MoE layer (AddAuxiliaryLoss on the layer output), not at the head.
    "aux_loss_alpha",
})

# What looks like a head extra by its name: soft-caps, logit scales / multipliers, auxiliary / z losses.
_HEAD_LIKE = re.compile(r"soft_?cap|logits?_(scale|scaling|multiplier)|(output|lm_head|logits?)_multiplier|"
                        r"aux_loss|z_loss")


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def text_config_of(cfg: Any) -> Any:
    try:
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    except ValueError:  # several text configs (encoder-decoder audio models): check_supported refuses those
        return cfg


def is_composite(model: Any) -> bool:
    """Whether ``model``'s config holds its language model's config as a sub-config (``text_config``): a
    multimodal model (model/multimodal.py), whose forward does more than its language model's."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "get_text_config"):
        return False
    try:
        text = cfg.get_text_config()
    except ValueError:  # several text configs (encoder-decoder audio models): refused elsewhere
        return False
    return text is not None and text is not cfg


def _config_items(cfg: Any) -> dict[str, Any]:
    """Public instance attributes of ``cfg`` (an HF config or any namespace)."""
    if cfg is None:
        return {}
    items = dict(vars(cfg))
    return {k: v for k, v in items.items() if not k.startswith("_")}


def head_value(model: Any, extra: str) -> tuple[str, float] | None:
    """``(attribute, value)`` of ``extra`` for ``model``: the first alias set to a number on the model itself (HF
    copies some onto it) or its text config; None when no alias is set. Two aliases set to different values are
    refused (which one HF reads would depend on the family)."""
    cfg = text_config_of(getattr(model, "config", None))
    found: dict[str, float] = {}
    for name in HEAD_ALIASES[extra]:
        for owner in (cfg, model):
            v = _number(getattr(owner, name, None))
            if v is not None:
                found.setdefault(name, v)
    if len(set(found.values())) > 1:
        raise ValueError(
            f"{type(model).__name__} sets {', '.join(f'{k}={v}' for k, v in found.items())}: these all mean the "
            f"same head extra ({extra}) and hf_megatrain cannot tell which one this family applies. Keep one.")
    return next(iter(found.items()), None)


def _inert(name: str, value: Any) -> bool:
    """Values that leave the head unchanged: unset, off, zero, or a multiplier / scale of one."""
    if value is None or value is False or value == 0:
        return True
    if re.search(r"multiplier|scale|scaling", name) and _number(value) == 1.0:
        return True
    return False


def check_head_extras(model: Any) -> None:
    """Refuse ``model`` when its config sets a head-extra-like attribute that hf_megatrain does not apply."""
    known = {n for names in HEAD_ALIASES.values() for n in names} | IN_DECODER
    cfg = getattr(model, "config", None)
    for owner in {id(c): c for c in (cfg, text_config_of(cfg))}.values():
        for name, value in _config_items(owner).items():
            if name in known or not _HEAD_LIKE.search(name) or _inert(name, value):
                continue
            raise NotImplementedError(
                f"{type(model).__name__}: config.{name}={value!r} looks like an extra applied at the model's head "
                "(logit soft-capping / scaling, an auxiliary loss), which hf_megatrain does not apply: training "
                f"would silently compute another loss than plain transformers. Set config.{name} to its neutral "
                "value (None / 0) to train without it, or add its meaning to hf_megatrain/model/head_config.py "
                "HEAD_ALIASES if it is one of the extras listed there under another name.")


# -- heads whose forward does more than ``weight @ h (+ bias)`` ---------------------------------------------------
# Parameter names an adapter library puts inside a module it wraps (PEFT's LoRA / modules_to_save): such a head is
# an adapter, not the family's own head; engine/conversion_plan.py refuses it.
_ADAPTER_MARKS = ("lora_", "modules_to_save", "original_module", "base_layer")


def head_module_params(head: Any) -> list[str]:
    """Names of the output embeddings' own parameters besides ``weight`` / ``bias`` (Dory's learned per-token
    ``logit_scale``): its forward applies them to the logits, so the loss runs that forward per chunk
    (loss.py ``module_cross_entropy``). Empty for a plain projection, and for an adapter-wrapped head."""
    names = [n for n, _ in head.named_parameters()]
    if any(mark in n for n in names for mark in _ADAPTER_MARKS):
        return []
    return [n for n in names if n not in ("weight", "bias")]


def head_transforms(model: Any, decoder: Any) -> list[Any]:
    """The model's direct children other than the one holding ``decoder`` (the module that owns the layer stack)
    and other than the output embeddings themselves, that hold parameters: what its forward applies between the
    decoder's last hidden state and the projection (ModernBERT-decoder's ``lm_head``: dense -> act -> norm before
    ``decoder``). A child that contains the output embeddings (a head module wrapping transform and projection)
    counts too. The model's own forward applies them (``own_forward_reason``)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    out = []
    for child in model.children():
        if child is head or any(m is decoder for m in child.modules()):
            continue
        if next(child.parameters(), None) is not None:
            out.append(child)
    return out


def aux_loss_needs_forward(model: Any) -> bool:
    """Whether the family's ``load_balancing_loss_func`` takes other arguments than transformers' usual
    ``(gate_logits, num_experts, top_k, attention_mask)`` (Doge's product-key router: ``num_keys`` too, logits
    ``[2, tokens, keys]``): hf_megatrain cannot call it itself, the model's own forward computes that aux loss."""
    import inspect
    import sys

    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if fn is None:
        return False
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return True
    return names[:4] != ["gate_logits", "num_experts", "top_k", "attention_mask"]


def _takes(module: Any, arg: str) -> bool:
    """Whether ``module``'s forward names the parameter ``arg`` (unreadable forwards: taken to)."""
    import inspect

    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return True
    return arg in params or any(p.kind is p.VAR_POSITIONAL for p in params.values())  # (a (*args, **kw) wrapper)


def embedding_owner(model: Any, decoder: Any) -> Any | None:
    """The module whose forward embeds ``input_ids`` and hands hidden states to ``decoder`` (the module that owns the
    layer stack), where ``decoder``'s own forward takes no ``input_ids``: CPM-Ant's ``CpmAntModel`` (input and segment
    embeddings, the segment-relative position bias) around its ``CpmAntEncoder``. The engine cannot call such a
    decoder on token ids: the model's own forward runs (``own_forward_reason``), with that module's parameters as
    resident parts. None where ``decoder`` embeds the ids itself (every Llama-like ``*Model``)."""
    if _takes(decoder, "input_ids"):
        return None
    for mod in model.modules():
        if any(child is decoder for child in mod.children()):
            return mod if mod is not model and _takes(mod, "input_ids") else None
    return None


def own_forward_reason(model: Any, decoder: Any) -> str | None:
    """Why the engine must run ``model``'s own forward up to lm_head's input (model/multimodal.py
    ``ModelForwardRun``: the forward's code runs unchanged, the projection's input recorded, its ``loss_function``
    neutralised) rather than only ``decoder``, the module that owns the layer stack; None where that is enough."""
    if is_composite(model):
        return "a multimodal model: its towers and projector run before the language model"
    transforms = head_transforms(model, decoder)
    if transforms:
        return (f"its forward applies {', '.join(type(m).__name__ for m in transforms)} between the decoder and the "
                "output embeddings")
    owner = embedding_owner(model, decoder)
    if owner is not None:
        return (f"{type(decoder).__name__} takes hidden states: {type(owner).__name__}'s forward embeds the input ids "
                "(and builds the masks / position biases) before it")
    if aux_loss_needs_forward(model):
        return "its MoE aux loss function takes arguments hf_megatrain does not pass: its forward computes it"
    return None


def other_layer_lists(model: Any, layers: Any, outside: set[int]) -> list[str]:
    """Dotted names of the model's non-empty ``nn.ModuleList``s, other than ``layers``, whose parameters are all
    among ``outside`` (ids of the trainable parameters the engine would not reach): further layer stacks, so a
    hierarchical / multi-stack forward (BLT's local encoder, global transformer and local decoder; HRM's H and L
    modules), not one decoder-layer stack."""
    from torch import nn

    found = []
    for name, mod in model.named_modules():
        if mod is layers or not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        ids = [id(p) for p in mod.parameters()]
        if ids and all(i in outside for i in ids) and not any(name.startswith(f"{f}.") for f in found):
            found.append(name)
    return found


# -- losses a forward computes itself -------------------------------------------------------------------------------
# transformers causal-LM classes whose forward computes its cross-entropy itself (not ``self.loss_function``) in a
# form hf_megatrain reproduces: class -> (form, the statement of its forward that computes it). The statement is
# looked up in the installed source; a forward that no longer has it is refused like any other own loss.
# ``unshifted_mean``: labels[..., i] is the target of logits[..., i] (no shift), ``-100`` ignored, the mean over the
# counted tokens of this forward (``num_items_in_batch`` not read, as that forward does not read it).
OWN_LOSS_FORMS: dict[str, tuple[str, str]] = {
    "TrOCRForCausalLM": ("unshifted_mean", "loss_fct = CrossEntropyLoss()\n"
                                           "            loss = loss_fct(logits.view(-1, self.config.vocab_size), "
                                           "labels.view(-1))"),
    "CpmAntForCausalLM": ("unshifted_mean", "loss_func = CrossEntropyLoss()\n"
                                            "            loss = loss_func(logits.view(-1, logits.size(-1)), "
                                            "labels.view(-1))"),
}

# Why the other transformers classes with an own loss are not causal decoder LMs (the refusal says so).
NOT_CAUSAL_LM: dict[str, str] = {
    "XLNetLMHeadModel": "XLNet is a permutation language model (two-stream attention over perm_mask / "
                        "target_mapping, unshifted labels), not a causal decoder LM",
    "XLMWithLMHeadModel": "XLM is a cross-lingual masked / translation LM (bidirectional attention unless "
                          "config.causal, its own prediction layer over unshifted labels, optionally an adaptive "
                          "softmax), not a causal decoder LM",
    # (transformers >= 5.24: the assistants google/gemma-4-*-assistant)
    "Gemma4AssistantForCausalLM": "a Gemma 4 assistant is a draft model for the target model's speculative "
                                  "decoding, not a language model of its own: its forward takes the target model's "
                                  "input embeddings and the keys/values of its last layers (inputs_embeds, "
                                  "shared_kv_states, which every layer attends to) and takes no labels",
    "Gemma4UnifiedAssistantForCausalLM": "a Gemma 4 assistant is a draft model for the target model's speculative "
                                         "decoding, not a language model of its own: its forward takes the target "
                                         "model's input embeddings and the keys/values of its last layers "
                                         "(inputs_embeds, shared_kv_states, which every layer attends to) and takes "
                                         "no labels",
}


def own_loss_form(model: Any) -> str | None:
    """The ``OWN_LOSS_FORMS`` form of ``model``'s class where its installed forward still computes it that way."""
    import inspect

    entry = OWN_LOSS_FORMS.get(type(model).__name__)
    if entry is None or not type(model).__module__.startswith("transformers."):
        return None
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
    return entry[0] if entry[1] in source else None
