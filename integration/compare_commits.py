"""Old vs new hf_megatrain on the same GPU, same lease: the benchmark model through each tree's own bench script.

    git archive <old-commit> | tar -x -C bench_old        # here; the untracked folder travels to the device
    python integration/compare_commits.py --old bench_old --regime streamed --out $OUT   # on the device

Runs ``integration/bench_vs_deepspeed.py --systems megatrain`` once from each tree (new first), same sizes,
same hf_megatrain config, each in its own subprocess, and writes one compact JSON (tokens/s, step time, MFU,
peak GPU / host memory per size, and new / old) plus the two Markdown tables to ``--out``. Regimes: ``auto``
(placement chosen by the planner: the model fits, most layers stay on the GPU) and ``streamed`` (every layer
streamed, no per-parameter state of a streamed layer on the GPU: ``device_layers=0, device_step_layers=0``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import record as schema  # noqa: E402
from bench.common import REGIMES  # noqa: E402  (one definition, shared with bench_vs_deepspeed.py)

KEEP = ("tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops", "mfu", "peak_gpu_alloc_gib",
        "peak_host_rss_gib", "status", "error")


def run_tree(tree: str, regime: str, a: argparse.Namespace, scratch: str) -> dict:
    cfg = json.dumps({"torch_compile": True, **REGIMES[regime]})
    cmd = [sys.executable, "integration/bench_vs_deepspeed.py", "--systems", "megatrain", "--sizes", a.sizes,
           "--megatrain-mode", "trainer", "--megatrain-config", cfg, "--no-profile", "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--budget", str(a.budget), "--timeout", str(a.timeout), "--out", scratch,
           "--fresh"]
    bench_src = open(os.path.join(tree, "integration/bench_vs_deepspeed.py")).read()
    if "--regime" in bench_src:  # (it defaults to streamed: name the regime; older trees take the overlay alone)
        cmd += ["--regime", regime]
    if a.max_grad_norm is not None:
        if "--max-grad-norm" in bench_src:
            cmd += ["--max-grad-norm", str(a.max_grad_norm)]
        else:
            runner = os.path.join(tree, "integration/bench/run_megatrain.py")
            src = open(runner).read().replace("LR, MAX_GRAD_NORM = 1e-5, 1.0", f"LR, MAX_GRAD_NORM = 1e-5, {a.max_grad_norm}")
            open(runner, "w").write(src)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
    out = {"tree": tree, "command": " ".join(cmd), "returncode": proc.returncode,
           "wall_s": round(time.perf_counter() - t0, 1), "stderr_tail": proc.stderr[-1500:], "rows": {}}
    for path in glob.glob(os.path.join(scratch, "bench_vs_deepspeed_*.json")):
        data = json.load(open(path))
        for rec in data.get("records", {}).values():
            if rec.get("system") == "megatrain":
                out["rows"][str(rec.get("tokens_per_step"))] = {k: rec.get(k) for k in KEEP}
        out["table"] = open(path[:-5] + ".md").read() if os.path.exists(path[:-5] + ".md") else ""
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="folder holding the old tree (git archive of the old commit)")
    ap.add_argument("--new", default=os.path.dirname(HERE), help="folder of the new tree (default: this repo)")
    ap.add_argument("--regime", choices=sorted(REGIMES), required=True)
    ap.add_argument("--sizes", default="4,16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=float, default=250, help="seconds per tree")
    ap.add_argument("--timeout", type=float, default=200, help="seconds per bench subprocess")
    ap.add_argument("--old-first", action="store_true", help="run the old tree first (order effects)")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="clip threshold for both trees (the old tree's bench may lack the flag: then its runner's "
                         "MAX_GRAD_NORM constant is rewritten in that scratch copy)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.max_grad_norm is not None and a.max_grad_norm < 0:
        ap.error(f"--max-grad-norm {a.max_grad_norm}: use 0 (no clipping) or a positive threshold")
    os.makedirs(a.out, exist_ok=True)
    res = {**schema.header(__file__),
           "regime": a.regime, "megatrain_config": {"torch_compile": True, **REGIMES[a.regime]},
           "max_grad_norm": a.max_grad_norm if a.max_grad_norm is not None else 1.0}
    order = [("new", a.new), ("old", a.old)]
    for name, tree in (order[::-1] if a.old_first else order):
        res[name] = run_tree(os.path.abspath(tree), a.regime, a, f"/tmp/compare_{a.regime}_{name}")
        print(name, json.dumps(res[name]["rows"]), flush=True)
    res["new_over_old_tokens_per_s"] = {
        k: round(v["tokens_per_s"] / res["old"]["rows"][k]["tokens_per_s"], 3)
        for k, v in res["new"]["rows"].items()
        if v.get("tokens_per_s") and res["old"]["rows"].get(k, {}).get("tokens_per_s")}
    print("new / old tokens/s:", res["new_over_old_tokens_per_s"], flush=True)
    schema.write(os.path.join(a.out, f"compare_commits_{a.regime}.json"), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
