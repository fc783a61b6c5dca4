"""A real 32B model at full precision on one GPU (issue 20): Qwen2.5-32B shape through ``MegaTrainTrainer``.

Model: Qwen2.5-32B shape (hidden 5120, MLP 27648, 64 layers, 40 / 8 heads, vocab 152064, untied: ~32.8B params),
random init: the skeleton is built on ``meta``, the resident parameters are drawn on the GPU and every layer's values
go from the GPU straight into the engine's FP32 masters (``scale_123b.random_engine``: no 65 GB model on the host).
Default store (FP32 master, gradient and AdamW moments on the host: 18 B/param for streamed layers), bf16 compute,
the planner's default placement (on an H200 it keeps 7 layers and the resident parts whole on the GPU: 18 B/param
for all 32.8B would be 549 GiB, more than a 512 GiB host has; the streamed regime, ``--megatrain-config`` with
``device_layers=0, device_step_layers=0``, fits the 560 GiB host only), batch 8 x 2048 tokens per optimizer step,
``--warmup`` + ``--steps`` steps of a plain ``transformers`` training loop (``MegaTrainTrainer`` on a random-token
``torch`` Dataset), then ``trainer.save_model()`` to a sharded safetensors checkpoint (timed) and, in a fresh process
once the trainer's host memory is gone, a reload with plain ``AutoModelForCausalLM.from_pretrained(dir)`` on the CPU
whose every tensor must hash equal to the trained FP32 master (hashed in the trainer after the save).

Each phase is a subprocess (an out-of-memory ends the phase, not the script); the JSON (+ md) is rewritten after each:
tokens/s, model TFLOP/s (6·N·tokens/s), MFU, peak host RSS against the planner's prediction, peak GPU memory, save
time, reload verdict. Progress lines are flushed; meant for the background:

    mkdir -p /tmp/f32 && CUDA_VISIBLE_DEVICES=0 setsid nohup python integration/full_32b.py --out /tmp/f32 \
        > /tmp/f32/run.log 2>&1 < /dev/null &                        # >= 512 GiB host, one H200 (~15-20 min)
    python integration/full_32b.py --layers auto --out /tmp/f32      # 128 GiB host: the deepest that fits (17)
    python integration/full_32b.py --dry-run --machines               # planner prediction for the lent machines
    python integration/full_32b.py --tiny --out /tmp/f32              # CPU smoke of the same code (seconds)

``full_32b_hub.py --hub-checkpoint DIR`` runs the user's path instead (phases in hub_32b.py): a Hub-layout bf16
checkpoint written to DIR, ``from_pretrained_streamed``, ``MegaTrainTrainer`` on packed fine-tune rows (1 GPU or
``--nproc N``), ``save_model`` and a plain-transformers reload whose logits must match. The device plan for the
4 x H100, 512 GiB host (commands, predicted times): integration/results/full_32b/NEXT.md.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any, Callable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402

from bench import record as schema  # noqa: E402
from bench.common import (GIB, PEAK_TFLOPS, REGIMES, StepClock, TokenDataset, _vm_hwm_bytes, runner_main,  # noqa: E402
                          throughput, token_rows)
from bench.child import log_tail  # noqa: E402
from bench.record import gpu_slug  # noqa: E402
from hf_megatrain import MegaTrainConfig, planner  # noqa: E402
from hf_megatrain.core.memory import available_host_bytes  # noqa: E402
from long_context import plan_record  # noqa: E402
from scale_123b import HostSampler, child_env, engine_plan, random_engine, spawn  # noqa: E402

# Qwen2.5-32B's config.json (shape only; the values are random).
WIDTH = dict(hidden_size=5120, intermediate_size=27648, num_attention_heads=40, num_key_value_heads=8,
             vocab_size=152064, rope_theta=1e6)
# vocab 512 = bench.common's tiny vocabulary, so token_rows draws the same range.
TINY_WIDTH = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
FULL_LAYERS = 64
LR = 1e-5
# Lent machines for --dry-run: name -> (host RAM available GiB, GPU memory free GiB). The H100 box's are measured
# (results/scale_123b/2026-11-23_5b0a4a8_scale_123b_h100_80gb_hbm3.json: 124.9 / 79.2); the H200 hosts' assume the same ~97.5% of nominal RAM
# available and the H100's 0.5 GiB of GPU in use at start.
MACHINES = {"h200-x4 (512 GiB host)": (499.0, 139.9), "h200-x8 (560 GiB host)": (546.0, 139.9),
            "h100-x1 (128 GiB host)": (124.9, 79.2)}


# -- model and plan ---------------------------------------------------------------------------------------------------
def model_config(spec: dict) -> Any:
    from transformers import Qwen2Config

    width = TINY_WIDTH if spec.get("tiny") else WIDTH
    return Qwen2Config(**width, num_hidden_layers=int(spec["layers"]), tie_word_embeddings=False,
                       max_position_embeddings=max(32768, int(spec["seq"])), attn_implementation="sdpa",
                       use_cache=False)


def skeleton(spec: dict) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import Qwen2ForCausalLM

    with init_empty_weights(include_buffers=False):  # parameters on meta, the rotary table real
        return Qwen2ForCausalLM(model_config(spec))


def model_shape(spec: dict) -> planner.ModelShape:
    return planner.ModelShape.from_model(skeleton(spec))


def config_dict(spec: dict) -> dict[str, Any]:
    # compute_dtype explicit (not bf16=True): the same on a CPU smoke, where Trainer's bf16 flag means autocast.
    return {"compute_dtype": "bfloat16", "micro_batch_size": int(spec["micro_batch"]),
            "host_memory_fraction": spec["host_fraction"], **(spec.get("megatrain_config") or {})}


def run_config(spec: dict) -> MegaTrainConfig:
    return MegaTrainConfig.from_dict(config_dict(spec))


def plan_for(spec: dict, device_type: str, gpu_free: int | None) -> planner.MemoryPlan:
    return planner.estimate(model_shape(spec), run_config(spec), int(spec["seq"]), int(spec["batch"]),
                            device_type=device_type, gpu_free=gpu_free)


def fits(plan: planner.MemoryPlan, spec: dict, host_avail: int, gpu_free: int | None, margin: int) -> dict[str, bool]:
    """Host: the planner's peak + ``margin`` within what is available, and within the engine's own refusal threshold
    (``host_memory_fraction``); GPU: the planner's step peak within the free memory."""
    host = plan.host_total + margin <= host_avail and plan.host_total <= spec["host_fraction"] * host_avail
    return {"host": host, "gpu": gpu_free is None or plan.device_total <= gpu_free}


def deepest(spec: dict, host_avail: int, gpu_free: int | None, device_type: str, margin: int,
            cap: int = FULL_LAYERS) -> int:
    """Most layers (same width) whose plan fits this host and GPU; 0 when not even one does."""
    best = 0
    for layers in range(1, cap + 1):
        verdict = fits(plan_for({**spec, "layers": layers}, device_type, gpu_free), spec, host_avail, gpu_free, margin)
        if not all(verdict.values()):
            break
        best = layers
    return best


def prediction_row(spec: dict, host_avail: int, gpu_free: int | None, device_type: str, margin: int) -> dict:
    plan = plan_for(spec, device_type, gpu_free)
    n = model_shape(spec).trainable
    verdict = fits(plan, spec, host_avail, gpu_free, margin)
    return {"layers": int(spec["layers"]), "n_params": n, "host_available_gib": host_avail / GIB,
            "gpu_free_gib": None if gpu_free is None else gpu_free / GIB,
            "host_bytes": {k: v for k, v in plan.host.items() if v}, "host_total_bytes": plan.host_total,
            "store_bytes_per_param": plan.store_host_bytes / n, "host_bytes_per_param": plan.host_total / n,
            "fits_host": verdict["host"], "fits_gpu": verdict["gpu"], "verdict": "fits" if all(verdict.values())
            else "does not fit: " + " and ".join(k for k, ok in verdict.items() if not ok),
            "planner": plan_record(plan)}


# -- phase 1 (child): build, train, save, hash ----------------------------------------------------------------------
def tensor_digest(t: torch.Tensor) -> str:
    """blake2b of the tensor's bytes: equal digests <=> bit-identical values (same dtype and shape)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy(), digest_size=16)  # (hashlib releases the GIL)
    return f"{t.dtype}:{tuple(t.shape)}:{h.hexdigest()}"


def digests(names: list[str], get: Callable[[str], torch.Tensor]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda n: tensor_digest(get(n)), names)))


class StepLog:
    """TrainerCallback: device-synchronised step ends (``StepClock``), the logged loss, a flushed progress line."""

    def __init__(self, layers: int) -> None:
        from transformers import TrainerCallback

        log = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                log.clock.mark()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                log.clock.mark()
                print(f"[train L={layers}] step {state.global_step}: {log.clock.periods[-1]:.2f}s", flush=True)

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
                if logs and "loss" in logs:
                    log.losses.append(float(logs["loss"]))
                    log.grad_norms.append(logs.get("grad_norm"))
                    print(f"[train L={layers}] step {state.global_step}: loss {logs['loss']:.4f} grad_norm "
                          f"{logs.get('grad_norm')}", flush=True)

        self.clock, self.losses, self.grad_norms = StepClock(), [], []
        self.callback = _Callback()


def run_train(spec: dict) -> dict[str, Any]:
    from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments

    sampler = HostSampler()
    sampler.start()
    cuda = torch.cuda.is_available()
    layers, batch = int(spec["layers"]), int(spec["batch"])
    total = int(spec["warmup"]) + int(spec["steps"])
    args = MegaTrainTrainingArguments(
        output_dir=os.path.join(spec["out"], "logs", "trainer"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, max_steps=total, learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=float(spec["max_grad_norm"]), logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=int(spec["seed"]), use_cpu=not cuda,
        megatrain_config=config_dict(spec))
    config = args.megatrain_resolved_config()
    print(f"[train L={layers}] building the engine on {args.device}", flush=True)
    engine, times = random_engine(lambda: skeleton(spec), config, args.device, int(spec["seed"]), device=args.device)
    n_params = engine.num_parameters()
    plan = engine_plan(engine, spec)  # the planner on what this engine placed
    setup: dict[str, Any] = {"setup_vm_hwm_gib": (_vm_hwm_bytes() or 0) / GIB,
                             "device_layers": len(engine.plans.kept),
                             "device_step_layers": len(engine.plans.device_stepped),
                             "resident_on_device": engine.plans.resident_on_device}
    print(f"[train L={layers}] {n_params / 1e9:.3f}B params, setup {times}, {setup}; planner host "
          f"{plan.host_total / GIB:.1f} GiB, GPU {plan.device_total / GIB:.1f} GiB", flush=True)
    if cuda:
        setup["setup_peak_gpu_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
    log = StepLog(layers)
    trainer = MegaTrainTrainer(model=engine, args=args, train_dataset=TokenDataset(token_rows(spec, total)),
                               callbacks=[log.callback])
    t = time.perf_counter()
    metrics = trainer.train().metrics
    train_s = time.perf_counter() - t
    periods = log.clock.periods
    out = throughput(spec, n_params, periods)
    out.update(n_params=n_params, layers=layers, setup=times, **setup, train_wall_s=train_s, trainer_metrics=metrics,
               losses=log.losses, grad_norms=log.grad_norms, loss_finite=all(map(math.isfinite, log.losses)),
               per_layer_s=out["step_time_s"] / layers, planner=plan_record(plan),
               planner_host_bytes_per_param=plan.host_total / n_params, megatrain_config=config.to_dict(),
               h2d_gb=engine.executor.h2d_bytes / 1e9, d2h_gb=engine.executor.d2h_bytes / 1e9)
    hwm = _vm_hwm_bytes() or 0
    out["train_vm_hwm_gib"] = hwm / GIB  # (setup + training: the planner's host peak covers both)
    out["host_rss_over_planner"] = hwm / plan.host_total
    if cuda:
        out.update(train_peak_gpu_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                   train_peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
        out["gpu_peak_over_planner"] = out["train_peak_gpu_reserved_gib"] / (plan.device_total / GIB)
    print(f"[train L={layers}] {out['tokens_per_s']:,.0f} tokens/s, {out['model_tflops']:.1f} TFLOP/s, MFU "
          f"{out['mfu']:.1%}; host HWM {hwm / GIB:.1f} GiB vs planner {plan.host_total / GIB:.1f} GiB "
          f"({out['host_rss_over_planner']:.3f}); saving to {spec['save_dir']}", flush=True)
    t = time.perf_counter()
    trainer.save_model(spec["save_dir"])
    out["save_s"] = time.perf_counter() - t
    files = sorted(os.listdir(spec["save_dir"]))
    out["saved_files"] = files
    out["saved_gb"] = sum(os.path.getsize(os.path.join(spec["save_dir"], f)) for f in files) / 1e9
    out["saved_shards"] = sum(f.endswith(".safetensors") for f in files)
    print(f"[train L={layers}] saved {out['saved_gb']:.1f} GB in {out['saved_shards']} shards, {out['save_s']:.1f}s; "
          "hashing the masters", flush=True)
    t = time.perf_counter()
    store = engine.store
    ref = digests(store.names(), store.master_tensor)
    out["hash_s"] = time.perf_counter() - t
    with open(spec["digest_path"], "w") as f:
        json.dump(ref, f)
    out["master_tensors"] = len(ref)
    out["after_save_vm_hwm_gib"] = (_vm_hwm_bytes() or 0) / GIB
    out.update(sampler.record())
    return out


# -- phase 2 (child): plain from_pretrained on the CPU, every tensor against the master's hash ----------------------
def run_reload(spec: dict) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["save_dir"])  # plain: what a user of the checkpoint runs
    load_s = time.perf_counter() - t
    with open(spec["digest_path"]) as f:
        ref = json.load(f)
    state = model.state_dict()
    print(f"[reload] loaded {type(model).__name__} in {load_s:.1f}s ({len(state)} tensors, "
          f"{next(model.parameters()).dtype}); hashing", flush=True)
    t = time.perf_counter()
    got = digests([n for n in ref if n in state], lambda n: state[n])
    mismatched = sorted(n for n in got if got[n] != ref[n])
    missing = sorted(set(ref) - set(state))
    extra = sorted(n for n in set(state) - set(ref) if not n.endswith("rotary_emb.inv_freq"))
    ids = torch.arange(16).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = {"load_s": load_s, "hash_s": time.perf_counter() - t, "loaded_dtype": str(next(model.parameters()).dtype),
           "tensors_compared": len(got), "mismatched": mismatched[:20], "missing": missing[:20],
           "unexpected": extra[:20], "forward_finite": bool(torch.isfinite(logits).all()),
           "reload_vm_hwm_gib": (_vm_hwm_bytes() or 0) / GIB}
    out["verified"] = (not mismatched and not missing and not extra and len(got) == len(ref)
                       and out["forward_finite"])
    print(f"[reload] verified={out['verified']}: {len(got)} tensors equal the trained masters bit for bit"
          if out["verified"] else f"[reload] NOT verified: {out}", flush=True)
    return out


def run_phase(spec: dict) -> dict[str, Any]:
    return run_train(spec) if spec["phase"] == "train" else run_reload(spec)


# -- parent ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default=None, help=f"decoder layers: N or 'auto' (deepest that fits here); default "
                                                   f"{FULL_LAYERS} (tiny 2)")
    ap.add_argument("--tiny", action="store_true", help="tiny width, 2 layers, short sequence (CPU smoke)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; tiny 64)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per optimizer step (default 8; tiny 4)")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="megatrain micro_batch_size: sequences per in-layer chunk (default 0 = whole batch; tiny 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; tiny 1)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="Trainer's clipping (0: off)")
    ap.add_argument("--host-fraction", type=float, default=0.97, help="engine host_memory_fraction")
    ap.add_argument("--margin-gib", type=float, default=4.0, help="host RAM the plan must leave free to 'fit'")
    ap.add_argument("--megatrain-config", default=None, help="JSON dict of MegaTrainConfig overrides")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="dense bf16 peak for the MFU")
    ap.add_argument("--save-dir", default=None, help="checkpoint folder (default OUT/full_32b_checkpoint)")
    ap.add_argument("--keep-checkpoint", action="store_true", help="leave the checkpoint on disk afterwards")
    ap.add_argument("--force", action="store_true", help="run even when the planner says it does not fit")
    ap.add_argument("--timeout", type=float, default=5400, help="seconds per phase (subprocess)")
    ap.add_argument("--alloc-conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF for runs")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "full_32b"))
    ap.add_argument("--dry-run", action="store_true",
                    help="planner prediction only: for this machine, or with --machines for the lent kinds")
    ap.add_argument("--machines", action="store_true",
                    help=f"with --dry-run: predict for {', '.join(MACHINES)} (full depth and the deepest that "
                         "fits) and write OUT/full_32b_prediction.json + md")
    return ap.parse_args(argv)


def make_spec(a: argparse.Namespace) -> dict[str, Any]:
    tiny = a.tiny
    return {"tiny": tiny, "layers": FULL_LAYERS if not tiny else 2, "seq": a.seq or (64 if tiny else 2048),
            "batch": a.batch or (4 if tiny else 8),
            "micro_batch": a.micro_batch_size if a.micro_batch_size is not None else (2 if tiny else 0),
            "steps": a.steps or (2 if tiny else 10), "warmup": a.warmup if a.warmup is not None else (1 if tiny else 2),
            "max_grad_norm": a.max_grad_norm, "host_fraction": a.host_fraction, "peak_tflops": a.peak_tflops,
            "seed": 0, "megatrain_config": json.loads(a.megatrain_config) if a.megatrain_config else {}}


def predictions(spec: dict, margin: int) -> dict[str, Any]:
    """The lent kinds: the full depth on each, and the deepest at the same width where the full one does not fit."""
    rows = []
    for name, (host_gib, gpu_gib) in MACHINES.items():
        host, gpu = int(host_gib * GIB), int(gpu_gib * GIB)
        row = {"machine": name, "full": prediction_row(spec, host, gpu, "cuda", margin)}
        # The streamed regime (every layer streams, no layer state on the GPU): the host-heaviest placement.
        streamed = {**spec, "megatrain_config": {**REGIMES["streamed"], **spec["megatrain_config"]}}
        row["full_streamed"] = prediction_row(streamed, host, gpu, "cuda", margin)
        if row["full"]["verdict"] != "fits":
            depth = deepest(spec, host, gpu, "cuda", margin)
            row["deepest_layers"] = depth
            if depth:
                row["deepest"] = prediction_row({**spec, "layers": depth}, host, gpu, "cuda", margin)
        rows.append(row)
    return {"spec": spec, "margin_gib": margin / GIB, "machines": rows,
            "assumptions": "host RAM available / GPU memory free per machine: " + json.dumps(MACHINES)}


def prediction_md(doc: dict) -> str:
    s = doc["spec"]
    lines = [f"Planner prediction: Qwen2.5-32B shape, {s['batch']} x {s['seq']} tokens/step, micro_batch_size "
             f"{s['micro_batch']}, bf16 compute, default store (host_memory_fraction {s['host_fraction']}, "
             f"margin {doc['margin_gib']:.0f} GiB)", "",
             "| machine | layers | params | host need GiB | host avail GiB | B/param (store / all) | GPU need GiB | "
             "GPU peak phase | kept / GPU-stepped layers | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for m in doc["machines"]:
        for key in ("full", "full_streamed", "deepest"):
            r = m.get(key)
            if not r:
                continue
            p = r["planner"]
            kept = [k for k in p["gpu_gib"] if "kept on the GPU" in k or "GPU AdamW" in k]
            name = m["machine"] + (" (streamed regime)" if key == "full_streamed" else "")
            lines.append(f"| {name} | {r['layers']} | {r['n_params'] / 1e9:.2f}B | {p['host_need_gib']:.1f} | "
                         f"{r['host_available_gib']:.1f} | {r['store_bytes_per_param']:.2f} / "
                         f"{r['host_bytes_per_param']:.2f} | {p['gpu_need_gib']:.1f} | {p['gpu_peak_phase']} | "
                         f"{'; '.join(kept) or 'none'} | {r['verdict']} |")
    lines += ["", doc["assumptions"], "", "Per row: host GiB by component; GPU GiB of each step phase (on top of the "
              "fixed buffers: weight slots, resident state, kept layers, CUDA context, fragmentation)", ""]
    for m in doc["machines"]:
        for key in ("full", "full_streamed", "deepest"):
            r = m.get(key)
            if r:
                p = r["planner"]
                host = ", ".join(f"{k} {v:.1f}" for k, v in p["host_gib"].items())
                phases = ", ".join(f"{k} {sum(v.values()):.1f}" for k, v in p["gpu_phases_gib"].items())
                fixed = ", ".join(f"{k} {v:.1f}" for k, v in p["gpu_gib"].items())
                lines += [f"- {m['machine']}, {r['layers']} layers{', streamed' if key == 'full_streamed' else ''}: "
                          f"host: {host}", f"  - GPU fixed: {fixed}",
                          f"  - GPU phases: {phases}"]
    return "\n".join(lines) + "\n"


def summary(doc: dict) -> str:
    t, r = doc.get("train") or {}, doc.get("reload") or {}
    f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)  # noqa: E731
    return "\n".join([
        f"hf_megatrain, Qwen2.5-32B shape, {doc['spec']['layers']} layers ({f(t.get('n_params'), '{:,}')} params) on "
        f"{doc['machine'].get('gpu') or 'cpu'}: {doc['spec']['batch']} x {doc['spec']['seq']} tokens/step, "
        f"MegaTrainTrainer, bf16 compute, FP32 master + AdamW on the host", "",
        "| metric | value |", "|---|---:|",
        f"| train status | {t.get('status')} |",
        f"| step time (median of {doc['spec']['steps']}) s | {f(t.get('step_time_s'), '{:.2f}')} |",
        f"| per layer s | {f(t.get('per_layer_s'), '{:.3f}')} |",
        f"| tokens/s | {f(t.get('tokens_per_s'), '{:,.0f}')} |",
        f"| model TFLOP/s (6·N·tokens) | {f(t.get('model_tflops'), '{:.1f}')} |",
        f"| MFU (vs {doc['spec']['peak_tflops']:.0f}) | {f(t.get('mfu'), '{:.1%}')} |",
        f"| peak host RSS GiB (train) | {f(t.get('train_vm_hwm_gib'), '{:.1f}')} |",
        f"| planner host GiB | {f((t.get('planner') or {}).get('host_need_gib'), '{:.1f}')} |",
        f"| RSS / planner (accept 0.9-1.1) | {f(t.get('host_rss_over_planner'), '{:.3f}')} |",
        f"| peak GPU reserved / alloc GiB | {f(t.get('train_peak_gpu_reserved_gib'), '{:.1f}')} / "
        f"{f(t.get('train_peak_gpu_alloc_gib'), '{:.1f}')} |",
        f"| planner GPU GiB | {f((t.get('planner') or {}).get('gpu_need_gib'), '{:.1f}')} |",
        f"| kept / GPU-stepped layers | {t.get('device_layers')} / {t.get('device_step_layers')} |",
        f"| losses | {', '.join(f'{x:.3f}' for x in t.get('losses') or [])} |",
        f"| save s ({f(t.get('saved_gb'), '{:.1f}')} GB, {t.get('saved_shards')} shards) | "
        f"{f(t.get('save_s'), '{:.1f}')} |",
        f"| reload (from_pretrained, CPU) s | {f(r.get('load_s'), '{:.1f}')} |",
        f"| reload verified (every tensor == master) | {r.get('verified')} ({r.get('tensors_compared')} tensors) |",
        ""]) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    spec = make_spec(a)
    margin = int(a.margin_gib * GIB)
    run_config(spec)  # a bad --megatrain-config fails here
    os.makedirs(a.out, exist_ok=True)
    if a.dry_run and a.machines:
        doc = predictions(spec, margin)
        path = os.path.join(a.out, "full_32b_prediction.json")
        schema.write(path, doc, prediction_md(doc))
        print(prediction_md(doc), flush=True)
        return 0
    info = schema.machine()
    device_type = "cuda" if info.get("gpu") else "cpu"
    if device_type == "cpu" and not (a.tiny or a.dry_run):
        raise SystemExit("[full32b] no GPU found (nvidia-smi); use --tiny on a CPU, or --dry-run [--machines]")
    gpu_free = int(info["gpu_free_gib"] * GIB) if info.get("gpu") else None
    host_avail = available_host_bytes()
    if a.layers == "auto":
        spec["layers"] = deepest(spec, host_avail, gpu_free, device_type, margin)
        if not spec["layers"]:
            raise SystemExit("[full32b] not even one layer fits this host")
    elif a.layers:
        spec["layers"] = int(a.layers)
    pred = prediction_row(spec, host_avail, gpu_free, device_type, margin)
    print(f"[full32b] {info.get('gpu') or 'cpu'}, {host_avail / GIB:.1f} GiB host available; {spec['layers']} layers "
          f"({pred['n_params'] / 1e9:.2f}B): planner host {pred['host_total_bytes'] / GIB:.1f} GiB "
          f"({pred['host_bytes_per_param']:.2f} B/param), GPU {pred['planner']['gpu_need_gib']:.1f} GiB: "
          f"{pred['verdict']}", flush=True)
    if a.dry_run:
        print(json.dumps(pred, indent=1, default=str), flush=True)
        return 0
    if pred["verdict"] != "fits" and not a.force:
        depth = deepest(spec, host_avail, gpu_free, device_type, margin)
        raise SystemExit(f"[full32b] {spec['layers']} layers do not fit here ({pred['verdict']}); the deepest that "
                         f"fits is {depth} (--layers auto), or --force")
    _, slug = gpu_slug(a.tiny)
    depth_tag = "" if spec["layers"] == FULL_LAYERS or a.tiny else f"_{spec['layers']}layers"
    path = os.path.join(a.out, f"full_32b_{slug}{depth_tag}.json")
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    save_dir = a.save_dir or os.path.join(a.out, "full_32b_checkpoint")
    spec.update(out=os.path.abspath(a.out), save_dir=os.path.abspath(save_dir),
                digest_path=os.path.join(os.path.abspath(a.out), "logs", "full_32b_master_digests.json"))
    doc: dict[str, Any] = {**schema.header(__file__, argv, host=info), "spec": spec,
                           "width": TINY_WIDTH if a.tiny else WIDTH, "prediction": pred}
    env = child_env(a.alloc_conf)

    def write() -> None:
        doc["wall_s"] = time.perf_counter() - T_START
        t, r = doc.get("train") or {}, doc.get("reload") or {}
        doc["acceptance"] = {
            "trained": t.get("status") == "ok" and bool(t.get("loss_finite")),
            "host_rss_within_10pct": None if t.get("host_rss_over_planner") is None
            else abs(t["host_rss_over_planner"] - 1.0) <= 0.10,
            "reload_verified": r.get("verified")}
        schema.write(path, doc, summary(doc))

    write()
    for phase in ("train", "reload"):
        print(f"[full32b] phase {phase} (log: {a.out}/logs/full_32b_{phase}.log)", flush=True)
        log = os.path.join(a.out, "logs", f"full_32b_{phase}.log")
        rec = spawn({**spec, "phase": phase}, a.timeout, log, env, script=__file__)
        doc[phase] = rec
        write()
        if rec.get("status") != "ok":
            print(f"[full32b] phase {phase} failed: {(rec.get('error') or '')[:600]}\n{log_tail(log, 25)}", flush=True)
            break
    if not a.keep_checkpoint and os.path.isdir(spec["save_dir"]):
        shutil.rmtree(spec["save_dir"], ignore_errors=True)
    print(f"[full32b] wrote {path}\n\n{summary(doc)}", flush=True)
    # (the RSS ratio is reported, not gating: a CPU smoke's host peak is its device memory too)
    return 0 if doc["acceptance"]["trained"] and doc["acceptance"]["reload_verified"] else 1


if __name__ == "__main__":
    if "--spec" in sys.argv:
        runner_main("full_32b", run_phase)
    sys.exit(main())
