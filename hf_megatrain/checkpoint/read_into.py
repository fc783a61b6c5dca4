"""Safetensors read straight into the engine's tensors, at disk speed: one copy, CRC-32 while reading, a pipeline.

Reading through ``safe_open`` maps the file, materialises each tensor (or row chunk) in a new buffer and copies that
into the destination: every byte is copied twice after the kernel's copy out of the page cache. Here ``preadv``
reads each byte range into the destination's own memory (the store's pinned host buffers: a ``memoryview`` over
the tensor), ``fast_io.READERS`` reader threads each taking consecutive ranges of a file:

- same dtype, contiguous CPU destination: the kernel copies from the page cache into the tensor, nothing more;
- another dtype (a bf16 checkpoint into FP32 masters), a destination on the GPU or not contiguous: each chunk is
  read into one of the reader's bounce buffers and converted / copied once into the destination;
- ``crc=True``: every byte of the file is read (ranges no target wants go to a bounce buffer) and its CRC-32 is
  computed on the fly and combined across threads (``fast_io.crc32_combine``); the caller compares it with the
  manifest's. Without it, bytes no target wants are not read.

Each reader hands every chunk it read to its own lane thread, which computes the CRC-32 and does the conversion
while the reader's next ``preadv`` is already waiting on the disk: a reader that did both in turn would leave the
disk without its request for the CPU time of every chunk (measured: loads at 75-81 % of a cold parallel read).
``read_stats()`` collects the thread-seconds of each phase (read / crc / convert / copy / stall) for benchmarks.

A target may take part of a stored tensor (``Target.first``: the first element, for a data-parallel rank's shard of
a flat optimizer buffer). Shapes, dtypes and offsets are checked from the header before any byte is written.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import queue
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..core.progress import Progress
from . import fast_io
from .fast_io import crc32_combine

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


# Bounce buffers per reader (reads that need a conversion or a CRC of bytes no target wants). Two left readers
# waiting for their lane 8 % of a 5B-parameter bf16 load (bursts of conversions behind a slow chunk); three absorb
# them (integration/results/checkpoint_io/: ``stall_s``).
BOUNCE_BUFFERS = 3


class HeaderError(ValueError):
    """A safetensors header that cannot be parsed or does not fit its file."""


@dataclass
class ReadStats:
    """Where reads spent their time, summed over the ``read_into`` calls inside ``read_stats()``: ``wall_s`` (the
    calls' elapsed time) and thread-seconds per phase: ``read_s`` in ``preadv`` (the kernel's copy out of the page
    cache, or the wait for the disk), ``crc_s`` CRC-32, ``convert_s`` dtype conversion into the destination,
    ``copy_s`` same-dtype copies (a GPU or strided destination), ``stall_s`` readers waiting for their lane (a
    free bounce buffer, or the CRC of a range read straight into its destination: the CPU side behind the disk). With the disk the bottleneck, ``read_s`` is about
    ``readers * wall_s`` and ``stall_s`` small."""

    bytes: int = 0
    files: int = 0
    readers: int = 0
    wall_s: float = 0.0
    read_s: float = 0.0
    crc_s: float = 0.0
    convert_s: float = 0.0
    copy_s: float = 0.0
    stall_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def as_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in ("bytes", "files", "readers", "wall_s", "read_s", "crc_s", "convert_s",
                                               "copy_s", "stall_s")}
        out["GBps"] = self.bytes / 1e9 / self.wall_s if self.wall_s else 0.0
        return out


_collectors: contextvars.ContextVar[tuple[ReadStats, ...]] = contextvars.ContextVar("read_stats", default=())


@contextlib.contextmanager
def read_stats() -> Iterator[ReadStats]:
    """Collect the phase times of every ``read_into`` (verify, loads) this context calls, for benchmarks."""
    stats = ReadStats()
    token = _collectors.set(_collectors.get() + (stats,))
    try:
        yield stats
    finally:
        _collectors.reset(token)


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offsets of the tensor's bytes
    end: int


def read_header(path: str) -> dict[str, Entry]:
    """The tensors of safetensors file ``path`` (absolute offsets), checked against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise HeaderError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise HeaderError(f"{path}: corrupt safetensors header ({e})") from e
    out: dict[str, Entry] = {}
    for key, v in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = _DTYPES[v["dtype"]], tuple(int(d) for d in v["shape"])
            a, b = (8 + n + int(o) for o in v["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise HeaderError(f"{path}: corrupt header entry for {key} ({e!r})") from e
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if b - a != nbytes or not 8 + n <= a <= b <= size:
            raise HeaderError(f"{path}: {key} has offsets {v['data_offsets']} for {nbytes} bytes in a file of "
                              f"{size} bytes (truncated or corrupt)")
        out[key] = Entry(dtype, shape, a, b)
    return out


@dataclass
class Target:
    """Where stored tensor ``key`` goes: ``dst`` receives its flattened elements ``[first, first + dst.numel())``
    (all of it, same shape, when ``first`` is 0 and the sizes match)."""

    dst: torch.Tensor
    first: int = 0


@dataclass
class _Piece:
    off: int  # absolute file offset
    n: int  # bytes
    dst: torch.Tensor | None  # None: bytes only read for the CRC; else the destination of these bytes
    src_dtype: torch.dtype | None = None


def _pieces(path: str, entries: dict[str, Entry], targets: dict[str, Target], chunk: int) -> list[_Piece]:
    out = []
    for key, tg in targets.items():
        e = entries.get(key)
        if e is None:
            raise HeaderError(f"{path} lacks tensor {key}")
        isz = torch.empty((), dtype=e.dtype).element_size()
        total, n = torch.Size(e.shape).numel(), tg.dst.numel()
        if tg.first == 0 and n == total:
            if tuple(tg.dst.shape) != e.shape:
                raise HeaderError(f"{path}: tensor {key} has shape {e.shape}, the destination {tuple(tg.dst.shape)}")
        elif tg.dst.dim() != 1 or tg.first < 0 or tg.first + n > total:
            raise HeaderError(f"{path}: elements [{tg.first}, {tg.first + n}) of {key} ({total} elements) asked "
                              f"into a {tuple(tg.dst.shape)} tensor")
        if tg.dst.is_contiguous():
            flat = tg.dst.detach().view(-1)
            step = max(1, chunk // isz)
            for a in range(0, n, step):
                b = min(a + step, n)
                out.append(_Piece(e.start + (tg.first + a) * isz, (b - a) * isz, flat[a:b], e.dtype))
        elif tg.first:
            raise HeaderError(f"{path}: a part of {key} can only be read into a contiguous tensor")
        else:  # (rows of dim 0: each is read whole, then copied into the strided destination)
            row = max(1, n // max(1, tg.dst.shape[0]))
            step = max(1, chunk // (row * isz))
            for r in range(0, tg.dst.shape[0], step):
                rows = tg.dst.detach()[r:r + step]
                out.append(_Piece(e.start + r * row * isz, rows.numel() * isz, rows, e.dtype))
    return sorted(out, key=lambda p: p.off)


def _cover(pieces: list[_Piece], size: int, chunk: int) -> list[_Piece]:
    """``pieces`` plus pieces for every byte between them (and the header), so that the file is read whole."""
    out, at = [], 0
    for p in pieces + [_Piece(size, 0, None)]:
        if p.off < at:
            raise HeaderError("overlapping tensors: the file cannot be read whole once")
        for a in range(at, p.off, chunk):
            out.append(_Piece(a, min(chunk, p.off - a), None))
        if p.n:
            out.append(p)
        at = max(at, p.off + p.n)
    return out


class _Phases:
    """Thread-seconds per phase of one ``read_into`` call, added to from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t = dict.fromkeys(("read_s", "crc_s", "convert_s", "copy_s", "stall_s"), 0.0)

    def add(self, key: str, since: float) -> None:
        dt = time.perf_counter() - since
        with self.lock:
            self.t[key] += dt


def _digest(p: _Piece, buf: torch.Tensor, slot: torch.Tensor | None, acc: list[int], crc_on: bool,
            free: queue.SimpleQueue, phases: _Phases) -> None:
    """The CPU side of one piece, on its lane (after its read): CRC-32 chained onto the range's, then the one
    conversion / copy into a destination the bytes could not be read into directly; hands the bounce buffer back."""
    try:
        if crc_on:
            t = time.perf_counter()
            acc[0] = zlib.crc32(memoryview(buf.numpy()).cast("B"), acc[0])
            phases.add("crc_s", t)
        if slot is not None and p.dst is not None:
            t = time.perf_counter()
            p.dst.copy_(buf.view(p.src_dtype).view(p.dst.shape))
            phases.add("copy_s" if p.dst.dtype == p.src_dtype else "convert_s", t)
    finally:
        if slot is not None:
            free.put(slot)


def _read_range(path: str, pieces: list[_Piece], chunk: int, crc_on: bool, lane: ThreadPoolExecutor,
                free: queue.SimpleQueue, phases: _Phases, stop: threading.Event,
                progress: Progress | None) -> tuple[int, int]:
    """Read ``pieces`` (consecutive in the file when a CRC is wanted) and hand each to ``lane`` (one thread: the
    pieces are digested in file order), so that this thread's next read is in flight while the lane computes the
    CRC / conversion of the last one. Returns the range's CRC-32 (``crc_on``) and byte count."""
    acc, total, pending = [0], 0, []
    fd = os.open(path, os.O_RDONLY)
    try:
        if fast_io.READ_SEQUENTIAL and pieces and hasattr(os, "posix_fadvise"):
            first = min(p.off for p in pieces)
            os.posix_fadvise(fd, first, max(p.off + p.n for p in pieces) - first, os.POSIX_FADV_SEQUENTIAL)
        for p in pieces:
            if stop.is_set():
                break
            direct = (p.dst is not None and p.dst.device.type == "cpu" and p.dst.dtype == p.src_dtype
                      and p.dst.is_contiguous())
            slot = None
            if direct:
                buf = p.dst.view(torch.uint8) if p.dst.dim() else p.dst.reshape(1).view(torch.uint8)
            else:
                t = time.perf_counter()
                slot = free.get()  # (waits while the lane still digests both buffers: the CPU side is behind)
                phases.add("stall_s", t)
                if slot.numel() < p.n:
                    slot = torch.empty(max(chunk, p.n), dtype=torch.uint8)
                buf = slot[:p.n]
            view = memoryview(buf.numpy()).cast("B")
            t = time.perf_counter()
            done = 0
            try:
                while done < p.n:
                    got = os.preadv(fd, [view[done:]], p.off + done)
                    if got <= 0:
                        raise HeaderError(f"{path}: unexpected end of file at byte {p.off + done}")
                    done += got
            except BaseException:
                if slot is not None:
                    free.put(slot)
                raise
            phases.add("read_s", t)
            total += p.n
            if progress is not None:
                progress.add(p.n)
            if crc_on or slot is not None:
                pending.append(lane.submit(_digest, p, buf, slot, acc, crc_on, free, phases))
    finally:
        os.close(fd)
        t = time.perf_counter()
        for f in pending:  # (a buffer in flight must come back before the lane is reused; errors raised below)
            f.exception()
        phases.add("stall_s", t)
    for f in pending:
        f.result()
    return acc[0], total


def read_into(jobs: list[tuple[str, dict[str, Target] | None, bool]], workers: int | None = None,
              chunk: int | None = None, progress: Progress | None = None) -> list[str | None]:
    """For each ``(path, targets, crc)``: read the targets' bytes into their destinations, files and consecutive
    ranges of each file on ``workers`` reader threads (default ``fast_io.READERS``), each with a lane thread that
    computes the CRC-32 / conversion of its last read while it reads the next. Returns each file's CRC-32 (8 hex
    digits) where ``crc`` asked for it (every byte read), else None. ``targets`` None: a file of any format, read
    whole for its CRC only. Headers and shapes are all checked before any byte is read; phase times go to the
    ``read_stats()`` collectors active in the caller's context. ``progress``: the bytes to read are announced on it
    once planned, and counted as they are read."""
    workers = max(1, workers or fast_io.READERS)
    chunk = chunk or fast_io.READ_CHUNK
    t0 = time.perf_counter()
    plans = []
    for path, targets, crc in jobs:
        size = os.path.getsize(path)
        pieces = _pieces(path, read_header(path), targets, chunk) if targets is not None else []
        plans.append((path, _cover(pieces, size, chunk) if crc or targets is None else pieces, crc))
    total = sum(p.n for _, pieces, _ in plans for p in pieces)
    if progress is not None:
        progress.expect(total)
    share = max(chunk, -(-total // max(1, 4 * workers)))  # ~4 ranges a thread: balanced, still large reads
    ranges: list[tuple[int, list[_Piece]]] = []
    for i, (_, pieces, _) in enumerate(plans):
        group: list[_Piece] = []
        size = 0
        for p in pieces:
            group.append(p)
            size += p.n
            if size >= share:
                ranges.append((i, group))
                group, size = [], 0
        if group or not pieces:
            ranges.append((i, group))
    phases, stop, todo = _Phases(), threading.Event(), queue.SimpleQueue()
    for r in enumerate(ranges):
        todo.put(r)
    results: list[tuple[int, int]] = [(0, 0)] * len(ranges)

    def reader() -> None:
        free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(BOUNCE_BUFFERS):  # one being read into, the others being digested (allocated on first use)
            free.put(torch.empty(0, dtype=torch.uint8))
        try:
            with ThreadPoolExecutor(1) as lane:
                while not stop.is_set():
                    try:
                        k, (i, group) = todo.get_nowait()
                    except queue.Empty:
                        return
                    path, _, crc = plans[i]
                    results[k] = _read_range(path, group, chunk, crc, lane, free, phases, stop, progress)
        except BaseException:
            stop.set()  # (the other readers stop at their next piece)
            raise

    n = max(1, min(workers, len(ranges)))
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(reader) for _ in range(n)]
        for f in futures:
            f.result()
    crcs = [0] * len(plans)
    for (i, _), (c, nb) in zip(ranges, results):
        crcs[i] = crc32_combine(crcs[i], c, nb)
    for stats in _collectors.get():
        with stats.lock:
            stats.bytes += total
            stats.files += len(plans)
            stats.readers = max(stats.readers, n)
            stats.wall_s += time.perf_counter() - t0
            for key, v in phases.t.items():
                setattr(stats, key, getattr(stats, key) + v)
    return [f"{c & 0xFFFFFFFF:08x}" if crc else None for c, (_, _, crc) in zip(crcs, plans)]


def crc32_files(paths: list[str], workers: int | None = None, chunk: int | None = None,
                progress: Progress | None = None) -> list[str]:
    """CRC-32 (8 hex digits) of each file, reading every byte once: files and ranges of large files on
    ``READERS`` readers, each CRC computed on the reader's lane while its next read waits on the disk."""
    return [c or "" for c in read_into([(p, None, True) for p in paths], workers, chunk, progress)]
