"""State one decoder layer hands to later ones outside the hidden state (issue 16 item 4): keys/values shared
across layers are refused at conversion (config) and, generically, at the first layer call that writes into a
mapping the decoder passes to every layer; one block reused at several depths is refused by
``check_no_shared_weights`` (tests/test_stacks_heads.py, Zamba2). Without these, the streamed backward (each layer
recomputed alone) leaves the reused keys/values without a gradient into the layers that computed them.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

from .models import COMMON


def _gemma3n_kv_shared() -> transformers.PreTrainedModel:
    cfg = transformers.Gemma3nTextConfig(**{
        **COMMON, "num_hidden_layers": 4, "head_dim": 8, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "intermediate_size": 64,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 96, "num_kv_shared_layers": 2,
        "altup_num_inputs": 2, "laurel_rank": 4, "activation_sparsity_pattern": [0.0] * 4})
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(cfg).float()
    assert [bool(layer.self_attn.is_kv_shared_layer) for layer in model.model.layers] == [False, False, True, True]
    return model


def test_kv_shared_across_layers_refused_at_conversion():
    model = _gemma3n_kv_shared()
    with pytest.raises(ValueError, match=r"Gemma3nForCausalLM is not supported: layers \[2, 3\] share "
                                         r"keys/values.*plain transformers"):
        MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")


def test_layer_writing_state_for_later_layers_refused_at_first_call():
    # the config no longer says so (a model whose config does not declare it): the layers still store and reuse
    # keys/values through the KVSharingDict, and the first layer that writes into it is refused
    model = _gemma3n_kv_shared()
    model.config.num_kv_shared_layers = 0
    assert not any(model.config.kv_sharing_modes)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"layer 0 \(Gemma3nTextDecoderLayer\) wrote into the KVSharingDict"):
        engine(input_ids=ids, labels=ids)
