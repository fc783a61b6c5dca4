"""Summarise torch-profiler chrome traces (the bench's ``--keep-trace`` files) for a side-by-side reading of ranks.

For each trace: GPU busy time per stream and per kind (GEMM, attention, NCCL, other kernels, H2D/D2H/D2D copies),
and every GPU event of at least ``--min-ms`` in time order (ms from the first GPU event, stream, duration, name),
so one process's step and each rank's can be laid side by side without the 100 MB traces themselves.

    python integration/probes/trace_events.py OUT.md TRACE.json.gz [TRACE.json.gz ...] [--min-ms 1.0]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os


def kind(ev: dict) -> str:
    name, cat = ev.get("name", ""), ev.get("cat", "")
    low = name.lower()
    if cat == "gpu_memcpy":
        for k in ("HtoD", "DtoH", "DtoD", "PtoP"):
            if k in name:
                return "copy " + k
        return "copy"
    if cat == "gpu_memset":
        return "memset"
    if "nccl" in low:
        return "nccl"
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "gemm"
    if any(s in low for s in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    return "kernel"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    evs = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in evs if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def summarise(path: str, min_ms: float) -> list[str]:
    evs = sorted(load(path), key=lambda e: e["ts"])
    if not evs:
        return [f"## {os.path.basename(path)}", "", "no GPU events", ""]
    t0 = evs[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in evs)
    by_stream: dict = collections.defaultdict(float)
    by_kind: dict = collections.defaultdict(float)
    for e in evs:
        by_stream[e.get("tid")] += e["dur"] / 1e3
        by_kind[kind(e)] += e["dur"] / 1e3
    out = [f"## {os.path.basename(path)}", "", f"GPU window {(end - t0) / 1e3:.1f} ms, {len(evs)} events", "",
           "busy per stream (ms): " + ", ".join(f"{s}: {v:.1f}" for s, v in sorted(by_stream.items(), key=str)),
           "", "busy per kind (ms): " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(by_kind.items())), "",
           "| t ms | stream | ms | kind | name |", "|---:|---|---:|---|---|"]
    for e in evs:
        if e["dur"] / 1e3 >= min_ms:
            out.append(f"| {(e['ts'] - t0) / 1e3:.1f} | {e.get('tid')} | {e['dur'] / 1e3:.2f} | {kind(e)} | "
                       f"{e.get('name', '')[:60]} |")
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--min-ms", type=float, default=1.0)
    a = ap.parse_args()
    lines = ["# GPU events per trace", ""]
    for p in a.traces:
        lines += summarise(p, a.min_ms)
    with open(a.out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
