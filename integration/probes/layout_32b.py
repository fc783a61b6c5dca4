"""Which host layout a Qwen2.5-32B run gets on the 4 x H100-80GB, 512 GiB host with the DEFAULT config (issue 46).

CPU only: the engine's own rules (``planner.unit_plans`` + ``planner.check_fits``, what ``engine/conversion_plan.py``
runs before allocating) on a meta skeleton of integration/hub_configs/qwen2.5-32b.json, for 1 and N processes; the
planner's host-layout choice (``megatrain estimate``'s "Host layouts"); and the deepest layer count each fits.

    python integration/probes/layout_32b.py [--host-gib 499] [--gpu-gib 79.2] [--gpus 1,4] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

from hf_megatrain import MegaTrainConfig, planner  # noqa: E402
from hf_megatrain.planner.host_layout import choose, host_layouts  # noqa: E402
from hf_megatrain.planner.cli import load_shape  # noqa: E402
from hf_megatrain.planner.step_time import MachineProfile  # noqa: E402

GIB = 2 ** 30
CONFIG = os.path.join(os.path.dirname(HERE), "hub_configs", "qwen2.5-32b.json")
_ONE: dict = {}


def shape_for(layers: int) -> planner.ModelShape:
    one = _ONE.get("shape") or _ONE.setdefault("shape", load_shape(CONFIG))
    per = one.layer_numels[0]
    return dataclasses.replace(one, layer_numels=[per] * layers, layer_frozen=[0] * layers)


def verdict(layers: int, config: MegaTrainConfig, gpus: int, host: int, gpu: int, seq: int, batch: int) -> dict:
    shape = shape_for(layers)
    plans = planner.unit_plans(shape, config, "cuda", gpu, host_free=host) if gpus == 1 else None
    plan = planner.estimate(shape, config, seq, batch, device_type="cuda", gpu_free=gpu, gpus=gpus, plans=plans)
    store = planner.estimate(shape, config, 1, 1, device_type="cuda", gpu_free=gpu, gpus=gpus, plans=plans,
                             offloaded_layers=0)
    out = {"layers": layers, "gpus": gpus, "params": shape.trainable, "host_need_gib": plan.host_total / GIB,
           "host_at_construction_gib": store.host_total / GIB, "gpu_need_gib": plan.device_total / GIB,
           "limit_gib": config.host_memory_fraction * host / GIB}
    # The engine's own check before it allocates (engine/conversion_plan.py); each data-parallel rank runs it on the
    # placement data parallel resolves to (parallel/setup.py: every layer streamed and stepped on the host).
    cfg = config if gpus == 1 else config.resolved(device_layers=0, device_step_layers=0)
    rank_plans = plans or planner.unit_plans(shape, cfg, "cuda", gpu, host_free=host)
    out["kept_layers"] = len(rank_plans.kept)
    out["gpu_stepped_layers"] = len(rank_plans.device_stepped)
    try:
        planner.check_fits(shape, cfg, device_type="cuda", gpu_available=gpu, baseline_paid=True,
                           plans=rank_plans, host_available=host)
        out["engine_check"] = "builds"
    except MemoryError as e:
        out["engine_check"] = str(e)
    out["fits"] = plan.host_total <= config.host_memory_fraction * host and plan.device_total <= gpu
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-gib", type=float, default=499.0)
    ap.add_argument("--gpu-gib", type=float, default=79.2)
    ap.add_argument("--gpus", default="1,4")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--config", default="{}", help="JSON MegaTrainConfig overrides (default: none)")
    a = ap.parse_args(argv)
    host, gpu = int(a.host_gib * GIB), int(a.gpu_gib * GIB)
    config = MegaTrainConfig.from_dict({"compute_dtype": "bfloat16", **json.loads(a.config)})
    for gpus in [int(x) for x in a.gpus.split(",")]:
        full = verdict(64, config, gpus, host, gpu, a.seq, a.batch)
        print(f"== {gpus} process(es), 64 layers, config {a.config}")
        print(json.dumps(full, indent=1))
        deepest = max((n for n in range(1, 65) if verdict(n, config, gpus, host, gpu, a.seq, a.batch)["fits"]),
                      default=0)
        print(f"deepest that fits with this config: {deepest} layers "
              f"({shape_for(deepest).trainable / 1e9:.2f}B params)" if deepest else "not even one layer fits")
        if gpus == 1:
            shape = shape_for(64)
            layouts = host_layouts(shape, config, a.seq, a.batch, gpu, host, MachineProfile())
            best, why = choose(layouts)
            for x in layouts:
                print(f"  layout {x.name:<30} {x.bytes_per_param:.1f} B/param host {x.host_total / GIB:6.1f} GiB "
                      f"GPU {x.gpu_total / GIB:5.1f} GiB fits={x.fits} step {x.step_s:.2f} s")
            print(f"  planner choice: {best.name if best else None} {best.keys if best else ''}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
