"""Checkpoint folders that change all at once, and recovery of saves a kill interrupted.

- ``atomic_directory``: a Trainer checkpoint is written into ``<name>.tmp-<pid>-XXXX`` and renamed into place. An
  existing ``<name>`` (a re-save of ``checkpoint-N``) is first moved to ``<name>.old-<pid>-XXXX/x``: between the two
  renames no folder has the final name, so ``recover_interrupted_saves`` puts a complete copy back.
- ``recover_interrupted_saves``: run under the lock (``durable.output_dir_lock``) before every save and before
  resuming; restores or removes what a killed save left, and logs every step. A copy is "complete" when its
  manifest (written last) verifies (``manifest.verify_checkpoint``).
- ``rotate_checkpoints``: ``save_total_limit`` rotation; a folder is renamed to ``<name>.del-...`` before it is
  deleted, so a kill mid-delete never leaves a half-deleted ``checkpoint-N`` that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from typing import Callable, Iterator

from .durable import fsync_dir, fsync_tree, pid_alive
from .manifest import verify_checkpoint
from .names import MANIFEST, CheckpointError

logger = logging.getLogger(__name__)

_LEFTOVER = re.compile(r"(?P<final>.+)\.(?P<kind>tmp|old|del)-(?:(?P<pid>\d+)-)?[A-Za-z0-9_]+")


# -- committing and recovering checkpoint folders --------------------------------------------------------------------
@contextlib.contextmanager
def atomic_directory(final: str) -> Iterator[str]:
    """Yield a temp folder next to ``final``; on success fsync it and rename it to ``final`` (an existing folder of
    that name is replaced only after the new one is complete). On error the temp folder is removed. Call it under
    ``output_dir_lock`` of the parent, after ``recover_interrupted_saves``."""
    parent = os.path.dirname(os.path.abspath(final)) or "."
    base = os.path.basename(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{base}.tmp-{os.getpid()}-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the final folder gets normal permissions
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(final):
        # From here until the second rename only the temp and old copies exist: recover_interrupted_saves restores
        # one of them (the new one when it is complete) if the process dies in between.
        old = tempfile.mkdtemp(prefix=f"{base}.old-{os.getpid()}-", dir=parent)
        os.rename(final, os.path.join(old, "x"))
    os.rename(tmp, final)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _complete(path: str) -> bool:
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return False
    try:
        verify_checkpoint(path, training_state=False)
    except (CheckpointError, OSError):
        return False
    return True


def _remove(path: str, why: str) -> None:
    logger.warning("hf_megatrain: removing %s (%s)", path, why)
    shutil.rmtree(path, ignore_errors=True)


def recover_interrupted_saves(parent: str, prefix: str = "checkpoint-",
                              complete: Callable[[str], bool] = _complete) -> None:
    """Finish what killed saves left in ``parent`` (call it holding ``output_dir_lock(parent)``):

    - ``<name>`` missing: a complete ``.tmp-`` copy (the new save, fully written) or else a complete ``.old-`` copy
      (the previous one) is renamed back to ``<name>``;
    - ``<name>`` present: its ``.tmp-`` / ``.old-`` copies are redundant (the save never committed, or had);
    - ``.del-`` folders (rotation was deleting them) and incomplete ``.tmp-`` folders (never committed) are removed.

    Folders of a live process other than this one are left alone. Every step is logged."""
    if not os.path.isdir(parent):
        return
    groups: dict[str, list[tuple[str, str]]] = {}
    for entry in sorted(os.listdir(parent)):
        m = _LEFTOVER.fullmatch(entry)
        path = os.path.join(parent, entry)
        if m is None or not entry.startswith(prefix) or not os.path.isdir(path):
            continue
        if m["pid"] is not None and int(m["pid"]) != os.getpid() and pid_alive(int(m["pid"])):
            logger.warning("hf_megatrain: leaving %s alone: process %s, which is writing it, is alive", path, m["pid"])
            continue
        if m["kind"] == "del":
            _remove(path, "a checkpoint rotation deleted it and was interrupted")
            continue
        if m["kind"] == "old":
            inner = os.path.join(path, "x")
            if not os.path.isdir(inner):  # killed before the move: nothing of value in it
                _remove(path, "an empty leftover of an interrupted save")
                continue
            path = inner
        groups.setdefault(m["final"], []).append((m["kind"], path))
    for final, copies in groups.items():
        target = os.path.join(parent, final)
        copies.sort(key=lambda c: c[0] != "tmp")  # the new save first
        done = {p: complete(p) for _, p in copies}
        if not os.path.exists(target):
            pick = next((p for _, p in copies if done[p]), None)
            if pick is not None:
                logger.warning("hf_megatrain: %s was missing (a save was killed while replacing it): restored it "
                               "from the complete copy %s", target, pick)
                os.rename(pick, target)
                fsync_dir(parent)
        for kind, p in copies:
            top = os.path.dirname(p) if kind == "old" else p
            if not os.path.exists(p):
                if os.path.isdir(top):
                    _remove(top, "an empty leftover of an interrupted save")
            elif kind == "tmp" and not done[p]:
                _remove(top, f"an incomplete copy of {final} that a killed save was writing")
            elif os.path.exists(target) and complete(target):
                _remove(top, f"a copy of {final} left by an interrupted save; {target} is complete")
            else:
                logger.warning("hf_megatrain: keeping %s: %s is not a complete checkpoint and this copy may be the "
                               "only one; inspect both and remove the one you do not need", top, target)


def remove_stale_temp_dirs(parent: str, prefix: str = "checkpoint-") -> None:
    """Earlier name of ``recover_interrupted_saves`` (which never deletes the only complete copy)."""
    recover_interrupted_saves(parent, prefix)


def rotate_checkpoints(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """``transformers.trainer_utils.rotate_checkpoints`` (oldest by mtime first; the newest and the best are kept),
    over ``checkpoint-N`` folders only (never a temp copy), each renamed to ``.del-`` before it is deleted."""
    if not save_total_limit or save_total_limit <= 0:
        return
    found = [os.path.join(run_dir, f) for f in os.listdir(run_dir)
             if re.fullmatch(r"checkpoint-\d+", f) and os.path.isdir(os.path.join(run_dir, f))]
    found.sort(key=lambda p: (os.path.getmtime(p), p))
    if len(found) <= save_total_limit:
        return
    protected = {found[-1]}
    if best_model_checkpoint is not None:
        protected.add(os.path.join(run_dir, os.path.basename(os.path.normpath(best_model_checkpoint))))
    remaining = len(found)
    for path in found:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if path in protected:
            continue
        gone = tempfile.mkdtemp(prefix=f"{os.path.basename(path)}.del-{os.getpid()}-", dir=run_dir)
        os.rename(path, os.path.join(gone, "x"))
        shutil.rmtree(gone, ignore_errors=True)
        remaining -= 1
