"""Tiny model configs for every family the tests cover (2-4 layers, small vocab)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def tiny(family: str, tie: bool = False, **over) -> transformers.PreTrainedModel:
    """Build a tiny random ``<family>ForCausalLM`` in fp32 (eager attention where SDPA would differ)."""
    cls_cfg = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    cfg = cls_cfg[0](**{**COMMON, "tie_word_embeddings": tie, **over})
    torch.manual_seed(1234)
    model = cls_cfg[1](cfg).float()
    # Fine-tuning starts from trained weights, not zero biases: give biases a trained-like spread so their
    # relative error after a few AdamW steps measures the implementation, not the size of the first step.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model
