"""Long-context training on one GPU: the Qwen2.5-7B shape at 524,288 tokens (issue 18), and the longest sequence
that trains on this GPU (``--max-seq-search``).

Model: Qwen2.5-7B shape (hidden 3584, MLP 18944, 28 layers, 28 / 4 heads, vocab 152064, untied), random init; the
skeleton is built on ``meta``, the resident parameters are drawn on the GPU and every layer's values go from the GPU
straight into the engine's FP32 masters (as integration/scale_123b.py: no 30 GB model materialised on the host).
Batch 1, bf16 compute, FP32 master + AdamW on the host; the position-wise modules run in sequence chunks
(``seq_chunk_tokens=-1``: the planner's chunk), the layer inputs the GPU cannot keep go to pinned host memory
(``activation_offload=auto``), and ``lean_store`` is used when the full store would not fit host RAM (the planner
decides). No gradient clipping by default: with random init every step would clip, and a lean step that clips runs
its forward+backward twice.

Each run is a subprocess (an out-of-memory ends the run, not the script); the JSON is rewritten after every run:
per-layer forward / backward times (CUDA events), step time, loss, peak GPU and host memory next to the planner's
prediction, FLOPs with attention counted. Progress lines are flushed; meant to run in the background:

    setsid nohup python integration/long_context.py --out $DIR > $DIR/long_context.log 2>&1 &   # H200, 512k
    setsid nohup python integration/long_context.py --max-seq-search --out $DIR > $DIR/search.log 2>&1 &  # H100
    python integration/long_context.py --tiny --seq 256 --out /tmp/lc                # CPU smoke (seconds)
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402

from bench import record as schema  # noqa: E402
from bench.common import GIB, PEAK_TFLOPS, _vm_hwm_bytes, runner_main  # noqa: E402
from bench.record import gpu_slug  # noqa: E402
from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner  # noqa: E402
from hf_megatrain.core.memory import available_host_bytes, gpu_budget  # noqa: E402
from scale_123b import HostSampler, LayerTimer, child_env, random_engine  # noqa: E402
from scale_123b import spawn as run_isolated  # noqa: E402

WIDTH = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
             vocab_size=152064)
TINY_WIDTH = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
FULL_LAYERS, DEFAULT_SEQ = 28, 524288
LR = 1e-5


# -- model and plan -------------------------------------------------------------------------------------------------
def model_config(spec: dict) -> Any:
    from transformers import Qwen2Config

    width = TINY_WIDTH if spec.get("tiny") else WIDTH
    return Qwen2Config(**width, num_hidden_layers=int(spec["layers"]), tie_word_embeddings=False,
                       max_position_embeddings=max(32768, int(spec["seq"])), rope_theta=1e6,
                       attn_implementation="sdpa", use_cache=False)


def skeleton(spec: dict) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import Qwen2ForCausalLM

    with init_empty_weights(include_buffers=False):  # parameters on meta, the rotary table real
        return Qwen2ForCausalLM(model_config(spec))


def model_shape(spec: dict) -> planner.ModelShape:
    with torch.device("meta"):
        from transformers import Qwen2ForCausalLM

        return planner.ModelShape.from_model(Qwen2ForCausalLM(model_config(spec)))


def run_config(spec: dict) -> MegaTrainConfig:
    return MegaTrainConfig.from_dict({"compute_dtype": "bfloat16", "seq_chunk_tokens": -1, "activation_offload": "auto",
                                     "loss_chunk_tokens": 2048, "host_memory_fraction": spec["host_fraction"],
                                     "lean_store": bool(spec.get("lean")), **(spec.get("megatrain_config") or {})})


def plan_for(spec: dict, device_type: str, gpu_free: int | None, offloaded: int | None = None) -> planner.MemoryPlan:
    return planner.estimate(model_shape(spec), run_config(spec), int(spec["seq"]), 1, device_type=device_type,
                            gpu_free=gpu_free, offloaded_layers=offloaded)


def choose_lean(spec: dict, device_type: str, gpu_free: int | None, host_avail: int) -> bool:
    """lean_store when the full store (18 B/param) would not fit the host next to the offloaded activations."""
    if "lean_store" in (spec.get("megatrain_config") or {}):
        return bool(spec["megatrain_config"]["lean_store"])
    full = plan_for({**spec, "lean": False}, device_type, gpu_free)
    return full.host_total > spec["host_fraction"] * host_avail


def fits(plan: planner.MemoryPlan, spec: dict, gpu_free: int | None, host_avail: int) -> bool:
    return (plan.host_total <= spec["host_fraction"] * host_avail
            and (gpu_free is None or plan.device_total <= gpu_free))


def plan_record(plan: planner.MemoryPlan) -> dict[str, Any]:
    gib = lambda d: {k: round(v / GIB, 3) for k, v in d.items() if v}  # noqa: E731
    return {"host_need_gib": plan.host_total / GIB, "gpu_need_gib": plan.device_total / GIB, "host_gib": gib(plan.host),
            "gpu_gib": gib(plan.device), "gpu_peak_phase": plan.peak_phase,
            "gpu_phases_gib": {k: gib(v) for k, v in plan.phases.items()},
            "offloaded_layers": plan.offloaded_layers, "seq_chunk_tokens": plan.seq_chunk_tokens, "notes": plan.notes}


# -- one run (child process) ------------------------------------------------------------------------------------------
def build_engine(spec: dict, config: MegaTrainConfig, dev: torch.device) -> tuple[MegaTrainEngine, dict]:
    return random_engine(lambda: skeleton(spec), config, dev, int(spec.get("seed", 0)), device=dev,
                         resident_dtype=torch.float32)


def run_one(spec: dict) -> dict[str, Any]:
    sampler = HostSampler()
    sampler.start()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    gpu_free = gpu_budget(dev)
    config, seq, layers = run_config(spec), int(spec["seq"]), int(spec["layers"])
    print(f"[run seq={seq}] building {layers} layers, lean_store={config.lean_store}", flush=True)
    engine, times = build_engine(spec, config, dev)
    n_params = engine.num_parameters()
    print(f"[run seq={seq}] {n_params / 1e9:.3f}B params, setup {times}", flush=True)
    setup: dict[str, Any] = {"setup_vm_hwm_gib": (_vm_hwm_bytes() or 0) / GIB}
    if cuda:
        setup["setup_peak_gpu_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
    timer = LayerTimer(engine.executor, layers, cuda)
    opt = engine.create_optimizer(lr=LR, weight_decay=0.0, max_grad_norm=spec.get("max_grad_norm") or None)
    vocab = (TINY_WIDTH if spec.get("tiny") else WIDTH)["vocab_size"]
    gen = torch.Generator().manual_seed(1000)
    steps = []
    for i in range(int(spec["steps"])):
        ids = torch.randint(0, vocab, (1, seq), generator=gen)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids, num_items_in_batch=seq - 1).loss  # no mask: SDPA's causal path
        if cuda:
            torch.cuda.synchronize()
        t_fwd = time.perf_counter() - t0
        print(f"[run seq={seq}] step {i}: forward {t_fwd:.1f}s, loss {float(loss.detach()):.4f}", flush=True)
        loss.backward()
        opt.step()
        opt.wait()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        period = time.perf_counter() - t0
        visits = timer.collect()
        steps.append({"step_s": period, "forward_s": t_fwd, "loss": float(loss.detach()),
                      "grad_norm": opt.last_grad_norm, "layer_forward_s": visits["forward"],
                      "layer_backward_s": visits["backward"]})
        print(f"[run seq={seq}] step {i}: {period:.1f}s, loss {steps[-1]['loss']:.4f}, per layer fwd "
              f"{sum(visits['forward']) / layers:.2f}s bwd {sum(visits['backward']) / layers:.2f}s", flush=True)
    acts = engine.executor.activations
    offloaded = len(acts.offload)
    plan = planner.estimate(planner.ModelShape.from_engine(engine), config, seq, 1, device_type=dev.type,
                            gpu_free=gpu_free, plans=engine.plans, offloaded_layers=offloaded)
    last = steps[-1]
    flops = plan.flops_per_token
    tokens_per_s = seq / last["step_s"]
    peak = float(spec.get("peak_tflops") or PEAK_TFLOPS)
    out = {"seq": seq, "layers": layers, "n_params": n_params, "setup": times, **setup, "steps": steps,
           "step_time_s": last["step_s"], "loss": last["loss"], "loss_finite": all(math.isfinite(s["loss"])
                                                                                   for s in steps),
           "per_layer_forward_s": sum(last["layer_forward_s"]) / layers,
           "per_layer_backward_s": sum(last["layer_backward_s"]) / layers,
           "tokens_per_s": tokens_per_s, "flops_per_token": flops,
           "model_tflops_with_attention": flops["model"] * tokens_per_s / 1e12,
           "model_tflops_6n": flops["dense_6n"] * tokens_per_s / 1e12,
           "hardware_tflops_causal_with_recompute": flops["hardware_with_recompute_causal"] * tokens_per_s / 1e12,
           "mfu_with_attention": flops["model"] * tokens_per_s / 1e12 / peak, "peak_tflops": peak,
           "offloaded_layers": offloaded, "activation_d2h_gb": acts.d2h_bytes / 1e9,
           "activation_h2d_gb": acts.h2d_bytes / 1e9, "activation_pinned_gib": acts.host_bytes / GIB,
           "seq_chunk_tokens": plan.seq_chunk_tokens, "tiled": engine.executor.templates[0].tiling.tiled,
           "lean_store": config.lean_store, "gpu_budget_gib": (gpu_free or 0) / GIB,
           "planner": plan_record(plan), "megatrain_config": config.to_dict(), **sampler.record()}
    if cuda:
        out.update(peak_gpu_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                   peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
        out["gpu_peak_over_planner"] = out["peak_gpu_reserved_gib"] / (plan.device_total / GIB)
    hwm = _vm_hwm_bytes()
    out["vm_hwm_gib"] = hwm / GIB if hwm else None
    out["host_hwm_over_planner"] = out["vm_hwm_gib"] / (plan.host_total / GIB) if hwm else None
    return out


# -- parent: runs in subprocesses, the search, the JSON -------------------------------------------------------------
def spawn(spec: dict, timeout: float, log_path: str, env: dict[str, str]) -> dict[str, Any]:
    record = run_isolated(spec, timeout, log_path, env, script=__file__)
    record["seq"] = spec["seq"]
    return record


def trains(rec: dict) -> bool:
    return rec.get("status") == "ok" and bool(rec.get("loss_finite"))


def next_search(tried: dict[int, bool], step: int, cap: int) -> int | None:
    """Next sequence length to try: double up from the longest that trained / halve down from the shortest that
    failed until both are known, then bisect between them in multiples of ``step``."""
    ok = max((s for s, good in tried.items() if good), default=None)
    bad = min((s for s, good in tried.items() if not good), default=None)
    if bad is None:
        nxt = min(ok * 2, cap) if ok is not None else None
        return None if nxt is None or nxt in tried else nxt
    if ok is None:
        nxt = max(step, (bad // 2) // step * step)
        return None if nxt in tried else nxt
    mid = (ok + bad) // 2 // step * step
    return None if mid <= ok or mid >= bad else mid


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default {DEFAULT_SEQ}; tiny 256)")
    ap.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {FULL_LAYERS}; tiny 3)")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps per run")
    ap.add_argument("--tiny", action="store_true", help="tiny width (CPU smoke of the same code)")
    ap.add_argument("--max-seq-search", action="store_true", help="find the longest sequence that trains here")
    ap.add_argument("--search-step", type=int, default=32768, help="granularity of the search (tokens)")
    ap.add_argument("--search-max", type=int, default=1048576, help="longest sequence the search tries")
    ap.add_argument("--search-start", type=int, default=None, help="first length (default: the planner's longest)")
    ap.add_argument("--host-fraction", type=float, default=0.97, help="engine host_memory_fraction")
    ap.add_argument("--megatrain-config", default=None, help="JSON dict of MegaTrainConfig overrides")
    ap.add_argument("--max-grad-norm", type=float, default=0.0, help="clipping (0: off; see the docstring)")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="dense bf16 peak for the MFU")
    ap.add_argument("--timeout", type=float, default=5400, help="seconds per run (subprocess)")
    ap.add_argument("--alloc-conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF for runs")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "long_context"))
    ap.add_argument("--dry-run", action="store_true", help="print the planner's prediction and exit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    info = schema.machine()
    device_type = "cuda" if info.get("gpu") else "cpu"
    if device_type == "cpu" and not a.tiny:
        raise SystemExit("[long] no GPU found (nvidia-smi); use --tiny on a CPU")
    gpu_free = int((info["gpu_free_gib"] + 0.75) * GIB) if info.get("gpu") else None  # (+ the CUDA context)
    host_avail = available_host_bytes()
    spec: dict[str, Any] = {"tiny": a.tiny, "seq": a.seq or (256 if a.tiny else DEFAULT_SEQ),
                            "layers": a.layers or (3 if a.tiny else FULL_LAYERS), "steps": a.steps,
                            "host_fraction": a.host_fraction, "max_grad_norm": a.max_grad_norm,
                            "peak_tflops": a.peak_tflops, "seed": 0,
                            "megatrain_config": json.loads(a.megatrain_config) if a.megatrain_config else {}}
    spec["lean"] = choose_lean(spec, device_type, gpu_free, host_avail)
    _, slug = gpu_slug(a.tiny)
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    name = "long_context_search" if a.max_seq_search else "long_context"
    path = os.path.join(a.out, f"{name}_{slug}.json")
    shape = model_shape(spec)
    doc: dict[str, Any] = {**schema.header(__file__, argv, host=info), "spec": spec,
                           "width": TINY_WIDTH if a.tiny else WIDTH, "n_params": shape.trainable,
                           "planner": plan_record(plan_for(spec, device_type, gpu_free)), "runs": []}
    pred = doc["planner"]
    print(f"[long] {info.get('gpu') or 'cpu'}, {host_avail / GIB:.1f} GiB host available; {spec['layers']} layers, "
          f"seq {spec['seq']}, lean_store={spec['lean']}: planner GPU {pred['gpu_need_gib']:.1f} GiB, host "
          f"{pred['host_need_gib']:.1f} GiB, {pred['offloaded_layers']} layers' inputs offloaded, chunk "
          f"{pred['seq_chunk_tokens']} -> {path}", flush=True)
    if a.dry_run:
        print(json.dumps(pred, indent=1))
        return 0
    env = child_env(a.alloc_conf)

    def write() -> None:
        doc["wall_s"] = time.perf_counter() - T_START
        schema.write(path, doc)

    def run(seq: int) -> dict:
        s = {**spec, "seq": seq}
        s["lean"] = choose_lean(s, device_type, gpu_free, host_avail)
        pred = plan_for(s, device_type, gpu_free)
        print(f"[long] run seq={seq}: planner GPU {pred.device_total / GIB:.1f} GiB, host {pred.host_total / GIB:.1f} "
              f"GiB, fits: {fits(pred, s, gpu_free, host_avail)}", flush=True)
        rec = spawn(s, a.timeout, os.path.join(a.out, "logs", f"{name}_{seq}.log"), env)
        rec["planner_fits"] = fits(pred, s, gpu_free, host_avail)
        doc["runs"].append(rec)
        ok = rec.get("status") == "ok"
        msg = (f"step {rec['step_time_s']:.1f}s, loss {rec['loss']:.4f}, GPU peak {rec.get('peak_gpu_reserved_gib')} "
               f"GiB (planner {rec['planner']['gpu_need_gib']:.1f}), host HWM {rec.get('vm_hwm_gib')} GiB (planner "
               f"{rec['planner']['host_need_gib']:.1f})") if ok else (rec.get("error") or "")[:600]
        print(f"[long]   -> {rec.get('status')} in {rec['subprocess_wall_s']:.0f}s: {msg}", flush=True)
        write()
        return rec

    write()
    if not a.max_seq_search:
        run(spec["seq"])
    else:
        step = a.search_step
        start = a.search_start
        if start is None:  # the planner's longest, in search steps
            start = step
            for k in range(1, a.search_max // step + 1):
                s = {**spec, "seq": k * step}
                s["lean"] = choose_lean(s, device_type, gpu_free, host_avail)
                if fits(plan_for(s, device_type, gpu_free), s, gpu_free, host_avail):
                    start = k * step
        doc["search"] = {"step": step, "planner_longest": start, "tried": {}}
        tried: dict[int, bool] = {}
        seq: int | None = start
        while seq is not None:
            tried[seq] = trains(run(seq))
            doc["search"]["tried"] = {str(k): v for k, v in sorted(tried.items())}
            doc["search"]["longest_trained"] = max((s for s, ok in tried.items() if ok), default=None)
            write()
            seq = next_search(tried, step, a.search_max)
        print(f"[long] longest sequence that trained: {doc['search']['longest_trained']} (planner said {start})",
              flush=True)
    print(f"[long] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    if "--spec" in sys.argv:
        runner_main("long_context", run_one)
    sys.exit(main())
