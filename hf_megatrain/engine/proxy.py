"""The autograd side of streaming: the weightless proxy that stands in for a decoder layer, and its Function.

The HF model's own forward loop still calls ``model.layers[i](hidden, **kwargs)``; each entry is a ``StreamedLayer``
whose call is one autograd Function. Its forward runs the layer under ``no_grad`` (keeping only the boundary
activation); its backward asks the executor to recompute the layer with grad and returns the input gradient.
Autograd calls the backwards in reverse layer order, which is what lets the executor prefetch layer i-1 while
layer i recomputes. Side outputs a tap collects (MoE router logits) become extra outputs of the Function, so a
loss on them sends its gradient into that layer's recompute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..model.layers import copy_plain_attributes

if TYPE_CHECKING:
    from .executor import StreamingExecutor


class _StreamedLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, executor: StreamingExecutor, index: int, call: tuple, anchor: torch.Tensor,  # type: ignore[override]
                hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        ctx.executor, ctx.index, ctx.call = executor, index, call
        ctx.save_for_backward(hidden)
        tap = executor.tap if executor.tap is not None and executor.tap.active else None
        if tap is None:
            out = executor.forward_layer(index, hidden, call, recompute=True)
            ctx.rng = executor.last_rng
            return out
        tap.start()
        out = executor.forward_layer(index, hidden, call, recompute=True)
        ctx.rng = executor.last_rng
        side = tap.stop()
        ctx.set_materialize_grads(False)  # an unused side output (no aux loss) costs no gradient
        return (out, *side)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, *side_grads: torch.Tensor | None):  # type: ignore[override]
        (hidden,) = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(hidden)
        grad_in = ctx.executor.backward_layer(ctx.index, hidden, ctx.call, grad_out, side_grads, ctx.rng)
        return None, None, None, None, grad_in


class StreamedLayer(nn.Module):
    """Stands in for decoder layer ``index`` inside the HF model; owns no weights."""

    def __init__(self, executor: StreamingExecutor, index: int, original: nn.Module) -> None:
        super().__init__()
        copy_plain_attributes(original, self)
        self.index = index
        self._executor = [executor]  # a list keeps it out of the module tree

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ex = self._executor[0]
        call = (args, kwargs)
        tap = ex.tap if ex.tap is not None and ex.tap.active else None
        if torch.is_grad_enabled():
            out = _StreamedLayerFunction.apply(ex, self.index, call, ex.grad_anchor, hidden_states)
            if tap is None:
                return out
            tap.record(out[1:])
            return out[0]
        if tap is not None:
            tap.start()
        out = ex.forward_layer(self.index, hidden_states, call)
        if tap is not None:
            tap.record(tap.stop())
        return out
