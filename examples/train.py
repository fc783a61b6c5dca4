#!/usr/bin/env python
"""Causal-LM fine-tuning with hf_megatrain, in the style of transformers' examples/pytorch/language-modeling/run_clm.py.

The only differences from a plain ``Trainer`` script are the two hf_megatrain classes:

    from hf_megatrain import MegaTrainTrainer as Trainer, MegaTrainTrainingArguments as TrainingArguments

(plus ``from_pretrained_streamed``, which loads a large checkpoint straight into the FP32 host store instead of
materialising it in RAM first; a model from ``AutoModelForCausalLM.from_pretrained`` works too).

With no arguments it runs the embedded default job (tiny Llama from a config, the shipped tokenizer and
corpus; no network): about half a minute on a 2-core CPU (26 s measured, README), uses the GPU when there is
one, prints the first and last training loss, eval perplexity / token accuracy, and where the checkpoint is.

Resuming, as in run_clm.py: ``--resume_from_checkpoint PATH`` continues from that checkpoint, ``true`` (as
``Trainer.train(resume_from_checkpoint=True)``) from the last ``checkpoint-N`` in ``--output_dir`` (an error when
there is none), ``auto`` from the last one if there is one, ``false`` starts afresh. Left out, a ``--output_dir``
holding ``checkpoint-N`` folders resumes from the last one (logged), unless ``--overwrite_output_dir`` is given.

    python examples/train.py                                            # embedded default job
    python examples/train.py --model_name_or_path Qwen/Qwen2.5-7B --train_file data.jsonl \
        --block_size 2048 --per_device_train_batch_size 4 --gradient_accumulation_steps 8 \
        --learning_rate 1e-5 --num_train_epochs 1 --output_dir outputs/qwen7b
    python examples/train.py --save_strategy steps --save_steps 20 --resume_from_checkpoint true   # go on
    accelerate launch --config_file examples/megatrain.yaml examples/train.py [args]
    megatrain launch --config examples/megatrain_combined.yaml examples/train.py [args]
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import torch
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator,
                          set_seed)
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from hf_megatrain.config import describe_sources
from hf_megatrain.hf import default_job
from hf_megatrain.hf.trainer import MegaTrainTrainer, MegaTrainTrainingArguments, from_pretrained_streamed

logger = logging.getLogger(__name__)

# Hyper-parameters of the embedded default job, used only where the command line does not set them and no
# --model_name_or_path is given (a real model keeps TrainingArguments' own defaults, as in run_clm).
DEFAULT_JOB_ARGS = {
    "learning_rate": "3e-3", "adam_beta2": "0.95", "num_train_epochs": "3", "per_device_train_batch_size": "8",
    "per_device_eval_batch_size": "8", "warmup_steps": "10", "lr_scheduler_type": "cosine", "logging_steps": "10",
    "logging_first_step": "true", "eval_strategy": "epoch", "save_strategy": "no", "report_to": "none",
    "block_size": "128",
}
DEFAULT_OUTPUT_DIR = "outputs/default"


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local directory or Hub id of a causal LM to fine-tune. Default: the embedded "
                                        "tiny Llama, randomly initialised from its config (no download)."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer to use if not the one of --model_name_or_path."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel: 'sdpa', 'eager', 'flash_attention_2'... (HF default)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code from the Hub."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(
        default=None, metadata={"help": "Local .txt (one sample per line) or .json/.jsonl file. Default: the shipped "
                                        "corpus."})
    validation_file: str | None = field(default=None, metadata={"help": "Local .txt/.json/.jsonl eval file."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of the train file held out when there is no validation file."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text in json files."})
    block_size: int | None = field(
        default=None, metadata={"help": "Training sequence length after packing. Default: min(model max length, "
                                        "1024)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the packed train set."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the packed eval set."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks in .txt files."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


@dataclass
class RunArguments:
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Train from scratch even when --output_dir holds checkpoint-N folders "
                                         "(otherwise the last one is resumed, as run_clm.py does). Checkpoints of "
                                         "the new run replace those of the same step."})


def with_default_job_args(argv: list[str]) -> list[str]:
    """Prepend the default job's flags the user did not give (and the default output dir)."""
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    extra = {} if "model_name_or_path" in given else dict(DEFAULT_JOB_ARGS)
    extra["output_dir"] = DEFAULT_OUTPUT_DIR
    out = []
    for k, v in extra.items():
        if k not in given:
            out += [f"--{k}", v]
    return out + argv


def resume_checkpoint(args: MegaTrainTrainingArguments, overwrite_output_dir: bool) -> str | bool | None:
    """What ``trainer.train(resume_from_checkpoint=...)`` gets, as run_clm.py decides it.

    ``--resume_from_checkpoint`` is parsed as a string: a path is passed on; "true" (1/yes) becomes ``True``, which
    ``Trainer.train`` turns into the last checkpoint of ``output_dir`` (an error when there is none); "false" (0/no)
    starts afresh; "auto" resumes from the last checkpoint when there is one. Left out, an ``output_dir`` holding
    checkpoints resumes from the last one unless ``--overwrite_output_dir`` (run_clm.py's "Detecting last
    checkpoint"). Resuming never rewrites the checkpoint it starts from: training goes on from its step."""
    given = args.resume_from_checkpoint
    word = given.strip().lower() if isinstance(given, str) else given
    if word in ("true", "1", "yes", True):
        return True
    if word in ("false", "0", "no", "", False):
        return None
    if given is not None and word != "auto":
        return given
    if overwrite_output_dir and word is None:
        return None
    folder = args.output_dir
    found = os.path.isdir(folder) and any(e.startswith(PREFIX_CHECKPOINT_DIR + "-") and
                                          os.path.isdir(os.path.join(folder, e)) for e in os.listdir(folder))
    if not found:
        return None
    # True, not the path: the trainer lists the checkpoints once it has finished saves a kill interrupted (a
    # re-save killed mid-way leaves checkpoint-N under another name until then).
    if word is None:
        logger.info("Checkpoint detected (%s), resuming training from the last one. To avoid this, change "
                    "--output_dir or add --overwrite_output_dir to train from scratch.",
                    get_last_checkpoint(folder) or "an interrupted save")
    return True


class StartStep(TrainerCallback):
    """Records the global step training starts from (a resumed checkpoint's), for the closing lines."""

    step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def load_raw_datasets(data: DataTrainingArguments) -> datasets.DatasetDict:
    files = default_job.data_files() if data.train_file is None else {"train": data.train_file}
    if data.train_file is not None and data.validation_file is not None:
        files["validation"] = data.validation_file
    ext = files["train"].rsplit(".", 1)[-1]
    builder = {"txt": "text", "jsonl": "json"}.get(ext, ext)
    kwargs = {"keep_linebreaks": data.keep_linebreaks} if builder == "text" else {}
    raw = datasets.load_dataset(builder, data_files=files, **kwargs)
    if "validation" not in raw:  # hold out a slice of train, as run_clm does
        pct = data.validation_split_percentage
        raw["validation"] = datasets.load_dataset(builder, data_files=files, split=f"train[:{pct}%]", **kwargs)
        raw["train"] = datasets.load_dataset(builder, data_files=files, split=f"train[{pct}%:]", **kwargs)
    return raw


def load_model_and_tokenizer(margs: ModelArguments, args: MegaTrainTrainingArguments):
    """-> (model or MegaTrainEngine, tokenizer). Both go to MegaTrainTrainer exactly like a plain model would."""
    if margs.model_name_or_path is None:
        tokenizer = default_job.load_tokenizer()
        return default_job.build_model(tokenizer, seed=args.seed), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(margs.tokenizer_name or margs.model_name_or_path,
                                              trust_remote_code=margs.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"trust_remote_code": margs.trust_remote_code}
    if margs.attn_implementation:
        kwargs["attn_implementation"] = margs.attn_implementation
    hf_config = AutoConfig.from_pretrained(margs.model_name_or_path, trust_remote_code=margs.trust_remote_code)
    if args.megatrain and len(tokenizer) <= hf_config.vocab_size:
        # Straight from the safetensors shards into the FP32 host store: the model never exists twice in RAM,
        # which is what lets a model far larger than the GPU (and close to host RAM / 18 bytes) load at all.
        # Compute dtype as in plain Trainer: explicit compute_dtype, else --bf16, else the checkpoint's dtype
        # (what from_pretrained loads by default: a float32 checkpoint trains in float32, a bf16 one in bf16).
        stored = hf_config.dtype if isinstance(hf_config.dtype, torch.dtype) else torch.float32
        return from_pretrained_streamed(margs.model_name_or_path, device=args.device, **kwargs,
                                        config=args.megatrain_resolved_config(model_dtype=stored)), tokenizer
    # Plain load in the checkpoint's dtype, as from_pretrained does by default (the trainer decides the compute
    # dtype from it and the flags; hf_megatrain keeps FP32 masters whatever dtype the checkpoint is stored in).
    model = AutoModelForCausalLM.from_pretrained(margs.model_name_or_path, **kwargs)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    return model, tokenizer


def pack(raw: datasets.DatasetDict, tokenizer, data: DataTrainingArguments, block_size: int,
         main_process_first) -> datasets.DatasetDict:
    column = data.text_column if data.text_column in raw["train"].column_names else raw["train"].column_names[0]
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch[column])["input_ids"]
        # One document per sample: end each with EOS so packed blocks show where one ends.
        return {"input_ids": [x + [eos] if eos is not None else x for x in ids]}

    def group(batch):
        flat = list(chain(*batch["input_ids"]))
        total = (len(flat) // block_size) * block_size
        blocks = [flat[i:i + block_size] for i in range(0, total, block_size)]
        return {"input_ids": blocks, "labels": [b[:] for b in blocks]}

    quiet = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # "sequence longer than max length": packing handles it
    with main_process_first(desc="tokenize and pack"):
        tokenized = raw.map(tokenize, batched=True, num_proc=data.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names, desc="tokenize")
        packed = tokenized.map(group, batched=True, num_proc=data.preprocessing_num_workers,
                               desc=f"pack into blocks of {block_size}")
    transformers.utils.logging.set_verbosity(quiet)
    return packed


def accuracy_metric():
    """Token accuracy via `evaluate`: the shipped offline copy of the Hub's "accuracy" (no network needed)."""
    import evaluate

    return evaluate.load(str(default_job.ACCURACY_METRIC))


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):  # extra outputs (past key values...)
        logits = logits[0]
    return logits.argmax(dim=-1)  # keep [B, T] token ids, not [B, T, vocab] logits


def main(argv: list[str] | None = None) -> dict:
    argv = with_default_job_args(list(sys.argv[1:] if argv is None else argv))
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, RunArguments, MegaTrainTrainingArguments))
    margs, data, run, args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO
                        if args.should_log else logging.WARNING, handlers=[logging.StreamHandler(sys.stdout)])
    datasets.utils.logging.set_verbosity_warning()
    datasets.utils.logging.disable_progress_bar()
    set_seed(args.seed)

    model, tokenizer = load_model_and_tokenizer(margs, args)
    block_size = data.block_size or min(getattr(tokenizer, "model_max_length", 1024), 1024)
    packed = pack(load_raw_datasets(data), tokenizer, data, block_size, args.main_process_first)
    train_ds, eval_ds = packed["train"], packed["validation"]
    if data.max_train_samples is not None:
        train_ds = train_ds.select(range(min(len(train_ds), data.max_train_samples)))
    if data.max_eval_samples is not None:
        eval_ds = eval_ds.select(range(min(len(eval_ds), data.max_eval_samples)))

    metric = accuracy_metric()

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        # preds are argmax ids at every position; position t predicts token t+1.
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        keep = labels != -100
        return metric.compute(predictions=preds[keep], references=labels[keep])

    trainer = MegaTrainTrainer(
        model=model, args=args, train_dataset=train_ds,
        eval_dataset=eval_ds, processing_class=tokenizer, data_collator=default_data_collator,
        compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    engine = getattr(trainer, "engine", None)
    n_params = engine.num_parameters() if engine is not None else sum(p.numel() for p in trainer.model.parameters())
    source = describe_sources(args.megatrain_base_config()) if engine is not None else "megatrain=False"
    print(f"[train.py] effective MegaTrainConfig: {engine.config if engine is not None else 'megatrain=False'} "
          f"(from: {source})", flush=True)
    print(f"[train.py] model: {margs.model_name_or_path or 'embedded tiny Llama'} ({n_params / 1e6:.2f}M params); "
          f"device: {args.device}; train blocks: {len(train_ds)} x {block_size} tokens; eval blocks: {len(eval_ds)}",
          flush=True)

    resume = resume_checkpoint(args, run.overwrite_output_dir)
    start = StartStep()
    trainer.add_callback(start)
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()  # standard HF checkpoint (safetensors + config + tokenizer) in args.output_dir
    metrics = dict(result.metrics)
    eval_metrics = trainer.evaluate()
    try:
        eval_metrics["eval_perplexity"] = math.exp(eval_metrics["eval_loss"])
    except OverflowError:
        eval_metrics["eval_perplexity"] = float("inf")
    trainer.log_metrics("train", metrics)
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("all", {**metrics, **eval_metrics})
    trainer.save_state()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ckpt = os.path.abspath(args.output_dir)
    if trainer.is_world_process_zero():
        if len(losses) == 1:
            print(f"[train.py] training loss: {losses[0]:.4f} (only one logged step; lower --logging_steps)")
        elif losses:
            print(f"[train.py] training loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} "
                  f"({'down' if losses[-1] < losses[0] else 'NOT down'})")
        acc = eval_metrics.get("eval_accuracy", float("nan"))
        print(f"[train.py] eval: loss {eval_metrics['eval_loss']:.4f}, perplexity "
              f"{eval_metrics['eval_perplexity']:.2f}, token accuracy {acc:.4f}")
        if start.step:
            print(f"[train.py] resumed at global step {start.step}, trained to {trainer.state.global_step}")
        print(f"[train.py] checkpoint: {ckpt}  (AutoModelForCausalLM.from_pretrained({ckpt!r}))", flush=True)
    return {"losses": losses, "eval": eval_metrics, "checkpoint": ckpt, "start_step": start.step,
            "global_step": trainer.state.global_step}


if __name__ == "__main__":
    main()
