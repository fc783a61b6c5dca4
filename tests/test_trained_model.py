"""What a Trainer user does with the trained model object (issue 17, items 1-3 and 9), checked against plain
transformers: ``trainer.model.save_pretrained`` / ``state_dict`` / ``named_parameters`` present every layer,
``trainer.model.generate`` gives the exported model's tokens, ``train()`` returns with the last update finished and
a script ending in it exits cleanly, and a batch with no counted label has a nan loss as in HF."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import transformers
from peft import PeftModel

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, MegaTrainPlugin, MegaTrainTrainer
from hf_megatrain.optim.adamw import UnitAdamW

from .models import tiny
from .test_peft import lora
from .test_trainer import dataset, mt_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trained(tmp_path, model=None, config=None, steps=2) -> MegaTrainTrainer:
    trainer = MegaTrainTrainer(model=model if model is not None else tiny("llama"),
                               args=mt_args(tmp_path / "run", config, max_steps=steps), train_dataset=dataset())
    trainer.train()
    return trainer


def _masters(trainer: MegaTrainTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.engine.named_master_tensors()}


# -- 1. the converted model presents its real weights ---------------------------------------------------------------
def test_model_save_pretrained_writes_every_layer(tmp_path):
    trainer = _trained(tmp_path)
    masters = _masters(trainer)
    trainer.model.save_pretrained(str(tmp_path / "out"))
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    theirs = dict(loaded.named_parameters())
    assert set(theirs) == set(masters)
    assert any(".layers." in n for n in masters)
    for n, t in masters.items():
        assert torch.equal(theirs[n].detach(), t), n


def test_state_dict_and_named_parameters_are_whole(tmp_path):
    plain = tiny("llama", tie=True)
    trainer = _trained(tmp_path, tiny("llama", tie=True))
    masters = _masters(trainer)
    model = trainer.model
    sd = model.state_dict()
    assert set(sd) == set(plain.state_dict())  # tied lm_head.weight listed too, as torch does
    for n, t in masters.items():
        assert torch.equal(sd[n], t), n
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    named = dict(model.named_parameters())
    assert list(named) == [n for n, _ in plain.named_parameters()]
    for n, p in named.items():
        assert p.requires_grad and torch.equal(p.detach().float(), masters[n]), n
    assert model.num_parameters() == plain.num_parameters()
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    # a wrapping module's state_dict recurses into the converted one with a prefix
    assert set(torch.nn.ModuleDict({"m": model}).state_dict()) == {f"m.{n}" for n in plain.state_dict()}


@pytest.mark.parametrize("tie", [False, True])
def test_load_state_dict_loads_every_layer(tie):
    """load_state_dict on the converted model writes the layers' masters too (plain nn.Module would load the
    resident parts only and call every layer key unexpected, which strict=False callers never read); the next
    forward computes with the loaded weights; strict errors and size mismatches change nothing."""
    ref = tiny("llama", tie=tie)
    model = tiny("llama", tie=tie)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"))
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    assert str(model.load_state_dict(sd)) == "<All keys matched successfully>"
    for n in engine.store.names():
        assert torch.equal(engine.store.master_tensor(n), sd[n]), n
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5)
    before = {n: engine.store.master_tensor(n).clone() for n in engine.store.names()}
    part = {"model.layers.1.mlp.up_proj.weight": sd["model.layers.1.mlp.up_proj.weight"] + 1, "bogus": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="nothing was loaded"):
        model.load_state_dict(part)
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict({"model.layers.0.mlp.up_proj.weight": torch.zeros(3)}, strict=False)
    assert all(torch.equal(engine.store.master_tensor(n), t) for n, t in before.items())
    res = model.load_state_dict(part, strict=False)
    assert res.unexpected_keys == ["bogus"] and "model.layers.0.mlp.up_proj.weight" in res.missing_keys
    assert torch.equal(engine.store.master_tensor("model.layers.1.mlp.up_proj.weight"), part[
        "model.layers.1.mlp.up_proj.weight"])


def test_save_pretrained_refuses_what_it_cannot_honour(tmp_path):
    trainer = _trained(tmp_path, steps=1)
    with pytest.raises(ValueError, match="state_dict"):
        trainer.model.save_pretrained(str(tmp_path / "a"), state_dict={})
    with pytest.raises(ValueError, match="push_to_hub"):
        trainer.model.save_pretrained(str(tmp_path / "b"), push_to_hub=True)
    with pytest.raises(TypeError, match="variant"):
        trainer.model.save_pretrained(str(tmp_path / "c"), variant="v2")
    assert not any((tmp_path / d).exists() for d in "abc")


def test_plugin_converted_model_saves_whole(tmp_path):
    model = tiny("qwen2")
    wrapped, opt = MegaTrainPlugin({"compute_dtype": "float32"}).prepare(model, lr=1e-2)
    for batch in dataset(4):
        wrapped(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(tmp_path))  # the original object the user still holds
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"], info
    theirs = dict(loaded.named_parameters())
    for n, t in wrapped.engine.named_master_tensors():
        assert torch.equal(theirs[n].detach(), t), n


def test_peft_model_save_pretrained_writes_every_adapter(tmp_path):
    trainer = _trained(tmp_path, lora(tiny("llama")))
    masters = _masters(trainer)
    trainer.model.save_pretrained(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(tiny("llama"), str(tmp_path / "adapter"))
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert theirs and set(theirs) == {n for n in masters if "lora_" in n}
    for n, p in theirs.items():
        assert torch.equal(p.detach(), masters[n]), n


# -- 2. generate() ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("micro_batch_size", [0, pytest.param(1, marks=pytest.mark.slow)])  # (fast tier: one)
def test_generate_matches_plain_transformers(tmp_path, micro_batch_size):
    config = {"compute_dtype": "float32", "micro_batch_size": micro_batch_size}
    trainer = _trained(tmp_path, config=config)
    trainer.save_model(str(tmp_path / "out"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    model = trainer.model.eval()
    prompts = torch.tensor([[5, 17, 33, 41, 9, 60], [70, 3, 88, 12, 25, 44]])
    mask = torch.ones_like(prompts)
    for rows in (prompts[:1], prompts[1:], prompts):  # one prompt at a time and a batch
        kw = dict(attention_mask=mask[: len(rows)], max_new_tokens=10, do_sample=False, pad_token_id=0)
        ours = model.generate(rows, **kw)
        theirs = plain.generate(rows, **kw)
        assert torch.equal(ours, theirs), (ours, theirs)
    with torch.no_grad():  # a cached forward gives the plain model's logits too
        out = model(prompts, use_cache=True)
        ref = plain(prompts, use_cache=True)
    assert out.past_key_values.get_seq_length() == prompts.shape[1]
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "mixtral", "gpt_oss"])
def test_generate_matches_across_families(tmp_path, family):
    """Sliding-window / per-type caches, soft-capping, MoE asking for router logits (its aux loss) in HF's own
    forward; the checkpoint comes from the converted model's save_pretrained."""
    model = tiny(family)
    MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", micro_batch_size=1), device="cpu")
    model.save_pretrained(str(tmp_path))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    model.eval()
    prompts = torch.tensor([[5, 17, 33, 41, 9, 60, 2, 7], [70, 3, 88, 12, 25, 44, 1, 8]])
    kw = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False, pad_token_id=0)
    try:
        want = plain.generate(prompts, **kw)
    except RuntimeError as e:  # (some releases fail in plain transformers itself, e.g. 5.17's MoE aux loss)
        with pytest.raises(type(e)):
            model.generate(prompts, **kw)  # the same call fails the same way, not silently otherwise
    else:
        assert torch.equal(model.generate(prompts, **kw), want)
    with torch.no_grad():
        ours, theirs = model(prompts, labels=prompts), plain(prompts, labels=prompts)
    assert torch.allclose(ours.loss, theirs.loss, atol=1e-5)
    if getattr(theirs, "aux_loss", None) is not None:
        assert torch.allclose(ours.aux_loss, theirs.aux_loss, atol=1e-5)


def test_cached_forward_with_gradients_is_refused(tmp_path):
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    with pytest.raises(RuntimeError, match="use_cache=False"):
        engine.model(torch.tensor([[1, 2, 3]]), use_cache=True)


# -- 3. train() returns with every update finished; a script ending in it exits cleanly ------------------------------
def _slow_updates(monkeypatch, seconds: float = 0.3) -> None:
    """Make every unit update sleep first, so the last step is still running when Trainer's loop ends."""
    orig = UnitAdamW.update_

    def slow(self, *a, **k):
        time.sleep(seconds)
        return orig(self, *a, **k)

    monkeypatch.setattr(UnitAdamW, "update_", slow)


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_train_returns_with_the_last_update_finished(tmp_path, monkeypatch):
    _slow_updates(monkeypatch)
    trainer = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path, {"compute_dtype": "float32",
                                                                             "overlap_optimizer": True}, max_steps=2),
                               train_dataset=dataset())
    trainer.train()
    alive = [t.name for t in threading.enumerate() if t.name == "megatrain-adamw" and t.is_alive()]
    assert not alive, alive


@pytest.mark.slow
def test_script_ending_in_train_exits_cleanly(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from hf_megatrain import MegaTrainTrainer
        from hf_megatrain.optim.adamw import UnitAdamW
        from tests.models import tiny
        from tests.test_trainer import dataset, mt_args
        orig = UnitAdamW.update_
        def slow(self, *a, **k):
            time.sleep(0.3)
            return orig(self, *a, **k)
        UnitAdamW.update_ = slow
        args = mt_args({str(tmp_path)!r}, {{"compute_dtype": "float32", "overlap_optimizer": True}}, max_steps=2)
        MegaTrainTrainer(model=tiny("llama"), args=args, train_dataset=dataset()).train()
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr


# -- 9. no counted label: nan, as HF ---------------------------------------------------------------------------------
def test_all_ignored_labels_give_nan_like_hf(tmp_path):
    model = tiny("llama")
    plain = tiny("llama")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    with torch.no_grad():
        theirs = plain(input_ids=ids, labels=labels).loss
        theirs_n = plain(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(0)).loss
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    with torch.no_grad():
        ours = engine(input_ids=ids, labels=labels).loss
        ours_n = engine(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(0)).loss
    assert torch.isnan(theirs) and torch.isnan(theirs_n)
    assert torch.isnan(ours) and torch.isnan(ours_n)
    # through Trainer.evaluate: eval_loss nan in both
    ignored = [{"input_ids": r, "labels": torch.full_like(r, -100)} for r in ids]
    args = dict(per_device_eval_batch_size=2)
    ref = transformers.Trainer(model=plain, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "ref"), report_to=[], use_cpu=True, **args), eval_dataset=ignored)
    ours_t = MegaTrainTrainer(model=engine, args=mt_args(tmp_path / "mt", **args), eval_dataset=ignored)
    assert torch.isnan(torch.tensor(ref.evaluate()["eval_loss"]))
    assert torch.isnan(torch.tensor(ours_t.evaluate()["eval_loss"]))
