"""PEFT (LoRA) on a streamed base: saving adapters and merged checkpoints from the engine's host store.

Training needs nothing PEFT-specific: ``peft.get_peft_model`` freezes the base and adds adapter parameters, and
the engine gives frozen parameters a compute-dtype copy only (core/store.py) and adapters the FP32 master and
AdamW state. What needs care is writing results, because the converted model's layers are weightless proxies:

- ``save_adapter``: the standard PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``)
  that ``PeftModel.from_pretrained(base, dir)`` loads, written by PEFT's own ``save_pretrained`` from a state
  dict of FP32 masters (store names are ``PeftModel.named_parameters()`` names, which PEFT maps to its keys).
- ``save_merged``: a plain HF checkpoint (sharded safetensors + config) of base + merged adapters. One layer at
  a time is rebuilt on the host in FP32 from the store (frozen base copy + adapter masters), merged by PEFT's
  own ``merge`` (so scaling, rsLoRA, DoRA, fan_in_fan_out are PEFT's) and written; peak extra memory is one
  shard. The base is only held in compute dtype, so a bf16 run's merged base is the bf16 base plus the delta.
- ``load_adapter_into_engine``: adapter weights from a PEFT folder into the masters (resuming, best model).

``get_peft_model`` must be called *before* the model is converted: a converted model's layers are proxies that
PEFT cannot find target modules in (the engine refuses such a model with an explanation).
PEFT is imported lazily: this module is an integration, the core never imports it.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..checkpoint.hub_layout import hub_layout
from ..core.engine_view import EngineView
from ..checkpoint.safetensors_io import (DEFAULT_MAX_SHARD_SIZE, _nbytes, _shard_files, open_safetensors, parse_size,
                                         write_json, write_safetensors)

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_peft_model(model: Any) -> bool:
    """True for a ``peft.PeftModel`` (checked without importing peft)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def _peft_model(engine: EngineView) -> nn.Module:
    if not is_peft_model(engine.model):
        raise ValueError(f"the engine's model is a {type(engine.model).__name__}, not a peft.PeftModel: call "
                         "peft.get_peft_model(model, config) before handing the model to hf_megatrain")
    return engine.model


@contextmanager
def _layers_visible(engine: EngineView) -> Iterator[None]:
    """PEFT finds adapter keys by visiting the model's tuner layers, which the converted model keeps only in its
    (meta, weightless) templates: show PEFT one meta skeleton per layer while it builds a state dict."""
    layers = engine.stack.layers
    proxies = list(layers)
    try:
        for i, template in enumerate(engine.layer_templates()):
            layers[i] = copy.deepcopy(template)
        yield
    finally:
        for i, proxy in enumerate(proxies):
            layers[i] = proxy


def _state_dict(engine: EngineView, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter by its PeftModel name: trainable masters (cast to ``dtype``), frozen values as views."""
    sd = {n: t.to(dtype) for n, t in engine.named_master_tensors()}
    sd.update({n: t for n, t in engine.named_frozen_tensors() if n not in sd})
    return sd


def save_adapter(engine: EngineView, save_dir: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> list[str]:
    """Write the PEFT adapter folder of ``engine.model`` (a PeftModel); ``kwargs`` go to ``save_pretrained``."""
    model = _peft_model(engine)
    os.makedirs(save_dir, exist_ok=True)
    before = set(os.listdir(save_dir))
    with _layers_visible(engine):
        # PEFT's own method (the converted model's save_pretrained is hf_megatrain's, which comes here).
        type(model).save_pretrained(model, save_dir, state_dict=_state_dict(engine, dtype), safe_serialization=True,
                                    **kwargs)
    return sorted(set(os.listdir(save_dir)) - before | {ADAPTER_WEIGHTS, "adapter_config.json"})


def adapter_key_aliases(engine: EngineView) -> dict[str, str]:
    """PEFT's name without the adapter segment -> the store's name, for the active adapter's parameters: what
    ``set_peft_model_state_dict`` hands ``load_state_dict`` when it cannot see the tuner layers inside streamed
    layers (it inserts the adapter name only for the modules it finds)."""
    if not is_peft_model(engine.model):
        return {}
    seg = f".{engine.model.active_adapter}."
    return {n.replace(seg, ".", 1): n for n in list(engine.store.by_name) + list(engine.store.frozen_by_name)
            if seg in n}


def load_adapter_into_engine(engine: EngineView, path: str, adapter_name: str = "default") -> None:
    """Copy the adapter weights of a PEFT folder into the engine's FP32 masters (every adapter must be present)."""
    from peft import get_peft_model_state_dict

    model = _peft_model(engine)
    masters = dict(engine.named_master_tensors())
    # PEFT's key for each master: map through its own renaming (values are passed through unchanged).
    by_key = {id(v): k for k, v in masters.items()}
    with _layers_visible(engine):
        picked = get_peft_model_state_dict(model, state_dict=masters, adapter_name=adapter_name)
    keys = {by_key[id(v)]: k for k, v in picked.items() if id(v) in by_key}
    fpath = os.path.join(path, ADAPTER_WEIGHTS)
    with open_safetensors(fpath) as f:
        present = set(f.keys())
        missing = [k for k in keys.values() if k not in present]
        if missing:
            raise ValueError(f"{fpath} lacks adapter weights of this model, e.g. {missing[:3]}")
        for name, key in keys.items():
            masters[name].copy_(f.get_tensor(key))
    engine.sync_device_()


# -- merged export ---------------------------------------------------------------------------------------------------
def _merge_unwrap(module: nn.Module) -> nn.Module:
    """Merge every PEFT tuner layer in ``module`` (a host FP32 copy) into its base layer and unwrap it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(module, BaseTunerLayer):
        module.merge()
        return module.get_base_layer()
    for name, child in list(module.named_children()):
        new = _merge_unwrap(child)
        if new is not child:
            setattr(module, name, new)
    return module


def _materialize(module: nn.Module, prefix: str, values: dict[str, torch.Tensor]) -> nn.Module:
    """An FP32 host copy of ``module`` whose parameter ``n`` holds ``values[prefix + n]``."""
    out = copy.deepcopy(module).to_empty(device="cpu").float()
    with torch.no_grad():
        for n, p in out.named_parameters(remove_duplicate=False):
            src = values.get(prefix + n)
            if src is not None:
                p.copy_(src)
    return out


def _merged_tensors(engine: EngineView) -> Iterator[tuple[str, torch.Tensor]]:
    """(base-model name, FP32 merged tensor), one layer at a time, in model order."""
    model = _peft_model(engine)
    values = _state_dict(engine, torch.float32)
    root = "base_model.model."
    strip = lambda n: n[len(root):] if n.startswith(root) else n  # noqa: E731
    stack = engine.stack
    layer_prefix = stack.path + "."
    # Parts outside the layer stack: plain parameters by name; tuner-wrapped modules (embedding LoRA) merged.
    resident_mods = {n: m for n, m in model.named_modules() if hasattr(m, "merge") and hasattr(m, "get_base_layer")
                     and not n.startswith(layer_prefix)}
    done: set[str] = set()
    for mname, mod in resident_mods.items():
        merged = _merge_unwrap(_materialize(mod, mname + ".", values))
        for n, t in merged.state_dict().items():
            yield strip(f"{mname}.{n}"), t
        done.update(f"{mname}.{n}" for n, _ in mod.named_parameters())
    for n, t in values.items():
        if not n.startswith(layer_prefix) and n not in done:
            yield strip(n), t.float()
    layer_buffers = dict(engine.named_layer_buffers())  # the layers' real buffers (the templates' are meta)
    written: set[int] = set()  # shared parameters (model/shared_blocks.py) written already
    for i, template in enumerate(engine.layer_templates()):
        prefix = f"{layer_prefix}{i}."
        shared = getattr(stack.layers[i], "shared_params", {})
        wrapped = [n for n in shared if ".base_layer." in n]
        if wrapped:  # each use has its own adapter on one weight: no single merged weight gives every use's output
            raise ValueError(
                f"hf_megatrain: a merged export cannot hold adapters on "
                f"{strip(prefix + wrapped[0].replace('.base_layer', ''))}: that weight is shared "
                "by several layers (one block at several depths) and each use has its own adapter, so merging them "
                "would change the model (PEFT's merge_and_unload adds every use's delta into the one weight). Save "
                "the adapter (save_model) instead, or leave the shared block out of target_modules.")
        merged = _merge_unwrap(_materialize(template, prefix, values))
        for n, t in merged.state_dict().items():
            if n in shared:  # written once, under its first use's name, as save_pretrained writes a tied block
                if id(shared[n]) in written:
                    continue
                written.add(id(shared[n]))
            yield strip(prefix + n), layer_buffers.get(prefix + n, t)


def save_merged(engine: EngineView, save_dir: str, dtype: torch.dtype = torch.float32,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Standard HF checkpoint of the base model with the adapters merged in (``from_pretrained`` loads it).

    Written shard by shard as layers are merged, so host memory grows by at most one shard."""
    model = _peft_model(engine)
    base = model.get_base_model()
    os.makedirs(save_dir, exist_ok=True)
    limit = parse_size(max_shard_size)
    tmp_names: list[str] = []
    weight_map: dict[str, int] = {}
    total = 0
    shard: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f".merged-shard-{len(tmp_names)}.safetensors"
            write_safetensors(os.path.join(save_dir, name), shard, dtype)
            for k, _ in shard:
                weight_map[k] = len(tmp_names)
            tmp_names.append(name)
        shard, size = [], 0

    for name, t in hub_layout(base, _merged_tensors(engine)):  # (transformers' save layout, one layer at a time)
        n = _nbytes(t, dtype)
        if shard and size + n > limit:
            flush()
        shard.append((name, t))
        size += n
        total += n
    flush()
    final = _shard_files("model", len(tmp_names))
    for tmp, fin in zip(tmp_names, final):
        os.replace(os.path.join(save_dir, tmp), os.path.join(save_dir, fin))
    files = list(final)
    if len(final) > 1:
        write_json(os.path.join(save_dir, "model.safetensors.index.json"),
                   {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}})
        files.append("model.safetensors.index.json")
    cfg = copy.deepcopy(base.config)
    cfg.dtype = str(dtype).replace("torch.", "")
    cfg.architectures = [type(base).__name__]
    cfg.use_cache = True
    cfg.save_pretrained(save_dir)
    files.append("config.json")
    gen = getattr(base, "generation_config", None)
    if gen is not None and getattr(base, "can_generate", lambda: False)():
        gen.save_pretrained(save_dir)
        files.append("generation_config.json")
    return files
