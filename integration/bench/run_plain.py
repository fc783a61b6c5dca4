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
import time
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402

from bench.common import (StepClock, build_model, count_params, run_hf_trainer, runner_main,  # noqa: E402
                          throughput)

LR, MAX_GRAD_NORM = 1e-5, 1.0


def run(spec: dict) -> dict[str, Any]:
    batch = int(spec["batch"])
    micro, ga = int(spec.get("micro_batch") or batch), int(spec.get("grad_accum") or 1)
    if micro * ga != batch and spec.get("data") != "finetune":  # (fine-tune: batch = real tokens)
        raise ValueError(f"micro_batch {micro} x grad_accum {ga} != batch {batch}")
    cuda = torch.cuda.is_available()

    t = time.perf_counter()
    model = build_model(spec, torch.float32, "cuda" if cuda else "cpu")  # FP32 master, on the GPU from the start
    n_params = count_params(model)
    build_s = time.perf_counter() - t

    clock = StepClock(spec.get("clock_sync") == "stream")

    run_ = run_hf_trainer(model, spec, micro=micro, ga=ga, clock=clock, prefix="bench_plain_", lr=LR,
                          max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch_fused")
    trainer, result, trainer_init_s, train_s = (run_[k] for k in ("trainer", "result", "trainer_init_s", "train_s"))
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
