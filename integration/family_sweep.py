"""Parity sweep over every decoder-only causal-LM class the installed transformers can build tiny (issue 16).

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (encoder-decoder configs skipped), one subprocess:

1. builds a tiny config generically (hidden 32, 2 layers, 4 heads / 2 kv heads, head_dim 8, vocab 96, 4 experts
   top-2, windows 4, dropout 0, ... wherever the config has such an attribute; nested sub-configs such as
   ``text_config`` / ``vision_config`` shrunk the same way, per-layer overrides mapped onto the tiny layers) and the
   model in fp32, eager attention, and runs one plain forward + backward (a failure here is ``cannot-build``:
   transformers itself);
2. converts a copy of it with ``MegaTrainEngine``: an error raised from hf_megatrain code there is ``refused`` (its
   message recorded);
   then goes through a real checkpoint: ``save_pretrained`` to a temporary directory; the reference is plain
   ``AutoModelForCausalLM.from_pretrained(dir)`` (the class's own ``from_pretrained`` where no auto class maps the
   saved config; failing: ``cannot-build``), ours is
   ``hf_megatrain.from_pretrained_streamed(dir, compute_dtype=float32)``; an error of the streamed load is
   ``fail`` (stage ``streamed-load``). A parameter plain ``from_pretrained`` hands back trainable but the
   constructor made frozen (a router's score-correction bias) is compared as a weight (``frozen_in_engine``).
   Tiny values transformers' config validators reject get their default back. Each line records
   ``load`` and ``load_memory`` (the store's host bytes vs the process's peak-RSS growth during the load;
   informational, tiny models are dominated by allocator noise);
3. trains the plain model + ``torch.optim.AdamW`` and the engine side by side (tests/parity.py's protocol: 3 steps,
   gradient accumulation 2, clipping, weight decay) and records the worst relative error of the loss, every
   gradient and every updated weight;
4. noise floor: the plain model trained again in float64 (or, where float64 does not run, with the accumulated
   micro-batches and the rows of each in reverse order) against the fp32 plain run: what fp32 rounding alone gives.

Multimodal models (``<type>+image``, issue 32): the tiny ``...ForConditionalGeneration`` models of
``tests/multimodal_models.py`` (hand-made configs: vision tower, projector, image placeholder tokens) go through the
same protocol with image+text and text-only steps (step 1: two image+text micro-batches, step 2: two text-only ones,
step 3: image+text), ``pixel_values`` and the family's other inputs passed to both models' forward; the reference is
the class's own ``from_pretrained``. ``--families gemma3+image,...``; all of them run by default after the causal
LMs. ``gemma3n+image`` is the sweep's own (``SWEEP_MULTIMODAL``: its vision tower needs timm): an audio clip too in
the first step (Gemma 3n's conformer audio tower).

Libraries outside the tested set: transformers builds Gemma 3n's vision tower (``gemma3n``, ``gemma3n+image``) as
``TimmWrapperModel``, which needs timm and pillow. ``integration/install_timm_site.sh DIR`` installs them beside the
venv (``pip install --no-deps --target DIR``), ``--extra-site DIR`` puts DIR on the workers' ``PYTHONPATH``, and
each record names the packages its worker imported from outside the interpreter's installation
(``extra_libraries``, with ``extra_note``). Without them those entries are ``refused`` naming the libraries.

Status: ``pass`` (every error <= max(1e-5, 10 x noise floor)), ``fail`` (numbers or the error), ``refused``,
``cannot-build``, ``timeout``, ``skipped`` (encoder-decoder). One JSON line per family to
``integration/results/family_sweep/family_sweep_cpu.jsonl`` and a Markdown table to ``family_sweep_cpu.md``.

    PYTHONPATH=. python integration/family_sweep.py [--families llama,gpt_neo] [--jobs 2] [--timeout 120]
        [--extra-site /tmp/timm_site]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "integration" / "results" / "family_sweep"

# Families people use most first, so a time-limited run covers them.
PRIORITY = ["llama", "gpt_neo", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
            "olmo", "olmo2", "stablelm", "starcoder2", "granite", "cohere", "mixtral", "qwen2_moe", "qwen3_moe",
            "gpt_neox", "gpt2", "gptj", "falcon", "bloom", "mpt", "opt", "deepseek_v3", "gpt_oss", "codegen",
            "jamba", "jetmoe", "deepseek_v2", "cohere2", "olmo3", "olmoe", "glm", "glm4", "helium", "smollm3",
            "ministral", "granitemoe", "phimoe", "dbrx", "nemotron", "persimmon", "gpt_bigcode", "xglm", "biogpt"]

# Attribute -> tiny value, applied where the config has the attribute.
TINY = {
    "vocab_size": 96, "hidden_size": 32, "n_embd": 32, "d_model": 32, "n_embed": 32, "dim": 32, "embed_dim": 32,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "ffn_hidden_size": 64, "d_ff": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 16,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "num_key_value_heads": 2,
    "n_kv_heads": 2, "num_kv_heads": 2, "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "sliding_window": 4, "window_size": 4, "attention_window_size": 4, "rotary_dim": 4,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_top_k": 2, "top_k": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "hidden_size_per_layer_input": 8, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 12, "mamba_d_state": 4, "mamba_dt_rank": 4, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_expand": 2, "mamba_n_groups": 1, "state_size": 4, "ssm_state_size": 4, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 1,
    "output_router_logits": True, "use_cache": False,
}
# What a record whose entry imported libraries outside the tested set (``extra_libraries``) says about them.
EXTRA_NOTE = ("libraries outside the tested set, installed beside it (not into the venv) by "
              "integration/install_timm_site.sh and put on PYTHONPATH with --extra-site; torchvision's PyPI wheel is a "
              "CUDA build whose C++ ops cannot load with the CPU torch: only its Python parts are used (timm imports "
              "FrozenBatchNorm2d from it)")
IMAGE = "+image"  # suffix of the multimodal entries (tests/multimodal_models.py), trained on image+text batches
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
N_LAYERS = 2

# Hand-made tiny settings for the types the generic ones above do not build (issue 32): the fields each family's
# config class requires to agree with each other (documented in its configuration_*.py), given to the config
# class at construction and kept over the generic tiny values. Each entry says what the generic config got wrong.
HAND: dict[str, dict] = {
    # per-layer-type RoPE: the parameters keyed by the layer types the tiny stack has
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_theta": 10000.0, "rope_type": "default"}}},
    # DBRX keeps attention / FFN settings in sub-dicts; rope_theta belongs to its attention config
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
    "deepseek_v2": {"num_experts_per_tok": 2},  # default None (every published config sets it)
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},  # defaults None
    "ernie4_5_moe": {"moe_k": 2},  # top-k 6 of the tiny 4 experts
    "kimi_linear": {"num_experts_per_token": 2},  # top-k 8 of the tiny 4 experts
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_chunk_size": 4},  # SSM width = mamba heads (4) x head dim (16)
    "mamba2": {"num_heads": 8, "head_dim": 8, "chunk_size": 4},  # heads x head_dim = expand (2) x hidden (32)
    # mamba heads x head dim = 2 x hidden, attention over [hidden, embeddings] (2 x hidden; to_dict() carries the
    # full-size derived value); the shared transformer block at two depths (layers 0 and 2), each use with its own
    # q/k/v adapters (whose width assumes as many kv heads as heads, as published Zamba2 configs have): one master,
    # gradients summed over the uses (model/shared_blocks.py)
    "zamba2": {"n_mamba_heads": 4, "mamba_headdim": 16, "chunk_size": 4, "attention_head_dim": 16,
               "attention_hidden_size": 64, "num_query_groups": 4, "num_key_value_heads": 4, "num_hidden_layers": 3,
               "layers_block_type": ["hybrid", "linear_attention", "hybrid"], "hybrid_layer_ids": [0, 2],
               "use_shared_attention_adapter": True, "adapter_rank": 4},
    # Zamba's one shared attention block at two depths (the generic cut keeps two mamba layers: no hybrid layer);
    # attention over [hidden, embeddings] (2 x hidden; to_dict() carries the full-size derived widths)
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["hybrid", "linear_attention", "hybrid"],
              "attention_hidden_size": 64, "attention_head_dim": 16},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # default None
    "xlstm": {"embedding_dim": 32, "hidden_size": 32, "num_blocks": 2, "num_heads": 4, "chunk_size": 4},
    "reformer": {"is_decoder": True, "axial_pos_embds": False, "attn_layers": ["local", "local"],
                 "local_attn_chunk_length": 4},  # a causal LM only as a decoder; axial shapes fix the length
    "xmod": {"default_language": "en_XX"},  # adapters are per language: one must be chosen
    # the QSA indexer's sizes default to None (published configs set them): 4 query heads of 8 over one shared key head
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
    "flint": {"mlp_only_layers": [0]},  # the generic cut keeps [0, 1]: no MoE layer left, no router logits
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]},  # both tiny layers hash-routed: no router logits
    # input / recurrent / output layers that must add up to the stack (the recurrent block runs n_recurrent_loops
    # times); layer types given without the "mlp" blocks its to_dict() interleaves (the constructor would halve them)
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "doge": {"is_moe": True},  # the default is the dense MLP: the product-key MoE and its router aux loss
    # the audio encoder's defaults (24 conformer blocks, 1024 channels) outweigh the tiny text decoder, so the
    # stack finder would stream the audio tower; a tiny audio tower and a wider text MLP keep the language model
    # the largest stack, as in the published model
    "phi4_multimodal": {"intermediate_size": 256,
                        "audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_blocks": 2,
                                         "num_attention_heads": 4, "ext_pw_out_channel": 32,
                                         "depthwise_separable_out_channel": 32, "nemo_conv_channels": 32,
                                         "dropout_rate": 0.0}},
    # Gemma 4 assistants (speculative-decoding drafts): a tiny Gemma 4 text model whose every layer reads the target
    # model's keys/values (num_kv_shared_layers = num_hidden_layers) and has no per-layer inputs, as the assistant
    # config's validator requires (the default text config has them: it does not build); a target width of 32
    "gemma4_assistant": {"backbone_hidden_size": 32, "text_config": {
        "model_type": "gemma4_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "global_head_dim": 8, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
        "max_position_embeddings": 64, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": 2}},
    # KV sharing (the last num_kv_shared_layers layers read the K/V of earlier ones) needs layers of both kinds
    # before the shared ones: 4 layers, the last 2 shared
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.0] * 4,
                     "intermediate_size": [64] * 4,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
    # the same KV sharing for Gemma 4 (its default shares none); full-attention head_dim 8, not 512: with 512 this
    # tiny model's fp32 rounding alone reaches 1e-3 in the gradients by step 3 (a noise floor that proves nothing)
    "gemma4_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "global_head_dim": 8,
                    "layer_types": ["sliding_attention", "full_attention"] * 2},
}


HAND["gemma4_unified_assistant"] = HAND["gemma4_assistant"]
# Gemma 3n's multimodal model: the text model above (KV sharing, per-layer inputs, AltUp); its MobileNetV5 vision
# tower (timm's, whose MSFA output width is fixed at 2048 = vision hidden_size) with 1/16 of the channels and a 2x2
# soft-token grid (4 image tokens, not 256), its layer scales initialised to 0.1 (timm's 1e-5 init leaves ~1e-5
# weights whose Adam steps fp32 rounding alone moves by 3e-3 relative after 3 steps: a noise floor that proves
# nothing; a trained tower's are larger); a 1-block conformer audio tower (12 blocks of 1536 by default)
HAND["gemma3n"] = {
    "text_config": {"model_type": "gemma3n_text", "vocab_size": 96, "vocab_size_per_layer_input": 96,
                    "hidden_size": 32, "hidden_size_per_layer_input": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4, "max_position_embeddings": 64,
                    "laurel_rank": 8, "use_cache": False, **HAND["gemma3n_text"]},
    "vision_config": {"model_args": {"channel_multiplier": 0.0625, "msfa_output_resolution": 2,
                                     "layer_scale_init_value": 0.1}},
    "audio_config": {"hidden_size": 32, "input_feat_size": 16, "conf_num_hidden_layers": 1,
                     "conf_num_attention_heads": 4, "sscp_conv_channel_size": [8, 8]},
    "vision_soft_tokens_per_image": 4, "use_cache": False,
}

# Types plain transformers cannot train on the sweep's batches because of a bug of its own (so neither side can be
# checked): model type -> (what its error says, the bug). Recorded as refused, naming the bug.
UPSTREAM: dict[str, tuple[str, str]] = {
    "git": ("Expected input batch_size", "transformers 5.24 GitForCausalLM.forward drops the first image_patch_tokens "
            "((image_size / patch_size)^2 + 1) logit positions before its loss whether or not pixel_values were given "
            "(modeling_git.py: 'shifted_logits = logits[:, num_image_tokens:-1, :]'), so a text-only batch with labels "
            "fails; GIT is an image-captioning model"),
    "llama4+image": ("has no attribute 'image_outputs'", "transformers 5.24 Llama4ForConditionalGeneration.forward "
                     "returns 'image_outputs=outputs.image_outputs' where outputs is its language model's "
                     "MoeCausalLMOutputWithPast, which has no such field: every forward raises, with or without "
                     "images, return_dict=False too (the output object is built before the tuple)"),
}


def _not_built(rec: dict, model, e: Exception) -> dict:
    """The record of a type whose plain tiny model failed (``model``: None where it was not built): refused where
    hf_megatrain refuses to convert it (not a decoder LM) or ``UPSTREAM`` names the bug, else cannot-build."""
    from hf_megatrain import MegaTrainConfig, MegaTrainEngine

    plain = f"{type(e).__name__}: {str(e)[:400]}"
    bug = UPSTREAM.get(rec["family"])
    bug = bug[1] if bug is not None and bug[0] in plain else None
    refusal = None
    if model is not None:
        try:
            MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32"), device="cpu")
        except Exception as c:  # noqa: BLE001
            if _from_hf_megatrain(c) and isinstance(c, (ValueError, TypeError, NotImplementedError)):
                refusal = f"{type(c).__name__}: {str(c)[:600]}"
    if refusal is None and bug is None:
        return {**rec, "status": "cannot-build", "reason": plain}
    why = "; ".join(x for x in (refusal, f"upstream bug: {bug}" if bug else None) if x)
    return {**rec, "status": "refused", "reason": f"{why} (plain transformers on the sweep's batch: {plain})"}


def _tiny_overrides(d: dict) -> dict:
    """The tiny settings for one config's dict (``to_dict()``), nested sub-configs (``text_config``,
    ``vision_config``, ``audio_config``, a BLT's ``encoder_config`` ...) shrunk the same way, recursively: a
    composite model builds its towers from those, and the top-level keys alone leave them full size (gemma3's
    SigLIP tower and 262k-token text model, mllama's 40-layer stack: minutes, or out of memory)."""
    old_layers = next((d[k] for k in LAYER_KEYS if isinstance(d.get(k), int)), None)
    over: dict = {}
    for k, v in TINY.items():
        if k in d and (d[k] is None or isinstance(d[k], type(v)) or isinstance(v, int) and isinstance(d[k], float)):
            if d[k] is None and k not in ("sliding_window", "head_dim", "q_lora_rank", "window_size",
                                          "num_key_value_heads"):
                continue
            over[k] = v
    for k in LAYER_KEYS:
        if isinstance(d.get(k), int):
            over[k] = N_LAYERS
    for k, v in d.items():  # dropout off (the two runs would draw masks differently), ids inside the vocabulary
        if ("dropout" in k or "pdrop" in k or k.endswith("_drop")) and isinstance(v, float):
            over[k] = 0.0
        if k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id"):
            if isinstance(v, int) and v >= 96:
                over[k] = {"bos_token_id": 1, "eos_token_id": 2}.get(k, 0)
            elif isinstance(v, list):
                over[k] = [x if x < 96 else 2 for x in v]
        # per-layer lists: keep the pattern's first N_LAYERS entries
        if isinstance(v, list) and old_layers and len(v) == old_layers and old_layers != N_LAYERS:
            over[k] = v[:N_LAYERS]
        if k in ("mlp_only_layers", "cross_attention_layers") and isinstance(v, list):
            over[k] = [x for x in v if isinstance(x, int) and x < N_LAYERS]
        if isinstance(v, dict) and (k.endswith("_config") or "model_type" in v):  # a nested sub-config
            over[k] = {**v, **_tiny_overrides(v)}
        # other widths of the model (a BLT's global hidden size seen by its local encoder/decoder)
        if k.startswith("hidden_size_") and k not in TINY and isinstance(v, int) and not isinstance(v, bool) \
                and v > 32:
            over[k] = 32
        # other vocabularies (per-layer-input embeddings, hash n-gram tables): as small as the main one
        if ("vocab_size" in k or k.endswith("_vocab")) and isinstance(v, int) and not isinstance(v, bool) \
                and v > 96:
            over[k] = 96
    if "kv_lora_rank" in d:  # MLA: as many kv heads as heads, qk head = nope + rope
        over.update(num_key_value_heads=4, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8, head_dim=4)
        if "qk_head_dim" in d:
            over["qk_head_dim"] = 8
        if "n_group" in d:
            over["n_group"] = 2
    if "layer_types" in d and isinstance(d["layer_types"], list) and d["layer_types"]:
        kinds = list(dict.fromkeys(d["layer_types"]))  # both kinds in the tiny stack where there are several
        over["layer_types"] = (kinds * N_LAYERS)[:N_LAYERS] if len(kinds) > 1 else [kinds[0]] * N_LAYERS
    plc = d.get("per_layer_config")
    if isinstance(plc, dict) and plc and old_layers:  # per-layer overrides keyed by layer index
        old_types, new_types = d.get("layer_types"), over.get("layer_types")
        new: dict = {}
        for key, val in plc.items():
            i = int(key)
            if isinstance(val, dict):  # the tiny value where there is one (config validators tie per-layer
                # dimensions to the global ones: dots3's sliding layers need head_dim = nope + rope)
                val = {kk: (over[kk] if kk in over and not isinstance(over[kk], (dict, list)) else vv)
                       for kk, vv in val.items()}
            if old_types and new_types and i < len(old_types):  # onto the tiny layers of the same type
                targets = [j for j, t in enumerate(new_types) if t == old_types[i]]
            else:
                targets = [i] if i < N_LAYERS else []
            for j in targets:
                new.setdefault(f"{j:02d}", val)
        over["per_layer_config"] = new
    return over


def _set_overrides(cfg, over: dict) -> None:
    """Set ``over`` as attributes, into sub-config objects where ``cfg`` holds one under that key."""
    for k, v in over.items():
        try:
            sub = getattr(cfg, k, None) if isinstance(v, dict) else None
        except Exception:  # noqa: BLE001  # a per-layer attribute read globally (heterogeneous configs)
            sub = None
        if isinstance(v, dict) and hasattr(sub, "to_dict"):
            _set_overrides(sub, {kk: vv for kk, vv in v.items() if sub.to_dict().get(kk, object()) != vv})
        else:
            setattr(cfg, k, v)


def _build_config(base, d: dict, over: dict):
    try:
        return type(base)(**{**d, **over})
    except Exception:  # noqa: BLE001  # some derived keys do not round-trip through to_dict: set attributes instead
        cfg = type(base)()
        _set_overrides(cfg, over)
        return cfg


def _invalid(cfg) -> bool:
    try:
        if hasattr(cfg, "validate"):
            cfg.validate()
        return False
    except Exception:  # noqa: BLE001
        return True


def _config_class(model_type: str):
    """The config class the type's causal-LM class takes: a composite (multimodal) type's ``...ForCausalLM`` is its
    text model (qwen3_5, llama4, emu3 ...) and takes the text config, not the type's own composite one."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        own = type(AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001  # defaults its own validator rejects
        own = type(AutoConfig.for_model(model_type, **HAND.get(model_type, {})))
    wanted = getattr(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None), "config_class", None)
    return wanted if isinstance(wanted, type) and wanted is not own and getattr(wanted, "model_type", "") else own


def tiny_config(model_type: str):
    import torch  # noqa: F401

    hand = HAND.get(model_type, {})
    cls = _config_class(model_type)
    hand = hand or HAND.get(getattr(cls, "model_type", ""), {})  # a composite type's text model: the text type's
    try:  # (the hand values alone can disagree with the full-size defaults; with the tiny ones they agree)
        base = cls()
    except Exception:  # noqa: BLE001  # a default its own validator rejects
        base = cls(**hand)
    d = base.to_dict()
    over = {**_tiny_overrides(d), **hand}
    cfg = _build_config(base, d, over)
    if _invalid(cfg):  # transformers' validators (run again by save_pretrained) reject a tiny value: put back the
        trials = [{kk: vv for kk, vv in over.items() if kk != k}  # default of the first one that fixes it
                  for k, v in over.items() if not isinstance(v, dict)]
        if "qk_nope_head_dim" in over and "qk_rope_head_dim" in over:  # MLA whose head_dim is nope + rope
            hd = over["qk_nope_head_dim"] + over["qk_rope_head_dim"]
            plc = {k: {**v, "head_dim": hd} if "head_dim" in v else v
                   for k, v in (over.get("per_layer_config") or {}).items()}
            trials.append({**over, "head_dim": hd, **({"per_layer_config": plc} if plc else {})})
        for trial_over in trials:
            trial = _build_config(base, d, trial_over)
            if not _invalid(trial):
                cfg = trial
                break
    cfg._attn_implementation = "eager"
    for k in getattr(cfg, "sub_configs", None) or {}:
        sub = getattr(cfg, k, None)
        if hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = "eager"
    return cfg


def _batches(steps, ga, batch, seq, vocab, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(ga):
            ids = torch.randint(3, vocab, (batch, seq), generator=g)
            labels = ids.clone()
            labels[0, : seq // 3] = -100
            micro.append((ids, labels))
        out.append(micro)
    return out


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _plain_train(model, batches, lr, wd, mgn, dtype, reverse=False):
    """Plain HF + torch.optim.AdamW (Trainer semantics); returns per-step losses, grads and weights."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.parity import reference_optimizer

    m = copy.deepcopy(model).to(dtype)
    opt = reference_optimizer(m, lr, wd)
    losses, grads, weights = [], [], []
    for micro in batches:
        n_items = sum(int((mb[1][:, 1:] != -100).sum()) for mb in micro)
        step_losses = [None] * len(micro)
        order = list(range(len(micro)))[::-1] if reverse else range(len(micro))
        for j in order:
            ids, lab, kw = _micro(micro[j], dtype)
            if reverse and not kw:  # the rows too: two micro-batches reversed alone sum exactly as in order
                ids, lab = ids.flip(0), lab.flip(0)
            out = m(input_ids=ids, labels=lab, num_items_in_batch=torch.tensor(n_items), **kw)
            out.loss.backward()
            step_losses[j] = out.loss.detach().double()
        losses.append(step_losses)
        grads.append({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})
        if mgn:
            torch.nn.utils.clip_grad_norm_(m.parameters(), mgn)
        opt.step()
        opt.zero_grad()
        weights.append({n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad})
    return losses, grads, weights


def _micro(mb: tuple, dtype=None) -> tuple:
    """``(input_ids, labels, other inputs)`` of a micro-batch ``(ids, labels[, inputs])``; floating inputs (pixel
    values) in ``dtype`` where given."""
    kw = dict(mb[2]) if len(mb) > 2 else {}
    if dtype is not None:
        kw = {k: v.to(dtype) if hasattr(v, "is_floating_point") and v.is_floating_point() else v
              for k, v in kw.items()}
    return mb[0], mb[1], kw


def _compare(a, b, lr, eps=1e-8):
    """Worst relative error of run ``a`` against run ``b`` (null-gradient parameters in absolute terms).

    A null-gradient parameter (true gradient zero: only fp32 rounding reaches it) moves by what Adam makes of that
    noise: with ``|g| << eps`` each step is about ``|g| / eps`` of a full step, so two runs whose rounding noise
    differs legitimately differ by up to ``2 |g|max / eps`` steps per step (HunYuan-MoE's router gate: gradients
    ~1e-10, 4e-3 steps apart after 3 steps). ``null_grad_excess``: the worst such difference over that allowance
    (at least 1e-3 steps); above 1 a null-gradient parameter moved more than its own noise can move it.

    The same holds for null-gradient *elements* of a parameter with a gradient (below 1e-6 of the total norm in both
    runs and not exactly zero in both, at any step so far): they are compared the same way and left out of its
    relative weight error.
    DeepSeek-V4's layer-0 hyper-connection ``attn_hc.base`` / ``attn_hc.fn``: the entries of the "pre" weights that
    collapse the hc_mult streams, identical at layer 0, into the RMS-normed attention input get ~5e-10 from float64
    (the norm's scale invariance cancels the rest) and ~1e-10 of fp32 cancellation noise from each fp32 run, which
    Adam turns into ~0.01-step moves: plain fp32 is 1.3e-2 (relative) from float64 on that parameter after 3 steps,
    hf_megatrain 1.5e-2, the two 8.5e-3 apart (float64 run with the experts' eager loop: grouped_mm has no float64
    kernel); its other entries agree to 8e-6. The gradients of the next steps, taken at those weights, then differ
    by ~1e-4 (step 1: 1.4e-6), as plain fp32 does from itself with its rows reversed (1.2e-4: the noise floor)."""
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    la, ga, wa = a
    lb, gb, wb = b
    null = set()
    allow: dict[str, float] = {}  # per null-gradient parameter: Adam steps its noise gradients allow so far
    null_el: dict[str, object] = {}  # per parameter with null-gradient elements: their mask so far
    for s in range(len(lb)):
        for x, y in zip(la[s], lb[s]):
            worst["loss"] = max(worst["loss"], _rel(x, y))
        total = sum(float(g.double().pow(2).sum()) for g in gb[s].values()) ** 0.5
        for n, g in gb[s].items():
            ours_null = n not in ga[s] or float(ga[s][n].norm()) < 1e-6 * total  # (else: a gradient error below)
            if float(g.norm()) < 1e-6 * total and ours_null:
                null.add(n)
                gmax = max(float(g.abs().max()), float(ga[s][n].abs().max()) if n in ga[s] else 0.0)
                allow[n] = allow.get(n, 0.0) + 2 * min(1.0, gmax / eps)
                continue
            if n not in ga[s]:
                worst["grad"] = float("inf")
                continue
            worst["grad"] = max(worst["grad"], _rel(ga[s][n], g))
            el = (g.abs() < 1e-6 * total) & (ga[s][n].abs() < 1e-6 * total) & ((g != 0) | (ga[s][n] != 0))
            if bool(el.any()):
                null_el[n] = el | null_el[n] if n in null_el else el
                gmax = max(float(g[el].abs().max()), float(ga[s][n][el].abs().max()))
                allow[n] = allow.get(n, 0.0) + 2 * min(1.0, gmax / eps)
        for n, w in wb[s].items():
            if n in null_el and n not in null:  # null-gradient elements: as null parameters, the rest relative
                el = null_el[n]
                moved = float((wa[s][n].double() - w.double())[el].abs().max()) / lr
                worst["null_grad_step"] = max(worst.get("null_grad_step", 0.0), moved)
                worst["null_grad_excess"] = max(worst.get("null_grad_excess", 0.0), moved / max(1e-3, allow[n]))
                if not bool(el.all()):
                    worst["weight"] = max(worst["weight"], _rel(wa[s][n][~el], w[~el]))
                continue
            if n in null:
                # in units of one Adam step (kept out of the relative errors so it never inflates a noise floor)
                moved = float((wa[s][n].double() - w.double()).abs().max()) / lr
                worst["null_grad_step"] = max(worst.get("null_grad_step", 0.0), moved)
                worst["null_grad_excess"] = max(worst.get("null_grad_excess", 0.0),
                                                moved / max(1e-3, allow.get(n, 0.0)))
                continue
            worst["weight"] = max(worst["weight"], _rel(wa[s][n], w))
    return worst


def _engine_train(model, batches, lr, wd, mgn, engine_box):
    import torch

    from hf_megatrain import MegaTrainConfig, MegaTrainEngine

    engine = engine_box["engine"]
    opt = engine.create_optimizer(lr=lr, weight_decay=wd, max_grad_norm=mgn)
    captured = {}
    if hasattr(opt, "gradient_hooks"):
        opt.gradient_hooks.append(lambda i, first, g, sq: captured.__setitem__(i, g.clone()) if first else None)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    losses, grads, weights = [], [], []
    for micro in batches:
        n_items = sum(int((mb[1][:, 1:] != -100).sum()) for mb in micro)
        step_losses = []
        for mb in micro:
            ids, lab, kw = _micro(mb)
            loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items, **kw).loss
            loss.backward()
            step_losses.append(loss.detach().double().cpu())
        engine.finish_backward()
        losses.append(step_losses)
        g = {}
        for n in names:
            if n not in engine.store.by_name:  # frozen on our side (see _engine_weight): no gradient
                continue
            unit, ps = engine.store.by_name[n]
            grad = captured.get(unit.index) if unit.grad is None else unit.grad
            if grad is not None:
                g[n] = unit.view(grad, ps).detach().clone().cpu()
        grads.append(g)
        opt.step()
        opt.wait()
        opt.zero_grad()
        weights.append({n: _engine_weight(engine, n).detach().clone().cpu() for n in names})
    return losses, grads, weights


def _engine_weight(engine, name: str):
    """A parameter's value on our side: its master, or, for one the engine holds frozen (``requires_grad=False`` in
    the constructor, e.g. a router's score-correction bias; plain ``from_pretrained`` hands such parameters back
    with ``requires_grad=True``, but they get no gradient, so AdamW never steps them), its frozen copy."""
    if name in engine.store.by_name:
        return engine.store.master_tensor(name)
    if name in engine.store.frozen_by_name:
        return engine.store.frozen_tensor(name).float()
    return dict(engine.model.named_parameters())[name].float()


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux: ``5`` to /proc/self/clear_refs) and return the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kb("VmRSS") or 0


def _peak_rss() -> int | None:
    return _status_kb("VmHWM")


def _from_hf_megatrain(exc: BaseException) -> bool:
    tb = traceback.extract_tb(exc.__traceback__)
    return bool(tb) and "hf_megatrain" in tb[-1].filename and "site-packages" not in tb[-1].filename


def worker(model_type: str) -> dict:
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.set_num_threads(1)
    if model_type.endswith(IMAGE):
        return _worker_multimodal(model_type)
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    rec = {"family": model_type, "model_class": cls_name, "status": None, "transformers": transformers.__version__}
    lr, wd, mgn, steps, ga, batch, seq = 1e-3, 0.1, 1.0, 3, 2, 2, 12
    # 1. build tiny + plain forward/backward
    model = None
    try:
        cfg = tiny_config(model_type)
        if getattr(cfg, "is_encoder_decoder", False):
            return {**rec, "status": "skipped", "reason": "encoder-decoder"}
        cls = getattr(transformers, cls_name)
        torch.manual_seed(1234)
        model = cls(cfg).float()
        with torch.no_grad():  # trained-like biases (tests/models.py)
            for n, p in model.named_parameters():
                if n.endswith("bias") or n.endswith("sinks"):
                    p.normal_(0.0, 0.02)
        model.train()
        rec["params"] = sum(p.numel() for p in model.parameters())
        batches = _batches(steps, ga, batch, seq, int(getattr(cfg, "vocab_size", 96) or 96))
        probe = copy.deepcopy(model)
        out = probe(input_ids=batches[0][0][0], labels=batches[0][0][1])
        out.loss.backward()
        if not torch.isfinite(out.loss):
            raise RuntimeError(f"non-finite plain loss {float(out.loss)}")
        del probe
    except ImportError as e:  # a tower transformers builds from a library outside the tested set (gemma3n's vision
        # tower: timm + PIL; its config cannot leave the tower out): refused, with the libraries it needs
        return {**rec, "status": "refused", "reason": f"needs a library outside the tested set: {str(e).strip()[:400]}"}
    except Exception as e:  # noqa: BLE001
        return _not_built(rec, model, e)
    return _check(rec, model, cls, batches, lr, wd, mgn)


# Gemma 3n's token layout, tiny: the text vocabulary ends with the vision then the audio "hard" tokens (as the real
# 262144 + 128 + 128), the placeholders the second of each (262145, 262273), the audio padding token the last id
GEMMA3N_IDS = {"vocab": 128, "vision_offset": 112, "audio_offset": 120, "image": 113, "audio": 121}


def _gemma3n_multimodal():
    """Gemma 3n with images and audio: the sweep's tiny ``gemma3n`` config (``HAND``) with ``GEMMA3N_IDS``' layout,
    a 2x2 grid of soft tokens per image, 4 per audio clip (64 frames: 16 after the two stride-2 convolutions, 4
    after the conformer's 4x reduction)."""
    import transformers

    hand, ids = HAND["gemma3n"], GEMMA3N_IDS
    text = {**hand["text_config"], "vocab_size": ids["vocab"], "vocab_size_per_layer_input": ids["vocab"]}
    return transformers.Gemma3nForConditionalGeneration(transformers.Gemma3nConfig(**{
        **hand, "text_config": text, "image_token_id": ids["image"], "audio_token_id": ids["audio"],
        "vision_config": {**hand["vision_config"], "vocab_offset": ids["vision_offset"], "vocab_size": 8},
        "audio_config": {**hand["audio_config"], "vocab_offset": ids["audio_offset"], "vocab_size": 8},
        "audio_soft_tokens_per_image": 4}))


def _gemma3n_batch(seed: int, image: bool) -> tuple:
    """Gemma 3n's micro-batch: text only, or an image (4 placeholders at 1..4, 32x32 pixels: MobileNetV5 downsamples
    32x, its fusion adapter resizes to the 2x2 grid) and, in the first step's micro-batches, an audio clip too (4
    placeholders at 8..11, the second row's last 16 frames masked); labels ignore the placeholders."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt without loss
    if not image:
        return ids, labels, {}
    ids[:, 1:5] = GEMMA3N_IDS["image"]
    kw = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    if seed < 10:
        ids[:, 8:12] = GEMMA3N_IDS["audio"]
        mask = torch.ones(2, 64, dtype=torch.bool)
        mask[1, 48:] = False
        kw.update(input_features=torch.randn(2, 64, 16, generator=g), input_features_mask=mask)
    labels[ids >= GEMMA3N_IDS["vision_offset"]] = -100
    return ids, labels, kw


# The ``+image`` entries the sweep adds to tests/multimodal_models.py's: those whose towers need a library outside
# the tested set (Gemma 3n's MobileNetV5 vision tower is timm's), kept out of the CPU tests that import that module:
# type -> (builder, batch(seed, image), what the three steps hold)
SWEEP_MULTIMODAL = {"gemma3n": (_gemma3n_multimodal, _gemma3n_batch,
                                "image+audio+text, text only, image+text (GA 2)")}


def extra_libraries() -> dict[str, str]:
    """The top-level packages this process imported from outside the interpreter's own installation and this repo
    (``PYTHONPATH=/tmp/timm_site``: timm, torchvision, PIL for Gemma 3n's vision tower), ``name version (dir)``:
    what an entry needed beyond the tested set, written into its record."""
    prefixes = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix})
    found: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        where = getattr(mod, "__file__", None)
        if "." in name or not where:
            continue
        path = str(Path(where).resolve())
        if path.startswith(prefixes) or path.startswith(str(ROOT)):
            continue
        site = str(Path(path).parent.parent if Path(path).name == "__init__.py" else Path(path).parent)
        found[name] = f"{getattr(mod, '__version__', '?')} ({site})"
    return found


def _worker_multimodal(family: str) -> dict:
    """A ``<type>+image`` entry: the tiny multimodal model of tests/multimodal_models.py (or ``SWEEP_MULTIMODAL``),
    image+text and text-only steps (module docstring)."""
    import transformers

    sys.path.insert(0, str(ROOT))
    import tests.multimodal_models as mm
    from tests.multimodal_models import multimodal_batch, tiny_multimodal

    model_type = family[: -len(IMAGE)]
    own = SWEEP_MULTIMODAL.get(model_type)
    if own is not None:  # (tiny_multimodal's initialisation, the sweep's builder)
        mm.FAMILIES = {**mm.FAMILIES, model_type: (own[0], 0, None)}
    batch_of = own[1] if own is not None else (lambda seed, image: multimodal_batch(model_type, seed, image))
    rec = {"family": family, "model_class": None, "status": None, "transformers": transformers.__version__,
           "batches": own[2] if own is not None else "image+text, text only, image+text (GA 2)"}
    model = None
    try:
        model = tiny_multimodal(model_type)
        rec["model_class"] = type(model).__name__
        model.train()
        rec["params"] = sum(p.numel() for p in model.parameters())
        batches = [[batch_of(10 * s + j, image) for j in range(2)] for s, image in enumerate((True, False, True))]
        probe = copy.deepcopy(model)
        ids, lab, kw = batches[0][0]
        out = probe(input_ids=ids, labels=lab, **kw)
        out.loss.backward()
        del probe
    except ImportError as e:  # (as in worker: a tower built from a library outside the tested set)
        return {**rec, "status": "refused", "reason": f"needs a library outside the tested set: {str(e).strip()[:400]}"}
    except Exception as e:  # noqa: BLE001
        return _not_built(rec, model, e)
    return _check(rec, model, type(model), batches, 1e-3, 0.1, 1.0)


def _check(rec: dict, model, cls, batches, lr: float, wd: float, mgn: float) -> dict:
    """Steps 2-4 of the module docstring for a built tiny ``model`` of class ``cls``."""
    import torch
    import transformers

    from hf_megatrain import MegaTrainConfig, MegaTrainEngine, from_pretrained_streamed

    cls_name = cls.__name__
    model_type = rec["family"]

    # 2. conversion of the in-memory model first: a refusal (hf_megatrain's message) is told apart from a failure
    #    of the streamed load itself, which is a fail
    try:
        MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e)[:600]}"
        if _from_hf_megatrain(e) and isinstance(e, (ValueError, TypeError, NotImplementedError)):
            return {**rec, "status": "refused", "reason": msg}
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {**rec, "status": "fail", "stage": "convert", "reason": msg, "where": f"{tb.filename}:{tb.lineno}"}
    # 2b. through a real checkpoint: save_pretrained, then plain from_pretrained (the reference) and
    #    from_pretrained_streamed (ours) from the same directory
    rec["load"] = "save_pretrained -> from_pretrained_streamed (reference: plain from_pretrained)"
    tmp = tempfile.TemporaryDirectory(prefix=f"sweep-{model_type}-")
    try:
        model.save_pretrained(tmp.name)
    except Exception as e:  # noqa: BLE001
        return {**rec, "status": "cannot-build", "reason": f"save_pretrained: {type(e).__name__}: {str(e)[:400]}"}
    del model
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp.name, dtype=torch.float32,
                                                                       attn_implementation="eager")
        except ValueError as e:  # a config class no auto class maps (MllamaForCausalLM saves its text config)
            if "Unrecognized configuration class" not in str(e):
                raise
            model = cls.from_pretrained(tmp.name, dtype=torch.float32, attn_implementation="eager")
            rec["load"] += f", {cls_name}.from_pretrained: AutoModelForCausalLM does not map the saved config"
        if type(model).__name__ != cls_name:
            raise TypeError(f"from_pretrained built {type(model).__name__}, not {cls_name}")
        model.train()
    except Exception as e:  # noqa: BLE001
        return {**rec, "status": "cannot-build", "reason": f"plain from_pretrained: {type(e).__name__}: {str(e)[:400]}"}
    unused: list[str] = []

    class _Unused(logging.Handler):
        def emit(self, r):
            unused.append(r.getMessage()[:300])

    log = logging.getLogger("hf_megatrain.hf.pretrained")
    handler = _Unused(level=logging.WARNING)
    log.addHandler(handler)
    try:
        rss0 = _reset_peak_rss()
        engine = from_pretrained_streamed(tmp.name, MegaTrainConfig(compute_dtype="float32"), device="cpu",
                                          attn_implementation="eager")
        peak = _peak_rss()
        store = int(engine.store.nbytes)
        rec["load_memory"] = {"store_bytes": store, "peak_rss_growth_bytes": None if peak is None else peak - rss0,
                              "ratio": None if peak is None or not store else round((peak - rss0) / store, 2),
                              "note": "informational: allocator and import noise dominate at this size"}
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {**rec, "status": "fail", "stage": "streamed-load", "reason": f"{type(e).__name__}: {str(e)[:600]}",
                "where": f"{tb.filename}:{tb.lineno}"}
    finally:
        log.removeHandler(handler)
    if unused:
        rec["load_unused"] = unused
    frozen_here = [n for n, p in model.named_parameters() if p.requires_grad and n not in engine.store.by_name]
    if frozen_here:  # trainable in the plain model as from_pretrained returns it, frozen in the engine
        rec["frozen_in_engine"] = frozen_here[:10]
    # 3. reference vs ours
    t0 = time.time()
    try:
        ref = _plain_train(model, batches, lr, wd, mgn, torch.float32)
    except Exception as e:  # noqa: BLE001
        return {**rec, "status": "cannot-build", "reason": f"plain training: {type(e).__name__}: {str(e)[:400]}"}
    try:
        ours = _engine_train(model, batches, lr, wd, mgn, {"engine": engine})
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {**rec, "status": "fail", "stage": "train", "reason": f"{type(e).__name__}: {str(e)[:600]}",
                "where": f"{tb.filename}:{tb.lineno}"}
    err = _compare(ours, ref, lr)
    # 4. noise floor
    try:
        noise_run = _plain_train(model, batches, lr, wd, mgn, torch.float64)
        noise = _compare(ref, noise_run, lr)
        rec["noise_method"] = "fp32 vs fp64 plain"
    except Exception:  # noqa: BLE001  # (grouped_mm experts have no float64 kernel)
        noise = _compare(_plain_train(model, batches, lr, wd, mgn, torch.float32, reverse=True), ref, lr)
        rec["noise_method"] = "fp32 plain, micro-batches and their rows reversed"
    floor = max(noise[k] for k in ("loss", "grad", "weight"))
    tol = max(1e-5, 10 * floor)
    worst = max(err[k] for k in ("loss", "grad", "weight"))
    ok = worst <= tol and (err.get("null_grad_excess", 0.0) <= 1.0
                           or err.get("null_grad_step", 0.0) <= 10 * noise.get("null_grad_step", 0.0))
    rec.update(status="pass" if ok else "fail", error=err, noise=noise, tol=tol,
               seconds=round(time.time() - t0, 2))
    if rec["status"] == "fail":
        rec["stage"] = "numbers"
        rec["reason"] = f"max error {worst:.3e} (tol {tol:.1e}), null-gradient parameter moved up to " \
                        f"{err.get('null_grad_step', 0.0):.1e} Adam steps ({err.get('null_grad_excess', 0.0):.1f} x what its noise gradients allow) ({', '.join(f'{k} {v:.2e}' for k, v in err.items())})"
    return rec


def run_one(model_type: str, timeout: float, extra_site: str = "") -> dict:
    path = os.pathsep.join(x for x in (str(ROOT), extra_site, os.environ.get("PYTHONPATH", "")) if x)
    env = {**os.environ, "PYTHONPATH": path,
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, __file__, "--worker", model_type], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"family": model_type, "status": "timeout", "reason": f"over {timeout:.0f} s",
                "wall_s": round(time.time() - t0, 1)}
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            rec = json.loads(line)
            rec["wall_s"] = round(time.time() - t0, 1)
            return rec
    return {"family": model_type, "status": "fail", "stage": "crash",
            "reason": f"worker exit code {p.returncode} (negative: killed by that signal): {(p.stderr or p.stdout)[-500:]}",
            "wall_s": round(time.time() - t0, 1)}


def _fmt(v) -> str:
    return "" if v is None else f"{v:.1e}"


def write_markdown(records: list[dict], path: Path) -> None:
    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = ["# Family parity sweep (CPU, fp32)", "",
             "Generated by `integration/family_sweep.py` (each model through `save_pretrained`: plain "
             "`from_pretrained` + torch.optim.AdamW vs `from_pretrained_streamed`, 3 steps, "
             "GA 2, clipping, decay; tolerance max(1e-5, 10 x fp32 noise floor)).", "",
             "Counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             "| family | class | status | max rel. error (loss / grad / weight) | noise floor | note |",
             "|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: r["family"]):
        e, n = r.get("error") or {}, r.get("noise") or {}
        errs = " / ".join(_fmt(e.get(k)) for k in ("loss", "grad", "weight")) if e else ""
        floor = _fmt(max(n.get(k, 0.0) for k in ("loss", "grad", "weight"))) if n else ""
        note = (r.get("reason") or "").replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {r['family']} | `{r.get('model_class', '')}` | {r['status']} | {errs} | {floor} | {note} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=str(RESULTS / "family_sweep_cpu.jsonl"))
    ap.add_argument("--append", action="store_true", help="keep the output file's other families' lines")
    ap.add_argument("--extra-site", default="", help="a directory put on the workers' PYTHONPATH for libraries "
                    "outside the tested set (integration/install_timm_site.sh: timm + pillow for gemma3n); the "
                    "lines of the entries that imported from it name them (extra_libraries)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        import warnings

        warnings.filterwarnings("ignore")
        try:
            rec = worker(a.worker)
        except Exception as e:  # noqa: BLE001
            rec = {"family": a.worker, "status": "fail", "stage": "worker", "reason": f"{type(e).__name__}: {e}"}
        extra = extra_libraries()
        if extra:  # (an entry that needed them says so, whatever its status)
            rec["extra_libraries"] = extra
            rec["extra_note"] = EXTRA_NOTE
        print(json.dumps(rec), flush=True)
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sys.path.insert(0, str(ROOT))
    from tests.multimodal_models import FAMILIES as MULTIMODAL

    multimodal = [f + IMAGE for f in {**MULTIMODAL, **SWEEP_MULTIMODAL}]
    everything = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if a.families:
        fams = [f.strip() for f in a.families.split(",") if f.strip()]
        unknown = [f for f in fams if f not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and f not in multimodal]
        if unknown:
            ap.error(f"unknown model types: {unknown}")
    else:
        fams = [f for f in PRIORITY if f in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        fams += [f for f in everything if f not in fams] + multimodal
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    if a.append and out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                records[r["family"]] = r
    for f in fams:
        records.pop(f, None)

    def flush():
        out.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
        write_markdown(list(records.values()), out.with_suffix(".md"))

    with cf.ThreadPoolExecutor(max_workers=a.jobs) as ex:
        futs = {ex.submit(run_one, f, a.timeout, a.extra_site): f for f in fams}
        for fut in cf.as_completed(futs):
            r = fut.result()
            records[r["family"]] = r
            print(f"{r['family']:28s} {r['status']:13s} {str(r.get('reason', ''))[:110]}", flush=True)
            flush()
    flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
