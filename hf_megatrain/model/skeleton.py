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


def _resident_meta(model: nn.Module, layers_path: str | None) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(qualified name, module, attribute, parameter) of each meta parameter outside the decoder stack or shared by
    its layers (resident: model/shared_blocks.py); a tied parameter once per module that holds it."""
    layers = find_layer_stack(model, layers_path).layers
    layer_ids = {id(p) for p in layers.parameters()} - shared_ids(layers)
    return [(f"{mname}.{name}" if mname else name, mod, name, p) for mname, mod in model.named_modules()
            for name, p in mod._parameters.items() if p is not None and p.is_meta and id(p) not in layer_ids]


def resident_meta_names(model: nn.Module, layers_path: str | None) -> list[str]:
    """The resident parameters (outside the decoder stack, or shared by its layers) still on the meta device."""
    return [name for name, *_ in _resident_meta(model, layers_path)]


def materialize_resident(model: nn.Module, layers_path: str | None) -> None:
    """Give the resident meta parameters (``resident_meta_names``) real (empty) host storage, keeping ties; the
    decoder layers' stay meta (the store holds their weights: filled from a checkpoint, or from another
    process's)."""
    new: dict[int, nn.Parameter] = {}
    for _, mod, name, p in _resident_meta(model, layers_path):
        if id(p) not in new:
            new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
        mod._parameters[name] = new[id(p)]
