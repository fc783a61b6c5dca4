"""Checkpoint bytes at disk speed: CRC-32 computed while writing, files written and read by a few threads.

- ``crc32_combine``: zlib's CRC-32 of ``a + b`` from the CRCs of ``a`` and ``b`` (Python's zlib does not expose
  it), so that ranges of one file written or read by different threads give the file's CRC without a second pass.
- ``record_crc32`` / ``recorded_crc32``: the CRC a writer computed over the bytes it wrote, keyed by the file's
  inode (renames and hard links keep it) and checked against its size and mtime, so that ``write_manifest`` reads
  back only the files nobody recorded (the small JSON / torch files other code writes).
- the readers' settings (``READERS``, ``READ_CHUNK``, ``READ_SEQUENTIAL``), read by ``read_into`` at every call, so
  that benchmarks can A/B them here.

The ground floor of the byte path: the writers (``safetensors_io``) and the readers (``read_into``, which also gives
the CRC-32 of whole files: ``crc32_files``) build on it; it imports neither.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

DEFAULT_WORKERS = 4  # writer threads: with the CRC-32 computed on the written bytes, at the disk's rate (measured)
CHUNK_BYTES = 64 << 20
# Reader threads of every load and verify (each with a lane thread computing CRC-32 / conversions: 2 threads a
# reader). Enough requests in flight for an NVMe disk's parallelism, bounded by the cores. Module constants, so that
# benchmarks can A/B them (integration/bench_checkpoint_io.py --readers / --read-chunk).
READERS = max(4, min(8, (os.cpu_count() or 4) // 2))
READ_CHUNK = 16 << 20  # bytes a preadv: large for the disk, small enough that the lanes keep pace chunk by chunk
# POSIX_FADV_SEQUENTIAL on each reader's range: the kernel's readahead window doubles, so the disk already has the
# range's next bytes requested while the reader's lane digests the last chunk (A/B: bench_checkpoint_io.py).
READ_SEQUENTIAL = True


# -- CRC-32 of a concatenation ---------------------------------------------------------------------------------------
def _gf2_times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_zero_ops: list[list[int]] = []  # [k]: the operator advancing a CRC over 2**k zero bytes
_zero_ops_lock = threading.Lock()


def _zero_op(k: int) -> list[int]:
    with _zero_ops_lock:
        if not _zero_ops:
            op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
            for _ in range(3):  # -> two, four, eight zero bits: one zero byte
                op = _gf2_square(op)
            _zero_ops.append(op)
        while len(_zero_ops) <= k:
            _zero_ops.append(_gf2_square(_zero_ops[-1]))
        return _zero_ops[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len2 = len(b)``
    (zlib's ``crc32_combine``: ``crc1`` advanced over ``len2`` zero bytes, the operators for 2**k zero bytes
    squared once per process and kept: a combine costs a few hundred integer operations, so that readers can
    combine per-range CRCs without holding the GIL for milliseconds)."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zero_op(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


# -- CRCs recorded by the writers ------------------------------------------------------------------------------------
_recorded: OrderedDict[tuple[int, int], tuple[int, int, str]] = OrderedDict()
_recorded_lock = threading.Lock()
_RECORDED_MAX = 4096


def record_crc32(fd: int, crc: int) -> None:
    """Remember ``crc`` as the CRC-32 of the (fsynced, complete) file open as ``fd``."""
    st = os.fstat(fd)
    with _recorded_lock:
        _recorded[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns, f"{crc & 0xFFFFFFFF:08x}")
        _recorded.move_to_end((st.st_dev, st.st_ino))
        while len(_recorded) > _RECORDED_MAX:
            _recorded.popitem(last=False)


def recorded_crc32(path: str) -> str | None:
    """The CRC-32 a writer of this process recorded for ``path`` (its inode), or None when none was, or the file
    changed since (another size or mtime)."""
    st = os.stat(path)
    with _recorded_lock:
        rec = _recorded.get((st.st_dev, st.st_ino))
    if rec is None or rec[:2] != (st.st_size, st.st_mtime_ns):
        return None
    return rec[2]
