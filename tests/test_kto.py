"""TRL KTOTrainer through the engine (hf_megatrain.hf.kto_support) against plain ``trl.KTOTrainer``, CPU, fp32.

Three optimizer steps with gradient accumulation 2 and clipping: per logging step the loss, grad norm and KTO's
metrics (rewards/*, logps/*, logits/*, kl, entropy, ...), the evaluation and every trained weight afterwards,
within 1e-5 relative. Full fine-tuning as TRL users write it (no ``ref_model``: plain KTOTrainer loads a copy of
the checkpoint, ours precomputes the reference with the initial weights), the reference precomputed on request, a
live ``ref_model`` (streamed frozen) and LoRA (the base with the adapters disabled). Skipped where trl is not
installed.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

import transformers  # noqa: E402
from trl import KTOConfig, KTOTrainer  # noqa: E402

from hf_megatrain.hf.compose import megatrain_args_class, megatrain_trainer_class  # noqa: E402
from hf_megatrain.hf.trainer import RUN_SUMMARY  # noqa: E402
from hf_megatrain.hf.kto_support import KTOPort, MegaTrainKTOConfig, MegaTrainKTOTrainer  # noqa: E402

from .models import tiny  # noqa: E402
from .test_dpo import REL, dpo_kwargs, lora_config, tokenizer  # noqa: E402
from .trl_parity import check_trainers_match, logs  # noqa: E402


def unpaired(n: int = 12, seed: int = 0) -> "datasets.Dataset":
    """In-memory unpaired preference rows: prompt, a completion and whether it is desirable."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(4, 40, (k,), generator=g).tolist())

    rows = [{"prompt": words(3 + i % 4) + " ", "completion": words(2 + i % 3), "label": i % 3 != 0}
            for i in range(n)]
    return datasets.Dataset.from_list(rows)


@pytest.fixture
def model_dir(tmp_path_factory):
    """The tiny model as a checkpoint folder: what plain KTOTrainer reloads as its reference copy."""
    path = tmp_path_factory.mktemp("init")
    tiny("llama").save_pretrained(path)
    return str(path)


def load(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def run_pair(tmp_path, model, *, composed=True, peft_config=None, live_ref=False, **over):
    """Plain KTOTrainer and ours (the composed class, or ``MegaTrainKTOTrainer``) on copies of ``model`` (a module or
    a checkpoint folder), evaluated once."""
    over = dict(eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=3, **over)
    fresh = (lambda: load(model)) if isinstance(model, str) else (lambda: copy.deepcopy(model))  # noqa: E731
    extra_ref = (lambda: dict(ref_model=fresh())) if live_ref else dict  # noqa: E731
    kw = dict(train_dataset=unpaired(), eval_dataset=unpaired(6, seed=1), processing_class=tokenizer())
    torch.manual_seed(7)
    plain = KTOTrainer(model=fresh(), args=KTOConfig(**dpo_kwargs(tmp_path / "ref", **over)),
                       peft_config=copy.deepcopy(peft_config), **kw, **extra_ref())
    plain.train()
    trainer_cls, args_cls = ((megatrain_trainer_class(KTOTrainer), megatrain_args_class(KTOConfig)) if composed
                             else (MegaTrainKTOTrainer, MegaTrainKTOConfig))
    torch.manual_seed(7)
    ours = trainer_cls(model=fresh(), args=args_cls(**dpo_kwargs(tmp_path / "mt", **over),
                                                    megatrain_config={"compute_dtype": "float32"}),
                       peft_config=copy.deepcopy(peft_config), **kw, **extra_ref())
    assert isinstance(ours, KTOPort) and ours.engine is not None
    ours.train()
    return plain, ours


def check_parity(plain, ours) -> None:
    _, our_logs = check_trainers_match(plain, ours, ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                                     "logps/chosen", "kl", "grad_norm"), REL)
    assert our_logs[-1]["loss"] != pytest.approx(our_logs[0]["loss"], rel=1e-3)  # it trained
    assert len(logs(ours, "eval_loss")) == 1


@pytest.mark.slow  # (>5 s; the fast tier covers the same mechanism with DPO: tests/test_dpo_implicit_ref.py)
def test_kto_implicit_reference_matches_plain(tmp_path, model_dir):
    """KTO as TRL users write it: plain KTOTrainer loads a copy of the checkpoint as its reference; ours precomputes
    the completions' and KL completions' reference log-probs with the initial weights; the run summary says so."""
    plain, ours = run_pair(tmp_path, model_dir)
    assert plain.ref_model is not None and ours.ref_model is None
    assert ours.args.precompute_ref_log_probs is False
    assert {"ref_logps", "ref_KL_logps"} <= set(ours.train_dataset.column_names)
    check_parity(plain, ours)
    summary = json.loads((tmp_path / "mt" / RUN_SUMMARY).read_text())
    assert summary["reference"] == "log-probs precomputed with the initial weights (ref_model not given)"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["precomputed", "live-ref", "lora", "moe"])
def test_kto_other_references_match_plain(tmp_path, case):
    """The other references; and Mixtral with the router aux loss (the engine's router tap), precomputed."""
    model = tiny("mixtral" if case == "moe" else "llama")
    if case in ("precomputed", "moe"):
        plain, ours = run_pair(tmp_path, model, composed=False, precompute_ref_log_probs=True)
        assert case != "moe" or (ours.aux_loss_enabled and logs(ours)[0]["aux_loss"] > 0)
    elif case == "live-ref":
        plain, ours = run_pair(tmp_path, model, live_ref=True)
        assert ours.ref_model.megatrain_engine is not ours.engine
    else:
        plain, ours = run_pair(tmp_path, model, peft_config=lora_config())
        assert ours.ref_model is None and not ours.precompute_ref_logps
    check_parity(plain, ours)
