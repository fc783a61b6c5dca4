"""Keys/values shared across layers (issue 32): Gemma 3n and Gemma 4 with ``num_kv_shared_layers`` train exactly.

A "store" layer writes its keys/values into the ``KVSharingDict`` the decoder passes to every layer and the last
``num_kv_shared_layers`` layers attend with them (they have no k/v projections). hf_megatrain carries those tensors
as outputs of the store layer's autograd Function and inputs of the later layers' (model/cross_layer.py), so the
reuse layers' gradients reach the store layers' k/v projections through the recompute. Checked against plain
transformers + torch.optim.AdamW (tests/parity.py: loss, every gradient, every weight after 3 clipped steps with
gradient accumulation), also with the batch split inside each layer visit and with activations offloaded; a mapping
whose values cannot be carried is still refused at the first layer that writes into it.
"""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

from .models import COMMON, tiny
from .parity import ROUNDING_TOL, run_parity

_MIXED = ["sliding_attention", "full_attention"] * 2  # one store layer per type, then a reader of each


def gemma3n(**over) -> transformers.PreTrainedModel:
    cfg = transformers.Gemma3nTextConfig(**{
        **COMMON, "num_hidden_layers": 4, "head_dim": 8, "sliding_window": 4, "layer_types": _MIXED,
        "intermediate_size": 64, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 96,
        "num_kv_shared_layers": 2, "altup_num_inputs": 2, "laurel_rank": 4, "activation_sparsity_pattern": [0.0] * 4,
        **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Gemma3nForCausalLM(cfg).float()


def gemma4(**over) -> transformers.PreTrainedModel:
    cfg = getattr(transformers, "Gemma4TextConfig", None)
    if cfg is None:
        pytest.skip("no Gemma 4 in this transformers")
    # global_head_dim 8: with the default 512 the full-attention logits of this tiny model are so peaked that plain
    # fp32 alone turns a 2e-8 weight difference into 1e-3 in the gradients two steps on (measured: no tolerance
    # of 1e-5 could tell rounding from a bug there). sliding_window 8 of 12 tokens: still sliding.
    cfg = cfg(**{**COMMON, "num_hidden_layers": 4, "head_dim": 8, "global_head_dim": 8, "sliding_window": 8,
                 "layer_types": _MIXED, "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 8,
                 "num_kv_shared_layers": 2, "bos_token_id": 2, "eos_token_id": 1, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    return transformers.Gemma4ForCausalLM(cfg).float()


def _modes(model) -> list:
    return [("reuse" if a.is_kv_shared_layer else "store" if a.store_full_length_kv else None)
            for a in (layer.self_attn for layer in model.model.layers)]


def test_gemma3n_kv_sharing_matches_plain():
    model = gemma3n()
    assert _modes(model) == ["store", "store", "reuse", "reuse"]
    run_parity(model)


def test_gemma4_kv_sharing_matches_plain():
    model = gemma4()
    assert _modes(model) == ["store", "store", "reuse", "reuse"]
    run_parity(model, tol=ROUNDING_TOL)


def test_kv_sharing_split_inside_layers_and_offloaded_matches_plain():
    """Micro-batches inside each layer visit (the carried keys/values cut by rows and put back together) and the
    layers' saved inputs offloaded to host memory (the carried tensors stay where they are)."""
    cfg = MegaTrainConfig(compute_dtype="float32", micro_batch_size=1, activation_offload="on")
    _, engine, _ = run_parity(gemma4(), split_in_layer=True, config=cfg)
    assert engine.executor.activations.d2h_bytes > 0


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_gemma4_kv_sharing_keys_as_values_matches_plain():
    """``attention_k_eq_v``: the full-attention store layer's values are its keys' projection (no v_proj)."""
    run_parity(gemma4(attention_k_eq_v=True, num_global_key_value_heads=1))


def test_kv_sharing_undeclared_in_config_is_carried_too():
    """The layers store and reuse although the config no longer says so: carried by what the layer call does,
    not by what the config declares."""
    model = gemma3n()
    model.config.num_kv_shared_layers = 0
    assert not any(model.config.kv_sharing_modes) and _modes(model)[2:] == ["reuse", "reuse"]
    run_parity(model, steps=1)


def test_kv_sharing_no_grad_forward_and_generate_match_plain():
    model = gemma3n().eval()
    plain = __import__("copy").deepcopy(model)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, want = engine.model(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss
    assert float(ours) == pytest.approx(float(want), rel=1e-6)
    out = engine.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain.generate(input_ids=ids, max_new_tokens=4, do_sample=False))


class _Notes(UserDict):
    """A mapping a decoder hands to its layers, into which a layer writes state that is not tensors."""


class _Noting(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    def forward(self, hidden_states, *args, notes=None, **kwargs):
        notes["layer"] = self.self_attn.layer_idx  # state for later layers, outside the hidden state
        return super().forward(hidden_states, *args, **kwargs)


@pytest.mark.parametrize("notes", [_Notes(), _Notes(seen=0)], ids=["empty", "holding-a-number"])
def test_layer_writing_uncarriable_state_is_refused_at_first_call(notes):
    """Only tensors can be carried (they are the Function's outputs): anything else a layer writes into a mapping
    its decoder passes on is refused, whether the mapping looked carriable (empty) or not."""
    model = tiny("llama")
    for layer in model.model.layers:
        layer.__class__ = _Noting
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    hidden = torch.randn(2, 8, 32)
    rotary = engine.model.model.rotary_emb(hidden, torch.arange(8)[None])
    with pytest.raises(RuntimeError, match=r"wrote .*into the _Notes its decoder passes.*plain transformers"):
        engine.model.model.layers[0](hidden, notes=notes, position_embeddings=rotary, attention_mask=None)


@pytest.mark.slow  # (torch.compile of the layer templates: tens of seconds on CPU)
def test_kv_sharing_compiled_layers_match_plain():
    """The compiled template writes the carried keys/values too. One step, within compiled layers' bound of 1e-4:
    inductor's fused fp32 reductions round differently from eager's (tests/test_core_parity.py; measured here:
    gradients 3e-6, as without KV sharing), and this tiny Gemma 4 amplifies that in later steps."""
    cfg = MegaTrainConfig(compute_dtype="float32", torch_compile=True)
    _, engine, _ = run_parity(gemma4(), steps=1, ga=1, config=cfg, tol=1e-4)
    assert all(t.compiled is not None for t in engine.executor.templates)  # traced, no fallback to eager


def test_gemma3n_refuses_a_micro_batch_split_by_name():
    """Gemma 3n's layers carry [altup, batch, seq, hidden]: the split would cut the AltUp dim, so it is refused."""
    with pytest.raises(ValueError, match="micro_batch_size=1 is not supported.*Gemma3nTextAltUp"):
        MegaTrainEngine(gemma3n(), MegaTrainConfig(compute_dtype="float32", micro_batch_size=1), device="cpu")


@pytest.mark.parametrize("build", [gemma3n, gemma4])
def test_kv_sharing_with_saved_graphs_matches_plain(build):
    """Every layer keeps its forward's graph (``saved_graph_layers``): the keys/values a store layer writes are
    outputs of that graph, and the reuse layers' gradients reach them there instead of through a recompute."""
    model = build()
    cfg = MegaTrainConfig(compute_dtype="float32", saved_graph_layers=model.config.num_hidden_layers)
    _, engine, _ = run_parity(model, config=cfg, tol=ROUNDING_TOL)
    assert len(engine.executor.graph_layers) == model.config.num_hidden_layers
