"""LayerTemplate: one stateless GPU module per distinct decoder-layer structure.

The template owns no weights: its parameters live on the meta device and each call binds views into a GPU
slot buffer (``torch.func.functional_call``), so running layer i means "bind slot views, run". No autograd
graph outlives the call that built it: the forward runs under ``no_grad`` and the backward recomputes.

A slot holds the unit's trainable weights first, then its frozen ones (PEFT base, frozen layers): trainable views
become leaves with ``.grad`` in the backward, frozen views stay plain tensors.

``compile``: run the call through ``torch.compile`` (inductor), which fuses the layer's elementwise work (RMSNorm
in FP32, rotary embeddings, SiLU-gating, residual adds) into a few kernels; at 14B width and 32k tokens that work
is ~20% of the GPU step in eager mode. The compiled graph takes the bound views as inputs, so one compilation
serves every layer of a kind; a call dynamo cannot trace falls back to eager once, with a warning. The batch and
token dimensions of the inputs are dynamic (core/compiling.py): one graph serves every sequence length, padded or
packed, and a recompile limit is never hit in silence.

``seq_chunk_tokens`` > 0: the template's position-wise children (MLP, norms) run over sequence chunks of that many
tokens, forward and backward (model/seq_tiling.py); ``tiling`` reports what was tiled and what was left whole.

``stochastic`` says whether the layer draws random numbers in training mode (dropout, attention dropout, MoE
router jitter): the executor then replays the forward's RNG state in the recompute, so both see the same masks.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ..core.compiling import CompiledCall, is_concurrent_trace, mark_token_dims
from ..core.store import ParamSlice
from .seq_tiling import TilingReport, tile_positionwise
from .shared_blocks import take_shared

logger = logging.getLogger(__name__)


def is_stochastic(module: nn.Module) -> bool:
    """True when ``module`` in training mode consumes random numbers (dropout, attention dropout, router jitter)."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for attr in ("attention_dropout", "dropout", "router_jitter_noise", "jitter_noise"):
            v = getattr(m, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return True
    return False


class LayerTemplate:
    def __init__(self, layer: nn.Module, layout: list[ParamSlice], frozen: list[ParamSlice] | None = None,
                 compile: bool = False, seq_chunk_tokens: int = 0) -> None:
        self.module = copy.deepcopy(layer).to("meta")
        self.layout = layout  # same order as the unit's flat buffer
        self.frozen = frozen or []  # offsets into the unit's frozen buffer, stored after ``numel`` in a slot
        self.numel = sum(p.numel for p in layout)
        self.frozen_numel = sum(p.numel for p in self.frozen)
        self.stochastic = is_stochastic(self.module)
        self.tiling = (tile_positionwise(self.module, seq_chunk_tokens, is_stochastic) if seq_chunk_tokens > 0
                       else TilingReport())
        self.compiled = (CompiledCall(self._functional, self._functional, f"torch.compile of {type(layer).__name__}",
                                      logger.warning) if compile else None)

    def bind(self, flat: torch.Tensor, requires_grad: bool = False, frozen: bool = True) -> dict[str, torch.Tensor]:
        """Views into ``flat`` [>= numel (+ frozen_numel)] named like the layer's parameters: trainable ones (leaves
        when ``requires_grad``), then, with ``frozen``, the frozen ones that follow them in the slot."""
        out = {}
        for p in self.layout:
            v = flat[p.offset:p.offset + p.numel].view(p.shape)
            out[p.local] = v.detach().requires_grad_() if requires_grad else v
        if frozen:
            base = self.numel
            for p in self.frozen:
                out[p.local] = flat[base + p.offset:base + p.offset + p.numel].view(p.shape)
        return out

    def __call__(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], training: bool,
                 args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.module.training != training:
            self.module.train(training)
        params, kwargs = take_shared(params, kwargs)  # (parameters several layers share: model/shared_blocks.py)
        tensors = {**params, **buffers}
        if self.compiled is not None:
            # A failure may come after part of the compiled call ran (a graph break) and drew random numbers: the
            # eager rerun starts from the same RNG state, as the backward's recompute will.
            rng = self._rng_state() if self.stochastic and training else None
            try:
                h = args[0]  # the hidden state [batch, tokens, hidden]: its two leading sizes vary between calls
                if isinstance(h, torch.Tensor) and h.dim() >= 2:
                    mark_token_dims(h.shape[0], h.shape[1], (args, kwargs))
                return self.compiled(tensors, args, kwargs)
            except Exception as e:  # noqa: BLE001 - any tracing/codegen failure: eager is always correct
                if rng is not None:
                    self._set_rng_state(rng)
                if is_concurrent_trace(e):  # (an optimizer worker is compiling: this call eagerly, then again)
                    return self._functional(tensors, args, kwargs)
                logger.warning("hf_megatrain: torch.compile of %s failed (%s: %s); running it eagerly",
                               type(self.module).__name__, type(e).__name__, str(e).splitlines()[0][:200])
                self.compiled = None
        return self._functional(tensors, args, kwargs)

    @staticmethod
    def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return torch.get_rng_state(), (torch.cuda.get_rng_state() if cuda else None)

    @staticmethod
    def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    def _functional(self, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict[str, Any]) -> Any:
        return functional_call(self.module, tensors, args, kwargs, tie_weights=False, strict=False)
