"""DPO training steps with TRL's DPOTrainer on the bench model: hf_megatrain (every layer streamed) beside DeepSpeed
ZeRO-3 offload (issue 33's GPU acceptance line).

One command runs each (system, pairs) in its own subprocess, one after the other (bench/run_dpo_megatrain.py,
bench/run_dpo_deepspeed.py), on the main benchmark's model (bench/common.py: Qwen2 at 14B width, ``--layers``
decoder layers, random init, bf16 compute, FP32 master), the same synthetic preference pairs (random token ids:
a ``--prompt-len`` prompt, chosen and rejected completions of ``--completion-len`` each; bench/run_dpo_common.py)
and the same DPOConfig hyper-parameters (sigmoid loss, beta 0.1, lr 1e-5 constant, no weight decay, the
``--max-grad-norm`` clip), the reference log-probabilities precomputed by the policy before training
(``precompute_ref_log_probs=True``: no second model on the GPU) for both:

* ``megatrain``: ``MegaTrainDPOTrainer`` (hf/dpo_support.py), ``device_layers=0, device_step_layers=0`` merged
  into its ``megatrain_config`` (the ``streamed`` regime of bench_vs_deepspeed.py);
* ``deepspeed``: plain ``trl.DPOTrainer`` with ``DPOConfig(deepspeed=<the main benchmark's ZeRO-3 dict>)``:
  parameters and optimizer offloaded to pinned CPU memory, DeepSpeedCPUAdam, activation checkpointing.

A step of ``--pairs`` P is 2P rows (DPOTrainer concatenates chosen and rejected) of prompt+completion tokens: with the
defaults (512 + 1536) P=4 is 16,384 tokens per optimizer step and P=8 32,768. Per system the record holds the step
time (median of the timed steps after the warm-up), pairs/s, tokens/s, model TFLOP/s = 6·N·tokens/s of the policy's
training and the MFU against ``--peak-tflops``; the reference precompute (one no-grad forward over the whole dataset
in DPOTrainer's ``__init__``, 2·N per token) is timed apart (``ref_precompute_s``, its tokens/s and TFLOP/s) and is
in none of those; peak GPU and host memory are over the whole subprocess, precompute included. Results are merged
into ``<out>/bench_dpo_<gpu>.json`` with the command and rendered as ``<out>/bench_dpo_<gpu>.md``.

On the device (carry ``.carry``: trl / datasets / transformers / peft wheels in .carry/dpo_wheels, DeepSpeed's in
.carry/wheels; one pair count per call, ~6-8 min each with the install):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/dpo_wheels/*.whl && \
      export PYTHONPATH=/tmp/site:$PWD && PREBUILD_CPU_ADAM=1 bash integration/install_peers.sh && \
      python3 integration/bench_dpo.py --pairs 8 --budget 390 --timeout 300 --mirror $OUT   # 32k tokens per step
    ... the same with --pairs 4 (16k tokens per step), merged into the same JSON when the first call's
    integration/results/bench_dpo/bench_dpo_<gpu>.json is in the working tree
    python integration/bench_dpo.py --tiny          # CPU smoke (hf_megatrain; DeepSpeed absent -> error record)

A failing run (OOM, DeepSpeed missing, timeout) becomes an error record and the next run goes on; with ``--micro
auto`` a run that runs out of memory is retried with gradient accumulation (P -> P/2 x 2 -> P/4 x 4 pairs), every
attempt kept in the record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from bench import record as schema  # noqa: E402
from bench.common import PEAK_TFLOPS  # noqa: E402
from bench import child  # noqa: E402
from bench.record import gpu_slug, mirror  # noqa: E402
from bench_vs_deepspeed import child_env  # noqa: E402

RUNNERS = {"megatrain": "run_dpo_megatrain.py", "deepspeed": "run_dpo_deepspeed.py"}
LABEL = {"megatrain": "hf_megatrain (every layer streamed)", "deepspeed": "DeepSpeed ZeRO-3 offload"}
FULL_LENS, TINY_LENS = (512, 1536), (16, 48)


# -- plan -------------------------------------------------------------------------------------------------------------
def attempts(system: str, pairs: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Spec overrides to try in order; the next one runs only if the previous one ran out of memory."""
    if a.micro == "auto":
        micros = list(dict.fromkeys(m for m in (pairs, pairs // 2, pairs // 4) if m >= 1 and pairs % m == 0))
    else:
        micros = [int(a.micro)]
    extra: dict[str, Any] = {}
    if system == "megatrain":
        extra = {"regime": "streamed", "megatrain_config": json.loads(a.megatrain_config) if a.megatrain_config
                 else {}}
    elif system == "deepspeed":
        extra = {"ds": json.loads(a.ds_json) if a.ds_json else {}, "ds_model_dtype": a.ds_model_dtype}
    return [{"micro_pairs": m, "grad_accum": pairs // m, **extra} for m in micros]


# -- running one system -------------------------------------------------------------------------------------------------
def run_child(system: str, spec: dict, a: argparse.Namespace, timeout: float, log_path: str) -> dict[str, Any]:
    """The system's runner in its own process group; its JSON record, or an error record from its log's tail."""
    env = child_env(a)
    env.setdefault("TQDM_DISABLE", "1")
    run = child.run_child(os.path.join(HERE, "bench", RUNNERS[system]), spec, log_path, env, timeout)
    record = run.record or run.error_record(timeout, system=system, pairs=spec["pairs"], spec=spec)
    record["pairs"] = spec["pairs"]
    record["subprocess_wall_s"] = run.wall_s
    record["log"] = os.path.relpath(log_path, ROOT) if log_path.startswith(ROOT) else log_path
    return record


# -- results ------------------------------------------------------------------------------------------------------------
def record_key(rec: dict) -> str:
    return f"{rec['system']}@{rec['pairs']}"


def ratios(records: dict[str, dict]) -> dict[str, Any]:
    """Per pair count: hf_megatrain's tokens/s over DeepSpeed's, where both ran."""
    out: dict[str, Any] = {}
    for p in sorted({int(r["pairs"]) for r in records.values()}):
        ours, ds = records.get(f"megatrain@{p}"), records.get(f"deepspeed@{p}")
        if ours and ds and ours.get("status") == ds.get("status") == "ok":
            out[str(p)] = {"megatrain_over_deepspeed": ours["tokens_per_s"] / ds["tokens_per_s"]}
    return out


def merge_and_write(path: str, doc_new: dict, fresh: bool) -> dict:
    doc: dict[str, Any] = {}
    if not fresh and os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    records = doc.get("records", {})
    for rec in doc_new.pop("records"):
        records[record_key(rec)] = rec
    runs, run = doc.get("runs", []), doc_new.pop("run")
    if run not in runs:  # (once per invocation, however many records it writes)
        runs.append(run)
    doc.update(doc_new, records=records, runs=runs, ratios=ratios(records))
    schema.write(path, doc, markdown(doc))
    return doc


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(doc: dict) -> str:
    s = doc["spec"]
    lines = [f"# DPO steps: hf_megatrain vs DeepSpeed ZeRO-3 offload ({doc['gpu']})", "",
             f"Qwen2 at {'tiny' if s['tiny'] else '14B'} width x {s['layers']} layers (random init), TRL DPOTrainer "
             f"(sigmoid, beta 0.1), pairs of prompt {s['prompt_len']} + completion {s['completion_len']} tokens "
             f"(chosen and rejected: 2 rows of {s['prompt_len'] + s['completion_len']} per pair), clip "
             f"{s['max_grad_norm']}, reference log-probs precomputed by the policy before training "
             "(precompute_ref_log_probs=True; its time is the 'ref precompute' column, not in the step). TFLOP/s = "
             "6·N·tokens/s of the policy's training; MFU against "
             f"{s['peak_tflops']:.0f} TFLOP/s. Peak memory over the whole run (precompute included).", "",
             "| system | pairs | tokens/step | micro x GA | step s | pairs/s | tokens/s | TFLOP/s | MFU | "
             "ref precompute s (tok/s) | peak GPU GiB | peak host GiB | loss first→last | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(doc["records"].values(), key=lambda r: (int(r["pairs"]), list(RUNNERS).index(r["system"]))):
        ok = r.get("status") == "ok"
        losses = r.get("losses") or []
        lines.append("| " + " | ".join([
            LABEL.get(r["system"], r["system"]), str(r["pairs"]),
            f"{r['tokens_per_step']:,}" if ok else "—",
            f"{r.get('micro_pairs')} x {r.get('grad_accum')}" if ok else "—",
            _f(r.get("step_time_s"), "{:.3f}"), _f(r.get("pairs_per_s")), _f(r.get("tokens_per_s"), "{:,.0f}"),
            _f(r.get("model_tflops"), "{:.1f}"), _f(r.get("mfu"), "{:.1%}"),
            f"{_f(r.get('ref_precompute_s'), '{:.1f}')} ({_f(r.get('ref_precompute_tokens_per_s'), '{:,.0f}')})",
            _f(r.get("peak_gpu_reserved_gib"), "{:.1f}"), _f(r.get("peak_host_rss_gib"), "{:.1f}"),
            f"{losses[0]:.4f}→{losses[-1]:.4f}" if losses else "—",
            "ok" if ok else f"{r.get('status')}: {(r.get('error') or '').splitlines()[0][:120] if r.get('error') else ''}",
        ]) + " |")
    for p, v in doc.get("ratios", {}).items():
        lines.append(f"\n{p} pairs: hf_megatrain / DeepSpeed tokens/s = {v['megatrain_over_deepspeed']:.2f}x")
    lines += ["", "Commands:", ""] + [f"    {run['command']}   # {run['started']}" for run in doc.get("runs", [])]
    return "\n".join(lines) + "\n"


# -- CLI ----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="megatrain,deepspeed", help="comma list of " + ",".join(RUNNERS))
    ap.add_argument("--pairs", default=None,
                    help="preference pairs per optimizer step, comma list (default 4,8: 16k and 32k tokens with the "
                         "default lengths; 2 with --tiny)")
    ap.add_argument("--prompt-len", type=int, default=None, help=f"prompt tokens (default {FULL_LENS[0]}; "
                    f"{TINY_LENS[0]} with --tiny)")
    ap.add_argument("--completion-len", type=int, default=None, help=f"chosen / rejected tokens each, EOS included "
                    f"(default {FULL_LENS[1]}; {TINY_LENS[1]} with --tiny)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; 2 with --tiny)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="global-norm clip for every system")
    ap.add_argument("--micro", default="auto",
                    help="pairs per micro-batch (GA = pairs / micro) for every system, or auto (all pairs at once; "
                         "halved with gradient accumulation on OOM)")
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen2 (CPU smoke test of the plumbing)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_dpo"))
    ap.add_argument("--fresh", action="store_true", help="overwrite instead of merging into the existing JSON")
    ap.add_argument("--mirror", default=None, metavar="DIR",
                    help="also copy the JSON, the table and the logs here after every run (e.g. $OUT on the device)")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per subprocess")
    ap.add_argument("--budget", type=float, default=570,
                    help="seconds for this whole invocation: later runs get what is left, none start below 60 s")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--clock-sync", choices=("device", "stream"), default="device")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="extra env for every runner")
    ap.add_argument("--alloc-conf", default="expandable_segments:True",
                    help="PYTORCH_CUDA_ALLOC_CONF for every runner unless already set ('' = none)")
    ap.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    ap.add_argument("--megatrain-config", default=None,
                    help="JSON dict of MegaTrainConfig overrides (the streamed placement is merged over it)")
    ap.add_argument("--ds-json", default=None, help="JSON merged into the DeepSpeed config (bench/run_deepspeed.py)")
    ap.add_argument("--ds-model-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args(argv)
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in a.system_list if s not in RUNNERS]
    if bad:
        ap.error(f"--systems: unknown {bad}; choose from {list(RUNNERS)}")
    a.pair_list = [int(p) for p in (a.pairs or ("2" if a.tiny else "4,8")).split(",") if p.strip()]
    if not a.pair_list or min(a.pair_list) < 1:
        ap.error(f"--pairs {a.pairs!r}: positive integers")
    lens = TINY_LENS if a.tiny else FULL_LENS
    a.prompt_len = a.prompt_len or lens[0]
    a.completion_len = a.completion_len or lens[1]
    if a.completion_len < 2:
        ap.error("--completion-len must be at least 2 (one token and the EOS)")
    a.layers = a.layers or (2 if a.tiny else 8)
    if a.max_grad_norm < 0:
        ap.error(f"--max-grad-norm {a.max_grad_norm}: use 0 (no clipping) or a positive threshold")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    gpu_name, slug = gpu_slug(a.tiny)
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    path_json = os.path.join(a.out, f"bench_dpo_{slug}.json")
    seq = a.prompt_len + a.completion_len
    base = {"tiny": a.tiny, "layers": a.layers, "prompt_len": a.prompt_len, "completion_len": a.completion_len,
            "warmup": a.warmup, "steps": a.steps, "max_grad_norm": a.max_grad_norm, "peak_tflops": a.peak_tflops,
            "seed": 0, "clock_sync": a.clock_sync}
    command = schema.command(__file__, argv, called="bench_dpo")
    started, commit, host = schema.now(), schema.commit(), schema.machine()
    plan = [(s, p, attempts(s, p, a)) for p in a.pair_list for s in a.system_list]  # a pair count's systems together
    print(f"[bench_dpo] {gpu_name}: {len(plan)} runs -> {path_json}", flush=True)
    for s, p, tries in plan:
        print(f"[bench_dpo]   {s} {p} pairs ({2 * p} rows x {seq} = {2 * p * seq:,} tokens/step): attempts {tries}",
              flush=True)
    if a.dry_run:
        return 0
    t_start = time.perf_counter()
    doc: dict[str, Any] = {}
    logs: list[str] = []
    for system, pairs, tries in plan:
        record, history = child.run_attempts(
            tries, lambda over, timeout, log: run_child(system, {**base, **over, "system": system, "pairs": pairs}, a,
                                                        timeout, log),
            log_path=lambda i: os.path.join(a.out, "logs", f"dpo_{system}_p{pairs}{f'_try{i + 1}' if i else ''}.log"),
            budget=a.budget, started=t_start, timeout=a.timeout, tag="[bench_dpo]", what=f"{system} {pairs} pairs",
            skipped={"system": system, "pairs": pairs}, logs=logs,
            summary=lambda r: f"{r['tokens_per_s']:,.0f} tok/s, {r['pairs_per_s']:.2f} pairs/s, step "
                              f"{r['step_time_s']:.3f}s, ref precompute {r['ref_precompute_s']:.1f}s")
        record["attempts_before"] = history
        doc = merge_and_write(path_json, {
            "gpu": gpu_name, "date": schema.now(), "commit": commit, "machine": host,
            "versions": schema.versions("trl", "datasets"),
            "spec": {k: base[k] for k in ("tiny", "layers", "prompt_len", "completion_len", "max_grad_norm",
                                          "peak_tflops")},
            "run": {"command": command, "commit": commit, "started": started, "systems": a.system_list,
                    "pairs": a.pair_list},
            "records": [record]}, fresh=a.fresh and not doc)
        if a.mirror:
            mirror(a.mirror, [path_json, path_json[:-5] + ".md"], logs)
    if doc:
        print(f"[bench_dpo] wrote {path_json} and {path_json[:-5]}.md\n", flush=True)
        print(markdown(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
