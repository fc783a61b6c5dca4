"""Checkpoint bytes at disk speed: CRC-32 computed while writing, files written and read by a few threads.

- ``crc32_combine``: zlib's CRC-32 of ``a + b`` from the CRCs of ``a`` and ``b`` (Python's zlib does not expose
  it), so that ranges of one file written or read by different threads give the file's CRC without a second pass.
- ``record_crc32`` / ``recorded_crc32``: the CRC a writer computed over the bytes it wrote, keyed by the file's
  inode (renames and hard links keep it) and checked against its size and mtime, so that ``write_manifest`` reads
  back only the files nobody recorded (the small JSON / torch files other code writes).
- ``crc32_files``: CRC-32 of whole files, one pass, large files split into ranges read in parallel with
  ``preadv`` into reused buffers (``zlib.crc32`` and the reads release the GIL).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

DEFAULT_WORKERS = 4  # writer / reader threads: enough to keep CRC-32 (~2 GB/s a core) ahead of one disk
CHUNK_BYTES = 64 << 20


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


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len2 = len(b)``
    (zlib's ``crc32_combine``: ``crc1`` advanced over ``len2`` zero bytes by GF(2) matrix squaring)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
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


# -- reading ---------------------------------------------------------------------------------------------------------
def _crc_range(path: str, start: int, end: int, chunk: int = CHUNK_BYTES) -> int:
    crc = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(max(1, min(chunk, end - start)))
        view = memoryview(buf)
        off = start
        while off < end:
            n = os.preadv(fd, [view[:min(len(buf), end - off)]], off)
            if n <= 0:
                raise OSError(f"{path}: unexpected end of file at byte {off} (expected {end})")
            crc = zlib.crc32(view[:n], crc)
            off += n
    finally:
        os.close(fd)
    return crc


def crc32_files(paths: list[str], workers: int = DEFAULT_WORKERS, chunk: int = CHUNK_BYTES) -> list[str]:
    """CRC-32 (8 hex digits) of each file, reading every byte once: files and ranges of large files in parallel."""
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    piece = max(chunk, -(-total // max(1, 4 * workers)))  # ~4 ranges a worker: balanced, still large reads
    ranges = [(i, a, min(a + piece, s)) for i, s in enumerate(sizes) for a in range(0, max(s, 1), piece)]
    with ThreadPoolExecutor(max(1, min(workers, len(ranges)))) as pool:
        crcs = list(pool.map(lambda r: _crc_range(paths[r[0]], r[1], r[2], chunk) if r[2] > r[1] else 0, ranges))
    out = [0] * len(paths)
    for (i, a, b), c in zip(ranges, crcs):
        out[i] = crc32_combine(out[i], c, b - a)
    return [f"{c:08x}" for c in out]
