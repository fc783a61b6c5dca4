"""Tiny model configs for every family the tests cover (2-4 layers, small vocab)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)

# Per-family extras on top of COMMON, chosen so each family's distinctive feature is *active* at seq 12:
# head_dim 8 (defaults are 128-256), sliding windows (4) shorter than the sequence, soft-caps small enough that
# tanh bends (tiny random logits are ~0.1), and MoE with 2 of 4 experts per token plus the router aux loss.
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
_GPT_DROPOUT = dict(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
_GPT_IDS = dict(bos_token_id=1, eos_token_id=2)
_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4, final_logit_softcapping=0.1,
                    attn_logit_softcapping=2.0, num_hidden_layers=4, attn_implementation="eager")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4, final_logit_softcapping=0.1,
                    num_hidden_layers=4, attn_implementation="eager",
                    layer_types=["sliding_attention", "full_attention"] * 2)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=4.0, bos_token_id=1, eos_token_id=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(logits_scaling=0.25, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=32, **_MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=8, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True,
                       mlp_only_layers=[1], **_MOE)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=8, num_local_experts=4, intermediate_size=32, sliding_window=4, num_hidden_layers=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     attn_implementation="eager", **_MOE)),
    # Layers that return a tuple (hidden_states, attn_weights) and loops that read outputs[0]; dropout off (the
    # reference would draw its masks in another order), token ids inside the tiny vocabulary.
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM",
                dict(attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=4, embed_dropout=0.0,
                     attention_dropout=0.0, resid_dropout=0.0, **_GPT_IDS)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(rotary_dim=4, **_GPT_DROPOUT, **_GPT_IDS)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(rotary_dim=4, **_GPT_DROPOUT, **_GPT_IDS)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(**_GPT_IDS)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(**_GPT_IDS)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(resid_pdrop=0.0, emb_pdrop=0.0, **_GPT_IDS)),
    # A hybrid stack mixing layer classes (Mamba / attention, dense / MoE); mamba runs its PyTorch path on CPU.
    "jamba": ("JambaConfig", "JambaForCausalLM",
              dict(num_experts=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                   attn_layer_offset=1, num_hidden_layers=4, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4,
                   pad_token_id=0, **_GPT_IDS)),
    # The router aux-loss coefficient under another name (aux_loss_coef).
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM",
               dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, aux_loss_coef=0.02,
                    kv_channels=8, **_GPT_IDS)),
}
FAMILIES = tuple(_FAMILIES)


def tiny(family: str, tie: bool = False, **over) -> transformers.PreTrainedModel:
    """Build a tiny random ``<family>ForCausalLM`` in fp32 (eager attention where SDPA would differ)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    cfg_name, model_name, extra = _FAMILIES[family]
    kw = {**COMMON, "tie_word_embeddings": tie, **extra, **over}
    attn = kw.pop("attn_implementation", None)
    cfg = getattr(transformers, cfg_name)(**kw)
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(1234)
    model = getattr(transformers, model_name)(cfg).float()
    # Fine-tuning starts from trained weights, not zero biases: give biases a trained-like spread so their
    # relative error after a few AdamW steps measures the implementation, not the size of the first step.
    # (gpt-oss attention sinks and router biases start at zero too: same treatment.)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or n.endswith("sinks"):
                p.normal_(0.0, 0.02)
    return model


SPECIAL_WORDS = {0: "<pad>", 1: "<eos>", 3: "<unk>"}


def word_tokenizer(vocab_size: int = 96) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ids 0 .. vocab_size-1 (built in code: no Hub): word ``t<i>`` is id i, except the
    special tokens pad 0, eos 1, unk 3, named so that no word starts with one (special tokens are matched inside
    words first: an unk named ``t3`` would split ``t35`` into ``t3`` + ``5``). What TRL's trainers need as
    ``processing_class`` for the tiny models."""
    import tokenizers

    vocab = {SPECIAL_WORDS.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")
