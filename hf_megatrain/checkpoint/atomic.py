"""Folders that change all at once, one writer per output folder, and recovery of saves a kill interrupted.

- ``output_dir_lock``: an exclusive ``flock`` on ``<folder>/_megatrain.lock`` held for a run (and for a save), so
  that a second run in the same ``output_dir`` fails at once with a clear message instead of overwriting the
  first one's checkpoints, and so that cleaning up leftovers never touches another run's save in progress. The
  lock is per process and re-entrant; folders inside a locked folder need no lock of their own.
- ``atomic_directory``: a Trainer checkpoint is written into ``<name>.tmp-<pid>-XXXX`` and renamed into place. An
  existing ``<name>`` (a re-save of ``checkpoint-N``) is first moved to ``<name>.old-<pid>-XXXX/x``: between the two
  renames no folder has the final name, so ``recover_interrupted_saves`` puts a complete copy back.
- ``recover_interrupted_saves``: run under the lock before every save and before resuming; restores or removes what
  a killed save left, and logs every step. A copy is "complete" when its manifest (written last) verifies.
- ``rotate_checkpoints``: ``save_total_limit`` rotation; a folder is renamed to ``<name>.del-...`` before it is
  deleted, so a kill mid-delete never leaves a half-deleted ``checkpoint-N`` that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

LOCK_NAME = "_megatrain.lock"  # leading "_": Trainer's Hub pushes ignore "_*"
_LEFTOVER = re.compile(r"(?P<final>.+)\.(?P<kind>tmp|old|del)-(?:(?P<pid>\d+)-)?[A-Za-z0-9_]+")


class OutputDirBusy(RuntimeError):
    """Another process holds the lock of an output folder."""


# -- fsync -----------------------------------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    """Make the folder's entries (renames, new and removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under ``path`` (files other libraries wrote, e.g. tokenizers, are not)."""
    for root, dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(root)


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# -- one writer per folder -------------------------------------------------------------------------------------------
_held: dict[str, list[int]] = {}  # realpath -> [fd, depth]
_held_guard = threading.Lock()


def _acquire(path: str) -> None:
    lock = os.path.join(path, LOCK_NAME)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown process"
            finally:
                os.close(fd)
            raise OutputDirBusy(
                f"{path} is in use by another hf_megatrain run ({owner}); two runs in one output_dir overwrite each "
                "other's checkpoints. Give this run its own output_dir, or wait until the other run ends.") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file between our open and flock: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n".encode(), 0)
    _held[path] = [fd, 1]


@contextlib.contextmanager
def output_dir_lock(folder: str) -> Iterator[None]:
    """Hold the exclusive lock of ``folder`` (created if missing) for the ``with`` block; raises ``OutputDirBusy``
    naming the holder when another process has it. Re-entrant; a no-op inside a folder this process has locked."""
    path = os.path.realpath(folder)
    os.makedirs(path, exist_ok=True)
    with _held_guard:
        if path in _held:
            _held[path][1] += 1
            owned = True
        elif any(path.startswith(h + os.sep) for h in _held):
            owned = False  # (a checkpoint's temp folder inside the locked output_dir)
        else:
            _acquire(path)
            owned = True
    try:
        yield
    finally:
        if owned:
            with _held_guard:
                entry = _held[path]
                entry[1] -= 1
                if entry[1] == 0:
                    del _held[path]
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(path, LOCK_NAME))  # while still locked: see _acquire's inode check
                    os.close(entry[0])


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
    from .folders import CheckpointError, MANIFEST, verify_checkpoint

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
