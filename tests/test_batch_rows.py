"""Micro-batches inside a layer visit slice exactly the inputs that hold rows of the batch (engine/batch_rows.py):
a tensor whose leading dim merely equals the batch size is passed whole, one with several rows per sequence is
sliced per sequence, and one that cannot be decided is refused.
"""

from __future__ import annotations

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

from .models import tiny
from .parity import run_parity
from .test_any_decoder import ToyForCausalLM, ToyModel

SPLIT = MegaTrainConfig(compute_dtype="float32", micro_batch_size=1)


def test_mpt_alibi_with_as_many_heads_as_sequences():
    # MPT's ALiBi bias is [heads, 1, max_seq_len]; with 4 heads and a batch of 4 (2 x GA 2 in one batch) its
    # leading dim equals the batch: sliced per sequence it broadcasts one head's slope over all heads (no error)
    model = tiny("mpt")
    assert model.config.n_heads == 4
    run_parity(model, ga=2, batch=2, split_in_layer=True, config=SPLIT)


def test_bloom_alibi_rows_per_sequence():
    # BLOOM's ALiBi bias is [batch * heads, 1, T]: heads rows per sequence, sliced as such
    run_parity(tiny("bloom"), ga=2, batch=2, split_in_layer=True, config=SPLIT)


def test_batch_sized_constant_passed_whole():
    # decided once per call signature: the probe (the stack's owner re-run on B + 1 sequences, seen here as the
    # embedding's calls with 5 rows) runs for the first step, not again for the same shapes; the ALiBi bias, whose
    # leading dim equals the batch (4 heads, 4 sequences), is passed whole: the loss is the plain model's
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tiny("mpt")(input_ids=ids, labels=ids).loss
    model = tiny("mpt")
    engine = MegaTrainEngine(model, SPLIT, device="cpu")
    probes = []
    model.transformer.wte.register_forward_hook(lambda m, args, out: probes.append(args[0].shape[0])
                                                if args[0].shape[0] == 5 else None)
    losses = []
    for _ in range(2):
        out = engine(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    n = model.config.n_layers
    assert probes == [5] * n  # first forward: each layer's call (its output structure unknown before it ran)
    assert torch.allclose(losses[0], plain, rtol=1e-5) and torch.equal(losses[1], losses[0])  # (no optimizer step)
    engine(input_ids=ids[:, :6], labels=ids[:, :6]).loss.backward()
    assert len(probes) == n + 1  # a new shape: one probe passes through every layer


class _Interleaved(ToyModel):
    """Hands each layer the embeddings as [copies, batch] rows flattened copy-major: leading dim 2 * batch, but not
    two rows per sequence."""

    def forward(self, input_ids=None, attention_mask=None, use_cache=None, **kwargs):
        e = self.embed(input_ids)
        h = e
        flat = torch.cat([e, 2 * e])
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask, positions=flat)
        return (self.final_norm(h),)


def test_interleaved_rows_refused():
    model = ToyForCausalLM()
    model.model = _Interleaved(model.config, False, False, False)
    engine = MegaTrainEngine(model, SPLIT, device="cpu")
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"cannot tell whether input .* holds rows of the batch.*"
                                           r"micro_batch_size=0"):
        engine(input_ids=ids, labels=ids)


def test_probe_leaves_rng_and_gradients_alone():
    # the probe runs under no_grad with the RNG restored: the forward draws the same random numbers as without it
    torch.manual_seed(5)
    engine = MegaTrainEngine(tiny("mpt"), SPLIT, device="cpu")
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    state = torch.get_rng_state()
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)
    assert torch.equal(torch.get_rng_state(), state)
    assert not engine.executor.rows.probing
