"""Prefault: the pages of lazily zeroed host buffers faulted in on background threads, their contents untouched.

``alloc_host_zeros`` (core/memory.py) gives the AdamW moments as anonymous mappings whose pages the kernel
zero-fills where they are first written, so building costs nothing. Left at that, the first writer pays: the first
host AdamW pass, right where the next forward waits for it. Measured on the H100 host (14B width x 8 layers, packed
fine-tune, 32k tokens): the second step took 2.45 / 2.14 s against a steady 1.27 s, its forward waiting 2.3 / 1.1 s
for updates that take 0.4-0.7 s once the pages exist (integration/PERF.md, lever 66).

``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) faults a range in writable "as if written" without writing it, so it
is safe beside threads that write the same buffer meanwhile (a resume's reads, an early update): whichever comes
first faults a page, and no value changes. A few daemon threads work through the buffers' pieces in the order given
(the store's: the forward's, where the first updates start), while the model loads and the first step runs.
Under ``MIN_BYTES`` in all, and on kernels without it (or another OS), nothing happens: the first writer pays, as
before. A thread holds a buffer only while populating one piece of it (weak references otherwise), so dropping an
engine frees its memory.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import weakref
from typing import Sequence

import torch

from .memory import ZEROS_MAPPING_MIN

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
PIECE = 256 << 20  # bytes per madvise call: an engine dropped meanwhile is let go within one piece
# Below this many bytes in all the first writer's faults cost milliseconds: not worth threads.
MIN_BYTES = 256 << 20
PAGE = 4096  # (whole pages inside a buffer only)

_libc = None
_supported: bool | None = None
_lock = threading.Lock()


def _madvise():  # -> the libc function, or None off Linux
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def supported() -> bool:
    """Whether this kernel populates ranges (checked once, on a small buffer of our own)."""
    global _supported
    with _lock:
        if _supported is None:
            madvise = _madvise()
            probe = torch.zeros(ZEROS_MAPPING_MIN // 4) if madvise is not None else None
            _supported = probe is not None and madvise(_pages(probe).start, PAGE, MADV_POPULATE_WRITE) == 0
        return _supported


def _pages(t: torch.Tensor) -> range:
    start = (t.data_ptr() + PAGE - 1) // PAGE * PAGE
    return range(start, (t.data_ptr() + t.numel() * t.element_size()) // PAGE * PAGE, PIECE)


def _populate_piece(lo: int, end: int) -> bool:
    madvise = _madvise()
    if madvise(lo, min(PIECE, end - lo), MADV_POPULATE_WRITE) != 0:
        logger.debug("hf_megatrain: prefault stopped (errno %d)", ctypes.get_errno())
        return False
    return True


def prefault_in_background(buffers: Sequence[torch.Tensor], threads: int = 1,
                           min_bytes: int = MIN_BYTES) -> list[threading.Thread]:
    """Start ``threads`` daemon threads that populate the mapped ``buffers`` (those ``alloc_host_zeros`` mapped)
    piece by piece, in order; the threads (to join in tests), none when there is nothing to do (under ``min_bytes``
    in all) or the kernel cannot."""
    big = [t for t in buffers if t.device.type == "cpu" and t.numel() * t.element_size() >= ZEROS_MAPPING_MIN]
    if sum(t.numel() * t.element_size() for t in big) < max(min_bytes, 1) or not supported():
        return []
    mapped = [weakref.ref(t) for t in big]
    del big
    pieces = iter([(ref, lo, r.stop) for ref in mapped for r in [_pages(ref())] for lo in r])
    take = threading.Lock()

    def run() -> None:
        while True:
            with take:
                ref, lo, end = next(pieces, (None, 0, 0))
            if ref is None:
                return
            t = ref()  # (held only for one piece: a dropped engine's memory is let go)
            if t is None:
                continue
            ok = _populate_piece(lo, end)
            del t
            if not ok:
                return

    out = [threading.Thread(target=run, name=f"megatrain-prefault-{k}", daemon=True) for k in range(max(1, threads))]
    for th in out:
        th.start()
    return out
