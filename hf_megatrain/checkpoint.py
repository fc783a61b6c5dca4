"""Checkpoints without a second copy of the model.

A model larger than GPU memory is usually larger than what host RAM can hold twice, so nothing here builds a
``state_dict``: weights go to disk tensor by tensor (cast in bounded chunks) straight from the host store's FP32
master, in the standard layout plain ``transformers.from_pretrained`` reads (``model.safetensors`` or
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``). Loading walks the shards with
``safe_open`` (memory-mapped) and copies each tensor, in row chunks, into its master slice.

A Trainer checkpoint folder additionally holds the engine's training state (FP32 master when the export dtype is
not FP32, the flat AdamW moments as safetensors, the optimizer hyper-state as JSON) and a manifest of every file
with its size. Folders are committed atomically: written into ``<name>.tmp-XXXX`` next to the target, fsynced,
then renamed, so a crash mid-save never leaves a partial ``checkpoint-N``. ``verify_checkpoint`` checks a folder
against its manifest before anything is loaded, so a corrupt folder raises before any state is overwritten.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

WEIGHTS_PREFIX = "model"  # HF: model.safetensors / model-0000x-of-0000y.safetensors
MASTER_PREFIX = "megatrain_master"  # FP32 master, written only when the exported weights are not FP32
OPTIMIZER_TENSORS = "megatrain_optimizer.safetensors"
OPTIMIZER_HYPER = "megatrain_optimizer.json"
MANIFEST = "megatrain_manifest.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5 save_pretrained default
_CHUNK_BYTES = 64 << 20  # casts/copies happen in pieces of this size, never a whole large tensor at once

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file, has a truncated/corrupt file, or does not match the model."""


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


def write_safetensors(path: str, items: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``items`` as one safetensors file, casting floating tensors to ``dtype`` chunk by chunk; fsynced."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for name, t in items:
        n = _nbytes(t, dtype)
        header[name] = {"dtype": _ST_DTYPES[_out_dtype(t, dtype)], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            dt = _out_dtype(t, dtype)
            flat = t.detach().reshape(-1)
            step = max(1, _CHUNK_BYTES // max(flat.element_size(), 1))
            for a in range(0, flat.numel(), step):
                piece = flat[a:a + step].to("cpu", dt).contiguous()
                f.write(memoryview(piece.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _shard_files(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def save_weights(save_dir: str, items: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, prefix: str = WEIGHTS_PREFIX) -> list[str]:
    """Write ``items`` in HF's sharded safetensors layout; returns the file names written.

    Shards are filled greedily in order (a tensor larger than the limit gets its own shard), like
    ``huggingface_hub.split_torch_state_dict_into_shards``. Stale shards of an earlier save with this prefix
    are removed so the folder never mixes two layouts.
    """
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
    names = _shard_files(prefix, len(shards))
    index_name = f"{prefix}.safetensors.index.json"
    stale = re.compile(rf"{re.escape(prefix)}(-\d{{5}}-of-\d{{5}})?\.safetensors(\.index\.json)?")
    for f in os.listdir(save_dir):
        if stale.fullmatch(f) and f not in names and f != index_name:
            os.remove(os.path.join(save_dir, f))
    for fname, shard in zip(names, shards):
        write_safetensors(os.path.join(save_dir, fname), shard, dtype)
    written = list(names)
    index_path = os.path.join(save_dir, index_name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t, dtype) for _, t in items)},
                 "weight_map": {name: fname for fname, shard in zip(names, shards) for name, _ in shard}}
        _write_json(index_path, index)
        written.append(index_name)
    elif os.path.exists(index_path):
        os.remove(index_path)
    return written


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def save_pretrained_streamed(engine: Any, save_dir: str, *, dtype: torch.dtype = torch.float32,
                             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                             extra: Iterable[tuple[str, torch.Tensor]] = ()) -> list[str]:
    """Standard HF checkpoint of ``engine.model``: weights from the FP32 master (cast to ``dtype``), ``extra``
    tensors (frozen parameters, persistent buffers), ``config.json`` recording ``dtype`` and, when the model can
    generate, ``generation_config.json``. Tied weights appear once (the store keeps the first name), as HF saves."""
    os.makedirs(save_dir, exist_ok=True)
    if getattr(engine, "optimizer", None) is not None:
        engine.optimizer.wait()  # an overlapped step may still be writing masters
    items = list(engine.named_master_tensors()) + list(extra)
    files = save_weights(save_dir, items, dtype=dtype, max_shard_size=max_shard_size)
    model = engine.model
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg = copy.deepcopy(cfg)
        cfg.dtype = str(dtype).replace("torch.", "")  # what from_pretrained(dtype="auto") picks
        cfg.architectures = [type(model).__name__]
        cfg.save_pretrained(save_dir)
        files.append("config.json")
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if gen is not None and can_generate():
        gen.save_pretrained(save_dir)
        files.append("generation_config.json")
    return files


def save_training_state(engine: Any, save_dir: str, *, master: bool) -> list[str]:
    """AdamW moments + step counts (safetensors), hyper-state (JSON) and, if ``master``, the FP32 master."""
    files: list[str] = []
    if master:
        files += save_weights(save_dir, list(engine.named_master_tensors()), dtype=torch.float32,
                              max_shard_size=DEFAULT_MAX_SHARD_SIZE, prefix=MASTER_PREFIX)
    opt = engine.optimizer
    if opt is not None:
        tensors = opt.state_tensors()  # waits for an overlapped step
        write_safetensors(os.path.join(save_dir, OPTIMIZER_TENSORS), list(tensors.items()))
        _write_json(os.path.join(save_dir, OPTIMIZER_HYPER), opt.hyper_state())
        files += [OPTIMIZER_TENSORS, OPTIMIZER_HYPER]
    return files


def write_manifest(save_dir: str) -> None:
    """Record every file in ``save_dir`` with its size; ``verify_checkpoint`` checks against it."""
    files = {f: os.path.getsize(os.path.join(save_dir, f)) for f in sorted(os.listdir(save_dir))
             if os.path.isfile(os.path.join(save_dir, f)) and f != MANIFEST}
    _write_json(os.path.join(save_dir, MANIFEST), {"format": 1, "files": files})


# -- atomic folders ----------------------------------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(final: str) -> Iterator[str]:
    """Yield a temp folder next to ``final``; on success fsync it and rename it to ``final`` (replacing an
    existing folder of that name only after the new one is complete). On error the temp folder is removed."""
    parent = os.path.dirname(os.path.abspath(final)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp-", dir=parent)
    try:
        yield tmp
        for f in os.listdir(tmp):  # files we wrote ourselves are fsynced already; others (tokenizer, json) now
            p = os.path.join(tmp, f)
            if os.path.isfile(p):
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
        _fsync_dir(tmp)
        old = None
        if os.path.exists(final):
            old = tempfile.mkdtemp(prefix=os.path.basename(final) + ".old-", dir=parent)
            os.rename(final, os.path.join(old, "x"))
        os.rename(tmp, final)
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temp_dirs(parent: str, prefix: str = "checkpoint-") -> None:
    """Delete ``<prefix>*.tmp-*`` / ``.old-*`` folders a killed save left behind."""
    if not os.path.isdir(parent):
        return
    for f in os.listdir(parent):
        if f.startswith(prefix) and (".tmp-" in f or ".old-" in f) and os.path.isdir(os.path.join(parent, f)):
            shutil.rmtree(os.path.join(parent, f), ignore_errors=True)


# -- reading -------------------------------------------------------------------------------------------------------------
def weight_files(path: str, prefix: str = WEIGHTS_PREFIX) -> dict[str, list[str]] | None:
    """{shard file: [tensor names]} for the ``prefix`` weights in ``path`` (None when there are none)."""
    index = os.path.join(path, f"{prefix}.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt ({e}); re-save the checkpoint or pick another one") from e
        out: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            out.setdefault(fname, []).append(name)
        return out
    single = os.path.join(path, f"{prefix}.safetensors")
    if os.path.isfile(single):
        with _open(single) as f:
            return {f"{prefix}.safetensors": list(f.keys())}
    return None


@contextlib.contextmanager
def _open(path: str) -> Iterator[Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"missing file {path}")
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated / garbled headers
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from e
    with handle as f:
        yield f


def verify_checkpoint(path: str, *, training_state: bool = True) -> None:
    """Raise ``CheckpointError`` naming the first missing or corrupt file of checkpoint folder ``path``.

    With a manifest (folders written by hf_megatrain) every listed file must exist with its recorded size and every
    safetensors header must parse; ``training_state`` also requires the optimizer and trainer state when they were
    saved. Without a manifest (a plain HF folder) only the weights are checked."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest_path):
        try:
            with open(manifest_path) as f:
                files = json.load(f)["files"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"corrupt manifest {manifest_path}: {e}") from e
        for fname, size in files.items():
            p = os.path.join(path, fname)
            if not os.path.isfile(p):
                raise CheckpointError(f"checkpoint {path} is incomplete: missing {fname}")
            if os.path.getsize(p) != size:
                raise CheckpointError(f"checkpoint {path} is corrupt: {fname} has {os.path.getsize(p)} bytes, "
                                      f"{size} were written")
        if training_state and "trainer_state.json" not in files:
            raise CheckpointError(f"checkpoint {path} has no trainer_state.json; it cannot be resumed from")
    shards = weight_files(path)
    if shards is None:
        raise CheckpointError(f"checkpoint {path} has no weights ({WEIGHTS_PREFIX}.safetensors or "
                              f"{WEIGHTS_PREFIX}.safetensors.index.json)")
    for prefix in (WEIGHTS_PREFIX, MASTER_PREFIX):
        for fname, names in (weight_files(path, prefix) or {}).items():
            with _open(os.path.join(path, fname)) as f:
                missing = set(names) - set(f.keys())
            if missing:
                raise CheckpointError(f"{os.path.join(path, fname)} lacks tensors its index lists: "
                                      f"{sorted(missing)[:5]}")
    opt = os.path.join(path, OPTIMIZER_TENSORS)
    if os.path.isfile(opt):
        with _open(opt):
            pass


def _copy_into(dst: torch.Tensor, f: Any, key: str, path: str) -> None:
    """Copy tensor ``key`` of open file ``f`` into ``dst`` in row chunks (bounded transient memory)."""
    sl = f.get_slice(key)
    shape = tuple(sl.get_shape())
    if shape != tuple(dst.shape):
        raise CheckpointError(f"{path}: tensor {key} has shape {shape}, the model expects {tuple(dst.shape)}")
    if dst.dim() == 0:
        dst.copy_(f.get_tensor(key))
        return
    row = max(1, math.prod(shape[1:]) * 4)
    step = max(1, _CHUNK_BYTES // row)
    for a in range(0, shape[0], step):
        dst[a:a + step].copy_(sl[a:a + step])


def load_pretrained_into_engine(engine: Any, path: str, *, prefix: str | None = None, strict: bool = True,
                                extra_sink: Callable[[str, torch.Tensor], bool] | None = None) -> list[str]:
    """Fill the engine's FP32 masters from the safetensors weights in ``path``, one shard at a time.

    ``prefix`` defaults to the FP32 master files when present, else the model weights. Tensors the store does not
    hold are offered to ``extra_sink(name, tensor)`` (frozen parameters, persistent buffers); it returns False for
    names it does not know either. Missing master names raise when ``strict``. Returns the names not used."""
    if prefix is None:
        prefix = MASTER_PREFIX if weight_files(path, MASTER_PREFIX) is not None else WEIGHTS_PREFIX
    shards = weight_files(path, prefix)
    if shards is None:
        raise CheckpointError(f"no {prefix}.safetensors[.index.json] in {path}")
    if getattr(engine, "optimizer", None) is not None:
        engine.optimizer.wait()
    store = engine.store
    missing = set(store.names())
    for fname, names in shards.items():  # headers only: refuse a mismatched checkpoint before copying anything
        with _open(os.path.join(path, fname)) as f:
            for key in names:
                if key in store.by_name:
                    shape, want = tuple(f.get_slice(key).get_shape()), store.by_name[key][1].shape
                    if shape != tuple(want):
                        raise CheckpointError(f"{os.path.join(path, fname)}: tensor {key} has shape {shape}, the "
                                              f"model expects {tuple(want)}")
                    missing.discard(key)
    if missing and strict:
        raise CheckpointError(f"{path} lacks {len(missing)} parameters of the model, e.g. {sorted(missing)[:5]}")
    unused: list[str] = []
    for fname, names in shards.items():
        fpath = os.path.join(path, fname)
        with _open(fpath) as f:
            for key in names:
                if key in store.by_name:
                    _copy_into(store.master_tensor(key), f, key, fpath)
                elif extra_sink is None or not extra_sink(key, f.get_tensor(key)):
                    unused.append(key)
    engine.sync_device_()
    return unused


class _LazyTensors(Mapping):
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


def check_training_state(engine: Any, path: str, f: Any | None = None) -> None:
    """Raise ``CheckpointError`` unless the optimizer state file matches the engine's units (names and sizes)."""
    if f is None:
        if not os.path.isfile(path):
            return
        with _open(path) as fh:
            return check_training_state(engine, path, fh)
    want = {"unit_steps": (len(engine.store.units),)}
    for u in engine.store.units:
        want[f"exp_avg.{u.index}"] = want[f"exp_avg_sq.{u.index}"] = (u.numel,)
    keys = set(f.keys())
    for key, shape in want.items():
        if key not in keys:
            raise CheckpointError(f"{path} lacks optimizer state {key}; was it saved for another model?")
        if tuple(f.get_slice(key).get_shape()) != shape:
            raise CheckpointError(f"{path}: optimizer state {key} has shape {tuple(f.get_slice(key).get_shape())}, "
                                  f"this model needs {shape}")


def load_training_state(engine: Any, path: str) -> bool:
    """Restore AdamW moments, step counts and hyper-state saved by ``save_training_state``; False if absent."""
    tensors, hyper = os.path.join(path, OPTIMIZER_TENSORS), os.path.join(path, OPTIMIZER_HYPER)
    if not os.path.isfile(tensors):
        return False
    opt = engine.optimizer
    if opt is None:
        raise RuntimeError("load_training_state needs the engine's optimizer: call engine.create_optimizer() first")
    try:
        with open(hyper) as fh:
            hyper_state = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"missing or corrupt {hyper}: {e}") from e
    with _open(tensors) as f:
        check_training_state(engine, tensors, f)
        opt.load_state_tensors(_LazyTensors(f))
    opt.load_hyper_state(hyper_state)
    return True
