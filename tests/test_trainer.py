"""MegaTrainTrainer vs plain transformers.Trainer (CPU, fp32 compute), argument validation, evaluation, exact
resume, best-model tracking and checkpoint rotation."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
import transformers

from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments
from hf_megatrain.checkpoint import CheckpointError, verify_checkpoint

from .models import tiny
from .parity import rel

FP32 = {"compute_dtype": "float32"}


def dataset(n: int = 16, seq: int = 12, vocab: int = 96, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        labels = ids.clone()
        labels[: (i % 4) + 1] = -100  # prompt-like ignored tokens, different per row
        out.append({"input_ids": ids, "labels": labels})
    return out


def common_args(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=1,
              logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
              dataloader_num_workers=0)
    kw.update(over)
    return kw


def mt_args(out, config=None, **over):
    return MegaTrainTrainingArguments(**common_args(out, **over), megatrain_config=config or dict(FP32))


def losses(trainer) -> list[tuple[int, float, float | None]]:
    return [(h["step"], h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]


def test_parity_with_plain_trainer(tmp_path):
    model = tiny("llama")
    ref = transformers.Trainer(model=copy.deepcopy(model), args=transformers.TrainingArguments(
        **common_args(tmp_path / "ref")), train_dataset=dataset())
    ref.train()
    ours = MegaTrainTrainer(model=copy.deepcopy(model), args=mt_args(tmp_path / "mt"), train_dataset=dataset())

    def no_trainer_clip(*a, **k):
        raise AssertionError("Trainer's clip_grad_norm_ ran on the streamed model")

    ours.accelerator.clip_grad_norm_ = no_trainer_clip
    ours.train()
    ref_log, our_log = losses(ref), losses(ours)
    assert [s for s, _, _ in our_log] == [1, 2, 3]
    for (s, rl, rg), (_, ol, og) in zip(ref_log, our_log):
        assert abs(ol - rl) <= 1e-5 * abs(rl), (s, ol, rl)
        assert abs(og - rg) <= 1e-5 * abs(rg), (s, og, rg)
    lrs = [h["learning_rate"] for h in ref.state.log_history if "loss" in h]
    assert lrs == [h["learning_rate"] for h in ours.state.log_history if "loss" in h]
    ours.engine.optimizer.wait()
    for n, p in ref.model.named_parameters():
        assert rel(ours.engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n


def test_eval_with_compute_metrics_matches_plain_trainer(tmp_path):
    model = tiny("qwen2", tie=True)

    def metrics(p):
        preds = p.predictions.argmax(-1)[:, :-1]
        labels = p.label_ids[:, 1:]
        mask = labels != -100
        return {"acc": float((preds[mask] == labels[mask]).mean())}

    kw = dict(eval_dataset=dataset(6, seed=1), compute_metrics=metrics)
    ref = transformers.Trainer(model=copy.deepcopy(model), args=transformers.TrainingArguments(
        **common_args(tmp_path / "ref", per_device_eval_batch_size=4)), **kw)
    ours = MegaTrainTrainer(model=copy.deepcopy(model), args=mt_args(tmp_path / "mt", per_device_eval_batch_size=4),
                            **kw)
    r, o = ref.evaluate(), ours.evaluate()
    assert abs(r["eval_loss"] - o["eval_loss"]) <= 1e-5 * r["eval_loss"]
    assert r["eval_acc"] == o["eval_acc"]
    pred = ours.predict(dataset(3, seed=2))
    assert pred.predictions.shape == (3, 12, 96)


def test_compute_loss_func_and_gradient_checkpointing_flag(tmp_path):
    seen = []

    def loss_fn(outputs, labels, num_items_in_batch=None):
        seen.append(outputs.logits.shape)
        return transformers.loss.loss_utils.ForCausalLMLoss(outputs.logits, labels, 96,
                                                            num_items_in_batch=num_items_in_batch)

    class Count(transformers.TrainerCallback):
        events: list[str] = []

        def on_step_end(self, args, state, control, **kw):
            self.events.append("step")

        def on_log(self, args, state, control, logs=None, **kw):
            self.events.append("log")

    tr = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path, max_steps=2, gradient_checkpointing=True,
                                                            disable_tqdm=False),
                          train_dataset=dataset(), compute_loss_func=loss_fn, callbacks=[Count()])
    tr.train()
    assert seen and seen[0] == (2, 12, 96) and np.isfinite(losses(tr)[0][1])
    assert Count.events.count("step") == 2 and "log" in Count.events


@pytest.mark.parametrize("bad, match", [
    (dict(deepspeed={"zero_optimization": {"stage": 3}}), "deepspeed"),
    (dict(fsdp="full_shard"), "fsdp"),
    (dict(optim="adafactor"), "adamw_torch"),
    (dict(megatrain_config={"compute_dtype": "float32", "save_dtype": "float16"}), "save_dtype"),
    (dict(megatrain_config={"compute_dtype": "float32", "stream_depth": 3}), "valid keys"),
    (dict(megatrain_config="/nonexistent/megatrain.yaml"), "neither"),
    (dict(fp16=True), "fp16"),
    (dict(use_liger_kernel=True), "liger"),
])
def test_bad_arguments(tmp_path, bad, match):
    kw = common_args(tmp_path)
    kw.setdefault("megatrain_config", dict(FP32))
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        MegaTrainTrainingArguments(**kw)


def test_config_sources(tmp_path, monkeypatch):
    y = tmp_path / "mt.yaml"
    y.write_text("megatrain:\n  compute_dtype: float32\n  save_dtype: bfloat16\n  num_slots: 3\n")
    args = MegaTrainTrainingArguments(**common_args(tmp_path), megatrain_config=str(y))
    cfg = args.megatrain_resolved_config()
    assert (cfg.compute_dtype, cfg.save_dtype, cfg.num_slots) == ("float32", "bfloat16", 3)
    monkeypatch.setenv("MEGATRAIN_CONFIG", str(y))
    monkeypatch.setenv("MEGATRAIN_NUM_SLOTS", "4")
    args = MegaTrainTrainingArguments(**common_args(tmp_path))
    cfg = args.megatrain_resolved_config()
    assert (cfg.num_slots, cfg.save_dtype) == (4, "bfloat16")  # env key wins over the yaml's; save_dtype from the yaml
    args = MegaTrainTrainingArguments(**common_args(tmp_path),
                                      megatrain_config='{"compute_dtype": "float32", "save_dtype": "bfloat16"}')
    assert args.megatrain_resolved_config().save_dtype == "bfloat16"
    parsed, = transformers.HfArgumentParser(MegaTrainTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--megatrain_config", '{"compute_dtype": "float32"}', "--use_cpu"])
    assert parsed.megatrain_resolved_config().compute_dtype == "float32"


def test_rejects_plain_args_and_custom_optimizer(tmp_path):
    with pytest.raises(TypeError, match="MegaTrainTrainingArguments"):
        MegaTrainTrainer(model=tiny("llama"), args=transformers.TrainingArguments(output_dir=str(tmp_path)))
    m = tiny("llama")
    with pytest.raises(ValueError, match="optimizers"):
        MegaTrainTrainer(model=m, args=mt_args(tmp_path), optimizers=(torch.optim.SGD(m.parameters(), 0.1), None))


def test_exact_resume(tmp_path):
    """6 steps uninterrupted == 3 steps, checkpoint, new process state, resume to 6: bit for bit."""
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3)
    full = MegaTrainTrainer(model=tiny("mistral"), args=mt_args(tmp_path / "a", **kw), train_dataset=dataset(24))
    full.train()
    resumed = MegaTrainTrainer(model=tiny("mistral"), args=mt_args(tmp_path / "b", **kw), train_dataset=dataset(24))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    a, b = losses(full), losses(resumed)  # the resumed history starts with the checkpoint's steps 1-3
    assert [s for s, _, _ in b] == [1, 2, 3, 4, 5, 6]
    assert a == b  # losses and grad norms of steps 4-6 identical
    full.engine.optimizer.wait()
    resumed.engine.optimizer.wait()
    for n in full.engine.store.names():
        assert torch.equal(full.engine.store.master_tensor(n), resumed.engine.store.master_tensor(n)), n


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_exact_resume_with_gpu_stepped_layers_on_host_state(tmp_path):
    """device_step_state="host" (the GPU-stepped layers' master and moments live on the host and are copied in for
    each update): a resumed run loads them and goes on bit for bit; the copies taken before the load are not used."""
    cfg = {"compute_dtype": "bfloat16", "device_step_layers": 1, "device_step_state": "host"}
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    full = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "a", cfg, **kw), train_dataset=dataset())
    full.train()
    assert full.engine.optimizer.device_stepper.host_state
    resumed = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "b", cfg, **kw), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert losses(full) == losses(resumed)
    for n in full.engine.store.names():
        assert torch.equal(full.engine.store.master_tensor(n), resumed.engine.store.master_tensor(n)), n


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_exact_resume_bf16_compute_bf16_export(tmp_path):
    """The FP32 master travels next to bf16 exported weights, so resuming stays exact."""
    cfg = {"compute_dtype": "bfloat16", "save_dtype": "bfloat16"}
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    full = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "a", cfg, **kw), train_dataset=dataset())
    full.train()
    ck = tmp_path / "a" / "checkpoint-2"
    assert json.loads((ck / "config.json").read_text())["dtype"] == "bfloat16"
    assert (ck / "megatrain_master.safetensors").exists()
    resumed = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "b", cfg, **kw), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=str(ck))
    assert [s for s, _, _ in losses(resumed)] == [1, 2, 3, 4]
    assert losses(full) == losses(resumed)


def test_corrupt_or_incomplete_resume_folder(tmp_path):
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2)
    tr = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "a", **kw), train_dataset=dataset())
    tr.train()
    ck = tmp_path / "a" / "checkpoint-2"

    def attempt(folder, **over):
        fresh = MegaTrainTrainer(model=tiny("llama", **over), args=mt_args(tmp_path / "b", **kw),
                                 train_dataset=dataset())
        before = {n: fresh.engine.store.master_tensor(n).clone() for n in fresh.engine.store.names()}
        with pytest.raises(CheckpointError) as e:
            fresh.train(resume_from_checkpoint=str(folder))
        for n, t in before.items():  # nothing was overwritten
            assert torch.equal(fresh.engine.store.master_tensor(n), t)
        return str(e.value)

    import shutil
    broken = tmp_path / "broken1"
    shutil.copytree(ck, broken)
    os.remove(broken / "megatrain_optimizer.safetensors")
    assert "megatrain_optimizer.safetensors" in attempt(broken)
    broken = tmp_path / "broken2"
    shutil.copytree(ck, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(broken / "model.safetensors") // 2)
    assert "model.safetensors" in attempt(broken)
    assert "shape" in attempt(ck, intermediate_size=48)  # a checkpoint of another model
    tr.save_model(str(tmp_path / "export"))
    assert "trainer_state.json" in attempt(tmp_path / "export")  # a model export, not a Trainer checkpoint
    broken = tmp_path / "broken3"
    shutil.copytree(ck, broken)
    (broken / "megatrain_manifest.json").unlink()
    with open(broken / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 16)  # garbled header
    assert "megatrain_manifest.json" in attempt(broken)  # no manifest: refused before anything is read
    with pytest.raises(CheckpointError, match="model.safetensors"):  # accepted knowingly: headers still checked
        verify_checkpoint(str(broken), allow_unverified=True)
    broken = tmp_path / "broken4"  # same size, bytes flipped inside the data: only the checksum can tell
    shutil.copytree(ck, broken)
    path = broken / "megatrain_optimizer.safetensors"
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 4000, len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    msg = attempt(broken)
    assert "megatrain_optimizer.safetensors" in msg and "CRC-32" in msg


def test_save_total_limit_and_load_best_model(tmp_path):
    kw = dict(max_steps=6, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
              save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="loss",
              greater_is_better=True)  # "best" = highest eval loss: an early checkpoint, not the last one
    tr = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path, **kw), train_dataset=dataset(32),
                          eval_dataset=dataset(4, seed=3))
    tr.train()
    kept = sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-"))
    assert len(kept) == 2 and "checkpoint-6" in kept, kept
    best = tr.state.best_model_checkpoint
    assert best is not None and os.path.basename(best) in kept and not best.endswith("-6")
    from safetensors.torch import load_file
    saved = load_file(os.path.join(best, "model.safetensors"))
    for n, t in saved.items():
        assert torch.equal(tr.engine.store.master_tensor(n), t), n


def test_megatrain_false_is_plain_trainer(tmp_path):
    model = tiny("llama")
    ref = transformers.Trainer(model=copy.deepcopy(model), args=transformers.TrainingArguments(
        **common_args(tmp_path / "ref")), train_dataset=dataset())
    ref.train()
    off = MegaTrainTrainer(model=copy.deepcopy(model), args=MegaTrainTrainingArguments(
        **common_args(tmp_path / "off"), megatrain=False, optim="adafactor"), train_dataset=dataset())
    assert off.engine is None
    off.args.optim = ref.args.optim  # adafactor was accepted (no MegaTrain checks); train with the same optimizer
    off.train()
    assert losses(off) == losses(ref)


def test_one_process_on_a_multi_gpu_host_keeps_the_per_device_batch(tmp_path, caplog, monkeypatch):
    """Trainer sizes its batch per_device x n_gpu when one process sees several GPUs (nn.DataParallel). The engine
    drives one GPU: it must run the per-device batch, not n_gpu times it on that one device, and say how to use the
    others (a 2-GPU host ran a double batch this way, read as a step twice as slow)."""
    # Two visible GPUs and no launcher, as TrainingArguments sees them, until the trainer sets the count to 1.
    monkeypatch.setattr(transformers.TrainingArguments, "n_gpu",
                        property(lambda self: 1 if vars(self).get("_n_gpu") == 1 else 2))
    args = mt_args(tmp_path, max_steps=1)
    with caplog.at_level("WARNING"):
        trainer = MegaTrainTrainer(model=tiny("llama"), args=args, train_dataset=dataset())
    assert args.n_gpu == 1 and args.train_batch_size == 2
    assert trainer.get_train_dataloader().total_batch_size == 2
    assert "accelerate launch --multi_gpu --num_processes 2" in caplog.text
