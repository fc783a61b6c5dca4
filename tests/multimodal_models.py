"""Tiny multimodal ``...ForConditionalGeneration`` models built in code, with text-only and image+text batches.

Each family: a tiny config (2 decoder layers of width 32, a 1-layer vision tower of width 16, 16x16 images) and the
inputs its processor would produce for one image per sequence: the image placeholder tokens in ``input_ids`` (as many
as the projector yields per image), ``pixel_values`` in the family's layout and the family's extra inputs (Gemma 3's
``token_type_ids``, Qwen-VL's ``image_grid_thw`` / ``mm_token_type_ids``, Mistral 3's ``image_sizes``, Idefics 3's
``pixel_attention_mask``). Labels ignore the image tokens, as chat-template collators do. Used by
``tests/test_multimodal.py`` and the family sweep (``integration/family_sweep.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers

VOCAB = 128
IMAGE = 100  # image placeholder token id (text ids are drawn from 3..95)
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                    temporal_patch_size=1, spatial_merge_size=2)


def _gemma3() -> transformers.PreTrainedModel:
    cfg = transformers.Gemma3Config(
        text_config=dict(**_TEXT, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=8),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4, vision_use_head=False),  # (as Gemma 3's checkpoints)
        mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_index=101, eoi_token_index=102)
    return transformers.Gemma3ForConditionalGeneration(cfg)


def _qwen2_5_vl() -> transformers.PreTrainedModel:
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(**_TEXT, rope_parameters=_MROPE),
        vision_config=dict(**_QWEN_VISION, window_size=8, fullatt_block_indexes=[0]),
        image_token_id=IMAGE, video_token_id=101, vision_start_token_id=102)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def _qwen2_vl() -> transformers.PreTrainedModel:
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(**_TEXT, rope_parameters=_MROPE),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           temporal_patch_size=1, spatial_merge_size=2),
        image_token_id=IMAGE, video_token_id=101, vision_start_token_id=102)
    return transformers.Qwen2VLForConditionalGeneration(cfg)


def _qwen3_vl() -> transformers.PreTrainedModel:
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(**_TEXT, rope_parameters={**_MROPE, "mrope_interleaved": True}),
        vision_config=dict(**_QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=IMAGE, video_token_id=101, vision_start_token_id=102)
    return transformers.Qwen3VLForConditionalGeneration(cfg)


def _qwen3_vl_moe() -> transformers.PreTrainedModel:  # MoE layers, router aux loss added by the model's forward
    cfg = transformers.Qwen3VLMoeConfig(
        text_config=dict(**_TEXT, rope_parameters={**_MROPE, "mrope_interleaved": True}, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                         output_router_logits=True, router_aux_loss_coef=0.02),
        vision_config=dict(**_QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=IMAGE, video_token_id=101, vision_start_token_id=102)
    return transformers.Qwen3VLMoeForConditionalGeneration(cfg)


def _mistral3() -> transformers.PreTrainedModel:
    cfg = transformers.Mistral3Config(
        text_config=dict(model_type="mistral", **_TEXT),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=4, head_dim=8),
        image_token_index=IMAGE, spatial_merge_size=2)
    return transformers.Mistral3ForConditionalGeneration(cfg)


def _llava() -> transformers.PreTrainedModel:
    cfg = transformers.LlavaConfig(
        text_config=dict(model_type="llama", **_TEXT),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16),
        image_token_id=IMAGE, vision_feature_layer=-1)
    return transformers.LlavaForConditionalGeneration(cfg)


def _idefics3() -> transformers.PreTrainedModel:
    cfg = transformers.Idefics3Config(
        text_config=dict(model_type="llama", **_TEXT),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4),
        image_token_id=IMAGE, scale_factor=2)
    return transformers.Idefics3ForConditionalGeneration(cfg)


def _llama4() -> transformers.PreTrainedModel:
    cfg = transformers.Llama4Config(
        text_config=dict(**_TEXT, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64,
                         interleave_moe_layer_step=1, no_rope_layers=[1, 0], attention_chunk_size=64),
        vision_config=dict(hidden_size=16, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32, pixel_shuffle_ratio=0.5),
        image_token_index=IMAGE)
    return transformers.Llama4ForConditionalGeneration(cfg)


# family -> (builder, image tokens per image, extra inputs for a batch of ``b`` images: (generator, ids) -> dict)
def _pixels(shape: tuple[int, ...]) -> Callable[[torch.Generator, torch.Tensor], dict[str, Any]]:
    return lambda g, ids: {"pixel_values": torch.randn(ids.shape[0], *shape, generator=g)}


def _gemma3_inputs(g: torch.Generator, ids: torch.Tensor) -> dict[str, Any]:
    return {"pixel_values": torch.randn(ids.shape[0], 3, 16, 16, generator=g), "token_type_ids": (ids == IMAGE).long()}


def _qwen_inputs(g: torch.Generator, ids: torch.Tensor) -> dict[str, Any]:
    b = ids.shape[0]  # a 4x4 grid of 2x2 patches per image (3 channels, 1 frame), merged 2x2: 4 tokens
    return {"pixel_values": torch.randn(b * 16, 12, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]] * b),
            "mm_token_type_ids": (ids == IMAGE).int()}


def _mistral3_inputs(g: torch.Generator, ids: torch.Tensor) -> dict[str, Any]:
    b = ids.shape[0]
    return {"pixel_values": torch.randn(b, 3, 16, 16, generator=g), "image_sizes": torch.tensor([[16, 16]] * b)}


def _idefics3_inputs(g: torch.Generator, ids: torch.Tensor) -> dict[str, Any]:
    b = ids.shape[0]
    return {"pixel_values": torch.randn(b, 1, 3, 16, 16, generator=g),
            "pixel_attention_mask": torch.ones(b, 1, 16, 16, dtype=torch.bool)}


FAMILIES: dict[str, tuple[Callable[[], transformers.PreTrainedModel], int, Callable]] = {
    "gemma3": (_gemma3, 4, _gemma3_inputs),
    "qwen2_5_vl": (_qwen2_5_vl, 4, _qwen_inputs),
    "qwen2_vl": (_qwen2_vl, 4, _qwen_inputs),
    "qwen3_vl": (_qwen3_vl, 4, _qwen_inputs),
    "qwen3_vl_moe": (_qwen3_vl_moe, 4, _qwen_inputs),
    "mistral3": (_mistral3, 4, _mistral3_inputs),
    "llava": (_llava, 4, _pixels((3, 8, 8))),
    "idefics3": (_idefics3, 4, _idefics3_inputs),
    "llama4": (_llama4, 4, _pixels((3, 16, 16))),
}


def tiny_multimodal(family: str) -> transformers.PreTrainedModel:
    """A tiny random ``<family>ForConditionalGeneration`` in fp32, eager attention, biases and zero-initialised
    matrices with a trained-like spread (as ``tests/models.py``: relative errors then measure the implementation,
    not a first step from 0)."""
    build = FAMILIES[family][0]
    torch.manual_seed(1234)
    model = build().float()
    model.config._attn_implementation = "eager"
    for k in getattr(model.config, "sub_configs", None) or {}:
        sub = getattr(model.config, k, None)
        if hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = "eager"
    with torch.no_grad():  # (and Gemma 3's projector matrix, zero-initialised: no image gradient at step 0)
        for n, p in model.named_parameters():
            if n.endswith("bias") or (p.dim() >= 2 and not p.any()):
                p.normal_(0.0, 0.02)
    return model


def multimodal_batch(family: str, seed: int, image: bool, batch: int = 2, seq: int = 16
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``(input_ids, labels, extra inputs)``: text only, or one image per sequence (placeholders at 2..)."""
    _, tokens, inputs = FAMILIES[family]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq // 4] = -100  # a prompt without loss
    if not image:
        return ids, labels, {}
    if family.startswith("qwen"):
        ids[:, 1] = 102  # <|vision_start|>
    ids[:, 2:2 + tokens] = IMAGE
    labels[ids == IMAGE] = -100
    return ids, labels, inputs(g, ids)
