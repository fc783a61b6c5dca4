"""Lean host store (12 B/param streamed): parity with plain HF + torch AdamW, the re-run path when the clip factor
changes, skipped steps, RNG replay, Trainer save/resume, refusal of gradient accumulation, byte accounting."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, MegaTrainTrainer, MegaTrainTrainingArguments
from hf_megatrain import planner
from hf_megatrain.core.store import bytes_per_param

from .models import tiny
from .parity import random_batches, reference_optimizer, rel, run_parity


def lean(**kw) -> MegaTrainConfig:
    # (the re-run path: without the gradient plane, tests/test_lean_grad_plane.py tests the path with it)
    return MegaTrainConfig(**{"compute_dtype": "float32", "lean_store": True, "lean_grad_plane": "off", **kw})


def n_items(lab: torch.Tensor) -> int:
    return int((lab[:, 1:] != -100).sum())


def layer_state(engine) -> list[torch.Tensor]:
    engine.optimizer.wait()
    return [t.clone() for u in engine.layer_units for t in (u.master, u.exp_avg, u.exp_avg_sq)]


# -- parity with plain HF + torch.optim.AdamW ------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_parity_clipping_inactive_no_rerun(overlap):
    worst, engine, _ = run_parity(tiny("llama"), ga=1, batch=4, max_grad_norm=1e6,
                                  config=lean(overlap_optimizer=overlap))
    assert engine.optimizer.regenerated_steps == 1  # the first step takes its norm first; the others speculate
    assert all(u.grad is None for u in engine.layer_units)


@pytest.mark.parametrize("family,tie,overlap", [("llama", False, True), ("qwen2", True, False)])
def test_parity_clipping_active_reruns_every_step(family, tie, overlap):
    """max_grad_norm well below the norm: every step clips, so every step takes its norm first and re-runs its
    forward+backward with the known clip factor; results match to 1e-5 and no master is ever taken back."""
    worst, engine, _ = run_parity(tiny(family, tie=tie), ga=1, batch=4, max_grad_norm=0.3,
                                  config=lean(overlap_optimizer=overlap))
    assert engine.optimizer.regenerated_steps == 3
    assert engine.optimizer.max_regenerated_sq_error == 0.0  # CPU: the re-run reproduces every gradient exactly


def test_speculated_step_that_clips_is_taken_back():
    """Step 1 does not clip (so step 2 speculates: each layer updated as its gradient lands); step 2 clips: the
    updates are taken back (masters algebraically, moments from the re-run's gradients) and redone with the true
    clip factor; step 3 takes its norm first. Every step matches HF + clip_grad_norm_ + torch AdamW."""
    model = tiny("llama")
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, lean(), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1e6)
    ropt = reference_optimizer(ref, 1e-3, 0.1)
    modes = []
    for step, micro in enumerate(random_batches(4, 1, 4, 12, 96, seed=4)):
        clip = 1e6 if step < 2 else 0.3
        opt.max_grad_norm = clip
        ids, lab = micro[0]
        out = ref(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ropt.step(), ropt.zero_grad()
        loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss
        loss.backward()
        modes.append(opt.policy.mode)
        opt.step(), opt.zero_grad()
        assert rel(loss.detach(), out.loss.detach()) <= 1e-5
        opt.wait()
        for n, p in ref.named_parameters():
            assert rel(engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), (step, n)
    assert modes == [True, False, False, True]  # norm first, speculate, speculate (clips: taken back), norm first
    assert opt.regenerated_steps == 3


def test_parity_in_layer_micro_batch_split():
    worst, engine, _ = run_parity(tiny("mistral"), ga=2, batch=2, split_in_layer=True,
                                  config=lean(micro_batch_size=2))
    assert engine.optimizer.regenerated_steps >= 1


def test_parity_dropout_replayed_in_rerun():
    """Attention dropout draws random numbers in every layer: the re-run restores the forward's RNG state (same
    masks, same gradients), and afterwards the caller's RNG stream is where it was (the re-run drew nothing)."""
    model = tiny("llama", attention_dropout=0.2, attn_implementation="eager")
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, lean(), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=0.3)
    ropt = reference_optimizer(ref, 1e-3, 0.1)
    for step, micro in enumerate(random_batches(3, 1, 4, 12, 96, seed=2)):
        ids, lab = micro[0]
        torch.manual_seed(step)
        out = ref(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ropt.step(), ropt.zero_grad()
        torch.manual_seed(step)
        loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss
        loss.backward()
        rng = torch.get_rng_state()
        opt.step()
        assert torch.equal(torch.get_rng_state(), rng)
        opt.zero_grad()
        assert rel(loss.detach(), out.loss.detach()) <= 1e-5
    assert opt.regenerated_steps == 3 and opt.max_regenerated_sq_error == 0.0
    assert all(t.stochastic for t in engine.executor.templates)
    opt.wait()
    for n, p in ref.named_parameters():
        assert rel(engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n


def test_parity_with_lr_scheduler_several_steps():
    model = tiny("qwen2")
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, lean(), device="cpu")
    opt = engine.create_optimizer(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0)
    ropt = reference_optimizer(ref, 2e-3, 0.1)
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, 6)
    rsched = transformers.get_linear_schedule_with_warmup(ropt, 2, 6)
    for micro in random_batches(6, 1, 4, 12, 96, seed=3):
        ids, lab = micro[0]
        out = ref(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step(), rsched.step(), ropt.zero_grad()
        loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
        assert rel(loss.detach(), out.loss.detach()) <= 1e-5
    opt.wait()
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    for n, p in ref.named_parameters():
        assert rel(engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n


def test_bf16_compute_matches_full_store():
    """bf16 compute: the lean store (FP32 master cast to bf16 in the executor, moments + apply split) trains like
    the 18 B/param store, with clipping active (re-runs) and the optimizer overlapped."""
    model = tiny("llama")
    engines = []
    for is_lean in (False, True):
        cfg = MegaTrainConfig(compute_dtype="bfloat16", lean_store=is_lean, resident_placement="host",
                              lean_grad_plane="off")  # (the re-run path)
        e = MegaTrainEngine(copy.deepcopy(model), cfg, device="cpu")
        e.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=0.3)
        engines.append(e)
    for micro in random_batches(3, 1, 4, 12, 96, seed=1):
        ids, lab = micro[0]
        losses = []
        for e in engines:
            loss = e(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss
            loss.backward()
            e.optimizer.step()
            e.optimizer.zero_grad()
            losses.append(loss.detach())
        assert rel(losses[1], losses[0]) <= 1e-5
    full, lean_ = engines
    assert lean_.optimizer.regenerated_steps == 3
    lean_.optimizer.wait(), full.optimizer.wait()
    for n in full.store.names():
        assert rel(lean_.store.master_tensor(n), full.store.master_tensor(n)) <= 1e-5, n


@pytest.mark.parametrize("kernel", ["native", "fused"])
def test_lean_compute_copy_trains_bit_identically(kernel):
    """``lean_compute_copy``: the layers stream the host bf16 copy the AdamW pass writes instead of casting the FP32
    master on the device -- the same rounding, so the same losses and weights, through speculated steps, a clipping
    step (taken back and re-run: the copy is refreshed before the re-run reads it) and the steps after it."""
    model = tiny("llama", num_hidden_layers=3)
    clips = [1e6, 1e6, 0.05, 1e6, 1e6]
    out = {}
    for with_copy in (False, True):
        cfg = MegaTrainConfig(compute_dtype="bfloat16", lean_store=True, lean_compute_copy=with_copy,
                              host_kernel=kernel, overlap_optimizer=False, resident_placement="host",
                              lean_grad_plane="off")  # (the re-run path; the plane's: test_lean_grad_plane.py)
        e = MegaTrainEngine(copy.deepcopy(model), cfg, device="cpu")
        assert all((u.compute is not None) == with_copy for u in e.layer_units)
        opt = e.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=clips[0])
        losses = []
        for clip, micro in zip(clips, random_batches(len(clips), 1, 4, 12, 96, seed=5)):
            opt.max_grad_norm = clip
            ids, lab = micro[0]
            loss = e(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        e.state.wait_all()
        for u in e.layer_units if with_copy else ():
            assert torch.equal(u.compute, u.master.to(torch.bfloat16))
        out[with_copy] = (torch.stack(losses), {n: e.store.master_tensor(n).clone() for n in e.store.names()},
                          opt.regenerated_steps, e.executor.h2d_bytes)
    (l0, w0, r0, h0), (l1, w1, r1, h1) = out[False], out[True]
    assert r0 == r1 >= 1
    assert torch.equal(l0, l1)
    for n in w0:
        assert torch.equal(w0[n], w1[n]), n
    assert h1 < 0.6 * h0  # half the bytes per streamed weight


def test_lean_compute_copy_needs_lean_store_and_16_bit_compute():
    with pytest.raises(ValueError, match="lean_store=True too"):
        MegaTrainConfig(lean_compute_copy=True)
    with pytest.raises(ValueError, match="compute_dtype='bfloat16'"):
        MegaTrainConfig(lean_store=True, lean_compute_copy=True, compute_dtype="float32")


# -- skipped steps ---------------------------------------------------------------------------------------------------
def test_nonfinite_loss_skips_bit_identical_without_rerun():
    """A NaN loss makes every layer gradient non-finite: no layer is speculated on, so the skipped step leaves
    masters, moments and step counts bit-identical, with no re-run; training then continues like the reference
    that never saw that batch."""
    model = tiny("llama")
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, lean(), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
    ropt = reference_optimizer(ref, 1e-3, 0.1)
    batches = [m[0] for m in random_batches(3, 1, 4, 12, 96, seed=5)]
    for step, (ids, lab) in enumerate(batches):
        poison = step == 1
        if poison:
            before, counts, reruns = layer_state(engine), opt.unit_steps.clone(), opt.regenerated_steps
        else:
            out = ref(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ropt.step(), ropt.zero_grad()
        loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss
        (loss * float("nan") if poison else loss).backward()
        opt.step()
        opt.zero_grad()
        if poison:
            assert opt.skipped_steps == 1 and opt.regenerated_steps == reruns  # no re-run for this step
            after = layer_state(engine)
            assert all(torch.equal(a, b) for a, b in zip(before, after))
            assert torch.equal(opt.unit_steps, counts)
    opt.wait()
    for n, p in ref.named_parameters():
        assert rel(engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n


def test_one_nonfinite_layer_gradient_undoes_the_others():
    """Layer 0's gradient (the last to arrive) is non-finite: layers 2 and 1 were already updated (speculate mode);
    the step is skipped, their masters are taken back and the re-run undoes their moments, and the next steps match
    the reference that skipped that batch."""
    model = tiny("llama")
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, lean(), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1e6)
    ropt = reference_optimizer(ref, 1e-3, 0.1)
    poison = False

    def poisoned(index, first_pass, grad, sq):
        if poison and first_pass and index == 0:
            grad.fill_(float("inf"))
            sq.fill_(float("inf"))

    opt.gradient_hooks.append(poisoned)
    batches = [m[0] for m in random_batches(3, 1, 4, 12, 96, seed=6)]
    for step, (ids, lab) in enumerate(batches):
        poison = step == 1
        if poison:
            before, counts = layer_state(engine), opt.unit_steps.clone()
        else:
            ref(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss.backward()
            ropt.step(), ropt.zero_grad()
        engine(input_ids=ids, labels=lab, num_items_in_batch=n_items(lab)).loss.backward()
        opt.step()
        opt.zero_grad()
        if poison:
            assert opt.skipped_steps == 1 and opt.regenerated_steps == 2  # the first step's norm pass + this
            after = layer_state(engine)
            assert torch.equal(opt.unit_steps, counts)
            assert torch.equal(before[0], after[0])  # layer 0 (non-finite) was never touched
            for a, b in zip(before, after):  # layers 2, 1: updated as they landed, taken back to rounding
                assert rel(b, a) <= 1e-6
    opt.wait()
    for n, p in ref.named_parameters():
        assert rel(engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n


@pytest.mark.parametrize("clip", [None, 1.0])
def test_zero_grad_without_step_takes_back_the_speculation(clip):
    """Without clipping the first step speculates (layers updated as their gradients land): zero_grad() takes the
    updates back through a re-run. With clipping on, the first step only collects norms: nothing to take back."""
    model = tiny("llama")
    engine = MegaTrainEngine(copy.deepcopy(model), lean(), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=clip)
    (ids, lab), = random_batches(1, 1, 4, 12, 96, seed=7)[0]
    before = layer_state(engine)
    engine(input_ids=ids, labels=lab).loss.backward()
    opt.zero_grad()
    after = layer_state(engine)
    assert opt.regenerated_steps == (1 if clip is None else 0) and opt.skipped_steps == 0
    assert all(rel(b, a) <= 1e-6 if a.norm() > 0 else b.abs().max() < 1e-12 for a, b in zip(before, after))
    assert int(opt.unit_steps.sum()) == 0
    engine(input_ids=ids, labels=lab).loss.backward()  # a new step may start
    opt.step()


# -- accumulation refused ---------------------------------------------------------------------------------------------
def test_gradient_accumulation_is_refused(tmp_path):
    with pytest.raises(ValueError, match="micro_batch_size"):
        MegaTrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                   gradient_accumulation_steps=2,
                                   megatrain_config={"compute_dtype": "float32", "lean_store": True})
    args = MegaTrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                      megatrain_config={"compute_dtype": "float32", "lean_store": True})
    args.gradient_accumulation_steps = 4
    with pytest.raises(ValueError, match="micro_batch_size"):
        MegaTrainTrainer(model=tiny("llama"), args=args)
    engine = MegaTrainEngine(tiny("llama"), lean(), device="cpu")
    (ids, lab), = random_batches(1, 1, 2, 12, 96, seed=8)[0]
    with pytest.raises(RuntimeError, match="lean_store needs the optimizer"):  # (its gradients have no buffer)
        engine(input_ids=ids, labels=lab).loss.backward()
    engine = MegaTrainEngine(tiny("llama"), lean(), device="cpu")
    engine.create_optimizer(lr=1e-3)
    engine(input_ids=ids, labels=lab).loss.backward()
    with pytest.raises(RuntimeError, match="gradient accumulation.*micro_batch_size"):
        engine(input_ids=ids, labels=lab)
    engine.optimizer.step()  # the engine stays usable: a step ends the refused state
    engine(input_ids=ids, labels=lab).loss.backward()
    engine.optimizer.step()
    with pytest.raises(ValueError, match="grad_offload_dtype"):
        MegaTrainConfig(lean_store=True, grad_offload_dtype="bfloat16")


# -- bytes per parameter ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_store_bytes_per_streamed_parameter(dtype):
    cfg = MegaTrainConfig(compute_dtype=dtype, lean_store=True, resident_placement="host")
    engine = MegaTrainEngine(tiny("llama"), cfg, device="cpu")
    store, res = engine.store, engine.resident_unit
    layer_params = sum(u.numel for u in engine.layer_units)
    assert bytes_per_param(torch.bfloat16, lean=True) == 12
    assert bytes_per_param(torch.bfloat16, lean=True, lean_copy=True) == 14
    assert store.nbytes == 12 * layer_params + bytes_per_param(engine.compute_dtype) * res.numel
    # + two FP32 staging slabs of the largest layer (the executor's), nothing else per parameter
    slabs = 2 * engine.executor.grads.staging_numel * engine.executor.grads.staging_dtype.itemsize
    assert slabs == 2 * 4 * max(u.numel for u in engine.layer_units)
    plan = planner.estimate(planner.ModelShape.from_engine(engine), cfg, 12, 2, device_type="cpu",
                            plans=engine.plans)
    store_rows = ("master fp32", "grad fp32", "exp_avg fp32", "exp_avg_sq fp32", "compute copy")
    planned = sum(v for k, v in plan.host.items() if k in store_rows)
    assert planned == store.nbytes


# -- Trainer: train, save, reload, resume --------------------------------------------------------------------------
def _dataset(n: int = 16, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, 96, (seq,), generator=g)
        labels = ids.clone()
        labels[: (i % 4) + 1] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _args(out, config, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=4,
              learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=1,
              logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
              dataloader_num_workers=0)
    kw.update(over)
    if config is None:
        return transformers.TrainingArguments(**kw)
    return MegaTrainTrainingArguments(**kw, megatrain_config=config)


def _log(trainer):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def test_trainer_parity_save_reload_and_exact_resume(tmp_path):
    cfg = {"compute_dtype": "float32", "lean_store": True, "micro_batch_size": 2, "lean_grad_plane": "off"}
    model = tiny("llama")
    ref = transformers.Trainer(model=copy.deepcopy(model), args=_args(tmp_path / "ref", None),
                               train_dataset=_dataset())
    ref.train()
    kw = dict(save_strategy="steps", save_steps=2)
    full = MegaTrainTrainer(model=copy.deepcopy(model), args=_args(tmp_path / "a", cfg, **kw), train_dataset=_dataset())
    full.train()
    for (s, rl, rg), (_, ol, og) in zip(_log(ref), _log(full)):
        assert abs(ol - rl) <= 1e-5 * abs(rl) and abs(og - rg) <= 1e-5 * abs(rg), (s, ol, rl, og, rg)
    assert full.engine.optimizer.regenerated_steps >= 1  # grad norms ~1.5 > 1.0: clipping is active
    full.engine.optimizer.wait()
    for n, p in ref.model.named_parameters():
        assert rel(full.engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n
    full.save_model(str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    for n, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), full.engine.store.master_tensor(n)), n
    resumed = MegaTrainTrainer(model=copy.deepcopy(model), args=_args(tmp_path / "b", cfg, **kw),
                               train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert _log(full) == _log(resumed)
    resumed.engine.optimizer.wait()
    for n in full.engine.store.names():
        assert torch.equal(full.engine.store.master_tensor(n), resumed.engine.store.master_tensor(n)), n


def test_estimate_cli_lean_store(tmp_path, capsys):
    """``megatrain estimate --lean-store``: the layers lose their gradient and bf16 copy rows; GA is flagged."""
    from .models import COMMON

    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path)
    (tmp_path / "streamed.yaml").write_text("device_step_layers: 0\n")  # every layer streamed, stepped on the CPU
    rows = {}
    for extra in ([], ["--lean-store", "--grad-accum", "2"]):
        assert planner.main([str(tmp_path), "--seq-len", "64", "--gpu-memory", "80", "--device-layers", "0",
                             "--config", str(tmp_path / "streamed.yaml"), "--json", *extra]) == 0
        rows[bool(extra)] = json.loads(capsys.readouterr().out)
    full, lean_ = rows[False], rows[True]
    layers = full["host"]["master fp32"] // 4  # resident parts planned on the 80 GiB GPU: host = layers only
    assert full["host"]["grad fp32"] == 4 * layers and full["host"]["compute copy"] == 2 * layers
    assert lean_["host"]["grad fp32"] == 0 and lean_["host"].get("compute copy", 0) == 0
    assert lean_["host"]["master fp32"] + lean_["host"]["exp_avg fp32"] + lean_["host"]["exp_avg_sq fp32"] \
        == 12 * layers
    assert any("lean_store refuses gradient accumulation" in n for n in lean_["notes"])
    assert planner.main([str(tmp_path), "--seq-len", "64", "--gpu-memory", "80", "--device-layers", "0",
                         "--config", str(tmp_path / "streamed.yaml"), "--json", "--lean-store",
                         "--lean-compute-copy"]) == 0
    copied = json.loads(capsys.readouterr().out)
    assert copied["host"]["compute copy"] == 2 * layers and copied["host"]["grad fp32"] == 0
    assert "lean FP32 H2D cast staging" not in copied["gpu"]  # (bf16 streams: nothing to cast on the GPU)
    assert any("lean_compute_copy=True would add" in n for n in lean_["notes"])
    assert not any("lean_compute_copy" in n for n in copied["notes"])


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_trainer_exact_resume_with_lean_compute_copy(tmp_path):
    """bf16 with ``lean_compute_copy``: a resumed run (masters loaded, the copies refreshed from them) continues
    bit-identically to the uninterrupted one."""
    cfg = {"compute_dtype": "bfloat16", "lean_store": True, "lean_compute_copy": True}
    model = tiny("llama")
    kw = dict(save_strategy="steps", save_steps=2)
    full = MegaTrainTrainer(model=copy.deepcopy(model), args=_args(tmp_path / "a", cfg, **kw), train_dataset=_dataset())
    full.train()
    resumed = MegaTrainTrainer(model=copy.deepcopy(model), args=_args(tmp_path / "b", cfg, **kw),
                               train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert _log(full) == _log(resumed)
    resumed.engine.optimizer.wait(), full.engine.optimizer.wait()
    for u, v in zip(full.engine.layer_units, resumed.engine.layer_units):
        assert torch.equal(u.master, v.master) and torch.equal(u.compute, v.compute)
