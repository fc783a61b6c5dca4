"""What a multi-GPU host looks like to one process: NUMA nodes, each GPU's node and local cores, clocks and power
limits, and per GPU the rates a training step leans on (bf16 GEMMs of the benchmark layer's shapes, pinned H2D /
D2H copies from host threads on the GPU's node and off it).

    python integration/probes/host_topology.py $OUT/topology.json

Written for issue 45 part 1 (one process on a 2-GPU host ran its GEMMs twice as long as on a one-GPU host).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, HERE)

from hf_megatrain.core import numa  # noqa: E402
from hf_megatrain.core.memory import alloc_host  # noqa: E402


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"<{e}>"


def gemm_tflops(device: torch.device, m: int, k: int, n: int, reps: int = 20) -> float:
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        a @ b
    e.record()
    e.synchronize()
    return 2 * m * k * n * reps / (s.elapsed_time(e) / 1e3) / 1e12


def copy_gbps(device: torch.device, nbytes: int, cores: set[int] | None) -> dict[str, float]:
    """Pinned (registered, as the store pins) H2D and D2H, the buffer first touched from ``cores``."""
    before = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        host = alloc_host(nbytes // 2, torch.bfloat16, pin=True)
        host.fill_(1)
        dev = torch.empty_like(host, device=device)
        out = {}
        for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                         ("d2h", lambda: host.copy_(dev, non_blocking=True))):
            fn()
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize(device)
            out[name] = 5 * nbytes / (time.perf_counter() - t) / 1e9
        return out
    finally:
        os.sched_setaffinity(0, before)


def main(path: str) -> None:
    res: dict[str, Any] = {"nodes": numa.nodes(), "affinity": sorted(os.sched_getaffinity(0)),
                           "nvidia_smi_topo": _sh(["nvidia-smi", "topo", "-m"]),
                           "nvidia_smi_q": _sh(["nvidia-smi", "-q", "-d", "POWER,CLOCK,PERFORMANCE,TEMPERATURE"]),
                           "lscpu": _sh(["lscpu"]), "gpus": []}
    for i in range(torch.cuda.device_count()):
        d = torch.device("cuda", i)
        torch.cuda.set_device(d)
        place = numa.gpu_placement(i)
        g: dict[str, Any] = {"index": i, "name": torch.cuda.get_device_name(i), **place.as_dict()}
        g["gemm_8192"] = gemm_tflops(d, 8192, 8192, 8192)
        g["gemm_layer"] = {f"{m}x{k}x{n}": gemm_tflops(d, m, k, n)
                           for m, k, n in ((16384, 5120, 13824), (16384, 13824, 5120), (16384, 5120, 5120),
                                           (5120, 16384, 13824))}
        local = set(place.cpus) & set(res["affinity"])
        remote = set(res["affinity"]) - local
        g["copy_local"] = copy_gbps(d, 1 << 30, local or None)
        if remote:
            g["copy_remote"] = copy_gbps(d, 1 << 30, remote)
        res["gpus"].append(g)
        print(json.dumps({k: v for k, v in g.items() if k != "cpus"}), flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "topology.json")
