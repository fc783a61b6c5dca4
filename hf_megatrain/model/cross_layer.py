"""State one decoder layer hands to another outside the hidden state: carried through the layers' Functions.

hf_megatrain runs each decoder layer through its own autograd Function and, in the backward, recomputes it alone
from its inputs (engine/proxy.py). Anything a layer passes to a *later* layer must therefore be an input or output
of those Functions, or it is trained wrongly without an error.

**Keys/values shared across layers** (Gemma 3n, Gemma 4 with ``num_kv_shared_layers``, Mistral Large 4): a "store"
layer writes its keys/values into a ``KVSharingDict`` the decoder passes to every layer, and later "reuse" layers
attend with them (their own k/v projections do not exist). They are carried here:

- into a layer: ``carry_mappings`` replaces every such mapping of the layer's call by a ``SharedKV`` holding its
  current entries. ``SharedKV`` is a pytree node, so its tensors are leaves of the call: the Function takes the
  ones that require grad as inputs beside the hidden state (engine/layer_io.py ``grad_positions``), the micro-batch
  split cuts them per rows of the batch, and the Function's backward returns their gradients;
- out of a layer: ``collect_writes`` runs the layer and returns ``Carried(output, writes)``, the entries the call
  wrote, so the keys/values a store layer computes are outputs of its Function, recomputed with grad in its backward
  (forward, recompute and every micro-batch chunk see the same structure);
- back to the decoder: ``deliver`` writes those outputs into the caller's mapping and returns the layer's own output.

So autograd links each store layer's Function to every reuse layer that reads its keys/values: the reuse layers'
gradients for them are summed into the store layer's output gradient, which its recompute back-propagates into its
k/v projections and hidden state. The carried tensors (per layer type ``[batch, kv_heads, tokens, head_dim]`` twice)
stay on the device from the store layer's forward to the last reader's backward; activation offload moves only the
hidden states. ``MappingWatch`` is the guard for everything else: a layer call that changes a mapping passed to it
that is not carried (values other than tensors, or nested deeper than the call's own arguments) raises at once.

**One block at several depths** (Zamba2's shared transformer block) is the other cross-layer case, carried by
model/shared_blocks.py: its parameters are resident (one FP32 master) and enter each using layer's Function as
inputs, so autograd sums their gradients over the uses.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

_WAY_OUT = "Train this model with plain transformers."


class SharedKV(dict):
    """One layer call's view of a cross-layer key/value mapping: its entries when the call started. Writes go
    into this copy (``collect_writes`` returns them); the caller's mapping is written by ``deliver`` only."""

    def __init__(self, entries: Any = (), origin: str = "mapping") -> None:
        super().__init__(entries)
        self.origin = origin  # the caller's mapping type, for messages


pytree.register_pytree_node(
    SharedKV, lambda d: (list(d.values()), (d.origin, tuple(d.keys()))),
    lambda values, ctx: SharedKV(zip(ctx[1], values), ctx[0]),
    serialized_type_name="hf_megatrain.model.cross_layer.SharedKV")


class Carried(NamedTuple):
    """A layer call's output and, per carried mapping of the call, the entries the layer wrote (pytree: its tensors
    are the Function's outputs after the layer's own, so ``out``'s hidden state stays the first)."""

    out: Any
    writes: list[dict]


def _is_kv(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, tuple) and all(isinstance(t, torch.Tensor)
                                                                               for t in value))


def _carriable(value: Any) -> bool:
    """A mapping the decoder hands to layers (not a dict: pytree already flattens those into fresh copies) whose
    entries are tensors or tuples of tensors: transformers' ``KVSharingDict``."""
    return isinstance(value, MutableMapping) and not isinstance(value, dict) and all(map(_is_kv, value.values()))


def _refusal(layer: str, mapping: str) -> RuntimeError:
    return RuntimeError(
        f"hf_megatrain: {layer} wrote into the {mapping} its decoder passes to every layer (state a later layer "
        "reads) something other than tensors (or removed an entry), which hf_megatrain cannot carry from layer to "
        "layer (model/cross_layer.py). It recomputes each layer alone in the backward, so that state would carry no "
        f"gradient back to the layer that wrote it (silently wrong training). {_WAY_OUT}")


def carry_mappings(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[MutableMapping]]:
    """The call with each carriable mapping (a top-level argument) replaced by a ``SharedKV`` of its entries, and the
    caller's mappings replaced, in the order ``collect_writes`` finds their copies."""
    originals: list[MutableMapping] = []

    def swap(v: Any) -> Any:
        if _carriable(v):
            originals.append(v)
            return SharedKV(v, type(v).__name__)
        return v

    args = tuple(swap(v) for v in args)
    kwargs = {k: swap(v) for k, v in kwargs.items()}
    return args, kwargs, originals


def collect_writes(run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    """``run()``, the layer called with ``args`` / ``kwargs``. With a ``SharedKV`` among them: ``Carried(output,
    writes)``, ``writes[j]`` the entries the call added or replaced in the j-th one (tensors only: anything else is
    refused); without: the output unchanged."""
    maps = [v for v in (*args, *kwargs.values()) if isinstance(v, SharedKV)]
    if not maps:
        return run()
    before = [dict(m) for m in maps]
    out = run()
    writes = [{k: v for k, v in m.items() if k not in b or v is not b[k]} for m, b in zip(maps, before)]
    for m, w, b in zip(maps, writes, before):
        if not all(map(_is_kv, w.values())) or b.keys() - m.keys():  # (an entry removed: not carried either)
            raise _refusal("a decoder layer", m.origin)
    return Carried(out, writes)


def deliver(out: Any, originals: list[MutableMapping]) -> Any:
    """The layer's own output; the entries it wrote (the Function's outputs) put into the caller's mappings."""
    if not isinstance(out, Carried):
        return out
    for mapping, writes in zip(originals, out.writes):
        for k, v in writes.items():
            mapping[k] = v
    return out.out


def drop_unread_kv_stores(layers: nn.Module) -> int:
    """Switch off the key/value store of layers when no layer reads them (Gemma 4's ``store_full_length_kv`` on a
    model without KV sharing). Such a store only fills the mapping the decoder returns for an assistant model to read
    at generation; in training nothing reads it, and carrying it would keep it on the device for nothing. Returns how
    many layers had one."""
    mods = list(layers.modules())
    if any(getattr(m, "is_kv_shared_layer", False) is True for m in mods):
        return 0  # a layer reads them: the stores are carried
    count = 0
    for mod in mods:
        if getattr(mod, "store_full_length_kv", None) is True:
            mod.store_full_length_kv = False
            count += 1
    return count


class MappingWatch:
    """Snapshot of the mapping objects of one layer call (their keys and value identities), to see whether the
    layer wrote into one that is not carried."""

    def __init__(self, leaves: list[Any]) -> None:
        self.maps = [m for m in leaves if isinstance(m, Mapping) and not isinstance(m, dict)]
        self.before = [self._state(m) for m in self.maps]

    @staticmethod
    def _state(m: Mapping) -> dict:
        return {k: id(v) for k, v in m.items()}

    def check(self, layer: str) -> None:
        for m, before in zip(self.maps, self.before):
            if self._state(m) != before:
                raise _refusal(layer, type(m).__name__)
