"""The converted HF model presents its real weights: ``save_pretrained``, ``state_dict``, ``named_parameters``.

After conversion the decoder layers of ``engine.model`` are weightless ``StreamedLayer`` proxies and the weights
live in the engine's store. Left alone, the plain ``nn.Module`` / ``PreTrainedModel`` methods would see only the
resident parts (embeddings, final norm, lm_head): ``trainer.model.save_pretrained(dir)`` would write a checkpoint
without a single layer (``from_pretrained`` then initialises them at random, with a mere warning) and
``state_dict()`` / ``named_parameters()`` would silently describe a partial model. ``present_weights`` gives the
converted model these methods as instance attributes (class, class name and ``isinstance`` stay HF's):

- ``save_pretrained(dir)``: the one export path, ``export.export_model`` (the standard sharded checkpoint streamed
  from the FP32 masters, or the PEFT adapter folder), so plain ``from_pretrained`` gets the trained weights;
- ``state_dict()``: every tensor that export writes (FP32 masters, frozen parameters, persistent buffers) plus tied
  aliases, by HF name; references to the live tensors, as in torch (no copy of the model);
- ``load_state_dict(sd, strict=True)``: the same names back into the masters (a tied alias into its source), frozen
  parameters and buffers, then every compute copy refreshed; ``strict=False`` reports missing / unexpected keys as
  torch does. Plain ``nn.Module.load_state_dict`` would load the resident parts only and call every layer key
  "unexpected", which ``strict=False`` callers never read;
- ``get_parameter(name)``: a streamed layer's parameter (its FP32 master, as ``named_parameters`` gives it) by name;
- ``named_parameters()`` / ``parameters()`` (and what is built on them: ``num_parameters``, ``device``, ``dtype``):
  every parameter in model order. Streamed layers' entries are their FP32 masters (``nn.Parameter`` sharing the host
  store's memory; ``.grad`` is the FP32 host gradient buffer where the plan keeps one, complete once
  ``optimizer.step()`` landed it), resident ones are the module's own device parameters (compute dtype), so
  ``model.device`` / ``model.dtype`` keep meaning where and in what the model computes. Values are final: the
  resident unit is published before the first entry and every update in flight finishes before the first layer
  entry (lazily, so ``next(model.parameters())`` never waits for the layers' optimizer).
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from .proxy import StreamedLayer
from ..core.engine_view import EngineView
from ..core.step_state import StepState
from ..export.weights import export_model, model_tensors
from ..export.peft_support import adapter_key_aliases, is_peft_model


@runtime_checkable
class PresentingEngine(EngineView, Protocol):
    """What the presented methods read of the engine (``engine/runtime.py`` ``MegaTrainEngine`` satisfies it): the
    ``EngineView`` plus the parameters outside the layers and what makes values final before they are read. Typed
    here, not as the engine's class, so this module stays below the runtime that calls it."""

    resident_params: dict[str, nn.Parameter]  # trainable parameters outside the layers (device working copies)
    frozen_resident: dict[str, nn.Parameter]  # frozen ones (device, compute dtype)
    state: StepState  # the units' lifecycle: ``wait_all`` before a layer's master is read

    def publish_resident(self) -> None:
        """The resident unit's finished masters into its device working parameters."""
        ...

    def widen_gradients(self) -> None:
        """Every narrow host gradient made FP32 in place, for readers of ``.grad``."""
        ...

# HF / PEFT save_pretrained arguments that are accepted at their default value (anything else is refused).
_ACCEPTED_DEFAULTS: dict[str, Any] = {"variant": None, "token": None, "save_peft_format": True,
                                      "save_original_format": True, "distributed_checkpoint": False,
                                      "safe_serialization": True}


LayerParams = list[list[tuple[str, nn.Parameter, "torch.Tensor | None"]]]  # per layer: (local name, param, grad)


def _layer_parameters(engine: PresentingEngine) -> LayerParams:
    """Per streamed layer, (name inside the layer, parameter, its gradient buffer) in the layer's own order:
    trainable parameters are their FP32 masters, frozen ones the compute-dtype host copy, all sharing the store's
    memory; the gradient is the unit's FP32 host buffer where the plan keeps one beside the master, else None."""
    out, templates = [], engine.layer_templates()
    for i, unit in enumerate(engine.layer_units):
        by_local: dict[str, tuple[nn.Parameter, torch.Tensor | None]] = {}
        keeps_grad = unit.grad is not None and unit.plan.grad is unit.plan.master
        for p in unit.params:
            by_local[p.local] = (nn.Parameter(unit.view(unit.master, p), requires_grad=True),
                                 unit.view(unit.grad, p) if keeps_grad else None)
        for p in unit.frozen_params:
            by_local[p.local] = (nn.Parameter(unit.view(unit.frozen, p), requires_grad=False), None)
        by_local.update({n: (p, None) for n, p in _shared_of(engine, i).items()})  # (resident: their own .grad)
        template = templates[i]
        order = [n for n, _ in template.named_parameters()]
        out.append([(n, *by_local[n]) for n in order if n in by_local])
    return out


def _named_parameters(engine: PresentingEngine, layers: LayerParams, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
    """``nn.Module.named_parameters`` of the converted model (see the module docstring); a generator, so each wait
    happens only when the caller gets that far."""
    model = engine.model
    engine.publish_resident()
    if not recurse:
        yield from type(model).named_parameters(model, prefix, recurse, remove_duplicate)
        return
    seen: set[int] = set()
    waited = False
    for mname, mod in model.named_modules(prefix=prefix, remove_duplicate=remove_duplicate):
        if isinstance(mod, StreamedLayer):
            if not waited:  # every layer's update of the last step is final before its master is read
                engine.state.wait_all()
                engine.widen_gradients()  # (.grad is FP32)
                waited = True
            named = []
            for n, p, grad in layers[mod.index]:
                if grad is not None:
                    p.grad = grad  # (again: a tool may have set it to None)
                named.append((n, p))
        else:
            named = [(n, p) for n, p in mod._parameters.items() if p is not None]
        for n, p in named:
            if remove_duplicate:
                if id(p) in seen:
                    continue
                seen.add(id(p))
            yield (f"{mname}.{n}" if mname else n), p


def _state_dict(engine: PresentingEngine, *args: Any, destination: dict | None = None, prefix: str = "",
                keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``nn.Module.state_dict`` semantics (also when a wrapper module recurses into this one with ``destination``
    and ``prefix``), values from the export's tensors."""
    if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
        destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args):])[:3]
    out: dict[str, torch.Tensor] = OrderedDict() if destination is None else destination
    tensors = dict(model_tensors(engine))  # waits for updates in flight
    for name, t in tensors.items():
        out[prefix + name] = t.detach()
    # Tied aliases (lm_head.weight = embed_tokens.weight): the export writes one name, torch lists both.
    for name, src in _aliases(engine).items():
        if name not in tensors and src in tensors:
            out[prefix + name] = tensors[src].detach()
    return out


def _aliases(engine: PresentingEngine) -> dict[str, str]:
    """Tied names the store holds once: alias -> the name its master is kept under."""
    model = engine.model
    first = {id(p): n for n, p in {**engine.resident_params, **engine.frozen_resident}.items()}
    named = dict(type(model).state_dict(model, keep_vars=True))
    for i in range(len(engine.layer_units)):  # a block several layers share: each use's names
        named.update({f"{engine.stack.path}.{i}.{n}": p for n, p in _shared_of(engine, i).items()})
    return {name: first[id(t)] for name, t in named.items() if id(t) in first and first[id(t)] != name}


def _shared_of(engine: PresentingEngine, index: int) -> dict[str, nn.Parameter]:
    """The parameters streamed layer ``index`` shares with other layers, by name inside it (resident parameters:
    model/shared_blocks.py)."""
    return getattr(engine.stack.layers[index], "shared_params", {})


def _load_state_dict(engine: PresentingEngine, state_dict: dict[str, torch.Tensor], strict: bool = True,
                     assign: bool = False) -> Any:
    """``nn.Module.load_state_dict`` over what ``state_dict()`` presents (moments untouched, as in torch)."""
    from torch.nn.modules.module import _IncompatibleKeys

    if assign:
        raise ValueError("hf_megatrain: load_state_dict(assign=True) is not supported on a converted model (its "
                         "weights live in the engine's host store); load without assign")
    expected = set(_state_dict(engine))  # (waits for updates in flight)
    aliases, store, sink = {**adapter_key_aliases(engine), **_aliases(engine)}, engine.store, extra_sink(engine)

    def in_store(name: str) -> bool:
        src = aliases.get(name, name)
        return src in store.by_name or src in store.frozen_by_name

    unexpected = [n for n in state_dict if not in_store(n) and n not in sink.names]
    given = {aliases.get(n, n) for n in state_dict} | set(state_dict)
    missing = sorted(n for n in expected if n not in given and aliases.get(n, n) not in given)
    if strict and (missing or unexpected):  # checked before anything is written: nothing half-loaded
        raise RuntimeError(f"Error(s) in loading state_dict for {type(engine.model).__name__}: missing keys "
                           f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected keys "
                           f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; nothing was loaded")
    slices = {**store.by_name, **store.frozen_by_name}
    wrong = [f"{n}: {tuple(t.shape)} != {slices[aliases.get(n, n)][1].shape}" for n, t in state_dict.items()
             if in_store(n) and tuple(t.shape) != slices[aliases.get(n, n)][1].shape]
    if wrong:  # (torch refuses a size mismatch whatever ``strict`` says)
        raise RuntimeError(f"Error(s) in loading state_dict for {type(engine.model).__name__}: size mismatch "
                           f"{wrong[:4]}; nothing was loaded")
    with torch.no_grad():
        for name, t in state_dict.items():
            if in_store(name):
                store.load_(aliases.get(name, name), t)
            elif name in sink.names:
                sink(name, t)
    engine.sync_device_()
    return _IncompatibleKeys(missing, unexpected)


def _save_pretrained(engine: PresentingEngine, save_directory: str, is_main_process: bool = True,
                     state_dict: dict | None = None, push_to_hub: bool = False, max_shard_size: int | str | None = None,
                     *, dtype: torch.dtype | str | None = None, **kwargs: Any) -> list[str]:
    """``save_pretrained`` of the converted model: ``export_model`` (the files ``trainer.save_model()`` writes).
    ``dtype`` defaults to the config's ``save_dtype``; returns the files written."""
    if state_dict is not None:
        raise ValueError("hf_megatrain: save_pretrained(state_dict=...) is not supported on a converted model: it "
                         "exports its FP32 masters itself. Call save_pretrained(dir) without state_dict (or "
                         "trainer.save_model(dir)).")
    if push_to_hub:
        raise ValueError("hf_megatrain: save_pretrained(push_to_hub=True) is not supported on a converted model. "
                         "Use trainer.push_to_hub(), or save_pretrained(dir) then huggingface_hub.upload_folder.")
    peft = is_peft_model(engine.model)
    if kwargs.get("safe_serialization", True) is False:
        raise ValueError("hf_megatrain exports safetensors only; drop safe_serialization=False")
    kwargs.pop("safe_serialization", None)
    if not peft:
        odd = {k: v for k, v in kwargs.items() if k not in _ACCEPTED_DEFAULTS or _ACCEPTED_DEFAULTS[k] != v}
        if odd:
            raise TypeError(f"hf_megatrain: save_pretrained of a converted model does not support {sorted(odd)}; "
                            f"it takes save_directory, max_shard_size and dtype")
        kwargs = {}
    if not is_main_process:
        return []
    return export_model(engine, save_directory, dtype=dtype, max_shard_size=max_shard_size, adapter_kwargs=kwargs)


def present_weights(engine: PresentingEngine) -> None:
    """Give ``engine.model`` the methods of the module docstring (bound to this engine)."""
    model = engine.model
    layers = _layer_parameters(engine)

    def named_parameters(self: nn.Module, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return _named_parameters(engine, layers, prefix, recurse, remove_duplicate)

    def state_dict(self: nn.Module, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return _state_dict(engine, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def save_pretrained(self: nn.Module, save_directory: str, *args: Any, **kwargs: Any) -> list[str]:
        return _save_pretrained(engine, save_directory, *args, **kwargs)

    def load_state_dict(self: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        return _load_state_dict(engine, state_dict, strict, assign)

    def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
        # nn.Module.zero_grad walks parameters(), which would now wait for the optimizer on every step (Trainer
        # calls it each step) and touch the host gradient buffers: the streamed layers' gradients belong to the
        # step state (the optimizer's zero_grad drops them), so only the module's own parameters are cleared.
        for child in self.children():
            child.zero_grad(set_to_none)
        for p in self._parameters.values():
            if p is not None and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def get_parameter(self: nn.Module, target: str) -> nn.Parameter:
        # A streamed layer's parameter by its full name (the proxy owns none): what transformers' checkpoint
        # conversions read target shapes from (a fused projection Split into q/k/v... by the targets' sizes).
        prefix = f"{engine.stack.path}."
        if target.startswith(prefix):
            index, _, local = target[len(prefix):].partition(".")
            if index.isdigit() and int(index) < len(layers):
                for name, param, _ in layers[int(index)]:
                    if name == local:
                        return param
        return type(self).get_parameter(self, target)

    for fn in (named_parameters, state_dict, load_state_dict, save_pretrained, zero_grad, get_parameter):
        object.__setattr__(model, fn.__name__, types.MethodType(fn, model))


def extra_sink(engine: PresentingEngine):
    """Load checkpoint tensors the store does not hold (frozen params, persistent buffers, the streamed layers'
    included) into the model."""
    model = engine.model
    targets = dict(model.named_buffers())
    targets.update(engine.named_layer_buffers())  # persistent buffers of the streamed layers (on the device)
    targets.update({n: p for n, p in model.named_parameters() if n not in engine.store.by_name})
    resident = {id(p) for p in engine.resident_params.values()}

    def sink(name: str, tensor: torch.Tensor) -> bool:
        t = targets.get(name)
        if t is None:
            return False
        if id(t) not in resident and not t.is_meta:  # a tied alias of a master is already loaded
            with torch.no_grad():
                t.copy_(tensor)
        return True

    sink.names = frozenset(targets)  # type: ignore[attr-defined]  # so renamed / converted keys can reach it
    return sink
