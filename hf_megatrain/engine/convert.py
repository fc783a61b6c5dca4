"""Conversion: an HF model's weights into the unit store and the layer templates, one layer at a time.

The plan is decided and the store allocated before this runs (engine/conversion_plan.py, engine/builder.py):
``convert`` copies each decoder layer's weights into its unit and keeps one weightless template per kind of layer
(model/template.py), then frees the layer (peak = store + one layer); it moves the layers' buffers to the device and
rebinds the resident parameters (embeddings, final norm, lm_head) to device copies -- views of the unit's device
buffers when its plan keeps it there. The model's decoder layers are left weightless (meta) until the builder puts
the proxies in their places.

Frozen parameters (``requires_grad=False``: a PEFT base, frozen layers) get no FP32 master or optimizer state: in
layers they stream from a compute-dtype host copy, outside layers they stay on the device in compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.plan import Plans, Where
from ..core.progress import progress_over, tensor_bytes
from ..core.store import UnitStore
from ..model import attention
from ..model.layers import LayerStack, group_layers
from ..model.seq_tiling import tile_positionwise
from ..model.shared_blocks import SharedParams, shared_by_layer
from ..model.template import LayerTemplate, is_stochastic
from ..parallel.liveness import Liveness
from .conversion_plan import ConversionPlan


@dataclass
class Converted:
    """What conversion leaves for the rest of the build (engine/builder.py) and the runtime."""

    stack: LayerStack
    plans: Plans
    store: UnitStore
    kinds: list[int]  # template index per layer
    templates: list[LayerTemplate]
    buffers: list[dict[str, torch.Tensor]]  # each layer's buffers, on the device
    persistent_buffers: list[list[str]]  # names (inside the layer) of each layer's buffers that checkpoints hold
    originals: list[nn.Module]  # the HF layers (weights freed: meta), for the proxies' plain attributes
    resident_params: dict[str, nn.Parameter]  # trainable parameters outside the layers (device working copies)
    frozen_resident: dict[str, nn.Parameter]  # frozen ones (device, compute dtype)
    peer_cells: torch.Tensor | None = None  # data parallel: [ranks, units] update counts in shared memory
    liveness: Liveness | None = None  # data parallel: this rank's watch over the host's others (parallel/liveness.py)
    shared: list[SharedParams] | None = None  # per layer: the parameters it shares with others (resident)
    attention: attention.AttentionChoice | None = None  # masked batches' attention kernel (model/attention.py)


def convert(model: nn.Module, plan: ConversionPlan, store: UnitStore, device: torch.device,
            compile: bool, show_progress: bool = True) -> Converted:
    """``model``'s weights into ``store`` (allocated from ``plan``), its layers' templates, its resident parameters
    on ``device`` in the store's compute dtype; ``compile``: the templates compile their layer's forward;
    ``show_progress``: a bar of the layers' bytes (core/progress.py; a terminal's only)."""
    stack, chunk, compute_dtype = plan.stack, plan.seq_chunk, store.compute_dtype
    # Layers -> store + templates. One layer at a time, so peak memory grows by one layer.
    layers = stack.layers
    kinds = group_layers(layers)
    # Parameters several layers share are resident (model/shared_blocks.py); taken before ``to("meta")`` below
    # replaces the layers' parameters, so these objects keep their values.
    shared = shared_by_layer(layers)
    shared_ids = {id(p) for s in shared for p in s.values()}
    shared_first = {n: p for n, p in model.named_parameters() if id(p) in shared_ids}
    templates: dict[int, LayerTemplate] = {}
    buffers: list[dict[str, torch.Tensor]] = []
    persistent: list[list[str]] = []
    originals = list(layers)
    for i, layer in enumerate(progress_over(originals, "Converting model", lambda m: tensor_bytes(
            p for p in m.parameters() if id(p) not in shared_ids), enabled=show_progress)):  # (real weights only)
        unit = store.units[i]
        if kinds[i] not in templates:
            templates[kinds[i]] = LayerTemplate(layer, unit.params, unit.frozen_params, compile=compile,
                                                seq_chunk_tokens=chunk)
        own = (p for p in layer.parameters() if id(p) not in shared_ids)  # (shared: resident, maybe real already)
        if not next(own, torch.empty(0, device="meta")).is_meta:
            for n, p in layer.named_parameters():
                if id(p) not in shared_ids:
                    store.load_(f"{stack.path}.{i}.{n}", p.detach())
        buffers.append({n: b.to(device) for n, b in layer.named_buffers()})
        persistent.append([n for n in layer.state_dict() if n in buffers[-1]])  # state_dict: persistent ones
        layer.to("meta")  # free this layer's weights now that the store holds them
        unit.refresh_compute_()

    # Resident parameters: FP32 master + a compute-dtype working copy on the device; where the plan keeps the unit
    # on the device the working parameters are views of its buffers (the optimizer's refresh updates them).
    layer_ids = {id(p) for p in layers.parameters()}
    outside = [(n, p) for n, p in model.named_parameters() if id(p) not in layer_ids] + list(shared_first.items())
    resident_params = {n: p for n, p in outside if p.requires_grad}
    frozen_resident = {n: p for n, p in outside if not p.requires_grad}
    res = store.units[-1]
    for name, p in resident_params.items():
        if not p.is_meta:
            store.load_(name, p.detach())
    res.refresh_compute_()
    for sl in res.params:
        param = resident_params[sl.name]
        if res.plan.master is Where.DEVICE:
            param.data = res.view(res.source, sl)
        else:
            param.data = torch.empty(sl.shape, dtype=compute_dtype, device=device)
    for p in {id(p): p for p in frozen_resident.values()}.values():
        if not p.is_meta:
            p.data = p.data.to(device, compute_dtype)
    if chunk > 0:  # the final norm (and any other position-wise child of the decoder module) too
        tile_positionwise(stack.parent, chunk, is_stochastic)
    for mod in model.modules():  # rotary tables and other buffers follow to the device, dtype unchanged
        for bname, b in list(mod._buffers.items()):
            if b is not None and not b.is_meta:
                mod._buffers[bname] = b.to(device)
    return Converted(stack, plan.plans, store, kinds, [templates[k] for k in range(len(templates))], buffers,
                     persistent, originals, resident_params, frozen_resident, shared=shared, attention=plan.attention)
