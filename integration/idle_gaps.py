"""Where the GPU sat idle in a profiled step: every gap between kernels, placed on the step's timeline.

``bench/common.py``'s ``phase_breakdown`` says how much of the window had no kernel running; this says *where*: each
gap longer than ``--min-ms``, its offset from the window's first kernel, the kernels on either side, the host ranges
(``record_function`` names such as ``megatrain.wait_optimizer``) open while it lasted and the copies that ran in it.
That is what decides a lever: a gap at the step's start (the clip norm, then layer 0's update and load) wants a
different fix than gaps between layers (loads) or at the end (the loss, the last gradients).

    python integration/idle_gaps.py trace.json[.gz] [--min-ms 0.5] [--top 40]
"""

from __future__ import annotations

import argparse
import gzip
import json
from typing import Any


def load_events(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def gaps(events: list[dict[str, Any]], min_ms: float = 0.5) -> dict[str, Any]:
    kern: list[tuple[float, float, str]] = []
    copies: list[tuple[float, float, str, Any]] = []  # (start, end, name, correlation id)
    host: list[tuple[float, float, str]] = []
    launched: dict[Any, float] = {}  # correlation id -> when the host issued it (cudaMemcpyAsync & co.)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        a = float(e["ts"])
        iv = (a, a + float(e["dur"]), str(e.get("name", "")))
        cat = e.get("cat", "")
        if cat == "kernel":
            kern.append(iv)
        elif cat == "gpu_memcpy":
            copies.append((*iv, (e.get("args") or {}).get("correlation")))
        elif cat == "cuda_runtime":
            launched[(e.get("args") or {}).get("correlation")] = a
        elif cat == "user_annotation" and iv[2].startswith("megatrain."):
            host.append(iv)
    if not kern:
        return {"error": "no kernels in trace"}
    kern.sort()
    lo = kern[0][0]
    hi = max(b for _, b, _ in kern)
    out: list[dict[str, Any]] = []
    end, prev = kern[0][1], kern[0][2]
    for a, b, name in kern[1:]:
        if a - end >= min_ms * 1e3:
            open_host = sorted({h for ha, hb, h in host if ha < a and hb > end})
            inside = [c for c in copies if c[1] > end and c[0] < a]
            moved = sum(min(cb, a) - max(ca, end) for ca, cb, _, _ in inside) / 1e3
            # Each copy in the gap relative to the gap's start (ms): issued by the host, started, ended. Issued
            # late: the host was behind; issued early but started late: a stream dependency held it.
            detail = [{"copy": n[:40], "issued": round((launched[k] - end) / 1e3, 2) if k in launched else None,
                       "started": round((ca - end) / 1e3, 2), "ended": round((cb - end) / 1e3, 2)}
                      for ca, cb, n, k in inside]
            out.append({"at_ms": round((end - lo) / 1e3, 2), "idle_ms": round((a - end) / 1e3, 2),
                        "after": prev[:60], "before": name[:60], "host_open": open_host,
                        "copy_ms_in_gap": round(moved, 2), "copies": detail})
        if b > end:
            end, prev = b, name
    total = sum(g["idle_ms"] for g in out)
    by_host: dict[str, float] = {}
    for g in out:
        key = " + ".join(g["host_open"]) or "(no megatrain range open)"
        by_host[key] = round(by_host.get(key, 0.0) + g["idle_ms"], 2)
    # The host's side of the timeline: each update and each wait for one (start, end in ms from the window's start).
    ranges = [(h, round((ha - lo) / 1e3, 2), round((hb - lo) / 1e3, 2)) for ha, hb, h in sorted(host)
              if h.startswith(("megatrain.optimizer.", "megatrain.wait_optimizer")) and hb > lo and ha < hi]
    return {"window_ms": round((hi - lo) / 1e3, 2), "gaps_ms_total": round(total, 2), "gaps": out,
            "host_ranges": ranges,
            "by_host_range": dict(sorted(by_host.items(), key=lambda kv: -kv[1]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=0.5)
    ap.add_argument("--top", type=int, default=40, help="print the longest N gaps (all go to --json)")
    ap.add_argument("--json", default=None, help="write the full result here")
    a = ap.parse_args()
    r = gaps(load_events(a.trace), a.min_ms)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    if "error" in r:
        print(r["error"])
        return
    print(f"window {r['window_ms']} ms, idle in gaps >= {a.min_ms} ms: {r['gaps_ms_total']} ms ({len(r['gaps'])} gaps)")
    print("by host range open:")
    for k, v in r["by_host_range"].items():
        print(f"  {v:9.2f} ms  {k}")
    print("host updates and waits (ms from the window's start):")
    for name, a0, b0 in r["host_ranges"]:
        print(f"  {a0:9.2f} .. {b0:9.2f}  {name}")
    print("longest gaps (in time order):")
    top = sorted(sorted(r["gaps"], key=lambda g: -g["idle_ms"])[: a.top], key=lambda g: g["at_ms"])
    for g in top:
        print(f"  at {g['at_ms']:9.2f}  idle {g['idle_ms']:7.2f}  copies {g['copy_ms_in_gap']:6.2f}  "
              f"{g['after']!r} -> {g['before']!r}  host: {', '.join(g['host_open']) or '-'}")
        for c in g["copies"]:
            print(f"      {c['copy']!r}: issued {c['issued']}  started {c['started']}  ended {c['ended']} ms")


if __name__ == "__main__":
    main()
