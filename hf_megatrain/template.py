"""LayerTemplate: one stateless GPU module per distinct decoder-layer structure.

The template owns no weights: its parameters live on the meta device and each call binds views into a GPU
slot buffer (``torch.func.functional_call``), so running layer i means "bind slot views, run". No autograd
graph outlives the call that built it: the forward runs under ``no_grad`` and the backward recomputes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from .host_store import ParamSlice


class LayerTemplate:
    def __init__(self, layer: nn.Module, layout: list[ParamSlice]) -> None:
        self.module = copy.deepcopy(layer).to("meta")
        self.layout = layout  # same order as the unit's flat buffer
        self.numel = sum(p.numel for p in layout)

    def bind(self, flat: torch.Tensor, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """Views into ``flat`` [>= numel] named like the layer's parameters (leaves when ``requires_grad``)."""
        out = {}
        for p in self.layout:
            v = flat[p.offset:p.offset + p.numel].view(p.shape)
            out[p.local] = v.detach().requires_grad_() if requires_grad else v
        return out

    def __call__(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], training: bool,
                 args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.module.training != training:
            self.module.train(training)
        return functional_call(self.module, {**params, **buffers}, args, kwargs, tie_weights=False, strict=False)
