"""hf_megatrain vs DeepSpeed ZeRO-3 offload vs PyTorch FSDP2 CPU offload vs plain GPU training, side by side on one GPU.

One command runs each (system, regime, batch) in its own subprocess, one after the other, on the same model (Qwen2
at 14B width, ``--layers`` decoder layers, random init), the same random tokens (sequence 2048) and the same batch
per optimizer step (``--sizes``: 4 and 16 sequences = 8,192 and 32,768 tokens), bf16 compute and FP32 master
everywhere. Results are *merged* into ``<out>/bench_vs_deepspeed_<gpu>.json`` (so the runs can be spread over
several device calls) and rendered as ``<out>/bench_vs_deepspeed_<gpu>.md``; the table is printed last.

hf_megatrain runs in one or both regimes (``--regime``, issue 15); its records are kept apart per regime
(``megatrain:streamed@4``, ``megatrain:auto@4``), the peers' are not (``deepspeed@4``):

* ``streamed`` (default, the headline): every decoder layer streamed, no per-parameter state of a streamed layer on
  the GPU (``{"device_layers": 0, "device_step_layers": 0}`` merged into its config): the model people bring, many
  times the GPU's memory. Compared with the best offload peer (DeepSpeed, FSDP2).
* ``auto``: the planner's placement, i.e. a model that fits. Compared with ``plain``: the HF model entirely on the
  GPU (FP32 master, bf16 autocast, activation checkpointing, fused torch AdamW, gradient accumulation).

hf_megatrain's record and table also carry the host AdamW rate over the timed steps (G param/s, bytes moved per
parameter, GB/s) and the forward's wait on the previous step's optimizer as a share of the step.

    bash integration/install_peers.sh   # on the device, before DeepSpeed runs (offline, from .carry/wheels)
    python integration/bench_vs_deepspeed.py --regime streamed --systems megatrain,deepspeed,fsdp2 \\
        --sizes 4,16 --max-grad-norm 1e4
    python integration/bench_vs_deepspeed.py --regime auto --systems megatrain,plain --sizes 4,16 --max-grad-norm 1e4
    python integration/bench_vs_deepspeed.py --regime streamed,auto --systems megatrain --sizes 4,16
    python integration/bench_vs_deepspeed.py --tiny --systems megatrain,plain --megatrain-mode engine   # CPU smoke

A failing run (OOM, DeepSpeed missing, timeout) becomes an error record and the next run goes on. With
``auto`` micro-batching a run that OOMs is retried smaller: peers and plain with gradient accumulation
(16 -> 8x2 -> 4x4), hf_megatrain with its in-layer split (micro_batch_size 0 -> 4). Every attempt is kept in the
record.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from bench import child  # noqa: E402
from bench import record as schema  # noqa: E402
from bench.common import FULL_SEQ, PEAK_TFLOPS, REGIMES, TINY_SEQ, regime_of, versions  # noqa: E402
from bench.record import gpu_slug, mirror  # noqa: E402

RUNNERS = {"megatrain": "run_megatrain.py", "plain": "run_plain.py", "deepspeed": "run_deepspeed.py",
           "fsdp2": "run_fsdp2.py"}
PEERS = ("deepspeed", "fsdp2")  # the offload peers: the streamed regime's reference (plain is the auto regime's)
PEERS_SITE = "/tmp/bench_peers_site"  # install_peers.sh's fallback --target
# Published figures (H100 80GB, PCIe Gen5, same model/data/batches): tokens/s at batch 4 and 16 (x 2048 tokens).
REFERENCE = {"deepspeed": {"4": 3798, "16": 10938, "version": "DeepSpeed 0.19.8"},
             "fsdp2": {"4": 4261, "16": 10799, "version": "torch 2.11 FSDP2 CPUOffloadPolicy"},
             "hardware": "H100 80GB, PCIe Gen5"}
LABEL = {"megatrain": "hf_megatrain", "plain": "plain HF on the GPU (no offload)",
         "deepspeed": "DeepSpeed ZeRO-3 offload", "fsdp2": "FSDP2 CPU offload"}


# -- plan -------------------------------------------------------------------------------------------------------------
def megatrain_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        return "trainer" if importlib.util.find_spec("hf_megatrain.hf.trainer") is not None else "engine"
    except (ImportError, ValueError):
        return "engine"


def attempts(system: str, batch: int, a: argparse.Namespace, regime: str = "streamed") -> list[dict[str, Any]]:
    """Spec overrides to try in order (best first); the next one runs only if the previous one ran out of memory.
    ``regime`` (REGIMES) applies to hf_megatrain only: the peers place the model their own way in both."""
    if system == "megatrain":
        # torch_compile on by default for the real model (docs/configuration.md: ~17 % faster steps); the tiny CPU
        # smoke run skips it (compilation would dominate). The regime's overlay last (parse_args refuses a
        # --megatrain-config that contradicts it).
        # The fine-tune regime runs the config's defaults (issue 31: only the regime's placement forced).
        default = {} if a.data == "finetune" else {"torch_compile": not a.tiny}
        base = {**default, **(json.loads(a.megatrain_config) if a.megatrain_config else {}), **REGIMES[regime]}
        if regime == "auto":  # as a user who knows the batch: auto placement plans the GPU for this step's tokens
            base.setdefault("placement_tokens", batch if a.data == "finetune" else
                            batch * (a.seq or (TINY_SEQ if a.tiny else FULL_SEQ)))
        if a.megatrain_split == "auto":
            splits = [int(base.get("micro_batch_size", 0))] + ([4] if batch > 4 and not base.get(
                "micro_batch_size") else [])
        else:
            splits = [int(a.megatrain_split)]
        return [{"mode": megatrain_mode(a.megatrain_mode), "regime": regime,
                 "megatrain_config": {**base, "micro_batch_size": s}} for s in splits]
    choice = {"deepspeed": a.ds_micro, "fsdp2": a.fsdp_micro, "plain": a.plain_micro}[system]
    if a.data == "finetune":  # rows per step vary: the step in 1, 2, 4 micro-batches (gradient accumulation)
        gas = [1, 2, 4] if choice == "auto" else [int(choice)]
        return [{"micro_batch": None, "grad_accum": g, **peer_extra(system, a)} for g in gas]
    if choice == "auto":
        micros = [m for m in (batch, batch // 2, batch // 4) if m >= 1 and batch % m == 0]
        micros = list(dict.fromkeys(micros))
    else:
        micros = [int(choice)]
    return [{"micro_batch": m, "grad_accum": batch // m, **peer_extra(system, a)} for m in micros]


def peer_extra(system: str, a: argparse.Namespace) -> dict[str, Any]:
    if system == "deepspeed":
        return {"ds": ds_overrides(a), "ds_model_dtype": a.ds_model_dtype}
    if system == "fsdp2":
        return {"fsdp": {"reshard_after_forward": a.fsdp_reshard_after_forward == "true",
                         "optimizer": a.fsdp_optimizer, "no_sync_during_accumulation": not a.fsdp_sync_every_micro}}
    return {}


def ds_overrides(a: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {}
    for flag, key in (("ds_prefetch_bucket", "stage3_prefetch_bucket_size"),
                      ("ds_persistence_threshold", "stage3_param_persistence_threshold"),
                      ("ds_reduce_bucket", "reduce_bucket_size"), ("ds_max_live", "stage3_max_live_parameters"),
                      ("ds_max_reuse", "stage3_max_reuse_distance"), ("ds_sub_group", "sub_group_size")):
        v = getattr(a, flag)
        if v is not None:
            zero[key] = int(float(v))
    out: dict[str, Any] = {"zero_optimization": zero} if zero else {}
    if a.ds_offload_ratio is not None:
        out.setdefault("zero_optimization", {})["offload_optimizer"] = {"device": "cpu", "pin_memory": True,
                                                                        "ratio": a.ds_offload_ratio}
    if a.ds_json:
        extra = json.loads(a.ds_json)
        for k, v in extra.items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = {**out[k], **v}
            else:
                out[k] = v
    return out


# -- running one system -------------------------------------------------------------------------------------------------
def child_env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    paths = [ROOT] + ([PEERS_SITE] if os.path.isdir(PEERS_SITE) else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if a.alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env




def run_child(system: str, spec: dict, a: argparse.Namespace, timeout: float, log_path: str) -> dict[str, Any]:
    n = int(spec.get("nproc", 1))
    run = child.run_child(os.path.join(HERE, "bench", RUNNERS[system]), spec, log_path, child_env(a), timeout,
                          nproc=n)
    record = run.record or run.error_record(timeout, system=system, batch=spec["batch"], spec=spec)
    record["processes"] = n
    record["host_added_peak_gib"] = run.host_added_bytes / 2 ** 30  # (the host's, every process counted once)
    # While training (the steps' ends, sampled by rank 0): the store and what every process holds through the run,
    # without what a rank held only while building its copy of the model before the conversion.
    used = [s["host_used_bytes"] for s in record.get("per_step") or [] if s.get("host_used_bytes")]
    if used:
        record["host_added_training_gib"] = (max(used) - run.host_base_bytes) / 2 ** 30
    record["subprocess_wall_s"] = run.wall_s
    record["log"] = os.path.relpath(log_path, ROOT) if log_path.startswith(ROOT) else log_path
    return record


# -- results ------------------------------------------------------------------------------------------------------------
def record_regime(rec: dict) -> str:
    """hf_megatrain's regime of a record ('' for the peers, which place the model the same way in both). Records
    from before --regime ran the planner's placement: their spec's config lacks the streamed overlay -> auto."""
    if rec["system"] != "megatrain":
        return ""
    spec = rec.get("spec") or {}
    return rec.get("regime") or spec.get("regime") or regime_of(spec.get("megatrain_config") or {})


def record_key(rec: dict) -> str:
    """``system@batch``; hf_megatrain's rows also name their regime: ``megatrain:streamed@4``; runs of N > 1
    processes (one GPU each, ``batch`` per process) end in ``xN``: ``megatrain:streamed@16x2``."""
    regime = record_regime(rec)
    n = int(rec.get("processes") or (rec.get("spec") or {}).get("nproc") or 1)
    return f"{rec['system']}{':' + regime if regime else ''}@{rec['batch']}" + (f"x{n}" if n > 1 else "")


def scaling(records: dict[str, dict]) -> list[dict[str, Any]]:
    """Per (system, batch per GPU, N > 1): tokens/s of N processes over one process on the same machine, host
    memory added over one process's, and hf_megatrain over DeepSpeed at the same N."""
    ok = {k: r for k, r in records.items() if r.get("status") == "ok"}
    out = []
    for key, r in sorted(ok.items()):
        base, _, n = key.rpartition("x")
        if "@" not in base or not n.isdigit():
            continue
        one = ok.get(base)
        row: dict[str, Any] = {"key": key, "processes": int(n), "tokens_per_s": r["tokens_per_s"],
                               "mfu_per_gpu": r.get("mfu")}
        if one:
            row.update(one_process_tokens_per_s=one["tokens_per_s"], speedup=r["tokens_per_s"] / one["tokens_per_s"],
                       host_ratio=(r.get("host_added_peak_gib") or 0) / max(one.get("host_added_peak_gib") or 0,
                                                                            1e-9))
            if r.get("host_added_training_gib") and one.get("host_added_training_gib"):
                row["host_training_ratio"] = r["host_added_training_gib"] / one["host_added_training_gib"]
        if r["system"] == "megatrain":
            ds = ok.get(f"deepspeed@{r['batch']}x{n}")
            if ds:
                row["vs_deepspeed"] = r["tokens_per_s"] / ds["tokens_per_s"]
        out.append(row)
    return out


def ratios(records: dict[str, dict]) -> dict[str, Any]:
    """Per batch: the best offload peer, the plain-GPU peer and, per regime run, hf_megatrain over each of them
    (the streamed regime's reference is the best offload peer, the auto regime's is plain)."""
    def ok(key: str) -> dict | None:
        r = records.get(key)
        return r if r and r.get("status") == "ok" else None

    out: dict[str, Any] = {}
    sizes = sorted({int(r["batch"]) for r in records.values() if r.get("batch") is not None})
    for b in sizes:
        peers = {s: r for s in PEERS if (r := ok(f"{s}@{b}"))}
        plain = ok(f"plain@{b}")
        entry: dict[str, Any] = {}
        if peers:
            best = max(peers, key=lambda s: peers[s]["tokens_per_s"])
            entry.update(best_peer=best, best_peer_tokens_per_s=peers[best]["tokens_per_s"])
        if plain:
            entry["plain_tokens_per_s"] = plain["tokens_per_s"]
        ref = max(REFERENCE[s][str(b)] for s in PEERS) if all(str(b) in REFERENCE[s] for s in PEERS) else None
        for regime in REGIMES:
            ours = ok(f"megatrain:{regime}@{b}")
            if not ours:
                continue
            tps = ours["tokens_per_s"]
            e: dict[str, Any] = {"ours_tokens_per_s": tps}
            if peers:
                e["ours_over_best_peer"] = tps / peers[best]["tokens_per_s"]
            if plain:
                e["ours_over_plain"] = tps / plain["tokens_per_s"]
            if ref:
                e["ours_over_best_published_peer"] = tps / ref
            entry[regime] = e
        out[str(b)] = entry
    return out


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _row_order(r: dict) -> tuple[int, int, int]:
    return int(r["batch"]), list(RUNNERS).index(r["system"]), (list(REGIMES)[::-1] + [""]).index(record_regime(r))


def _versus(r: dict, rat: dict) -> str:
    """hf_megatrain's row against its regime's reference: streamed -> best offload peer, auto -> plain."""
    if r["system"] != "megatrain":
        return ""
    regime = record_regime(r)
    entry = rat.get(str(r["batch"]), {})
    if regime.startswith("streamed") and "ours_over_best_peer" in entry.get(regime, {}):
        return f"{entry[regime]['ours_over_best_peer']:.2f}x {LABEL[entry['best_peer']]}"
    if regime == "auto" and "ours_over_plain" in entry.get(regime, {}):
        return f"{entry[regime]['ours_over_plain']:.2f}x plain"
    return "—"


def step_tokens(spec: dict, batch: int) -> int:
    """Tokens per step of a record's ``batch``: sequences x seq, or (fine-tune) the real-token budget itself."""
    return batch if spec.get("data") == "finetune" else batch * spec["seq"]


def finetune_note(spec: dict) -> list[str]:
    if spec.get("data") != "finetune":
        return []
    return [f"**Fine-tune regime** (`--data finetune --layout {spec['layout']}`): variable-length sequences from "
            "integration/bench/sft_lengths.json (a SYNTHETIC log-normal fit, median 600 tokens, truncated at "
            f"{spec['seq']:,}; see its provenance), each step exactly the stated REAL tokens; "
            + ("padded to the step's longest (length-grouped like Trainer's group_by_length)"
               if spec["layout"] == "padded" else "packed into rows of "
               f"{spec['seq']:,} tokens, position_ids restarting per sequence, no attention mask")
            + "; hf_megatrain with the config's defaults (only the regime's placement forced); tokens/s, TFLOP/s "
            "and MFU count real tokens only (6·N·real tokens/s), totals over the timed steps.", ""]


def markdown(doc: dict) -> str:
    recs, rat = doc["records"], doc["ratios"]
    n = next((r.get("n_params") for r in recs.values() if r.get("n_params")), None)
    spec = doc["spec"]
    lines = [f"# hf_megatrain vs DeepSpeed ZeRO-3 offload vs FSDP2 CPU offload vs plain GPU — {doc['gpu']}", "",
             f"Model: Qwen2 {'tiny' if spec['tiny'] else '14B-width'} x {spec['layers']} layers, "
             f"N = {_f(n, '{:,}')} params, sequence {spec['seq']}, random init and tokens; bf16 compute, "
             f"FP32 master, AdamW on the CPU (plain: fused AdamW on the GPU), grad clip "
             f"{spec.get('max_grad_norm', 1.0):g}. Step time = median of the timed steps; "
             f"model TFLOP/s = 6·N·tokens/s; MFU vs {spec['peak_tflops']:.0f} TFLOP/s. hf_megatrain regimes: "
             "**streamed** = every decoder layer streamed, no per-parameter state of a streamed layer on the GPU "
             "(`device_layers=0, device_step_layers=0`: a model many times the GPU's memory), compared with the "
             "best offload peer; **auto** = the planner's placement (the model fits), compared with plain.", ""] + \
        finetune_note(spec) + [
             "| tokens/step | system | micro x GA (split) | step s | tokens/s | TFLOP/s | MFU | GPU alloc / reserved "
             "GiB | host RSS GiB | hf_megatrain vs reference |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    keys = sorted(recs, key=lambda k: _row_order(recs[k]))
    for k in keys:
        r = recs[k]
        b = int(r["batch"])
        nproc = int(r.get("processes") or 1)
        tokens = step_tokens(spec, b) * nproc
        label = LABEL[r["system"]]
        if r["system"] == "megatrain":
            label += f" ({record_regime(r)})"
        if nproc > 1:
            label += f", {nproc} GPUs"
        if r.get("status") != "ok":
            why = (r.get("error") or r.get("status", "")).splitlines()[0][:90]
            lines.append(f"| {tokens:,} | {label} | — | — | **{r.get('status')}**: {why} | | | | | |")
            continue
        shape = f"{r.get('micro_batch') or 'rows/GA'} x {r.get('grad_accum')}"
        if r["system"] == "megatrain":
            shape = f"{b} x 1 (split {r.get('in_layer_split') or 'none'}, {r.get('mode')})"
        lines.append(
            f"| {tokens:,} | {label} | {shape} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f}"
            + (f" ({r['total_tokens_per_s']:,.0f} with padding)" if r.get("timed_padding_frac") else "") + " | "
            f"{r['model_tflops']:.1f} | {r['mfu']:.1%} | {_f(r.get('peak_gpu_alloc_gib'), '{:.1f}')} / "
            f"{_f(r.get('peak_gpu_reserved_gib'), '{:.1f}')} | {_f(r.get('peak_host_rss_gib'), '{:.1f}')} | "
            f"{_versus(r, rat)} |")
    ref = REFERENCE
    lines += ["", f"Published reference ({ref['hardware']}): {ref['deepspeed']['version']}: "
              f"{ref['deepspeed']['4']:,} tok/s at 8k tokens/step, {ref['deepspeed']['16']:,} at 32k; "
              f"{ref['fsdp2']['version']}: {ref['fsdp2']['4']:,} and {ref['fsdp2']['16']:,}."]
    phase_rows = [recs[k] for k in keys if recs[k]["system"] == "megatrain" and recs[k].get("status") == "ok"]
    if phase_rows:
        lines += ["", "hf_megatrain, one profiled step (ms), CPU optimizer (s, medians of the timed steps) and the "
                  "host AdamW pass over the timed steps (G param/s = params updated on the host / seconds updating "
                  "them, speculative updates included; bytes moved per parameter; GB/s = their product):", "",
                  "| tokens/step | regime | step window | compute (stream busy) | H2D | D2H | GPU idle | opt worker | "
                  "fwd waits on opt: host (÷ step) | GPU idle for it (÷ step) | opt step() call | "
                  "host AdamW G param/s | B/param | GB/s | host DRAM GB/step (AdamW + DMA), GB/s over the step |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in phase_rows:
            p, c, h = r.get("phases") or {}, r.get("cpu_optimizer") or {}, r.get("host_adamw") or {}
            idle = f"{p['gpu_idle_ms']:.0f} ({p['gpu_idle_frac']:.0%})" if "gpu_idle_ms" in p else "—"
            lines.append(f"| {step_tokens(spec, int(r['batch'])):,} | {record_regime(r)} | "
                         f"{_f(p.get('window_ms'), '{:.0f}')} | "
                         f"{_f(p.get('compute_ms'), '{:.0f}')} ({_f(p.get('compute_busy_ms'), '{:.0f}')}) | "
                         f"{_f(p.get('h2d_ms'), '{:.0f}')} | {_f(p.get('d2h_ms'), '{:.0f}')} | {idle} | "
                         f"{_f(c.get('optimizer_worker_s'), '{:.3f}')} | "
                         f"{_f(c.get('forward_wait_for_optimizer_s'), '{:.3f}')} "
                         f"({_f(wait_share(r), '{:.1%}')}) | "
                         f"{_f(c.get('forward_gpu_wait_for_optimizer_s'), '{:.3f}')} "
                         f"({_f(wait_share(r, gpu=True), '{:.1%}')}) | "
                         f"{_f(c.get('optimizer_step_call_s'), '{:.3f}')} | {_f(h.get('gparam_per_s'))} | "
                         f"{_f(h.get('bytes_per_param'), '{:.1f}')} | {_f(h.get('gb_per_s'), '{:.1f}')} | "
                         f"{_f(h.get('host_dram_gb_per_step'), '{:.1f}')} ({_f(h.get('dma_gb_per_step'), '{:.1f}')} DMA)"
                         f", {_f(h.get('host_dram_gb_per_s'), '{:.0f}')} |")
    if doc.get("scaling"):
        lines += ["", "Several GPUs of this machine (batch per GPU; one process per GPU through torchrun; host memory "
                  "= MemTotal - MemAvailable added, shared pages once: at the step ends, and at the peak, which "
                  "includes each rank's copy of the model before the conversion):", "",
                  "| run | tokens/s | MFU per GPU | over one process | host memory over one process: training "
                  "(peak) | hf_megatrain over DeepSpeed (same N) |", "|---|---:|---:|---:|---:|---:|"]
        for row in doc["scaling"]:
            lines.append(f"| {row['key']} | {row['tokens_per_s']:,.0f} | {_f(row.get('mfu_per_gpu'), '{:.1%}')} | "
                         f"{_f(row.get('speedup'))}x | {_f(row.get('host_training_ratio'))}x "
                         f"({_f(row.get('host_ratio'))}x) | "
                         f"{_f(row.get('vs_deepspeed'))}x |")
    lines += ["", f"Updated {doc['date']}. Commands:", ""] + [f"    {c['command']}" for c in doc["runs"][-6:]]
    return "\n".join(lines) + "\n"


def merge_and_write(path_json: str, doc_new: dict, fresh: bool) -> dict:
    doc = None
    if os.path.exists(path_json) and not fresh:
        with open(path_json) as f:
            doc = json.load(f)
        if {k: doc["spec"].get(k) for k in ("tiny", "layers", "seq")} != \
                {k: doc_new["spec"][k] for k in ("tiny", "layers", "seq")}:
            raise SystemExit(f"{path_json} holds results for a different model/sequence ({doc['spec']}); use "
                             "another --out or --fresh")
    if doc is None:
        doc = {k: v for k, v in doc_new.items() if k != "records"}
        doc["records"], doc["runs"] = {}, []
    # Keyed from the records themselves, so files written before --regime (``megatrain@4``) merge as ``auto``.
    doc["records"] = {record_key(r): r for r in doc["records"].values()}
    for rec in doc_new["records"].values():
        key = record_key(rec)
        if rec.get("status") == "skipped" and key in doc["records"]:
            continue  # a run skipped for time never hides an earlier result
        doc["records"][key] = rec
    doc.update({k: doc_new[k] for k in ("date", "gpu", "commit", "machine", "versions") if k in doc_new},
               reference=REFERENCE)
    doc["spec"] = {**doc.get("spec", {}), **doc_new["spec"]}
    if not doc["runs"] or doc["runs"][-1].get("command") != doc_new["run"]["command"] or \
            doc["runs"][-1].get("started") != doc_new["run"]["started"]:
        doc["runs"].append(doc_new["run"])
    else:
        doc["runs"][-1] = doc_new["run"]
    doc["ratios"] = ratios(doc["records"])
    doc["scaling"] = scaling(doc["records"])
    doc.pop("run", None)
    schema.write(path_json, doc, markdown(doc))
    return doc


def wait_share(r: dict, gpu: bool = False) -> float | None:
    """hf_megatrain's forward wait on the previous step's optimizer over the step time (medians of the timed steps;
    issue 15 wants < 5%): the host's wait, or (``gpu``) the GPU's idle for the loads that waited (the update's wait
    and the copy after it: engine/slots.py) -- the host waits while queued GPU work runs, so the first overstates
    what the step loses. Derived here, so older records show it too."""
    key = "forward_gpu_wait_for_optimizer_s" if gpu else "forward_wait_for_optimizer_s"
    wait = (r.get("cpu_optimizer") or {}).get(key)
    return wait / r["step_time_s"] if wait is not None and r.get("step_time_s") else None


def host_note(r: dict) -> str:
    """hf_megatrain's host AdamW rate and forward wait, for the progress line ('' for the others)."""
    h = r.get("host_adamw") or {}
    if not h.get("gparam_per_s"):
        return ""
    return (f"; host AdamW {h['gparam_per_s']:.2f} G param/s x {h['bytes_per_param']:.1f} B/param = "
            f"{h['gb_per_s']:.1f} GB/s; host DRAM {_f(h.get('host_dram_gb_per_step'), '{:.1f}')} GB/step "
            f"({_f(h.get('host_dram_gb_per_s'), '{:.0f}')} GB/s over the step); forward waits on the optimizer {_f(wait_share(r), '{:.1%}')} of "
            f"the step (the GPU idle for it: {_f(wait_share(r, gpu=True), '{:.1%}')})")


# -- CLI ----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="megatrain,deepspeed,fsdp2", help="comma list of " + ",".join(RUNNERS))
    ap.add_argument("--regime", default="streamed",
                    help="hf_megatrain's placement, comma list of " + ",".join(REGIMES) + ": streamed = every "
                         "decoder layer streamed, no per-parameter state of a streamed layer on the GPU (a model "
                         "many times the GPU's memory; the headline, vs the offload peers); streamed_gpu_step = "
                         "the same with layer 0 stepped on the GPU, its state streamed each step; auto = the planner's "
                         "placement (the model fits; vs plain). The peers run once whatever the regime")
    ap.add_argument("--sizes", default="4,16", help="sequences per optimizer step (x seq tokens), per process")
    ap.add_argument("--nproc", default="1", help="comma list of process counts (one GPU each, through torchrun as "
                    "accelerate launch --multi_gpu starts them); each system runs once per count")
    ap.add_argument("--data", choices=("fixed", "finetune"), default="fixed",
                    help="fixed: random tokens, --seq each (the headline); finetune: variable lengths from "
                         "bench/sft_lengths.json, --tokens REAL tokens per step, hf_megatrain on the config's "
                         "defaults (issue 31; bench/finetune_data.py)")
    ap.add_argument("--layout", choices=("padded", "packed"), default="padded",
                    help="finetune: pad each step's sequences to its longest, or pack them into rows of the "
                         "longest length with position_ids restarting per sequence (DataCollatorWithFlattening)")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "flex_attention", "eager"),
                    help="the model's attn_implementation, for every system (packed rows: transformers builds a "
                         "block-causal mask from the positions; flex_attention skips the blocks it masks out, and "
                         "hf_megatrain's compiled layers route its packed rows to SDPA: model/attention.py)")
    ap.add_argument("--tokens", default=None,
                    help="finetune: real tokens per optimizer step, comma list (default 32768; 512 with --tiny); "
                         "a multiple of the longest length (4096; 64 with --tiny) for --layout packed")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; 2 with --tiny)")
    ap.add_argument("--seq", type=int, default=None, help=f"default {FULL_SEQ} ({TINY_SEQ} with --tiny)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="global-norm clip for every system (1.0: clips every step at random init; a large value "
                         "such as 1e4 keeps clipping configured but inactive, as in a typical fine-tune)")
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen2 (CPU smoke test of the plumbing)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_vs_deepspeed"))
    ap.add_argument("--fresh", action="store_true", help="overwrite instead of merging into the existing JSON")
    ap.add_argument("--mirror", default=None, metavar="DIR",
                    help="also copy the JSON, the table and this invocation's logs here after every run (e.g. "
                         "$OUT on the device, so results survive the command being cut off)")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per subprocess")
    ap.add_argument("--budget", type=float, default=570,
                    help="seconds for this whole invocation: later runs get what is left, none start below 60 s")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--no-profile", action="store_true", help="skip hf_megatrain's extra profiled step")
    ap.add_argument("--keep-trace", action="store_true", help="keep the chrome trace (gzipped) next to the results")
    ap.add_argument("--profile-steps", type=int, default=1,
                    help="consecutive steps in hf_megatrain's profile (2+ shows the overlapped optimizer)")
    ap.add_argument("--timeline", action="store_true",
                    help="hf_megatrain (trainer mode): host timestamps of each step's phases (bench/timeline.py)")
    ap.add_argument("--clock-sync", choices=("device", "stream"), default="device",
                    help="step clock: synchronise the whole device at each step end, or the main stream only")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="extra env for every runner")
    ap.add_argument("--alloc-conf", default="expandable_segments:True",
                    help="PYTORCH_CUDA_ALLOC_CONF for every runner unless already set ('' = none)")
    ap.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    g = ap.add_argument_group("hf_megatrain")
    g.add_argument("--megatrain-mode", choices=("auto", "trainer", "engine"), default="auto",
                   help="auto = MegaTrainTrainer if hf_megatrain.hf.trainer exists, else the bare engine")
    g.add_argument("--megatrain-config", default=None, help="JSON dict of MegaTrainConfig overrides "
                   "(default {\"torch_compile\": true}; false with --tiny)")
    g.add_argument("--megatrain-split", default="auto",
                   help="micro_batch_size inside the layer visit: int, or auto (none; 4 if that OOMs)")
    g = ap.add_argument_group("plain (HF Trainer, whole model on the GPU: FP32 master, bf16 autocast, "
                              "checkpointing, fused AdamW)")
    g.add_argument("--plain-micro", default="auto", help="micro-batch (GA = batch / micro) or auto (largest that fits)")
    g = ap.add_argument_group("DeepSpeed (ZeRO-3 offload through transformers.Trainer)")
    g.add_argument("--ds-micro", default="auto", help="micro-batch (GA = batch / micro) or auto (largest that fits)")
    g.add_argument("--ds-prefetch-bucket", default=None, help="stage3_prefetch_bucket_size (default 5e8)")
    g.add_argument("--ds-persistence-threshold", default=None, help="stage3_param_persistence_threshold (1e6)")
    g.add_argument("--ds-reduce-bucket", default=None, help="reduce_bucket_size (5e8)")
    g.add_argument("--ds-max-live", default=None, help="stage3_max_live_parameters (2e9)")
    g.add_argument("--ds-max-reuse", default=None, help="stage3_max_reuse_distance (2e9)")
    g.add_argument("--ds-sub-group", default=None, help="sub_group_size (1e9)")
    g.add_argument("--ds-offload-ratio", type=float, default=None,
                   help="offload_optimizer.ratio (<1 keeps part of the optimizer on the GPU; default 1.0)")
    g.add_argument("--ds-json", default=None, help="JSON merged into the DeepSpeed config last")
    g.add_argument("--ds-model-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g = ap.add_argument_group("FSDP2 (fully_shard + CPUOffloadPolicy)")
    g.add_argument("--fsdp-micro", default="auto", help="micro-batch (GA = batch / micro) or auto")
    g.add_argument("--fsdp-reshard-after-forward", choices=("true", "false"), default="true")
    g.add_argument("--fsdp-optimizer", choices=("auto", "fused", "foreach"), default="auto")
    g.add_argument("--fsdp-sync-every-micro", action="store_true",
                   help="reduce/offload grads every micro-batch (default: set_requires_gradient_sync(False) "
                        "until the last micro-batch)")
    a = ap.parse_args(argv)
    if a.max_grad_norm < 0:
        ap.error(f"--max-grad-norm {a.max_grad_norm}: use 0 (no clipping) or a positive threshold")
    a.regimes = list(dict.fromkeys(r.strip() for r in a.regime.split(",") if r.strip()))
    if not a.regimes or any(r not in REGIMES for r in a.regimes):
        ap.error(f"--regime {a.regime!r}: choose from {', '.join(REGIMES)} (comma list)")
    user = json.loads(a.megatrain_config) if a.megatrain_config else {}
    clash = {k: v for r in a.regimes for k, v in REGIMES[r].items() if k in user and user[k] != v}
    if clash:  # the record would carry a regime its placement does not have
        ap.error(f"--megatrain-config sets {sorted(clash)} against --regime {a.regime} ({clash}); drop them or "
                 "change --regime")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in RUNNERS]
    if bad:
        raise SystemExit(f"unknown systems {bad}; choose from {list(RUNNERS)}")
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    seq = a.seq or (TINY_SEQ if a.tiny else FULL_SEQ)
    if a.data == "finetune":  # a record's "batch" is then its real-token budget; seq the longest sequence
        from bench.finetune_data import FULL_MAX_LEN, TINY_MAX_LEN

        sizes = [int(t) for t in (a.tokens or ("512" if a.tiny else "32768")).split(",") if t.strip()]
        seq = a.seq or (TINY_MAX_LEN if a.tiny else FULL_MAX_LEN)
    a.layers = a.layers or (2 if a.tiny else 8)
    gpu_name, slug = gpu_slug(a.tiny)
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    kind = f"finetune_{a.layout}_" if a.data == "finetune" else ""
    path_json = os.path.join(a.out, f"bench_vs_deepspeed_{kind}{slug}.json")
    base = {"tiny": a.tiny, "layers": a.layers, "seq": seq, "warmup": a.warmup, "steps": a.steps,
            "max_grad_norm": a.max_grad_norm,
            "profile": not a.no_profile, "profile_steps": a.profile_steps, "keep_trace": a.keep_trace,
            "peak_tflops": a.peak_tflops, "seed": 0, "timeline": a.timeline, "clock_sync": a.clock_sync,
            "trace_dir": os.path.abspath(a.out) if a.keep_trace else None}
    if a.data == "finetune":
        base.update(data="finetune", layout=a.layout, max_len=seq)
    if a.attn != "sdpa":  # (every system runs the same attention implementation)
        base["attn"] = a.attn
    command = schema.command(__file__, argv, called="bench_vs_deepspeed")
    started, commit, host = schema.now(), schema.commit(), schema.machine()
    # hf_megatrain once per regime; the peers once (their placement does not depend on it).
    nprocs = [int(n) for n in a.nproc.split(",") if n.strip()]
    plan = [(s, r, b, [{**t, "nproc": n} for t in attempts(s, b, a, r or "streamed")]) for n in nprocs
            for s in systems for r in (a.regimes if s == "megatrain" else [""]) for b in sizes]
    print(f"[bench] {gpu_name}: {len(plan)} runs -> {path_json}", flush=True)
    for s, r, b, tries in plan:
        print(f"[bench]   {s}{' ' + r if r else ''} batch {b} ({b if a.data == 'finetune' else b * seq:,} "
              f"tokens/step per process) x{tries[0]['nproc']}: attempts {tries}",
              flush=True)
    if a.dry_run:
        return 0
    env_note = {k: v for k, v in child_env(a).items() if k in ("PYTORCH_CUDA_ALLOC_CONF", "OMP_WAIT_POLICY",
                                                                  "OMP_NUM_THREADS")} | dict(
        kv.partition("=")[::2] for kv in a.env)
    t_start = time.perf_counter()
    doc: dict[str, Any] = {}
    logs: list[str] = []
    for system, regime, batch, tries in plan:
        name = system + (f"_{regime}" if regime else "") + (f"_x{tries[0]['nproc']}" if tries[0]["nproc"] > 1 else "")

        def attempt(over: dict[str, Any], timeout: float, log: str) -> dict[str, Any]:
            spec = {**base, **over, "system": system, "batch": batch}
            if a.data == "finetune":
                spec["tokens"] = batch
            return run_child(system, spec, a, timeout, log)

        record, history = child.run_attempts(
            tries, attempt,
            log_path=lambda i: os.path.join(a.out, "logs", f"{name}_b{batch}{f'_try{i + 1}' if i else ''}.log"),
            budget=a.budget, started=t_start, timeout=a.timeout, tag="[bench]", what=f"{name} batch {batch}",
            skipped={"system": system, "batch": batch}, logs=logs,
            summary=lambda r: f"{r['tokens_per_s']:,.0f} tok/s, step {r['step_time_s']:.3f}s" + host_note(r))
        if regime:
            record["regime"] = regime  # (also on error / skipped records: their key names it)
            record["forward_wait_share"] = wait_share(record) if record.get("status") == "ok" else None
            record["forward_gpu_wait_share"] = wait_share(record, gpu=True) if record.get("status") == "ok" else None
        record["attempts_before"] = history
        record["env"] = env_note
        doc = merge_and_write(path_json, {
            "gpu": gpu_name, "date": schema.now(), "commit": commit, "machine": host, "versions": versions(),
            "spec": {k: base[k] for k in ("tiny", "layers", "seq", "peak_tflops", "max_grad_norm", "data", "layout",
                                          "attn") if k in base},
            "run": {"command": command, "commit": commit, "started": started, "systems": systems, "sizes": sizes},
            "records": {"new": record}}, fresh=a.fresh and not doc)
        if a.mirror:
            mirror(a.mirror, [path_json, path_json[:-5] + ".md"], logs)
    if doc:
        print(f"[bench] wrote {path_json} and {path_json[:-5]}.md\n", flush=True)
        for row in doc.get("scaling") or []:
            print("[bench] scaling " + json.dumps(row), flush=True)
        print(markdown(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
