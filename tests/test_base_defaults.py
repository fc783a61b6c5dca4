"""Composed trainers keep the base trainer's defaults, and other people's scripts train the same with the swap.

- every field default of ``megatrain_args_class(Base)`` (and ``MegaTrainSFTConfig``) equals ``Base``'s, for every
  TRL config installed: a user who swaps two lines keeps SFTConfig's learning rate, DPOConfig's 1e-6, ``bf16``...;
- TRL's own installed ``trl/scripts/sft.py`` run unchanged (the two classes swapped at run time, the script not
  copied) against the unswapped script on a tiny local model: the same logged hyper-parameters, losses within 1e-5.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import transformers
from transformers import TrainingArguments

from hf_megatrain.hf.compose import megatrain_args_class
from hf_megatrain.hf.training_args import MegaTrainTrainingArguments

from .models import tiny

TRL_CONFIGS = ["SFTConfig", "DPOConfig", "GRPOConfig", "KTOConfig", "ORPOConfig", "RewardConfig", "RLOOConfig",
               "CPOConfig", "BCOConfig", "PRMConfig", "NashMDConfig", "OnlineDPOConfig", "XPOConfig"]


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _installed_bases() -> list[type]:
    bases: list[type] = [TrainingArguments, transformers.Seq2SeqTrainingArguments]
    try:
        trl = importlib.import_module("trl")
    except ImportError:
        return bases
    for name in TRL_CONFIGS:
        try:
            cls = getattr(trl, name)
        except Exception:  # (not in this TRL version, or an extra it needs is missing)
            continue
        if isinstance(cls, type) and issubclass(cls, TrainingArguments):
            bases.append(cls)
    return bases


@pytest.mark.parametrize("base", _installed_bases(), ids=lambda b: b.__name__)
def test_composed_arguments_keep_every_base_default(base):
    composed = megatrain_args_class(base, module=__name__)
    ours = {f.name: f for f in dataclasses.fields(composed)}
    for f in dataclasses.fields(base):
        assert f.name in ours, f.name
        assert _default(ours[f.name]) == _default(f), (f"{composed.__name__}.{f.name} defaults to "
                                                       f"{_default(ours[f.name])!r}, {base.__name__} to {_default(f)!r}")
        assert ours[f.name].metadata == f.metadata, f.name  # (the --help text the CLI parsers show)
    own = set(MegaTrainTrainingArguments.__dataclass_fields__) - set(TrainingArguments.__dataclass_fields__)
    assert own <= set(ours)  # and the megatrain switches on top


def test_sft_config_keeps_sftconfig_defaults():
    trl = pytest.importorskip("trl")
    from hf_megatrain.hf.trl_support import MegaTrainSFTConfig

    ours = MegaTrainSFTConfig(output_dir="unused", use_cpu=True)
    plain = trl.SFTConfig(output_dir="unused", use_cpu=True)
    for name in ("learning_rate", "bf16", "logging_steps", "gradient_checkpointing", "max_length", "loss_type"):
        assert getattr(ours, name) == getattr(plain, name), name
    assert ours.learning_rate == 2e-5 and ours.megatrain


# -- TRL's own sft.py, swapped at run time -----------------------------------------------------------------------------
_RUNNER = textwrap.dedent("""
    import runpy, sys, trl, trl.scripts.sft as sft
    if sys.argv[1] == "megatrain":  # the README's two-line swap, applied to the installed script at run time
        from hf_megatrain.hf.trl_support import MegaTrainSFTConfig, MegaTrainSFTTrainer
        trl.SFTConfig, trl.SFTTrainer = MegaTrainSFTConfig, MegaTrainSFTTrainer
    sys.argv = [sft.__file__] + sys.argv[2:]
    runpy.run_path(sft.__file__, run_name="__main__")
""")


def _write_model_and_data(root: str) -> tuple[str, str]:
    from .test_trl import tokenizer

    model_dir, data_dir = os.path.join(root, "model"), os.path.join(root, "data")
    tiny("llama").save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    os.makedirs(data_dir)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for i in range(16):
            words = [f"t{4 + (i * 7 + j * 3) % 8}" for j in range(6 + i % 9)]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return model_dir, data_dir


def _run_sft_script(mode: str, model_dir: str, data_dir: str, out: str) -> list[dict]:
    args = ["--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out, "--max_steps", "3",
            "--logging_steps", "1", "--per_device_train_batch_size", "4", "--use_cpu", "--bf16", "False",
            "--report_to", "none", "--save_strategy", "steps", "--save_steps", "3", "--seed", "0", "--max_length", "32",
            "--dataloader_num_workers", "0", "--disable_tqdm", "True"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, mode, *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "checkpoint-3", "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    return [h for h in history if "loss" in h]


@pytest.mark.slow
def test_trl_sft_script_with_the_swap_matches_the_plain_script(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    model_dir, data_dir = _write_model_and_data(str(tmp_path))
    plain = _run_sft_script("plain", model_dir, data_dir, str(tmp_path / "plain"))
    ours = _run_sft_script("megatrain", model_dir, data_dir, str(tmp_path / "ours"))
    assert [h["step"] for h in ours] == [h["step"] for h in plain] == [1, 2, 3]
    for a, b in zip(ours, plain):
        assert a["learning_rate"] == b["learning_rate"], (a, b)  # SFTConfig's default 2e-5 schedule, not 5e-5
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(b["grad_norm"]), (a, b)
    # what hf_megatrain decided is on record in the output folder (the start-of-training summary)
    with open(tmp_path / "ours" / "_megatrain_run.json") as f:
        summary = json.load(f)
    assert summary["compute_dtype"] == "float32"


# -- a batch with no counted label, through both trainers --------------------------------------------------------------
def test_all_masked_batch_trains_like_plain_trainer(tmp_path):
    """The model's loss for a batch whose labels are all -100 is nan, as in HF (test_trained_model.py); through the
    Trainer, hf_megatrain does what plain Trainer does on the installed transformers: the same logged loss and grad
    norm (0 on 5.24), the same weights after it and after the normal steps that follow."""
    import copy

    import torch
    from transformers import Trainer

    from hf_megatrain import MegaTrainTrainer

    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (8, 12), generator=g)
    labels = ids.clone()
    labels[:4] = -100  # the first batch (sequential order below) counts no label at all
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    model = tiny("llama")
    kw = dict(per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2, weight_decay=0.1, use_cpu=True,
              report_to=[], logging_steps=1, disable_tqdm=True, save_strategy="no", seed=0)

    class Sequential:
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(data)

    plain = type("PlainSeq", (Sequential, Trainer), {})(
        model=copy.deepcopy(model), args=TrainingArguments(output_dir=str(tmp_path / "p"), **kw), train_dataset=data)
    ours = type("OursSeq", (Sequential, MegaTrainTrainer), {})(
        model=copy.deepcopy(model), args=MegaTrainTrainingArguments(output_dir=str(tmp_path / "o"), **kw),
        train_dataset=data)
    plain.train()
    ours.train()
    logged = [[(h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h] for t in (plain, ours)]
    for (lp, gp), (lo, go) in zip(*logged):
        assert (lp != lp and lo != lo) or abs(lp - lo) <= 1e-5 * max(1.0, abs(lp)), logged
        assert (gp != gp and go != go) or abs(gp - go) <= 1e-4 * max(1.0, abs(gp)), logged
    ref = dict(plain.model.named_parameters())
    for n, p in ours.model.named_parameters():
        assert torch.allclose(p.detach(), ref[n].detach(), rtol=1e-5, atol=1e-7), n
