"""Benchmark DPO steps through hf_megatrain once (one pair count), spawned by integration/bench_dpo.py.

The path users run: ``MegaTrainDPOTrainer`` + ``MegaTrainDPOConfig`` (hf/dpo_support.py) with the shared DPOConfig
hyper-parameters (bench/run_dpo_common.py), every decoder layer streamed (the ``streamed`` regime's overlay,
``device_layers=0, device_step_layers=0``, merged last into ``megatrain_config``), the reference log-probabilities
precomputed by the same streamed model before training. ``gradient_checkpointing`` stays off: the streamed backward
already recomputes each layer. The model is built in bf16 on the host (meta + cheap init); the host store makes the
FP32 master.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402

from bench.common import REGIMES, build_model, count_params, runner_main  # noqa: E402
from bench.run_dpo_common import dpo_kwargs, dpo_metrics, train_timed  # noqa: E402


def run(spec: dict) -> dict[str, Any]:
    from hf_megatrain.hf.dpo_support import MegaTrainDPOConfig, MegaTrainDPOTrainer

    micro, ga = int(spec.get("micro_pairs") or spec["pairs"]), int(spec.get("grad_accum") or 1)
    if micro * ga != int(spec["pairs"]):
        raise ValueError(f"micro_pairs {micro} x grad_accum {ga} != pairs {spec['pairs']}")
    regime = spec.get("regime", "streamed")
    mt_config = {**(spec.get("megatrain_config") or {}), **REGIMES[regime]}
    t = time.perf_counter()
    model = build_model(spec, torch.bfloat16)
    n_params = count_params(model)
    build_s = time.perf_counter() - t
    args = MegaTrainDPOConfig(**dpo_kwargs(spec, micro, ga), gradient_checkpointing=False, megatrain=True,
                              megatrain_config=mt_config)
    run_ = train_timed(MegaTrainDPOTrainer, model, args, spec)
    res = dpo_metrics(spec, n_params, run_, micro, ga)
    res.update(model_build_s=build_s, regime=regime,
               megatrain_config=args.megatrain_resolved_config().to_dict(),
               model_init="bf16 on host (meta + N(0,0.02)); FP32 master made by the host store")
    return res


if __name__ == "__main__":
    runner_main("megatrain", run)
