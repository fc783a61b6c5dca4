"""LM heads that do more than ``lm_head.weight @ h``, trained exactly (issue 32).

- a head *transform* before the projection (ModernBERT-decoder: ``decoder(lm_head(h))``, lm_head = dense -> act ->
  norm): the model's own forward runs up to the projection's input, the transform's parameters are resident;
- parameters of the output embeddings applied *after* the projection (Dory's learned per-token ``logit_scale``):
  the loss runs the head's own forward chunk by chunk (unfused);
- an MoE aux loss whose function takes other arguments (Doge's product-key router): the model's own forward
  computes it from the router logits the engine records.

Each: loss, every gradient and the weights after 3 clipped AdamW steps with gradient accumulation, against plain
transformers + torch.optim.AdamW (tests/parity.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

from .parity import run_parity

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)


def _build(cfg_name: str, model_name: str, **kw) -> transformers.PreTrainedModel:
    if not hasattr(transformers, cfg_name):  # (a family newer than this transformers, e.g. the GPU image's 5.17)
        pytest.skip(f"transformers {transformers.__version__} has no {cfg_name}")
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **kw})
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    return getattr(transformers, model_name)(cfg).float()


def _modernbert_decoder() -> transformers.PreTrainedModel:
    return _build("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM", sep_token_id=0, cls_token_id=0,
                  layer_types=["full_attention", "sliding_attention"], sliding_window=4)


def _dory() -> transformers.PreTrainedModel:
    model = _build("DoryConfig", "DoryForCausalLM", num_key_value_heads=2, head_dim=8, sliding_window=4,
                   num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    with torch.no_grad():  # a trained-like spread, so a skipped or mis-applied scale shows in the loss
        model.lm_head.logit_scale.mul_(torch.empty_like(model.lm_head.logit_scale).uniform_(0.5, 1.5))
    return model


def _doge_moe(**kw) -> transformers.PreTrainedModel:
    model = _build("DogeConfig", "DogeForCausalLM", num_key_value_heads=2, is_moe=True, num_experts=4,
                   num_experts_per_tok=2, **{"output_router_logits": True, "router_aux_loss_coef": 0.5, **kw})
    # The attention's dynamic-mask rates A get a gradient that is nearly all cancellation (fp32 vs fp64 of plain
    # transformers alone differ by 2e-4 after one update): held constant (a buffer, in both runs), so the parity
    # measures the router / aux-loss path this test is about, to 1e-5.
    for layer in model.model.layers:
        a = layer.self_attn.A.detach().clone()
        del layer.self_attn.A
        layer.self_attn.register_buffer("A", a.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0)))
    return model


def test_head_transform_before_projection_parity():
    """ModernBERT-decoder's dense -> act -> norm before the projection: applied by the model's own forward, its
    parameters trained as resident parts (every gradient compared, theirs included); the projection stays a
    plain weight (fusable)."""
    model = _modernbert_decoder()
    _, engine, _ = run_parity(model)
    assert "unfused" not in engine.head_extras.loss_impl_reason


def test_head_parameters_after_projection_parity():
    """Dory's learned logit_scale, applied by its lm_head's forward: the loss runs that forward per chunk (2 chunks
    here), unfused, and says so; logit_scale gets its gradient and its AdamW update."""
    model = _dory()
    _, engine, ref = run_parity(model, config=MegaTrainConfig(compute_dtype="float32", loss_chunk_tokens=16))
    assert "unfused" in engine.head_extras.loss_impl_reason and "logit_scale" in engine.head_extras.loss_impl_reason
    moved = engine.store.master_tensor("lm_head.logit_scale") - model.lm_head.logit_scale.detach()
    assert float(moved.abs().max()) > 0  # trained (and equal to the reference: run_parity compared it)


def test_head_parameters_refuse_a_fused_loss_by_name():
    with pytest.raises(ValueError, match="logit_scale.*no fused kernel"):
        MegaTrainEngine(_dory(), MegaTrainConfig(compute_dtype="float32", loss_impl="liger"), device="cpu")


@pytest.mark.parametrize("build", [_dory, _modernbert_decoder, _doge_moe], ids=["dory", "modernbert", "doge"])
def test_eval_loss_and_logits_match_plain(build):
    """Without gradients (evaluation) the same heads give plain transformers' loss and logits."""
    model = build()
    ref = copy.deepcopy(model).eval()
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", loss_chunk_tokens=8), device="cpu")
    engine.model.eval()
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids)
        got = engine(input_ids=ids, labels=ids, return_logits=True)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)


def test_moe_aux_loss_through_the_models_forward_parity():
    """Doge's product-key router: its aux loss function takes num_keys and [2, tokens, keys] logits, so the model's
    own forward computes it from the logits the engine records (the layer's router gets the aux gradient)."""
    run_parity(_doge_moe())


def test_moe_aux_loss_through_the_models_forward_is_active():
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    cfg = MegaTrainConfig(compute_dtype="float32")
    with_aux = MegaTrainEngine(_doge_moe(), cfg, device="cpu")(input_ids=ids, labels=ids).loss
    without = MegaTrainEngine(_doge_moe(output_router_logits=False), cfg, device="cpu")(input_ids=ids,
                                                                                          labels=ids).loss
    assert float((with_aux - without).abs()) > 1e-4


def test_second_layer_stack_is_refused_as_multi_stack():
    """A model whose forward runs another layer stack besides the streamed one (BLT, HRM) is refused saying so."""
    model = _build("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)
    model.model.local = nn.Module()  # a second stack, of its own module (BLT's local encoder beside its global one)
    model.model.local.layers = nn.ModuleList(copy.deepcopy(layer) for layer in model.model.layers)
    with pytest.raises(ValueError, match=r"2 layer stacks \(model.local.layers, model.layers\).*multi-stack"):
        MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", layers_path="model.local.layers"),
                        device="cpu")


def test_unshifted_own_loss_parity():
    """TrOCR's decoder computes its own loss: labels[i] is the target of logits[i] (no shift), the mean over the
    forward's counted tokens (num_items_in_batch not read). hf_megatrain reproduces that form
    (head_config.OWN_LOSS_FORMS) with the gradient accumulation the plain model gets."""
    cfg = transformers.TrOCRConfig(vocab_size=96, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                   decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                   activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   decoder_start_token_id=2, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    run_parity(transformers.TrOCRForCausalLM(cfg).float())


def test_permutation_lm_is_refused_as_not_causal():
    cfg = transformers.XLNetConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4, d_inner=64)
    with pytest.raises(ValueError, match="permutation language model .*not a causal decoder LM"):
        MegaTrainEngine(transformers.XLNetLMHeadModel(cfg), MegaTrainConfig(compute_dtype="float32"), device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("build", [_dory, _modernbert_decoder], ids=["dory", "modernbert"])
def test_heads_on_the_gpu_with_the_auto_loss(build):
    """CUDA, loss_impl='auto': Dory's head runs chunked and unfused (no fused kernel applies its logit_scale),
    ModernBERT-decoder's projection through the fused loss where one is installed; fp32 compute, TF32 off, the
    GPU parity tolerance of tests/test_gpu.py."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _, engine, _ = run_parity(build(), config=MegaTrainConfig(compute_dtype="float32", loss_impl="auto"),
                                  device="cuda", tol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert ("unfused" in engine.head_extras.loss_impl_reason) == (build is _dory)


def test_layers_that_mix_rows_refuse_a_micro_batch_split():
    """Doge's router reshapes the logits of every token of the batch together: a visit on part of the batch would
    compute other values, so ``micro_batch_size`` is refused by name instead of training another model. The refusal
    comes with the plan, before the store is allocated: the model keeps its weights and converts as the message
    says (micro_batch_size=0)."""
    model = _doge_moe()
    with pytest.raises(ValueError, match="micro_batch_size=1 is not supported.*DogeCDMoE"):
        MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", micro_batch_size=1), device="cpu")
    assert not any(p.is_meta for p in model.parameters())
    MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", micro_batch_size=0), device="cpu")
