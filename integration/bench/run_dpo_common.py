"""What both DPO runners share (integration/bench_dpo.py): the preference pairs, the tokenizer, DPOConfig's
hyper-parameters, the step clock around ``DPOTrainer.train()`` and the record's metrics.

Fairness as in bench/common.py: the same model (bench/common.py ``build_model``: Qwen2 at 14B width, random init),
the same pairs, the same DPOConfig hyper-parameters, the same clock. Only the system differs:
``MegaTrainDPOTrainer`` (hf/dpo_support.py) or plain ``trl.DPOTrainer`` with ``DPOConfig(deepspeed=<dict>)``.

Data: random token ids written as words ``t<id>`` and read back by a word-level tokenizer over the model's whole
vocabulary (``tokenizer``; words drawn from ids 4..), so every system tokenizes the very same ids (checked after
tokenization: ``check_lengths``): a prompt of ``prompt_len`` tokens and chosen / rejected completions of
``completion_len`` tokens each, the last one EOS (TRL appends EOS only when missing). DPOTrainer's collator concatenates a pair's chosen and rejected rows, so a step of
``pairs`` pairs is ``2 * pairs`` rows of ``prompt_len + completion_len`` tokens.

The reference log-probabilities are precomputed (``precompute_ref_log_probs=True``) by DPOTrainer in its
``__init__``: one no-grad forward over the whole dataset, before training, by the policy itself (no second model on
the GPU). That pass is timed on its own (``ref_precompute_s``) and left out of the step time and of the MFU.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402

from bench.common import FULL_WIDTH, TINY_WIDTH, StepClock, throughput  # noqa: E402

LR, BETA = 1e-5, 0.1
PAD, EOS, UNK, FIRST_WORD = 0, 1, 3, 4


def vocab_size(spec: dict) -> int:
    return (TINY_WIDTH if spec.get("tiny") else FULL_WIDTH)["vocab_size"]


SPECIAL = {PAD: "<pad>", EOS: "<eos>", UNK: "<unk>"}


def tokenizer(spec: dict) -> Any:
    """A word-level tokenizer over the model's vocabulary (built in code: no Hub, no merges): id i is the word
    ``t<i>``, except the special tokens. Their names are no word's prefix: the fast tokenizer splits added tokens out
    of the text before the words, so an EOS spelled ``t1`` would cut ``t15`` into ``t1`` + ``5``."""
    import tokenizers
    import transformers

    vocab = {SPECIAL.get(i, f"t{i}"): i for i in range(vocab_size(spec))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=SPECIAL[UNK]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIAL[PAD],
                                                eos_token=SPECIAL[EOS], unk_token=SPECIAL[UNK])


def total_pairs(spec: dict) -> int:
    """Pairs in the dataset: one step's worth per warm-up and timed step (the precompute runs over all of them)."""
    return int(spec["pairs"]) * (int(spec["warmup"]) + int(spec["steps"]))


def pair_dataset(spec: dict) -> Any:
    """``total_pairs`` preference pairs of random token ids (fixed seed, CPU generator: the same for every system)."""
    import datasets

    p, c = int(spec["prompt_len"]), int(spec["completion_len"])
    n = total_pairs(spec)
    g = torch.Generator().manual_seed(2000 + int(spec.get("seed", 0)))
    ids = torch.randint(FIRST_WORD, vocab_size(spec), (n, p + 2 * (c - 1)), generator=g).tolist()

    def words(xs: list[int]) -> str:
        return " ".join(SPECIAL.get(i, f"t{i}") for i in xs)

    rows = [{"prompt": words(r[:p]) + " ",  # the space keeps the prompt's last word apart from the completion's first
             "chosen": words(r[p:p + c - 1] + [EOS]),
             "rejected": words(r[p + c - 1:] + [EOS])} for r in ids]
    return datasets.Dataset.from_list(rows)


def dpo_kwargs(spec: dict, micro: int, ga: int) -> dict[str, Any]:
    """DPOConfig's hyper-parameters, the same for every system (the system adds its own switches)."""
    cuda = torch.cuda.is_available()
    return dict(
        output_dir=tempfile.mkdtemp(prefix="bench_dpo_"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=ga, max_steps=int(spec["warmup"]) + int(spec["steps"]),
        precompute_ref_log_probs=True, precompute_ref_batch_size=micro, beta=BETA, loss_type=["sigmoid"],
        max_length=int(spec["prompt_len"]) + int(spec["completion_len"]), learning_rate=LR, weight_decay=0.0,
        max_grad_norm=float(spec.get("max_grad_norm", 1.0)), lr_scheduler_type="constant", warmup_steps=0,
        bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=cuda, seed=int(spec.get("seed", 0)),
        train_sampling_strategy="sequential")


def timed_trainer(base: type) -> type:
    """``base`` (a DPOTrainer class) whose reference precompute (DPOTrainer's ``_precompute_ref_logps``, called in
    ``__init__``) is timed: device synchronised before and after, seconds added to ``bench_ref_precompute_s``."""

    class Timed(base):  # type: ignore[misc, valid-type]
        bench_ref_precompute_s = 0.0
        bench_ref_precompute_calls = 0

        def _precompute_ref_logps(self, *args: Any, **kwargs: Any) -> Any:
            _sync()
            t = time.perf_counter()
            out = super()._precompute_ref_logps(*args, **kwargs)
            _sync()
            type(self).bench_ref_precompute_s += time.perf_counter() - t
            type(self).bench_ref_precompute_calls += 1
            return out

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


def check_lengths(dataset: Any, spec: dict) -> None:
    """Every tokenized pair has exactly the lengths asked for (else the token counts, and so every rate, would be
    wrong without a sign): DPOTrainer's tokenization of ``pair_dataset``'s text must give back its ids one for one."""
    p, c = int(spec["prompt_len"]), int(spec["completion_len"])
    rows = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    got = {(len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows}
    unknown = sum(UNK in r[k] for r in rows for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    if got != {(p, c, c)} or len(dataset) != total_pairs(spec) or unknown:
        raise RuntimeError(f"tokenized pairs have (prompt, chosen, rejected) lengths {sorted(got)[:5]} over "
                           f"{len(dataset)} rows, {unknown} sequences with unknown words; expected ({p}, {c}, {c}) "
                           f"over {total_pairs(spec)}, none unknown")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_timed(trainer_cls: type, model: torch.nn.Module, args: Any, spec: dict) -> dict[str, Any]:
    """Build the trainer (the precompute runs here), train with a step clock (marked at train begin and after every
    optimizer step) and return the trainer, train()'s result and the timings."""
    from transformers import TrainerCallback

    clock = StepClock(spec.get("clock_sync") == "stream")
    marks: dict[str, float] = {}

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            marks["train_begin"] = time.perf_counter()
            clock.mark()

        def on_step_end(self, a, state, control, **kw):
            clock.mark()

    cls = timed_trainer(trainer_cls)
    t = time.perf_counter()
    trainer = cls(model=model, args=args, train_dataset=pair_dataset(spec), processing_class=tokenizer(spec),
                  callbacks=[Timer()])
    init_s = time.perf_counter() - t
    check_lengths(trainer.train_dataset, spec)
    t = time.perf_counter()
    result = trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if hasattr(opt, "wait"):  # hf_megatrain's CPU AdamW overlaps the next forward: let the last update land
        opt.wait()
    return {"trainer": trainer, "result": result, "periods": clock.periods, "trainer_init_s": init_s,
            "ref_precompute_s": cls.bench_ref_precompute_s, "ref_precompute_calls": cls.bench_ref_precompute_calls,
            "train_s": time.perf_counter() - t, "setup_in_train_s": marks.get("train_begin", t) - t}


def dpo_metrics(spec: dict, n_params: int, run: dict[str, Any], micro: int, ga: int) -> dict[str, Any]:
    """The record's numbers: bench/common.py ``throughput`` over the step's ``2 * pairs`` rows (policy training:
    6·N per token), pairs/s, the reference precompute's rate (forward only: 2·N per token, not in the step time
    nor the MFU) and TRL's logged DPO metrics of the last step."""
    pairs, seq = int(spec["pairs"]), int(spec["prompt_len"]) + int(spec["completion_len"])
    res = throughput({**spec, "batch": 2 * pairs, "seq": seq}, n_params, run["periods"])
    res["pairs_per_s"] = pairs / res["step_time_s"]
    ref_tokens = 2 * total_pairs(spec) * seq
    ref_s = run["ref_precompute_s"]
    res.update(ref_precompute_s=ref_s, ref_precompute_calls=run["ref_precompute_calls"],
               ref_precompute_tokens=ref_tokens, ref_precompute_tokens_per_s=ref_tokens / ref_s if ref_s else None,
               ref_precompute_tflops=2.0 * n_params * ref_tokens / ref_s / 1e12 if ref_s else None,
               ref_precompute_note="one no-grad forward over the whole dataset in DPOTrainer.__init__ (2*N*tokens), "
                                   "before training: excluded from step_time_s, tokens_per_s, model_tflops and mfu")
    logs = [h for h in run["trainer"].state.log_history if "loss" in h]
    keep = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected")
    res.update(n_params=n_params, pairs=pairs, rows_per_step=2 * pairs, seq=seq,
               prompt_len=int(spec["prompt_len"]), completion_len=int(spec["completion_len"]),
               micro_pairs=micro, grad_accum=ga, trainer_init_s=run["trainer_init_s"],
               setup_in_train_s=run["setup_in_train_s"], train_s=run["train_s"],
               train_loss=run["result"].training_loss, losses=[h["loss"] for h in logs],
               last_log={k: logs[-1].get(k) for k in keep} if logs else {})
    return res
