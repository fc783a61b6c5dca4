"""Sequence tiling: a decoder layer's position-wise parts run over chunks of the sequence, forward and backward.

At long context the per-token work of a layer is dominated, in memory, by tensors that scale with the whole
sequence: the MLP's gate / up / act(gate) * up ([tokens, intermediate]: 20 GB each at 512k tokens and 7B width in
bf16) and the fp32 upcasts of RMSNorm. Those modules compute each token from that token alone, so they can run one
chunk of tokens at a time: the forward keeps only the chunk's output (written into the whole output), the backward
recomputes one chunk under autograd, back-propagates its slice of the output gradient and drops it before the next
(the technique of Arctic Long Sequence Training's ``TiledMLP`` in DeepSpeed). Only one chunk's intermediates are
ever alive; the layer's own recompute (engine/executor.py) sees one autograd node per tiled module.

``tile_positionwise`` installs this on a layer template (model/template.py) at conversion, by structure, not by
family: direct children named like an MLP (``mlp``, ``feed_forward``, ``ffn``...) and norm modules (class name
with "Norm"). A child is left untiled, and the reason logged, where chunking could change the math:

- mixture-of-experts blocks (``experts`` / ``router`` submodules, ``num_experts`` / ``top_k`` attributes): routers
  with capacity limits see the whole batch of tokens at once, and the router logits feed an aux loss over the
  whole sequence (recorded by a tap that expects one tensor per layer call);
- modules that draw random numbers in training (dropout): a chunk's recompute would draw other masks.

A tiled module called with anything but one tensor (extra arguments), or a sequence no longer than the chunk,
runs its own forward unchanged. Parameters reach the tiler through the template's ``functional_call`` binding;
their gradients are summed over chunks in FP32 (one rounding to the compute dtype, as one whole-sequence GEMM).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

logger = logging.getLogger(__name__)

MLP_NAMES = frozenset({"mlp", "feed_forward", "ffn", "feedforward", "ff", "mlp_block"})
_MOE_CHILDREN = frozenset({"experts", "router", "expert", "routers"})
_MOE_ATTRS = ("num_experts", "top_k", "num_experts_per_tok", "num_local_experts", "router_jitter_noise")
_UNTILED = "_megatrain_untiled"  # keyword a tiled forward takes to run the module's own forward (the recompute)


@dataclass
class TilingReport:
    tiled: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # child name -> why it runs untiled


def _kind(name: str, module: nn.Module) -> str | None:
    if name.lower() in MLP_NAMES:
        return "mlp"
    cls = type(module).__name__.lower()
    if "norm" in cls and not any(True for _ in module.children()):
        return "norm"
    return None


def _unsafe(module: nn.Module, training_stochastic: Callable[[nn.Module], bool]) -> str | None:
    for name, sub in module.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in _MOE_CHILDREN or any(isinstance(getattr(sub, a, None), int) and not isinstance(
                getattr(sub, a), bool) for a in _MOE_ATTRS):
            return ("a mixture-of-experts block: its routing (capacity limits, router logits for the whole-sequence "
                    "aux loss) is not safely per token")
    if training_stochastic(module):
        return "draws random numbers in training (dropout): a chunk's recompute would draw different masks"
    return None


def tile_positionwise(layer: nn.Module, chunk_tokens: int,
                      is_stochastic: Callable[[nn.Module], bool]) -> TilingReport:
    """Make ``layer``'s position-wise children run over chunks of ``chunk_tokens`` tokens (in place)."""
    report = TilingReport()
    for name, child in layer.named_children():
        kind = _kind(name, child)
        if kind is None:
            continue
        why = _unsafe(child, is_stochastic)
        if why is not None:
            report.skipped[name] = why
            continue
        child.forward = _TiledForward(child, chunk_tokens)  # instance attribute: names and hooks unchanged
        report.tiled.append(name)
    if report.skipped:
        logger.warning("hf_megatrain: seq_chunk_tokens: %s of %s run untiled over the whole sequence: %s",
                       sorted(report.skipped), type(layer).__name__,
                       "; ".join(f"{k}: {v}" for k, v in report.skipped.items()))
    return report


class _TiledForward:
    """The forward installed on a tiled module: chunks along the token dim (the one before the features)."""

    def __init__(self, module: nn.Module, chunk_tokens: int) -> None:
        self.own = type(module).forward.__get__(module)  # the class's forward, bound (not a tensor holder)
        self.module_ref = [module]  # a list: no reference cycle through nn.Module attribute handling
        self.chunk_tokens = chunk_tokens

    def __call__(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        if kwargs.pop(_UNTILED, False) or args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self.own(x, *args, **kwargs)
        dim = x.dim() - 2
        rows = max(1, x[..., 0].numel() // x.shape[dim])  # sequences sharing a token index (the batch)
        chunk = max(1, self.chunk_tokens // rows)
        if x.shape[dim] <= chunk:
            return self.own(x)
        module = self.module_ref[0]
        names, tensors = [], []
        for n, t in list(module.named_parameters()) + list(module.named_buffers()):
            names.append(n)
            tensors.append(t)
        run = _runner(module, names)
        if not torch.is_grad_enabled():
            return _chunked(run, tensors, x, dim, chunk)
        return _TiledFunction.apply(run, dim, chunk, x, *tensors)


def _runner(module: nn.Module, names: list[str]) -> Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]:
    def run(tensors: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(module, dict(zip(names, tensors)), (x,), {_UNTILED: True}, tie_weights=False,
                               strict=False)
    return run


def _chunked(run: Callable, tensors: list[torch.Tensor], x: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """The whole output, computed chunk by chunk (no grad): only one chunk's intermediates alive at a time."""
    out = None
    for a in range(0, x.shape[dim], chunk):
        xc = x.narrow(dim, a, min(chunk, x.shape[dim] - a))
        oc = run(tensors, xc)
        if not isinstance(oc, torch.Tensor) or oc.shape[:-1] != xc.shape[:-1]:
            raise RuntimeError(
                f"hf_megatrain: seq_chunk_tokens: a tiled module returned {type(oc).__name__} "
                f"{tuple(getattr(oc, 'shape', ()))} for input {tuple(xc.shape)}: not one tensor per token, so it "
                "cannot run in sequence chunks; set seq_chunk_tokens=0")
        if out is None:
            out = oc.new_empty(x.shape[:-1] + oc.shape[-1:])
        out.narrow(dim, a, xc.shape[dim]).copy_(oc)
        del oc
    return out


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable, dim: int, chunk: int, x: torch.Tensor,  # type: ignore[override]
                *tensors: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.dim, ctx.chunk = run, dim, chunk
        ctx.save_for_backward(x, *tensors)
        return _chunked(run, list(tensors), x, dim, chunk)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, *tensors = ctx.saved_tensors
        dim, chunk = ctx.dim, ctx.chunk
        need_x, need_t = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        gx = torch.empty_like(x) if need_x else None
        # Parameter gradients summed over chunks in FP32: rounded to the compute dtype once, like one GEMM's.
        acc: list[torch.Tensor | None] = [None] * len(tensors)
        for a in range(0, x.shape[dim], chunk):
            n = min(chunk, x.shape[dim] - a)
            xc = x.narrow(dim, a, n).detach().requires_grad_(need_x)
            leaves = [t.detach().requires_grad_() if need else t for t, need in zip(tensors, need_t)]
            with torch.enable_grad():
                out = ctx.run(leaves, xc)
            wrt = ([xc] if need_x else []) + [t for t, need in zip(leaves, need_t) if need]
            if not wrt or not out.requires_grad:
                if need_x:
                    gx.narrow(dim, a, n).zero_()
                continue
            grads = list(torch.autograd.grad(out, wrt, grad.narrow(dim, a, n), allow_unused=True))
            del out
            if need_x:
                g = grads.pop(0)
                gx.narrow(dim, a, n).copy_(g) if g is not None else gx.narrow(dim, a, n).zero_()
            for i, need in enumerate(need_t):
                if not need:
                    continue
                g = grads.pop(0)
                if g is None:
                    continue
                if acc[i] is None:
                    acc[i] = g.float() if g.dtype != torch.float32 else g.clone()
                else:
                    acc[i].add_(g)
        out_t = [None if a is None else a.to(t.dtype) for a, t in zip(acc, tensors)]
        return (None, None, None, gx, *out_t)
