"""Probe: variants of the native AdamW kernel (core/native_adamw.py) alone and under DMA in both directions.

    python integration/probes/native_schedule.py [numel] [out.json]
"""
import ctypes, os, subprocess, sys, tempfile, threading, time, json
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from hf_megatrain.core import native_adamw, kernels

VARIANTS = {  # name -> (text in the kernel's source, its replacement)
    "current": ("", ""),
    "plain-stores": ("if (OUT) stream_u16(out + s, buf, t - s);", "if (OUT) memcpy(out + s, buf, 2 * (t - s));"),
    "static": ("schedule(dynamic, 1)", "schedule(static)"),
}


def build(variant: str):
    d = tempfile.mkdtemp()
    old, new = VARIANTS[variant]
    assert old in native_adamw._SOURCE, variant
    src = native_adamw._SOURCE.replace(old, new) if old else native_adamw._SOURCE
    open(f"{d}/a.c", "w").write(src)
    subprocess.run([native_adamw._compiler(), *native_adamw._FLAGS, f"{d}/a.c", "-o", f"{d}/a.so"], check=True)
    lib = ctypes.CDLL(f"{d}/a.so")
    lib.adamw_span.restype = None
    lib.adamw_span.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib

n = int(sys.argv[1]) if len(sys.argv) > 1 else 275_268_608
pin = torch.cuda.is_available()
mk = lambda dt=torch.float32: torch.empty(n, dtype=dt, pin_memory=pin).uniform_(0.1, 1.0)
p, m, v, g = mk(), mk(), mk(), mk(torch.bfloat16)
out = mk(torch.bfloat16)
c, small = kernels._constants(kernels.Hyper(1e-4, (0.9, 0.999), 1e-8, 0.01), 10, None)
res = {}
def timed(fn, reps=5):
    fn(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]
def in_thread(fn):
    def run():
        t = threading.Thread(target=fn); t.start(); t.join()
    return run
scheds = list(VARIANTS)
libs = {s: build(s) for s in scheds}
def job(lib, threads, copy):
    return lambda: lib.adamw_span(p.data_ptr(), g.data_ptr(), 1, m.data_ptr(), v.data_ptr(),
                                  out.data_ptr() if copy else None, n, c.data_ptr(), int(small), threads)
dmas = [(), ("d2h", "h2d")] if pin else [()]
for dirs in dmas:
    stop = threading.Event(); ts = []
    if dirs:
        dev = torch.empty(n // 2, device="cuda"); dst = torch.empty(n // 2, pin_memory=True)
        dev_in = torch.empty(n // 2, device="cuda"); src = torch.empty(n // 2, pin_memory=True)
        def dma(direction):
            st = torch.cuda.Stream()
            with torch.cuda.stream(st):
                while not stop.is_set():
                    (dst.copy_(dev, non_blocking=True) if direction == "d2h" else dev_in.copy_(src, non_blocking=True))
                    st.synchronize()
        ts = [threading.Thread(target=dma, args=(d,)) for d in dirs]
        for t in ts: t.start()
        time.sleep(0.5)
    for s in scheds:
        for threads in (16, 14, 12):
            for copy in (False, True):
                if threads != 16 and s != "current":
                    continue
                sec = timed(in_thread(job(libs[s], threads, copy)))
                key = f"{'+'.join(dirs) or 'alone'} {s} t{threads} {'copy' if copy else 'lean'}"
                res[key] = n / sec / 1e9
                print(f"{key:45s} {sec*1e3:7.1f} ms {n/sec/1e9:5.2f} G param/s", flush=True)
    stop.set()
    for t in ts: t.join()
if len(sys.argv) > 2:
    Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
