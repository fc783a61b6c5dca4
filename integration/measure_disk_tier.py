"""Disk tier cost: one CPU AdamW step with the moments in host RAM vs memory-mapped files (optimizer_state_dir).

    python integration/measure_disk_tier.py [--params-m 150] [--dir /path/on/nvme] [--out results.json]

Times the optimizer step alone (overlap off) on a Llama-shaped store, steady state (after a first step that
faults the pages in). While the moments fit in the page cache this measures the mmap overhead; beyond RAM the
step streams 16 bytes per parameter (read + write of m and v) through the disk, which the script also reports
as a bound from a measured sequential write/read of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_megatrain import MegaTrainConfig, MegaTrainEngine  # noqa: E402


def build(params_m: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 1024
    layers = max(1, int(params_m * 1e6 / (12 * hidden * hidden)))
    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16)
    return LlamaForCausalLM(cfg)


def time_steps(state_dir: str | None, params_m: int, steps: int) -> dict:
    engine = MegaTrainEngine(build(params_m), MegaTrainConfig(compute_dtype="float32", overlap_optimizer=False,
                                                              optimizer_state_dir=state_dir), device="cpu")
    opt = engine.create_optimizer(lr=1e-4, max_grad_norm=1.0)
    for u in engine.store.units:  # a gradient everywhere, without paying for forward/backward
        u.grad.normal_()
    times = []
    for _ in range(steps + 1):
        for u in engine.store.units:  # tell the step state those gradients are this step's
            engine.state.accumulate(u.index)
            engine.state.landed(u.index)
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return {"params": engine.store.numel, "first_step_s": times[0], "median_step_s": statistics.median(times[1:])}


def disk_bandwidth(directory: str, nbytes: int) -> dict:
    buf = os.urandom(1 << 24)
    path = os.path.join(directory, "megatrain-bw.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(buf))):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t)
    os.unlink(path)
    return {"seq_write_GBps_fsync": write / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=int, default=150)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    ram = time_steps(None, a.params_m, a.steps)
    disk = time_steps(a.dir, a.params_m, a.steps)
    bw = disk_bandwidth(a.dir, 8 * ram["params"])
    bound = 16 * ram["params"] / (bw["seq_write_GBps_fsync"] * 1e9)
    res = {"command": "python " + " ".join(sys.argv), "threads": torch.get_num_threads(), "ram": ram, "disk": disk,
           "slowdown_in_page_cache": disk["median_step_s"] / ram["median_step_s"], "disk": disk, **bw,
           "beyond_ram_bound_s_per_step": bound, "beyond_ram_bound_s_per_Gparam": bound / ram["params"] * 1e9,
           "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
