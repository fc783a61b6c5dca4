"""What the engine decided, in a few lines a user can paste into an issue.

Run through someone else's training script (TRL's ``sft.py``, ``run_clm.py``), nothing else tells a user whether
layers compute in float32 or bfloat16, which layers stream, how many host bytes each parameter costs or which loss
runs -- the decisions that made silent default changes invisible before. ``run_summary`` reads them off a built
engine (and its optimizer, once created); the integrations add where the config came from and print / file it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.memory import format_bytes
from ..core.plan import Stepper, Where
from ..export.weights import checkpoint_bytes
from ..parallel.group import sharded
from ..parallel.shards import shard_range

__all__ = ["run_summary", "format_summary"]


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def run_summary(engine: Any, *, config_source: str | None = None) -> dict[str, Any]:
    """A JSON-serialisable record of ``engine``'s decisions: precision, placement, host memory, loss, optimizer.
    ``config_source``: where the config came from, as the entry point knows it (e.g. "megatrain_config (dict)")."""
    plans = engine.plans
    layers = [p for p in plans.layers if p.numel > 0]
    kept, stepped = len(plans.kept), len(plans.device_stepped)
    lean = len(plans.indices(Stepper.LEAN))
    trainable = engine.num_parameters()
    host = engine.store.nbytes
    config = engine.config
    opt = engine.optimizer
    out: dict[str, Any] = {
        "compute_dtype": _dtype(engine.compute_dtype),
        "master_dtype": "float32",
        "parameters": engine.num_parameters(include_frozen=True),
        "trainable_parameters": trainable,
        "device": str(engine.device),
        "layers": len(layers),
        "layers_kept_on_device": kept,
        "layers_stepped_on_device": stepped,
        "layers_stepped_on_host": len(layers) - kept - stepped - lean,
        "layers_lean": lean,
        "resident_parts": "device" if plans.resident.master is Where.DEVICE else "host",
        "host_bytes": host,
        "host_bytes_per_trainable_parameter": round(host / trainable, 2) if trainable else 0.0,
        "loss_impl": engine.head_extras.loss_impl.value,
        "loss_impl_reason": getattr(engine.head_extras, "loss_impl_reason", ""),
        "torch_compile": config.compiles(engine.device.type),
        "micro_batch_size": config.micro_batch_size,
        "masked_attention": ("flex" if engine.attention is not None and engine.attention.flex else "model"),
        "masked_attention_reason": engine.attention.reason if engine.attention is not None else "",
        "padding_free": engine.unpadding.on,
        "padding_free_reason": engine.unpadding.reason,
        "checkpoint": _checkpoint(engine),
        "config_explicit_keys": sorted(config.explicit_keys),
        "config_source": config_source or "given to the engine",
    }
    placement = getattr(engine, "host_placement", None)  # (core/threads.py: node, cores, threads)
    if placement is not None:
        out["host_placement"] = {**placement.as_dict(), "text": placement.describe()}
    out.update(_processes(engine, trainable))
    if opt is not None:
        out.update({**engine.modes.describe(), "max_grad_norm": opt.max_grad_norm})  # (core/plan.py StepModes)
    return out


def _checkpoint(engine: Any) -> dict[str, Any]:
    """One Trainer checkpoint's bytes (export/weights.py ``checkpoint_bytes``: the formula ``megatrain estimate``
    prints; the Trainer checks them against the output folder's free space before the first step)."""
    ck = checkpoint_bytes(engine)
    return {"bytes": ck.total, "export_bytes": ck.export, "master_bytes": ck.master, "moment_bytes": ck.moments,
            "save_dtype": engine.config.save_dtype}


def _width(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _processes(engine: Any, trainable: int) -> dict[str, Any]:
    """How many data-parallel processes train together, this rank's shard of the host-stepped layers, and host
    memory counted once: the store's shared buffers (``Where.HOST``: one copy per host, mapped by each of its
    processes) once, each process's private host buffers (a CPU device's replicated resident unit) once per process.
    (Not counted: the ranks' per-unit update counters, 8 bytes per unit and process, shared too.)"""
    ranks = engine.ranks
    if ranks.world == 1:
        return {"processes": 1}
    on_host = ranks.on_host
    # (a lean store's gradient plane is no store buffer: each rank holds the plane of its shards, the host the
    # whole plane once)
    plane = sum(u.plan.grad_plane * u.numel for u in engine.store.units)
    shared = sum(u.plan.nbytes(Where.HOST, engine.compute_dtype) for u in engine.store.units) - plane
    private = engine.store.nbytes - shared
    host = shared + on_host * private + plane
    units = [u for u in engine.store.units if sharded(u) and u.numel]
    mine = [ranks.own(u) for u in units]  # (this rank's shard of each: what its optimizer steps)
    state = [sum(t.element_size() for t in (u.master, u.grad, u.exp_avg, u.exp_avg_sq, u.compute)
                 if t is not None and t.device.type == "cpu") for u in units]  # bytes per element of the unit
    return {
        "processes": ranks.world,
        "processes_on_host": on_host,
        "rank": engine.dp.rank,
        "shard_elements": sum(map(_width, mine)),
        "shard_bytes": sum(_width(span) * b for span, b in zip(mine, state)),
        "shard_elements_per_layer": [_width(span) for span in mine],
        "shard_elements_by_rank": [sum(_width(shard_range(u.numel, r, on_host)) for u in units)
                                   for r in range(on_host)],
        "host_bytes_shared": shared,
        "host_bytes_per_process": private,
        "host_bytes": host,
        "host_bytes_per_trainable_parameter": round(host / trainable, 2) if trainable else 0.0,
        # (engine/weight_gather.py: how many of those layers the training forward loads by shards + all-gather)
        "weight_gather_layers": len(gather.order) if (gather := engine.executor.weights.gather) is not None else 0,
    }


def _placement(s: dict[str, Any]) -> str:
    lean = f", {s['layers_lean']} lean" if s["layers_lean"] else ""
    if s["device"].split(":")[0] == "cpu":  # (nothing is placed on a GPU: say so rather than "0 kept on the GPU")
        return f"  placement: no GPU in this run: {s['layers']} decoder layers{lean} and AdamW on the CPU"
    return (f"  placement: {s['layers']} decoder layers: {s['layers_kept_on_device']} kept on the GPU, "
            f"{s['layers_stepped_on_device']} streamed + AdamW on the GPU, {s['layers_stepped_on_host']} streamed + "
            f"AdamW on the CPU{lean}; embeddings/head on the {'GPU' if s['resident_parts'] == 'device' else 'CPU'}")


def _host_memory(s: dict[str, Any]) -> str:
    per = f"{s['host_bytes_per_trainable_parameter']} B per trainable parameter"
    if s.get("processes", 1) == 1:
        return f"  host memory: {s['host_bytes'] / 2**30:.2f} GiB ({per})"
    return (f"  host memory: {format_bytes(s['host_bytes'])} on this host: the shared store "
            f"{format_bytes(s['host_bytes_shared'])} once + {s['processes_on_host']} x "
            f"{format_bytes(s['host_bytes_per_process'])} per process ({per}, counted once)")


def _shard(s: dict[str, Any]) -> str:
    per_layer = s["shard_elements_per_layer"]
    spread = f"{min(per_layer):,}-{max(per_layer):,}" if per_layer else "0"
    return (f"  data parallel: {s['processes']} processes ({s['processes_on_host']} on this host, sharing its store); "
            f"rank {s['rank']} steps its shard, {s['shard_elements']:,} elements of the host-stepped layers "
            f"({format_bytes(s['shard_bytes'])} of state; {spread} per layer); the host's ranks: "
            + ", ".join(f"{n:,}" for n in s["shard_elements_by_rank"])
            + f"; the training forward loads {s['weight_gather_layers']} layers by shards + all-gather")


def _checkpoint_line(c: dict[str, Any]) -> str:
    master = f" + FP32 master {format_bytes(c['master_bytes'])}" if c["master_bytes"] else ""
    return (f"  checkpoint: {format_bytes(c['bytes'])} per Trainer checkpoint (export in {c['save_dtype']} "
            f"{format_bytes(c['export_bytes'])}{master} + AdamW moments {format_bytes(c['moment_bytes'])}); "
            f"save_model / save_only_model=True: {format_bytes(c['export_bytes'])}")


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a short block of text (what the Trainer logs at the start of training)."""
    s = summary
    lines = [
        f"hf_megatrain: {s['parameters']:,} parameters ({s['trainable_parameters']:,} trainable) on {s['device']}; "
        f"compute {s['compute_dtype']}, FP32 master/gradients/AdamW",
        _placement(s),
        _host_memory(s),
        f"  loss: {s['loss_impl']} ({s['loss_impl_reason']}); torch_compile={s['torch_compile']}, "
        f"micro_batch_size={s['micro_batch_size']}",
        f"  masked batches' attention: {s['masked_attention_reason']}; {s['padding_free_reason']}",
    ]
    if s.get("checkpoint"):
        lines.append(_checkpoint_line(s["checkpoint"]))
    if s.get("processes", 1) > 1:
        lines.append(_shard(s))
    if s.get("host_placement"):
        lines.append(f"  host threads: {s['host_placement']['text']}")
    if "host_kernel" in s:
        lines.append(f"  optimizer: host AdamW kernel {s['host_kernel']}, speculative_step={s['speculative_step']}, "
                     f"narrow_grads={s['narrow_grads']}, split_host_update={s['split_host_update']}, "
                     f"max_grad_norm={s['max_grad_norm']}")
    if s.get("reference"):  # (a TRL trainer with a reference model: hf/dpo_support.py)
        lines.append(f"  reference: {s['reference']}")
    keys = ", ".join(s["config_explicit_keys"]) or "none (all defaults)"
    lines.append(f"  config: from {s['config_source']}; keys set: {keys}")
    return "\n".join(lines)
