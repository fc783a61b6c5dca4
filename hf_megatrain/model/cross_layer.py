"""State one decoder layer hands to another outside the hidden state: refused, because streaming cannot train it.

hf_megatrain runs each decoder layer through its own autograd Function and, in the backward, recomputes it alone
from its inputs. Anything a layer passes to a *later* layer must therefore be an input or output of those
Functions; state that travels any other way is trained wrongly without an error:

- **KV shared across layers** (Gemma 3n, Gemma 4 with ``num_kv_shared_layers``, Mistral Large 4's
  ``kv_source_layers``): a "store" layer writes its keys/values into a ``KVSharingDict`` the decoder passes to
  every layer and later "reuse" layers attend with them. The store layer runs under ``no_grad`` in the streamed
  forward, so the reuse layers' gradient never reaches its key/value projections; in micro-batches each chunk
  overwrites the dict.
- **One block at several depths** (Zamba2's shared transformer block): refused by
  ``layers.check_no_shared_weights`` (each streamed layer would train its own copy).

``check_no_cross_layer_state`` refuses the first kind at conversion where the config declares it (a layer reading
in the ``kv_sharing_modes`` transformers derives for every KV-sharing family, or a non-zero ``num_kv_shared_layers``;
layers that only store, which no layer reads, are switched off by ``drop_unread_kv_stores``);
``MappingWatch`` is the generic guard behind it: a layer call that changes a mapping object passed to it (a
``KVSharingDict`` or any other ``MutableMapping`` that the decoder hands from layer to layer) raises at once.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from torch import nn

from .head_config import text_config_of

_WAY_OUT = ("Train this model with plain transformers; a configuration without cross-layer KV sharing "
            "(num_kv_shared_layers=0) is a different model and would not load the checkpoint's behaviour.")


def check_no_cross_layer_state(model: nn.Module) -> None:
    """Refuse a model whose config declares keys/values shared between layers (see the module docstring)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    cfg = text_config_of(cfg)  # (a multimodal model's language model declares it: Gemma 3n)
    try:
        modes = getattr(cfg, "kv_sharing_modes", None)
    except Exception:  # noqa: BLE001 - a derived property that does not apply to this config
        modes = None
    # "store": the layer keeps its keys/values for later ones (transformers >= 5.24 marks the last layer of each
    # type so even where no layer reads them, for assistant models); only a layer that reads them shares state.
    shared = [i for i, m in enumerate(modes or []) if m not in (None, "none", "store")]
    n = getattr(cfg, "num_kv_shared_layers", 0)
    if shared or (isinstance(n, int) and n > 0):
        where = f"layers {shared}" if shared else f"the last {n} layers"
        raise ValueError(
            f"{type(model).__name__} is not supported: {where} share keys/values computed by earlier layers "
            "(config kv_sharing_modes / num_kv_shared_layers). hf_megatrain recomputes each decoder layer alone in "
            "the backward, so the later layers' gradient would never reach the layers that computed those keys and "
            f"values (silently wrong training). {_WAY_OUT}")


def drop_unread_kv_stores(layers: nn.Module) -> int:
    """Switch off the key/value store of layers no layer reads from (Gemma 4's ``store_full_length_kv`` on a
    model without KV sharing: ``check_no_cross_layer_state`` has passed). Such a store only fills the mapping the
    decoder returns for an assistant model to read at generation; in training nothing reads it, and a layer writing
    into the mapping it is passed is what ``MappingWatch`` refuses. Returns how many layers had one."""
    mods = list(layers.modules())
    if any(getattr(m, "is_kv_shared_layer", False) is True for m in mods):
        return 0  # a layer reads them after all (a config edited after construction): MappingWatch refuses it
    count = 0
    for mod in mods:
        if getattr(mod, "store_full_length_kv", None) is True:
            mod.store_full_length_kv = False
            count += 1
    return count


class MappingWatch:
    """Snapshot of the mapping objects of one layer call (their keys and value identities), to see whether the
    layer wrote into one."""

    def __init__(self, leaves: list[Any]) -> None:
        self.maps = [m for m in leaves if isinstance(m, MutableMapping)]
        self.before = [self._state(m) for m in self.maps]

    @staticmethod
    def _state(m: MutableMapping) -> dict:
        return {k: id(v) for k, v in m.items()}

    def check(self, layer: str) -> None:
        for m, before in zip(self.maps, self.before):
            if self._state(m) != before:
                raise RuntimeError(
                    f"hf_megatrain: {layer} wrote into the {type(m).__name__} its decoder passes to every layer (state "
                    "a later layer reads, e.g. keys/values shared across layers). hf_megatrain recomputes each layer "
                    "alone in the backward, so that state would carry no gradient back to the layer that wrote it "
                    f"(silently wrong training). {_WAY_OUT}")
