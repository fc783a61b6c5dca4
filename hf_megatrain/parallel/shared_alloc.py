"""Host buffers shared by the data-parallel ranks of one host: one copy of the FP32 store per host, not per rank.

Each buffer is a file in a run directory on a RAM file system (``/dev/shm``), mapped ``MAP_SHARED`` by every rank
(``torch.from_file(shared=True)``): a write by one rank is the same memory every other rank reads. Every rank
builds the same ``UnitStore`` from the same plans, so the buffers are requested in the same order; the n-th request
maps the file ``<n>-<numel>-<dtype>.bin`` (whoever comes first creates it at its size; the others find it there),
and ``signature()`` lets the ranks check afterwards that they asked for the same sequence. Pinned for fast
transfers with ``cudaHostRegister`` on each rank's mapping (CUDA only).

The files need to exist only until every rank has mapped them: ``release()`` (local rank 0, after a barrier)
removes the run directory, the mappings stay valid, and the memory goes back to the system when the last rank
exits, however it exits. Until then the files hold RAM with no process behind them if the conversion fails, so
``removed_on_failure`` removes them from any rank that fails (an exception, Ctrl-C, or the SIGTERM / SIGHUP that
torchrun sends every rank when one dies); only a SIGKILL leaves them, and then directories of runs whose leader is
gone are removed at the next start (``stale_run_dirs``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import uuid
from typing import Iterator

import torch

from ..core.memory import HostMemoryError, format_bytes, pin_in_place, reserve_file

RUN_PREFIX = "megatrain-"


def new_run_dir(root: str) -> str:
    """A fresh run directory under ``root`` named after this (leader) process, after removing stale ones."""
    for stale in stale_run_dirs(root):
        shutil.rmtree(stale, ignore_errors=True)
    path = os.path.join(root, f"{RUN_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.makedirs(path, mode=0o700)
    return path


def stale_run_dirs(root: str) -> list[str]:
    """Run directories under ``root`` whose leader process is gone."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if not name.startswith(RUN_PREFIX):
            continue
        pid = name[len(RUN_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            out.append(os.path.join(root, name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedHostAllocator:
    """``alloc(numel, dtype, pin)`` -> a host tensor backed by a shared file of the run directory (the store's
    ``host_alloc``)."""

    def __init__(self, run_dir: str, capacity: int | None = None) -> None:
        """``capacity``: bytes the file system of ``run_dir`` had free when the run began (None: unchecked)."""
        self.run_dir, self.capacity = run_dir, capacity
        self._names: list[str] = []
        self.requested = 0  # bytes of every file so far

    def __call__(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        size = max(numel, 1)
        nbytes = size * torch.empty((), dtype=dtype).element_size()
        # The files are sparse until written: a tmpfs too small for them would fail with SIGBUS on a write, in the
        # middle of training. Its size is its own limit (Docker's /dev/shm is 64 MiB by default; a host's is
        # half its RAM), whatever the RAM: refuse here, every rank alike (the same requests, the leader's figure).
        if self.capacity is not None and self.requested + nbytes > self.capacity:
            raise HostMemoryError(
                f"hf_megatrain data parallel: the host's shared store needs more than the "
                f"{format_bytes(self.capacity)} free in {os.path.dirname(self.run_dir)} (so far "
                f"{format_bytes(self.requested + nbytes)}). Enlarge that RAM file system (e.g. `mount -o remount,"
                "size=<bytes> /dev/shm`, or `docker run --shm-size=...`) or set shared_memory_dir to a larger one")
        self.requested += nbytes
        name = f"{len(self._names):06d}-{numel}-{str(dtype).replace('torch.', '')}.bin"
        self._names.append(name)
        path = os.path.join(self.run_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != nbytes:  # (the first rank here sizes it; same size: no-op, data kept)
                # Blocks reserved now, not on first write: a /dev/shm that fills later (another job, another run)
                # would otherwise SIGBUS a rank mid-training with no message.
                reserve_file(fd, nbytes, os.path.dirname(self.run_dir),
                             f"the host's shared store (data parallel; {format_bytes(self.requested)} requested so "
                             "far)", "Enlarge that RAM file system (e.g. `mount -o remount,size=<bytes> /dev/shm`, "
                             "or `docker run --shm-size=...`) or set shared_memory_dir to a larger one")
        finally:
            os.close(fd)
        t = torch.from_file(path, shared=True, size=size, dtype=dtype)
        if pin and torch.cuda.is_available():
            pin_in_place(t)  # (unpinned on refusal: slower transfers, same results)
        return t[:numel]

    def signature(self) -> list[str]:
        """The buffers requested so far, in order (equal on every rank of a correct run)."""
        return list(self._names)

    def release(self) -> None:
        """Remove the run directory (every rank has mapped its files: the mappings outlive the names)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)

    @contextlib.contextmanager
    def removed_on_failure(self) -> Iterator[None]:
        """While the ranks create and map the files: on an exception, or SIGTERM / SIGHUP (whose handlers are
        swapped in for the duration, main thread only), remove the run directory before the process goes on
        failing. A signal is then delivered again to the handler it had before, so the process ends as it would
        have. The other ranks fail too: the conversion is all or nothing."""
        previous: dict[int, object] = {}

        def on_signal(signum: int, _frame: object) -> None:
            self.release()
            signal.signal(signum, previous.pop(signum, None) or signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            yield
        except BaseException:
            self.release()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
