"""CPM-Ant: a causal LM whose layer stack's owner (``CpmAntEncoder``) takes hidden states, not token ids -- its
``CpmAntModel`` prepends prompt tokens, embeds ids and segments and builds the segment-relative position bias before
it, then drops the prompt positions. hf_megatrain runs the model's own forward (model/multimodal.py, with
head_config.embedding_owner's parameters resident) and reproduces its unshifted mean loss (head_config.OWN_LOSS_FORMS).
Reformer runs its whole stack inside one reversible autograd Function: refused, naming it."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from tests.parity import run_parity


def _cpmant() -> transformers.CpmAntForCausalLM:
    cfg = transformers.CpmAntConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                                    num_hidden_layers=2, prompt_length=4, prompt_types=3, segment_types=3,
                                    position_bias_num_buckets=16, position_bias_max_distance=32, init_std=0.02,
                                    use_cache=False)
    torch.manual_seed(1234)
    return transformers.CpmAntForCausalLM(cfg).float()


def test_cpmant_parity():
    """3 clipped AdamW steps with gradient accumulation: loss, every gradient (embeddings, segment embedding and
    position bias included) and every updated weight as plain transformers + torch.optim.AdamW."""
    run_parity(_cpmant(), steps=3, ga=2, max_grad_norm=0.5)


def test_cpmant_runs_its_own_forward_with_resident_embeddings():
    engine = MegaTrainEngine(_cpmant(), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    assert engine.head_extras.run.runs_model
    assert engine.head_extras.unshifted
    resident = set(engine.resident_params)
    assert {"cpmant.input_embedding.weight", "cpmant.segment_embedding.weight",
            "cpmant.position_bias.relative_attention_bias"} <= resident


def test_reformer_reversible_stack_is_refused_by_name():
    cfg = transformers.ReformerConfig(vocab_size=96, hidden_size=32, num_attention_heads=2, attention_head_size=16,
                                      feed_forward_size=64, attn_layers=["local", "local"], axial_pos_embds=False,
                                      max_position_embeddings=64, local_attn_chunk_length=8, is_decoder=True)
    with pytest.raises(ValueError, match=r"whole layer stack .*one autograd Function \(_ReversibleFunction"):
        MegaTrainEngine(transformers.ReformerModelWithLMHead(cfg), MegaTrainConfig(compute_dtype="float32"),
                        device="cpu")


def test_a_second_stack_beside_the_embeddings_stays_refused():
    """HRM's ``HrmTextModel`` embeds the ids around its L and H modules' layer stacks: counting the embedding owner's
    parameters as resident (the CPM-Ant rule) must not turn the second stack into a silently resident one."""
    cfg = transformers.HrmTextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     head_dim=8, num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1],
                                     max_position_embeddings=64, use_cache=False)
    with pytest.raises(ValueError, match=r"2 layer stacks .*multi-stack"):
        MegaTrainEngine(transformers.HrmTextForCausalLM(cfg), MegaTrainConfig(compute_dtype="float32"), device="cpu")
