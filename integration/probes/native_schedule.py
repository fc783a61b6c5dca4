"""Variants of the native host AdamW kernel (core/native_adamw.py), alone and while DMA runs both ways: the
kernel as built, with ordinary stores for the compute copy, and with one fixed share per thread (static schedule).
One 14B-width layer by default; lean (no copy) and with the bf16 copy; 16, 14 and 12 threads for the kernel as is.

    python integration/probes/native_schedule.py [numel] [out.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_megatrain.core import kernels, native_adamw  # noqa: E402
from host_adamw_rate import dma_running, in_thread, timed  # noqa: E402

VARIANTS = {  # name -> (text in the kernel's source, its replacement)
    "current": ("", ""),
    "plain-stores": ("if (OUT) stream_u16(out + s, buf, t - s);", "if (OUT) memcpy(out + s, buf, 2 * (t - s));"),
    "static": ("schedule(dynamic, 1)", "schedule(static)"),
}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 275_268_608
    pin = torch.cuda.is_available()
    mk = lambda dt=torch.float32: torch.empty(n, dtype=dt, pin_memory=pin).uniform_(0.1, 1.0)  # noqa: E731
    p, m, v, g, out = mk(), mk(), mk(), mk(torch.bfloat16), mk(torch.bfloat16)
    c, small = kernels._constants(kernels.Hyper(1e-4, (0.9, 0.999), 1e-8, 0.01), 10, None)
    libs = {}
    for name, (old, new) in VARIANTS.items():
        assert old in native_adamw._SOURCE, name  # (the kernel changed: update the variant)
        libs[name] = native_adamw.build(native_adamw._SOURCE.replace(old, new) if old else native_adamw._SOURCE)

    def job(lib, threads: int, copy: bool, state: bool = True):
        return lambda: lib.adamw_span(p.data_ptr(), g.data_ptr(), 1, m.data_ptr(), v.data_ptr(),
                                      out.data_ptr() if copy else None, n, c.data_ptr(), int(small), threads,
                                      int(state))
    res = {}
    for dirs in ((), ("d2h", "h2d")) if pin else ((),):
        with dma_running(n // 2, dirs):
            for name, lib in libs.items():
                for threads in (16, 14, 12) if name == "current" else (16,):
                    for copy in (False, True):
                        sec = timed(in_thread(job(lib, threads, copy)), 5)
                        key = f"{'+'.join(dirs) or 'alone'} {name} t{threads} {'copy' if copy else 'lean'}"
                        res[key] = n / sec / 1e9
                        print(f"{key:45s} {sec * 1e3:7.1f} ms {n / sec / 1e9:5.2f} G param/s", flush=True)
            # The halves of a split update (kernels.UpdatePart): the new weights alone, then master and moments.
            for name, lib in libs.items():
                sec = timed(in_thread(job(lib, 16, True, False)), 5)
                key = f"{'+'.join(dirs) or 'alone'} {name} t16 weights-only"
                res[key] = n / sec / 1e9
                print(f"{key:45s} {sec * 1e3:7.1f} ms {n / sec / 1e9:5.2f} G param/s", flush=True)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
