"""The host's ceiling for the host AdamW passes, with no GPU work beside them: one process, and several at once
(as data-parallel ranks run them), each on its own buffers, over thread counts.

    python integration/probes/host_adamw_processes.py $OUT/host_adamw_processes.json [--params 2e8] [--plan 1x32,2x12]

Each entry of ``--plan`` is PROCESSESxTHREADS. Every process runs the native kernel (core/native_adamw.py) over
``--params`` parameters of its own, for each pass the training step uses -- the split update's WEIGHTS (bf16 and
FP32 gradient) and STATE halves, and a WHOLE update -- after a barrier, so the processes' passes overlap. The rate
is the host DRAM bytes the pass moves by the kernel's own count (kernels.host_bytes_per_param) over the slowest
process's median time: what the host delivers to a memory-bound pass, against which a training step's timeline
(``upd`` spans) can be read. Written for issue 45 (2 GPUs at 16k tokens per GPU on a 32-core host);
integration/host_adamw_rate.py measures one process's kernel variants, beside DMA. (Session 29 ran it as
``probes/host_adamw_rate.py``: its result file keeps that name.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(HERE, "integration"), HERE]

PASSES = (("weights_bf16_grad", "WEIGHTS", 2), ("weights_fp32_grad", "WEIGHTS", 4),
          ("state_bf16_grad", "STATE", 2), ("state_fp32_grad", "STATE", 4), ("whole_fp32_grad", "WHOLE", 4),
          ("read_fp32", "READ", 4), ("copy_fp32", "COPY", 4))  # READ / COPY: torch's sum / copy_, a bandwidth reference


def _worker(n: int, threads: int, reps: int, barrier: Any, queue: Any) -> None:
    import torch

    from hf_megatrain.core import kernels, native_adamw

    torch.set_num_threads(threads)
    p, m, v = (torch.rand(n) for _ in range(3))
    grads = {4: torch.rand(n) * 1e-3, 2: (torch.rand(n) * 1e-3).bfloat16()}
    out = torch.empty(n, dtype=torch.bfloat16)
    c = torch.tensor([1 - 1e-5 * 0.01, 0.1, 0.999, 0.001, 0.5, 1e-8, -1e-5, 0.5], dtype=torch.float32)
    native_adamw.library()
    times: dict[str, list[float]] = {}
    for name, part, gb in PASSES:
        g = grads[gb]
        for _ in range(reps + 1):
            barrier.wait()
            t0 = time.perf_counter()
            if part == "WEIGHTS":
                native_adamw.adamw_span_(p, g, m, v, out, c, True, write_state=False)
            elif part == "STATE":
                native_adamw.adamw_span_(p, g, m, v, None, c, True)
            elif part == "WHOLE":
                native_adamw.adamw_span_(p, g, m, v, out, c, True)
            elif part == "READ":
                p.sum()
            else:
                m.copy_(p)
            times.setdefault(name, []).append(time.perf_counter() - t0)
    per_param = {name: 4 if part == "READ" else 8 if part == "COPY" else kernels.host_bytes_per_param(
        kernels.HostKernel.NATIVE, True, 2 if part != "STATE" else 0, gb, kernels.UpdatePart[part])
        for name, part, gb in PASSES}
    queue.put({name: {"s": statistics.median(ts[1:]), "bytes": n * per_param[name]} for name, ts in times.items()})


def run(procs: int, threads: int, n: int, reps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(n, threads, reps, barrier, queue)) for _ in range(procs)]
    for q in ps:
        q.start()
    results = [queue.get(timeout=900) for _ in ps]
    for q in ps:
        q.join()
    out: dict[str, Any] = {"processes": procs, "threads_each": threads, "params_each": n}
    for name in results[0]:
        slowest = max(r[name]["s"] for r in results)
        total = sum(r[name]["bytes"] for r in results)
        out[name] = {"slowest_s": round(slowest, 4), "gb": round(total / 1e9, 2), "gb_per_s": round(total / slowest / 1e9, 1)}
    return out


def main(argv: list[str] | None = None) -> None:
    from bench import record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--params", type=float, default=2e8, help="parameters per process (default 2e8)")
    ap.add_argument("--plan", default="1x32,1x24,1x16,1x12,2x12,2x16", help="PROCESSESxTHREADS, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    rows = []
    for item in a.plan.split(","):
        procs, threads = (int(x) for x in item.split("x"))
        rows.append(run(procs, threads, int(a.params), a.reps))
        print(json.dumps(rows[-1]), flush=True)
    record.write(a.out, {**record.header("integration/probes/host_adamw_processes.py", argv),
                         "cores": os.cpu_count(), "runs": rows})


if __name__ == "__main__":
    main()
