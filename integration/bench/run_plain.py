"""Benchmark plain HF training on the GPU once, no offload: the peer of hf_megatrain's ``auto`` regime.

What people run when the model fits: ``transformers.Trainer`` on the whole model in GPU memory, FP32 master weights
(the model is built in fp32 straight on the GPU), ``bf16=True`` (autocast), activation checkpointing
(``gradient_checkpointing_enable``, non-reentrant, as the DeepSpeed peer), fused ``torch.optim.AdamW(fused=True)``
(``optim="adamw_torch_fused"``), gradient clipping as the others, gradient accumulation to reach the batch
(``micro_batch`` x ``grad_accum``; bench_vs_deepspeed.py halves the micro-batch after an OOM). On a CPU-only machine
(smoke tests) the same code runs on the CPU with bf16 CPU autocast.
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

from bench.common import (StepClock, TokenDataset, build_model, count_params, runner_main,  # noqa: E402
                          throughput, token_rows)

LR, MAX_GRAD_NORM = 1e-5, 1.0


def run(spec: dict) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    warm, steps, batch = int(spec["warmup"]), int(spec["steps"]), int(spec["batch"])
    micro, ga = int(spec.get("micro_batch") or batch), int(spec.get("grad_accum") or 1)
    if micro * ga != batch:
        raise ValueError(f"micro_batch {micro} x grad_accum {ga} != batch {batch}")
    cuda = torch.cuda.is_available()

    t = time.perf_counter()
    model = build_model(spec, torch.float32, "cuda" if cuda else "cpu")  # FP32 master, on the GPU from the start
    n_params = count_params(model)
    build_s = time.perf_counter() - t

    clock = StepClock(spec.get("clock_sync") == "stream")

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.mark()

        def on_step_end(self, args, state, control, **kw):
            clock.mark()

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench_plain_"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=ga, max_steps=warm + steps, bf16=True, use_cpu=not cuda,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        optim="adamw_torch_fused", learning_rate=LR, weight_decay=0.0,
        max_grad_norm=spec.get("max_grad_norm", MAX_GRAD_NORM), lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=10 ** 6, save_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, dataloader_pin_memory=cuda, seed=int(spec.get("seed", 0)))
    t = time.perf_counter()
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(token_rows(spec, warm + steps)),
                      callbacks=[Timer()])
    trainer_init_s = time.perf_counter() - t
    t = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - t
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under Accelerate's wrapper
    fused = bool(opt.defaults.get("fused")) if opt is not None else None
    res = throughput(spec, n_params, clock.periods)
    res.update(n_params=n_params, model_build_s=build_s, setup_s=trainer_init_s, train_s=train_s,
               train_loss=result.training_loss, micro_batch=micro, grad_accum=ga,
               optimizer=f"{type(opt).__module__}.{type(opt).__name__}(fused={fused})",
               model_init=f"fp32 on {'the GPU' if cuda else 'the host'} (meta + N(0,0.02)): the FP32 master; "
                          "Trainer bf16=True autocasts the compute")
    return res


if __name__ == "__main__":
    runner_main("plain", run)
