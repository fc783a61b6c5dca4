"""Narrow gradients (engine/offload.py): a layer visit's gradient that is the step's only one and computed whole
crosses PCIe and waits on the host in the compute dtype. Same values as the FP32 path, so the same training, bit for
bit where no norm is involved; ``.grad`` readers see FP32."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.core.plan import Plans, Stepper, UnitPlan, Where
from hf_megatrain.core.store import Unit

from .models import tiny
from .parity import random_batches, rel


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 1000, 4097])
def test_widen_in_place_gives_the_fp32_values(n):
    plan = UnitPlan(0, True, n, 0, Where.HOST, Where.HOST, Where.HOST, Where.HOST, Stepper.HOST)
    grad = torch.full((n,), float("nan"))
    unit = Unit(0, plan, [], n, torch.zeros(n), grad, torch.zeros(n), torch.zeros(n), None)
    values = torch.randn(n).bfloat16()
    unit.grad_as(torch.bfloat16).copy_(values)
    unit.widen_grad_(torch.bfloat16)
    assert torch.equal(unit.grad, values.float())


def _train(model, cfg, steps, clip_schedule, ga=1, expose=None):
    engine = MegaTrainEngine(copy.deepcopy(model), cfg)
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=clip_schedule[0])
    for s, micro in enumerate(random_batches(steps, ga, 2, 16, model.config.vocab_size, seed=1)):
        opt.max_grad_norm = clip_schedule[s]
        for j, (ids, lab) in enumerate(micro):
            loss = engine(input_ids=ids, labels=lab).loss
            engine.set_final_backward(j == ga - 1)
            loss.backward()
        if expose is not None and s == 1:  # what a .grad reader sees before a step that speculated
            expose.update({n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    engine.state.wait_all()
    weights = {n: engine.store.master_tensor(n).clone() for n in engine.store.by_name}
    return weights, engine


@pytest.mark.parametrize("kernel", ["native", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("lean", [False, True])
def test_narrow_gradients_train_as_fp32_ones(lean, kernel):
    """bf16 compute, the compiled host kernel: steps that speculate, one that clips after them (taken back and
    redone; lean: re-run), and a .grad read before a step -- the same as with FP32 gradients. (The optimizer runs
    on the main thread: an overlapped one shares the CPU's threads with the forward's GEMMs, whose blocking -- and
    so rounding -- can then differ from run to run.)"""
    model = tiny("llama", num_hidden_layers=3)
    clips = [1e6, 1e6, 0.05, 1e6]
    out = {}
    for narrow in (False, True):
        cfg = MegaTrainConfig(compute_dtype="bfloat16", host_kernel=kernel, narrow_grads=narrow, lean_store=lean,
                              overlap_optimizer=False, device_layers=0, device_step_layers=0)
        seen: dict[str, torch.Tensor] = {}
        weights, engine = _train(model, cfg, 4, clips, expose=None if lean else seen)
        out[narrow] = (weights, engine.executor.grads.d2h_bytes, seen)
    (w32, d32, g32), (w16, d16, g16) = out[False], out[True]
    layers = sum(u.numel for u in engine.layer_units)
    assert d32 - d16 >= 2 * layers * (3 if lean else 4) * 0.99  # the layers' gradients crossed in bf16
    for n in w32:
        assert rel(w16[n], w32[n]) <= 1e-6, n
    assert g32.keys() == g16.keys() and (g32 or lean)
    for n in g32:
        assert torch.equal(g16[n], g32[n]), n


def test_accumulated_or_split_gradients_stay_fp32():
    """Gradient accumulation (the last backward adds to the first) and a layer visit split into micro-batches
    (FP32 sums) keep the FP32 path: nothing narrow, the same bytes."""
    model = tiny("llama", num_hidden_layers=2)
    base = dict(compute_dtype="bfloat16", host_kernel="native", device_layers=0, device_step_layers=0)
    for cfg, ga in ((MegaTrainConfig(**base), 2), (MegaTrainConfig(**base, micro_batch_size=1), 1)):
        _, e16 = _train(model, cfg, 2, [1.0, 1.0], ga=ga)
        _, e32 = _train(model, MegaTrainConfig(**{**cfg.to_dict(), "narrow_grads": False}), 2, [1.0, 1.0], ga=ga)
        assert e16.executor.grads.d2h_bytes == e32.executor.grads.d2h_bytes


def test_staging_slabs_allocated_only_when_a_gradient_needs_them():
    """A step's only visit of a host gradient lands straight in the store: the staging slabs (two of the largest
    layer, pinned on a GPU, so resident once allocated) are never allocated; gradient accumulation allocates them."""
    model = tiny("llama", num_hidden_layers=2)
    for dtype in ("bfloat16", "float32"):
        cfg = MegaTrainConfig(compute_dtype=dtype, host_kernel="native", device_layers=0, device_step_layers=0)
        _, once = _train(model, cfg, 2, [1.0, 1.0], ga=1)
        assert once.executor.grads.staging == [None, None], dtype
        _, acc = _train(model, cfg, 2, [1.0, 1.0], ga=2)
        assert all(t is not None and t.numel() == acc.executor.grads.staging_numel
                   for t in acc.executor.grads.staging), dtype


def test_fused_kernel_and_fp32_compute_never_narrow():
    """The fused host kernel reads FP32 gradients only; FP32 compute has nothing narrower."""
    model = tiny("llama", num_hidden_layers=2)
    for cfg in (MegaTrainConfig(compute_dtype="bfloat16", host_kernel="fused"),
                MegaTrainConfig(compute_dtype="float32", host_kernel="native")):
        engine = MegaTrainEngine(copy.deepcopy(model), cfg)
        engine.create_optimizer()
        assert engine.executor.grads.narrow is None


def test_trainer_callback_reading_optimizer_gradients_sees_fp32(tmp_path):
    """A Trainer callback that reads ``optimizer.param_groups`` gradients before the step sees them landed (the
    resident parts' too) and FP32 (narrow ones widened first): the same values with narrow gradients or without."""
    from transformers import TrainerCallback

    from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments

    from .test_trainer import common_args, dataset

    class Reader(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            self.seen.append(torch.cat([p.grad.flatten().clone() for g in optimizer.param_groups
                                        for p in g["params"] if p.grad is not None]))

    model = tiny("llama", num_hidden_layers=2)
    out = {}
    for narrow in (False, True):
        cfg = dict(compute_dtype="bfloat16", host_kernel="native", narrow_grads=narrow, overlap_optimizer=False,
                   device_layers=0, device_step_layers=0)
        reader = Reader()
        args = MegaTrainTrainingArguments(**common_args(tmp_path / str(narrow), gradient_accumulation_steps=1,
                                                        max_grad_norm=1e6), megatrain_config=cfg)
        trainer = MegaTrainTrainer(model=copy.deepcopy(model), args=args, train_dataset=dataset(), callbacks=[reader])
        trainer.train()
        out[narrow] = (reader.seen, trainer.engine.executor.grads.d2h_bytes)
    assert out[True][1] < out[False][1]  # (narrow gradients crossed)
    assert len(out[True][0]) == len(out[False][0]) == 3
    for a, b in zip(out[True][0], out[False][0]):
        assert torch.equal(a, b)
