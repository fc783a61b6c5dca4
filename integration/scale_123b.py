"""How fast would hf_megatrain train a 123B model on one H100? Measure a few Mistral-Large-width layers, extrapolate.

The full model (Mistral Large 2 shape: hidden 12288, MLP 28672, 96 heads / 8 KV heads, head_dim 128, vocab 32768,
untied, 88 layers) needs ~2.2 TB of host RAM for its FP32 master, gradients and AdamW state, far more than a
128 GiB device host. Every decoder layer costs the same and only one streams through the GPU at a time, so the
step time is ``intercept + L x per-layer`` (the intercept: embeddings, lm_head, loss, resident optimizer). This
script trains the same width with as many layers as the host holds (``--layers auto``: the planner's estimate +
``--margin-gib``), again with fewer layers, each in its own subprocess, fits the line and extrapolates to 88 layers
(step time, tokens/s, MFU, host RAM from the planner, GPU peak). Each run also times every layer visit with CUDA
events, so one run alone still gives a per-layer estimate when the budget has no room for the second.

Timing as in ``bench/run_megatrain.py``: ``MegaTrainEngine`` + ``create_optimizer`` in a plain loop, bf16 compute,
FP32 master, CPU AdamW with max_grad_norm 1.0, random tokens, a step is the interval between device-synchronised
step ends (with the overlapped optimizer it carries the previous step's optimizer stall), medians after warm-up.
The model is never whole on the host: the skeleton is built on ``meta``, the resident parameters are drawn on the
GPU, and every layer's N(0, 0.02) values go from the GPU straight into the engine's pinned FP32 master.

    python integration/scale_123b.py --mirror $OUT            # H100: auto layers, then auto - 2; ~4-6 minutes
    python integration/scale_123b.py --tiny --out /tmp/scale  # CPU smoke of the same code (seconds)
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the child's deadline counts from process start (before the heavy imports)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any, Callable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402

from bench import record as schema  # noqa: E402
from bench.common import GIB, PEAK_TFLOPS, StepClock, _vm_hwm_bytes, runner_main, throughput  # noqa: E402
from bench.record import machine  # noqa: E402  (full_32b.py, long_context.py take it from here)
from bench import child  # noqa: E402
from bench.child import log_tail  # noqa: E402
from bench.record import gpu_slug, mirror  # noqa: E402
from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner  # noqa: E402
from hf_megatrain.model.layers import find_layer_stack  # noqa: E402
from hf_megatrain.core.memory import available_host_bytes  # noqa: E402

FULL_LAYERS = 88
WIDTH = dict(hidden_size=12288, intermediate_size=28672, num_attention_heads=96, num_key_value_heads=8,
             head_dim=128, vocab_size=32768)
TINY_WIDTH = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, vocab_size=512)
LR, MAX_GRAD_NORM = 1e-5, 1.0


# -- model ------------------------------------------------------------------------------------------------------------
def model_config(spec: dict, layers: int) -> Any:
    from transformers import MistralConfig

    width = TINY_WIDTH if spec.get("tiny") else WIDTH
    return MistralConfig(**width, num_hidden_layers=layers, tie_word_embeddings=False, sliding_window=None,
                         max_position_embeddings=max(131072, int(spec["seq"])), attn_implementation="sdpa",
                         use_cache=False)


def skeleton(spec: dict, layers: int) -> torch.nn.Module:
    """The model with parameters on ``meta`` (buffers such as the rotary table real): nothing allocated."""
    from accelerate import init_empty_weights
    from transformers import MistralForCausalLM

    with init_empty_weights(include_buffers=False):
        return MistralForCausalLM(model_config(spec, layers))


_ONE_LAYER: dict[bool, planner.ModelShape] = {}


def model_shape(spec: dict, layers: int) -> planner.ModelShape:
    """The planner's shape for ``layers`` layers from a one-layer skeleton (all layers are identical)."""
    tiny = bool(spec.get("tiny"))
    if tiny not in _ONE_LAYER:
        _ONE_LAYER[tiny] = planner.ModelShape.from_model(skeleton(spec, 1))
    shape = _ONE_LAYER[tiny]
    return dataclasses.replace(shape, layer_numels=shape.layer_numels * layers, layer_frozen=[0] * layers)


def random_value(name: str, shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """bench.common's init (norms 1, biases 0, weights N(0, 0.02) drawn in bf16), left on ``device``: here values go
    from the GPU straight into pinned FP32 masters, where ``_init_value`` would stage them in pageable host RAM."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)


def random_engine(make_skeleton: Callable[[], torch.nn.Module], config: MegaTrainConfig, gen_device: torch.device,
                  seed: int = 0, device: torch.device | None = None,
                  resident_dtype: torch.dtype | None = None) -> tuple[MegaTrainEngine, dict[str, float]]:
    """Meta skeleton -> resident parameters drawn on ``gen_device`` -> engine (store allocated and pinned, layers stay
    meta) -> each layer's masters filled from ``gen_device`` -> streaming copies synced. The model is never whole on
    the host (shared by scale_123b, long_context and full_32b). Returns the engine and its phase times."""
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    times: dict[str, float] = {}
    t = time.perf_counter()
    model = make_skeleton()
    layer_ids = {id(p) for p in find_layer_stack(model, config.layers_path).layers.parameters()}
    with torch.no_grad():
        for mname, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is not None and id(p) not in layer_ids:
                    name = f"{mname}.{pname}" if mname else pname
                    value = random_value(name, p.shape, gen_device, gen)
                    module._parameters[pname] = torch.nn.Parameter(
                        value if resident_dtype is None else value.to(resident_dtype))
    model.train()
    times["model_build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    engine = MegaTrainEngine(model, config, device=device)
    times["engine_build_s"] = time.perf_counter() - t  # store allocation + page-locking dominate
    t = time.perf_counter()
    store, resident = engine.store, engine.resident_unit
    with torch.no_grad():
        for name in store.names():
            unit, sl = store.by_name[name]
            if unit is not resident:
                store.load_(name, random_value(name, sl.shape, gen_device, gen).float())
    times["fill_layers_s"] = time.perf_counter() - t
    t = time.perf_counter()
    engine.sync_device_()  # master -> bf16 streaming copy of every unit
    times["sync_s"] = time.perf_counter() - t
    return engine, times


def build_engine(spec: dict, config: MegaTrainConfig, gen_device: torch.device) -> tuple[MegaTrainEngine, dict]:
    from transformers import MistralForCausalLM  # noqa: F401  (imported here: not part of the timed build)

    layers = int(spec["layers"])
    return random_engine(lambda: skeleton(spec, layers), config, gen_device, int(spec.get("seed", 0)))


def count_params(spec: dict, layers: int) -> int:
    return model_shape(spec, layers).trainable


# -- planning -----------------------------------------------------------------------------------------------------------
def run_config(spec: dict) -> MegaTrainConfig:
    # device_layers=0: every layer streams, as in the full 88-layer model (whose layers do not fit the GPU), so
    # the per-layer time extrapolates; a layer kept on the GPU would run without PCIe and skew it. Likewise
    # saved_graph_layers=0: a few-layer run would keep the forward graphs of a share of its layers that 88 layers
    # cannot (~8 GB each at this width and 16k tokens), and its per-layer backward would skip the recompute.
    return MegaTrainConfig.from_dict({"compute_dtype": "bfloat16", "host_memory_fraction": spec["host_fraction"],
                                     "device_layers": 0, "saved_graph_layers": 0,
                                     **(spec.get("megatrain_config") or {})})


def plan_for(spec: dict, layers: int, device_type: str, gpu_free: int | None) -> planner.MemoryPlan:
    return planner.estimate(model_shape(spec, layers), run_config(spec), int(spec["seq"]), int(spec["batch"]),
                            device_type=device_type, gpu_free=gpu_free)


def plan_record(plan: planner.MemoryPlan, n_params: int) -> dict[str, Any]:
    gib = lambda d: {k: v / GIB for k, v in d.items() if v}  # noqa: E731
    return {"host_need_gib": plan.host_total / GIB, "host_gib": gib(plan.host),
            "host_bytes_per_param": plan.host_total / n_params, "gpu_need_gib": plan.device_total / GIB,
            "gpu_gib": gib(plan.device), "gpu_peak_phase": plan.peak_phase,
            "gpu_peak_phase_gib": gib(plan.phases.get(plan.peak_phase, {}))}


def auto_layers(spec: dict, avail: int, margin: int, device_type: str, gpu_free: int | None,
                cap: int) -> tuple[int, list[dict]]:
    """Largest L whose planned host peak + ``margin`` fits ``avail`` bytes (and the engine's own fraction check)."""
    rows, best = [], 0
    for layers in range(1, cap + 1):
        need = plan_for(spec, layers, device_type, gpu_free).host_total
        ok = need + margin <= avail and need <= run_config(spec).host_memory_fraction * avail
        rows.append({"layers": layers, "host_need_gib": need / GIB, "fits": ok})
        if not ok:
            break
        best = layers
    if best == 0:
        raise SystemExit(f"[scale] not even one layer fits: {rows[0]['host_need_gib']:.1f} GiB needed + "
                         f"{margin / GIB:.0f} GiB margin, {avail / GIB:.1f} GiB available")
    return best, rows


# -- one run (child process) --------------------------------------------------------------------------------------------
class LayerTimer:
    """Time of every layer visit (forward, backward recompute) per step: CUDA events on the compute stream (the
    start waits for the work queued before it, so visits tile the stream, optimizer stalls included), wall clock on
    the CPU. Wraps this executor instance's ``forward_layer`` / ``backward_layer``; the core is not touched."""

    def __init__(self, executor: Any, layers: int, cuda: bool) -> None:
        self.layers, self.cuda, self.pending = layers, cuda, []
        for kind in ("forward", "backward"):
            if hasattr(executor, f"{kind}_layer"):  # else no events: the two-run slope still stands
                setattr(executor, f"{kind}_layer", self._wrap(kind, getattr(executor, f"{kind}_layer")))

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _wrap(self, kind: str, fn: Any) -> Any:
        def timed(index: int, *args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            out = fn(index, *args, **kwargs)
            self.pending.append((kind, index, start, self._mark()))
            return out
        return timed

    def collect(self) -> dict[str, list[float]]:
        """Seconds per layer of the step just ended (call after a device synchronise)."""
        out = {"forward": [0.0] * self.layers, "backward": [0.0] * self.layers}
        for kind, i, a, b in self.pending:
            out[kind][i] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        self.pending = []
        return out


class HostSampler(threading.Thread):
    """Lowest MemAvailable and highest RSS seen (every 0.2 s): how close the host came to running out."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.start_avail = self.min_avail = available_host_bytes()
        self.max_rss = 0

    def run(self) -> None:
        while True:
            self.min_avail = min(self.min_avail, available_host_bytes())
            try:
                with open("/proc/self/status") as f:
                    rss = next((int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:")), 0)
                self.max_rss = max(self.max_rss, rss)
            except OSError:
                pass
            time.sleep(0.2)

    def record(self) -> dict[str, float]:
        return {"mem_available_start_gib": self.start_avail / GIB, "mem_available_min_gib": self.min_avail / GIB,
                "host_rss_sampled_max_gib": self.max_rss / GIB}


def engine_plan(engine: MegaTrainEngine, spec: dict) -> planner.MemoryPlan:
    """The planner's numbers for what this engine placed (as ``planner.check_fits(engine, ...)`` computes them)."""
    return planner.estimate(planner.ModelShape.from_engine(engine), engine.config, int(spec["seq"]),
                            int(spec["batch"]), device_type=engine.device.type, plans=engine.plans)


def train(engine: MegaTrainEngine, spec: dict, timer: LayerTimer) -> dict[str, Any]:
    """Warm-up + timed steps; stops early (``truncated``) when the next step would pass the child's deadline."""
    opt = engine.create_optimizer(lr=LR, weight_decay=0.0, max_grad_norm=spec.get("max_grad_norm", MAX_GRAD_NORM))
    ex, batch, seq = engine.executor, int(spec["batch"]), int(spec["seq"])
    total = int(spec["warmup"]) + int(spec["steps"])
    vocab = (TINY_WIDTH if spec.get("tiny") else WIDTH)["vocab_size"]
    rows = torch.randint(0, vocab, (total * batch, seq), generator=torch.Generator().manual_seed(1000))
    deadline = T_START + float(spec.get("deadline_s") or 1e9)
    clock, steps, truncated = StepClock(), [], False
    clock.mark()
    for i in range(total):
        if i >= 2 and time.perf_counter() + 1.3 * clock.periods[-1] > deadline:
            truncated = True
            break
        ids = rows[i * batch:(i + 1) * batch]
        w0, u0, n0 = ex.wait_optimizer_s, opt.host_update_seconds, opt.host_update_params
        loss = engine(input_ids=ids, labels=ids, num_items_in_batch=batch * (seq - 1)).loss
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        call_s = time.perf_counter() - t0
        clock.mark()
        visits = timer.collect()
        steps.append({"period_s": clock.periods[-1], "loss": float(loss.detach()), "grad_norm": opt.last_grad_norm,
                      "optimizer_step_call_s": call_s, "forward_wait_for_optimizer_s": ex.wait_optimizer_s - w0,
                      "optimizer_worker_prev_s": opt.last_step_seconds, "layer_forward_s": visits["forward"],
                      "layer_backward_s": visits["backward"],
                      "host_update_s": opt.host_update_seconds - u0, "host_update_params": opt.host_update_params - n0,
                      "reruns_so_far": getattr(opt, "regenerated_steps", 0)})
        print(f"[run L={spec['layers']}] step {i}: {steps[-1]['period_s']:.3f}s loss {steps[-1]['loss']:.4f}",
              flush=True)
    opt.wait()
    return {"steps": steps, "truncated": truncated, "periods": clock.periods}


def event_split(steps: list[dict], layers: int, layer_numel: int) -> dict[str, Any]:
    """Per-layer and resident time from the layer-visit events, and the optimizer's share (medians over steps).

    A layer costs its GPU visits or its host AdamW update, whichever is longer: with many layers the CPU updates
    one layer while the GPU runs another, so the slower of the two paces the step (a run of a few layers hides a
    slow host in its tail). GPU visits: the interior layers' (the first layer's forward waits for the step's first
    weight load, the last backward for the step's tail; in an 88-layer model that excess is paid once, so it goes
    to the intercept), all layers' when there are fewer than three. ``host_update_per_layer_s``: the updates'
    seconds per parameter over the timed steps (each timed around its kernel, on whichever thread ran it) times
    one layer's parameters."""
    inner = range(1, layers - 1) if layers >= 3 else range(layers)
    gpu = [sum(s["layer_forward_s"][i] + s["layer_backward_s"][i] for i in inner) / len(inner) for s in steps]
    every = [(sum(s["layer_forward_s"]) + sum(s["layer_backward_s"])) / layers for s in steps]
    if not any(gpu):
        return {"per_layer_s": None, "error": "no layer visits were timed"}
    params = sum(s.get("host_update_params", 0) for s in steps)
    host = sum(s.get("host_update_s", 0.0) for s in steps) / params * layer_numel if params else 0.0
    per_layer = [max(g, host) for g in gpu]
    rest = [s["period_s"] - layers * p for s, p in zip(steps, per_layer)]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"per_layer_s": med(per_layer), "intercept_s": med(rest), "gpu_per_layer_s": med(gpu),
            "gpu_per_layer_all_layers_s": med(every), "gpu_layers_timed": list(inner),
            "host_update_per_layer_s": host, "bound": "host AdamW" if host > med(gpu) else "GPU visits",
            **{k: med([s[k] for s in steps]) for k in ("optimizer_worker_prev_s", "forward_wait_for_optimizer_s",
                                                        "optimizer_step_call_s")},
            "layer_forward_s": [med([s["layer_forward_s"][i] for s in steps]) for i in range(layers)],
            "layer_backward_s": [med([s["layer_backward_s"][i] for s in steps]) for i in range(layers)]}


def run_one(spec: dict) -> dict[str, Any]:
    sampler = HostSampler()
    sampler.start()
    cuda = torch.cuda.is_available()
    config, layers = run_config(spec), int(spec["layers"])
    engine, times = build_engine(spec, config, torch.device("cuda") if cuda else torch.device("cpu"))
    n_params = engine.num_parameters()
    print(f"[run L={layers}] {n_params / 1e9:.3f}B params, setup {times}", flush=True)
    plan = engine_plan(engine, spec)
    hwm = _vm_hwm_bytes()
    setup_mem: dict[str, Any] = {"setup_vm_hwm_gib": hwm / GIB if hwm is not None else None}
    if cuda:
        setup_mem.update(setup_peak_gpu_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                         setup_peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
        torch.cuda.reset_peak_memory_stats()  # runner_main's peaks are then those of training
    timer = LayerTimer(engine.executor, layers, cuda)
    res = train(engine, spec, timer)
    periods = res.pop("periods")
    warm = min(int(spec["warmup"]), max(len(periods) - 1, 0))
    out = throughput({**spec, "warmup": warm}, n_params, periods)
    hidden = (TINY_WIDTH if spec.get("tiny") else WIDTH)["hidden_size"]
    out["model_tflops_with_attention"] = (6.0 * n_params + 12.0 * layers * hidden * int(spec["seq"])) \
        * out["tokens_per_s"] / 1e12
    out.update(res, layers=layers, n_params=n_params, setup=times, warmup_used=warm,
               events=event_split(res["steps"][warm:], layers, max(u.numel for u in engine.layer_units)),
               planner=plan_record(plan, n_params),
               resident_on_device=engine.plans.resident_on_device, megatrain_config=config.to_dict(),
               device_layers=len(engine.plans.kept), device_step_layers=len(engine.plans.device_stepped),
               h2d_gb=engine.executor.h2d_bytes / 1e9, d2h_gb=engine.executor.d2h_bytes / 1e9,
               torch_threads=torch.get_num_threads(), **setup_mem, **sampler.record())
    return out


# -- parent: plan, spawn, fit, extrapolate ------------------------------------------------------------------------------
def child_env(alloc_conf: str | None) -> dict[str, str]:
    """The environment of a run's subprocess: this repo first on PYTHONPATH, unbuffered output, and the allocator
    configuration unless the caller's environment sets one."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                   else []))}
    if alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    return env


def spawn(spec: dict, timeout: float, log_path: str, env: dict[str, str], script: str = __file__) -> dict[str, Any]:
    """One run of ``script --spec ... --result ...`` (a ``runner_main`` child) in its own process group (killed whole
    on timeout); an error record when no result came back."""
    run = child.run_child(script, spec, log_path, env, timeout)
    record = run.record or run.error_record(timeout, layers=spec["layers"], spec=spec)
    record.setdefault("layers", spec["layers"])
    record.update(subprocess_wall_s=run.wall_s, log=os.path.basename(log_path), returncode=run.returncode)
    return record


def out_of_memory(rec: dict) -> bool:
    """Host or GPU memory ran out: an OOM error, the planner's refusal, or SIGKILL (the kernel's OOM killer)."""
    text = (rec.get("error") or "").lower()
    return bool(rec.get("oom")) or "memory" in text or "does not fit" in text or rec.get("returncode") == -9


def fit(runs: list[dict]) -> dict[str, Any] | None:
    """Least squares of median step time vs layers over the runs that finished (needs two layer counts)."""
    pts = sorted({r["layers"]: r["step_time_s"] for r in runs if r.get("status") == "ok"}.items())
    if len(pts) < 2:
        return None
    xs, ys = [float(x) for x, _ in pts], [y for _, y in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    return {"method": "slope of median step time over runs", "points": pts, "per_layer_s": slope,
            "intercept_s": my - slope * mx}


def extrapolate(spec: dict, runs: list[dict], line: dict, layers: int, device_type: str,
                gpu_free: int | None) -> dict[str, Any]:
    n = count_params(spec, layers)
    tokens = int(spec["batch"]) * int(spec["seq"])
    step = line["intercept_s"] + layers * line["per_layer_s"]
    tflops = 6.0 * n * tokens / step / 1e12
    out = {"layers": layers, "method": line["method"], "per_layer_s": line["per_layer_s"],
           "intercept_s": line["intercept_s"], "n_params": n, "step_time_s": step, "tokens_per_step": tokens,
           "tokens_per_s": tokens / step, "model_tflops": tflops, "mfu": tflops / float(spec["peak_tflops"]),
           "planner": plan_record(plan_for(spec, layers, device_type, gpu_free), n)}
    ok = [r for r in runs if r.get("status") == "ok"]
    if ok:
        big = max(ok, key=lambda r: r["layers"])
        c = torch.empty((), dtype=run_config(spec).torch_compute_dtype).element_size()
        hidden = (TINY_WIDTH if spec.get("tiny") else WIDTH)["hidden_size"]
        boundary = tokens * hidden * c  # one more saved layer-boundary activation per layer; the rest is per-visit
        measured = big.get("peak_gpu_reserved_gib")
        total = big.get("gpu_total_gib")
        predicted = None if measured is None else measured + (layers - big["layers"]) * boundary / GIB
        out["gpu"] = {"measured_at_layers": big["layers"], "measured_peak_alloc_gib": big.get("peak_gpu_alloc_gib"),
                      "measured_peak_reserved_gib": measured, "boundary_activation_per_layer_gib": boundary / GIB,
                      "predicted_peak_reserved_gib": predicted, "gpu_total_gib": total,
                      "fits_gpu": None if predicted is None or total is None else predicted <= total}
    return out


def _count(n: int | None) -> str:
    return "-" if not n else f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def summary(doc: dict) -> str:
    f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)  # noqa: E731
    lines = [f"hf_megatrain at Mistral-Large width on {doc['machine'].get('gpu') or 'cpu'} "
             f"({doc['spec']['batch']} x {doc['spec']['seq']} tokens/step)", "",
             "| layers | params | status | step s | tokens/s | MFU | GPU alloc/reserved GiB | host HWM GiB | "
             "planner host GiB | setup s |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["runs"]:
        setup = sum((r.get("setup") or {}).values()) or None
        plan = r.get("planner") or {}
        lines.append(f"| {r['layers']} | {_count(r.get('n_params'))} | {r.get('status')} | "
                     f"{f(r.get('step_time_s'), '{:.3f}')} | {f(r.get('tokens_per_s'), '{:,.0f}')} | "
                     f"{f(r.get('mfu'), '{:.1%}')} | {f(r.get('peak_gpu_alloc_gib'), '{:.1f}')} / "
                     f"{f(r.get('peak_gpu_reserved_gib'), '{:.1f}')} | {f(r.get('vm_hwm_gib'), '{:.1f}')} | "
                     f"{f(plan.get('host_need_gib'), '{:.1f}')} | {f(setup, '{:.0f}')} |")
    lines.append("")
    for key in ("fit", "events_fit"):
        line = doc.get(key)
        if line:
            lines.append(f"{key}: {line['method']}: per layer {line['per_layer_s']:.3f} s, intercept "
                         f"{line['intercept_s']:.3f} s")
            if line.get("gpu_per_layer_s") is not None:
                lines.append(f"  per layer: GPU visits {line['gpu_per_layer_s']:.3f} s (interior layers; all layers "
                             f"{line['gpu_per_layer_all_layers_s']:.3f}), host AdamW update "
                             f"{line['host_update_per_layer_s']:.3f} s")
    x = doc.get("extrapolation")
    if x:
        gpu, plan = x.get("gpu") or {}, x["planner"]
        lines.append(f"{x['layers']} layers ({x['n_params'] / 1e9:.1f}B): step {x['step_time_s']:.2f} s, "
                     f"{x['tokens_per_s']:,.0f} tokens/s, MFU {x['mfu']:.1%}; host RAM {plan['host_need_gib']:,.0f} "
                     f"GiB ({plan['host_bytes_per_param']:.1f} B/param); GPU peak ~"
                     f"{f(gpu.get('predicted_peak_reserved_gib'), '{:.1f}')} GiB (planner "
                     f"{plan['gpu_need_gib']:.1f}; fits: {gpu.get('fits_gpu')})")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny width on the CPU (smoke test of the same code)")
    ap.add_argument("--layers", default=None, help="'auto' (largest that fits host RAM) or N; default auto (tiny 3)")
    ap.add_argument("--layer-counts", default=None, help="comma list of layer counts to run instead (e.g. 4,2)")
    ap.add_argument("--second-offset", type=int, default=2, help="second run: L - this many layers (0 = none)")
    ap.add_argument("--max-layers", type=int, default=FULL_LAYERS, help="cap for --layers auto")
    ap.add_argument("--full-layers", type=int, default=FULL_LAYERS, help="extrapolate to this many layers")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; tiny 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; tiny 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; tiny 1)")
    ap.add_argument("--margin-gib", type=float, default=8.0, help="host RAM left free by --layers auto")
    ap.add_argument("--host-fraction", type=float, default=1.0,
                    help="engine host_memory_fraction (the absolute --margin-gib replaces its relative reserve)")
    ap.add_argument("--megatrain-config", default=None, help="JSON dict of MegaTrainConfig overrides")
    ap.add_argument("--max-grad-norm", type=float, default=MAX_GRAD_NORM,
                    help="global-norm clipping (0: off). Random init clips every step: with lean_store each such "
                         "step runs its forward+backward twice")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--budget", type=float, default=570, help="seconds for the whole command")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per run (subprocess)")
    ap.add_argument("--alloc-conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF for runs")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--mirror", default=None, metavar="DIR", help="copy the JSON and logs here after every run")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (layer counts, host RAM) and exit")
    a = ap.parse_args(argv)
    if a.max_grad_norm < 0:
        ap.error(f"--max-grad-norm {a.max_grad_norm}: use a positive threshold, or 0 to turn clipping off")
    return a


def layer_counts(a: argparse.Namespace, spec: dict, info: dict, device_type: str,
                 gpu_free: int | None) -> tuple[list[int], list[dict]]:
    if a.layer_counts:
        return [int(x) for x in a.layer_counts.split(",") if x.strip()], []
    layers, table = (a.layers or ("3" if a.tiny else "auto")), []
    if layers == "auto":
        avail = int(info["mem_available_gib"] * GIB)
        big, table = auto_layers(spec, avail, int(a.margin_gib * GIB), device_type, gpu_free, a.max_layers)
    else:
        big = int(layers)
    small = big - a.second_offset if big - a.second_offset >= 1 else big - 1
    return [big] + ([small] if a.second_offset > 0 and small >= 1 else []), table


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = T_START if argv is None else time.perf_counter()  # the budget counts from process start
    info = machine()
    device_type = "cuda" if info.get("gpu") else "cpu"
    if device_type == "cpu" and not a.tiny:
        raise SystemExit("[scale] no GPU found (nvidia-smi); the full-width run needs an H100. Use --tiny on a CPU.")
    gpu_free = int(info["gpu_free_gib"] * GIB) if info.get("gpu") else None
    spec = {"tiny": a.tiny, "batch": a.batch or (2 if a.tiny else 4), "seq": a.seq or (64 if a.tiny else 4096),
            "steps": a.steps or (3 if a.tiny else 10), "warmup": a.warmup if a.warmup is not None else
            (1 if a.tiny else 2), "peak_tflops": a.peak_tflops, "host_fraction": a.host_fraction, "seed": 0,
            "max_grad_norm": a.max_grad_norm,
            "megatrain_config": json.loads(a.megatrain_config) if a.megatrain_config else {}}
    run_config(spec)  # a bad --megatrain-config fails here, not in every run
    counts, table = layer_counts(a, spec, info, device_type, gpu_free)
    _, slug = gpu_slug(a.tiny)
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    path = os.path.join(a.out, f"scale_123b_{slug}.json")
    doc: dict[str, Any] = {**schema.header(__file__, argv, host=info), "spec": spec,
                           "width": TINY_WIDTH if a.tiny else WIDTH, "layer_counts": counts, "auto_layers": table,
                           "margin_gib": a.margin_gib, "runs": []}
    print(f"[scale] {info.get('gpu') or 'cpu'}, {info['mem_available_gib']:.1f} GiB host RAM available: runs with "
          f"{counts} layers -> {path}", flush=True)
    for row in table:
        print(f"[scale]   {row['layers']} layers: planner host peak {row['host_need_gib']:.1f} GiB "
              f"{'fits' if row['fits'] else 'does not fit'}", flush=True)
    if a.dry_run:
        return 0
    env = child_env(a.alloc_conf)
    logs: list[str] = []

    def write() -> None:
        doc["wall_s"] = time.perf_counter() - t_start
        schema.write(path, doc, summary(doc))
        if a.mirror:
            mirror(a.mirror, [path, path[:-5] + ".md"], logs)

    write()
    k = 0
    while k < len(counts):
        layers = counts[k]
        k += 1
        left = a.budget - (time.perf_counter() - t_start)
        done = [r for r in doc["runs"] if r.get("status") == "ok"]
        guess = max((r["subprocess_wall_s"] * (layers + 1) / (r["layers"] + 1) for r in done), default=0.0)
        if left < 60 or (k > 1 and guess + 20 > left):
            doc["runs"].append({"layers": layers, "status": "skipped", "error": f"{left:.0f}s left of --budget "
                                f"{a.budget:.0f}s, this run needs ~{guess:.0f}s"})
            print(f"[scale] skipping {layers} layers: {doc['runs'][-1]['error']}", flush=True)
            continue
        timeout = min(a.timeout, left - 35)  # room for the kill's grace periods and the last write
        log = os.path.join(a.out, "logs", f"scale_123b_L{layers}.log")
        logs.append(log)
        print(f"[scale] run {k}/{len(counts)}: {layers} layers (timeout {timeout:.0f}s)", flush=True)
        rec = spawn({**spec, "layers": layers, "deadline_s": timeout - 30}, timeout, log, env)
        need, hwm = (rec.get("planner") or {}).get("host_need_gib"), rec.get("vm_hwm_gib")
        rec["host_hwm_over_planner"] = hwm / need if need and hwm else None
        doc["runs"].append(rec)
        msg = (f"step {rec['step_time_s']:.3f}s, {rec['tokens_per_s']:,.0f} tokens/s, MFU {rec['mfu']:.1%}"
               if rec.get("status") == "ok" else (rec.get("error") or "")[:400])
        print(f"[scale]   -> {rec.get('status')} in {rec['subprocess_wall_s']:.0f}s: {msg}", flush=True)
        if rec.get("status") != "ok":
            print(log_tail(log, 25), flush=True)
            if k == 1 and out_of_memory(rec) and layers - 1 >= 1 and layers - 1 not in counts:
                counts.insert(1, layers - 1)  # the largest count did not fit after all: one layer fewer next
                print(f"[scale] {layers} layers failed: trying {layers - 1} next", flush=True)
        analyse(doc, device_type, gpu_free, a.full_layers)
        write()
    print(f"[scale] wrote {path}\n", flush=True)
    print(summary(doc), flush=True)
    return 0


def analyse(doc: dict, device_type: str, gpu_free: int | None, full_layers: int) -> None:
    """Per-layer line: two-run slope when there are two layer counts, else the largest run's layer-visit events."""
    ok = [r for r in doc["runs"] if r.get("status") == "ok"]
    doc["fit"] = fit(doc["runs"])
    big = max(ok, key=lambda r: r["layers"], default=None)
    if big is not None and big.get("events", {}).get("per_layer_s") is not None:
        ev = big["events"]
        doc["events_fit"] = {"method": f"layer-visit events of the {big['layers']}-layer run, paced by the "
                                       f"{ev.get('bound', 'GPU visits')}",
                             "per_layer_s": ev["per_layer_s"], "intercept_s": ev["intercept_s"],
                             "gpu_per_layer_s": ev.get("gpu_per_layer_s"),
                             "gpu_per_layer_all_layers_s": ev.get("gpu_per_layer_all_layers_s"),
                             "host_update_per_layer_s": ev.get("host_update_per_layer_s")}
    line = doc.get("fit") or doc.get("events_fit")
    if line:
        doc["extrapolation"] = extrapolate(doc["spec"], doc["runs"], line, full_layers, device_type, gpu_free)
    if doc.get("fit") and doc.get("events_fit"):  # the cross-check: the same extrapolation from one run's events
        doc["extrapolation_from_events"] = extrapolate(doc["spec"], doc["runs"], doc["events_fit"], full_layers,
                                                       device_type, gpu_free)


if __name__ == "__main__":
    if "--spec" in sys.argv:
        runner_main("megatrain_123b", run_one)
    sys.exit(main())
