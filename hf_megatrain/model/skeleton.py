"""The model class a config trains as: what ``from_pretrained_streamed`` builds its skeleton with and what
``megatrain estimate`` measures, so both agree on every model a checkpoint can hold.

``AutoModelForCausalLM`` first; where its mapping does not know the config class, the class the checkpoint names in
``architectures`` (what ``save_pretrained`` wrote: ``MllamaForCausalLM`` saves its text config,
``mllama_text_model``, which no auto class maps; a ``...ForConditionalGeneration`` checkpoint names itself); then,
for a config without ``architectures`` that holds a ``text_config`` (a multimodal model built from a bare config),
``AutoModelForImageTextToText``. Anything else raises transformers' own error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layers import find_layer_stack
from .shared_blocks import shared_ids


def causal_lm_skeleton(cfg: Any, **kwargs: Any) -> nn.Module:
    """The model for ``cfg`` (``kwargs`` as ``from_config`` takes them), built wherever the caller's device
    context says (meta for a skeleton)."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(cfg, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        for arch in getattr(cfg, "architectures", None) or []:
            cls = getattr(transformers, arch, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) \
                    and isinstance(cfg, cls.config_class):
                kwargs.pop("trust_remote_code", None)
                return cls._from_config(cfg, **kwargs)
        image_text = getattr(transformers, "AutoModelForImageTextToText", None)
        if image_text is not None and getattr(cfg, "text_config", None) is not None:
            try:
                return image_text.from_config(cfg, **kwargs)
            except ValueError:
                pass
        raise


def materialize_resident(model: nn.Module, layers_path: str | None) -> None:
    """Give the meta parameters outside the decoder stack, and those its layers share (resident:
    model/shared_blocks.py), real (empty) host storage, keeping ties; the decoder layers' stay meta (the store
    holds their weights: filled from a checkpoint, or from another process's)."""
    layers = find_layer_stack(model, layers_path).layers
    layer_ids = {id(p) for p in layers.parameters()} - shared_ids(layers)
    new: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta or id(p) in layer_ids:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
            mod._parameters[name] = new[id(p)]
