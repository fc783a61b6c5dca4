"""DPO as TRL users write it: full fine-tuning, ``ref_model`` left out, no ``precompute_ref_log_probs``.

Plain ``DPOTrainer`` then loads a second copy of the policy's checkpoint as its reference; hf_megatrain precomputes
the reference log-probs with the same streamed model, its initial weights, before training (hf/dpo_support.py).
Against plain DPOTrainer with its implicit copy (CPU, fp32, the model loaded from a folder so that plain TRL can
load the copy): per logging step the loss, grad norm and DPO's metrics, the evaluation, and every trained weight,
within 1e-5 relative; the run summary says what the reference is; and what a precomputed reference cannot serve
is refused, saying what to pass. Skipped where trl is not installed.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

import transformers  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from hf_megatrain.hf.compose import megatrain_args_class, megatrain_trainer_class  # noqa: E402
from hf_megatrain.hf.trainer import RUN_SUMMARY  # noqa: E402
from hf_megatrain.hf.dpo_support import MegaTrainDPOConfig, MegaTrainDPOTrainer  # noqa: E402

from .models import tiny  # noqa: E402
from .test_dpo import REL, check_parity, dpo_kwargs, pairs, tokenizer  # noqa: E402
from .trl_parity import logs  # noqa: E402

IMPLICIT = "log-probs precomputed with the initial weights (ref_model not given)"


@pytest.fixture
def model_dir(tmp_path_factory):
    """The tiny model as a checkpoint folder: what plain DPOTrainer reloads as its reference copy."""
    path = tmp_path_factory.mktemp("init")
    tiny("llama").save_pretrained(path)
    return str(path)


def load(path: str, train_mode: bool = False) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train(train_mode)


def run_pair(tmp_path, model_dir, *, evaluate=True, train_mode=False, **over):
    """Plain DPOTrainer and the composed ``megatrain_trainer_class(DPOTrainer)``, neither given a reference."""
    if evaluate:
        over = dict(eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=3, **over)
    extra = dict(eval_dataset=pairs(6, seed=1)) if evaluate else {}
    plain = DPOTrainer(model=load(model_dir, train_mode), args=DPOConfig(**dpo_kwargs(tmp_path / "ref", **over)),
                       train_dataset=pairs(), processing_class=tokenizer(), **extra)
    assert plain.ref_model is not None and not plain.precompute_ref_logps  # (plain TRL: the implicit copy)
    plain.train()
    args = megatrain_args_class(DPOConfig)(**dpo_kwargs(tmp_path / "mt", **over),
                                           megatrain_config={"compute_dtype": "float32"})
    ours = megatrain_trainer_class(DPOTrainer)(model=load(model_dir, train_mode), args=args, train_dataset=pairs(),
                                               processing_class=tokenizer(), **extra)
    ours.train()
    return plain, ours


def test_dpo_implicit_reference_matches_plain(tmp_path, model_dir):
    """The reference DPOTrainer loads as a copy is, here, log-probs precomputed with the initial weights (train and
    eval sets): the same losses, rewards, evaluation and weights; nothing loaded twice; the run summary says so."""
    plain, ours = run_pair(tmp_path, model_dir)
    assert ours.ref_model is None and ours.precompute_ref_logps  # no second copy
    assert ours.args.precompute_ref_log_probs is False  # the user's arguments as given (saved with checkpoints)
    assert "ref_chosen_logps" in ours.train_dataset.column_names
    assert len(logs(ours, "eval_loss")) == 1
    check_parity(plain, ours)
    summary = json.loads((tmp_path / "mt" / "_megatrain_run.json").read_text())
    assert summary["reference"] == IMPLICIT


@pytest.mark.slow  # (a variant of the fast test's path)
def test_dpo_implicit_reference_with_dropout_matches_plain(tmp_path, model_dir):
    """``disable_dropout=False`` on a model with attention dropout, handed over in train mode: plain TRL's copy
    computes in eval mode (no dropout), and so does the precompute pass; the pass leaves the RNG (and so the
    training order and the policy's dropout masks) as plain TRL's load does."""
    model = load(model_dir)
    model.config.attention_dropout = 0.1
    model.save_pretrained(model_dir)
    plain, ours = run_pair(tmp_path, model_dir, evaluate=False, train_mode=True, disable_dropout=False)
    check_parity(plain, ours)


def test_dpo_implicit_reference_evaluate_new_dataset(tmp_path, model_dir):
    """``evaluate(new_dataset)``: before training the initial weights serve (as plain TRL's copy: same metrics);
    after a step they are gone, and a new dataset is refused, saying what to pass."""
    kw = dict(train_dataset=pairs(), processing_class=tokenizer())
    plain = DPOTrainer(model=load(model_dir), args=DPOConfig(**dpo_kwargs(tmp_path / "ref")), **kw)
    ours = MegaTrainDPOTrainer(model=load(model_dir), args=MegaTrainDPOConfig(
        **dpo_kwargs(tmp_path / "mt", per_device_eval_batch_size=3), megatrain_config={"compute_dtype": "float32"}),
        **kw)
    want = plain.evaluate(pairs(6, seed=2))
    got = ours.evaluate(pairs(6, seed=2))
    for k in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert got[k] == pytest.approx(want[k], rel=REL, abs=1e-6), k
    assert got["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # (policy = reference before training)
    ours.train()
    with pytest.raises(ValueError, match="ref_model=<the initial model"):
        ours.evaluate(pairs(6, seed=2))


def test_dpo_implicit_reference_refusals(tmp_path, model_dir):
    """What precomputed log-probs cannot serve: a streamed (iterable) dataset, a reference synced to the policy."""
    args = dict(**dpo_kwargs(tmp_path), megatrain_config={"compute_dtype": "float32"})
    kw = dict(processing_class=tokenizer())
    with pytest.raises(ValueError, match="IterableDataset.*ref_model=<the initial model"):
        MegaTrainDPOTrainer(model=load(model_dir), args=MegaTrainDPOConfig(**args),
                            train_dataset=pairs().to_iterable_dataset(), **kw)
    with pytest.raises(ValueError, match="IterableDataset"):
        MegaTrainDPOTrainer(model=load(model_dir), args=MegaTrainDPOConfig(**args), train_dataset=pairs(),
                            eval_dataset={"a": pairs(4).to_iterable_dataset()}, **kw)
    with pytest.raises(ValueError, match="sync_ref_model"):
        MegaTrainDPOTrainer(model=load(model_dir), args=MegaTrainDPOConfig(**args, sync_ref_model=True),
                            train_dataset=pairs(), **kw)
