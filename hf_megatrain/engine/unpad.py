"""Padded training batches as one packed row (``padding_free``): the decoder layers never compute padding.

A padded batch (one sequence per row, right-padded to the longest: ``DataCollatorWithPadding``,
``DataCollatorForSeq2Seq``, SFTTrainer without packing) makes every layer's matmuls run over the padding too -- 18-23 %
of the positions of a length-grouped 32k-token fine-tune step, ~60 % at batch 8 without ``group_by_length``
(integration/PERF.md, lever 57). Before the model runs, the engine can lay the batch's real tokens end to end in
one row with ``position_ids`` restarting at each sequence -- what ``DataCollatorWithFlattening`` would have given --
and transformers' mask code then keeps every token inside its own sequence.

It is the same math, not an approximation, under the conditions ``packed_from_padded`` checks (else the batch runs
as it came):

- right padding: each ``attention_mask`` row is ones then zeros, so the real tokens' default positions are
  ``0..len-1``, the positions a packed row restarts at (given ``position_ids`` must be those);
- every padded position's label is -100. With HF's shift the target of position ``t`` is label ``t+1``: a row's
  last real token targets the padding's -100, its first label is never a target. The packed row sets each
  sequence's first label to -100 (``DataCollatorWithFlattening``'s separator), so the last token of one sequence
  predicts nothing across the boundary, and the counted targets -- and so the loss, its normaliser with or without
  ``num_items_in_batch``, and every gradient -- are the padded batch's;
- a training forward (grad enabled) without ``return_logits`` (its rows would not be the caller's) and with no
  other model inputs (multimodal, ``token_type_ids``, ...).

Which engines do it is decided once (``decide``): "auto" where packed rows run FlexAttention
(``masked_attention``: model/attention.py), where the packed row costs what its sequences cost; not where
they would run SDPA's dense mask, ``[N, N]`` over the whole step. Decoder-only, shifted-loss models without a MoE
router auxiliary loss (that loss reads the padding mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..model.loss import IGNORE_INDEX


@dataclass(frozen=True)
class Unpadding:
    on: bool
    reason: str


def windowed_attention(config: Any) -> bool:
    """Some layer attends through a sliding window or in chunks (transformers passes their masks ``local_size``):
    such a layer's packed row takes SDPA's dense mask (model/attention.py), quadratic in the whole step's tokens."""
    types = getattr(config, "layer_types", None) or ()
    return (any(t != "full_attention" for t in types)
            or bool(getattr(config, "attention_chunk_size", None))
            or (bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
                is not False and not types))


def decide(setting: str, flex: bool, *, runs_model: bool, unshifted: bool, router: bool,
           windowed: bool = False, masks_packed: bool = True) -> Unpadding:
    """``setting``: the config's ``padding_free`` ("auto" / "on" / "off"); ``flex``: packed rows run
    FlexAttention (model/attention.py ``AttentionChoice.flex``); the rest: what the model's head does
    (model/families.py ``ModelHead``) and ``windowed_attention``; ``masks_packed``: the model's mask code keeps
    packed sequences apart (transformers' masking utilities, which every ``_supports_flex_attn`` model uses, read
    restarting ``position_ids`` as boundaries; without them a packed row would attend across sequences). "on"
    refuses, saying why, where "auto" would quietly stay padded (a windowed model under "on" is exact, only slow)."""
    if setting == "off":
        return Unpadding(False, "padding_free='off'")
    why_not = ("its mask code is not known to keep packed sequences apart (not a transformers model supporting "
               "flex_attention)" if not masks_packed
               else "a multimodal forward (its towers read the padded rows)" if runs_model
               else "the model's own unshifted loss form" if unshifted
               else "a MoE router auxiliary loss (it reads the padding mask)" if router else None)
    if why_not is not None:
        if setting == "on":
            raise ValueError(f"padding_free='on' cannot run here: {why_not}. Use padding_free='auto' or 'off'.")
        return Unpadding(False, f"padded batches stay padded: {why_not}")
    if setting == "auto" and not flex:
        return Unpadding(False, "padded batches stay padded (packed rows would run SDPA's dense mask: the model's "
                                "attention, not FlexAttention)")
    if setting == "auto" and windowed:
        return Unpadding(False, "padded batches stay padded (sliding-window or chunked layers would run the packed "
                                "row through SDPA's dense mask)")
    return Unpadding(True, "padded training batches run as one packed row (the layers skip the padding)")


def _stays(why: list[str] | None, reason: str | None) -> None:
    if why is not None and reason is not None:
        why.append(reason)


def packed_from_padded(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                       labels: torch.Tensor | None, kwargs: dict[str, Any],
                       why: list[str] | None = None) -> dict[str, Any] | None:
    """The batch as one packed row -- ``input_ids``, ``position_ids``, ``labels`` ([1, N]) -- or None where it is
    not a right-padded batch this is exact for (module docstring); then, for a batch that has padding, the reason is
    appended to ``why``. The mask is read on the host (one copy; it is [rows, width] integers) and the tokens
    gathered by index, so the step's device work is waited on once for the mask and once for each of the labels'
    and positions' checks."""
    if input_ids is None or attention_mask is None or input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        return None  # (no padding mask: nothing to remove)
    keep = attention_mask.detach().cpu().bool()
    lengths = keep.sum(dim=1)
    width = input_ids.shape[1]
    columns = torch.arange(width)
    if bool(keep.all()):
        return None  # (nothing to remove)
    if set(kwargs) - {"position_ids"}:
        return _stays(why, f"other model inputs ({', '.join(sorted(set(kwargs) - {'position_ids'}))})")
    if not torch.equal(keep, columns[None, :] < lengths[:, None]):
        return _stays(why, "not right padding (for training, pad on the right: tokenizer.padding_side='right')")
    if bool((lengths == 0).any()):
        return _stays(why, "a row without tokens")
    positions = columns.expand_as(keep)[keep]  # restarts at 0 with each sequence
    device = input_ids.device
    real = keep.flatten().nonzero().squeeze(1).to(device, non_blocking=True)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and (position_ids.dim() > 2 or position_ids.shape[-1] != width or not torch.equal(
            position_ids.expand(len(keep), width).flatten()[real.to(position_ids.device)].cpu(),
            positions.to(position_ids.dtype))):
        return _stays(why, "position_ids other than 0..length-1 in each row")
    out: dict[str, Any] = {"input_ids": input_ids.flatten()[real][None], "position_ids": positions.to(device)[None]}
    if labels is not None:
        if labels.shape != keep.shape:
            return _stays(why, f"labels of shape {tuple(labels.shape)} beside input_ids {tuple(keep.shape)}")
        pad = (~keep).flatten().nonzero().squeeze(1).to(labels.device)
        if bool((labels.flatten()[pad] != IGNORE_INDEX).any()):
            return _stays(why, "labels at padded positions that are not -100 (the padded batch trains on them)")
        firsts = (positions == 0).nonzero().squeeze(1).to(labels.device)  # (never a target in the padded rows)
        out["labels"] = labels.flatten()[real.to(labels.device)].index_fill_(0, firsts, IGNORE_INDEX)[None]
    return out
