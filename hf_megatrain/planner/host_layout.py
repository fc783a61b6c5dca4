"""Host layouts: which exact host layout (18 / 16 / 14 / 12 bytes per parameter) is the fastest that fits the RAM.

Every layout trains the same weights (each is exact against torch AdamW); they trade host RAM for speed:

    18  the full store: FP32 master, gradient, m, v + the bf16 copy that streams
    16  lean + bf16 copy + gradient plane: streams bf16, a clipping step updates from the plane
    14  lean + bf16 copy: streams bf16, a clipping step re-runs its forward+backward
    14  lean + gradient plane: streams the FP32 master (cast on the GPU), no re-run when clipping
    12  lean: streams FP32, a clipping step re-runs

(plus 2 B/param of bf16 plane where the gradients cross narrow, 4 where they cross FP32.) ``host_layouts`` plans
each one with the engine's own rules (``unit_plans``, ``estimate``) for this host's RAM and predicts its step
(``predict_step``), and ``choose`` takes the fastest that fits -- with clipping on every step unless told otherwise
(Trainer's default ``max_grad_norm=1.0``). ``megatrain estimate`` prints the table and the choice with the config
keys that select it; the config the user gives overrides it (the engine only decides ``lean_grad_plane="auto"``
for the lean layout asked for, by the same fit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..config import MegaTrainConfig
from ..core.plan import Where
from .disk_tier import moments_cached
from .predict import ModelShape, estimate, unit_plans
from .step_time import MachineProfile, predict_step

_KEYS = ("lean_store", "lean_compute_copy", "lean_grad_plane")  # (the config keys each layout sets)
LAYOUTS: tuple[tuple[str, dict[str, object]], ...] = tuple((name, dict(zip(_KEYS, values))) for name, values in (
    ("full store", (False, False, "auto")),
    ("lean + bf16 copy + grad plane", (True, True, "on")),
    ("lean + bf16 copy", (True, True, "off")),
    ("lean + grad plane", (True, False, "on")),
    ("lean", (True, False, "off")),
))


@dataclass
class Layout:
    name: str
    keys: dict[str, object]  # the config keys that select it
    bytes_per_param: float  # host bytes per streamed-layer parameter
    host_total: int
    fits: bool  # host RAM and GPU both
    step_s: float  # predicted step, clipping as asked
    passes: int  # forward+backward passes per step
    gpu_total: int = 0  # the step's planned GPU peak
    host_fits: bool = True
    gpu_fits: bool = True
    disk_bytes: int = 0  # AdamW moments on disk (optimizer_state_dir)
    bottleneck: str = ""


def host_layouts(shape: ModelShape, config: MegaTrainConfig, seq_len: int, batch_size: int, gpu_free: int | None,
                 host_free: int, machine: MachineProfile, clipping: bool = True, grad_accum: int = 1,
                 device_type: str = "cuda", step_model: bool = True, gpus: int = 1) -> list[Layout]:
    """Every layout of ``LAYOUTS`` planned for this model, a ``gpu_free``-byte GPU and ``host_free`` bytes of RAM
    (bf16 compute). It fits when its host plan fits ``host_memory_fraction`` of the RAM and its step's GPU peak the
    GPU; with ``optimizer_state_dir`` in ``config`` its step counts the moments' disk traffic (disk_tier.py).
    Layouts the other keys rule out (the lean store with ``device_layers`` > 0, a bf16 gradient offload, or
    gradient accumulation) are left out: the engine would refuse them. ``gpus`` > 1: that many data-parallel
    processes of one host (their placement, one shared store, each process's own buffers)."""
    out = []
    for name, keys in LAYOUTS:
        if keys["lean_store"] and grad_accum > 1:
            continue  # (lean_store refuses gradient accumulation: hf/training_args.py)
        try:
            cfg = dataclasses.replace(config, **keys)
            if gpus > 1:
                cfg = _data_parallel(cfg, gpus)
        except ValueError:  # (a combination config validation or the data-parallel path refuses)
            continue
        plans = unit_plans(shape, cfg, device_type, gpu_free, host_free=host_free, data_parallel=gpus > 1)
        mem = estimate(shape, cfg, seq_len, batch_size, device_type=device_type, gpu_free=gpu_free, plans=plans,
                       grad_accum=grad_accum, gpus=gpus)
        numel = sum(p.numel for p in plans.layers) or 1
        per = sum(p.nbytes(Where.HOST, cfg.torch_compute_dtype) for p in plans.layers) / numel
        pred = predict_step(shape, cfg, plans, seq_len, batch_size, machine, clipping=clipping,
                            grad_accum=grad_accum, moments_cached=moments_cached(mem, cfg, host_free)) \
            if step_model else None  # (step_model False: the fit alone; no step prediction for this device)
        host_ok = mem.host_total <= cfg.host_memory_fraction * host_free
        gpu_ok = gpu_free is None or mem.device_total <= gpu_free
        out.append(Layout(name, keys, per, mem.host_total, host_ok and gpu_ok,
                          pred.step_s if pred else float("nan"), pred.passes if pred else 0,
                          mem.device_total, host_ok, gpu_ok, sum(p.nbytes(Where.DISK, cfg.torch_compute_dtype)
                                                                 for p in plans.units), pred.bottleneck if pred else ""))
    return out


def choose(layouts: list[Layout]) -> tuple[Layout | None, str]:
    """The fastest layout that fits, and why (None: none fits)."""
    fitting = [x for x in layouts if x.fits]
    if not fitting:
        if any(x.host_fits for x in layouts):
            return None, "no exact host layout fits: those that fit the RAM do not fit the GPU"
        return None, "no exact host layout fits the RAM"
    best = min(fitting, key=lambda x: x.step_s)
    faster = [x for x in layouts if x.step_s < best.step_s and not x.fits]
    why = f"the fastest predicted step ({best.step_s:.3f} s) of the layouts that fit"
    if faster:
        why += "; faster but too large for the RAM or GPU: " + ", ".join(f"{x.name} ({x.step_s:.3f} s)"
                                                                       for x in faster)
    if best.passes > 1:
        why += "; its clipping steps re-run forward+backward (no room for a gradient plane)"
    return best, why


def layout_lines(layouts: list[Layout], clipping: bool) -> list[str]:
    """The ``Host layouts`` section of ``megatrain estimate``."""
    from ..core.memory import format_bytes

    best, why = choose(layouts)
    out = [f"Host layouts (exact; predicted step {'with clipping on every step' if clipping else 'without clipping'})"]
    for x in layouts:
        mark = "->" if x is best else "  "
        verdict = "fits" if x.fits else "DOES NOT FIT" + ("" if x.host_fits else " RAM") + (
            "" if x.gpu_fits else " GPU")
        out.append(f"{mark} {x.bytes_per_param:4.1f} B/param  {x.name:<30} host {format_bytes(x.host_total):>11} "
                   f"GPU {format_bytes(x.gpu_total):>11} {verdict:<20} {x.step_s:8.3f} s/step"
                   + (" (re-runs forward+backward)" if x.passes > 1 else ""))
    if best is not None:
        keys = ", ".join(f"{k}={v!r}" for k, v in best.keys.items())
        out.append(f"  choice: {best.name} ({keys}): {why}")
    else:
        out.append(f"  choice: none ({why})")
    return out


def is_planned(config: MegaTrainConfig, gpus: int) -> bool:
    """The step model covers one GPU in bf16: only then are layouts compared."""
    return config.torch_compute_dtype == torch.bfloat16 and gpus == 1


def _data_parallel(config: MegaTrainConfig, gpus: int) -> MegaTrainConfig:
    """``config`` as ``gpus`` data-parallel processes of one host run it (raises what that path refuses)."""
    from ..parallel.setup import data_parallel_config  # (as predict.estimate takes it)

    return data_parallel_config(config, SimpleNamespace(world=gpus))


# Keys whose explicit setting means the user chose the host layout (``host_layout="auto"`` then leaves it alone).
LAYOUT_KEYS = _KEYS + ("optimizer_state_dir",)
AUTO_SEQ_LEN, AUTO_BATCH = 2048, 8  # (the step ``auto_layout`` ranks layouts for when the config plans no tokens)


def auto_layout(shape: ModelShape, config: MegaTrainConfig, device_type: str, gpu_free: int | None, host_free: int,
                grad_accum: int = 1, machine: MachineProfile | None = None,
                gpus: int = 1) -> tuple[MegaTrainConfig, str | None]:
    """``host_layout="auto"``: the config to build the engine with, and a note when it is not ``config``'s layout.

    The full store is kept whenever its host plan fits ``host_memory_fraction`` of ``host_free``; the user's own
    layout keys (``LAYOUT_KEYS`` set explicitly) and ``host_layout="full"`` are never overridden; with gradient
    accumulation the lean layouts are out (they take one backward per step). Otherwise: on a GPU with bf16 compute,
    the fastest exact layout that fits (``choose``, clipping on every step as Trainer's default); elsewhere the first
    of ``LAYOUTS`` that fits (most bytes: the fewest re-runs). None fits: ``config`` unchanged, and the engine's fit
    check refuses with what to change. ``gpus`` > 1: data-parallel processes of one host sharing one store (the
    step model covers one GPU: the first layout that fits)."""
    if config.host_layout != "auto" or config.explicit_keys & set(LAYOUT_KEYS) or grad_accum > 1:
        return config, None
    if config.placement_tokens > 0:
        seq_len, batch = min(AUTO_SEQ_LEN, config.placement_tokens), max(1, config.placement_tokens // AUTO_SEQ_LEN)
    else:
        seq_len, batch = AUTO_SEQ_LEN, AUTO_BATCH
    as_run = _data_parallel(config, gpus) if gpus > 1 else config
    full = estimate(shape, as_run, seq_len, batch, device_type=device_type, gpu_free=gpu_free, gpus=gpus,
                    plans=unit_plans(shape, as_run, device_type, gpu_free, host_free=host_free,
                                     data_parallel=gpus > 1))
    if full.host_total <= config.host_memory_fraction * host_free:
        return config, None
    planned = device_type == "cuda" and is_planned(config, gpus)
    layouts = host_layouts(shape, config, seq_len, batch, gpu_free if device_type == "cuda" else None, host_free,
                           machine or MachineProfile(), device_type=device_type, step_model=planned, gpus=gpus)
    if planned:
        best, why = choose(layouts)
    else:
        best = next((x for x in layouts if x.fits), None)
        why = "the first exact layout that fits, in the order of host bytes (" + (
            "the step model covers one GPU" if gpus > 1 else "no step model for this device") + ")"
    if best is None or not best.keys["lean_store"]:
        return config, None
    from ..core.memory import format_bytes

    keys = ", ".join(f"{k}={v!r}" for k, v in best.keys.items())
    note = (f"host_layout='auto': the full store needs {format_bytes(full.host_total)} of host RAM, more than "
            f"host_memory_fraction={config.host_memory_fraction} of the {format_bytes(host_free)} available; "
            f"training with the {best.name} layout instead ({best.bytes_per_param:.0f} B per streamed parameter, "
            f"{format_bytes(best.host_total)}; {keys}): {why}. The math is the same (exact AdamW, clipping "
            "included); gradient accumulation is refused with it (use micro_batch_size). Set host_layout='full' "
            "to refuse instead, or set the lean keys yourself.")
    return config.resolved(**best.keys), note
