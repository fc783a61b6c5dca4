"""What every benchmarked system shares: the model, the data, the clock, the metrics and the record format.

The comparison is only fair if all the systems train the very same model on the very same tokens and are
timed the same way, so none of that lives in the per-system runners:

* model: Qwen2-shaped at 14B width (hidden 5120, MLP 13824, 40 heads / 8 KV heads, vocab 152064, untied), N
  layers, SDPA attention, random init. Parameters are created on ``meta`` and materialised one tensor at a time
  with a cheap N(0, 0.02) init (on the GPU when there is one, then copied to the host) in the dtype the system
  wants, so building the 3.76B model takes seconds and the host never holds two copies.
* data: random tokens from a fixed seed, ``labels = input_ids`` (HF shifts them), no attention mask.
* clock: a step is the interval between two consecutive step ends (device synchronised), so a CPU optimizer that
  overlaps the next forward is charged where it stalls it; medians over the timed steps after the warm-up.
* metrics: tokens/s, model TFLOP/s = 6·N·tokens/s, MFU against a stated peak, GPU and host memory peaks, and for
  a profiled step a per-phase breakdown parsed from the exported chrome trace.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

# integration/ on the path: the lazy ``from bench.finetune_data import ...`` below, however this module was reached
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from .record import versions  # noqa: E402  (the result schema's; here for the runners' records)

FULL_WIDTH = dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=8,
                  vocab_size=152064, max_position_embeddings=4096)
TINY_WIDTH = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512, max_position_embeddings=256)
FULL_SEQ, TINY_SEQ = 2048, 64
PEAK_TFLOPS = 800.0  # dense bf16 H100 SXM as measured here (8192^3 matmul ~798 TFLOP/s)
GIB = 2 ** 30
# hf_megatrain's placement per regime, merged into its MegaTrainConfig (bench_vs_deepspeed.py, compare_commits.py).
# auto: the planner's choice (a model that fits keeps most layers on the GPU). streamed: the users' case, a model many
# times the GPU's memory: every decoder layer streamed and no streamed layer keeps per-parameter state (weights,
# gradients, moments) on the GPU between steps; the resident parts (embeddings, final norm, lm_head) may stay.
# hf_megatrain's placements. "streamed": every layer streams and is stepped on the CPU; "streamed_gpu_step": the
# same with the first 2 layers in forward order stepped on the GPU, their master and moments streamed in and out
# each step (device_step_state="host": nothing of a streamed layer's state stays on the GPU between steps; the GPU
# holds a fixed 2 layers' worth of buffers, as it could beside a model many times its size).
REGIMES: dict[str, dict[str, Any]] = {
    "auto": {},
    "streamed": {"device_layers": 0, "device_step_layers": 0},
    "streamed_gpu_step": {"device_layers": 0, "device_step_layers": 1, "device_step_state": "host"},
}


def regime_of(megatrain_config: dict) -> str:
    """The regime a MegaTrainConfig override dict runs in: the one whose whole overlay it holds (the longest
    overlay first), else auto."""
    for name, overlay in sorted(REGIMES.items(), key=lambda kv: -len(kv[1])):
        if overlay and all(megatrain_config.get(k) == v for k, v in overlay.items()):
            return name
    return "auto"


# -- model ------------------------------------------------------------------------------------------------------------
def model_config(spec: dict) -> Any:
    from transformers import Qwen2Config

    width = TINY_WIDTH if spec.get("tiny") else FULL_WIDTH
    return Qwen2Config(**width, num_hidden_layers=int(spec["layers"]), tie_word_embeddings=False,
                       attn_implementation=spec.get("attn") or "sdpa", use_cache=False)


def _init_value(name: str, shape: torch.Size, dtype: torch.dtype, gen_device: torch.device,
                gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=gen_device)
    t.normal_(0.0, 0.02, generator=gen)
    return t.to(device)


def build_model(spec: dict, dtype: torch.dtype, device: str | torch.device = "cpu",
                meta: bool = False) -> torch.nn.Module:
    """The benchmark model in ``dtype`` (buffers such as rotary tables stay fp32), random init; parameters are
    materialised on ``device`` (the host by default; the plain-GPU peer builds straight on the GPU), the same values
    wherever they land (drawn on the GPU when there is one). ``meta``: left on the meta device (hf_megatrain's
    processes other than rank 0: the store takes rank 0's weights)."""
    from accelerate import init_empty_weights
    from transformers import Qwen2ForCausalLM

    cfg = model_config(spec)
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers real
        model = Qwen2ForCausalLM(cfg)
    if meta:  # (in ``dtype``, as rank 0's: the ranks' plans follow the model's dtype)
        for module in model.modules():
            for pname, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[pname] = torch.nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
        model.tie_weights()
        model.config.use_cache = False
        model.train()
        return model
    gen_device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(int(spec.get("seed", 0)))
    device = torch.device(device)
    done: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for mname, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in done:
                    full = f"{mname}.{pname}" if mname else pname
                    done[id(p)] = torch.nn.Parameter(_init_value(full, p.shape, dtype, gen_device, gen, device),
                                                     requires_grad=p.requires_grad)
                module._parameters[pname] = done[id(p)]
    model.config.use_cache = False
    model.train()
    return model


def count_params(model: torch.nn.Module) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def attention_flops_per_token(spec: dict) -> float:
    """12·L·H·T: the attention score/value matmuls (fwd+bwd) that 6·N leaves out (PaLM appendix B)."""
    width = TINY_WIDTH if spec.get("tiny") else FULL_WIDTH
    return 12.0 * int(spec["layers"]) * width["hidden_size"] * int(spec["seq"])


# -- data -------------------------------------------------------------------------------------------------------------
def token_rows(spec: dict, n_steps: int) -> torch.Tensor:
    """[n_steps * batch, seq] random token ids; the same for every system (fixed seed, CPU generator)."""
    vocab = (TINY_WIDTH if spec.get("tiny") else FULL_WIDTH)["vocab_size"]
    gen = torch.Generator().manual_seed(1000 + int(spec.get("seed", 0)))
    return torch.randint(0, vocab, (n_steps * int(spec["batch"]), int(spec["seq"])), generator=gen)


def processes(spec: dict) -> int:
    """Processes of the run (``nproc``: one per GPU, data parallel); ``batch`` is per process."""
    return max(int(spec.get("nproc", 1) or 1), 1)


def is_finetune(spec: dict) -> bool:
    """The fine-tune regime (``--data finetune``, bench/finetune_data.py): variable lengths, ``spec['tokens']`` real
    tokens per step; ``spec['batch']`` then names that budget, not a sequence count."""
    return spec.get("data") == "finetune"


def finetune_steps(spec: dict, n_steps: int) -> list[dict[str, torch.Tensor]]:
    from bench.finetune_data import step_batches

    vocab = (TINY_WIDTH if spec.get("tiny") else FULL_WIDTH)["vocab_size"]
    return step_batches({**spec, "vocab_size": vocab}, n_steps)


def trainer_data(spec: dict, n_steps: int, micro: int, ga: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Trainer kwargs, TrainingArguments kwargs) for ``n_steps`` steps of ``micro`` x ``ga``. Fine-tune: the step's
    rows in ``ga`` pre-collated micro-batches, one Trainer item each, taken in order (a step's micro-batches
    together, every system the same steps in the same order)."""
    if not is_finetune(spec):  # (N processes: N x the rows, each rank its own micro-batches)
        rows = token_rows({**spec, "batch": int(spec["batch"]) * processes(spec)}, n_steps)
        return {"train_dataset": TokenDataset(rows)}, {"per_device_train_batch_size": micro}
    from bench.finetune_data import MicroBatchDataset, unwrap

    n = processes(spec)  # (rank r's step s is step s * n + r; its micro-batches dealt to it in turn, see below)
    ranks = [MicroBatchDataset(finetune_steps(spec, n_steps * n)[r::n], ga) for r in range(n)]
    # Accelerate deals a map-style dataset's batches (one item each here) round-robin over the ranks: item k goes to
    # rank k % n, so interleaving gives each rank its own steps' micro-batches in order.
    data = ranks[0] if n == 1 else [ranks[r][k] for k in range(len(ranks[0])) for r in range(n)]
    return ({"train_dataset": data, "data_collator": unwrap},
            {"per_device_train_batch_size": 1, "train_sampling_strategy": "sequential"})


class TokenDataset(torch.utils.data.Dataset):
    """Rows of random tokens as Trainer examples (``input_ids`` and ``labels``; no attention mask)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


# -- clock --------------------------------------------------------------------------------------------------------------
def sync(stream_only: bool = False) -> None:
    if torch.cuda.is_available():
        if stream_only:
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.synchronize()


class StepClock:
    """Step boundaries; ``periods`` are the step times. Default: the whole device is synchronised at each mark.
    ``stream_only``: only the main (compute) stream, i.e. the step's own forward/backward/update work, so
    background work a system queued on side streams (an overlapped optimizer) is charged to the step it delays
    instead of being forced to finish at the mark."""

    def __init__(self, stream_only: bool = False) -> None:
        self.marks: list[float] = []
        self.stream_only = stream_only

    def mark(self) -> None:
        sync(self.stream_only)
        self.marks.append(time.perf_counter())

    @property
    def periods(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


# -- metrics ------------------------------------------------------------------------------------------------------------
def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_stats() -> dict[str, Any]:
    out: dict[str, Any] = {"peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    hwm = _vm_hwm_bytes()
    out["vm_hwm_gib"] = hwm / GIB if hwm is not None else None
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        out.update(peak_gpu_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                   peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                   gpu_used_now_gib=(total - free) / GIB, gpu_total_gib=total / GIB)
        # the caching allocator's retries free cached blocks with a device-wide synchronisation: a step that pays
        # them waits for every stream (the optimizer's copies included)
        stats = torch.cuda.memory_stats()
        out["cuda_alloc"] = {k: stats.get(k) for k in ("num_alloc_retries", "num_sync_all_streams",
                                                         "num_device_alloc", "num_device_free", "num_ooms")}
    return out


def throughput(spec: dict, n_params: int, periods: list[float]) -> dict[str, Any]:
    """Median step time and the derived rates over the timed steps (the ones after the warm-up). Fine-tune: steps
    differ, so the rates are totals over the timed steps (tokens / seconds), ``tokens_per_s`` counts REAL tokens
    (padding excluded; also ``real_tokens_per_s``) and ``total_tokens_per_s`` what was computed, padding included."""
    warm, steps = int(spec["warmup"]), int(spec["steps"])
    timed = periods[warm:warm + steps]
    if not timed:
        raise RuntimeError(f"no timed steps: {len(periods)} step periods for warmup={warm} steps={steps}")
    peak = float(spec.get("peak_tflops", PEAK_TFLOPS))
    med = statistics.median(timed)
    if is_finetune(spec):
        from bench.finetune_data import summary

        world = processes(spec)  # (several processes: every rank's steps; MFU per GPU)
        batches = finetune_steps(spec, (warm + steps) * world)
        data = summary(batches, spec)
        tokens = int(spec["tokens"]) * world
        tps = tokens * len(timed) / sum(timed)
        tflops = 6.0 * n_params * tps / 1e12
        per_rank = data["total_tokens_per_step"]
        total = [sum(per_rank[s * world:(s + 1) * world]) for s in range(warm, warm + steps)]
        return {"tokens_per_step": tokens, "processes": world, "step_time_s": sum(timed) / len(timed),
                "step_time_median_s": med,
                "step_times_s": timed, "warmup_times_s": periods[:warm], "tokens_per_s": tps,
                "real_tokens_per_s": tps, "total_tokens_per_s": sum(total) / sum(timed),
                "timed_padding_frac": 1 - tokens * len(timed) / sum(total), "data": data,
                "first_step_over_steady": periods[0] / med if periods else None,
                "model_tflops": tflops, "mfu": tflops / world / peak, "peak_tflops": peak}
    world = processes(spec)  # (several processes: tokens of every rank; MFU per GPU)
    tokens = int(spec["batch"]) * int(spec["seq"]) * world
    tps = tokens / med
    tflops = 6.0 * n_params * tps / 1e12
    return {"tokens_per_step": tokens, "step_time_s": med, "step_times_s": timed, "warmup_times_s": periods[:warm],
            "tokens_per_s": tps, "model_tflops": tflops, "mfu": tflops / world / peak, "peak_tflops": peak,
            "processes": world,
            "model_tflops_with_attention": (6.0 * n_params + attention_flops_per_token(spec)) * tps / 1e12}


# -- profiler trace -> phases ---------------------------------------------------------------------------------------------
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Time covered by both of two sorted, disjoint interval lists."""
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


def _stream(e: dict) -> Any:
    args = e.get("args") or {}
    if "stream" in args:
        return args["stream"]
    return e.get("tid")


def phase_breakdown(trace: str | dict, window_name: str = "bench.step") -> dict[str, Any]:
    """Per-phase GPU times (ms) of one step from a torch.profiler chrome trace.

    Window: the CPU ``record_function(window_name)`` range (the step body ends with a device sync, so all its GPU
    work lies inside); without one, first to last GPU event. The compute stream is the stream with the most kernel
    time. ``compute_ms`` sums its kernels; ``h2d_ms`` / ``d2h_ms`` sum the HtoD / DtoH copies (any stream);
    ``gpu_idle_ms`` = window − union of compute-stream kernel intervals.
    """
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    windows = [e for e in events if e.get("name") == window_name and e.get("cat") in ("user_annotation", "cpu_op")]
    if windows:
        w = max(windows, key=lambda e: float(e["dur"]))
        lo, hi = float(w["ts"]), float(w["ts"]) + float(w["dur"])
    else:
        lo = min(float(e["ts"]) for e in gpu)
        hi = max(float(e["ts"]) + float(e["dur"]) for e in gpu)

    def clipped(e: dict) -> tuple[float, float] | None:
        a, b = max(float(e["ts"]), lo), min(float(e["ts"]) + float(e["dur"]), hi)
        return (a, b) if b > a else None

    kernels_by_stream: dict[Any, list[tuple[float, float]]] = {}
    h2d, d2h, d2d = [], [], []
    for e in gpu:
        iv = clipped(e)
        if iv is None:
            continue
        if e["cat"] == "kernel":
            kernels_by_stream.setdefault(_stream(e), []).append(iv)
        elif e["cat"] == "gpu_memcpy":
            name = e.get("name", "")
            (h2d if "HtoD" in name else d2h if "DtoH" in name else d2d).append(iv)
    if not kernels_by_stream:
        return {"error": "no kernels inside the step window"}
    compute_stream = max(kernels_by_stream, key=lambda s: sum(b - a for a, b in kernels_by_stream[s]))
    comp = kernels_by_stream[compute_stream]
    K, H, D = _union(comp), _union(h2d), _union(d2h)
    wall = hi - lo
    ms = 1e-3
    other = sum(b - a for s, iv in kernels_by_stream.items() if s != compute_stream for a, b in iv)
    return {
        "window_ms": wall * ms,
        "compute_stream": compute_stream,
        "compute_ms": sum(b - a for a, b in comp) * ms,
        "compute_busy_ms": _length(K) * ms,
        "other_stream_kernels_ms": other * ms,
        "h2d_ms": sum(b - a for a, b in h2d) * ms,
        "d2h_ms": sum(b - a for a, b in d2h) * ms,
        "d2d_ms": sum(b - a for a, b in d2d) * ms,
        "h2d_under_compute_frac": _overlap(H, K) / max(_length(H), 1e-9),
        "d2h_under_compute_frac": _overlap(D, K) / max(_length(D), 1e-9),
        "gpu_idle_ms": (wall - _length(K)) * ms,
        "gpu_idle_frac": 1.0 - _length(K) / max(wall, 1e-9),
        "n_kernels": len(comp),
    }


class Profiled:
    """Profile ``steps`` consecutive steps (``start()`` before the first, ``stop()`` after the last) ->
    ``p.phases`` afterwards, per step (times divided by ``steps``). ``keep`` leaves the trace gzipped."""

    def __init__(self, trace_path: str, keep: bool = False, steps: int = 1) -> None:
        self.path, self.keep, self.steps = trace_path, keep, max(1, steps)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.phases: dict[str, Any] = {}
        self._range: Any = None

    def start(self) -> None:
        sync()
        self.prof.__enter__()
        self._range = torch.profiler.record_function("bench.step")
        self._range.__enter__()

    def stop(self) -> None:
        sync()
        self._range.__exit__(None, None, None)
        self.prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.prof.export_chrome_trace(self.path)
        try:
            self.phases = phase_breakdown(self.path)
            if self.steps > 1:
                self.phases = {k: v / self.steps if k.endswith("_ms") else v for k, v in self.phases.items()}
                self.phases["profiled_steps"] = self.steps
        finally:
            if not self.keep:
                os.remove(self.path)
            else:
                import gzip
                import shutil

                with open(self.path, "rb") as src, gzip.open(self.path + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.remove(self.path)
                self.phases["trace"] = self.path + ".gz"


# -- process harness ----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_dist_env() -> None:
    """Environment of a one-process torch.distributed job (what torchrun / deepspeed launch would set)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def runner_main(system: str, run: Callable[[dict], dict]) -> None:
    """CLI of every runner: ``--spec JSON --result PATH``. Writes one JSON record (also on failure), then exits
    with ``os._exit`` so a hanging teardown (process groups, pinned-memory release) cannot eat the time budget."""
    ap = argparse.ArgumentParser(description=f"benchmark {system} once (one batch size)")
    ap.add_argument("--spec", required=True, help="JSON object (or @file) with the run's settings")
    ap.add_argument("--result", required=True, help="where to write the JSON record")
    a = ap.parse_args()
    spec = json.loads(open(a.spec[1:]).read() if a.spec.startswith("@") else a.spec)
    t0 = time.perf_counter()
    record: dict[str, Any] = {"system": system, "batch": spec.get("batch"), "spec": spec}
    code = 0
    try:
        torch.manual_seed(int(spec.get("seed", 0)))
        record.update(run(spec))
        record["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - the parent must get a record whatever happened
        traceback.print_exc()
        record.update(status="error", oom=is_oom(e), error=f"{type(e).__name__}: {e}"[:2000],
                      traceback=traceback.format_exc()[-4000:])
        code = 1
    try:
        record.update(memory_stats())
    except Exception as e:  # noqa: BLE001
        record["memory_stats_error"] = repr(e)
    record.update(wall_s=time.perf_counter() - t0, gpu=device_name(), versions=versions(),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"))
    line = json.dumps(record, default=str)
    rank = int(os.environ.get("RANK", "0"))  # (torchrun's; rank 0 writes the record, the others a side file)
    with open(a.result if rank == 0 else f"{a.result}.rank{rank}", "w") as f:
        f.write(line + "\n")
    print("BENCH_RESULT " + line[:4000], flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- the peers that run through plain transformers.Trainer (plain GPU, DeepSpeed) ------------------------------------
def run_hf_trainer(model: torch.nn.Module, spec: dict, *, micro: int, ga: int, clock: "StepClock", prefix: str,
                   lr: float, max_grad_norm: float, **extra: Any) -> dict[str, Any]:
    """``transformers.Trainer`` over the benchmark's tokens as a user configures it (bf16, non-reentrant activation
    checkpointing, constant LR, no weight decay, the spec's clip), ``extra`` TrainingArguments on top (``optim``,
    ``deepspeed``). The clock is marked at train begin and after every step. Returns the trainer, train()'s
    result, the Trainer construction time, train()'s wall time and the seconds from train() to the first mark
    (engine / optimizer setup inside train())."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    marks: dict[str, float] = {}

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks["train_begin"] = time.perf_counter()
            clock.mark()

        def on_step_end(self, args, state, control, **kw):
            clock.mark()

    warm, steps = int(spec["warmup"]), int(spec["steps"])
    cuda = torch.cuda.is_available()
    data, data_args = trainer_data(spec, warm + steps, micro, ga)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix=prefix), **data_args,
        gradient_accumulation_steps=ga, max_steps=warm + steps, bf16=True, use_cpu=not cuda,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, learning_rate=lr,
        weight_decay=0.0, max_grad_norm=spec.get("max_grad_norm", max_grad_norm), lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=10 ** 6, save_strategy="no", report_to=[], disable_tqdm=True,
        remove_unused_columns=False, dataloader_num_workers=0, dataloader_pin_memory=cuda,
        seed=int(spec.get("seed", 0)), **extra)
    t = time.perf_counter()
    trainer = Trainer(model=model, args=args, **data,
                      callbacks=[Timer()])
    init_s = time.perf_counter() - t
    t = time.perf_counter()
    result = trainer.train()
    return {"trainer": trainer, "result": result, "trainer_init_s": init_s, "train_s": time.perf_counter() - t,
            "setup_in_train_s": marks.get("train_begin", t) - t}
