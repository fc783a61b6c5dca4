"""What crosses a streamed layer's autograd Function: a decoder layer's inputs and outputs as flat tensor lists.

A decoder layer is called as ``layer(hidden_states, *args, **kwargs)`` and returns whatever its class returns: the
hidden state alone, a tuple ``(hidden_states, attn_weights)`` (BLOOM, Falcon, GPT-J, GPT-Neo, CodeGen, MPT: their
loops read ``outputs[0]``), or a ``ModelOutput``. An autograd Function takes and returns tensors only, so

- inputs: every floating tensor of ``(args, kwargs)`` that requires grad (a per-layer input, the embeddings fed to
  every layer, a shared learned tensor) is an input of the Function besides the hidden state, and its backward
  returns their gradients (``grad_positions``);
- outputs: the layer's output is flattened with torch's pytree; each tensor leaf is an output of the Function (the
  hidden state first) and ``OutLayout.rebuild`` puts the layer's own structure back around them, non-tensor and
  None leaves passed through unchanged.

A visit split into micro-batches (``micro_batch_size``) runs the layer per chunk of rows: input tensors that hold
rows of the batch are sliced, the others (broadcast masks, rotary tables, ALiBi biases) passed whole
(``slice_call``; which is which is asked of the model, not read off a shape: engine/batch_rows.py);
output tensors whose leading dim is each chunk's rows are concatenated, tensors equal in every chunk kept once
(``shared``), and anything else is refused (``merge_chunks``): no output is silently cut or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

Call = tuple[tuple, dict]  # (args, kwargs) of one layer call, the hidden state excluded


def grad_positions(flat: list[Any]) -> list[int]:
    """Leaf positions (in the flattened call) of the floating tensors that require grad."""
    return [i for i, x in enumerate(flat)
            if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()]


def slice_call(flat: list[Any], spec: pytree.TreeSpec, a: int, b: int, rows: list[int | None] | None,
               replace: dict[int, torch.Tensor] | None = None) -> Call:
    """The call for rows ``a:b`` of the batch: leaves holding ``r`` rows per sequence (``rows``, decided by
    engine/batch_rows.py; None: the whole batch, nothing sliced) cut to ``a*r:b*r``, the others passed whole,
    leaves in ``replace`` substituted (the backward's leaves that collect input gradients, already cut)."""
    replace = replace or {}
    leaves = [replace[i] if i in replace else x if rows is None or rows[i] is None else x[a * rows[i]:b * rows[i]]
              for i, x in enumerate(flat)]
    return pytree.tree_unflatten(leaves, spec)


@dataclass
class OutLayout:
    """How a layer's output is put back together from the Function's tensors (no tensor is kept here)."""

    spec: pytree.TreeSpec
    leaves: list[Any]  # the output's leaves, tensors replaced by None
    slots: list[int]  # leaf position of each tensor output, in Function output order (hidden state first)
    shared: list[bool]  # per tensor output: one value for the whole batch, taken from the first chunk

    def rebuild(self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        for slot, t in zip(self.slots, tensors):
            leaves[slot] = t
        return pytree.tree_unflatten(leaves, self.spec)

    def tensors_of(self, out: Any) -> list[torch.Tensor]:
        """The tensor outputs of one (recomputed) call, in Function output order."""
        leaves, spec = pytree.tree_flatten(out)
        if spec != self.spec:
            raise RuntimeError(f"hf_megatrain: a decoder layer's recompute returned {spec}, its forward {self.spec}; "
                               "the backward cannot pair their outputs")
        return [leaves[s] for s in self.slots]


def _equal(parts: list[Any]) -> bool:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return all(p.shape == first.shape and p.dtype == first.dtype and torch.equal(p, first) for p in parts[1:])
    try:
        return all(p is first or bool(p == first) for p in parts[1:])
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return False


def merge_chunks(outs: list[Any], sizes: list[int], layer: str) -> tuple[list[torch.Tensor], OutLayout]:
    """The outputs of one visit's chunks (rows ``sizes[c]`` each) as one output: (tensors, layout)."""
    flats = [pytree.tree_flatten(o) for o in outs]
    spec = flats[0][1]
    if any(s != spec for _, s in flats[1:]):
        raise RuntimeError(f"hf_megatrain: {layer} returned differently structured outputs for the micro-batches of "
                           "one visit; set micro_batch_size=0 to run each layer on the whole batch")
    columns = list(zip(*(f for f, _ in flats)))
    hidden = columns[0][0] if columns else None
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise TypeError(
            f"hf_megatrain: {layer} returned {type(outs[0]).__name__} whose first entry is "
            f"{type(hidden).__name__}, not the hidden-state tensor; hf_megatrain streams layers that return the hidden "
            "state first (a tensor, or a tuple / ModelOutput starting with it). Point MegaTrainConfig(layers_path=...) "
            "at the decoder-layer list if it picked the wrong one.")
    tensors: list[torch.Tensor] = []
    leaves: list[Any] = []
    slots: list[int] = []
    shared: list[bool] = []
    single = len(outs) == 1
    for j, parts in enumerate(columns):
        first = parts[0]
        if not isinstance(first, torch.Tensor):
            if not single and not _equal(list(parts)):
                raise RuntimeError(f"hf_megatrain: {layer} output {j} ({type(first).__name__}) differs between the "
                                   "micro-batches of one visit and cannot be combined; set micro_batch_size=0")
            leaves.append(first)
            continue
        leaves.append(None)
        slots.append(j)
        if single:
            tensors.append(first)
            shared.append(False)
            continue
        rows = all(isinstance(p, torch.Tensor) and p.dim() > 0 and p.shape[0] == n for p, n in zip(parts, sizes))
        # With one row per chunk a broadcast [1, ...] tensor looks batch-major; equal rows then mean "shared".
        ambiguous = max(sizes) == 1 and j > 0 and _equal(list(parts))
        if rows and not ambiguous:
            tensors.append(torch.cat(parts))
            shared.append(False)
        elif j > 0 and all(isinstance(p, torch.Tensor) for p in parts) and _equal(list(parts)):
            tensors.append(first)
            shared.append(True)
        else:
            raise RuntimeError(
                f"hf_megatrain: {layer} output {j} (shape {tuple(first.shape)}) is neither one row per sequence nor "
                "the same for the whole batch, so the micro-batches of one visit (micro_batch_size) cannot be "
                "combined; set micro_batch_size=0")
    return tensors, OutLayout(spec, leaves, slots, shared)
