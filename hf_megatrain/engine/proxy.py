"""The autograd side of streaming: the weightless proxy that stands in for a decoder layer, and its Function.

The HF model's own forward loop still calls ``model.layers[i](hidden, **kwargs)``; each entry is a ``StreamedLayer``
whose call is one autograd Function. Its forward runs the layer under ``no_grad`` (keeping only the boundary
activation, on the device or offloaded: engine/activations.py); its backward asks the executor to recompute the
layer with grad and returns the input gradients -- except for the layers whose forward keeps its graph (the last
ones, while the GPU has room: ``saved_graph_layers``), whose backward differentiates that graph.
Autograd calls the backwards in reverse layer order, which is what lets the executor prefetch layer i-1 while
layer i recomputes.

The Function's inputs are the hidden state and every other floating tensor of the call that requires grad (a
per-layer input, the embeddings passed to each layer: each gets its gradient); its outputs are every tensor of the
layer's output (the proxy returns the layer's own structure around them: ``outputs[0]`` of a tuple-returning layer
is the hidden state, not a batch row), then the side outputs a tap collects (MoE router logits), so a loss on any
of them sends its gradient into that layer's recompute (engine/layer_io.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..model.cross_layer import MappingWatch, carry_mappings, deliver
from ..model.layers import copy_plain_attributes
from ..model.shared_blocks import SharedParams, with_shared
from .layer_io import Call, grad_positions

if TYPE_CHECKING:
    from .executor import StreamingExecutor


class _StreamedLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, executor: StreamingExecutor, index: int, call: Call, grad_pos: list[int],  # type: ignore[override]
                anchor: torch.Tensor, hidden: torch.Tensor, *extras: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.executor, ctx.index, ctx.call, ctx.grad_pos = executor, index, call, grad_pos
        # The input the backward recomputes from: saved here, or offloaded to host memory (engine/activations.py).
        ctx.saved_input = saved = executor.activations.save(index, hidden)
        if saved is not None and saved.offloaded:
            ctx.save_for_backward(*extras)
        else:
            ctx.save_for_backward(hidden, *extras)
        ctx.set_materialize_grads(False)  # an unused output (attention weights, no aux loss) costs no gradient
        tap = executor.tap if executor.tap is not None and executor.tap.active else None
        if tap is not None:
            tap.start()
        # A layer chosen to keep its graph (executor.graph_layers) runs with grad now; its backward takes that
        # graph instead of recomputing (the saved input stays for a second backward, which recomputes).
        ctx.graph = None
        if executor.keeps_graph(index, hidden):
            tensors, layout, ctx.graph = executor.forward_layer_saving(index, hidden, call, grad_pos,
                                                                       ctx.needs_input_grad[5:])
        else:
            tensors, layout = executor.forward_layer(index, hidden, call, recompute=True)
        ctx.rng = executor.last_rng
        side = tap.stop() if tap is not None else []
        if ctx.graph is not None:
            ctx.graph.side, side = side, [t.detach() for t in side]
        ctx.layout, ctx.num_out = layout, len(tensors)  # (the layout holds no tensor: nothing kept alive)
        executor.last_layout = layout  # read by the proxy to rebuild the layer's output
        # Fresh aliases: a tensor the layer passed through from its call (a mask, rotary tables) would otherwise get
        # this Function as its grad_fn in place, and requires_grad with it, for every later user of it.
        tensors = [t.detach() for t in tensors]
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return (*tensors, *side)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        saved, acts = ctx.saved_input, ctx.executor.activations
        if saved is not None and saved.offloaded:
            hidden, extras = acts.load(saved), list(ctx.saved_tensors)
        else:
            hidden, *extras = ctx.saved_tensors
        if saved is not None:
            acts.prefetch_before(saved)  # the layers whose backward comes next, during this recompute
        n = ctx.num_out
        graph, ctx.graph = ctx.graph, None  # (used once: autograd frees it)
        grads_in = ctx.executor.backward_layer(ctx.index, hidden, ctx.call, ctx.grad_pos, extras,
                                               ctx.needs_input_grad[5:], grads[:n], ctx.layout, grads[n:], ctx.rng,
                                               graph)
        return (None, None, None, None, None, *grads_in)


class StreamedLayer(nn.Module):
    """Stands in for decoder layer ``index`` inside the HF model; owns no weights."""

    def __init__(self, executor: StreamingExecutor, index: int, original: nn.Module) -> None:
        super().__init__()
        copy_plain_attributes(original, self)
        self.index = index
        self._executor = [executor]  # a list keeps it out of the module tree
        self.shared_params: SharedParams = {}  # parameters it shares with other layers (model/shared_blocks.py)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ex = self._executor[0]
        # keys/values shared across layers travel as the Function's tensors (model/cross_layer.py)
        args, kwargs, shared = carry_mappings(args, kwargs)
        call = (args, with_shared(kwargs, self.shared_params))  # (inputs of the Function: their gradients flow back)
        if ex.rows.probing:  # the decoder re-run that finds which inputs hold batch rows (engine/batch_rows.py)
            return deliver(ex.rows.visit(self.index, hidden_states, call), shared)
        watch = MappingWatch(pytree.tree_leaves(call))  # other state a layer writes for later layers: refused
        out = self._run(ex, hidden_states, call)
        if watch.maps:
            watch.check(f"layer {self.index} ({type(ex.templates[ex.kinds[self.index]].module).__name__})")
        return deliver(out, shared)

    def _run(self, ex: StreamingExecutor, hidden_states: torch.Tensor, call: Call) -> Any:
        tap = ex.tap if ex.tap is not None and ex.tap.active else None
        if torch.is_grad_enabled():
            flat = pytree.tree_leaves(call)
            pos = grad_positions(flat)
            out = _StreamedLayerFunction.apply(ex, self.index, call, pos, ex.grad_anchor, hidden_states,
                                               *[flat[i] for i in pos])
            layout = ex.last_layout
            n = len(layout.slots)
            if tap is not None:
                tap.record(out[n:])
            return layout.rebuild(out[:n])
        if tap is not None:
            tap.start()
        tensors, layout = ex.forward_layer(self.index, hidden_states, call)
        if tap is not None:
            tap.record(tap.stop())
        return layout.rebuild(tensors)
