"""The native host AdamW: one C loop (OpenMP, vectorised by the compiler) called through ctypes.

Why not the inductor-compiled loop (kernels.py, ``HostKernel.COMPILED``): inductor's Python binding of a CPU kernel
holds the GIL for the whole call, ~70 ms per 14B-width layer. The overlapped optimizer runs while the backward
is still being driven from Python (autograd's thread launches each layer's kernels, lands gradients), so every
host update froze the backward: measured on the H100 host, a layer's gradient landed only after the previous
layer's update had finished, serialising the GPU with the CPU. ``ctypes.CDLL`` releases the GIL around the foreign
call; torch's own fused kernel does too, but it needs a second pass for the compute copy and reads FP32 gradients
only.

The loop is handed out in 64K-element blocks on demand (``schedule(dynamic)``), not split into one fixed share per
thread: the process's other threads (autograd's, the CUDA driver's, DMA completion) take cores while it runs, and a
fixed share waits for its slowest thread. Measured on the H100 host (the retired native_schedule probe,
integration/PERF.md; one 14B-width layer, DMA running both ways): 1.97 -> 2.22 G param/s at 16 threads, 2.47 at 14.

The compute copy is written with streaming stores (``stream_u16``): the copy is write-only, and an ordinary store
reads each line before filling it.

Same expressions as ``kernels._adamw_math`` (ATen's CPU AdamW, in float), no FMA contraction; the gradient is read
as FP32 or as bf16 (a narrow gradient: its exact FP32 value); the compute copy, if any, is bf16, rounded to nearest
even as torch rounds. Built with the system C compiler (a fraction of a second) once per source, flags, compiler
and CPU, into a private per-user cache (core/build_cache.py): ``-march=native`` code only ever runs on the kind of
CPU it was built for, and no run leaves a directory in /tmp.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from typing import Any

import torch

from .build_cache import shared_library

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_in(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_out(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN, as c10::BFloat16 */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FENCE() _mm_sfence()
#else
#define FENCE() ((void)0)
#endif

/* Write-only output with streaming stores: an ordinary store first reads the line it fills (2 more bytes of DRAM
   traffic per parameter, on a pass of 28); streaming stores skip that read. */
static inline void stream_u16(uint16_t* restrict dst, const uint16_t* restrict src, int64_t n) {
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k < n && ((uintptr_t)(dst + k) & 63); k++) dst[k] = src[k];
    for (; k + 32 <= n; k += 32) _mm512_stream_si512((__m512i*)(dst + k), _mm512_loadu_si512((const void*)(src + k)));
#elif defined(__AVX2__)
    for (; k < n && ((uintptr_t)(dst + k) & 31); k++) dst[k] = src[k];
    for (; k + 16 <= n; k += 16) _mm256_stream_si256((__m256i*)(dst + k), _mm256_loadu_si256((const __m256i*)(src + k)));
#endif
    for (; k < n; k++) dst[k] = src[k];
}

#define BLOCK 65536  /* handed out one at a time (dynamic): see the module docstring */
#define SUB 2048     /* the copy of SUB parameters waits in an L1-sized buffer, then streams out */

#define BODY(GRAD, LERP_SMALL, OUT, STATE)                                                       \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                        \
    for (int64_t b = 0; b < n; b += BLOCK) {                                                     \
        const int64_t e = b + BLOCK < n ? b + BLOCK : n;                                         \
        uint16_t buf[SUB];                                                                       \
        for (int64_t s = b; s < e; s += SUB) {                                                   \
            const int64_t t = s + SUB < e ? s + SUB : e;                                         \
            for (int64_t i = s; i < t; i++) {                                                    \
                float gi = (GRAD) / c7;                                                          \
                float mi = m[i];                                                                 \
                float mn = LERP_SMALL ? mi + c1 * (gi - mi) : gi + c1m1 * (gi - mi);             \
                float vn = v[i] * c2 + c3 * gi * gi;                                             \
                float pn = p[i] * c0 + c6 * mn / (sqrtf(vn) / c4 + c5);                          \
                if (STATE) { m[i] = mn; v[i] = vn; p[i] = pn; }                                  \
                if (OUT) buf[i - s] = bf16_out(pn);                                              \
            }                                                                                    \
            if (OUT) stream_u16(out + s, buf, t - s);                                            \
        }                                                                                        \
        if (OUT) FENCE();  /* streaming stores are weakly ordered: visible before the update ends */ \
    }

/* c = [wd_mul, 1-b1, b2, 1-b2, bc2_sqrt, eps, -step_size, grad_scale]
   write_state = 0: the weights-only half of a split update (the compute copy of the new master; master and moments
   untouched, so the same call with write_state = 1 and no copy later writes bit-identical state). */
#define ALL(GRAD, LERP_SMALL)                                                                                    \
    if (!write_state) { BODY(GRAD, LERP_SMALL, 1, 0) }                                                          \
    else if (out)     { BODY(GRAD, LERP_SMALL, 1, 1) }                                                          \
    else              { BODY(GRAD, LERP_SMALL, 0, 1) }

void adamw_span(float* restrict p, const void* restrict g, int g_bf16, float* restrict m, float* restrict v,
                uint16_t* restrict out, int64_t n, const float* c, int lerp_small, int threads, int write_state) {
    const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4], c5 = c[5], c6 = c[6], c7 = c[7];
    const float c1m1 = c1 - 1.0f;
    const float* restrict gf = (const float*)g;
    const uint16_t* restrict gb = (const uint16_t*)g;
    if (g_bf16) {
        if (lerp_small) { ALL(bf16_in(gb[i]), 1) } else { ALL(bf16_in(gb[i]), 0) }
    } else {
        if (lerp_small) { ALL(gf[i], 1) } else { ALL(gf[i], 0) }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC",
          "-std=c11"]

_lib: Any = None
_lock = threading.Lock()


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise RuntimeError("no C compiler found (cc, gcc or clang)")


def build(source: str = _SOURCE) -> Any:
    """Compile ``source`` (the kernel, or a variant of it: integration/probes) and load it; RuntimeError saying why
    when it cannot be built."""
    lib = shared_library(source, _compiler(), _FLAGS, "adamw", ctypes.CDLL)  # (CDLL: each call releases the GIL)
    lib.adamw_span.restype = None
    lib.adamw_span.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def library() -> Any:
    """The built kernel (built on first use; RuntimeError saying why when it cannot be)."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = build()
        return _lib


def adamw_span_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
                c: torch.Tensor, lerp_small: bool, write_state: bool = True, threads: int | None = None) -> None:
    """One span, in place: contiguous CPU tensors of one length; ``c`` the 8 float32 constants of
    ``kernels._constants``. ``write_state=False``: only ``out`` (required) gets the new weights; master and
    moments are left as they were (the first half of a split update, kernels.UpdatePart). ``threads``: OpenMP
    threads of this call (None: torch's intra-op count); any count writes the same bits (one element, one thread)."""
    if threads is not None and threads < 1:
        raise ValueError(f"native AdamW: threads={threads}; give a count >= 1, or None for torch's intra-op count")
    n = p.numel()
    if n == 0:
        return
    assert g.numel() == m.numel() == v.numel() == n and (out is None or out.numel() == n)
    assert write_state or out is not None
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in (p, g, m, v, c))
    if g.dtype not in (torch.float32, torch.bfloat16) or p.dtype != torch.float32 or (
            out is not None and out.dtype != torch.bfloat16):
        raise TypeError(f"native AdamW: FP32 state, an FP32 or bf16 gradient and a bf16 copy, not "
                        f"grad {g.dtype}, copy {None if out is None else out.dtype}")
    library().adamw_span(p.data_ptr(), g.data_ptr(), int(g.dtype == torch.bfloat16), m.data_ptr(), v.data_ptr(),
                         None if out is None else out.data_ptr(), n, c.data_ptr(), int(lerp_small),
                         torch.get_num_threads() if threads is None else int(threads), int(write_state))
