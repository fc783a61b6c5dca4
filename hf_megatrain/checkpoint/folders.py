"""Checkpoints without a second copy of the model.

A model larger than GPU memory is usually larger than what host RAM can hold twice, so nothing here builds a
``state_dict``: weights go to disk tensor by tensor (``safetensors_io``) straight from the host store's FP32
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
import logging
import copy
import json
import os
import shutil
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import torch

from .safetensors_io import (read_json_key, DEFAULT_MAX_SHARD_SIZE, WEIGHTS_PREFIX, CheckpointError, LazyTensors, copy_tensor_into,
                             open_safetensors, parse_size, save_weights, weight_files, write_json, write_safetensors)

logger = logging.getLogger(__name__)

MASTER_PREFIX = "megatrain_master"  # FP32 master, written only when the exported weights are not FP32
OPTIMIZER_TENSORS = "megatrain_optimizer.safetensors"
OPTIMIZER_HYPER = "megatrain_optimizer.json"
MANIFEST = "megatrain_manifest.json"

__all__ = ["CheckpointError", "DEFAULT_MAX_SHARD_SIZE", "parse_size", "save_weights", "write_safetensors",
           "weight_files", "save_pretrained_streamed", "save_training_state", "write_manifest", "atomic_directory",
           "remove_stale_temp_dirs", "verify_checkpoint", "load_pretrained_into_engine", "check_training_state",
           "load_training_state"]


def save_pretrained_streamed(engine: Any, save_dir: str, *, dtype: torch.dtype = torch.float32,
                             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                             extra: Iterable[tuple[str, torch.Tensor]] = ()) -> list[str]:
    """Standard HF checkpoint of ``engine.model``: weights from the FP32 master (cast to ``dtype``), ``extra``
    tensors (frozen parameters, persistent buffers), ``config.json`` recording ``dtype`` and, when the model can
    generate, ``generation_config.json``. Tied weights appear once (the store keeps the first name), as HF saves."""
    os.makedirs(save_dir, exist_ok=True)
    items = list(engine.named_master_tensors()) + list(extra)  # (waits for updates in flight)
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
        write_json(os.path.join(save_dir, OPTIMIZER_HYPER), opt.hyper_state())
        files += [OPTIMIZER_TENSORS, OPTIMIZER_HYPER]
    return files


def file_crc32(path: str, chunk: int = 64 << 20) -> str:
    """CRC-32 of a file's bytes, read in large chunks (zlib releases the GIL on them: files hash in parallel)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _crc32_all(paths: list[str]) -> list[str]:
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(file_crc32, paths))


def write_manifest(save_dir: str) -> None:
    """Record every file in ``save_dir`` with its size and CRC-32; ``verify_checkpoint`` checks against both, so
    a truncated file and a same-size corrupt one are refused before anything is loaded."""
    names = [f for f in sorted(os.listdir(save_dir)) if os.path.isfile(os.path.join(save_dir, f)) and f != MANIFEST]
    sums = _crc32_all([os.path.join(save_dir, f) for f in names])
    files = {f: os.path.getsize(os.path.join(save_dir, f)) for f in names}
    write_json(os.path.join(save_dir, MANIFEST), {"format": 2, "files": files, "crc32": dict(zip(names, sums))})


# -- atomic folders --------------------------------------------------------------------------------------------------
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
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the final folder gets normal permissions
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


# -- verifying and loading -------------------------------------------------------------------------------------------
def verify_checkpoint(path: str, *, training_state: bool = True) -> None:
    """Raise ``CheckpointError`` naming the first missing or corrupt file of checkpoint folder ``path``.

    With a manifest (folders written by hf_megatrain) every listed file must exist with its recorded size; without
    one (a plain HF folder) only the files present are checked. Every safetensors header must parse and hold what
    its index lists; ``training_state`` also requires ``trainer_state.json`` (resuming needs it)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest_path):
        files = read_json_key(manifest_path, "files")
        for fname, size in files.items():
            p = os.path.join(path, fname)
            if not os.path.isfile(p):
                raise CheckpointError(f"checkpoint {path} is incomplete: missing {fname}")
            if os.path.getsize(p) != size:
                raise CheckpointError(f"checkpoint {path} is corrupt: {fname} has {os.path.getsize(p)} bytes, "
                                      f"{size} were written")
        with open(manifest_path) as fh:
            sums = json.load(fh).get("crc32")
        if sums is None:  # a manifest of an earlier release: sizes only
            logger.warning("hf_megatrain: %s records no checksums (an earlier release wrote it): only file sizes "
                           "are verified", manifest_path)
            sums = {}
        names = sorted(sums)
        for fname, got in zip(names, _crc32_all([os.path.join(path, f) for f in names])):
            if got != sums[fname]:
                raise CheckpointError(f"checkpoint {path} is corrupt: {fname} does not hold the bytes that were "
                                      f"written (CRC-32 {got}, recorded {sums[fname]}); resume from an earlier "
                                      "checkpoint")
    if training_state and not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise CheckpointError(f"{path} has no trainer_state.json, so training cannot resume from it (it is a "
                              "model export, not a Trainer checkpoint); start a new run from it instead")
    shards = weight_files(path)
    if shards is None and not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):  # PEFT: adapters
        raise CheckpointError(f"checkpoint {path} has no weights ({WEIGHTS_PREFIX}.safetensors or "
                              f"{WEIGHTS_PREFIX}.safetensors.index.json)")
    for prefix in (WEIGHTS_PREFIX, MASTER_PREFIX):
        for fname, names in (weight_files(path, prefix) or {}).items():
            with open_safetensors(os.path.join(path, fname)) as f:
                missing = set(names) - set(f.keys())
            if missing:
                raise CheckpointError(f"{os.path.join(path, fname)} lacks tensors its index lists: "
                                      f"{sorted(missing)[:5]}")
    opt = os.path.join(path, OPTIMIZER_TENSORS)
    if os.path.isfile(opt):
        with open_safetensors(opt):
            pass


def load_pretrained_into_engine(engine: Any, path: str, *, prefix: str | None = None, strict: bool = True,
                                extra_sink: Callable[[str, torch.Tensor], bool] | None = None,
                                weight_mapping: list | None = None, extra_names: Iterable[str] = (),
                                base_model_prefix: str | None = None) -> list[str]:
    """Fill the engine's FP32 masters from the safetensors weights in ``path``, one shard at a time.

    ``prefix`` defaults to the FP32 master files when present, else the model weights. Tensors the store does not
    hold are offered to ``extra_sink(name, tensor)`` (frozen parameters, persistent buffers); it returns False for
    names it does not know either. Missing master names raise when ``strict``. Returns the names not used.

    ``weight_mapping``: transformers' conversion list for the model (``get_model_conversion_mapping``), applied to
    checkpoint keys not already named as in the model (``convert_keys``): renamed keys are copied like the others,
    converted ones (per-expert tensors -> fused experts) are built one target tensor at a time from their sources.
    ``extra_names``: the names ``extra_sink`` accepts, so that renamed / converted keys can reach it too. The whole
    plan (names, shapes, converted shapes on meta tensors) is checked before any master is written."""
    from .convert_keys import plan_keys, run_group

    if prefix is None:
        prefix = MASTER_PREFIX if weight_files(path, MASTER_PREFIX) is not None else WEIGHTS_PREFIX
    shards = weight_files(path, prefix)
    if shards is None:
        raise CheckpointError(f"no {prefix}.safetensors[.index.json] in {path}")
    engine.state.wait_all()  # no update may write a master while we do
    store = engine.store
    model = getattr(engine, "model", None)
    config = getattr(model, "config", None)
    plan = plan_keys(shards, [*store.names(), *extra_names], weight_mapping, base_model_prefix)
    missing = set(store.names())

    def read_group(g: Any, read: Callable[[Any, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        with contextlib.ExitStack() as stack:  # only this group's shards are open (mapped pages leave with them)
            files = {fname: stack.enter_context(open_safetensors(os.path.join(path, fname)))
                     for fname in dict.fromkeys(fname for _, _, fname in g.sources)}
            return run_group(g, lambda fname, key: read(files[fname], key), model=model, config=config)

    for fname, names in shards.items():  # headers only: refuse a mismatched checkpoint before copying anything
        with open_safetensors(os.path.join(path, fname)) as f:
            for key in names:
                name = plan.direct.get(key)
                if name is not None and name in store.by_name:
                    shape, want = tuple(f.get_slice(key).get_shape()), store.by_name[name][1].shape
                    if shape != tuple(want):
                        raise CheckpointError(f"{os.path.join(path, fname)}: tensor {key} has shape {shape}, the "
                                              f"model expects {tuple(want)} for {name}")
                    missing.discard(name)
    for g in plan.groups:  # converted targets: the converter's own ops on meta tensors of the sources' shapes
        out = read_group(g, lambda f, key: torch.empty(tuple(f.get_slice(key).get_shape()), device="meta"))
        for name, t in out.items():
            if name in store.by_name:
                want = tuple(store.by_name[name][1].shape)
                if tuple(t.shape) != want:
                    raise CheckpointError(f"{path}: {name} converted from {[k for _, k, _ in g.sources][:4]}... "
                                          f"has shape {tuple(t.shape)}, the model expects {want}")
                missing.discard(name)
    if missing and strict:
        raise CheckpointError(f"{path} lacks {len(missing)} parameters of the model, e.g. {sorted(missing)[:5]}")
    unused: list[str] = []
    converted = plan.converted_keys
    writes = getattr(engine, "writes_master", lambda name: True)  # (data parallel: local rank 0 fills shared ones)
    for fname, names in shards.items():
        fpath = os.path.join(path, fname)
        with open_safetensors(fpath) as f:
            for key in names:
                name = plan.direct.get(key)
                if name is not None and name in store.by_name:
                    if writes(name):
                        copy_tensor_into(store.master_tensor(name), f, key, fpath)
                elif key not in converted:
                    if extra_sink is None or not extra_sink(name or key, f.get_tensor(key)):
                        unused.append(key)
    for g in plan.groups:  # one target's sources in memory at a time
        for name, t in read_group(g, lambda f, key: f.get_tensor(key)).items():
            if name in store.by_name:
                if writes(name):
                    with torch.no_grad():
                        store.master_tensor(name).copy_(t)
            elif extra_sink is None or not extra_sink(name, t):
                unused.append(name)
    engine.sync_device_()
    return unused


def check_training_state(engine: Any, path: str, f: Any | None = None) -> None:
    """Raise ``CheckpointError`` unless the optimizer state file matches the engine's units (names and sizes)."""
    if f is None:
        if not os.path.isfile(path):
            return
        with open_safetensors(path) as fh:
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
    with open_safetensors(tensors) as f:
        check_training_state(engine, tensors, f)
        opt.load_state_tensors(LazyTensors(f))
    opt.load_hyper_state(hyper_state)
    return True
