"""Named Hub models at their real shapes: conversion check, memory plan and predicted step time, as a table.

Each ``integration/hub_configs/<name>.json`` holds the published ``config.json`` values of one Hub model (numbers
only, no weights) plus ``name``, ``source`` (the Hub repo id) and ``published_params`` (the model card's size). For
each one this script, on the CPU and the meta device only:

1. builds the model the way ``megatrain estimate`` and ``from_pretrained_streamed`` do
   (``model/skeleton.causal_lm_skeleton``) and counts its parameters (total, and active per token for an MoE:
   ``planner/active.py``);
2. runs the engine's conversion check (``families.check_supported`` on the layer stack it finds): ``supported``,
   or ``refused`` with the engine's message;
3. plans the run with ``planner.predict.estimate`` for three host stores -- the default (18 B/param),
   ``lean_store`` + ``lean_compute_copy`` (14) and ``lean_store`` (12) -- every decoder layer streamed and
   host-stepped (``device_layers=0, device_step_layers=0``), bf16 compute, ``BATCH`` sequences of ``SEQ_LEN``
   tokens per step, for an 80 GiB H100 and ``HOST_GIB`` GiB of host RAM (``host_memory_fraction`` of it usable);
4. predicts the step time of each store with ``planner.step_time.predict_step`` (the H100 machine's measured rates,
   gradient clipping on every step as the Trainer's default ``max_grad_norm=1.0`` does).

Results go to ``integration/results/named_models/named_models.json`` (with the date and the command) and the table
into docs/models.md between ``<!-- named-models:start -->`` and ``<!-- named-models:end -->``;
``tests/test_named_models.py`` checks that the doc holds exactly what ``render`` gives from the JSON.

    python integration/named_models.py            # measure every config, write the JSON and docs/models.md
    python integration/named_models.py --check    # exit 1 if docs/models.md is not what the JSON renders
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_megatrain.config import MegaTrainConfig  # noqa: E402
from hf_megatrain.planner.predict import GiB, ModelShape, estimate, unit_plans  # noqa: E402
from hf_megatrain.planner.step_time import MachineProfile, predict_step  # noqa: E402

CONFIGS = ROOT / "integration" / "hub_configs"
RESULTS = ROOT / "integration" / "results" / "named_models" / "named_models.json"
DOC = ROOT / "docs" / "models.md"
START, END = "<!-- named-models:start -->", "<!-- named-models:end -->"
META_KEYS = ("name", "source", "published_params", "published_active_params", "published_note", "deviations")
SEQ_LEN, BATCH = 4096, 4  # 16,384 tokens per optimizer step
GPU_GIB = 80.0  # an H100 80GB (the estimate CLI's default target)
HOST_GIB = 1536.0  # "1.5 TB" of host RAM: 24 x 64 GiB DIMMs
TOLERANCE = 0.02  # a config whose parameter count is further than this from the published size is wrong
# (label, bytes per streamed parameter, MegaTrainConfig overrides)
STORES = (("default", 18, {}), ("lean_store+lean_compute_copy", 14, {"lean_store": True, "lean_compute_copy": True}),
          ("lean_store", 12, {"lean_store": True}))


def config_files() -> list[Path]:
    return sorted(CONFIGS.glob("*.json"))


def load_meta(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the published-size metadata, the config.json values) of one hub_configs file."""
    raw = json.loads(path.read_text())
    return {k: raw[k] for k in META_KEYS if k in raw}, {k: v for k, v in raw.items() if k not in META_KEYS}


def build(path: Path) -> torch.nn.Module:
    """The model of ``path`` on the meta device, as ``megatrain estimate`` builds it (tied weights tied)."""
    import transformers

    from hf_megatrain.model.skeleton import causal_lm_skeleton

    _, values = load_meta(path)
    # what AutoConfig.from_pretrained does with a config.json once read (megatrain estimate's path)
    cfg = transformers.CONFIG_MAPPING[values["model_type"]].from_dict(values)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = causal_lm_skeleton(cfg)
    model.tie_weights()
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def conversion_status(model: torch.nn.Module) -> tuple[str, str]:
    """("supported", "") or ("refused", the engine's message) from the conversion check."""
    from hf_megatrain.model.families import check_supported
    from hf_megatrain.model.layers import find_layer_stack

    try:
        check_supported(model, find_layer_stack(model, None))
    except (ValueError, NotImplementedError) as e:
        return "refused", " ".join(str(e).split())
    return "supported", ""


def plan_store(shape: ModelShape, overrides: dict[str, Any], machine: MachineProfile) -> dict[str, Any]:
    """Host bytes, GPU plan and predicted step of one host store for ``shape``."""
    config = MegaTrainConfig(device_layers=0, device_step_layers=0, **overrides)
    gpu = int(GPU_GIB * GiB)
    plan = estimate(shape, config, SEQ_LEN, BATCH, device_type="cuda", gpu_free=gpu)
    plans = unit_plans(shape, config, "cuda", gpu)
    step = predict_step(shape, config, plans, SEQ_LEN, BATCH, machine, clipping=True)
    host_cap = config.host_memory_fraction * HOST_GIB * GiB
    return {"host_bytes": plan.host_total, "store_bytes": plan.store_host_bytes,
            "host_fits": plan.host_total <= host_cap, "gpu_bytes": plan.device_total,
            "gpu_fits": plan.device_total <= gpu, "gpu_peak_phase": plan.peak_phase,
            "offloaded_layers": plan.offloaded_layers, "step_s": step.step_s, "tokens_per_s": step.tokens_per_s,
            "mfu": step.mfu, "bottleneck": step.bottleneck, "passes": step.passes}


def measure(path: Path, machine: MachineProfile | None = None) -> dict[str, Any]:
    """One record: the model's counts, conversion status and a plan per host store."""
    import transformers

    meta, values = load_meta(path)
    model = build(path)
    status, reason = conversion_status(model)
    shape = ModelShape.from_model(model)
    total = count_params(model)
    rec = {"file": path.name, **meta, "model_type": values.get("model_type"), "class": type(model).__name__,
           "transformers": transformers.__version__, "params": total, "active_params": shape.active,
           "moe": shape.routed_inactive > 0, "layers": shape.num_layers,
           "published_deviation": total / meta["published_params"] - 1, "status": status, "reason": reason,
           "flops_per_token_6n": 6.0 * shape.active, "stores": {}}
    machine = machine or MachineProfile()
    for label, per_param, over in STORES:
        rec["stores"][label] = {"bytes_per_param": per_param, **plan_store(shape, over, machine)}
    return rec


# -- rendering -------------------------------------------------------------------------------------------------------
def _b(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n < 99.95e9 else f"{n / 1e9:.0f}B"


def _gib(n: float) -> str:
    return f"{n / GiB:,.0f}"


def _time(s: float) -> str:
    return f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def _bound(bottleneck: str) -> str:
    """step_time's bottleneck sentence in a few words."""
    if bottleneck.startswith("GPU compute + the forward's wait"):
        return "GPU + host AdamW wait"
    return bottleneck.split(" (")[0].replace("GPU compute", "GPU")


def chosen_store(rec: dict[str, Any]) -> str | None:
    """The first store (most host RAM, fastest) that fits the host and the GPU; None if none does."""
    return next((label for label, _, _ in STORES if rec["stores"][label]["host_fits"]
                 and rec["stores"][label]["gpu_fits"]), None)


def render(data: dict[str, Any]) -> str:
    """The Markdown between the markers (without them)."""
    s = data["setup"]
    lines = [
        f"Generated by `{data['command']}` on {data['date']} (transformers {s['transformers']}, meta device) from "
        "`integration/hub_configs/*.json` into `integration/results/named_models/named_models.json`. "
        f"Plan: every decoder layer streamed and host-stepped, bf16 compute, {s['batch']} x {s['seq_len']:,} = "
        f"{s['batch'] * s['seq_len']:,} tokens per step, an {s['gpu_gib']:g} GiB H100 and {s['host_gib']:,.0f} GiB "
        f"of host RAM ({s['host_memory_fraction']:g} of it usable). Host RAM is the whole process's planned peak "
        "(store + baseline + staging + offloaded activations), in GiB; the GPU peak is that of the same store as the step time (layer inputs offloaded to host memory where the 80 GiB would not hold them). Step time: `planner/step_time.py` with the "
        "H100 machine's measured rates, clipping on every step, for the first store that fits (default, else "
        "lean + copy, else lean); MoE FLOPs count the active parameters.", "",
        "| model | type | params total / active | status | host GiB at 18 / 14 / 12 B/param | fits 1.5 TB at | "
        "GPU peak (GiB) | step time | tokens/s | MFU | bound by |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["models"]:
        st = r["stores"]
        host = " / ".join(_gib(st[label]["host_bytes"]) for label, _, _ in STORES)
        fit = [str(per) for label, per, _ in STORES if st[label]["host_fits"]]
        chosen = chosen_store(r)
        c = st[chosen] if chosen else None
        params = _b(r["params"]) + (f" / {_b(r['active_params'])}" if r["moe"] else "")
        status = r["status"] if r["status"] == "supported" else f"refused ({r['reason'][:80]}...)"
        step = (f"{_time(c['step_s'])}" + (f" ({dict((lbl, p) for lbl, p, _ in STORES)[chosen]} B)"
                                           if chosen != "default" else "")) if c else "-"
        g = c or st["default"]  # the GPU plan of the store the step time is for
        gpu = f"{g['gpu_bytes'] / GiB:.0f}" + ("" if g["gpu_fits"] else " (too big)") + (
            f" ({g['offloaded_layers']} inputs offloaded)" if g["offloaded_layers"] else "")
        tps, mfu = (f"{c['tokens_per_s']:,.0f}", f"{c['mfu']:.0%}") if c else ("-", "-")
        bound = _bound(c["bottleneck"]) if c else "-"
        lines.append(f"| [{r['name']}](https://huggingface.co/{r['source']}) | `{r['model_type']}` | {params} | "
                     f"{status} | {host} | {', '.join(fit) + ' B' if fit else 'no'} | {gpu} | {step} | "
                     f"{tps} | {mfu} | {bound} |")
    notes = [r for r in data["models"] if r.get("published_note") or r.get("deviations")
             or abs(r["published_deviation"]) > 0.005]
    if notes:
        lines += ["", "Counted here against the published size (the test allows 2 %):", ""]
        for r in notes:
            extra = "; ".join(x for x in (r.get("published_note"), r.get("deviations")) if x)
            lines.append(f"- {r['name']}: {_b(r['params'])} built (`{r['class']}`) vs {_b(r['published_params'])} "
                         f"published ({r['published_deviation']:+.1%})" + (f"; {extra}" if extra else ""))
    if data.get("not_written"):
        lines += ["", "Not written (no config file):", ""]
        lines += [f"- {name}: {why}" for name, why in data["not_written"].items()]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"{DOC} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}\n{END}{tail}"


DOC_HEAD = """# Named Hub models at their real shapes

Each row is one model's published `config.json` (numbers in `integration/hub_configs/`, no weights), built on the
meta device with the loader `megatrain estimate` uses, checked by the engine's conversion check and planned by the
planner. Regenerate with `python integration/named_models.py`; `tests/test_named_models.py` checks every config's
parameter count against the published size and that this table is what the script renders.

"""

# Models of the brief for which no config file is written, and why (rendered under the table).
NOT_WRITTEN = {
    "Falcon-H1 34B": "its config.json could not be read here (no network) and the values found offline disagree "
                     "(attention / KV heads) or are missing (intermediate_size, mamba_d_ssm, vocab_size): no guessed "
                     "numbers. transformers 5.24 builds `falcon_h1`; a hand-made tiny Falcon-H1 trains with parity "
                     "(issue 32)",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/models.md is not what the JSON renders")
    a = ap.parse_args(argv)
    if a.check:
        data = json.loads(RESULTS.read_text())
        text = DOC.read_text() if DOC.exists() else ""
        if START not in text or replace_block(text, render(data)) != text:
            print(f"{DOC}: stale; run python integration/named_models.py", file=sys.stderr)
            return 1
        return 0
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_megatrain").setLevel(logging.WARNING)
    machine = MachineProfile()
    models = []
    for path in config_files():  # (rows ordered by size below)
        rec = measure(path, machine)
        print(f"{path.name:28} {rec['params'] / 1e9:8.2f}B ({rec['published_deviation']:+.2%}) {rec['status']}",
              flush=True)
        models.append(rec)
    models.sort(key=lambda r: (r["params"], r["file"]))
    data = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "command": "python integration/named_models.py",
            "setup": {"seq_len": SEQ_LEN, "batch": BATCH, "gpu_gib": GPU_GIB, "host_gib": HOST_GIB,
                      "host_memory_fraction": MegaTrainConfig().host_memory_fraction, "device_layers": 0,
                      "device_step_layers": 0, "clipping": True, "compute_dtype": "bfloat16",
                      "transformers": transformers.__version__, "machine": asdict(machine)},
            "not_written": NOT_WRITTEN, "models": models}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    text = DOC.read_text() if DOC.exists() and START in DOC.read_text() else f"{DOC_HEAD}{START}\n{END}\n"
    DOC.write_text(replace_block(text, render(data)))
    bad = [r["file"] for r in models if abs(r["published_deviation"]) > TOLERANCE]
    if bad:
        print(f"off the published size by more than {TOLERANCE:.0%}: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
