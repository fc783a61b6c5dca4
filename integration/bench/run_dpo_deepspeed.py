"""Benchmark DPO steps with plain ``trl.DPOTrainer`` on DeepSpeed ZeRO-3 offload once, spawned by
integration/bench_dpo.py.

What a TRL user runs: ``DPOConfig(deepspeed=<dict>, bf16=True, gradient_checkpointing=True)`` with the ZeRO-3
config of the main benchmark (bench/run_deepspeed.py ``ds_config``: parameters and optimizer offloaded to pinned
CPU memory, DeepSpeedCPUAdam), the shared DPOConfig hyper-parameters (bench/run_dpo_common.py). With
``precompute_ref_log_probs=True`` and no ``ref_model`` DPOTrainer keeps no reference model: its precompute wraps the
policy in a DeepSpeed inference engine (TRL's ``prepare_deepspeed``) for one no-grad pass before training.
One process, world size 1 (RANK/WORLD_SIZE/MASTER_* set here, as for the main benchmark).
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

from bench.common import build_model, count_params, runner_main  # noqa: E402
from bench.run_deepspeed import _resolved, ds_config, import_deepspeed  # noqa: E402
from bench.run_dpo_common import dpo_kwargs, dpo_metrics, train_timed  # noqa: E402


def run(spec: dict) -> dict[str, Any]:
    deepspeed = import_deepspeed()
    from trl import DPOConfig, DPOTrainer

    micro, ga = int(spec.get("micro_pairs") or spec["pairs"]), int(spec.get("grad_accum") or 1)
    if micro * ga != int(spec["pairs"]):
        raise ValueError(f"micro_pairs {micro} x grad_accum {ga} != pairs {spec['pairs']}")
    dtype = torch.float32 if spec.get("ds_model_dtype") == "float32" else torch.bfloat16
    t = time.perf_counter()
    model = build_model(spec, dtype)
    n_params = count_params(model)
    build_s = time.perf_counter() - t
    config = ds_config(spec.get("ds"))
    args = DPOConfig(**dpo_kwargs(spec, micro, ga), gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"use_reentrant": False}, deepspeed=copy.deepcopy(config))
    run_ = train_timed(DPOTrainer, model, args, spec)
    trainer = run_["trainer"]
    chain, opt = [], trainer.optimizer
    while opt is not None and len(chain) < 6:  # Accelerate wrapper -> DS wrapper -> ZeRO-3 -> DeepSpeedCPUAdam
        chain.append(f"{type(opt).__module__}.{type(opt).__name__}")
        opt = getattr(opt, "optimizer", None)
    res = dpo_metrics(spec, n_params, run_, micro, ga)
    res.update(model_build_s=build_s, deepspeed_version=deepspeed.__version__, ds_config=config,
               ds_config_resolved=_resolved(trainer), optimizer=chain[-1] if chain else None,
               optimizer_chain=chain,
               model_init=f"{str(dtype).replace('torch.', '')} on host (meta + N(0,0.02)); DeepSpeedEngine casts "
                          "to bf16, the ZeRO-3 optimizer keeps the FP32 master")
    return res


if __name__ == "__main__":
    runner_main("deepspeed", run)
