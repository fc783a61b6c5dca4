"""Perf probe (issue 6): where the optimizer window of a step goes, measured on the GPU box in one process.

The side-by-side benchmark (``bench_vs_deepspeed.py``) gives one number per system; this probe answers the
questions that decide the next change to the core, cheaply (one model build, many configurations):

1. ``cpu_adam``: the CPU AdamW of one 14B-width layer (275M params) through ``CPUAdamW``'s host path, whole-unit
   kernel + separate bf16 copy pass vs chunked (copy fused per chunk), on the main thread and on a worker thread,
   alone and while PCIe DMA (H2D + D2H of pinned buffers) runs: is the CPU step compute, thread or
   memory-bandwidth bound?
2. ``sweep``: the benchmark model (Qwen2 14B width, 8 layers) through ``MegaTrainEngine`` at 8k and 32k tokens
   per step, for several optimizer placements (how many streamed layers ``DeviceStepper`` steps on the GPU, chunked
   or whole-unit CPU step): median step time, optimizer worker time, how long the forward waited for it, peak
   GPU memory; one profiled pair of steps per batch size with the host ranges (``megatrain.*``) as a timeline.

    python integration/perf_probe.py --out $OUT [--parts cpu_adam,sweep] [--sizes 4,16]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from bench.common import build_model, phase_breakdown, token_rows  # noqa: E402
from hf_megatrain import MegaTrainConfig, MegaTrainEngine  # noqa: E402
from hf_megatrain.optim.device_stepper import DeviceStepper  # noqa: E402
from hf_megatrain.core.store import HostStore  # noqa: E402
from hf_megatrain.optim.adamw import CPUAdamW  # noqa: E402

H, I, KV = 5120, 13824, 1024
LAYER_SHAPES = [(H, H), (H,), (KV, H), (KV,), (KV, H), (KV,), (H, H), (I, H), (I, H), (H, I), (H,), (H,)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- 1. CPU AdamW of one layer -----------------------------------------------------------------------------------------
class _DMA:
    """Background PCIe traffic: pinned 1 GiB buffers copied H2D and D2H back to back on two side streams."""

    def __init__(self) -> None:
        n = 1 << 28
        self.host = [torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.dev = [torch.empty(n, dtype=torch.float32, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self.stop = threading.Event()
        self.bytes = 0
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.dev[0].copy_(self.host[0], non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.host[1].copy_(self.dev[1], non_blocking=True)
            self.streams[0].synchronize()
            self.streams[1].synchronize()
            self.bytes += 2 * self.host[0].numel() * 4

    def __enter__(self) -> "_DMA":
        self.t0 = time.perf_counter()
        self.t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.t.join()
        self.gbps = self.bytes / (time.perf_counter() - self.t0) / 1e9


def part_cpu_adam(reps: int = 3) -> dict[str, Any]:
    layout = [(f"p{i}", f"p{i}", s, len(s) > 1) for i, s in enumerate(LAYER_SHAPES)]
    store = HostStore([layout], compute_dtype=torch.bfloat16, pin=torch.cuda.is_available())
    u = store.units[0]
    for t in (u.master, u.grad, u.exp_avg, u.exp_avg_sq):
        t.normal_()
    u.exp_avg_sq.abs_()
    opt = CPUAdamW(store, lr=1e-5, max_grad_norm=None)
    hyper = [dict(lr=float(g["lr"]), betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
             for g in opt.param_groups]
    out: dict[str, Any] = {"numel": u.numel, "threads_main": torch.get_num_threads()}

    def timed(chunk: int, where: str) -> float:
        opt.host_chunk = chunk
        times: list[float] = []

        def body() -> None:
            for _ in range(reps):
                t0 = time.perf_counter()
                opt._run_host([0], hyper, 2.0)
                times.append(time.perf_counter() - t0)
        if where == "thread":
            th = threading.Thread(target=body)
            th.start()
            th.join()
        else:
            body()
        return _median(times)

    seen_threads: list[int] = []
    th = threading.Thread(target=lambda: seen_threads.append(torch.get_num_threads()))
    th.start()
    th.join()
    out["threads_worker"] = seen_threads[0]
    for chunk in (0, 1 << 20, 1 << 22, 1 << 24):
        for where in ("main", "thread"):
            s = timed(chunk, where)
            out[f"chunk{chunk}_{where}_s"] = s
            out[f"chunk{chunk}_{where}_Gparams_per_s"] = u.numel / s / 1e9
    if torch.cuda.is_available():
        for chunk in (0, 1 << 22):
            with _DMA() as dma:
                s = timed(chunk, "thread")
            out[f"chunk{chunk}_thread_with_dma_s"] = s
            out[f"dma_GBps_during_chunk{chunk}"] = dma.gbps
        with _DMA() as dma:
            time.sleep(1.0)
        out["dma_GBps_alone"] = dma.gbps
    t0 = time.perf_counter()
    for _ in range(reps):
        u.compute.copy_(u.master)
    out["bf16_copy_pass_s"] = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        u.exp_avg.copy_(u.master)
    out["fp32_memcpy_GBps"] = 2 * 4 * u.numel * reps / (time.perf_counter() - t0) / 1e9
    return out


# -- 2. engine sweep --------------------------------------------------------------------------------------------------
def set_device_units(engine: MegaTrainEngine, opt: CPUAdamW, layer_ids: list[int]) -> None:
    """Re-place the GPU AdamW (DeviceStepper) on exactly these streamed layers."""
    for u in engine.layer_units:
        u.grad_device = None
        if u.index not in layer_ids:  # moments of layers the CPU steps live on the host
            u.exp_avg, u.exp_avg_sq = u.exp_avg.cpu().pin_memory(), u.exp_avg_sq.cpu().pin_memory()
    units = [engine.layer_units[i] for i in layer_ids]
    engine.device_stepper = opt.device_stepper = None
    torch.cuda.empty_cache()
    stepper = DeviceStepper(units, engine.device, engine.compute_dtype) if units else None
    engine.device_stepper = opt.device_stepper = stepper
    opt._on_device = {u.index for u in units}


def _timeline(trace_path: str) -> dict[str, Any]:
    with open(trace_path) as f:
        trace = json.load(f)
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    win = [e for e in ev if e.get("name") == "bench.step"]
    t0 = float(win[0]["ts"]) if win else min(float(e["ts"]) for e in ev)
    rows = [{"name": e["name"], "tid": e.get("tid"), "start_ms": round((float(e["ts"]) - t0) / 1e3, 2),
             "dur_ms": round(float(e["dur"]) / 1e3, 2)}
            for e in ev if str(e.get("name", "")).startswith(("megatrain.", "bench.")) and float(e["dur"]) > 100]
    rows.sort(key=lambda r: r["start_ms"])
    out: dict[str, Any] = {"phases": phase_breakdown(trace), "host_ranges": rows}
    # GPU busy per stream in 10 ms buckets: shows where each stream waits.
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy")]
    busy: dict[str, list[float]] = {}
    for e in gpu:
        key = f"{e.get('cat')}:{(e.get('args') or {}).get('stream', e.get('tid'))}"
        if e.get("cat") == "gpu_memcpy":
            key = "h2d" if "HtoD" in e.get("name", "") else "d2h" if "DtoH" in e.get("name", "") else "d2d"
        a, b = (float(e["ts"]) - t0) / 1e3, (float(e["ts"]) + float(e["dur"]) - t0) / 1e3
        row = busy.setdefault(key, [])
        k = int(max(a, 0) // 10)
        while k * 10 < b:
            lo, hi = max(a, k * 10), min(b, k * 10 + 10)
            if hi > lo:
                while len(row) <= k:
                    row.append(0.0)
                row[k] += hi - lo
            k += 1
    out["busy_ms_per_10ms"] = {k: [round(x, 1) for x in v] for k, v in busy.items()}
    return out


def run_config(engine: MegaTrainEngine, opt: CPUAdamW, rows: torch.Tensor, batch: int, steps: int,
               profile_to: str | None) -> dict[str, Any]:
    ex = engine.executor
    items = batch * (rows.shape[1] - 1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ends, per = [], []
    prof = None
    n = steps + (2 if profile_to else 0)
    for i in range(n):
        if profile_to and i == steps:
            torch.cuda.synchronize()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            rng = torch.profiler.record_function("bench.step")
            rng.__enter__()
        ids = rows[(i % 8) * batch:(i % 8 + 1) * batch]
        w0 = ex.wait_optimizer_s
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids, num_items_in_batch=items).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
        per.append({"fwd_call": t1 - t0, "bwd_call": t2 - t1, "step_call": t3 - t2,
                    "fwd_wait_opt": ex.wait_optimizer_s - w0, "opt_worker_prev": opt.last_step_seconds})
    if prof is not None:
        torch.cuda.synchronize()
        rng.__exit__(None, None, None)
        prof.__exit__(None, None, None)
    opt.wait()
    periods = [b - a for a, b in zip(ends, ends[1:])][1:steps - 1]  # drop the first (warm) and profiled
    out: dict[str, Any] = {"step_s": _median(periods), "periods": periods,
                           "tokens_per_s": batch * rows.shape[1] / _median(periods),
                           "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30,
                           "last_loss": float(loss.detach())}
    out.update({k: _median([p[k] for p in per[2:steps]]) for k in per[0]})
    if prof is not None and profile_to:
        prof.export_chrome_trace(profile_to)
        out["timeline"] = _timeline(profile_to)
        with open(profile_to, "rb") as src, gzip.open(profile_to + ".gz", "wb") as dst:
            dst.write(src.read())
        os.remove(profile_to)
    return out


def part_sweep(sizes: list[int], configs: list[dict], steps: int, out_dir: str, log: Any) -> list[dict[str, Any]]:
    spec = {"layers": 8, "seq": 2048, "batch": max(sizes), "seed": 0}
    t = time.perf_counter()
    model = build_model(spec, torch.bfloat16)
    engine = MegaTrainEngine(model, MegaTrainConfig())
    opt = engine.create_optimizer(lr=1e-5, weight_decay=0.0, max_grad_norm=1.0)
    log(f"engine built in {time.perf_counter() - t:.1f}s; default GPU AdamW layers: "
        f"{[u.index for u in (engine.device_stepper.units if engine.device_stepper else [])]}")
    rows = token_rows({**spec, "batch": max(sizes)}, 8)
    results = []
    for b in sizes:
        for cfg in configs:
            name = cfg["name"]
            set_device_units(engine, opt, cfg["device_layers"])
            opt.host_chunk = cfg.get("host_chunk", 0)
            prof = os.path.join(out_dir, f"trace_b{b}_{name}.json") if cfg.get("profile") else None
            try:
                r = run_config(engine, opt, rows, b, steps, prof)
            except torch.OutOfMemoryError as e:
                opt.wait()
                r = {"error": f"OOM: {str(e)[:200]}"}
                torch.cuda.empty_cache()
            r.update(batch=b, config=cfg)
            results.append(r)
            log(json.dumps({k: v for k, v in r.items() if k not in ("timeline", "periods")}))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="cpu_adam,sweep")
    ap.add_argument("--sizes", default="4,16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--configs", default=None, help="JSON list of {name, device_layers, host_chunk, profile}")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = os.path.join(a.out, "perf_probe.json")

    def log(msg: str) -> None:
        print(msg, flush=True)

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    if "cpu_adam" in a.parts:
        res["cpu_adam"] = part_cpu_adam()
        log(json.dumps(res["cpu_adam"]))
        save()
    if "sweep" in a.parts:
        configs = json.loads(a.configs) if a.configs else [
            {"name": "first6", "device_layers": [0, 1, 2, 3, 4, 5], "profile": True},
            {"name": "first4", "device_layers": [0, 1, 2, 3]},
            {"name": "first5", "device_layers": [0, 1, 2, 3, 4]},
            {"name": "first7", "device_layers": [0, 1, 2, 3, 4, 5, 6]},
            {"name": "all8", "device_layers": [0, 1, 2, 3, 4, 5, 6, 7]},
        ]
        res["sweep"] = part_sweep([int(s) for s in a.sizes.split(",")], configs, a.steps, a.out, log)
        save()


if __name__ == "__main__":
    main()
