"""PEFT's adapter on/off switch, reaching the streamed layers.

``PeftModel.disable_adapter()`` (and ``base_model.disable_adapter_layers()`` / ``enable_adapter_layers()``) flip a
flag on every tuner layer PEFT finds by walking ``model.modules()``. In a converted model the decoder layers are
weightless proxies; their tuner layers live in the executor's layer templates (model/template.py), which that walk
never reaches. Without this module, "adapters disabled" would still run the streamed layers' adapters, in silence:
TRL's DPO reference log-probabilities (the base with adapters disabled) would be the policy's.

``follow_adapter_switches(engine)`` makes the tuner model of a converted PEFT model flip the templates' tuner
layers too, through PEFT's own ``enable_adapters`` (so the flag and the requires-grad bookkeeping are PEFT's).
Only the two public switches are followed; switching the *active* adapter (``set_adapter``) after conversion is
refused there, because the engine decided which adapter parameters are trained when it converted the model.

PEFT is imported lazily (an integration; the core never imports it).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch import nn

from ..core.engine_view import EngineView
from ..export.peft_support import is_peft_model

_FOLLOWING = "_megatrain_follows_adapter_switches"  # set on the tuner model once patched


def _tuner_layers(modules: list[nn.Module]) -> Iterator[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:  # (PEFT's wrapper of modules_to_save / trainable tokens, switched by the same walk in PEFT)
        from peft.utils.other import AuxiliaryTrainingWrapper
        kinds: tuple[type, ...] = (BaseTunerLayer, AuxiliaryTrainingWrapper)
    except ImportError:  # older PEFT
        kinds = (BaseTunerLayer,)
    for root in modules:
        for m in root.modules():
            if isinstance(m, kinds):
                yield m


def follows_adapter_switches(engine: EngineView) -> bool:
    """Whether ``engine.model`` is a PEFT model whose adapter switches reach the streamed layers."""
    model = engine.model
    return is_peft_model(model) and (getattr(model.base_model, _FOLLOWING, False)
                                     or model.active_peft_config.is_prompt_learning)


def follow_adapter_switches(engine: EngineView) -> bool:
    """Patch ``engine.model``'s tuner model (a PEFT LoRA-style model) so its adapter switches reach the streamed
    layers' templates. Returns whether the model is a PEFT model (and now follows); idempotent."""
    model = engine.model
    if not is_peft_model(model):
        return False
    tuner = model.base_model
    if getattr(tuner, _FOLLOWING, False):
        return True
    if model.active_peft_config.is_prompt_learning:  # (its switch swaps forwards; no tuner layer to reach)
        return True
    templates = list({id(t): t for t in engine.layer_templates()}.values())  # (layers of one kind share one)

    def switched(original: Callable[..., Any], enabled: bool) -> Callable[..., Any]:
        def switch(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            for layer in _tuner_layers(templates):
                layer.enable_adapters(enabled)
            return out
        return switch

    def set_adapter(adapter_name: Any, *args: Any, **kwargs: Any) -> Any:
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        if names != list(model.active_adapters):
            raise NotImplementedError(
                f"hf_megatrain: switching the active adapter to {adapter_name!r} after conversion is not supported "
                f"(the engine trains the adapter that was active when it converted the model: "
                f"{model.active_adapters}). Activate the adapter before handing the model to hf_megatrain.")
        return original_set_adapter(adapter_name, *args, **kwargs)

    def get_model_status() -> Any:
        # (PeftModel.disable_adapter asks it first; it walks the modules too and finds no tuner layer in a model
        # whose every adapter is in a streamed layer: show it the templates in the layers' places meanwhile)
        layers = engine.stack.layers
        proxies = list(layers)
        try:
            for i, template in enumerate(engine.layer_templates()):
                layers[i] = template
            return original_status()
        finally:
            for i, proxy in enumerate(proxies):
                layers[i] = proxy

    original_set_adapter, original_status = tuner.set_adapter, model.get_model_status
    model.get_model_status = get_model_status
    tuner.disable_adapter_layers = switched(tuner.disable_adapter_layers, False)
    tuner.enable_adapter_layers = switched(tuner.enable_adapter_layers, True)
    tuner.set_adapter = set_adapter
    setattr(tuner, _FOLLOWING, True)
    return True
