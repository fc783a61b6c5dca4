"""``megatrain estimate`` counts an MoE's FLOPs from its *active* parameters (planner/active.py), checked against
hand counts of three published models from their real Hub ``config.json`` values (written here as numbers: no
network, no weights; the models are built on the meta device through ``load_shape``, the CLI's own path).

Hand-count convention (the planner's): every parameter a token runs through, embeddings and lm_head included,
norms and biases included; a routed expert block counts top_k / num_experts of itself, shared experts and routers
count whole. Published "active" figures differ by that convention (gpt-oss's 5.1B leaves out the input embedding).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner
from hf_megatrain.planner.active import expert_blocks
from hf_megatrain.planner.cli import load_shape, main
from tests.models import tiny

# deepseek-ai/DeepSeek-V3 config.json (the fields that set parameter shapes; rope_scaling and the MTP layer,
# which transformers does not build, left out)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "tie_word_embeddings": False, "attention_bias": False,
}
# openai/gpt-oss-120b config.json (quantization_config left out: the planner counts bf16/fp32 parameters)
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
    "vocab_size": 201088, "sliding_window": 128, "max_position_embeddings": 131072, "rope_theta": 150000,
    "tie_word_embeddings": False, "swiglu_limit": 7.0, "attention_bias": True, "rms_norm_eps": 1e-5,
    "initial_context_length": 4096, "layer_types": ["sliding_attention", "full_attention"] * 18,
}
# Qwen/Qwen3-30B-A3B config.json
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
}


def _deepseek_v3() -> tuple[int, int]:
    c = DEEPSEEK_V3
    H, L, V, heads = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["num_attention_heads"]
    ql, kvl, nope, rope, vd = c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], \
        c["v_head_dim"]
    attn = (H * ql + ql + ql * heads * (nope + rope)  # q_a_proj, q_a_layernorm, q_b_proj
            + H * (kvl + rope) + kvl + kvl * heads * (nope + vd)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
            + heads * vd * H)  # o_proj
    dense_mlp = 3 * H * c["intermediate_size"]
    expert = 3 * H * c["moe_intermediate_size"]  # gate, up, down
    E, k, dense = c["n_routed_experts"], c["num_experts_per_tok"], c["first_k_dense_replace"]
    router = E * H + E  # gate weight + e_score_correction_bias
    shared = c["n_shared_experts"] * expert
    common = 2 * V * H + H + L * (attn + 2 * H) + dense * dense_mlp + (L - dense) * (shared + router)
    return common + (L - dense) * E * expert, common + (L - dense) * k * expert


def _gpt_oss_120b() -> tuple[int, int]:
    c = GPT_OSS_120B
    H, L, V, I = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    attn = (H * q + q) + 2 * (H * kv + kv) + (q * H + H) + c["num_attention_heads"]  # q, k, v, o (+biases), sinks
    expert = (H * 2 * I + 2 * I) + (I * H + H)  # gate_up_proj (+bias), down_proj (+bias)
    E, k = c["num_local_experts"], c["num_experts_per_tok"]
    common = 2 * V * H + H + L * (attn + 2 * H + E * H + E)  # + router weight and bias
    return common + L * E * expert, common + L * k * expert


def _qwen3_30b_a3b() -> tuple[int, int]:
    c = QWEN3_30B_A3B
    H, L, V, hd = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attn = H * q + 2 * H * kv + q * H + 2 * hd  # q, k, v, o, q_norm, k_norm
    expert = 3 * H * c["moe_intermediate_size"]
    E, k = c["num_experts"], c["num_experts_per_tok"]
    common = 2 * V * H + H + L * (attn + 2 * H + E * H)
    return common + L * E * expert, common + L * k * expert


# (config, hand count, published total / active in billions -- a sanity check of the hand count itself)
CASES = {"deepseek_v3": (DEEPSEEK_V3, _deepseek_v3, 671, 37.5), "gpt_oss_120b": (GPT_OSS_120B, _gpt_oss_120b, 117, 5.7),
         "qwen3_30b_a3b": (QWEN3_30B_A3B, _qwen3_30b_a3b, 30.5, 3.35)}


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_flops_use_active_parameters(name, tmp_path):
    cfg, hand, pub_total, pub_active = CASES[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    total, active = hand()
    assert total == pytest.approx(pub_total * 1e9, rel=0.03) and active == pytest.approx(pub_active * 1e9, rel=0.03)
    shape = load_shape(str(path))
    assert shape.trainable + shape.frozen == pytest.approx(total, rel=1e-3)  # (exact up to buffers)
    assert shape.active == pytest.approx(active, rel=1e-3)
    flops = planner.estimate(shape, MegaTrainConfig(), 4096, 1, device_type="cuda", gpu_free=80 * 2 ** 30) \
        .flops_per_token
    assert flops["dense_6n"] == pytest.approx(6 * active, rel=0.01)
    assert flops["params_active"] == shape.active and flops["params_total"] == shape.trainable + shape.frozen
    # the old count (6 x every parameter) would be this many times too high
    assert total / active > {"deepseek_v3": 17, "gpt_oss_120b": 20, "qwen3_30b_a3b": 9}[name]


def test_estimate_cli_prints_active_parameters(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_30B_A3B))
    assert main([str(path), "--json", "--gpu-memory", "80", "--host-memory", "2000"]) == 0
    out = json.loads(capsys.readouterr().out)
    total, active = _qwen3_30b_a3b()
    assert out["params"]["active"] == pytest.approx(active, rel=0.01)
    assert out["flops_per_token"]["dense_6n"] == pytest.approx(6 * active, rel=0.01)


def test_dense_layers_and_blocks_found_from_modules():
    """DeepSeek's first_k_dense_replace and Qwen3-MoE's mlp_only_layers: no experts in those layers; expert
    count and top-k found on the modules (the router's top_k, the experts' num_experts)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, num_experts=8, num_experts_per_tok=2, vocab_size=64,
                                      mlp_only_layers=[0, 2])
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    blocks = expert_blocks(model, cfg)
    assert [b[0] for b in blocks] == ["model.layers.1.mlp.experts", "model.layers.3.mlp.experts"]
    assert all(b[2:] == (8, 2) for b in blocks)
    shape = planner.ModelShape.from_model(model)
    assert shape.routed_inactive == sum(b[1] for b in blocks) * 6 // 8


def test_dense_model_unchanged_and_engine_agrees():
    """A dense model: every parameter active. The built engine (layers in its templates) counts as the meta model."""
    dense = planner.ModelShape.from_model(tiny("llama"))
    assert dense.routed_inactive == 0 and dense.active == dense.trainable + dense.frozen
    model = tiny("qwen3_moe")
    with torch.device("meta"):
        meta = type(model)(model.config)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    shape = planner.ModelShape.from_engine(engine)
    assert shape.routed_inactive > 0 and shape == planner.ModelShape.from_model(meta)
