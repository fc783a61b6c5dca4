"""Benchmark PyTorch FSDP2 with CPU offload once: one batch size, one process, world size 1.

The configuration: ``fully_shard`` per decoder layer, on the embeddings, on the lm_head, then the root;
``CPUOffloadPolicy(pin_memory=True)`` (sharded FP32 params, grads and optimizer state in pinned host memory,
params copied H2D before each all-gather), ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, HF
activation checkpointing per decoder layer (non-reentrant), fused CPU AdamW (``torch.optim.AdamW(fused=True)``
on the CPU DTensors), gradient clipping 1.0. FSDP2 needs a process group even for one GPU: env:// on localhost,
``cpu:gloo,cuda:nccl`` (gloo for CPU-side collectives such as the grad-norm reduction of CPU DTensors).
On a CPU-only machine (smoke tests) the same code runs on a gloo CPU mesh without offload.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import (StepClock, build_model, count_params, runner_main, single_process_dist_env,  # noqa: E402
                          throughput, token_rows)

LR, MAX_GRAD_NORM = 1e-5, 1.0


def _make_optimizer(params: list, choice: str) -> tuple[torch.optim.Optimizer, str]:
    """Fused CPU AdamW if the build supports it on these (DTensor) params, else foreach; the choice is recorded."""
    kinds = ["fused", "foreach"] if choice == "auto" else [choice]
    err = None
    for kind in kinds:
        try:
            opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, **{kind: True})
            return opt, kind
        except (RuntimeError, ValueError, TypeError) as e:  # e.g. fused unsupported for this device/dtype
            err = e
    raise RuntimeError(f"could not build AdamW ({kinds}): {err}")


def run(spec: dict) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    fs = dict(spec.get("fsdp") or {})
    cuda = torch.cuda.is_available()
    single_process_dist_env()
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (1,))

    t = time.perf_counter()
    model = build_model(spec, torch.float32)  # FSDP2's sharded params are the FP32 master
    n_params = count_params(model)
    build_s = time.perf_counter() - t
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    t = time.perf_counter()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if cuda else OffloadPolicy()
    reshard = bool(fs.get("reshard_after_forward", True))
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **kw)
    fully_shard(model.model.embed_tokens, reshard_after_forward=reshard, **kw)
    fully_shard(model.lm_head, reshard_after_forward=False, **kw)  # backward needs it right after forward
    fully_shard(model, **kw)
    opt, opt_kind = _make_optimizer(list(model.parameters()), fs.get("optimizer", "auto"))
    setup_s = time.perf_counter() - t

    warm, steps, batch = int(spec["warmup"]), int(spec["steps"]), int(spec["batch"])
    micro, ga = int(spec.get("micro_batch") or batch), int(spec.get("grad_accum") or 1)
    if micro * ga != batch:
        raise ValueError(f"micro_batch {micro} x grad_accum {ga} != batch {batch}")
    no_sync = bool(fs.get("no_sync_during_accumulation", True))
    rows = token_rows(spec, warm + steps)
    clock, losses, opt_s = StepClock(spec.get("clock_sync") == "stream"), [], []
    clock.mark()
    for i in range(warm + steps):
        step_rows = rows[i * batch:(i + 1) * batch]
        total = torch.zeros((), device=device)
        for m in range(ga):
            if no_sync and ga > 1:
                model.set_requires_gradient_sync(m == ga - 1)
            ids = step_rows[m * micro:(m + 1) * micro].to(device, non_blocking=True)
            loss = model(input_ids=ids, labels=ids).loss / ga
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.get("max_grad_norm", MAX_GRAD_NORM))
        t0 = time.perf_counter()
        try:
            opt.step()
        except (RuntimeError, NotImplementedError) as e:
            # Fused AdamW may build but refuse CPU DTensors at the first step: fall back to foreach, once.
            if i > 0 or opt_kind != "fused" or fs.get("optimizer", "auto") != "auto":
                raise
            print(f"fused AdamW failed at the first step ({e}); using foreach", flush=True)
            opt, opt_kind = _make_optimizer(list(model.parameters()), "foreach")
            opt.step()
        opt.zero_grad(set_to_none=True)
        opt_s.append(time.perf_counter() - t0)
        clock.mark()
        losses.append(float(total))
    res = throughput(spec, n_params, clock.periods)
    res.update(n_params=n_params, model_build_s=build_s, setup_s=setup_s, losses=losses, micro_batch=micro,
               grad_accum=ga, optimizer=f"torch.optim.AdamW({opt_kind}=True) on CPU DTensors",
               cpu_optimizer={"optimizer_step_s": sorted(opt_s[warm:])[len(opt_s[warm:]) // 2]},
               fsdp={"reshard_after_forward": reshard, "lm_head_reshard_after_forward": False,
                     "offload": type(offload).__name__, "no_sync_during_accumulation": no_sync,
                     "mixed_precision": "param bf16, reduce fp32"},
               model_init="fp32 on host (meta + N(0,0.02)); fully_shard keeps it as the FP32 master")
    return res


if __name__ == "__main__":
    runner_main("fsdp2", run)
