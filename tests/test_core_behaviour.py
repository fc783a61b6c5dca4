"""Core engine behaviour beyond parity: memory accounting, bad input, non-finite gradients, eval path."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.core.store import bytes_per_param

from .models import tiny


@pytest.mark.parametrize("dtype,expected", [("bfloat16", 18), ("float32", 16)])
def test_host_bytes_per_parameter(dtype, expected):
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype=dtype, resident_placement="host"),
                             device="cpu")
    assert bytes_per_param(engine.compute_dtype) == expected
    assert engine.store.nbytes == expected * engine.store.numel


def test_unfindable_layer_stack_names_model_and_fix():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"Odd.*layers_path"):
        MegaTrainEngine(Odd(), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", layers_path="model.nope"),
                        device="cpu")


def test_explicit_layers_path_works():
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", layers_path="model.layers"),
                             device="cpu")
    assert len(engine.layer_units) == 3


def test_bad_config_values():
    with pytest.raises(ValueError, match="unknown MegaTrain config keys"):
        MegaTrainConfig.from_dict({"compute_dtype": "bfloat16", "micro_bach_size": 2})
    with pytest.raises(ValueError, match="compute_dtype"):
        MegaTrainConfig(compute_dtype="int8")
    with pytest.raises(ValueError, match="num_slots"):
        MegaTrainConfig(num_slots=1)


def test_nonfinite_gradient_skips_step_and_keeps_state(caplog):
    engine = MegaTrainEngine(tiny("qwen2"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, max_grad_norm=1.0)
    ids = torch.randint(0, 96, (2, 8))
    engine(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.wait()
    before = {n: t.clone() for n, t in engine.named_master_tensors()}
    moments = {k: v.clone() for k, v in opt.state_tensors().items()}
    loss = engine(input_ids=ids, labels=ids).loss
    (loss * float("nan")).backward()
    with caplog.at_level(logging.WARNING):
        opt.step()
        opt.wait()
    assert opt.skipped_steps == 1 and "non-finite" in caplog.text
    for n, t in engine.named_master_tensors():
        assert torch.equal(t, before[n]), n
    for k, v in opt.state_tensors().items():
        assert torch.equal(v, moments[k]), k
    # the next finite step proceeds normally
    engine(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.wait()
    assert opt.skipped_steps == 1
    assert any(not torch.equal(t, before[n]) for n, t in engine.named_master_tensors())


def test_eval_forward_matches_hf_and_keeps_no_graph():
    model = tiny("mistral")
    ref = tiny("mistral")
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    ids = torch.randint(0, 96, (2, 10))
    model.eval()
    ref.eval()
    with torch.no_grad():
        ours = engine(input_ids=ids, labels=ids, return_logits=True)
        theirs = ref(input_ids=ids, labels=ids)
    assert torch.allclose(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    assert abs(float(ours.loss) - float(theirs.loss)) < 1e-5
    assert ours.loss.grad_fn is None


def test_padding_mask_and_ignored_labels_match_hf():
    model, ref = tiny("llama"), tiny("llama")
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", micro_batch_size=1), device="cpu")
    ids = torch.randint(0, 96, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in one row
    labels = ids.masked_fill(mask == 0, -100)
    ours = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
    theirs = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert abs(float(ours) - float(theirs)) <= 1e-5 * abs(float(theirs))


def test_chunked_host_step_matches_whole_unit_step():
    """The CPU step runs AdamW + the bf16 streaming copy chunk by chunk (one pass over host memory); chunk edges
    that cut through parameters and decay groups give the whole-unit result (to rounding: the kernel's vectorised
    body and scalar tail round differently) and a streaming copy equal to the new master."""
    results = []
    for chunk in (0, 37):
        torch.manual_seed(0)
        engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="bfloat16"), device="cpu")
        opt = engine.create_optimizer(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
        opt.host_chunk = chunk
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            ids = torch.randint(0, 96, (2, 8), generator=gen)
            engine(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        opt.wait()
        results.append(([u.master.clone() for u in engine.store.units], [u.compute.clone() for u in engine.store.units],
                         {k: v.clone() for k, v in opt.state_tensors().items()}))
    (m0, c0, s0), (m1, c1, s1) = results
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))  # noqa: E731
    assert max(rel(a, b) for a, b in zip(m1, m0)) < 1e-7
    assert all(torch.equal(c, m.to(c.dtype)) for c, m in zip(c1, m1))  # the streaming copy is the new master
    assert max(rel(s1[k], s0[k]) for k in s0 if k != "unit_steps") < 1e-6
