"""Long context (issue 18): sequence-tiled position-wise modules, layer-boundary activation offload, the planner's
long-sequence rules. CPU parity in fp32 against plain HF + torch AdamW (loss, every gradient, every weight)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner
from hf_megatrain.model.seq_tiling import tile_positionwise
from hf_megatrain.model.template import is_stochastic

from .models import tiny
from .parity import ROUNDING_TOL, rel, run_parity


# -- sequence tiling ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,chunk", [("llama", 4), ("qwen2", 8)])
def test_parity_tiled_mlp_and_norms(family, chunk):
    """Chunks of 2-4 tokens per row (batch 2) against the untiled HF model: 3 steps, GA 2, clipping. (Qwen2's
    k_proj.bias has a nearly cancelling gradient, ~1e-4 of the total with RoPE: the chunked GEMMs' other rounding
    moves it most, and Adam amplifies that; at 4 layers and 2-token chunks it reaches 2.5e-5 after 3 steps.)"""
    cfg = MegaTrainConfig(compute_dtype="float32", seq_chunk_tokens=chunk)
    worst, engine, _ = run_parity(tiny(family), config=cfg, tol=ROUNDING_TOL)
    assert engine.executor.templates[0].tiling.tiled == ["mlp", "input_layernorm", "post_attention_layernorm"]


def test_parity_tiled_with_micro_batches_and_uneven_chunks():
    cfg = MegaTrainConfig(compute_dtype="float32", seq_chunk_tokens=5, micro_batch_size=1)
    run_parity(tiny("llama"), ga=2, batch=2, seq=13, config=cfg, split_in_layer=True)


def test_tiled_gradients_as_close_to_float64_as_hf_fp32():
    """Tiling changes only the rounding: every gradient is as close to a float64 run of the model as plain HF in
    fp32 is (Adam then turns that rounding into the same order of weight differences as any other GEMM shape)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    model = tiny("llama", rope_parameters=rope)
    ref, r64 = copy.deepcopy(model), copy.deepcopy(model).double()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    ref(input_ids=ids, labels=ids).loss.backward()
    r64(input_ids=ids, labels=ids).loss.backward()
    engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32", seq_chunk_tokens=4),
                             device="cpu")
    engine(input_ids=ids, labels=ids).loss.backward()
    engine.finish_backward()
    g64 = dict(r64.named_parameters())
    hf_err = max(rel(p.grad, g64[n].grad) for n, p in ref.named_parameters())
    for n, p in ref.named_parameters():
        unit, sl = engine.store.by_name[n]
        assert rel(unit.view(unit.grad, sl), g64[n].grad) <= 2 * hf_err, n


def test_tiling_is_exact_when_the_sequence_fits_one_chunk():
    """A sequence no longer than the chunk runs the module's own forward: bit for bit the untiled engine."""
    worst, _, _ = run_parity(tiny("llama"), steps=1, config=MegaTrainConfig(compute_dtype="float32",
                                                                            seq_chunk_tokens=4096))
    assert worst["loss"] == 0.0 and worst["grad"] == 0.0


def test_tiled_backward_holds_one_chunk_of_mlp_intermediates():
    """The MLP's [tokens, intermediate] tensors saved for the backward: the whole sequence untiled, none tiled
    (the tiler saves only its input; one chunk is recomputed at a time)."""
    model = tiny("llama", intermediate_size=256)
    ids = torch.randint(0, 96, (1, 64))

    def widest_saved(chunk):
        engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32",
                                                                     seq_chunk_tokens=chunk), device="cpu")
        tmpl = engine.executor.templates[0]
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t
        x = torch.randn(1, 64, 32)
        params = tmpl.bind(torch.randn(tmpl.numel), requires_grad=True)
        pos = engine.model.model.rotary_emb(x, torch.arange(64)[None])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tmpl(params, {}, True, (x,), {"position_embeddings": pos, "attention_mask": None})
        return max(sizes)
    assert widest_saved(0) == 64 * 256
    assert widest_saved(16) < 64 * 256


class _Block(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.norm = nn.LayerNorm(8)


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8)])
        self.top_k = 1

    def forward(self, x):
        return self.experts[0](x)


def test_unsafe_modules_stay_untiled_and_say_why(caplog):
    block = _Block(_Moe())
    report = tile_positionwise(block, 4, is_stochastic)
    assert report.tiled == ["norm"] and "mixture-of-experts" in report.skipped["mlp"]
    drop = _Block(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)))
    report = tile_positionwise(drop, 4, is_stochastic)
    assert "random numbers" in report.skipped["mlp"]
    assert "run untiled" in caplog.text


def test_moe_family_tiles_its_norms_only_and_keeps_parity():
    cfg = MegaTrainConfig(compute_dtype="float32", seq_chunk_tokens=4)
    worst, engine, _ = run_parity(tiny("mixtral"), steps=2, config=cfg)
    tiling = engine.executor.templates[0].tiling
    assert "mlp" in tiling.skipped and "input_layernorm" in tiling.tiled


def test_tiled_module_that_is_not_per_token_is_refused():
    class Pool(nn.Module):
        def forward(self, x):
            return x.mean(dim=1)  # one row per sequence, not per token

    block = _Block(Pool())
    tile_positionwise(block, 2, is_stochastic)
    with pytest.raises(RuntimeError, match="seq_chunk_tokens=0"):
        block.mlp(torch.randn(1, 6, 8))


# -- activation offload ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parity_activation_offload(family):
    worst, engine, _ = run_parity(tiny(family), config=MegaTrainConfig(compute_dtype="float32",
                                                                       activation_offload="on"))
    acts = engine.executor.activations
    assert acts.offload == frozenset(range(3))
    assert acts.d2h_bytes == acts.h2d_bytes > 0  # every saved input went out and came back once


def test_parity_activation_offload_with_tiling_and_prefetch_one():
    cfg = MegaTrainConfig(compute_dtype="float32", activation_offload="on", seq_chunk_tokens=4, activation_prefetch=1)
    run_parity(tiny("llama", num_hidden_layers=4), config=cfg)


def test_parity_partial_offload_first_layers(monkeypatch):
    """The first two of four layers offloaded, the last two kept: the rule the planner's 'auto' applies."""
    model = tiny("llama", num_hidden_layers=4)
    ref = copy.deepcopy(model)
    engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    ids = torch.randint(0, 96, (2, 12))
    # the planner's answer given by hand (on a CPU 'auto' offloads nothing): the engine offloads the first two
    monkeypatch.setattr(planner, "offloaded_layers_for", lambda *a, **k: 2)
    loss = engine(input_ids=ids, labels=ids).loss
    loss.backward()
    engine.finish_backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    assert engine.executor.activations.d2h_bytes == 2 * 2 * 12 * 32 * 4
    for n, p in ref.named_parameters():
        unit, sl = engine.store.by_name[n]
        assert rel(unit.view(unit.grad, sl), p.grad) < 1e-5, n


def test_offload_two_forwards_then_backward_and_buffers_reused():
    """Two forwards before their backwards (each keeps its own host buffers), then a second step reuses the pool."""
    model = tiny("llama")
    ref = copy.deepcopy(model)
    engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32",
                                                                   activation_offload="on"), device="cpu")
    a, b = torch.randint(0, 96, (2, 12)), torch.randint(0, 96, (2, 12))
    (engine(input_ids=a, labels=a).loss + engine(input_ids=b, labels=b).loss).backward()
    engine.finish_backward()
    (ref(input_ids=a, labels=a).loss + ref(input_ids=b, labels=b).loss).backward()
    for n, p in ref.named_parameters():
        unit, sl = engine.store.by_name[n]
        assert rel(unit.view(unit.grad, sl), p.grad) < 1e-5, n
    acts = engine.executor.activations
    held = acts.host_bytes
    assert held == 2 * 3 * 2 * 12 * 32 * 4  # two forwards' buffers, back in the pool
    engine(input_ids=a, labels=a).loss.backward()
    assert acts.host_bytes == held  # reused, none allocated


def test_offload_retain_graph_second_backward():
    model = tiny("qwen2")
    engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32",
                                                                   activation_offload="on"), device="cpu")
    ids = torch.randint(0, 96, (1, 10))
    loss = engine(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    engine.finish_backward()
    first = engine.store.units[0].grad.clone()
    loss.backward()
    engine.finish_backward()
    assert rel(engine.store.units[0].grad, 2 * first) < 1e-6


# -- positions and attention ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                  {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 16}])
def test_rope_scaling_is_respected(rope):
    """The rotary tables are the model's own (resident, passed to each layer unchanged): parity with scaling set,
    and the scaling changes the loss (it is active at these positions)."""
    cfg = MegaTrainConfig(compute_dtype="float32", activation_offload="on")
    _, engine, _ = run_parity(tiny("llama", rope_parameters=rope), steps=2, seq=24, config=cfg)
    assert engine.model.model.rotary_emb.rope_type == rope["rope_type"]
    ids = torch.randint(0, 96, (1, 24))
    scaled = tiny("llama", rope_parameters=rope)(input_ids=ids, labels=ids).loss
    plain = tiny("llama")(input_ids=ids, labels=ids).loss
    assert abs(float(scaled) - float(plain)) > 1e-6


def test_templates_keep_the_models_attention_implementation():
    """No eager attention forced: the layer template runs whatever the model was built with (SDPA here)."""
    engine = MegaTrainEngine(tiny("qwen2"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    attn = engine.executor.templates[0].module.self_attn
    assert attn.config._attn_implementation == "sdpa"


# -- planner and config ---------------------------------------------------------------------------------------------
def qwen7b_shape():
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                   tie_word_embeddings=False, max_position_embeddings=524288)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
    return planner.ModelShape.from_model(model)


def test_planner_7b_at_512k_tiles_offloads_and_counts_attention():
    shape = qwen7b_shape()
    cfg = MegaTrainConfig(seq_chunk_tokens=-1, lean_store=True)
    plan = planner.estimate(shape, cfg, 524288, 1, device_type="cuda", gpu_free=131 << 30)
    assert 0 < plan.offloaded_layers < 28 and plan.device_total <= 131 << 30
    assert plan.seq_chunk_tokens == 8192  # auto: ~2 GiB of MLP intermediates per chunk at this width
    act = 524288 * 3584 * 2
    assert plan.host["offloaded activations (pinned, layer inputs)"] == plan.offloaded_layers * act
    f = plan.flops_per_token
    assert 10 < f["attention_over_6n"] < 16
    off = planner.estimate(shape, MegaTrainConfig(activation_offload="off", seq_chunk_tokens=-1, lean_store=True),
                           524288, 1, device_type="cuda", gpu_free=131 << 30)
    assert off.offloaded_layers == 0 and off.device_total > 131 << 30
    untiled = planner.estimate(shape, MegaTrainConfig(lean_store=True), 524288, 1, device_type="cuda",
                               gpu_free=131 << 30)
    assert untiled.offloaded_layers > plan.offloaded_layers  # the untiled MLP leaves less room for activations


def test_planner_offloads_nothing_at_short_sequences_or_on_cpu():
    shape = qwen7b_shape()
    assert planner.estimate(shape, MegaTrainConfig(), 4096, 1, device_type="cuda",
                            gpu_free=131 << 30).offloaded_layers == 0
    assert planner.estimate(shape, MegaTrainConfig(), 524288, 1, device_type="cpu").offloaded_layers == 0
    assert planner.estimate(shape, MegaTrainConfig(activation_offload="on"), 4096, 1, device_type="cuda",
                            gpu_free=131 << 30).offloaded_layers == 28


@pytest.mark.parametrize("bad", [dict(seq_chunk_tokens=-2), dict(activation_offload="maybe"),
                                 dict(activation_prefetch=0)])
def test_config_rejects_bad_long_context_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        MegaTrainConfig(**bad)


def test_config_long_context_values_from_strings():
    cfg = MegaTrainConfig.from_dict({"seq_chunk_tokens": "8192", "activation_offload": "on"})
    assert cfg.seq_chunk_tokens == 8192 and cfg.activation_offload == "on"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_layer_recompute_formula_vs_allocator(dtype):
    """The planner's tiled recompute bytes against the CPU allocator's peak for a tiled Llama layer (as
    test_planner's untiled calibration), and well under the untiled peak."""
    from .test_planner import _alloc_peak, layer_recompute_probe

    B, T, chunk = 2, 256, 64
    model, step = layer_recompute_probe(dtype, B, T, tile=lambda layer: tile_positionwise(layer, chunk, is_stochastic))
    step()
    measured = _alloc_peak(step)
    shape = planner.ModelShape.from_model(model)
    predicted = planner.layer_recompute_bytes(shape, B * T, dtype, chunk)
    assert 0.9 * measured <= predicted <= 1.3 * measured, (predicted, measured)
    assert predicted < planner.layer_recompute_bytes(shape, B * T, dtype)
