"""One block used at several depths (Zamba2's shared transformer): one master, gradients summed over its uses.

Zamba2 ties one (or ``num_mem_blocks``) transformer block(s) into every hybrid layer of its stack: layer 0's and
layer 6's ``shared_transformer.self_attn.q_proj.weight`` are one ``nn.Parameter``. Streaming each layer with its own
copy would train separate copies. Such a parameter is trained as a resident one instead:

- layouts (``model/layers.py`` ``unit_layouts``): a parameter found in more than one layer of the stack belongs to no
  layer unit; it joins the resident unit (embeddings, final norm, lm_head) under its first name in model order
  (``model.layers.0.shared_transformer...``), so it has one FP32 master, one gradient, one AdamW update, and the
  export writes it once -- as ``save_pretrained`` writes a tied block, which ``from_pretrained`` ties back;
- the layer call (``engine/proxy.py``): the proxy of each layer using it adds the shared parameters (their device
  working copies) to the call under ``SHARED_KEY``. Floating tensors that require grad are inputs of the layer's
  autograd Function (``engine/layer_io.py``), so each use's recompute returns their gradient and autograd sums those
  over the uses into the parameter's ``.grad``; the landing adds it into the resident FP32 gradient like any
  resident parameter's (``engine/landing.py``). They are not batch rows (their leading size does not follow the
  batch), so a visit split into micro-batches passes them whole and autograd sums over the chunks too;
- the template (``model/template.py``) takes them back out of the call (``take_shared``) and binds them by their
  names inside the layer, beside the slot's views.

A shared parameter stays on the device for the whole step (it is resident): one copy instead of one stream per use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The keyword the shared parameters travel under from the proxy to the template (never reaches the HF layer).
SHARED_KEY = "_megatrain_shared_params"

SharedParams = dict[str, nn.Parameter]  # name inside the layer -> the shared parameter


def shared_ids(layers: nn.ModuleList) -> set[int]:
    """Ids of the parameters that more than one layer of ``layers`` holds."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if owner.setdefault(id(p), i) != i:
                shared.add(id(p))
    return shared


def shared_by_layer(layers: nn.ModuleList) -> list[SharedParams]:
    """Per layer: its shared parameters by every name they have inside it (empty for most layers)."""
    ids = shared_ids(layers)
    return [{n: p for n, p in layer.named_parameters(remove_duplicate=False) if id(p) in ids} for layer in layers]


def with_shared(kwargs: dict[str, Any], shared: SharedParams) -> dict[str, Any]:
    """The layer call's keyword arguments with its shared parameters added (unchanged without any)."""
    if not shared:
        return kwargs
    if SHARED_KEY in kwargs:
        raise RuntimeError(f"hf_megatrain: the decoder passed its layer a keyword {SHARED_KEY!r} (reserved)")
    return {**kwargs, SHARED_KEY: dict(shared)}


def take_shared(params: dict[str, torch.Tensor],
                kwargs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(params, kwargs)`` of a template call with the shared parameters moved from the call into the bound
    tensors (the call's own leaves: in the backward, the leaves whose gradient autograd collects)."""
    if SHARED_KEY not in kwargs:
        return params, kwargs
    kwargs = dict(kwargs)
    shared = kwargs.pop(SHARED_KEY)
    return {**params, **shared}, kwargs
