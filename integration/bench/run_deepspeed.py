"""Benchmark DeepSpeed ZeRO-3 with parameter and optimizer offload once, through ``transformers.Trainer``.

The configuration users run: ``TrainingArguments(deepspeed=<dict>, bf16=True, gradient_checkpointing=True)``,
ZeRO stage 3 with ``offload_param`` and ``offload_optimizer`` to pinned CPU memory, the DeepSpeed "AdamW"
optimizer (DeepSpeedCPUAdam once the optimizer is offloaded; JIT-built with ninja on first use), gradient
clipping 1.0, constant LR. The buckets are tuned for a ~3.8B model on an 80 GB GPU (``DEFAULT_ZERO``); every knob
can be overridden from the command line (``--ds-*`` / ``--ds-json``) and the exact config is recorded.

The model is built in bf16 on the host (meta + cheap init); DeepSpeedEngine casts/moves it and the ZeRO-3
optimizer makes the FP32 master from those values (the usual ``from_pretrained(torch_dtype=bf16)`` path).
One process, world size 1: RANK/WORLD_SIZE/MASTER_* are set here so DeepSpeed does not go looking for MPI.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402

from bench.common import (StepClock, build_model, count_params, run_hf_trainer, runner_main,  # noqa: E402
                          single_process_dist_env, throughput)

LR, MAX_GRAD_NORM = 1e-5, 1.0

# ZeRO-3 knobs for a ~3.8B model on one 80 GB GPU. One 14B-width decoder layer is ~275M params (550 MB in bf16):
# prefetch ~2 layers ahead, keep biases/norms resident, let up to ~2B params be live (4 GB bf16; the GPU has
# room), reduce/offload gradients in 500M-element buckets, step the CPU optimizer in 1B-param sub-groups.
DEFAULT_ZERO: dict[str, Any] = {
    "stage": 3,
    "offload_param": {"device": "cpu", "pin_memory": True},
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 500_000_000,
    "stage3_param_persistence_threshold": 1_000_000,
    "stage3_max_live_parameters": 2_000_000_000,
    "stage3_max_reuse_distance": 2_000_000_000,
    "sub_group_size": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": False,
}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ds_config(overrides: dict | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict ("auto" fields are filled by Trainer from TrainingArguments)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": copy.deepcopy(DEFAULT_ZERO),
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    return _merge(cfg, overrides or {})


def import_deepspeed() -> Any:
    """deepspeed, imported for a one-process run: the environment torch.distributed wants, its CPU accelerator
    where there is no GPU."""
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError(f"deepspeed is not importable ({e}); run integration/install_peers.sh first") from e
    single_process_dist_env()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return deepspeed


def run(spec: dict) -> dict[str, Any]:
    deepspeed = import_deepspeed()
    batch = int(spec["batch"])
    micro, ga = int(spec.get("micro_batch") or batch), int(spec.get("grad_accum") or 1)
    if micro * ga != batch and spec.get("data") != "finetune":  # (fine-tune: batch = real tokens)
        raise ValueError(f"micro_batch {micro} x grad_accum {ga} != batch {batch}")
    dtype = torch.float32 if spec.get("ds_model_dtype") == "float32" else torch.bfloat16

    t = time.perf_counter()
    model = build_model(spec, dtype)
    n_params = count_params(model)
    build_s = time.perf_counter() - t

    config = ds_config(spec.get("ds"))
    clock = StepClock(spec.get("clock_sync") == "stream")
    run_ = run_hf_trainer(model, spec, micro=micro, ga=ga, clock=clock, prefix="bench_ds_", lr=LR,
                          max_grad_norm=MAX_GRAD_NORM, deepspeed=copy.deepcopy(config))
    trainer, result, trainer_init_s, train_s = (run_[k] for k in ("trainer", "result", "trainer_init_s", "train_s"))
    chain, opt = [], trainer.optimizer
    while opt is not None and len(chain) < 6:  # Accelerate wrapper -> DS wrapper -> ZeRO-3 -> DeepSpeedCPUAdam
        chain.append(f"{type(opt).__module__}.{type(opt).__name__}")
        opt = getattr(opt, "optimizer", None)
    res = throughput(spec, n_params, clock.periods)
    res.update(n_params=n_params, model_build_s=build_s, trainer_init_s=trainer_init_s,
               # DeepSpeed's engine/optimizer init (and the CPU Adam JIT build) happens inside train() before
               # the first step: setup = train() time up to on_train_begin.
               setup_s=run_["setup_in_train_s"], train_s=train_s, train_loss=result.training_loss,
               micro_batch=micro, grad_accum=ga, deepspeed_version=deepspeed.__version__,
               ds_config=config, ds_config_resolved=_resolved(trainer),
               optimizer=chain[-1] if chain else None, optimizer_chain=chain,
               model_init=f"{str(dtype).replace('torch.', '')} on host (meta + N(0,0.02)); DeepSpeedEngine casts "
                          "to bf16, the ZeRO-3 optimizer keeps the FP32 master")
    return res


def _resolved(trainer: Any) -> Any:
    try:
        return trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    except Exception:  # noqa: BLE001 - informational only
        return None


if __name__ == "__main__":
    runner_main("deepspeed", run)
