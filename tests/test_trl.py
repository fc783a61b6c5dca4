"""TRL SFTTrainer integration (hf_megatrain.hf.trl_support) against plain ``trl.SFTTrainer`` on CPU in fp32: the
losses, grad norms and SFT's own metrics (entropy, mean_token_accuracy, num_tokens) per logging step, train and
eval, and the refusals. Skipped where trl (the ``[trl]`` extra) is not installed."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import transformers  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_megatrain.hf.compose import megatrain_args_class, megatrain_trainer_class  # noqa: E402
from hf_megatrain.hf.trl_support import MegaTrainSFTConfig, MegaTrainSFTTrainer  # noqa: E402

from .models import tiny, word_tokenizer  # noqa: E402

VOCAB = 96


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    return word_tokenizer(VOCAB)


def sft_dataset(n: int = 12, seed: int = 0) -> "datasets.Dataset":
    """Pre-tokenized rows of different lengths with prompt-like ignored labels (SFT's completion-only shape), drawn
    from 8 token ids so that a few steps make the model right on some tokens (mean_token_accuracy above 0)."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = [], []
    for i in range(n):
        length = 8 + (i * 5) % 7
        row = torch.randint(4, 12, (length,), generator=g).tolist()
        lab = list(row)
        lab[: 2 + i % 3] = [-100] * (2 + i % 3)
        ids.append(row)
        labels.append(lab)
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})


def sft_kwargs(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=3,
              gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0,
              lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, report_to=[], use_cpu=True,
              save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
              gradient_checkpointing=False, eval_strategy="steps", eval_steps=4)
    kw.update(over)
    return kw


KEYS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy",
        "eval_mean_token_accuracy", "eval_num_tokens")


def logs(trainer) -> list[dict]:
    return [{k: h[k] for k in KEYS if k in h} | {"step": h["step"]} for h in trainer.state.log_history
            if any(k in h for k in KEYS)]


def test_sft_matches_plain_sfttrainer(tmp_path):
    model = tiny("llama")
    data, evald = sft_dataset(), sft_dataset(6, seed=1)
    ref = SFTTrainer(model=copy.deepcopy(model), args=SFTConfig(**sft_kwargs(tmp_path / "ref")),
                     train_dataset=data, eval_dataset=evald, processing_class=tokenizer())
    ref.train()
    ours = MegaTrainSFTTrainer(model=copy.deepcopy(model), args=MegaTrainSFTConfig(
        **sft_kwargs(tmp_path / "mt"), megatrain_config={"compute_dtype": "float32"}),
        train_dataset=data, eval_dataset=evald, processing_class=tokenizer())
    assert ours.engine is not None
    ours.train()
    ref_logs, our_logs = logs(ref), logs(ours)
    assert [sorted(r) for r in ref_logs] == [sorted(o) for o in our_logs]
    assert sum("entropy" in r for r in our_logs) == 4 and sum("eval_entropy" in r for r in our_logs) == 1
    for r, o in zip(ref_logs, our_logs):
        for k in r:
            assert o[k] == pytest.approx(r[k], rel=2e-5, abs=1e-6), (r["step"], k, o[k], r[k])
    assert 0.0 < our_logs[0]["entropy"] < 5.0 and our_logs[0]["num_tokens"] > 0
    assert max(r.get("mean_token_accuracy", 0.0) for r in our_logs) > 0.05  # the metric is exercised, not all 0


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_sft_metrics_with_fused_loss_path(tmp_path, monkeypatch):
    """The fused implementations never form logits: the metrics then come from a separate chunked pass. Run that
    path on CPU with the chunked kernel standing in for the fused one: same metrics as the in-loss path."""
    from hf_megatrain.model import loss_impl

    class FakeFused:
        PACKAGE = "fake"

        @staticmethod
        def unavailable(device):
            return None

        @staticmethod
        def unsupported(*, bias, softcap, dtype=None):
            return None

        @staticmethod
        def loss_sum(hidden, weight, bias, targets, softcap):
            return loss_impl.linear_cross_entropy(hidden, weight, targets, bias=bias, num_items_in_batch=1,
                                                  softcap=softcap, shift=False)

    monkeypatch.setitem(loss_impl.FUSED, loss_impl.LossImpl.LIGER, FakeFused)
    model = tiny("llama")
    runs = {}
    for impl in ("chunked", "liger"):
        t = MegaTrainSFTTrainer(model=copy.deepcopy(model), args=MegaTrainSFTConfig(
            **sft_kwargs(tmp_path / impl), megatrain_config={"compute_dtype": "float32", "loss_impl": impl}),
            train_dataset=sft_dataset(), eval_dataset=sft_dataset(6, seed=1), processing_class=tokenizer())
        assert t.engine.head_extras.loss_impl.value == impl
        t.train()
        runs[impl] = logs(t)
    for a, b in zip(runs["chunked"], runs["liger"]):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k)


def test_sft_refusals(tmp_path):
    model = tiny("llama")
    with pytest.raises(TypeError, match="MegaTrainSFTConfig"):
        MegaTrainSFTTrainer(model=model, args=SFTConfig(**sft_kwargs(tmp_path)), train_dataset=sft_dataset(),
                            processing_class=tokenizer())
    with pytest.raises(ValueError, match="loss_type='dft'"):
        MegaTrainSFTTrainer(model=model, args=MegaTrainSFTConfig(**sft_kwargs(tmp_path), loss_type="dft"),
                            train_dataset=sft_dataset(), processing_class=tokenizer())


def test_compose_is_generic():
    cls = megatrain_trainer_class(SFTTrainer)
    assert cls is megatrain_trainer_class(SFTTrainer)  # cached: one class per base
    names = [c.__name__ for c in cls.__mro__]
    assert names.index("MegaTrainTrainer") < names.index("SFTTrainer") < names.index("_ConvertAtTrainerInit") \
        < names.index("Trainer")
    args_cls = megatrain_args_class(SFTConfig, name="Args", module=__name__)
    assert issubclass(args_cls, SFTConfig) and args_cls(output_dir="x", use_cpu=True).megatrain
    with pytest.raises(TypeError):
        megatrain_trainer_class(int)


@pytest.mark.slow
def test_sft_peft_config_and_megatrain_false(tmp_path):
    """SFTTrainer wraps the model with PEFT from ``peft_config`` before the conversion (compose.py: the model is
    converted at Trainer.__init__); megatrain=False is plain SFTTrainer."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = tiny("llama")
    data, evald = sft_dataset(), sft_dataset(6, seed=1)

    def run(cls, args, **kw):
        t = cls(model=copy.deepcopy(model), args=args, train_dataset=data, eval_dataset=evald,
                processing_class=tokenizer(), **kw)
        t.train()
        return t

    ref = run(SFTTrainer, SFTConfig(**sft_kwargs(tmp_path / "ref")), peft_config=lora)
    ours = run(MegaTrainSFTTrainer, MegaTrainSFTConfig(**sft_kwargs(tmp_path / "mt"),
                                                       megatrain_config={"compute_dtype": "float32"}),
               peft_config=lora)
    assert ours.engine is not None and isinstance(ours.engine.model, peft.PeftModel)
    for r, o in zip(logs(ref), logs(ours), strict=True):
        for k in r:
            assert o[k] == pytest.approx(r[k], rel=2e-5, abs=1e-6), (r["step"], k)
    plain = run(MegaTrainSFTTrainer, MegaTrainSFTConfig(**sft_kwargs(tmp_path / "off"), megatrain=False))
    ref2 = run(SFTTrainer, SFTConfig(**sft_kwargs(tmp_path / "ref2")))
    assert plain.engine is None
    assert logs(plain) == logs(ref2)
