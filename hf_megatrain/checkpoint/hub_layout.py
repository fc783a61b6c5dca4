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
(``tests/test_hub_layout.py`` checks that against ``save_pretrained``). The reverted tensors are views or per-layer
copies of the FP32 masters; a group whose element count changes is refused (nothing written).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch

from .safetensors_io import CheckpointError

__all__ = ["hub_layout"]

_FIRST_INDEX = re.compile(r"^(.*?\.\d+\.)")


def _group_key(name: str) -> str:
    m = _FIRST_INDEX.match(name)
    return m.group(1) if m else ""


def hub_layout(model: Any, items: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``items`` (model names -> tensors, in order) renamed / split as ``model.save_pretrained`` would write them;
    unchanged where transformers has no conversion for the model (most dense families) or is too old to say."""
    items = list(items)
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return items
    if not isinstance(model, PreTrainedModel):  # (a PEFT wrapper's names are not the model's)
        return items
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in items:
        groups.setdefault(_group_key(name), []).append((name, t))
    out: list[tuple[str, torch.Tensor]] = []
    for key, group in groups.items():
        before = dict(group)
        after = revert_weight_conversion(model, dict(before))
        if after.keys() == before.keys() and all(after[k] is before[k] for k in before):
            out.extend(group)
            continue
        if sum(t.numel() for t in after.values()) != sum(t.numel() for t in before.values()):
            raise CheckpointError(
                f"export of {type(model).__name__}: transformers' save layout of the tensors under "
                f"'{key or '(no layer index)'}' changes their element count ({sorted(before)[:3]}... -> "
                f"{sorted(after)[:3]}...); nothing was written. Report it with the transformers version.")
        out.extend(after.items())
    return out
