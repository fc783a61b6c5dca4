"""Safetensors read straight into the engine's tensors, at disk speed: one copy, CRC-32 while reading.

Reading through ``safe_open`` maps the file, materialises each tensor (or row chunk) in a new buffer and copies that
into the destination: every byte is copied twice after the kernel's copy out of the page cache. Here ``preadv``
reads each byte range into the destination's own memory (the store's pinned host buffers: a ``memoryview`` over
the tensor), a few threads each taking consecutive ranges of a file, as the writer does (``safetensors_io``):

- same dtype, contiguous CPU destination: the kernel copies from the page cache into the tensor, nothing more;
- another dtype (a bf16 checkpoint into FP32 masters), a destination on the GPU or not contiguous: each chunk is
  read into the thread's reused bounce buffer and converted / copied once into the destination;
- ``crc=True``: every byte of the file is read (ranges no target wants go to the bounce buffer) and its CRC-32 is
  computed on the fly and combined across threads (``fast_io.crc32_combine``); the caller compares it with the
  manifest's. Without it, bytes no target wants are not read.

A target may take part of a stored tensor (``Target.first``: the first element, for a data-parallel rank's shard of
a flat optimizer buffer). Shapes, dtypes and offsets are checked from the header before any byte is written.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .fast_io import CHUNK_BYTES, DEFAULT_WORKERS, crc32_combine

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class HeaderError(ValueError):
    """A safetensors header that cannot be parsed or does not fit its file."""


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


def _read(fd: int, path: str, pieces: list[_Piece], chunk: int, crc_on: bool) -> tuple[int, int]:
    """Read ``pieces`` (consecutive in the file when a CRC is wanted); returns their CRC-32 (``crc_on``) and byte
    count."""
    bounce: torch.Tensor | None = None
    crc, total = 0, 0
    for p in pieces:
        direct = (p.dst is not None and p.dst.device.type == "cpu" and p.dst.dtype == p.src_dtype
                  and p.dst.is_contiguous())
        if direct:
            buf = p.dst.view(torch.uint8) if p.dst.dim() else p.dst.reshape(1).view(torch.uint8)
        else:
            if bounce is None:
                bounce = torch.empty(max(chunk, p.n), dtype=torch.uint8)
            elif bounce.numel() < p.n:
                bounce = torch.empty(p.n, dtype=torch.uint8)
            buf = bounce[:p.n]
        view = memoryview(buf.numpy()).cast("B")
        done = 0
        while done < p.n:
            got = os.preadv(fd, [view[done:]], p.off + done)
            if got <= 0:
                raise HeaderError(f"{path}: unexpected end of file at byte {p.off + done}")
            done += got
        if crc_on:
            crc = zlib.crc32(view, crc)
        total += p.n
        if not direct and p.dst is not None:
            p.dst.copy_(buf.view(p.src_dtype).view(p.dst.shape))  # the one conversion (or device copy)
    return crc, total


def read_into(jobs: list[tuple[str, dict[str, Target], bool]], workers: int = DEFAULT_WORKERS,
              chunk: int = CHUNK_BYTES) -> list[str | None]:
    """For each ``(path, targets, crc)``: read the targets' bytes into their destinations, files and consecutive
    ranges of each file on ``workers`` threads. Returns each file's CRC-32 (8 hex digits) where ``crc`` asked for
    it (every byte read), else None. Headers and shapes are all checked before any byte is read."""
    plans = []
    for path, targets, crc in jobs:
        entries = read_header(path)
        pieces = _pieces(path, entries, targets, chunk)
        plans.append((path, _cover(pieces, os.path.getsize(path), chunk) if crc else pieces, crc))
    total = sum(p.n for _, pieces, _ in plans for p in pieces)
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

    def run(r: tuple[int, list[_Piece]]) -> tuple[int, int]:
        path = plans[r[0]][0]
        fd = os.open(path, os.O_RDONLY)
        try:
            return _read(fd, path, r[1], chunk, plans[r[0]][2])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max(1, min(workers, len(ranges)))) as pool:
        results = list(pool.map(run, ranges))
    crcs = [0] * len(plans)
    for (i, _), (c, n) in zip(ranges, results):
        crcs[i] = crc32_combine(crcs[i], c, n)
    return [f"{c & 0xFFFFFFFF:08x}" if crc else None for c, (_, _, crc) in zip(crcs, plans)]
