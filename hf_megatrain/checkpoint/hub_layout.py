"""Exports in the layout transformers' own ``save_pretrained`` writes, one decoder layer at a time.

transformers 5 keeps some models in memory in another layout than their Hub checkpoints (MoE experts fused into one
``gate_up_proj`` / ``down_proj`` tensor per layer where the Hub files hold one tensor per expert, renamed modules such
as Mixtral's ``block_sparse_moe``), and ``save_pretrained`` writes the Hub layout back by default
(``save_original_format=True``: ``core_model_loading.revert_weight_conversion``). Serving stacks and converters read
that layout, so an export must too: a fine-tuned Mixtral or gpt-oss whose files carry the in-memory names loads in
transformers but not where the user deploys it.

``revert_weight_conversion`` takes a state dict; a whole one of a 120B model is what the streamed export avoids. Its
converters each read and write tensors of one decoder layer (the experts of that layer), so the tensors are grouped by
the prefix up to their first integer component (``model.layers.7.``), reverted group by group, and everything
without an index (embeddings, final norm, lm_head) as one group: the same keys and values as the whole-dict call
(``tests/test_hub_layout.py`` checks that against ``save_pretrained``). The export (``folders.py``) and the merged
PEFT export (``export/peft_support.py``) both go through it; only one layer's tensors are held at a time (views of
the FP32 masters, or one layer's merged copies). A group whose element count changes is refused.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Iterable, Iterator

import torch

from .names import CheckpointError

__all__ = ["hub_layout", "layer_runs"]

_FIRST_INDEX = re.compile(r"^(.*?\.\d+\.)")


def _group_key(name: str) -> str:
    m = _FIRST_INDEX.match(name)
    return m.group(1) if m else ""


def hub_layout(model: Any, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` (model names -> tensors) renamed / split as ``model.save_pretrained`` would write them; unchanged
    where transformers has no conversion for the model (most dense families) or is too old to say. Each run of
    consecutive items with the same layer prefix is reverted as one group, and only that run is held: callers pass
    a layer's tensors together (``layer_runs`` orders a list so), and a merged export's per-layer tensors stream."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        yield from items
        return
    if not isinstance(model, PreTrainedModel):  # (a PEFT wrapper's names are not the model's)
        yield from items
        return
    for key, run in itertools.groupby(items, key=lambda item: _group_key(item[0])):
        before = dict(run)
        after = revert_weight_conversion(model, dict(before))
        if after.keys() != before.keys() and \
                sum(t.numel() for t in after.values()) != sum(t.numel() for t in before.values()):
            raise CheckpointError(
                f"export of {type(model).__name__}: transformers' save layout of the tensors under "
                f"'{key or '(no layer index)'}' changes their element count ({sorted(before)[:3]}... -> "
                f"{sorted(after)[:3]}...); nothing was written. Report it with the transformers version.")
        yield from after.items()


def layer_runs(items: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``items`` with each layer prefix's tensors together (stable, in order of first appearance): a layer's frozen
    parameters and buffers, listed after every master, join its run for ``hub_layout``."""
    order: dict[str, int] = {}
    for name, _ in items:
        order.setdefault(_group_key(name), len(order))
    return sorted(items, key=lambda item: order[_group_key(item[0])])
