"""``full_32b_hub.py --hub-checkpoint DIR``: the 32B run as a user runs it (issue 46 parts 1, 2/3, 5); phases: hub_32b.py.

write (when DIR holds no checkpoint) -> raw read of the shards (O_DIRECT, else after posix_fadvise(DONTNEED)) -> pages
dropped -> train (``from_pretrained_streamed`` + ``MegaTrainTrainer``, 1 process or ``--nproc N`` through torchrun)
-> reload (plain transformers) of the export. The planner's prediction (``megatrain estimate --json`` on DIR's config
at this run's depth and processes) is recorded beside the measurements. The host layout: the config's default unless
it does not fit; then the layout the library's ``host_layout="auto"`` takes (``--host-layout auto``; one process: the
estimate's fastest that fits, several: the first that fits), given explicitly so prediction and run are one layout;
``--layers auto``: the full depth when such a layout fits, else the deepest the planner fits with the default store.

    python integration/full_32b_hub.py --hub-checkpoint /tmp/q32 --tiny --out /tmp/f32hub     # CPU smoke, ~25 s

On the 4 x H100, 512 GiB host (integration/results/full_32b/NEXT.md: the plan, the planner's predicted times), as a
background queue (integration/results/full_32b/queue_46.txt) across chained calls of the device tool (nvidia-h100-x4):

    cp -a . /tmp/tree && bash /tmp/tree/integration/device_queue.sh start \
        /tmp/tree/integration/results/full_32b/queue_46.txt /tmp/q46 && bash /tmp/tree/integration/device_queue.sh \
        wait 560 /tmp/q46 $OUT                                          # call 1
    bash /tmp/tree/integration/device_queue.sh wait 580 /tmp/q46 $OUT  # calls 2, 3 (at once: warm for 30 s only)

The queue's runs, D the largest non-tmpfs mount:

    CUDA_VISIBLE_DEVICES=0 python3 integration/full_32b_hub.py --hub-checkpoint D/q32_46 --out /tmp/q46/f32
    python3 integration/full_32b_hub.py --hub-checkpoint D/q32_46 --nproc 4 --layers auto --raw-read none \
        --phases train --out /tmp/q46/f32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from bench import record as schema  # noqa: E402
from bench.child import log_tail, run_child  # noqa: E402
from bench.common import GIB, PEAK_TFLOPS  # noqa: E402
from bench.finetune_data import FULL_MAX_LEN, LENGTHS_JSON, TINY_MAX_LEN  # noqa: E402
import hub_32b  # noqa: E402

FULL_LAYERS, VOCAB, TINY_VOCAB = 64, 152064, 512


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hub-checkpoint", required=True, metavar="DIR", help="the Hub-layout bf16 checkpoint (written "
                    "here first when DIR holds none)")
    ap.add_argument("--tiny", action="store_true", help="tiny width, 2 layers (CPU smoke of the same code)")
    ap.add_argument("--layers", default=None, help="decoder layers trained: N (the checkpoint's first N), or 'auto' "
                    "(the deepest the planner fits here); default all 64 (tiny 2)")
    ap.add_argument("--nproc", type=int, default=1, help="data-parallel processes (torchrun, one per GPU)")
    ap.add_argument("--tokens", type=int, default=None, help="real tokens per step and process (default 32768; "
                    "tiny 256)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; tiny 1)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-5; tiny 1e-2, so that the "
                    "bf16 export differs from the checkpoint it started from)")
    ap.add_argument("--host-layout", choices=("auto", "default"), default="auto",
                    help="auto: the layout megatrain estimate chooses when the config's default does not fit")
    ap.add_argument("--megatrain-config", default=None, help="JSON dict of MegaTrainConfig overrides")
    ap.add_argument("--host-fraction", type=float, default=0.9, help="engine host_memory_fraction (its default)")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="shard size of the written checkpoint (GB)")
    ap.add_argument("--raw-read", choices=("direct", "buffered", "both", "none"), default="direct",
                    help="raw read rate of the shards before the load (direct: O_DIRECT)")
    ap.add_argument("--read-threads", type=int, default=16)
    ap.add_argument("--heldout-tokens", type=int, default=None, help="held-out batch for the logits (default 128)")
    ap.add_argument("--export-dir", default=None, help="save_model target (default DIR_export, beside DIR on its disk; "
                    "removed after the reload unless --keep-export)")
    ap.add_argument("--keep-export", action="store_true")
    ap.add_argument("--phases", default="write,train,reload")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per phase")
    ap.add_argument("--alloc-conf", default="expandable_segments:True")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "full_32b"))
    ap.add_argument("--mirror", default=None, metavar="DIR", help="copy the JSON, md and logs here after each phase")
    return ap.parse_args(argv)


def make_spec(a: argparse.Namespace) -> dict[str, Any]:
    tiny = a.tiny
    return {"tiny": tiny, "full_layers": 2 if tiny else FULL_LAYERS, "layers": 2 if tiny else FULL_LAYERS,
            "seed": 0, "shard_gb": a.shard_gb if not tiny else 1e-4, "data": "finetune", "layout": "packed",
            "tokens": a.tokens or (256 if tiny else 32768), "nproc": a.nproc, "steps": a.steps or (2 if tiny else 20),
            "warmup": a.warmup if a.warmup is not None else (1 if tiny else 2), "max_grad_norm": a.max_grad_norm,
            "lr": a.lr or (1e-2 if tiny else 1e-5), "peak_tflops": a.peak_tflops,
            "vocab": TINY_VOCAB if tiny else VOCAB,
            "heldout_tokens": a.heldout_tokens or (32 if tiny else 128), "hub_dir": os.path.abspath(a.hub_checkpoint)}


# -- the planner ------------------------------------------------------------------------------------------------------
def estimate(spec: dict, config: dict, host_gib: float, gpu_gib: float) -> dict[str, Any]:
    """``megatrain estimate --json`` (what a user runs) on DIR's config at this depth, processes and rows."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(spec["hub_dir"], "config.json")) as f:
            cfg = json.load(f)
        cfg.update(hub_32b.depth_overrides(spec["hub_dir"], int(spec["layers"])))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        with open(os.path.join(d, "megatrain.json"), "w") as f:
            json.dump(config, f)
        row = TINY_MAX_LEN if spec["tiny"] else FULL_MAX_LEN
        cmd = [sys.executable, "-m", "hf_megatrain.cli", "estimate", d, "--seq-len", str(row), "--batch-size",
               str(int(spec["tokens"]) // row), "--lengths", LENGTHS_JSON, "--layout", "packed", "--gpus",
               str(spec["nproc"]), "--host-memory", f"{host_gib:.1f}", "--gpu-memory", f"{gpu_gib:.1f}",
               "--config", os.path.join(d, "megatrain.json"), "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-2000:], "command": " ".join(cmd)}
    doc = json.loads(p.stdout)
    step = doc.get("step_time") or {}
    clip = step.get("clipping on every step") or {}
    return {"command": "megatrain " + " ".join(cmd[3:]), "host_need_gib": doc["host_total"] / GIB,
            "gpu_need_gib": doc["gpu_total"] / GIB, "host_fits": doc["host_fits"], "gpu_fits": doc["gpu_fits"],
            "verdict": doc["verdict"], "step_s_clip": clip.get("step_s"),
            "tokens_per_s_clip": clip.get("tokens_per_s"), "host_layout_choice": doc.get("host_layout_choice"),
            "host_layouts": [{k: x[k] for k in ("name", "keys", "bytes_per_param", "host_total", "fits", "step_s")}
                             for x in doc.get("host_layouts") or []],
            "checkpoint": doc.get("checkpoint"), "host": {k: v / GIB for k, v in doc["host"].items() if v}}


def _shape(spec: dict) -> Any:
    """DIR's model shape at this run's depth (meta device: nothing allocated)."""
    from hf_megatrain.planner.cli import load_shape

    one = load_shape(spec["hub_dir"])
    n = int(spec["layers"])
    return dataclasses.replace(one, layer_numels=[one.layer_numels[0]] * n, layer_frozen=[0] * n)


def library_layout(spec: dict, base: dict, host_gib: float, gpu_gib: float) -> tuple[dict, str | None]:
    """The layout keys the engine's ``host_layout="auto"`` takes for this run (planner/host_layout.py
    ``auto_layout``, the engine's own rule at this depth and process count), and its note (None: the config as
    given)."""
    from hf_megatrain import MegaTrainConfig
    from hf_megatrain.planner.host_layout import LAYOUT_KEYS, auto_layout

    cfg, note = auto_layout(_shape(spec), MegaTrainConfig.from_dict(base), "cuda", int(gpu_gib * GIB),
                            int(host_gib * GIB), gpus=int(spec["nproc"]))
    return ({k: getattr(cfg, k) for k in LAYOUT_KEYS if k != "optimizer_state_dir"} if note else {}), note


def choose_config(spec: dict, base: dict, a: argparse.Namespace, host_gib: float, gpu_gib: float
                  ) -> tuple[dict, dict, str]:
    """(config, prediction, why): the default when it fits; else the layout the library's ``host_layout="auto"``
    takes (any process count), passed explicitly so the prediction and the run are of one layout."""
    pred = estimate(spec, base, host_gib, gpu_gib)
    if spec["tiny"] or "error" in pred or (pred["host_fits"] and pred["gpu_fits"]):
        return base, pred, "the config as given fits (planner)" if "error" not in pred else pred["error"][:300]
    if a.host_layout == "auto":
        keys, note = library_layout(spec, base, host_gib, gpu_gib)
        if note:
            config = {**base, **keys}
            return config, estimate(spec, config, host_gib, gpu_gib), (
                f"the default does not fit ({pred['verdict']}); host_layout='auto' takes {keys}: {note}")
    return base, pred, f"does not fit: {pred['verdict']} (no exact layout fits; use --layers auto)"


def shm_free_bytes(config: dict) -> int:
    st = os.statvfs(config.get("shared_memory_dir") or "/dev/shm")
    return st.f_bavail * st.f_frsize


def deepest_layers(spec: dict, config: dict, host_gib: float, gpu_gib: float, shm_free: int | None = None) -> int:
    """The most layers whose plan (this many processes) fits, by the planner in this process (64 quick plans); with
    several processes the shared store must also fit ``shm_free`` (default: ``shared_memory_dir``'s free space)."""
    from hf_megatrain import MegaTrainConfig, planner
    from hf_megatrain.planner.cli import load_shape

    one = load_shape(spec["hub_dir"])
    cfg = MegaTrainConfig.from_dict(config)
    row = TINY_MAX_LEN if spec["tiny"] else FULL_MAX_LEN
    for n in range(int(spec["full_layers"]), 0, -1):
        shape = dataclasses.replace(one, layer_numels=[one.layer_numels[0]] * n, layer_frozen=[0] * n)
        plan = planner.estimate(shape, cfg, row, int(spec["tokens"]) // row, device_type="cuda",
                                gpu_free=int(gpu_gib * GIB), gpus=int(spec["nproc"]))
        if int(spec["nproc"]) > 1 and plan.store_host_bytes > (shm_free_bytes(config) if shm_free is None
                                                                 else shm_free):
            continue
        if plan.host_total <= cfg.host_memory_fraction * host_gib * GIB and plan.device_total <= gpu_gib * GIB:
            return n
    return 0


# -- raw reads --------------------------------------------------------------------------------------------------------
def raw_reads(folder: str, mode: str, threads: int) -> dict[str, Any]:
    from bench_checkpoint_io import raw_read_files

    paths = hub_32b.shard_paths(folder)
    nbytes = sum(os.path.getsize(p) for p in paths)
    out: dict[str, Any] = {"bytes": nbytes, "threads": threads}
    for kind in (("direct", "buffered") if mode == "both" else (mode,)):
        t = time.perf_counter()
        s = raw_read_files(paths, threads, direct=kind == "direct")
        if s is None and kind == "direct":  # (the filesystem refuses O_DIRECT: a read after the pages were dropped)
            out["direct_unsupported"] = True
            kind, t = "buffered", time.perf_counter()
            s = raw_read_files(paths, threads)
        wall = time.perf_counter() - t
        out[f"{kind}_s"] = s if s is not None else wall
        out[f"{kind}_gb_per_s"] = nbytes / out[f"{kind}_s"] / 1e9
    out["cache_drop"] = "posix_fadvise(DONTNEED) per shard before each read (no root needed)"
    return out


# -- parent -----------------------------------------------------------------------------------------------------------
def summary(doc: dict) -> str:
    w, r, t, b = (doc.get(k) or {} for k in ("write", "raw_read", "train", "reload"))
    p = doc.get("prediction") or {}
    f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)  # noqa: E731
    raw = r.get("direct_gb_per_s") or r.get("buffered_gb_per_s")
    rows = [("write s (GB, GB/s)", f"{f(w.get('write_s'), '{:.0f}')} ({f((w.get('bytes') or 0) / 1e9, '{:.1f}')}, "
             f"{f(w.get('write_gb_per_s'))})"),
            ("raw read GB/s (O_DIRECT or cold)", f(raw)),
            ("from_pretrained_streamed s (store build s + reads s)", f"{f(t.get('load_s'), '{:.1f}')} "
             f"({f(t.get('load_build_s'), '{:.1f}')} + {f(t.get('load_read_s'), '{:.1f}')})"),
            ("reads GB/s (vs raw read)", f"{f(t.get('load_read_gb_per_s'))} "
             f"({f(t['load_read_gb_per_s'] / raw if raw and t.get('load_read_gb_per_s') else None, '{:.0%}')})"),
            ("host layout", doc.get("layout_why")),
            ("layers / params", f"{doc['spec']['layers']} / {f(t.get('n_params'), '{:,}')}"),
            ("processes", doc["spec"]["nproc"]),
            ("step s (mean; planner)", f"{f(t.get('step_time_s'))} ({f(p.get('step_s_clip'))})"),
            ("real tokens/s (all GPUs)", f(t.get("tokens_per_s"), "{:,.0f}")),
            ("MFU per GPU (6·N·T)", f(t.get("mfu"), "{:.1%}")),
            ("host GiB: rank-0 HWM, all processes added (planner)", f"{f(t.get('train_vm_hwm_gib'), '{:.1f}')}, "
             f"{f(t.get('host_added_gib'), '{:.1f}')} ({f(p.get('host_need_gib'), '{:.1f}')})"),
            ("GPU peak reserved GiB (planner)", f"{f(t.get('train_peak_gpu_reserved_gib'), '{:.1f}')} "
             f"({f(p.get('gpu_need_gib'), '{:.1f}')})"),
            ("losses", ", ".join(f"{x:.3f}" for x in t.get("losses") or [])),
            ("save_model s (GB)", f"{f(t.get('save_s'), '{:.1f}')} ({f(t.get('export_gb'), '{:.1f}')})"),
            ("plain from_pretrained s (host HWM GiB)", f"{f(b.get('load_s'), '{:.1f}')} "
             f"({f(b.get('reload_vm_hwm_gib'), '{:.1f}')})"),
            ("logits max |diff| / max |logit| (top-1)", f"{f(b.get('rel_max_diff'), '{:.2%}')} "
             f"({f(b.get('top1_agree'), '{:.1%}')}): {b.get('logits_match')}")]
    return "\n".join([f"Qwen2.5-32B shape through the Hub path on {doc['machine'].get('gpu') or 'cpu'} "
                      f"(x{doc['spec']['nproc']}): {doc['spec']['tokens']} real tokens per step and process, packed",
                      "", "| | |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in rows]) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    spec = make_spec(a)
    info = schema.machine()
    cuda = bool(info.get("gpu"))
    if not cuda and not a.tiny:
        raise SystemExit("[hub32] no GPU found; use --tiny on a CPU")
    host_gib = info["mem_available_gib"]
    gpu_gib = info["gpu_free_gib"] if cuda else 80.0
    out = os.path.abspath(a.out)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    _, slug = schema.gpu_slug(a.tiny)
    phases = a.phases.split(",")
    spec.update(out=out, export_dir=os.path.abspath(a.export_dir or spec["hub_dir"].rstrip("/") + "_export"),
                logits_path=os.path.join(out, "logs", f"hub_heldout_logits_{a.nproc}.pt"))
    doc: dict[str, Any] = {**schema.header(__file__, argv, host=info), "spec": spec,
                           "disk_free_gib": shutil.disk_usage(os.path.dirname(spec["hub_dir"]) or ".").free / GIB}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", a.alloc_conf)
    logs: list[str] = []
    path = [""]

    def write() -> None:
        t, b = doc.get("train") or {}, doc.get("reload") or {}
        doc["wall_s"] = time.perf_counter() - t0
        doc["acceptance"] = {"trained": t.get("status") == "ok" and bool(t.get("loss_finite")),
                             "export_reloads_with_matching_logits": b.get("logits_match")}
        p = doc.get("prediction") or {}
        ratio = lambda x, y: x / y if x and y else None  # noqa: E731
        doc["measured_over_planner"] = {  # (issue 46: host within 5 %, GPU within 10 %, step within 15 %)
            "host_added": ratio(t.get("host_added_gib"), p.get("host_need_gib")),
            "host_rank0_hwm": ratio(t.get("train_vm_hwm_gib"), p.get("host_need_gib")),
            "gpu_reserved": ratio(t.get("train_peak_gpu_reserved_gib"), p.get("gpu_need_gib")),
            "step": ratio(t.get("step_time_s"), p.get("step_s_clip"))}
        if path[0]:
            schema.write(path[0], doc, summary(doc))
            if a.mirror:
                schema.mirror(a.mirror, [path[0], path[0][:-5] + ".md"], logs)

    def phase(name: str, nproc: int = 1) -> dict[str, Any]:
        log = os.path.join(out, "logs", f"full_32b_hub_{name}_{a.nproc}.log")
        logs.append(log)
        print(f"[hub32] phase {name} (log {log})", flush=True)
        run = run_child(hub_32b.__file__, {**spec, "phase": name}, log, env, a.timeout, nproc=nproc)
        rec = run.record or run.error_record(a.timeout, phase=name)
        rec.update(subprocess_wall_s=run.wall_s, host_added_gib=run.host_added_bytes / GIB)
        doc[name] = rec
        write()
        if rec.get("status") != "ok":
            print(f"[hub32] phase {name} failed: {(rec.get('error') or '')[:600]}\n{log_tail(log, 30)}", flush=True)
        return rec

    t0 = time.perf_counter()
    if "write" in phases and not hub_32b.has_checkpoint(spec["hub_dir"]):
        path[0] = os.path.join(out, f"full_32b_hub_write_{slug}.json")
        if phase("write").get("status") != "ok":
            return 1
    if not hub_32b.has_checkpoint(spec["hub_dir"]):
        raise SystemExit(f"[hub32] {spec['hub_dir']} holds no checkpoint (run the write phase)")
    base = {"compute_dtype": "bfloat16", "save_dtype": "bfloat16", "host_memory_fraction": a.host_fraction,
            "placement_tokens": spec["tokens"], **(json.loads(a.megatrain_config) if a.megatrain_config else {})}
    if a.layers == "auto" and a.host_layout == "auto" and not spec["tiny"] and \
            library_layout(spec, base, host_gib, gpu_gib)[1]:
        pass  # (the full depth trains in the layout the library takes: no shallower model needed)
    elif a.layers == "auto":
        spec["layers"] = deepest_layers(spec, base, host_gib, gpu_gib)
        if not spec["layers"]:
            raise SystemExit("[hub32] not even one layer fits this host")
    elif a.layers:
        spec["layers"] = int(a.layers)
    spec["config"], doc["prediction"], doc["layout_why"] = choose_config(spec, base, a, host_gib, gpu_gib)
    spec["export"] = "reload" in phases  # (no reload asked: no save_model either)
    if a.nproc > 1:
        doc["shm_free_gib"] = shm_free_bytes(spec["config"]) / GIB
    print(f"[hub32] {spec['layers']} layers, {a.nproc} process(es): {doc['layout_why']}; planner: "
          f"{json.dumps({k: doc['prediction'].get(k) for k in ('host_need_gib', 'gpu_need_gib', 'step_s_clip')})}",
          flush=True)
    depth = "" if spec["layers"] == spec["full_layers"] else f"_{spec['layers']}layers"
    path[0] = os.path.join(out, f"full_32b_hub_{slug}_{a.nproc}gpu{depth}.json")
    if a.raw_read != "none":
        doc["raw_read"] = raw_reads(spec["hub_dir"], a.raw_read, a.read_threads)
        print(f"[hub32] raw read: {doc['raw_read']}", flush=True)
    from bench_checkpoint_io import drop_pages

    drop_pages(spec["hub_dir"])  # (the load reads from the disk, not from the write's page cache)
    write()
    ok = True
    if "train" in phases:
        ok = phase("train", a.nproc).get("status") == "ok"
    if ok and "reload" in phases:
        phase("reload")
    if not a.keep_export and os.path.isdir(spec["export_dir"]):
        shutil.rmtree(spec["export_dir"], ignore_errors=True)
    write()
    print(f"[hub32] wrote {path[0]}\n\n{summary(doc)}", flush=True)
    acc = doc["acceptance"]
    return 0 if acc["trained"] and (acc["export_reloads_with_matching_logits"] or "reload" not in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
