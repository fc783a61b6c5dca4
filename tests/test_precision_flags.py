"""Precision flags mean what they mean in Trainer (issue 17 item 4): an explicit ``compute_dtype`` wins, else
``bf16=True`` computes in bfloat16, else the model's dtype decides (float32 -> float32, no autocast, as plain
Trainer); ``fp16`` is refused. The Accelerate plugin (no flags) keeps its bfloat16 default and says so."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainPlugin, MegaTrainTrainer, MegaTrainTrainingArguments
from hf_megatrain.config import MegaTrainConfig, resolve_config
from hf_megatrain.engine.runtime import MegaTrainEngine

from .models import tiny
from .parity import rel
from .test_trainer import common_args, dataset, losses


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("MEGATRAIN_")]:
        monkeypatch.delenv(key)


def args(out, config=None, **over) -> MegaTrainTrainingArguments:
    return MegaTrainTrainingArguments(**common_args(out, **over), megatrain_config=config)


def engine_dtype(tmp_path, model=None, config=None, **over) -> torch.dtype:
    trainer = MegaTrainTrainer(model=model if model is not None else tiny("llama"), args=args(tmp_path, config, **over),
                               train_dataset=dataset())
    return trainer.engine.compute_dtype


def test_fp32_model_without_flags_trains_in_fp32_like_plain_trainer(tmp_path):
    """No bf16 flag, no compute_dtype, a float32 model: plain Trainer computes in fp32 (no autocast); so do we
    (it computed in bf16 before)."""
    model = tiny("llama")
    ref = transformers.Trainer(model=copy.deepcopy(model), args=transformers.TrainingArguments(
        **common_args(tmp_path / "ref")), train_dataset=dataset())
    ref.train()
    ours = MegaTrainTrainer(model=copy.deepcopy(model), args=args(tmp_path / "mt"), train_dataset=dataset())
    assert ours.engine.compute_dtype == torch.float32 and ours.engine.config.compute_dtype == "float32"
    ours.train()
    for (s, rl, rg), (_, ol, og) in zip(losses(ref), losses(ours), strict=True):
        assert abs(ol - rl) <= 1e-5 * abs(rl), (s, ol, rl)
        assert abs(og - rg) <= 1e-5 * abs(rg), (s, og, rg)
    for n, p in ref.model.named_parameters():
        assert rel(ours.engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n


def test_bf16_flag_computes_in_bf16_and_an_explicit_key_wins_with_a_warning(tmp_path, caplog):
    assert engine_dtype(tmp_path / "a", bf16=True) == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        a = args(tmp_path / "b", {"compute_dtype": "float32"}, bf16=True)
    assert "bf16=True but the megatrain config sets compute_dtype='float32'" in caplog.text
    assert MegaTrainTrainer(model=tiny("llama"), args=a, train_dataset=dataset()).engine.compute_dtype == torch.float32


def test_explicit_compute_dtype_wins_over_the_model_dtype(tmp_path, monkeypatch):
    """compute_dtype given (dict, MegaTrainConfig object, env) with bf16=False: that dtype; the same sources without
    the key leave it to the model (fp32 here)."""
    assert engine_dtype(tmp_path / "d", config={"compute_dtype": "bfloat16"}, bf16=False) == torch.bfloat16
    assert engine_dtype(tmp_path / "o", config=MegaTrainConfig(compute_dtype="bfloat16")) == torch.bfloat16
    assert engine_dtype(tmp_path / "n", config=MegaTrainConfig(micro_batch_size=1)) == torch.float32
    assert engine_dtype(tmp_path / "k", config={"micro_batch_size": 1}) == torch.float32
    monkeypatch.setenv("MEGATRAIN_COMPUTE_DTYPE", "bfloat16")
    assert engine_dtype(tmp_path / "e") == torch.bfloat16


@pytest.mark.parametrize("flag", ["fp16", "fp16_full_eval"])
def test_fp16_refused_with_the_way_out(tmp_path, flag):
    with pytest.raises(ValueError, match=rf"{flag}=True is not supported with megatrain=True: hf_megatrain computes "
                                         r"in bfloat16 or float32.*Use bf16=True.*compute_dtype"):
        args(tmp_path, **{flag: True})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_flags_follow_the_model_dtype(tmp_path, dtype):
    model = tiny("qwen2").to(dtype)
    assert engine_dtype(tmp_path, model=model) == dtype


def test_prebuilt_engine_contradicting_the_flags_is_refused(tmp_path):
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    with pytest.raises(ValueError, match=r"converted with compute_dtype='float32'.*ask for 'bfloat16' \(bf16=True\)"):
        MegaTrainTrainer(model=engine, args=args(tmp_path / "a", bf16=True), train_dataset=dataset())
    # no flag and no key: the engine's dtype was decided when it was built
    trainer = MegaTrainTrainer(model=engine, args=args(tmp_path / "b"), train_dataset=dataset())
    assert trainer.engine is engine and engine.compute_dtype == torch.float32


def test_resolve_config_reports_the_keys_it_was_given():
    assert resolve_config({"compute_dtype": "float32"}, environ={"MEGATRAIN_NUM_SLOTS": "3"}).explicit_keys == {
        "compute_dtype", "num_slots"}
    assert resolve_config(None, environ={}).explicit_keys == frozenset()
    cfg = MegaTrainConfig(micro_batch_size=2)
    assert cfg.explicit_keys == {"micro_batch_size"} and resolve_config(cfg, environ={}) == cfg
    assert resolve_config(cfg, environ={}).explicit_keys == {"micro_batch_size"}
    assert copy.deepcopy(cfg).explicit_keys == {"micro_batch_size"}
    assert MegaTrainConfig.from_dict({"compute_dtype": "bf16"}).explicit_keys == {"compute_dtype"}


def test_plugin_keeps_bf16_default_and_warns_for_an_fp32_model(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        model, _ = MegaTrainPlugin({"micro_batch_size": 1}, device="cpu").prepare(tiny("llama"))
    assert model.engine.compute_dtype == torch.bfloat16
    assert "the model is float32 and no compute_dtype was given: layers compute in bfloat16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        model, _ = MegaTrainPlugin({"compute_dtype": "float32"}, device="cpu").prepare(tiny("llama"))
    assert model.engine.compute_dtype == torch.float32 and "no compute_dtype was given" not in caplog.text
