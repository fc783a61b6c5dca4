"""Data parallel over the GPUs of one host (issue 19): parity and scaling of N processes against one.

Two measurements, each in freshly spawned processes (``torch.multiprocessing``; NCCL for the gradients, gloo for
barriers, one shared FP32 store per host in /dev/shm):

- **parity**: a small Qwen2 (benchmark shape scaled down) trained 3 steps, clipped, on the same global batch by one
  process and by N (each of ``--parity-procs``); every FP32 master compared, ``max ‖a−b‖/‖b‖`` over tensors. The
  reference is one process running the same micro-batches as the N ranks, accumulated (gradient accumulation N,
  as a user with ``per_device_train_batch_size`` B/N and ``gradient_accumulation_steps`` N): the same kernels on the
  same shapes, so only the order of the N-term gradient sum and of the norm's partial sums differ. One process
  computing the whole batch in one micro-batch is reported beside it (``one_batch_max_rel``): there every GEMM has
  another shape and the bias gradients are summed over the tokens in another order, a difference of rounding, not
  of math. FP32 compute (TF32 off); bf16 compute (``--parity-dtypes``) is reported beside it.
- **scaling**: the benchmark model (Qwen2 14B width, ``--layers``) in the streamed regime (every layer streamed),
  ``--batch`` sequences of ``--seq`` tokens *per process*: one process, then N. Tokens/s, the ratio, the host memory
  the run added (MemTotal − MemAvailable, sampled; the shared store counts once however many processes map it) and
  each rank's peak GPU memory.

    python integration/multi_gpu.py --out $OUT                    # GPU host with >= 2 GPUs
    python integration/multi_gpu.py --tiny --gpus 2 --out /tmp/mg  # CPU (gloo) smoke of the same code

Writes ``multi_gpu_<gpu>.json`` (and ``.md``) under ``--out``. Engine API in a plain loop, as bench/run_megatrain.py's
engine mode: a step is the interval between device-synchronised step ends, medians after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench import record as schema  # noqa: E402
from bench.child import HostPeak  # noqa: E402
from bench.common import FULL_WIDTH, GIB, PEAK_TFLOPS, build_model, count_params, free_port, token_rows  # noqa: E402

PARITY_WIDTH = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2,
                    vocab_size=4096)
LR, CLIP = 1e-4, 1.0


def _spec(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    if kind == "parity":
        return {"tiny": a.tiny, "layers": 4, "seq": 256 if not a.tiny else 32, "batch": 4, "seed": 0}
    return {"tiny": a.tiny, "layers": a.layers, "seq": a.seq, "batch": a.batch, "seed": 0}


def worker(rank: int, world: int, kind: str, a: argparse.Namespace, port: int, compute: str, out: str,
           accum: int = 1) -> None:
    cuda = torch.cuda.is_available() and not a.tiny
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank) if cuda else None)
    elif cuda:
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    from bench import common
    from hf_megatrain import MegaTrainConfig, MegaTrainEngine
    from hf_megatrain.parallel import DataParallel

    spec = _spec(kind, a)
    if kind == "parity" and not a.tiny:
        common.FULL_WIDTH = {**FULL_WIDTH, **PARITY_WIDTH}  # (this process only)
    dtype = torch.float32 if compute == "float32" else torch.bfloat16
    model = build_model(spec, dtype)
    n_params = count_params(model)
    config = MegaTrainConfig(compute_dtype=compute, device_layers=0, device_step_layers=0,
                             torch_compile=kind == "scaling" and cuda and a.compile, shared_memory_dir=a.shm,
                             **json.loads(a.megatrain_config or "{}"))
    dp = DataParallel.from_process_group() if world > 1 else None
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    engine = MegaTrainEngine(model, config, device=device, dp=dp)
    opt = engine.create_optimizer(lr=LR, weight_decay=0.01, max_grad_norm=CLIP if kind == "parity" else 1e4)
    steps = 3 if kind == "parity" else a.warmup + a.steps
    per_rank = int(spec["batch"]) if kind == "scaling" else int(spec["batch"]) // max(world, accum)
    global_batch = per_rank * max(world, accum)
    rows = token_rows({**spec, "batch": global_batch}, steps)
    seq = int(spec["seq"])
    times, t_last = [], None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for s in range(steps):
        g = rows[s * global_batch:(s + 1) * global_batch]
        items = global_batch * (seq - 1)
        for m in range(accum):  # (accum > 1: one process running the N ranks' micro-batches in turn)
            part = rank if world > 1 else m
            ids = g[part * per_rank:(part + 1) * per_rank].to(device) if accum > 1 or world > 1 else g.to(device)
            loss = engine(input_ids=ids, labels=ids, num_items_in_batch=items).loss
            (loss * world).backward()  # (Trainer's scaling with average_tokens_across_devices; dp averages grads)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        if t_last is not None:
            times.append(t - t_last)
        t_last = t
    opt.wait()
    res: dict[str, Any] = {"rank": rank, "n_params": n_params, "step_times_s": times,
                           "peak_gpu_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
                           "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None}
    if kind == "parity" and rank == 0:
        torch.save({n: t.detach().float().cpu() for n, t in engine.named_master_tensors()},
                   os.path.join(out, f"parity_{compute}_{world}{_accum_tag(accum)}.pt"))
    with open(os.path.join(out, f"{kind}_{compute}_{world}{_accum_tag(accum)}_rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _accum_tag(accum: int) -> str:
    return f"_ga{accum}" if accum > 1 else ""


def run(kind: str, world: int, a: argparse.Namespace, compute: str, accum: int = 1) -> dict[str, Any]:
    peak, t0 = HostPeak(), time.perf_counter()
    mp.spawn(worker, args=(world, kind, a, free_port(), compute, a.out, accum), nprocs=world, join=True)
    used = peak.stop()
    tag = _accum_tag(accum)
    ranks = [json.load(open(os.path.join(a.out, f"{kind}_{compute}_{world}{tag}_rank{r}.json")))
             for r in range(world)]
    out: dict[str, Any] = {"processes": world, "gradient_accumulation": accum, "compute_dtype": compute,
                           "wall_s": time.perf_counter() - t0, "host_added_gib": used / GIB, "ranks": ranks}
    if kind == "scaling":
        times = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))][a.warmup - 1:]  # slowest rank per step
        step = statistics.median(times)
        tokens = a.batch * a.seq * world
        n = ranks[0]["n_params"]
        out.update(step_time_s=step, tokens_per_step=tokens, tokens_per_s=tokens / step,
                   model_tflops=6 * n * tokens / step / 1e12, mfu_per_gpu=6 * n * tokens / step / 1e12 / world
                   / PEAK_TFLOPS)
    return out


# A key projection's bias has a zero gradient in exact arithmetic: it adds q·b_k to every score of a query, which the
# softmax ignores. What the backward computes for it is rounding noise, and AdamW normalises that noise to full-size
# steps, so its values after training differ by more than any other tensor between two correct runs that round
# differently. Reported separately (``noise_only_max_rel``), not held to the tolerance.
NOISE_ONLY = ("self_attn.k_proj.bias",)


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], noise: bool = False) -> tuple[float, str]:
    rel = {n: float((a[n] - t).norm() / t.norm().clamp_min(1e-30)) for n, t in b.items()
           if n.endswith(NOISE_ONLY) == noise}
    if not rel:
        return 0.0, ""
    name = max(rel, key=rel.get)
    return rel[name], name


def parity(world: int, a: argparse.Namespace, compute: str) -> dict[str, Any]:
    """N processes against one process running the same N micro-batches (the reference), and against one process
    computing the whole batch at once (reported beside)."""
    batch = run("parity", 1, a, compute) if not os.path.exists(os.path.join(a.out, f"parity_{compute}_1.pt")) \
        else None
    one, many = run("parity", 1, a, compute, accum=world), run("parity", world, a, compute)
    ref = torch.load(os.path.join(a.out, f"parity_{compute}_1{_accum_tag(world)}.pt"))
    got = torch.load(os.path.join(a.out, f"parity_{compute}_{world}.pt"))
    whole = torch.load(os.path.join(a.out, f"parity_{compute}_1.pt"))
    out = {"compute_dtype": compute, "processes": world, "tensors": len(ref), "one": one, "many": many,
           "one_batch": batch}
    out["max_rel"], out["worst_tensor"] = _worst(got, ref)
    out["one_batch_max_rel"], out["one_batch_worst_tensor"] = _worst(got, whole)
    out["noise_only_max_rel"], out["noise_only_worst_tensor"] = _worst(got, ref, noise=True)
    fp32 = os.path.join(a.out, "parity_float32_1.pt")
    if compute != "float32" and os.path.exists(fp32):  # the single-GPU bf16 tolerance: distance to FP32 training
        exact = torch.load(fp32)
        out["one_vs_fp32_max_rel"], _ = _worst(ref, exact)
        out["many_vs_fp32_max_rel"], _ = _worst(got, exact)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="processes (default: every visible GPU; --tiny: 2)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="sequences per process per step (scaling)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch_compile the layers (scaling runs)")
    ap.add_argument("--parity-procs", default="",
                    help="comma list of process counts for parity (default: 2 and every visible GPU)")
    ap.add_argument("--parity-dtypes", default="float32,bfloat16", help="compute dtypes for parity")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: parity, scaling")
    ap.add_argument("--tiny", action="store_true", help="tiny width on the CPU with gloo (smoke test)")
    ap.add_argument("--shm", default="/dev/shm", help="where the shared host store's files live")
    ap.add_argument("--megatrain-config", default=None,
                    help='JSON dict of more MegaTrainConfig keys, e.g. \'{"gradient_exchange": "all_to_all"}\'')
    ap.add_argument("--out", default=os.path.join(HERE, "results", "multi_gpu"))
    a = ap.parse_args(argv)
    if a.tiny:
        a.layers, a.seq, a.batch, a.steps, a.warmup = 2, 32, 2, 2, 1
    world = a.gpus or (2 if a.tiny or not torch.cuda.is_available() else torch.cuda.device_count())
    if world < 2:
        print("multi_gpu: needs 2 or more GPUs (or --tiny)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    gpu = "cpu" if a.tiny or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    res: dict[str, Any] = {**schema.header(__file__, argv), "gpu": gpu, "processes": world}
    path = os.path.join(a.out, f"multi_gpu_{gpu.lower().replace(' ', '_')}.json")

    def save() -> None:
        schema.write(path, res)

    skip = set(a.skip.split(","))
    if "parity" not in skip:
        procs = sorted({int(n) for n in a.parity_procs.split(",") if n} or {2, world})
        res["parity"] = []
        for c in a.parity_dtypes.split(","):
            for n in procs:
                res["parity"].append(parity(n, a, c))
                save()
        for p in res["parity"]:
            n = p["processes"]
            vs = (f"; vs FP32 training: 1 process {p['one_vs_fp32_max_rel']:.2e}, {n}: "
                  f"{p['many_vs_fp32_max_rel']:.2e}") if "one_vs_fp32_max_rel" in p else ""
            print(f"[multi_gpu] parity {p['compute_dtype']} {n} vs 1 (same micro-batches): max rel "
                  f"{p['max_rel']:.2e} ({p['worst_tensor']}); vs one batch {p['one_batch_max_rel']:.2e}; "
                  f"k_proj biases (zero gradient in exact math) {p['noise_only_max_rel']:.2e}{vs}")
    if "scaling" not in skip:
        one = run("scaling", 1, a, "float32" if a.tiny else "bfloat16")
        save()
        many = run("scaling", world, a, "float32" if a.tiny else "bfloat16")
        res["scaling"] = {"one": one, "many": many, "speedup": many["tokens_per_s"] / one["tokens_per_s"],
                          "host_ratio": many["host_added_gib"] / max(one["host_added_gib"], 1e-9)}
        save()
        s = res["scaling"]
        print(f"[multi_gpu] 1 process {one['tokens_per_s']:,.0f} tok/s, {world}: {many['tokens_per_s']:,.0f} "
              f"({s['speedup']:.2f}x); host added {one['host_added_gib']:.1f} -> {many['host_added_gib']:.1f} GiB "
              f"({s['host_ratio']:.2f}x)")
    print(f"[multi_gpu] -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
