"""Benchmark hf_megatrain once: one batch size, in this process only (spawned by bench_vs_deepspeed.py).

Two modes. ``trainer``: the path users run, ``MegaTrainTrainer`` + ``MegaTrainTrainingArguments``, timed with a
callback. ``engine``: ``MegaTrainEngine`` + ``engine.create_optimizer`` in a plain loop, i.e. the core without
any Trainer overhead. Both: the batch is one optimizer step (``batch`` sequences; ``micro_batch_size`` in the
MegaTrain config splits it inside each layer visit), bf16 compute, FP32 master, CPU AdamW with grad clipping
``max_grad_norm``, then one extra profiled step (not timed) for the per-phase breakdown. Also recorded: the host
AdamW rate (G param/s, bytes moved per parameter, GB/s) from the optimizer's counters over the timed steps, and the
forward's wait on the previous step's optimizer as a share of the step.
"""

from __future__ import annotations

import glob
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402

from bench.child import host_used_bytes  # noqa: E402
from bench.timeline import HostTimeline  # noqa: E402
from bench.common import (Profiled, StepClock, build_model, count_params, finetune_steps,  # noqa: E402
                          is_finetune, runner_main, throughput, token_rows, trainer_data)

LR, MAX_GRAD_NORM = 1e-5, 1.0


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _profile_steps(spec: dict) -> int:
    """Consecutive steps profiled after the timed ones (2+ shows the overlapped optimizer of the step before)."""
    return int(spec.get("profile_steps", 1)) if spec.get("profile", True) else 0


def _trace_path(spec: dict) -> str:
    d = spec.get("trace_dir") or tempfile.gettempdir()
    return os.path.join(d, f"trace_megatrain_b{spec['batch']}_{os.getpid()}.json")


def _mean_step(raw: list[dict], warm: int, steps: int) -> float | None:
    timed = [r["step_s"] for r in raw[warm:warm + steps]]
    return sum(timed) / len(timed) if timed else None


def _host_phases(per_step: list[dict], warm: int) -> dict[str, Any]:
    timed = per_step[warm:]
    keys = sorted({k for s in timed for k in s})
    return {k: _median([s.get(k) for s in timed]) for k in keys}


def _host_adamw_snapshot(opt: Any, ex: Any = None) -> dict[str, Any] | None:
    """The optimizer's cumulative host AdamW work (optim/adamw.py counters) after a step, whether that step
    clipped (the optimizer's own rule on the norm it just computed), and the executor's cumulative bytes over PCIe
    (weights in, gradients out: DMA that reads or writes host memory too); None for an optimizer without the
    counters."""
    if opt is None or not hasattr(opt, "host_update_params"):
        return None
    norm = getattr(opt, "last_grad_norm", None)
    clip = norm is not None and opt._grad_scale(norm) is not None
    return {"s": opt.host_update_seconds, "params": opt.host_update_params, "clip": clip,
            "bytes": getattr(opt, "host_update_bytes", 0),
            "dma": getattr(ex, "h2d_bytes", 0) + getattr(ex, "d2h_bytes", 0) if ex is not None else 0}


def _host_adamw(opt: Any, snaps: list[dict | None], warm: int, steps: int,
                step_s: float | None = None) -> dict[str, Any]:
    """Host AdamW rate over the timed steps: params and seconds are counter deltas from the end of the last warm-up
    step to the end of the last timed one (updates still running at a boundary count on neither side; an update
    adds its params and seconds together, so the rate is exact); bytes/param from core/kernels.py per timed step
    (clipped or not) averaged over the host-updated units' parameters (compute copy: its element size). Host DRAM
    per step: the AdamW bytes plus the layers' PCIe bytes (DMA reads the weights from host memory and writes the
    gradients into it), over the step time (``step_s``): how close the step runs to the host's memory bandwidth
    (integration/host_adamw_rate.py measures it: ~116-128 GB/s on the H100 host)."""
    if opt is None or any(x is None for x in snaps[:warm + steps]) or len(snaps) < warm + steps:
        return {}
    from hf_megatrain.core import kernels
    from hf_megatrain.core.plan import Stepper

    a = snaps[warm - 1] if warm else {"s": 0.0, "params": 0}
    b = snaps[warm + steps - 1]
    d_params, d_s = b["params"] - a["params"], b["s"] - a["s"]
    # The units whose updates the counters count: masters on the host, updated there (not streamed to the GPU).
    units = [u for u in opt.store.units if u.master.device.type == "cpu" and u.plan.stepper is not
             Stepper.DEVICE_STREAMED]
    numel = sum(u.numel for u in units)

    def bytes_per_param(clip: bool) -> float:
        return sum(u.numel * kernels.host_bytes_per_param(opt.host_kernel, clip, u.compute.element_size()
                                                          if u.compute is not None else 0)
                   for u in units) / max(numel, 1)

    clips = [s["clip"] for s in snaps[warm:warm + steps]]
    d_bytes = b.get("bytes", 0) - a.get("bytes", 0)  # counted per update (narrow gradients: 2 fewer)
    bpp = d_bytes / d_params if d_bytes > 0 and d_params > 0 else sum(bytes_per_param(c) for c in clips) / len(clips)
    rate = d_params / d_s if d_s > 0 else None
    return {"host_kernel": opt.host_kernel.value, "host_params": numel, "params_per_step": d_params / steps,
            "seconds_per_step": d_s / steps, "gparam_per_s": rate / 1e9 if rate else None,
            "bytes_per_param": bpp, "gb_per_s": rate * bpp / 1e9 if rate else None,
            "clipped_steps": sum(clips), "timed_steps": steps,
            **_host_dram(d_params * bpp / steps, (b.get("dma", 0) - a.get("dma", 0)) / steps, step_s)}


def _host_dram(adamw_bytes: float, dma_bytes: float, step_s: float | None) -> dict[str, Any]:
    total = adamw_bytes + dma_bytes
    return {"host_dram_gb_per_step": total / 1e9, "dma_gb_per_step": dma_bytes / 1e9,
            "host_dram_gb_per_s": total / 1e9 / step_s if step_s else None}


class _StepCounters:
    """Per-step counters that explain an outlier step: the CUDA caching allocator's retries (a failed cudaMalloc
    frees every cached block and synchronises) and device allocations, and the seconds spent in Python's GC."""

    def __init__(self) -> None:
        import gc

        self.gc_s, self._t0 = 0.0, 0.0

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._t0 = time.perf_counter()
            else:
                self.gc_s += time.perf_counter() - self._t0
        gc.callbacks.append(on_gc)
        self.last = self._read()

    def _read(self) -> dict[str, float]:
        stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_allocs": stats.get("num_device_alloc", 0),
                "gc_s": self.gc_s}

    def delta(self) -> dict[str, float]:
        now = self._read()
        out = {k: now[k] - self.last[k] for k in now}
        self.last = now
        return out


def run_engine(spec: dict, model: torch.nn.Module, mt_config: dict) -> dict[str, Any]:
    from hf_megatrain import MegaTrainEngine
    from hf_megatrain.config import resolve_config

    t = time.perf_counter()
    engine = MegaTrainEngine(model, resolve_config(mt_config, environ={}))
    opt = engine.create_optimizer(lr=LR, weight_decay=0.0, max_grad_norm=spec.get("max_grad_norm", MAX_GRAD_NORM))
    setup_s = time.perf_counter() - t
    ex = engine.executor
    warm, steps, batch = int(spec["warmup"]), int(spec["steps"]), int(spec["batch"])
    n_prof = _profile_steps(spec)
    total = warm + steps + n_prof
    if is_finetune(spec):  # variable-length steps (bench/finetune_data.py), one collated batch each
        from bench.finetune_data import label_items

        batches = finetune_steps(spec, total)
        items_of = [label_items(b) for b in batches]
    else:
        rows = token_rows(spec, total)
        items = batch * (int(spec["seq"]) - 1)  # what Trainer passes: label tokens after the shift (no padding)
        batches = [{"input_ids": rows[i * batch:(i + 1) * batch], "labels": rows[i * batch:(i + 1) * batch]}
                   for i in range(total)]
        items_of = [items] * total
    clock, losses, per_step, phases, prof = StepClock(spec.get("clock_sync") == "stream"), [], [], {}, None
    snaps: list[dict | None] = []
    counters, raw = _StepCounters(), []
    clock.mark()
    for i in range(total):
        if n_prof and i == warm + steps:
            prof = Profiled(_trace_path(spec), keep=bool(spec.get("keep_trace")), steps=n_prof)
            prof.start()
        w0, g0 = getattr(ex, "wait_optimizer_s", None), getattr(ex, "gpu_wait_optimizer_s", None)
        loss = engine(**batches[i], num_items_in_batch=items_of[i]).loss
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        call_s = time.perf_counter() - t0
        snaps.append(_host_adamw_snapshot(opt, ex))
        if n_prof and i == total - 1:
            prof.stop()
            phases = prof.phases
        clock.mark()
        w1, g1 = getattr(ex, "wait_optimizer_s", None), getattr(ex, "gpu_wait_optimizer_s", None)
        losses.append(float(loss.detach()))
        raw.append({"shape": list(batches[i]["input_ids"].shape), "step_s": clock.periods[-1],
                    "host_used_bytes": host_used_bytes(), **counters.delta()})
        per_step.append({"optimizer_step_call_s": call_s,
                         "optimizer_norm_s": getattr(opt, "last_norm_seconds", None),
                         "optimizer_worker_s": getattr(opt, "last_step_seconds", None),
                         "split_host_update": getattr(opt, "last_step_split", None),
                         "forward_wait_for_optimizer_s": (w1 - w0) if w0 is not None else None,
                         "forward_gpu_wait_for_optimizer_s": (g1 - g0) if g0 is not None else None,
                         # (the last layers that kept their forward's graph this step: saved_graph_layers)
                         "saved_graph_layers": len(getattr(ex, "graph_layers", ()))})
        raw[-1]["host"] = per_step[-1]  # (per step: what made a first step slow)
    opt.wait()
    out = {"mode": "engine", "setup_s": setup_s, "losses": losses, "per_step": raw,
           "grad_norm_last": getattr(opt, "last_grad_norm", None),
           "skipped_steps": getattr(opt, "skipped_steps", None), "periods": clock.periods,
           "cpu_optimizer": _host_phases(per_step[:warm + steps], warm), "phases": phases,
           "host_adamw": _host_adamw(opt, snaps, warm, steps, _mean_step(raw, warm, steps)),
           "h2d_gb": getattr(ex, "h2d_bytes", 0) / 1e9, "d2h_gb": getattr(ex, "d2h_bytes", 0) / 1e9,
           "megatrain_config": resolve_config(mt_config, environ={}).to_dict()}
    return out


def _find_executor(model: torch.nn.Module) -> Any:
    engine = getattr(model, "megatrain_engine", None)  # MegaTrainTrainer tags the converted model
    if engine is not None:
        return engine.executor
    for m in model.modules():
        ex = getattr(m, "_executor", None)
        if ex:
            return ex[0] if isinstance(ex, list) else ex
    return None


def _timeline(model: torch.nn.Module) -> HostTimeline:
    """Host timestamps of the phases of every step (bench/timeline.py), the weight slots' wait per unit included."""
    from accelerate import Accelerator

    from bench import common
    from hf_megatrain.optim.device_stepper import DeviceStepper
    from hf_megatrain.engine import MegaTrainEngine
    from hf_megatrain.engine.executor import StreamingExecutor
    from hf_megatrain.core.step_state import StepState
    from hf_megatrain.optim.adamw import CPUAdamW

    tl = HostTimeline()
    tl.sample_stack(MegaTrainEngine, "__call__", (15.0, 60.0, 120.0))  # (inside the wrap below: its span's calls)
    tl.wrap(MegaTrainEngine, "__call__", "forward")
    tl.wrap(Accelerator, "backward", "backward")
    tl.wrap(CPUAdamW, "step", "opt.step")
    tl.wrap(StepState, "finish_update", "unit", lambda self, i, *a, **k: f"[{i}]")
    tl.wrap(StepState, "wait_loadable", "wait", lambda self, i: f"[{i}]")  # the weight slots' wait per unit
    tl.wrap(StepState, "landed", "landed", lambda self, i, *a, **k: f"[{i}]")  # a gradient is complete
    tl.wrap(CPUAdamW, "update_", "upd", lambda self, unit, *a, **k: f"[{unit.index}]")  # one host or GPU update
    tl.wrap(StreamingExecutor, "finish", "executor.finish")
    tl.wrap(DeviceStepper, "run", "device_stepper")
    tl.wrap(common, "sync", "clock_sync")
    # The Trainer's work between one step's end and the next forward (~20 ms on most steps of session 29's 2-GPU
    # runs, 1-3 ms on others, with one process or two): which of its phases holds it.
    from hf_megatrain.hf.trainer import MegaTrainTrainer

    for name, label in (("get_batch_samples", "batch"), ("_prepare_inputs", "prepare"),
                        ("_maybe_log_save_evaluate", "log_save"), ("training_step", "train_step")):
        if hasattr(MegaTrainTrainer, name):
            tl.wrap(MegaTrainTrainer, name, label)
    # where threads block outside the slots' waits: device syncs, the resident unit's publication, activation
    # offload buffers (calls of 1 ms or more). Not torch.Tensor methods: compiled layers would trace the wrapper
    # (graph breaks, and recompiles on its clock values).
    from hf_megatrain.engine.activations import ActivationStore

    for owner, name, label in ((torch.cuda.Event, "synchronize", "event.sync"),
                               (torch.cuda.Stream, "synchronize", "stream.sync"),
                               (torch.cuda, "synchronize", "device.sync"),
                               (MegaTrainEngine, "publish_resident", "publish_resident"),
                               (ActivationStore, "save", "act.save"), (ActivationStore, "_take", "act.take")):
        tl.wrap_slow(owner, name, label)
    return tl


def run_trainer(spec: dict, model: torch.nn.Module, mt_config: dict) -> dict[str, Any]:
    from transformers import TrainerCallback

    from hf_megatrain.hf.trainer import MegaTrainTrainer, MegaTrainTrainingArguments

    warm, steps, batch = int(spec["warmup"]), int(spec["steps"]), int(spec["batch"])
    n_prof = _profile_steps(spec)
    total = warm + steps + n_prof
    clock, per_step, state = StepClock(spec.get("clock_sync") == "stream"), [], {"phases": {}}
    raw: list[dict[str, Any]] = []
    snaps: list[dict | None] = []
    cuda = torch.cuda.is_available()
    timeline = _timeline(model) if spec.get("timeline") else None

    class Timer(TrainerCallback):
        def on_train_begin(self, args, st, control, **kw):
            opt = kw.get("optimizer")
            state["opt"] = getattr(opt, "optimizer", opt)
            state["ex"] = _find_executor(kw.get("model") or model)
            state["counters"] = _StepCounters()
            clock.mark()

        def on_step_begin(self, args, st, control, **kw):
            ex = state.get("ex")
            state["w0"] = getattr(ex, "wait_optimizer_s", None)
            state["g0"] = getattr(ex, "gpu_wait_optimizer_s", None)
            if n_prof and st.global_step == warm + steps:
                state["prof"] = Profiled(_trace_path(spec), keep=bool(spec.get("keep_trace")), steps=n_prof)
                state["prof"].start()

        def on_step_end(self, args, st, control, **kw):
            prof = state.pop("prof", None) if st.global_step == total else None
            if prof:
                prof.stop()
                state["phases"] = prof.phases
            clock.mark()
            raw.append({"step_s": clock.periods[-1], "host_used_bytes": host_used_bytes(), **state["counters"].delta()})
            if timeline is not None:
                timeline.cut()
            opt, ex = state.get("opt"), state.get("ex")
            snaps.append(_host_adamw_snapshot(opt, ex))
            w1, g1 = getattr(ex, "wait_optimizer_s", None), getattr(ex, "gpu_wait_optimizer_s", None)
            per_step.append({"optimizer_norm_s": getattr(opt, "last_norm_seconds", None),
                             "optimizer_worker_s": getattr(opt, "last_step_seconds", None),
                             "split_host_update": getattr(opt, "last_step_split", None),
                             "forward_wait_for_optimizer_s": (w1 - state["w0"]) if w1 is not None
                             and state.get("w0") is not None else None,
                             "forward_gpu_wait_for_optimizer_s": (g1 - state["g0"]) if g1 is not None
                             and state.get("g0") is not None else None,
                             "saved_graph_layers": len(getattr(ex, "graph_layers", ()))})
            raw[-1]["host"] = per_step[-1]  # (per step: what made a first step slow)

    out_dir = tempfile.mkdtemp(prefix="bench_mt_")
    data, data_args = trainer_data(spec, total, batch, 1)
    args = MegaTrainTrainingArguments(
        output_dir=out_dir, megatrain=True, megatrain_config=mt_config,
        # bf16=False: layers compute in megatrain_config's compute_dtype; Trainer's autocast would only wrap the
        # resident ops (embedding, loss head) and add casts.
        gradient_accumulation_steps=1, max_steps=total, bf16=False, use_cpu=not cuda, learning_rate=LR,
        weight_decay=0.0, max_grad_norm=spec.get("max_grad_norm", MAX_GRAD_NORM), lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=10 ** 6, save_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, seed=int(spec.get("seed", 0)), **data_args)
    t = time.perf_counter()
    trainer = MegaTrainTrainer(model=model, args=args, **data, callbacks=[Timer()])
    setup_s = time.perf_counter() - t
    want = data_args["per_device_train_batch_size"]  # (the rates assume it: a larger step would read as slow)
    if trainer._train_batch_size != want:
        raise RuntimeError(f"the Trainer runs {trainer._train_batch_size} items per process and step, the bench "
                           f"counts {want}")
    result = trainer.train()
    opt = state.get("opt")
    if opt is not None and hasattr(opt, "wait"):
        opt.wait()
    extra: dict[str, Any] = {}
    if timeline is not None:
        timeline.restore()
        extra["timeline"] = timeline.summary(keep=3 if not n_prof else n_prof + 2)
    extra["process_memory"] = _process_memory()  # (this rank's; every rank's in by_rank)
    extra.update(_by_rank(state.get("ex"), per_step, warm, extra.get("timeline")))
    return {**extra, "mode": "trainer", "setup_s": setup_s, "per_step": raw, "train_loss": result.training_loss,
            "grad_norm_last": getattr(opt, "last_grad_norm", None), "periods": clock.periods,
            "cpu_optimizer": _host_phases(per_step[:warm + steps], warm), "phases": state["phases"],
            "host_adamw": _host_adamw(opt, snaps, warm, steps, _mean_step(raw, warm, steps)),
            "megatrain_config": args.megatrain_resolved_config().to_dict(), "trainer_bf16_flag": False}


def _process_memory() -> dict[str, float]:
    """This process's resident memory by kind (GiB, /proc/self/status): anonymous (its own heap, pinned staging,
    the CUDA runtime's host side), file-backed (libraries) and shared (the store's mapped pages, counted once per
    host by the bench's host figure); its proportional share (``Pss*``, /proc/self/smaps_rollup: a page shared by k
    processes counts 1/k); torch's pinned host allocator; and its descendants' (e.g. torch.compile's worker pool),
    by ``Pss`` too: those workers are forked, so their summed RssAnon (11.7 GiB for 33 workers, session 27) counts
    pages they share and overstated them -- quiescing them left the host's used memory unchanged."""

    def status(pid: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, keys in (("status", ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmPin", "VmLck")),
                           ("smaps_rollup", ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"))):
            try:
                with open(f"/proc/{pid}/{name}") as f:
                    for line in f:
                        key, _, rest = line.partition(":")
                        if key in keys:
                            out[key] = int(rest.split()[0]) / 2 ** 20  # (kB)
            except (OSError, ValueError, IndexError):
                pass
        return out

    def children(pid: str) -> list[str]:
        kids: list[str] = []
        for task in glob.glob(f"/proc/{pid}/task/*/children"):
            try:
                with open(task) as f:
                    kids += f.read().split()
            except OSError:
                pass
        return kids

    me: dict[str, Any] = status("self")
    me["mappings"] = _mappings()
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        try:
            stats = torch.cuda.host_memory_stats()
            me["torch_pinned"] = stats.get("allocated_bytes.current", 0) / 2 ** 30  # (active + cached blocks)
            me["torch_pinned_active"] = stats.get("active_bytes.current", 0) / 2 ** 30
        except RuntimeError:
            pass
    todo, seen = children(str(os.getpid())), 0
    anon = pss = 0.0
    while todo:
        pid = todo.pop()
        seen += 1
        kid = status(pid)
        anon += kid.get("RssAnon", 0.0)
        pss += kid.get("Pss", 0.0)
        todo += children(pid)
    return {**me, "descendants": seen, "descendants_RssAnon": anon, "descendants_Pss": pss}


def _mappings(top: int = 8) -> dict[str, dict[str, float]]:
    """This process's resident memory by mapping (/proc/self/smaps), the ``top`` largest by Rss (GiB): which part of
    a rank's own memory is its heap (``[heap]`` and unnamed anonymous maps: Python, torch, staging), the GPU driver's
    (``/dev/nvidia*``: pinned buffers, the CUDA context's host side), libraries, or the shared store."""
    sums: dict[str, dict[str, float]] = {}
    name = "?"
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if not head:
                    continue
                if "-" in head[0] and ":" not in head[0]:  # a mapping's first line: range perms offset dev inode [path]
                    path = head[5] if len(head) > 5 else "[anon]"
                    name = ("/dev/shm/*" if path.startswith("/dev/shm/") else
                            "*.so" if ".so" in path else path)
                elif head[0] in ("Rss:", "Anonymous:", "Shared_Clean:", "Shared_Dirty:"):
                    slot = sums.setdefault(name, {})
                    slot[head[0][:-1]] = slot.get(head[0][:-1], 0.0) + int(head[1]) / 2 ** 20  # (kB)
    except (OSError, ValueError, IndexError):
        return {}
    return dict(sorted(sums.items(), key=lambda kv: -kv[1].get("Rss", 0.0))[:top])


def _by_rank(ex: Any, per_step: list[dict], warm: int, timeline: dict | None) -> dict[str, Any]:
    """Several processes: every rank's host phases (median of the timed steps), its wait for the other ranks'
    shards of an update (``PeerCells.waited_s``) and its timeline, gathered onto the rank that writes the record:
    a step is as slow as its slowest rank, and rank 0 alone does not show which one that is."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    peers = getattr(getattr(ex, "state", None), "peers", None)
    mine = {"rank": dist.get_rank(), "cpu_optimizer": _host_phases(per_step, warm),
            "peer_wait_s": getattr(peers, "waited_s", None), "timeline": timeline, "memory": _process_memory()}
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return {"by_rank": out}


def run(spec: dict) -> dict[str, Any]:
    mt_config = dict(spec.get("megatrain_config") or {})
    compute = str(mt_config.get("compute_dtype", "bfloat16")).lower()
    dtype = torch.float32 if compute in ("float32", "fp32") else torch.bfloat16
    baseline = None
    if torch.cuda.is_available():  # this process's memory with torch and its CUDA context only (before the model)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # (the launch's device, as Trainer picks it)
        torch.zeros(1, device="cuda")
        baseline = _process_memory()
    t = time.perf_counter()
    # bf16 on the host (7.5 GB); the host store makes the FP32 master. Several processes: rank 0's alone, the
    # others' on the meta device (the store takes rank 0's weights): one copy in RAM, as from_pretrained_streamed.
    model = build_model(spec, dtype, meta=int(os.environ.get("RANK", "0")) > 0)
    n_params = count_params(model)
    build_s = time.perf_counter() - t
    mode = spec.get("mode", "engine")
    if mode == "trainer":
        res = run_trainer(spec, model, mt_config)
    elif mode == "engine":
        if int(spec.get("nproc", 1) or 1) > 1:
            raise ValueError("several processes run through the Trainer (--megatrain-mode trainer), as users launch")
        res = run_engine(spec, model, mt_config)
    else:
        raise ValueError(f"megatrain mode {mode!r}: use 'engine' or 'trainer'")
    res.update(throughput(spec, n_params, res.pop("periods")))
    res.update(n_params=n_params, model_build_s=build_s, micro_batch=int(spec["batch"]), grad_accum=1,
               regime=spec.get("regime", "auto"),
               in_layer_split=int(mt_config.get("micro_batch_size", 0) or 0),
               model_init="bf16 on host (meta + N(0,0.02)), rank 0 only (the others: meta); FP32 master made by "
                          "the host store",
               process_memory_at_start=baseline)
    return res


if __name__ == "__main__":
    runner_main("megatrain", run)
