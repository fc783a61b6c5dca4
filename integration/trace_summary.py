"""Summarise a torch.profiler chrome trace: what each GPU stream did and how much of it overlapped.

Used by the GPU checks and the benchmark to report H2D / compute / D2H busy time, how much of the H2D and D2H
time ran under compute (overlap), and the GPU idle fraction (wall time with no kernel running).
"""

from __future__ import annotations

import json
from typing import Any


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(trace_path: str, window: tuple[float, float] | None = None) -> dict[str, Any]:
    """Busy/overlap/idle figures (ms) from a chrome trace exported by ``prof.export_chrome_trace``.

    ``window`` (us, trace clock) limits the analysis, e.g. to one step; default: first to last GPU event.
    """
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kern, h2d, d2h, labels = [], [], [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if cat == "kernel":
            kern.append(iv)
        elif cat == "gpu_memcpy":
            if "HtoD" in name:
                h2d.append(iv)
            elif "DtoH" in name:
                d2h.append(iv)
        elif cat == "gpu_user_annotation":  # record_function ranges as they ran on the GPU
            labels.append((name, iv))
    allgpu = kern + h2d + d2h
    if not allgpu:
        return {"error": "no GPU events in trace"}
    lo, hi = window or (min(a for a, _ in allgpu), max(b for _, b in allgpu))
    clip = lambda ivs: [(max(a, lo), min(b, hi)) for a, b in ivs if b > lo and a < hi]  # noqa: E731
    K, H, D = union(clip(kern)), union(clip(h2d)), union(clip(d2h))
    wall = hi - lo
    out = {
        "wall_ms": wall / 1e3,
        "compute_ms": length(K) / 1e3,
        "h2d_ms": length(H) / 1e3,
        "d2h_ms": length(D) / 1e3,
        "h2d_overlapped_with_compute_frac": intersect(H, K) / max(length(H), 1e-9),
        "d2h_overlapped_with_compute_frac": intersect(D, K) / max(length(D), 1e-9),
        "gpu_idle_frac": 1.0 - length(K) / wall,
    }
    # Per labelled region (record_function names such as "megatrain.forward" / "megatrain.backward").
    regions: dict[str, dict[str, float]] = {}
    for name, (a, b) in labels:
        if not name.startswith("megatrain."):
            continue
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        r = regions.setdefault(name, {"wall_ms": 0.0, "h2d_ms": 0.0, "h2d_under_compute_ms": 0.0})
        Hs, Ks = union(clip([(max(x, a), min(y, b)) for x, y in H if y > a and x < b])), \
            union([(max(x, a), min(y, b)) for x, y in K if y > a and x < b])
        r["wall_ms"] += (b - a) / 1e3
        r["h2d_ms"] += length(Hs) / 1e3
        r["h2d_under_compute_ms"] += intersect(Hs, Ks) / 1e3
    out["regions"] = regions
    return out
