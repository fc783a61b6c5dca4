"""Checkpoints without a second copy of the model.

A model larger than GPU memory is usually larger than what host RAM can hold twice, so nothing here builds a
``state_dict``: weights go to disk tensor by tensor (``safetensors_io``) straight from the host store's FP32
master, in the standard layout plain ``transformers.from_pretrained`` reads (``model.safetensors`` or
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``). Loading reads each master's bytes
straight into its slice of the store, shards and ranges in parallel, computing CRC-32 while reading
(``read_into``); a bf16 checkpoint is converted once, chunk by chunk.

A Trainer checkpoint folder additionally holds the engine's training state (FP32 master when the export dtype is
not FP32, the flat AdamW moments as safetensors, the optimizer hyper-state as JSON) and a manifest of every file
with its size and CRC-32, written last (``manifest.py``: ``verify_checkpoint`` checks a folder against it before
anything is loaded). Folders are committed atomically (``atomic.py``); exports into an existing folder go through a
staging folder (``staged.py``).

This module is also the package's list of public names (``__all__``: ``hf_megatrain.checkpoint`` hands them on).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from typing import Any, Callable, Iterable

import torch

from ..core.engine_view import EngineView
from ..core.memory import available_host_bytes
from ..core.progress import Progress, byte_progress
from .atomic import atomic_directory, recover_interrupted_saves, remove_stale_temp_dirs, rotate_checkpoints
from .convert_keys import plan_keys, run_group
from .durable import OutputDirBusy, output_dir_lock
from .hub_layout import hub_layout, layer_runs
from .manifest import file_crc32, manifest_crcs, verify_checkpoint, write_manifest  # noqa: F401 (folders.file_crc32)
from .names import (MANIFEST, MASTER_PREFIX, OPTIMIZER_HYPER, OPTIMIZER_TENSORS,  # noqa: F401 (folders.MANIFEST)
                    WEIGHTS_PREFIX, CheckpointError)
from .read_into import HeaderError, ReadStats, Target, read_into, read_stats
from .safetensors_io import (DEFAULT_MAX_SHARD_SIZE, data_bytes, open_safetensors, parse_size, save_weights,
                             stored_nbytes, weight_files, write_json, write_safetensors, write_weights)
from .staged import staged_export

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "DEFAULT_MAX_SHARD_SIZE", "parse_size", "save_weights", "write_safetensors",
           "weight_files", "save_pretrained_streamed", "save_training_state", "write_manifest", "atomic_directory",
           "remove_stale_temp_dirs", "verify_checkpoint", "files_checked_on_load", "read_stats", "ReadStats",
           "load_pretrained_into_engine", "check_training_state", "load_training_state", "output_dir_lock",
           "OutputDirBusy", "recover_interrupted_saves", "rotate_checkpoints", "staged_export", "write_weights"]


def save_pretrained_streamed(engine: EngineView, save_dir: str, *, dtype: torch.dtype = torch.float32,
                             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                             extra: Iterable[tuple[str, torch.Tensor]] = (), show_progress: bool = True) -> list[str]:
    """Standard HF checkpoint of ``engine.model``: weights from the FP32 master (cast to ``dtype``), ``extra``
    tensors (frozen parameters, persistent buffers), ``config.json`` recording ``dtype`` and, when the model can
    generate, ``generation_config.json``. Tied weights appear once (the store keeps the first name), as HF saves.

    ``save_dir`` may hold an earlier export and the user's files: the export is staged and committed so that a kill
    at any instant leaves the old or the new model loadable, never a mix (``staged.py``).

    ``show_progress``: a bar of the bytes written (``core/progress.py``: on a terminal, unless transformers' bars
    are off); the caller's policy (``TrainingArguments.disable_tqdm``, the main process only)."""
    # (waits for updates in flight) In the layout transformers' save_pretrained writes (hub_layout.py).
    items = list(hub_layout(engine.model, layer_runs(list(engine.named_master_tensors()) + list(extra))))
    with staged_export(save_dir) as stage:
        with byte_progress("Saving model", data_bytes(items, dtype), enabled=show_progress) as progress:
            files = write_weights(stage, items, dtype=dtype, max_shard_size=max_shard_size, progress=progress)
        model = engine.model
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "save_pretrained"):
            cfg = copy.deepcopy(cfg)
            cfg.dtype = str(dtype).replace("torch.", "")  # what from_pretrained(dtype="auto") picks
            cfg.architectures = [type(model).__name__]
            cfg.save_pretrained(stage)
            files.append("config.json")
        gen = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)
        if gen is not None and can_generate():
            gen.save_pretrained(stage)
            files.append("generation_config.json")
    return files


def save_training_state(engine: EngineView, save_dir: str, *, master: bool, show_progress: bool = True) -> list[str]:
    """AdamW moments + step counts (safetensors), hyper-state (JSON) and, if ``master``, the FP32 master, written
    straight into ``save_dir`` (a checkpoint's new temp folder: ``atomic_directory``). ``show_progress``: one bar
    of the bytes of both (as ``save_pretrained_streamed``)."""
    files: list[str] = []
    masters = list(engine.named_master_tensors()) if master else []  # (waits for updates in flight)
    opt = engine.optimizer
    moments = list(opt.state_tensors().items()) if opt is not None else []  # (waits for an overlapped step)
    total = data_bytes(masters, torch.float32) + data_bytes(moments, None)
    with byte_progress("Saving training state", total, enabled=show_progress) as progress:
        if master:
            files += write_weights(save_dir, masters, dtype=torch.float32, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
                                   prefix=MASTER_PREFIX, progress=progress)
        if opt is not None:
            write_safetensors(os.path.join(save_dir, OPTIMIZER_TENSORS), moments, progress=progress)
            write_json(os.path.join(save_dir, OPTIMIZER_HYPER), opt.hyper_state())
            files += [OPTIMIZER_TENSORS, OPTIMIZER_HYPER]
    return files


# -- verifying and loading -------------------------------------------------------------------------------------------
def _moment_targets(engine: EngineView, live: dict[str, torch.Tensor]) -> dict[str, Target]:
    """Where ``load_training_state`` reads each AdamW moment: the optimizer's own buffer, or this data-parallel
    rank's shard of it (``Target.first``)."""
    own = getattr(engine.optimizer, "own", lambda u: (0, u.numel))
    targets = {}
    for u in engine.store.units:
        lo, hi = own(u)
        for key in (f"exp_avg.{u.index}", f"exp_avg_sq.{u.index}"):
            dst = live[key]
            targets[key] = Target(dst) if (lo, hi) == (0, dst.numel()) else Target(dst.view(-1)[lo:hi], lo)
    return targets


def files_checked_on_load(engine: EngineView, path: str, *, page_cache_bytes: int | None = None) -> list[str]:
    """The files of checkpoint ``path`` that a resume of ``engine`` should read once: ``verify_checkpoint(
    crc_on_load=...)`` skips their CRC-32, and the loads (``load_pretrained_into_engine`` with its default prefix,
    ``load_training_state``), which read them whole, check every byte against the manifest while reading.

    The price of one read: a file found corrupt by the load has already been read into the engine's state, which
    then holds part of the checkpoint (the error says so). So while the files fit in half of ``page_cache_bytes``
    (default: the host's available memory) this returns none: verify reads them from the disk, the loads read them
    again from the page cache (a memory copy), and a corrupt file is refused before any state is touched. Larger
    (a 120B model's 1.4 TB of master and moments), the second read would come from the disk again: read once.
    Also none where this process does not write every master or holds a shard of the optimizer state (data
    parallel), where the loads read only part of a file."""
    sums = manifest_crcs(path)
    if not sums or not all(engine.writes_master(n) for n in engine.store.names()):
        return []
    prefix = MASTER_PREFIX if weight_files(path, MASTER_PREFIX) is not None else WEIGHTS_PREFIX
    out = [f for f in weight_files(path, prefix) or {} if f in sums]
    opt = engine.optimizer
    if opt is not None and OPTIMIZER_TENSORS in sums:
        own = getattr(opt, "own", lambda u: (0, u.numel))
        if all(own(u) == (0, u.numel) for u in engine.store.units):
            out.append(OPTIMIZER_TENSORS)
    cache = available_host_bytes() if page_cache_bytes is None else page_cache_bytes
    if 2 * sum(os.path.getsize(os.path.join(path, f)) for f in out) <= cache:
        return []
    return out


def _read_checked(jobs: list[tuple[str, dict[str, Target], bool]], sums: dict[str, str],
                  progress: Progress | None = None) -> None:
    """``read_into`` the jobs; a file read whole whose CRC-32 (computed while reading) differs from the manifest's
    raises: it changed after the save (or after ``verify_checkpoint``), and the state it was read into is not the
    checkpoint's."""
    try:
        got = read_into(jobs, progress=progress)
    except HeaderError as e:
        raise CheckpointError(str(e)) from e
    for (fpath, _, crc), c in zip(jobs, got):
        if crc and c != sums[os.path.basename(fpath)]:
            raise CheckpointError(f"{fpath} is corrupt: it changed while it was loaded or since it was verified "
                                  f"(CRC-32 {c}, recorded {sums[os.path.basename(fpath)]}); the engine's state now "
                                  "holds part of it, not the checkpoint's: resume from another checkpoint, or build "
                                  "the engine / trainer again before training without one")


def _counted(t: torch.Tensor, progress: Progress) -> torch.Tensor:
    progress.add(t.nbytes)
    return t


def load_pretrained_into_engine(engine: EngineView, path: str, *, prefix: str | None = None,
                                strict: bool = True,
                                extra_sink: Callable[[str, torch.Tensor], bool] | None = None,
                                weight_mapping: list | None = None, extra_names: Iterable[str] = (),
                                base_model_prefix: str | None = None, show_progress: bool = True) -> list[str]:
    """Fill the engine's FP32 masters from the safetensors weights in ``path``: every master read straight into
    the store (``read_into``: one copy, ranges of the shards on a few threads; another dtype converted once). A
    shard its manifest lists and that this process reads whole is checked against its CRC-32, computed while
    reading (the separate ``verify_checkpoint`` pass refuses a corrupt folder before anything is written).

    ``prefix`` defaults to the FP32 master files when present, else the model weights. Tensors the store does not
    hold are offered to ``extra_sink(name, tensor)`` (frozen parameters, persistent buffers); it returns False for
    names it does not know either. Missing master names raise when ``strict``. Returns the names not used.

    ``weight_mapping``: transformers' conversion list for the model (``get_model_conversion_mapping``), applied to
    checkpoint keys not already named as in the model (``convert_keys``): renamed keys are copied like the others,
    converted ones (per-expert tensors -> fused experts) are built one target tensor at a time from their sources.
    ``extra_names``: the names ``extra_sink`` accepts, so that renamed / converted keys can reach it too. The whole
    plan (names, shapes, converted shapes on meta tensors) is checked before any master is written.

    ``show_progress``: a bar of the bytes read (as ``save_pretrained_streamed``)."""
    if prefix is None:
        prefix = MASTER_PREFIX if weight_files(path, MASTER_PREFIX) is not None else WEIGHTS_PREFIX
    shards = weight_files(path, prefix)
    if shards is None:
        raise CheckpointError(f"no {prefix}.safetensors[.index.json] in {path}")
    masters = dict(engine.named_master_tensors())  # (waits: no update may write a master while we do)
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

    later = 0  # bytes read through safe_open (not into a master): frozen parameters, buffers, converted sources
    for fname, names in shards.items():  # headers only: refuse a mismatched checkpoint before copying anything
        with open_safetensors(os.path.join(path, fname)) as f:
            for key in names:
                name = plan.direct.get(key)
                if name is None or name not in store.by_name:
                    later += stored_nbytes(f, key)
                else:
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
    writes = engine.writes_master  # (data parallel: local rank 0 fills the shared masters)
    sums = manifest_crcs(path)
    jobs, others = [], []
    for fname, names in shards.items():  # masters: read straight into them, every shard at once (read_into.py)
        targets = {key: Target(masters[plan.direct[key]]) for key in names
                   if plan.direct.get(key) in store.by_name and writes(plan.direct[key])}
        skipped = any(plan.direct.get(key) in store.by_name and key not in targets for key in names)
        jobs.append((os.path.join(path, fname), targets, fname in sums and not skipped))
        others.append([key for key in names if plan.direct.get(key) not in store.by_name and key not in converted])
    with byte_progress("Loading weights", later, enabled=show_progress) as progress:  # (read_into adds its bytes)
        _read_checked(jobs, sums, progress)
        for (fpath, _, _), keys in zip(jobs, others):  # frozen parameters, buffers: small, through safe_open
            if keys:
                with open_safetensors(fpath) as f:
                    for key in keys:
                        name = plan.direct.get(key)
                        t = f.get_tensor(key)
                        progress.add(t.nbytes)
                        if extra_sink is None or not extra_sink(name or key, t):
                            unused.append(key)
        for g in plan.groups:  # one target's sources in memory at a time
            for name, t in read_group(g, lambda f, key: _counted(f.get_tensor(key), progress)).items():
                if name in store.by_name:
                    if writes(name):
                        with torch.no_grad():
                            masters[name].copy_(t)
                elif extra_sink is None or not extra_sink(name, t):
                    unused.append(name)
    engine.sync_device_()
    return unused


def check_training_state(engine: EngineView, path: str, f: Any | None = None) -> None:
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


def load_training_state(engine: EngineView, path: str, *, show_progress: bool = True) -> bool:
    """Restore AdamW moments, step counts and hyper-state saved by ``save_training_state``; False if absent.
    ``show_progress``: a bar of the moments' bytes read (as ``save_pretrained_streamed``)."""
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
        live = opt.state_tensors()  # (waits for a step in flight) the moments themselves: read straight into them
        targets = _moment_targets(engine, live)
        whole = all(t.first == 0 for t in targets.values())
        sums = manifest_crcs(path)
        with byte_progress("Loading optimizer state", enabled=show_progress) as progress:  # (read_into: its bytes)
            _read_checked([(tensors, targets, whole and OPTIMIZER_TENSORS in sums)], sums, progress)
        # The moments are in place (loading a tensor into itself copies nothing); the small rest from the file.
        opt.load_state_tensors({**{k: f.get_tensor(k) for k in f.keys() if k not in targets},
                                **{k: live[k] for k in targets}})
    opt.load_hyper_state(hyper_state)
    return True
