"""What makes a folder's changes durable and its writer unique: fsync, the output folder's lock, a pid's liveness.

- ``fsync_dir`` / ``fsync_tree``: a rename or a folder's new files are durable only once the folder (and the files)
  are fsynced; every commit (``atomic.py``, ``staged.py``) ends with them.
- ``output_dir_lock``: an exclusive ``flock`` on ``<folder>/_megatrain.lock`` held for a run (and for a save), so
  that a second run in the same ``output_dir`` fails at once with a clear message instead of overwriting the
  first one's checkpoints, and so that cleaning up leftovers never touches another run's save in progress. The
  lock is per process and re-entrant; folders inside a locked folder need no lock of their own.
- ``pid_alive``: leftovers of a live process (another run's save in progress) are never cleaned up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from typing import Iterator

LOCK_NAME = "_megatrain.lock"  # leading "_": Trainer's Hub pushes ignore "_*"


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
