"""Safetensors files written and read one tensor at a time.

``safetensors.torch.save_file`` takes a dict of finished tensors, so exporting a model in bf16 would first need a
bf16 copy of all of it. This writer emits the header from shapes alone, then streams each tensor, casting in
bounded chunks. The reader side copies a tensor from a memory-mapped file into an existing buffer in row chunks,
so loading never holds more than one chunk beyond the destination.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import json
import math
import os
import re
import struct
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ..core.progress import Progress
from .fast_io import DEFAULT_WORKERS, crc32_combine, record_crc32
from .names import WEIGHTS_PREFIX, CheckpointError
from .staged import check_free_space, disk_full, staged_export, write_json

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5 save_pretrained default
CHUNK_BYTES = 64 << 20  # casts/copies happen in pieces of this size, never a whole large tensor at once
# Each written chunk's pages are handed to writeback at once (POSIX_FADV_DONTNEED starts it without waiting), so
# the disk streams during the save instead of idling until the dirty limit or the final fsync, and a checkpoint
# larger than the free RAM does not push the model's pages out. Module constant for A/B measurements.
_ADVISE = hasattr(os, "posix_fadvise")

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def parse_size(size: int | str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20 (the units ``save_pretrained(max_shard_size=...)`` accepts)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: use an int (bytes) or a string like '5GB' / '500MiB'")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base ** power)


# -- writing ---------------------------------------------------------------------------------------------------------
def _out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * torch.empty((), dtype=_out_dtype(t, dtype)).element_size()


def data_bytes(items: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> int:
    """Bytes of the tensors of ``items`` written as ``dtype`` (floating ones; the others as they are): what the
    writers below write besides headers and indexes, and count on a ``Progress``."""
    return sum(_nbytes(t, dtype) for _, t in items)


def _pieces(items: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
            start: int) -> list[tuple[int, torch.Tensor, int, int, torch.dtype]]:
    """(file offset, flat tensor, first element, end element, output dtype) of every chunk of the data section."""
    out = []
    off = start
    for _, t in items:
        dt = _out_dtype(t, dtype)
        flat = t.detach().reshape(-1)  # (a view of a contiguous tensor: no copy)
        osz = torch.empty((), dtype=dt).element_size()
        step = max(1, CHUNK_BYTES // max(flat.element_size(), osz, 1))
        for a in range(0, flat.numel(), step):
            b = min(a + step, flat.numel())
            out.append((off, flat, a, b, dt))
            off += (b - a) * osz
    return out


def _write_pieces(fd: int, pieces: list, stop: threading.Event, progress: Progress | None) -> tuple[int, int]:
    """pwrite ``pieces`` (consecutive in the file) from the tensors' own memory (a cast or a device copy only
    where needed, one chunk at a time); returns the CRC-32 and byte count of the bytes written."""
    crc, total = 0, 0
    for off, flat, a, b, dt in pieces:
        if stop.is_set():
            break
        piece = flat[a:b]
        if piece.device.type != "cpu" or piece.dtype != dt:
            piece = piece.to("cpu", dt)
        view = memoryview(piece.contiguous().view(torch.uint8).numpy())
        crc = zlib.crc32(view, crc)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], off + done)
        if _ADVISE:  # start the chunk's writeback now (the disk works while we copy the next), keep it uncached
            os.posix_fadvise(fd, off, len(view), os.POSIX_FADV_DONTNEED)
        total += len(view)
        if progress is not None:
            progress.add(len(view))
    return crc, total


def write_safetensors(path: str, items: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None, *, workers: int = DEFAULT_WORKERS,
                      progress: Progress | None = None) -> str:
    """Write ``items`` as one safetensors file, casting floating tensors to ``dtype`` chunk by chunk; fsynced.
    ``workers`` threads write consecutive ranges of the data section (``pwrite``), each computing the CRC-32 of
    the bytes it writes; the file's CRC-32 (returned, 8 hex digits) is combined from theirs and recorded for
    ``write_manifest`` (``fast_io``): the file is never read back. A full disk raises ENOSPC naming the folder and
    the bytes the file needs; the partial file is removed. ``progress`` counts the tensors' bytes as they are
    written (the caller announced them: ``data_bytes``)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for name, t in items:
        n = _nbytes(t, dtype)
        header[name] = {"dtype": _ST_DTYPES[_out_dtype(t, dtype)], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    pieces = _pieces(items, dtype, len(head))
    workers = max(1, min(workers, len(pieces)))
    bounds = [round(i * off / workers) for i in range(workers + 1)]  # ~equal byte ranges, split at chunk starts
    groups: list[list] = [[] for _ in range(workers)]
    for p in pieces:
        groups[min(workers - 1, bisect.bisect_right(bounds, p[0] - len(head)) - 1)].append(p)
    groups = [g for g in groups if g]
    try:
        with open(path, "wb") as f:
            fd = f.fileno()
            os.pwrite(fd, head, 0)
            crc = zlib.crc32(head)
            stop = threading.Event()
            if len(groups) <= 1:
                parts = [_write_pieces(fd, g, stop, progress) for g in groups]
            else:
                with ThreadPoolExecutor(len(groups)) as pool:
                    futures = [pool.submit(_write_pieces, fd, g, stop, progress) for g in groups]
                    try:
                        parts = [fut.result() for fut in futures]
                    finally:
                        stop.set()  # (an error: the other writers stop at their next chunk)
            for c, n in parts:
                crc = crc32_combine(crc, c, n)
            os.fsync(fd)
            record_crc32(fd, crc)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            with contextlib.suppress(OSError):
                os.remove(path)  # (a partial file would keep the disk full)
        raise disk_full(e, os.path.dirname(os.path.abspath(path)), 8 + len(raw) + off) from e
    return f"{crc & 0xFFFFFFFF:08x}"


def _shard_files(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_weights(save_dir: str, items: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, prefix: str = WEIGHTS_PREFIX,
                  workers: int = DEFAULT_WORKERS, progress: Progress | None = None) -> list[str]:
    """Write ``items`` in HF's sharded safetensors layout straight into ``save_dir`` (a new folder: a staging or a
    checkpoint's temp folder); returns the file names written, the index last.

    Shards are filled greedily in order (a tensor larger than the limit gets its own shard), like
    ``huggingface_hub.split_torch_state_dict_into_shards``. Shards are written ``workers`` at a time (one file a
    thread; with fewer shards than workers, each file's ranges in parallel: ``write_safetensors``). ``progress``
    counts the bytes written (the caller announced them: ``data_bytes``)."""
    limit = parse_size(max_shard_size)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        n = _nbytes(t, dtype)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    total = data_bytes(items, dtype)
    check_free_space(save_dir, total)
    names = _shard_files(prefix, len(shards))
    files = max(1, min(workers, len(shards)))  # one file a worker; a file's ranges share what is left
    try:
        if files == 1:
            for fname, shard in zip(names, shards):
                write_safetensors(os.path.join(save_dir, fname), shard, dtype, workers=workers, progress=progress)
        else:
            with ThreadPoolExecutor(files) as pool:
                list(pool.map(lambda fs: write_safetensors(os.path.join(save_dir, fs[0]), fs[1], dtype,
                                                           workers=max(1, workers // files), progress=progress),
                              zip(names, shards)))
    except OSError as e:  # (the caller removes the folder it gave: no partial file keeps the disk full)
        raise disk_full(e, save_dir, total) from e
    if len(shards) > 1:
        index_name = f"{prefix}.safetensors.index.json"
        write_json(os.path.join(save_dir, index_name),
                   {"metadata": {"total_size": total},
                    "weight_map": {name: fname for fname, shard in zip(names, shards) for name, _ in shard}})
        names.append(index_name)
    return names


def save_weights(save_dir: str, items: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, prefix: str = WEIGHTS_PREFIX) -> list[str]:
    """``write_weights`` into a folder that may hold an earlier save (and other files): written into a staging
    folder, then committed so that a kill at any instant leaves the old or the new weights loadable, never a mix
    (``staged.py``). Returns the file names written."""
    os.makedirs(save_dir, exist_ok=True)
    with staged_export(save_dir) as stage:
        return write_weights(stage, items, dtype=dtype, max_shard_size=max_shard_size, prefix=prefix)


# -- reading ---------------------------------------------------------------------------------------------------------
def read_json_key(path: str, key: str) -> Any:
    """``json.load(path)[key]``, or a ``CheckpointError`` naming the corrupt file."""
    try:
        with open(path) as f:
            return json.load(f)[key]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); re-save the checkpoint or pick another one") from e


def weight_files(path: str, prefix: str = WEIGHTS_PREFIX) -> dict[str, list[str]] | None:
    """{shard file: [tensor names]} for the ``prefix`` weights in ``path`` (None when there are none).

    ``<prefix>.safetensors`` wins over an index when both exist, as in ``transformers.from_pretrained`` (exports
    switch between the layouts relying on that order: ``staged.py``)."""
    single = os.path.join(path, f"{prefix}.safetensors")
    if os.path.isfile(single):
        with open_safetensors(single) as f:
            return {f"{prefix}.safetensors": list(f.keys())}
    index = os.path.join(path, f"{prefix}.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_key(index, "weight_map")
        out: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            out.setdefault(fname, []).append(name)
        return out
    return None


@contextlib.contextmanager
def open_safetensors(path: str) -> Iterator[Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"missing file {path}")
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated / garbled headers
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from e
    with handle as f:
        yield f


def stored_nbytes(f: Any, key: str) -> int:
    """Bytes of tensor ``key`` in open file ``f``, from its header (dtype names carry their bits: F32, BF16,
    F8_E4M3, ...; BOOL is a byte). For progress bars: never raises on a dtype this package does not write."""
    sl = f.get_slice(key)
    bits = re.search(r"\d+", sl.get_dtype())
    return math.prod(sl.get_shape()) * (int(bits.group()) if bits else 8) // 8


def copy_tensor_into(dst: torch.Tensor, f: Any, key: str, path: str) -> None:
    """Copy tensor ``key`` of open file ``f`` into ``dst`` in row chunks (bounded transient memory)."""
    sl = f.get_slice(key)
    shape = tuple(sl.get_shape())
    if shape != tuple(dst.shape):
        raise CheckpointError(f"{path}: tensor {key} has shape {shape}, the model expects {tuple(dst.shape)}")
    if dst.dim() == 0:
        dst.copy_(f.get_tensor(key))
        return
    row = max(1, math.prod(shape[1:]) * 4)
    step = max(1, CHUNK_BYTES // row)
    for a in range(0, shape[0], step):
        dst[a:a + step].copy_(sl[a:a + step])


class LazyTensors(Mapping):
    """Read-on-access view of an open safetensors file (one tensor in memory at a time)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._keys = list(f.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
