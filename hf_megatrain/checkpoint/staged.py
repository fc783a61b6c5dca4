"""Exports into a folder that already holds a model (and the user's other files), crash-safe at every step.

``save_model`` / ``save_pretrained`` write into the user's folder, next to a tokenizer, a README, checkpoints: the
folder cannot be swapped as a whole. So an export is written into a hidden staging folder inside it
(``.megatrain-staging-<pid>-XXXX``, same filesystem: renames are atomic), fsynced, and committed with renames
ordered so that what plain ``transformers.from_pretrained`` loads is, after a kill at any instant, either the
complete old weights or the complete new ones. It prefers ``<prefix>.safetensors`` over the sharded index when
both exist, so:

- new single file: one ``rename`` over ``<prefix>.safetensors`` is the switch; the old index and shards go after;
- new shards: they are renamed in under names the live layout does not use, then the index is replaced (the
  switch), then an old ``<prefix>.safetensors`` is removed (the switch when the layout was a single file);
- new shards whose names the live index uses (same shard count): the index is first switched to the new shards
  *inside the staging folder*, then each is hard-linked (copied where links are not supported) to its standard
  name, and a second index switch names them; the staging folder goes last.

Old files of the prefix are removed only once the new index is durable. A failed export removes its staging folder
(no hidden file keeps the disk full); one a killed process left is removed by the next export into the folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Iterator

from .durable import fsync_dir, fsync_tree, output_dir_lock, pid_alive

logger = logging.getLogger(__name__)

STAGING = ".megatrain-staging-"
_STAGING_RE = re.compile(re.escape(STAGING) + r"(?P<pid>\d+)-[A-Za-z0-9_]+")
_WEIGHTS_RE = re.compile(r"(?P<prefix>.+?)(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_TEMP_RE = re.compile(r".+\.tmp-\d+-[A-Za-z0-9_]+")  # a checkpoint's temp folder (atomic.py)
_LEGACY_PARTIAL = re.compile(r"\..+\.safetensors(\.index\.json)?\.partial")  # an earlier release's temp files


def disk_full(e: OSError, folder: str, needed: int) -> OSError:
    """``e`` again when it is not ENOSPC; else an ENOSPC error naming the folder (the user's one, not a staging or
    temp folder inside it) and the bytes the save needs and those free."""
    if e.errno != errno.ENOSPC:
        return e
    folder = os.path.abspath(folder)
    while os.path.basename(folder).startswith(STAGING) or _TEMP_RE.fullmatch(os.path.basename(folder)):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    return OSError(errno.ENOSPC, f"No space left on the device of {folder}: this save needs {needed:,} bytes "
                                 f"there, {free:,} are free. Free space or save elsewhere (the previous save in that "
                                 "folder is unchanged).")


def check_free_space(folder: str, needed: int) -> None:
    """Refuse a save before writing anything when the folder's filesystem lacks ``needed`` bytes."""
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise disk_full(OSError(errno.ENOSPC, "no space"), folder, needed)


def _live(save_dir: str, prefix: str) -> set[str]:
    """The files of ``prefix`` that ``from_pretrained`` would read in ``save_dir`` now (names relative to it)."""
    single = f"{prefix}.safetensors"
    if os.path.isfile(os.path.join(save_dir, single)):
        return {single}
    index = os.path.join(save_dir, f"{prefix}.safetensors.index.json")
    try:
        with open(index) as f:
            return set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def _referenced_staging(save_dir: str) -> set[str]:
    refs: set[str] = set()
    for f in os.listdir(save_dir):
        if f.endswith(".safetensors.index.json"):
            refs |= {r.split("/")[0] for r in _live(save_dir, f[:-len(".safetensors.index.json")]) if "/" in r}
    return refs


def remove_abandoned_staging(save_dir: str) -> None:
    """Remove staging folders (and an earlier release's ``.partial`` files) that dead exports left in ``save_dir``,
    except one the live index still names (a kill between the two index switches: it holds the live weights)."""
    if not os.path.isdir(save_dir):
        return
    refs = _referenced_staging(save_dir)
    for f in os.listdir(save_dir):
        path = os.path.join(save_dir, f)
        m = _STAGING_RE.fullmatch(f)
        if m is not None and f not in refs and os.path.isdir(path):
            if int(m["pid"]) != os.getpid() and pid_alive(int(m["pid"])):
                continue  # another live process's export in progress
            logger.warning("hf_megatrain: removing %s, left by an export that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)
        elif _LEGACY_PARTIAL.fullmatch(f) and os.path.isfile(path):
            logger.warning("hf_megatrain: removing %s, left by an export that did not finish", path)
            os.remove(path)


@contextlib.contextmanager
def staged_export(save_dir: str) -> Iterator[str]:
    """Yield a staging folder inside ``save_dir``; write the export there with its final file names. On success it
    is committed into ``save_dir`` (see the module docstring); on error, or after the commit, it is removed. Holds
    ``output_dir_lock(save_dir)`` throughout: a second process exporting into the same folder gets a clear error."""
    with output_dir_lock(save_dir):  # (so that cleaning up never removes another export's staging folder)
        remove_abandoned_staging(save_dir)
        stage = tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}-", dir=save_dir)
        try:
            yield stage
            commit_staged(stage, save_dir)
        finally:
            if os.path.isdir(stage) and os.path.basename(stage) not in _referenced_staging(save_dir):
                shutil.rmtree(stage, ignore_errors=True)
        remove_abandoned_staging(save_dir)  # (one a kill between two index switches left: the index moved on)


def commit_staged(stage: str, save_dir: str) -> None:
    """Move everything in ``stage`` into ``save_dir``: weights by the protocol above, then the other files (config,
    tokenizer, adapter config: each one ``rename``), folders recursively."""
    fsync_tree(stage)
    names = sorted(os.listdir(stage))
    prefixes = sorted({m["prefix"] for f in names if (m := _WEIGHTS_RE.fullmatch(f))
                       and os.path.isfile(os.path.join(stage, f))})
    for prefix in prefixes:
        _commit_weights(stage, save_dir, prefix)
    for f in names:
        src = os.path.join(stage, f)
        if not os.path.exists(src):
            continue  # (weights, moved already)
        if os.path.isdir(src):
            os.makedirs(os.path.join(save_dir, f), exist_ok=True)
            commit_staged(src, os.path.join(save_dir, f))
        else:
            os.replace(src, os.path.join(save_dir, f))
    fsync_dir(save_dir)


def write_json(path: str, obj: object) -> None:
    """``obj`` as JSON at ``path``, fsynced (its rename or its folder's commit follows)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: a copy (slower, same result)
        shutil.copyfile(src, dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())


def _commit_weights(stage: str, save_dir: str, prefix: str) -> None:
    single, index_name = f"{prefix}.safetensors", f"{prefix}.safetensors.index.json"
    live = _live(save_dir, prefix)
    if os.path.isfile(os.path.join(stage, single)):
        os.replace(os.path.join(stage, single), os.path.join(save_dir, single))  # the switch
        fsync_dir(save_dir)
        new = {single}
    else:
        with open(os.path.join(stage, index_name)) as f:
            index = json.load(f)
        shards = sorted(set(index["weight_map"].values()))
        clash = [s for s in shards if s in live]
        for s in shards:
            if s not in clash:
                os.replace(os.path.join(stage, s), os.path.join(save_dir, s))
        fsync_dir(save_dir)  # the shards' names are durable before an index names them
        staged_name = os.path.basename(stage)
        first = dict(index, weight_map={k: f"{staged_name}/{v}" if v in clash else v
                                        for k, v in index["weight_map"].items()})
        write_json(os.path.join(stage, index_name + ".first"), first)
        os.replace(os.path.join(stage, index_name + ".first"), os.path.join(save_dir, index_name))  # the switch
        fsync_dir(save_dir)
        if single in live:
            os.remove(os.path.join(save_dir, single))  # the switch when the old layout was one file
            fsync_dir(save_dir)
        if clash:
            for s in clash:  # both names hold the new bytes before the index moves to the standard ones
                tmp = os.path.join(save_dir, f".{s}.link-{os.getpid()}")
                _link_or_copy(os.path.join(stage, s), tmp)
                os.replace(tmp, os.path.join(save_dir, s))
            fsync_dir(save_dir)
            os.replace(os.path.join(stage, index_name), os.path.join(save_dir, index_name))
            fsync_dir(save_dir)
        else:
            os.remove(os.path.join(stage, index_name))
        new = set(shards) | {index_name}
    removed = False
    for f in os.listdir(save_dir):  # old files of this prefix: nothing names them any more
        m = _WEIGHTS_RE.fullmatch(f)
        if m is not None and m["prefix"] == prefix and f not in new and os.path.isfile(os.path.join(save_dir, f)):
            os.remove(os.path.join(save_dir, f))
            removed = True
    if removed:
        fsync_dir(save_dir)
