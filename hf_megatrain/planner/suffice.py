"""What would suffice when a run does not fit: the host RAM and GPU each exact layout needs, the disk tier with its
real step time, the GPU-side changes that fit, and the cheapest change of all.

``megatrain estimate`` prints this section when its verdict is "does NOT fit". Every figure comes from the same
planner calls as the rest of the estimate (``estimate``, ``host_layouts``, ``predict_step``): one more plan per
candidate, nothing guessed. Order of "cheapest": a change of config keys on the machine checked (the fastest
predicted step among those that fit), else the least hardware (the smallest RAM, then the fastest step).

A decoder layer is the smallest unit the engine streams: when one layer's weight slots, gradient and offload
buffers alone exceed the GPU (``step_reserve_bytes``), no config key helps. Streaming a MoE layer expert by expert
is not supported; the section says so and names the GPU it would take.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config import MegaTrainConfig
from ..core.memory import format_bytes
from .disk_tier import disk_moment_bytes, with_disk_tier
from .host_layout import Layout, host_layouts
from .predict import MemoryPlan, ModelShape, estimate, step_reserve_bytes
from .step_time import MachineProfile

__all__ = ["Suffice", "what_would_suffice", "suffice_lines", "layer_floor", "machine_words"]

# GPU-side changes tried in this order when the step's peak exceeds the GPU (each keeps the math exact).
GPU_CHANGES: tuple[dict[str, Any], ...] = (
    {"activation_offload": "on"},
    {"activation_offload": "on", "seq_chunk_tokens": -1},
    {"activation_offload": "on", "seq_chunk_tokens": -1, "loss_chunk_tokens": 1024},
)


@dataclass
class Suffice:
    """The answer: what each option needs, and the cheapest that fits."""

    layouts: list[Layout] = field(default_factory=list)  # the exact layouts, moments in RAM
    disk_layouts: list[Layout] = field(default_factory=list)  # the same with the disk tier
    gpu_change: dict[str, Any] | None = None  # config keys that bring the step under the GPU ({}: it fits already)
    gpu_need: int = 0  # the step's planned GPU peak as configured
    floor: int = 0  # GPU bytes one streamed layer needs before any activation (step_reserve_bytes)
    layer_too_big: bool = False
    cheapest: str = ""
    least_hardware: str = ""
    disk_refused: str = ""  # why the disk tier cannot serve this run (data parallel), else empty


def layer_floor(shape: ModelShape, config: MegaTrainConfig) -> int:
    """GPU bytes every step needs whatever the placement and sequence: the CUDA context, ``num_slots`` weight slots
    of the largest layer, its gradient and two offload buffers, with fragmentation (``step_reserve_bytes``)."""
    return step_reserve_bytes(shape, config)


def machine_words(host_available: int, gpu: int | None) -> str:
    """"a machine with ..." as the verdict names a machine it did not detect."""
    return (f"a machine with {format_bytes(host_available)} of host RAM available and "
            + (f"{_a(format_bytes(gpu))} {format_bytes(gpu)} GPU" if gpu is not None else "no GPU"))


def _a(number: str) -> str:
    """The article before a number as it is read: "an 80.0 GiB", "an 11.7 TiB", "a 141.0 GiB"."""
    whole = number.split(".")[0].split()[0]
    return "an" if whole.startswith("8") or whole in ("11", "18") or (
        len(whole) == 5 and whole[:2] in ("11", "18")) else "a"


def _keys(keys: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in keys.items())


def _need_ram(x: Layout, fraction: float) -> int:
    return int(x.host_total / fraction)  # (the engine uses host_memory_fraction of what is available)


def what_would_suffice(shape: ModelShape, config: MegaTrainConfig, plan: MemoryPlan, seq_len: int, batch_size: int,
                       gpu: int, host_available: int, machine: MachineProfile, *, clipping: bool,
                       step_model: bool, gpus: int = 1, grad_accum: int = 1) -> Suffice:
    """Plan the options for a run that does not fit ``host_available`` bytes of RAM and a ``gpu``-byte GPU
    (``gpus`` data-parallel processes, ``grad_accum`` micro-steps per step, as ``estimate`` takes them).
    ``step_model``: the step time is predicted (bf16, one GPU); else only the memory is."""
    out = Suffice(gpu_need=plan.device_total, floor=layer_floor(shape, config))
    out.layer_too_big = out.floor > gpu
    if plan.device_total <= gpu:
        out.gpu_change = {}
    elif not out.layer_too_big:
        for change in GPU_CHANGES:
            cfg = dataclasses.replace(config, **change)
            if estimate(shape, cfg, seq_len, batch_size, device_type="cuda", gpu_free=gpu, grad_accum=grad_accum,
                        gpus=gpus).device_total <= gpu:
                out.gpu_change = change
                break
    base = dataclasses.replace(config, **(out.gpu_change or {}))
    frac = config.host_memory_fraction
    if step_model:
        out.layouts = host_layouts(shape, base, seq_len, batch_size, gpu, host_available, machine, clipping,
                                   grad_accum)
        out.disk_layouts = host_layouts(shape, with_disk_tier(base), seq_len, batch_size, gpu, host_available,
                                        machine, clipping, grad_accum)
    else:  # (memory only: the configured layout, with and without the disk tier)
        for cfg, into in ((base, out.layouts), (with_disk_tier(base), out.disk_layouts)):
            try:
                mem = estimate(shape, cfg, seq_len, batch_size, device_type="cuda", gpu_free=gpu,
                               grad_accum=grad_accum, gpus=gpus)
            except ValueError as e:  # (data parallel refuses the disk tier)
                out.disk_refused = str(e)
                continue
            host_ok, gpu_ok = mem.host_total <= frac * host_available, mem.device_total <= gpu
            into.append(Layout("as configured", {}, mem.store_host_bytes / max(shape.trainable, 1), mem.host_total,
                               host_ok and gpu_ok, float("nan"), 1, mem.device_total, host_ok, gpu_ok,
                               disk_moment_bytes(mem)))
    gpu_keys = out.gpu_change or {}
    here = [(x, False) for x in out.layouts if x.fits] + [(x, True) for x in out.disk_layouts if x.fits]
    if here:  # a change of keys on the machine checked: the fastest that fits (NaN: memory only, the first)
        x, disk = min(here, key=lambda t: (t[0].step_s != t[0].step_s, t[0].step_s))
        keys = {**gpu_keys, **x.keys, **({"optimizer_state_dir": "<a local disk directory>"} if disk else {})}
        out.cheapest = f"{_keys(keys) or 'the configured layout'}" + (
            f" ({x.name}{' + disk tier' if disk else ''}: {_step(x)})" if x.name != "as configured" else "")
    # The least hardware: the layout (moments in RAM) that needs the least RAM, then the fastest; its GPU peak.
    if not out.layouts:
        return out
    x = min(out.layouts, key=lambda t: (t.host_total, t.step_s if t.step_s == t.step_s else 0.0))
    out.least_hardware = (f"{format_bytes(_need_ram(x, frac))} of host RAM available and a GPU of "
                          f"{format_bytes(x.gpu_total)} or more ({x.name}"
                          + (f", {_keys({**gpu_keys, **x.keys})}" if x.keys or gpu_keys else "")
                          + f": {_step(x)})")
    return out


def _step(x: Layout) -> str:
    if x.step_s != x.step_s:
        return "step time not predicted"
    return f"{x.step_s:,.3f} s/step" + (", bound by the disk" if "disk tier" in x.bottleneck else "")


def suffice_lines(s: Suffice, shape: ModelShape, config: MegaTrainConfig, gpu: int, host_available: int,
                  disk_gbps: float, where: str) -> list[str]:
    """The ``What would suffice`` section of ``megatrain estimate``."""
    frac = config.host_memory_fraction
    out = [f"What would suffice (this run does not fit {where})",
           f"  host RAM each exact layout needs ({frac:g} x the available RAM is used; "
           f"{format_bytes(host_available)} available), its GPU peak, its step:"]

    def row(x: Layout, disk: bool) -> str:
        name = x.name + (" + disk tier" if disk else "")
        state = "fits" if x.fits else "does not fit: " + " and ".join(
            w for w, ok in (("RAM", x.host_fits), ("GPU", x.gpu_fits)) if not ok)
        return (f"    {x.bytes_per_param:4.1f} B/param  {name:<42} RAM {format_bytes(_need_ram(x, frac)):>11}  "
                f"GPU {format_bytes(x.gpu_total):>11}  {_step(x):<34} {state}")

    out += [row(x, False) for x in s.layouts]
    if s.disk_refused:
        out.append(f"  the disk tier (optimizer_state_dir): not supported for this run: {s.disk_refused}")
    else:
        out.append(f"  with the disk tier (optimizer_state_dir: AdamW m, v on disk; every step reads and writes "
                   f"them at {disk_gbps:g} GB/s, --disk-gbps, unless the page cache holds them):")
        out += [row(x, True) for x in s.disk_layouts]
    n_max = max(shape.layer_numels, default=0)
    if s.layer_too_big:
        out.append(f"  GPU: one decoder layer ({n_max / 1e9:.2f}B parameters) needs {format_bytes(s.floor)} of "
                   f"the GPU before any activation ({config.num_slots} weight slots, its gradient and two offload "
                   f"buffers), more than the {format_bytes(gpu)} GPU: no sequence length or placement fits it. A "
                   "decoder layer is the smallest unit the engine streams; streaming a MoE layer expert by expert "
                   f"is not supported. It needs a GPU of {format_bytes(s.gpu_need)} or more for this step.")
    elif s.gpu_change:
        out.append(f"  GPU: this step needs {format_bytes(s.gpu_need)} of the {format_bytes(gpu)} GPU; "
                   f"{_keys(s.gpu_change)} brings it under (the rows above include it)")
    elif s.gpu_change is None:
        out.append(f"  GPU: this step needs {format_bytes(s.gpu_need)} of the {format_bytes(gpu)} GPU and no "
                   "exact config change brings it under: shorten seq_len or batch_size, or a GPU of "
                   f"{format_bytes(s.gpu_need)} or more")
    out.append(f"  cheapest change that fits: {s.cheapest}" if s.cheapest
               else f"  cheapest change that fits: none of config alone on {where}")
    if s.least_hardware:
        out.append(f"  least hardware that fits (moments in RAM): {s.least_hardware}")
    return out
