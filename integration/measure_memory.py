"""Measure the real memory of one hf_megatrain train step and compare it with the planner's prediction.

For each (model size, compute dtype) case a fresh process builds a random Llama of that size (from a config, no
Hub), converts it with ``MegaTrainEngine``, runs one forward + backward + optimizer step, and reports

- host: peak RSS growth over the process's RSS just before the model was built (``VmHWM`` after resetting it
  through ``/proc/self/clear_refs``, i.e. ``ru_maxrss`` restricted to this case), vs the planner's host total
  minus its baseline constant (the measured baseline replaces it);
- GPU (CUDA only): ``torch.cuda.max_memory_reserved`` + the context (``mem_get_info`` used before/after), vs the
  planner's device total.

    python integration/measure_memory.py                      # CPU: 10M, 50M, 150M params, fp32 + bf16
    python integration/measure_memory.py --device cuda --sizes 1B,3B --seq-len 4096 --json out.json

Cases run in forked children on the CPU (imports paid once) and in fresh interpreters on CUDA (no fork after
CUDA init). Used by tests/test_planner.py (CPU) and by the lead on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# name -> (hidden, intermediate, layers, heads, kv heads, vocab); ~params in the name.
SIZES = {
    "10M": (256, 688, 4, 4, 2, 16384),
    "50M": (512, 1376, 8, 8, 4, 16384),
    "150M": (1024, 2752, 8, 16, 8, 32000),
    "1B": (2048, 5504, 16, 16, 8, 32000),
    "3B": (3072, 8192, 26, 24, 8, 32000),
    "8B": (4096, 14336, 32, 32, 8, 128256),
}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak-RSS high-water mark (Linux >= 4.0)
        f.write("5")


def run_case(size: str, dtype: str, device: str, seq_len: int, batch_size: int, extra: dict) -> dict:
    import ctypes
    import gc

    import torch
    import transformers

    from hf_megatrain import MegaTrainConfig, MegaTrainEngine
    from hf_megatrain import planner

    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 16)))
    H, inter, L, nh, nkv, V = SIZES[size]
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=inter, num_hidden_layers=L,
                                   num_attention_heads=nh, num_key_value_heads=nkv, vocab_size=V,
                                   max_position_embeddings=max(seq_len, 128), attn_implementation="sdpa")
    config = MegaTrainConfig(compute_dtype=dtype, **extra)
    cuda = device == "cuda"
    imported = _status_kib("VmRSS")
    # Warm-up: one step of a tiny model pays the one-time costs (lazy modeling imports, thread pools, kernel
    # caches, autograd engine) that belong to the baseline, not to the store and buffers being measured.
    tiny = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa")
    warm = MegaTrainEngine(transformers.LlamaForCausalLM(tiny), config, device=device)
    warm_opt = warm.create_optimizer(lr=1e-4, max_grad_norm=1.0)
    ids = torch.randint(0, 64, (batch_size, seq_len))
    warm(input_ids=ids, labels=ids).loss.backward()
    warm_opt.step()
    warm_opt.wait()
    del warm, warm_opt, ids
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free0, total = torch.cuda.mem_get_info()
    _reset_peak()
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)  # fp32 on the host, as a user's from_pretrained would give
    n_params = sum(p.numel() for p in model.parameters())
    engine = MegaTrainEngine(model, config, device=device)
    opt = engine.create_optimizer(lr=1e-4, max_grad_norm=1.0)
    ids = torch.randint(0, V, (batch_size, seq_len))
    out = engine(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.wait()
    if cuda:
        torch.cuda.synchronize()
    peak = _status_kib("VmHWM") - base
    shape = planner.ModelShape.from_engine(engine)
    gpu_free = free0 + planner.CUDA_CONTEXT_GPU_BYTES if cuda else None
    plan = planner.estimate(shape, config, seq_len, batch_size, device_type=device, gpu_free=gpu_free,
                            source_bytes=4 * n_params, plans=engine.plans)
    res = {"size": size, "dtype": dtype, "device": device, "params": n_params, "seq_len": seq_len,
           "batch_size": batch_size, "seconds": round(time.perf_counter() - t0, 2),
           "rss_after_imports": imported, "baseline_rss": base,
           "host_measured": peak,
           "host_predicted": plan.host_total - plan.host["baseline (python, torch, transformers)"],
           "store_nbytes": engine.store.nbytes, "loss": float(out.loss.detach())}
    if cuda:
        free1, _ = torch.cuda.mem_get_info()
        res["gpu_max_allocated"] = torch.cuda.max_memory_allocated()
        res["gpu_max_reserved"] = torch.cuda.max_memory_reserved()
        # context = what the device uses beyond the allocator's reservation, measured at the end
        res["gpu_context"] = (total - free1) - torch.cuda.memory_reserved()
        res["gpu_measured"] = res["gpu_max_reserved"] + res["gpu_context"]
        res["gpu_predicted"] = plan.device_total
        res["gpu_plan"] = plan.device
    res["host_ratio"] = round(res["host_predicted"] / max(res["host_measured"], 1), 3)
    return res


def _forked(fn, *args) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: measure, send the result, exit without running the parent's cleanup
        os.close(r)
        try:
            data = json.dumps(fn(*args)).encode()
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            data = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data or b'{"error": "child died"}')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default="10M,50M,150M")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--config", default="{}", help="extra MegaTrainConfig keys as JSON")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case, print its JSON
    a = p.parse_args(argv)
    extra = json.loads(a.config)
    if a.case:
        size, dtype = a.case.split(":")
        print("RESULT " + json.dumps(run_case(size, dtype, a.device, a.seq_len, a.batch_size, extra)))
        return 0
    from bench import record as schema

    head = schema.header(__file__, argv)  # (before any case: the date is the run's start)
    if a.device == "cpu":
        import torch  # noqa: F401  - imported once, before forking
        import transformers  # noqa: F401

        import hf_megatrain.engine  # noqa: F401
        import hf_megatrain.planner  # noqa: F401
    results = []
    for size in a.sizes.split(","):
        for dtype in a.dtypes.split(","):
            if a.device == "cpu":
                res = _forked(run_case, size, dtype, a.device, a.seq_len, a.batch_size, extra)
            else:
                cmd = [sys.executable, __file__, "--device", a.device, "--seq-len", str(a.seq_len), "--batch-size",
                       str(a.batch_size), "--config", a.config, "--case", f"{size}:{dtype}"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                res = json.loads(lines[-1][7:]) if lines else {"size": size, "dtype": dtype,
                                                                "error": proc.stderr[-2000:]}
            results.append(res)
            gib = 1024 ** 3
            if "error" in res:
                print(f"{size:>5} {dtype:<9} ERROR {res['error']}", flush=True)
                continue
            line = (f"{size:>5} {dtype:<9} {res['params'] / 1e6:8.1f}M  host measured {res['host_measured'] / gib:7.3f}"
                    f" GiB  predicted {res['host_predicted'] / gib:7.3f} GiB  ratio {res['host_ratio']:.3f}")
            if "gpu_measured" in res:
                line += (f"  | GPU measured {res['gpu_measured'] / gib:7.2f} GiB  predicted "
                         f"{res['gpu_predicted'] / gib:7.2f} GiB")
            print(line + f"  ({res['seconds']} s)", flush=True)
    if a.json:
        schema.write(a.json, {**head, "results": results})
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
