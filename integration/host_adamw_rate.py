"""Host AdamW rate on this machine: G param/s and GB/s of the update variants, one 14B-width layer's worth.

Measures what bounds the CPU optimizer of the streamed regime (issue 15): torch's fused AdamW kernel alone, with the
compute-copy pass after it, with global-norm clipping (the kernel unscales the gradient in place: one more write),
the single-pass compiled kernel (core/kernels.py ``HostKernel.COMPILED``: update + compute copy in one loop), from
the main thread and from a worker thread (where the optimizer runs), and alongside PCIe DMA into pinned memory (the
gradient offload runs while the optimizer does). Bytes per parameter are counted from what each variant reads and
writes; the host's copy bandwidth is measured the same way for the ceiling.

    python integration/host_adamw_rate.py --out integration/results/host_adamw   # JSON: host_adamw_rate_<host>.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench import record as schema  # noqa: E402
from hf_megatrain.core import kernels  # noqa: E402

COPY_BYTES = 12  # the plain copy ceiling: read 4, write 4, and the write's cache-line fill 4


def timed(fn, reps: int) -> float:
    fn()
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return sorted(best)[len(best) // 2]


def in_thread(fn):
    def run():
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("v", fn()))
        t.start()
        t.join()
        return out["v"]
    return run


@contextlib.contextmanager
def dma_running(n: int, directions: tuple[str, ...]) -> Iterator[None]:
    """PCIe copies of ``n`` FP32 elements looping in each of ``directions`` ("d2h": into pinned memory, "h2d": out
    of it), each on its own stream and thread, for the duration of the block (the streamed step's DMA traffic)."""
    stop, threads = threading.Event(), []
    for direction in directions:
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(n, dtype=torch.float32, device="cuda")
        dst, src = (host, dev) if direction == "d2h" else (dev, host)

        def loop(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
            st = torch.cuda.Stream()
            with torch.cuda.stream(st):
                while not stop.is_set():
                    dst.copy_(src, non_blocking=True)
                    st.synchronize()
        threads.append(threading.Thread(target=loop))
    for t in threads:
        t.start()
    time.sleep(0.5 if threads else 0)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=275_268_608)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = args.numel
    pin = torch.cuda.is_available()
    mk = lambda dt=torch.float32: torch.empty(n, dtype=dt, pin_memory=pin)  # noqa: E731
    p, g, m, v = mk(), mk(), mk(), mk()
    for t in (p, g, m, v):
        t.uniform_(0.1, 1.0)
    out = mk(torch.bfloat16)
    h = kernels.Hyper(1e-4, (0.9, 0.999), 1e-8, 0.01)
    groups = [(h, [(0, n)])]
    step = [10]

    def fused(copy: bool, clip: bool, impl: kernels.HostKernel):
        def run():
            step[0] += 1
            kernels.adamw_(p, g, m, v, groups, step[0], 1.0 if clip else None,
                           compute=out if copy else None, impl=impl)
        return run, kernels.host_bytes_per_param(impl, clip, out.element_size() if copy else 0)

    variants = {
        "fused": fused(False, False, kernels.HostKernel.FUSED),
        "fused+copy": fused(True, False, kernels.HostKernel.FUSED),
        "fused+clip+copy": fused(True, True, kernels.HostKernel.FUSED),
        "compiled+copy": fused(True, False, kernels.HostKernel.COMPILED),
        "compiled+clip+copy": fused(True, True, kernels.HostKernel.COMPILED),
        "copy": (lambda: m.copy_(v), COPY_BYTES),
        "read": (lambda: v.sum(), 4),  # the read-only ceiling
    }
    kernels.warm_up_native()  # (needs a C compiler: says so when there is none)
    gb = mk(torch.bfloat16).uniform_(0.1, 1.0)

    def native(copy: bool):  # a narrow (bf16) gradient: the lean store's update, and with the compute copy
        def run():
            step[0] += 1
            kernels.adamw_(p, gb, m, v, groups, step[0], None, compute=out if copy else None,
                           impl=kernels.HostKernel.NATIVE)
        return run, kernels.host_bytes_per_param(kernels.HostKernel.NATIVE, False, 2 if copy else 0, 2)
    variants["native+bf16grad"] = native(False)
    variants["native+bf16grad+copy"] = native(True)
    res = {**schema.header(__file__),
           "host": platform.node(), "threads": torch.get_num_threads(), "numel": n, "pinned": pin,
           "torch": torch.__version__, "cpu_count": os.cpu_count(), "variants": {}}
    for name, (fn, b) in variants.items():
        for where, f in (("main", fn), ("thread", in_thread(fn))):
            s = timed(f, args.reps)
            res["variants"][f"{name}/{where}"] = {"s": s, "Gparam_s": n / s / 1e9, "bytes_per_param": b,
                                                  "GB_s": n * b / s / 1e9}
            print(f"{name:>20s} {where:>6s}: {s * 1e3:7.1f} ms  {n / s / 1e9:5.2f} G param/s  "
                  f"{b} B/param  {n * b / s / 1e9:6.1f} GB/s", flush=True)
    if torch.cuda.is_available():  # the same update while gradients stream D2H into pinned memory
        # and while weights stream H2D as well (both directions busy, as in the streamed step)
        for dirs in (("d2h",), ("d2h", "h2d")):
            with dma_running(n // 2, dirs):
                for name in ("fused+copy", "compiled+copy", "native+bf16grad", "native+bf16grad+copy", "read",
                             "copy"):
                    s = timed(in_thread(variants[name][0]), args.reps)
                    tag = "+".join(dirs)
                    res["variants"][f"{name}/thread+{tag}"] = {"s": s, "Gparam_s": n / s / 1e9,
                                                               "GB_s": n * variants[name][1] / s / 1e9}
                    print(f"{name:>20s} +{tag:8s}: {s * 1e3:7.1f} ms  {n / s / 1e9:5.2f} G param/s "
                          f"{n * variants[name][1] / s / 1e9:6.1f} GB/s", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"host_adamw_rate_{platform.node()}.json"
        schema.write(str(path), res)
        print("wrote", path)


if __name__ == "__main__":
    main()
