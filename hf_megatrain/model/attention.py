"""Masked batches' attention: FlexAttention where the mask is causal + padding or packed sequences, SDPA everywhere
else.

A fine-tune's padded batches (``attention_mask`` with zeros, one row per sequence padded to the batch's longest)
hand SDPA a dense ``[rows, 1, T, T]`` boolean mask under transformers' default ``attn_implementation="sdpa"``,
which costs twice over on a GPU (H200, 14B width: integration/results/attention_shapes):

- no kernel can skip what the mask removes (the causal half, the padding): the dense-mask kernel computes it all;
- with a mask SDPA picks cuDNN attention, which builds an execution graph for every new shape, and a padded
  batch's width is new almost every step: 0.1-5 s for the first call of a shape against 10-50 ms for the next
  (the fine-tune's occasional 2-5 s step).

FlexAttention with a ``BlockMask`` skips the fully masked blocks and runs one kernel for every width (fine-tune
regime, 32k real tokens per step: median step 1.75-2.06 s -> 1.60-1.65 s, no outlier step). Where there is no
mask (fixed-length rows), SDPA's flash kernel is faster than FlexAttention (5.8 vs 8.0 ms at 16 x 2,048), so this
implementation keeps it there. The math is the model's attention either way; only the kernel's rounding differs
(tests/test_masked_attention.py: float32, against plain HF with SDPA, 1e-7 on the loss).

Packed sequences (``position_ids`` restarting: ``DataCollatorWithFlattening``, TRL ``padding_free``): compiled into
the layers, FlexAttention with transformers' packed mask computed wrong values on torch 2.11 -- in plain
transformers too, with each decoder layer ``torch.compile``d (logits 1.3e-2 off; eager right: the retired
masked_flex_parity probe's ``--diagnose``, integration/PERF.md: an upstream bug, not the engine's). So packed rows run
FlexAttention *outside* the layer's compiled graph: the builder wraps their ``BlockMask`` (``PackedBlockMask``) and
the attention function hands it to a separately compiled ``flex_attention`` behind ``torch.compiler.disable`` --
right on an H200 (loss 1e-7, weights 2.5e-6 after three steps, masked_flex_parity) and an H100 (the GPU tests), a
fresh wrapper per step re-compiles nothing, and the fine-tune regime's packed step runs at 0.96x the fixed-length
step (H100: 1.432 s vs SDPA's dense mask ~1.6 s; integration/results/bench_vs_deepspeed, session 19). Padded
batches mostly never get here: ``padding_free`` (engine/unpad.py) turns them into packed rows first.

``MASKED_FLEX`` is registered with transformers as an attention function (``AttentionInterface``) and a mask
builder (``AttentionMaskInterface``): the model's own mask code (``create_causal_mask`` and its siblings) asks the
builder, which in a training forward (grad enabled) answers transformers' ``BlockMask`` for a padded causal batch and
a ``PackedBlockMask`` for packed rows, and ``sdpa``'s answer for everything else (plain causal: ``None``, SDPA's
``is_causal``; evaluation and generation; sliding windows, overlays). The attention function runs FlexAttention for
those two and SDPA for anything else.

Which models get it is decided once, in ``choose`` (``masked_attention`` in the config); ``apply`` sets it on the
model config before the layer templates copy the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MASKED_FLEX = "hf_megatrain_masked_flex"  # padded and packed rows through FlexAttention (packed: outside the graph)


@dataclass(frozen=True)
class AttentionChoice:
    """What runs masked batches' attention: FlexAttention (``MASKED_FLEX``) or the model's own implementation."""

    flex: bool
    reason: str

    @property
    def implementation(self) -> str:
        return MASKED_FLEX


def _block_mask_type() -> type | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # (a torch without FlexAttention)
        return None
    return BlockMask


def _masked_flex_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                      mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                      allow_is_causal_skip: bool = True, **kwargs: Any) -> Any:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

    sdpa, flex = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"]
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    training = torch.is_grad_enabled() and not (q_offset or kv_offset or q_length != kv_length)
    padded_causal = (attention_mask is not None and mask_function in (None, causal_mask_function)
                     and allow_is_causal_skip and not bool(attention_mask.all()))
    if training and padded_causal:
        return flex(**args)
    if training and attention_mask is None and not allow_is_causal_skip \
            and kwargs.get("local_size") is None:  # (transformers turns the causal skip off for packed rows)
        return PackedBlockMask(flex(**args))
    # Everything else is what "sdpa" does: plain causal batches (None: SDPA's is_causal, its flash kernel);
    # evaluation and generation (no grad, or a cache offsetting the queries: a new prompt width compiles
    # nothing); and the other masks (sliding windows, overlays), whose FlexAttention inside the compiled layers
    # was not shown right (packed rows there: loss off by 2e-4, weights by 1 % after one step on torch 2.11,
    # masked_flex_parity in integration/PERF.md).
    return sdpa(**args)


class PackedBlockMask:
    """A packed batch's BlockMask, marked so the attention function runs it outside the layer's compiled graph:
    inlined into a compiled decoder layer, FlexAttention with transformers' packed mask computes wrong values
    (module docstring), while the same BlockMask through a separately compiled ``flex_attention`` is right."""

    def __init__(self, block_mask: Any) -> None:
        self.block_mask = block_mask


_FLEX_OUTSIDE: Any = None


@torch.compiler.disable
def _flex_outside_graph(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
                        scale: float | None, enable_gqa: bool) -> torch.Tensor:
    global _FLEX_OUTSIDE
    if _FLEX_OUTSIDE is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX_OUTSIDE = torch.compile(flex_attention, dynamic=None)
    return _FLEX_OUTSIDE(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _refuse_beyond_plain_attention(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """SDPA (this implementation's path for every batch FlexAttention does not take) and the packed path compute
    plain softmax attention; a layer asking for more is refused rather than computed differently (``choose``
    declines the configs it can read: soft-capping, dropout)."""
    extra = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None] + (["dropout"] if kwargs.get("dropout")
                                                                            else [])
    if extra:
        raise ValueError(f"{type(module).__name__} asks its attention for {', '.join(extra)}, which "
                         f"hf_megatrain's FlexAttention routing does not compute: set masked_attention='model' (the "
                         "model's own attention implementation).")


def masked_flex_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _refuse_beyond_plain_attention(module, kwargs)
    if isinstance(attention_mask, PackedBlockMask):
        out = _flex_outside_graph(query, key, value, attention_mask.block_mask, kwargs.get("scaling"),
                                  query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    block_mask = _block_mask_type()
    name = "flex_attention" if block_mask is not None and isinstance(attention_mask, block_mask) else "sdpa"
    return ALL_ATTENTION_FUNCTIONS[name](module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Make ``MASKED_FLEX`` a transformers attention implementation (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(MASKED_FLEX, masked_flex_attention)
    AttentionMaskInterface.register(MASKED_FLEX, _masked_flex_mask)


def _attention_dropout(config: Any) -> float:
    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        v = getattr(config, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 0.0


def _head_dim(config: Any) -> int | None:
    hd = getattr(config, "head_dim", None)
    if isinstance(hd, int):
        return hd
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


FLEX_MIN_HEAD_DIM = 16  # FlexAttention's kernels refuse smaller heads (inductor: "must be at least 16")
# "auto" up to here: head sizes 16, 64 and 128 train like plain HF on an H100 (tests/test_masked_attention.py, GPU);
# at 256 (Gemma 3) the float32 parity case missed its bound (weights ~1e-3 after two steps) and its packed case
# compiled for minutes -- not settled, so such models keep SDPA unless masked_attention="flex" asks for it.
FLEX_MAX_AUTO_HEAD_DIM = 128


def choose(model: nn.Module, setting: str, compiled: bool, device_type: str, micro_batch_size: int) -> AttentionChoice:
    """Decide once whether masked batches run FlexAttention. ``setting``: the config's ``masked_attention``
    ("auto" / "flex" / "model"); "flex" refuses, saying why, where "auto" keeps the model's (and tries head sizes
    that are not a power of two or over 128, and eager layers)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if setting == "model":
        if impl == "flex_attention" and compiled:
            raise _compiled_flex_model("masked_attention='model' keeps it. Use masked_attention='auto' "
                                       "(FlexAttention for padded and packed batches) or "
                                       "torch_compile=False.")
        return AttentionChoice(False, "masked_attention='model': the model's attn_implementation")
    try:
        hd, dropout = _head_dim(config), _attention_dropout(config)
        softcap = getattr(config, "attn_logit_softcapping", None)
    except Exception:  # noqa: BLE001 - a heterogeneous config refuses global reads of per-layer attributes
        hd, dropout, softcap = -1, 0.0, None
    why_not = None
    if _block_mask_type() is None:
        why_not = f"torch {torch.__version__} has no FlexAttention"
    elif config is None or not hasattr(model, "_supports_flex_attn"):
        why_not = "not a transformers model"
    elif device_type != "cuda":
        why_not = f"training on {device_type} (FlexAttention trains on a GPU: no backward elsewhere)"
    elif impl not in ("sdpa", "flex_attention", MASKED_FLEX) and setting == "auto":
        why_not = f"the model was loaded with attn_implementation={impl!r} (kept as chosen)"
    elif not getattr(model, "_supports_flex_attn", False):
        why_not = f"{type(model).__name__} does not support flex_attention in transformers"
    elif getattr(config, "sub_configs", None):
        why_not = "a composite (multimodal) config: its towers keep their attention"
    elif hd == -1:
        why_not = "per-layer attention sizes (a heterogeneous config): not measured with FlexAttention"
    elif (hd or FLEX_MIN_HEAD_DIM) < FLEX_MIN_HEAD_DIM:
        why_not = f"head_dim {hd} (FlexAttention needs at least {FLEX_MIN_HEAD_DIM})"
    elif setting == "auto" and hd and hd > FLEX_MAX_AUTO_HEAD_DIM:
        why_not = (f"head_dim {hd} (FlexAttention under 'auto' up to {FLEX_MAX_AUTO_HEAD_DIM}: larger heads are not "
                   "shown to train like plain HF here)")
    elif setting == "auto" and hd and hd & (hd - 1):
        # (not measured here: the default stays on the head sizes every run of this kind used; "flex" may try it)
        why_not = f"head_dim {hd} is not a power of two (FlexAttention's kernels are tiled for those)"
    elif dropout > 0:
        why_not = f"attention dropout {dropout} (FlexAttention has none)"
    elif softcap:
        why_not = (f"attention logit soft-capping ({softcap}): SDPA, which runs the batches FlexAttention does "
                   "not take, has none")
    elif micro_batch_size:
        why_not = (f"micro_batch_size={micro_batch_size} splits a layer's rows, and a BlockMask's mask function "
                   "indexes the whole batch's rows")
    elif setting == "auto" and not compiled:  # (a flex_attention model keeps its own here: eager flex is right)
        why_not = ("layers run eagerly (FlexAttention is fast inside the compiled layers; eagerly transformers "
                   "compiles it again for every new shape)")
    if why_not is None:
        return AttentionChoice(True, "padded and packed batches run FlexAttention with a BlockMask (packed rows "
                                     "outside the layers' compiled graphs); unmasked ones SDPA")
    if setting == "flex":
        raise ValueError(f"masked_attention='flex' cannot run here: {why_not}. Use masked_attention='auto' "
                         "(or 'model') to keep the model's attention implementation.")
    if impl == "flex_attention" and compiled and device_type == "cuda":
        raise _compiled_flex_model(f"It cannot be routed to SDPA here: {why_not}. Load the model with "
                                   "attn_implementation='sdpa' or set torch_compile=False.")
    return AttentionChoice(False, f"the model's {impl!r}: {why_not}")


def _compiled_flex_model(what_to_do: str) -> ValueError:
    return ValueError("attn_implementation='flex_attention' with compiled layers computes packed batches wrong "
                      "(torch 2.11, also in plain transformers: integration/PERF.md, lever 52). "
                      + what_to_do)


def loaded_implementation(config: Any) -> str | None:
    """The ``attn_implementation`` to load another copy of this model with: ``MASKED_FLEX`` is set by the engine
    on transformers' default ("sdpa"), which is what a plain load asks for (a reference model then gets its own
    engine and its own choice)."""
    impl = getattr(config, "_attn_implementation", None)
    return "sdpa" if impl == MASKED_FLEX else impl


def apply(model: nn.Module, choice: AttentionChoice, forced: bool = False) -> AttentionChoice:
    """Switch the model to ``choice.implementation`` (before the layer templates copy the layers and their config), through
    transformers' own ``set_attn_implementation``; returns the choice in force. Where transformers declines the
    switch an sdpa model keeps SDPA (said in the reason); a flex_attention model (its packed batches would be
    computed wrong) or a forced ``masked_attention="flex"`` is refused. A saved config does not carry it
    (``attn_implementation`` is not written to ``config.json``)."""
    if not choice.flex:
        return choice
    register()
    model.set_attn_implementation(choice.implementation)
    now = getattr(model.config, "_attn_implementation", None)
    if now == choice.implementation:
        return choice
    declined = f"transformers did not switch {type(model).__name__} to another attention implementation"
    if now == "flex_attention":
        raise _compiled_flex_model(f"It cannot be routed to SDPA here: {declined}. Load the model with "
                                   "attn_implementation='sdpa' or set torch_compile=False.")
    if forced:
        raise ValueError(f"masked_attention='flex' cannot run here: {declined}. Use masked_attention='auto' "
                         "(or 'model') to keep the model's attention implementation.")
    return AttentionChoice(False, f"the model's {now!r}: {declined}")
