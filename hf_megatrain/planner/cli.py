"""``megatrain estimate``: the memory plan of a model config, before anything is allocated.

The model is built on the meta device from its config (a local folder, a config.json or a Hub id), measured with
the engine's own layout code and planned by ``predict.estimate`` for a target GPU (this one, or ``--gpu-memory``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

import torch

from ..config import MegaTrainConfig, resolve_config
from ..core.memory import available_host_bytes, format_bytes, gpu_budget
from .finetune_rows import Layout as RowLayout
from .finetune_rows import load_lengths, padding_summary, sample_steps
from .disk_tier import disk_moment_bytes, disk_tier_note, moments_cached
from .host_layout import Layout, choose, host_layouts, is_planned, layout_lines
from .predict import GiB, MemoryPlan, ModelShape, estimate, sum_values, unit_plans
from .saved_graphs import saved_graph_bytes, saved_graph_count
from .step_time import DISK_TIER, MachineProfile, StepPrediction, predict_step, predict_steps
from .suffice import machine_words, suffice_lines, what_would_suffice

__all__ = ["checkpoint_sizes", "load_shape", "main", "step_time_lines"]


# -- megatrain estimate ----------------------------------------------------------------------------------------------
def load_shape(path: str, layers_path: str | None = None, trust_remote_code: bool = False) -> ModelShape:
    """Build ``path``'s model on the meta device (local dir, config.json, or hub id) and measure its layout."""
    import transformers

    local = os.path.exists(path)
    looks_local = path.startswith(("/", ".", "~")) or path.endswith(".json") or path.count("/") > 1
    if not local and looks_local:
        raise FileNotFoundError(f"{path}: no such file or directory; pass a model directory holding config.json, "
                                "a config.json path, or a Hugging Face hub id")
    try:
        cfg = transformers.AutoConfig.from_pretrained(os.path.expanduser(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        where = "the local config" if local else "the hub (no network, or not cached?)"
        raise FileNotFoundError(f"could not load a model config for {path!r} from {where}: {e}. Pass a local "
                                "directory with config.json or a config.json path.") from e
    from ..model.skeleton import causal_lm_skeleton

    with torch.device("meta"):
        model = causal_lm_skeleton(cfg, trust_remote_code=trust_remote_code)
    model.tie_weights()
    from ..model.families import check_supported  # a family the engine refuses must not "fit"
    from ..model.layers import find_layer_stack

    check_supported(model, find_layer_stack(model, layers_path))
    return ModelShape.from_model(model, layers_path)


def _rows(items: dict[str, int], indent: str = "  ") -> list[str]:
    return [f"{indent}{k:<{56 - len(indent)}} {format_bytes(v):>11}" for k, v in items.items() if v]


def _report(plan: MemoryPlan, host_verdict: str, gpu_verdict: str) -> list[str]:
    peak = plan.peak_phase
    others = ", ".join(f"{k} {format_bytes(sum_values(v))}" for k, v in plan.phases.items() if k != peak)
    return (["Host RAM"] + _rows(plan.host) + [f"  {'total (peak)':<54} {format_bytes(plan.host_total):>11}   "
                                                f"{host_verdict}", "GPU memory (per GPU)"] + _rows(plan.device)
            + [f"  step peak = {peak}:"] + _rows(plan.phases.get(peak, {}), "    ") + [f"    (other phases: {others})"]
            + [f"  {'total':<54} {format_bytes(plan.device_total):>11}   {gpu_verdict}",
               "Disk (per checkpoint; + AdamW moments with optimizer_state_dir)"]
            + _rows(plan.disk) + [f"  {'total':<54} {format_bytes(sum_values(plan.disk)):>11}"])


def checkpoint_sizes(plan: MemoryPlan, disk_gbps: float) -> dict[str, float]:
    """Bytes of a Trainer checkpoint (the export at save_dtype + the training state: AdamW moments, and the FP32
    master when the export is not FP32: ``plan.checkpoint``, the formula the engine's run summary and the Trainer's
    free-space check use, checkpoint/space.py) and of a model export, with the seconds each takes at
    ``disk_gbps``."""
    export, trainer = plan.checkpoint.export, plan.checkpoint.total
    rate = disk_gbps * 1e9
    return {"disk_gbps": disk_gbps, "trainer_bytes": trainer, "trainer_s": trainer / rate,
            "export_bytes": export, "export_s": export / rate}


def step_time_lines(preds: dict[str, StepPrediction], machine: MachineProfile) -> list[str]:
    """The ``Step time`` section: one line per clipping case, then the rates it was predicted from."""
    out = ["Step time (predicted from measured machine rates, steady state: planner/step_time.py)"]
    for label, p in preds.items():
        out.append(f"  {label:<30} {p.step_s:8.3f} s/step  {p.tokens_per_s:10,.0f} tokens/s  MFU {p.mfu:6.1%} "
                   f"(6N; {p.mfu_with_attention:.1%} with attention)")
        out.append(f"  {'':<30} bottleneck: {p.bottleneck}" + (
            "; each step runs forward+backward twice (lean store, norm first)" if p.passes > 1 else ""))
    m = machine
    disk = any(p.busy_s.get(DISK_TIER) for p in preds.values())
    out.append(f"  rates: {m.tflops:g} TFLOP/s bf16 x {m.gemm_efficiency:g} in the layers' GEMMs (--tflops), attention "
               f"{m.attention_tflops:g}, PCIe {m.pcie_h2d_gbps:g} H2D / {m.pcie_d2h_gbps:g} D2H GB/s (--pcie-gbps), "
               f"host AdamW {m.host_adamw_gbps:g} GB/s (--host-adamw-gbps)"
               + (f", disk {m.disk_gbps:g} GB/s (--disk-gbps)" if disk else ""))
    return out


ROW_LAYOUTS = (("padded", RowLayout.PADDED, False), ("padded, group_by_length", RowLayout.PADDED, True),
               ("packed (DataCollatorWithFlattening / padding_free)", RowLayout.PACKED, False))


def compare_row_layouts(shape: ModelShape, config: MegaTrainConfig, plans: Any, lengths: list[int], batch_size: int,
                        max_len: int, machine: MachineProfile, grad_accum: int = 1,
                        saved_graphs: int = 0) -> list[dict[str, Any]]:
    """The same lengths laid out each way Trainer and TRL offer, clipping on every step: what a user could switch to
    (packed rows never pay for padding; grouping by length pays less)."""
    out = []
    for label, layout, grouped in ROW_LAYOUTS:
        batches = sample_steps(lengths, layout, batch_size, max_len, group_by_length=grouped)
        p = predict_steps(shape, config, plans, batches, machine, clipping=True, grad_accum=grad_accum,
                          saved_graphs=saved_graphs)
        out.append({"layout": label, "step_s": p.step_s, "real_tokens_per_s": p.tokens_per_s,
                    **padding_summary(batches)})
    return out


def _layout_json(x: Layout) -> dict[str, Any]:
    row = asdict(x)
    row["step_s"] = None if x.step_s != x.step_s else x.step_s  # (NaN: not predicted; JSON has no NaN)
    return row


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else (f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatrain estimate", description="Host RAM, GPU memory and disk a "
                                "hf_megatrain run needs, from the model config alone (nothing is allocated).")
    p.add_argument("model", help="model directory with config.json, a config.json path, or a hub id")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per optimizer micro-step")
    p.add_argument("--micro-batch-size", type=int, default=None, help="split inside a layer visit (0 = none)")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel processes of one host (one shared store)")
    p.add_argument("--compute-dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--num-slots", type=int, default=None)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lean-store", action="store_true",
                   help="plan for lean_store=True (12 host bytes per streamed parameter)")
    p.add_argument("--lean-compute-copy", action="store_true",
                   help="with --lean-store: plan for lean_compute_copy=True (14 B/param; weights stream in bf16)")
    p.add_argument("--lean-grad-plane", default=None, choices=["auto", "on", "off"],
                   help="with --lean-store: keep each layer's step gradient on the host (+2 B/param bf16), so a "
                        "clipping step needs no second forward+backward (default auto: when it fits the RAM)")
    p.add_argument("--no-clip", action="store_true",
                   help="compare the host layouts without clipping (default: clipping on every step, as Trainer's "
                        "max_grad_norm=1.0 usually does early in a fine-tune)")
    p.add_argument("--device-layers", type=int, default=None,
                   help="decoder layers kept whole on the GPU (default -1: as many as fit; 0: stream every layer)")
    p.add_argument("--seq-chunk-tokens", type=int, default=None,
                   help="tiles of the position-wise modules (MLP, norms) in tokens: 0 off, -1 auto (long context)")
    p.add_argument("--activation-offload", default=None, choices=["auto", "on", "off"],
                   help="layer inputs saved for the backward: in pinned host memory when the GPU cannot keep them")
    p.add_argument("--host-memory", type=float, default=None,
                   help="GiB of host RAM available when planning for another machine (default: this one's); the "
                        "verdict then names that machine")
    p.add_argument("--config", default=None, help="megatrain yaml (other MegaTrainConfig keys)")
    p.add_argument("--gpu-memory", type=float, default=None,
                   help="GiB of the target GPU when planning for another machine (default: this GPU; with none "
                        "here, an 80 GiB H100). The GPU check always runs against it")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--disk-gbps", type=float, default=1.0,
                   help="disk write/read rate in GB/s (1e9 B/s) for the checkpoint save/load times and the disk "
                        "tier's moments (optimizer_state_dir) in the step time (default 1.0; measure yours with "
                        "integration/bench_checkpoint_io.py or dd conv=fsync)")
    p.add_argument("--tflops", type=float, default=None,
                   help="bf16 matmul TFLOP/s of the GPU for the step-time prediction (default 800: an H100's measured)")
    p.add_argument("--pcie-gbps", type=float, default=None,
                   help="PCIe GB/s, each direction (default: the H100 machine's measured 45.5 H2D / 55.1 D2H)")
    p.add_argument("--host-adamw-gbps", type=float, default=None,
                   help="host AdamW DRAM traffic in GB/s while the step runs (default 140: the H100 machine's 16 "
                        "threads, measured in-step; integration/host_adamw_rate.py measures yours alone)")
    p.add_argument("--lengths", default=None,
                   help="a fine-tune's sequence lengths (JSON list, JSON histogram {bin_edges, counts}, or one per "
                        "line): the step time is predicted over batches drawn from them, in real tokens/s; with "
                        "--layout padded, --batch-size sequences per step padded to their longest (at most "
                        "--seq-len); packed, --batch-size rows of --seq-len tokens")
    p.add_argument("--layout", default=None, choices=["padded", "packed"],
                   help="with --lengths: padded rows (a padding collator; the default) or packed rows "
                        "(DataCollatorWithFlattening, TRL padding_free / packing)")
    p.add_argument("--group-by-length", action="store_true",
                   help="with --lengths --layout padded: Trainer's group_by_length (length-grouped batches)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    try:
        over = {k: v for k, v in (("compute_dtype", a.compute_dtype), ("num_slots", a.num_slots),
                                  ("micro_batch_size", a.micro_batch_size), ("device_layers", a.device_layers),
                                  ("lean_store", a.lean_store or None),
                                  ("lean_compute_copy", a.lean_compute_copy or None), ("seq_chunk_tokens", a.seq_chunk_tokens),
                                  ("lean_grad_plane", a.lean_grad_plane),
                                  ("activation_offload", a.activation_offload)) if v is not None}
        config = MegaTrainConfig.from_dict({**resolve_config(a.config).to_dict(), **over})
        rates = (a.disk_gbps, a.tflops, a.pcie_gbps, a.host_adamw_gbps)
        if a.seq_len <= 0 or a.batch_size <= 0 or a.gpus <= 0 or not all(r is None or r > 0 for r in rates):
            raise ValueError("--seq-len, --batch-size, --gpus and the rates (--disk-gbps, --tflops, --pcie-gbps, "
                             "--host-adamw-gbps) must be positive")
        if not a.lengths and (a.layout or a.group_by_length):
            raise ValueError("--layout and --group-by-length describe the batches drawn from --lengths: give "
                             "--lengths FILE (your data's sequence lengths) too")
        a.layout = a.layout or "padded"
        if a.group_by_length and a.layout == "packed":
            raise ValueError("--group-by-length groups padded batches; packed rows have no padding to group: drop "
                             "it or use --layout padded")
        batches = lengths = None
        if a.lengths:
            lengths = load_lengths(a.lengths)
            batches = sample_steps(lengths, RowLayout(a.layout), a.batch_size, a.seq_len,
                                   group_by_length=a.group_by_length)
        shape = load_shape(a.model, config.layers_path, a.trust_remote_code)
    except (FileNotFoundError, ValueError) as e:
        print(f"megatrain estimate: error: {e}", file=sys.stderr)
        return 2
    gpu_here = torch.cuda.is_available()
    gpu_avail = gpu_budget(torch.device("cuda", torch.cuda.current_device())) if gpu_here else None
    gpu_plan = a.gpu_memory * GiB if a.gpu_memory else (gpu_avail or 80 * GiB)
    host_avail = int(a.host_memory * GiB) if a.host_memory else available_host_bytes()
    # (one GPU: the plans for this host's RAM, where lean_grad_plane="auto" asks whether the plane fits)
    plans = unit_plans(shape, config, "cuda", gpu_plan, host_free=host_avail) if a.gpus == 1 else None
    plan = estimate(shape, config, a.seq_len, a.batch_size, device_type="cuda", gpu_free=gpu_plan,
                    grad_accum=a.grad_accum, gpus=a.gpus, plans=plans)
    # The last layers that keep their forward's graph for this step shape (the engine's rule; per visit of the
    # longest rows when --lengths draws several).
    graphs = saved_graph_count(config, shape.num_layers, device_type="cuda",
                               split=0 < config.micro_batch_size < a.batch_size, offloaded=plan.offloaded_layers,
                               budget=gpu_plan, planned_peak=plan.device_total,
                               per_layer=saved_graph_bytes(shape, config, a.seq_len * a.batch_size,
                                                           plan.seq_chunk_tokens))
    machine = MachineProfile().with_overrides(tflops=a.tflops, pcie_h2d_gbps=a.pcie_gbps, pcie_d2h_gbps=a.pcie_gbps,
                                              host_adamw_gbps=a.host_adamw_gbps, disk_gbps=a.disk_gbps)
    preds: dict[str, StepPrediction] = {}
    step_note = None
    layouts: list[Layout] = []
    cached = moments_cached(plan, config, host_avail)  # (the disk tier's moments: in the page cache, or streamed)
    if plans is not None and is_planned(config, a.gpus):
        for label, clip in (("no clipping", False), ("clipping on every step", True)):
            if batches is None:
                preds[label] = predict_step(shape, config, plans, a.seq_len, a.batch_size, machine, clipping=clip,
                                            grad_accum=a.grad_accum, saved_graphs=graphs, moments_cached=cached)
            else:  # (tokens/s: real tokens, padding not counted)
                preds[label] = predict_steps(shape, config, plans, batches, machine, clipping=clip,
                                             grad_accum=a.grad_accum, saved_graphs=graphs, moments_cached=cached)
        layouts = host_layouts(shape, config, a.seq_len, a.batch_size, gpu_plan, host_avail, machine,
                               clipping=not a.no_clip, grad_accum=a.grad_accum)
    else:
        step_note = "step time: not predicted for float32 compute or several GPUs (the model covers one GPU, bf16)"
    rows, compared = None, []
    if lengths is not None and plans is not None and is_planned(config, a.gpus):
        compared = compare_row_layouts(shape, config, plans, lengths, a.batch_size, a.seq_len, machine, a.grad_accum,
                                       graphs)
    if batches is not None:
        rows = {"layout": a.layout, "group_by_length": a.group_by_length, "steps_drawn": len(batches),
                **padding_summary(batches)}
    host_need = plan.host_total
    host_ok = host_need <= config.host_memory_fraction * host_avail
    # Always against the GPU planned for: this one, the one --gpu-memory describes, or (no GPU here) the default.
    gpu_target = gpu_plan
    gpu_ok = plan.device_total <= gpu_target
    fits = host_ok and gpu_ok
    # "this machine" only when both the GPU and the RAM checked are this machine's own, as detected.
    this_machine = gpu_here and not a.gpu_memory and not a.host_memory
    where = "this machine" if this_machine else machine_words(host_avail, gpu_plan)
    verdict = f"fits {where}" if fits else f"does NOT fit {where} (" + " and ".join(
        w for w, ok in (("host RAM", host_ok), ("GPU", gpu_ok)) if not ok) + ")"
    suffice = None
    if not fits:
        suffice = what_would_suffice(shape, config, plan, a.seq_len, a.batch_size, gpu_plan, host_avail, machine,
                                     clipping=not a.no_clip, step_model=plans is not None and is_planned(config,
                                                                                                        a.gpus),
                                     gpus=a.gpus, grad_accum=a.grad_accum)
    disk_note = disk_tier_note(plan, config, host_avail, a.disk_gbps)
    if a.json:
        print(json.dumps({"params": {"trainable": shape.trainable, "frozen": shape.frozen, "active": shape.active},
                          "shape": asdict(shape) | {"layer_numels": None, "layer_frozen": None},
                          "host": plan.host, "gpu": plan.device, "gpu_phases": plan.phases,
                          "gpu_peak_phase": plan.peak_phase, "disk": plan.disk,
                          "host_total": host_need, "gpu_total": plan.device_total,
                          "disk_total": sum(plan.disk.values()),
                          "host_available": host_avail, "gpu_available": gpu_target, "host_fits": host_ok,
                          "gpu_fits": gpu_ok, "notes": plan.notes, "offloaded_layers": plan.offloaded_layers,
                          "seq_chunk_tokens": plan.seq_chunk_tokens, "flops_per_token": plan.flops_per_token,
                          "saved_graph_layers": graphs,
                          "checkpoint": checkpoint_sizes(plan, a.disk_gbps),
                          "step_time": {k: asdict(v) for k, v in preds.items()}, "machine": asdict(machine),
                          "fine_tune_rows": rows, "fine_tune_layouts": compared,
                          "host_layouts": [asdict(x) for x in layouts],
                          "host_layout_choice": getattr(choose(layouts)[0], "name", None) if layouts else None,
                          "disk_tier": {"moments_on_disk": disk_moment_bytes(plan),
                                        "moments_cached": cached, "note": disk_note},
                          "this_machine": this_machine, "verdict": verdict,
                          "would_suffice": None if suffice is None else {
                              "layouts": [_layout_json(x) for x in suffice.layouts],
                              "disk_tier_layouts": [_layout_json(x) for x in suffice.disk_layouts],
                              "gpu_change": suffice.gpu_change, "gpu_need": suffice.gpu_need,
                              "layer_floor": suffice.floor, "layer_too_big": suffice.layer_too_big,
                              "disk_tier_refused": suffice.disk_refused or None,
                              "cheapest": suffice.cheapest, "least_hardware": suffice.least_hardware}},
                         indent=1))
        return 0
    print(f"{a.model}: {shape.trainable / 1e9:.3f}B trainable parameters ({shape.num_layers} streamed layers, "
          f"{shape.resident_numel / 1e6:.1f}M resident), {config.compute_dtype} compute, seq_len={a.seq_len}, "
          f"batch_size={a.batch_size}")
    if rows is not None:
        print(f"  fine-tune rows from {a.lengths}: {a.layout}"
              + (", grouped by length" if a.group_by_length else "")
              + f", {rows['real_tokens_per_step']:,.0f} real tokens per step on average, "
              f"{rows['padding_share']:.0%} padding ({len(batches)} steps drawn); step times below are their mean")
    if shape.routed_inactive:  # an MoE: FLOPs (and so time / MFU) follow the experts a token is routed to
        print(f"  {shape.active / 1e9:.3f}B active per token of {(shape.trainable + shape.frozen) / 1e9:.3f}B "
              "(routed experts: top_k / num_experts of theirs)")
    host_v = (("fits" if host_ok else "DOES NOT FIT") + f" ({config.host_memory_fraction:g} x "
              f"{format_bytes(host_avail)} available)")
    gpu_v = ("fits" if gpu_ok else "DOES NOT FIT") + (
        f" (a {format_bytes(gpu_target)} GPU, --gpu-memory)" if a.gpu_memory else
        f" ({format_bytes(gpu_target)} free)" if gpu_here else
        f" (no GPU here: a {format_bytes(gpu_target)} GPU planned, --gpu-memory)")
    print("\n".join(_report(plan, host_v, gpu_v)))
    ck = checkpoint_sizes(plan, a.disk_gbps)
    print(f"Checkpoint time at {a.disk_gbps:g} GB/s (--disk-gbps; each save and each load streams these bytes)")
    print(f"  {'Trainer checkpoint (export + FP32 master + AdamW m, v)':<54} {format_bytes(ck['trainer_bytes']):>11}"
          f"   {_duration(ck['trainer_s'])}")
    print(f"  {'model export (save_model, save_dtype)':<54} {format_bytes(ck['export_bytes']):>11}"
          f"   {_duration(ck['export_s'])}")
    f = plan.flops_per_token
    print(f"FLOPs per token: {f['model']:.3g} = 6N {f['dense_6n']:.3g} (N active) + attention {f['attention']:.3g} "
          f"(12 x layers x heads x (qk + v head dims) / 2 x seq_len: {f['attention_over_6n']:.1f}x 6N); executed "
          "with the layer "
          f"recompute and a causal kernel ~{f['hardware_with_recompute_causal']:.3g}")
    if preds:
        print("\n".join(step_time_lines(preds, machine)))
        print(f"  the last {graphs} of {shape.num_layers} layers keep their forward's graph: no recompute in their "
              "backward (saved_graph_layers)")
    if compared:
        print(f"Layouts of these lengths (clipping on every step; --batch-size {a.batch_size} sequences padded, or "
              f"rows of --seq-len {a.seq_len} packed)")
        for c in compared:
            print(f"  {c['layout']:<52} {c['step_s']:7.3f} s/step  {c['real_tokens_per_s']:10,.0f} real tokens/s  "
                  f"{c['padding_share']:4.0%} padding")
    if layouts:
        print("\n".join(layout_lines(layouts, clipping=not a.no_clip)))
    if suffice is not None:
        print("\n".join(suffice_lines(suffice, shape, config, gpu_plan, host_avail, a.disk_gbps, where)))
    no_gpu = [] if gpu_here else [f"no GPU here: placement planned and checked for a {format_bytes(gpu_plan)} GPU "
                                  "(--gpu-memory)"]
    for note in plan.notes + ([disk_note] if disk_note else []) + ([step_note] if step_note else []) + no_gpu:
        print("note:", note)
    print("verdict:", verdict)
    return 0
