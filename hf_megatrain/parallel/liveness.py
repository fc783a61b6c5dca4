"""Liveness: when one data-parallel rank of a host dies or fails, every other rank of the host ends within seconds,
naming it.

Without this, the others wait for the dead rank forever or nearly: an NCCL collective until its 30-minute timeout,
the checkpoint save's barrier for up to a week, a load of a unit for its shards (parallel/peer_cells.py) for 30
minutes; and only some launchers end the survivors (torchrun's and accelerate's agents do; mp.spawn does so only
while its parent sits in ``join``; a plain process per rank, SLURM's srun or a custom launcher may not).

Each rank owns one row (one writer per row, as peer_cells) of a shared int64 ``[ranks of the host, WORDS]`` tensor
in the host's store: its state, global rank, pid, process start time, pid namespace, a heartbeat and, once it
fails, a message. A daemon thread per rank polls the other rows every ``poll_s``; a peer is *gone* when it failed
(an uncaught exception: ``sys.excepthook`` writes the message before the traceback prints), or when its process
ended (or is a zombie) without saying it finished. A peer in another pid namespace (its pid means nothing here)
is gone when its heartbeat is older than ``heartbeat_timeout_s``. Then this rank logs at ERROR, e.g.
``hf_megatrain data parallel: rank 1 (pid 4242) died (killed, or it exited without finishing); stopping this
rank (0)``, flushes the logs and ends with ``os._exit(EXIT_CODE)``: a thread cannot interrupt the main thread's
blocked NCCL / gloo call any other way, and the process's end frees its mappings of the shared store (the run
directory's names are gone once every rank mapped them: parallel/shared_alloc.py).

A normal end is not a death: the rank's row says *done* at interpreter exit (``atexit``, and multiprocessing's exit
finalizers, which run where ``atexit`` does not: forked children), and when the engine holding it is collected. A
launcher that ends its ranks with ``os._exit`` skips both: call ``finished()`` first. A rank's ``sys.exit(n)`` is
a normal exit too (``mp.spawn`` ends a raising rank so, then its parent ends the others). A failed rank's own end is
bounded as well: if it has not exited ``FAILED_EXIT_S`` after the exception (a process group's teardown that hangs
on the others), faulthandler dumps its threads and ends it.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import multiprocessing.util
import os
import sys
import threading
import time
import weakref
from typing import Any

import psutil
import torch

logger = logging.getLogger(__name__)

# A row: the words below, then the message (UTF-8, MESSAGE_BYTES at most).
STATE, RANK, PID, STARTED, PIDNS, HEARTBEAT, MSGLEN = range(7)
HEADER = 8
MESSAGE_BYTES = 1024
WORDS = HEADER + MESSAGE_BYTES // 8

# States (0: not registered yet).
RUNNING, DONE, FAILED, STOPPED = 1, 2, 3, 4

PREFIX = "hf_megatrain data parallel: "
EXIT_CODE = 75  # this rank was stopped because another one died or failed (EX_TEMPFAIL: retrying may work)
POLL_S = 1.0
HEARTBEAT_TIMEOUT_S = 30.0
EXCEPTION_GRACE_S = 1.0  # a rank that raises looks this long for a dead peer first (its error may be the death's)
FAILED_EXIT_S = 30.0

_live: "weakref.WeakSet[Liveness]" = weakref.WeakSet()  # this process's rows still running
_hooks_pid = 0  # the process that installed the exit hooks (a forked child installs its own)


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000  # (CLOCK_MONOTONIC: one clock for every process of the host)


def started_us(pid: int) -> int:
    return round(psutil.Process(pid).create_time() * 1e6)


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # (not Linux: no way to tell namespaces apart; heartbeats only)
        return 0


def _process_gone(pid: int, started_us: int) -> bool:
    """Whether the process ``pid`` that started at ``started_us`` has ended (a zombie has; a new process that
    reused the pid is not it)."""
    try:
        p = psutil.Process(pid)
        if abs(round(p.create_time() * 1e6) - started_us) > 1000:
            return True
        return p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


class PeerGone(RuntimeError):
    """Another rank of the host died or failed: this one cannot go on."""


class Liveness:
    """This rank's row of ``cells`` (``local_rank``) and the watch over the others'."""

    def __init__(self, cells: torch.Tensor, local_rank: int, rank: int, *, poll_s: float = POLL_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        if cells.dim() != 2 or cells.dtype != torch.int64 or cells.shape[1] != WORDS \
                or not 0 <= local_rank < cells.shape[0]:
            raise ValueError(f"liveness: need an int64 [ranks, {WORDS}] tensor and a rank in it, got "
                             f"{tuple(cells.shape)} {cells.dtype}, local rank {local_rank}")
        self.cells, self.local_rank, self.rank = cells, local_rank, rank
        self.poll_s, self.heartbeat_timeout_s = poll_s, heartbeat_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A collected Liveness (its engine gone) no longer speaks for this process: its row says done, its watch
        # ends (the thread holds only a weak reference). (Also at interpreter exit: weakref.finalize's atexit.)
        self._finalizer = weakref.finalize(self, _retire, cells, local_rank, self._stop)

    # -- this rank's row ---------------------------------------------------------------------------------------------
    def register(self) -> None:
        """Write this rank's row (before the ranks' barrier: every row is filled once any rank watches)."""
        row = self.cells[self.local_rank]
        row[RANK], row[PID], row[STARTED] = self.rank, os.getpid(), started_us(os.getpid())
        row[PIDNS], row[HEARTBEAT] = pid_namespace(), now_ms()
        row[STATE] = RUNNING  # (last: a reader that sees RUNNING sees the rest; x86 keeps stores in order)
        _live.add(self)
        _install_hooks()

    def start(self) -> None:
        """Watch the other rows on a daemon thread (after every rank registered)."""
        if self._thread is None:
            ref = weakref.ref(self)
            self._thread = threading.Thread(target=_watch, args=(ref, self._stop, self.poll_s),
                                            name="hf_megatrain-liveness", daemon=True)
            self._thread.start()

    @property
    def state(self) -> int:
        return int(self.cells[self.local_rank, STATE])

    @property
    def mine(self) -> bool:
        """Whether this process wrote the row (not a child forked from it, which inherits the hooks)."""
        return int(self.cells[self.local_rank, PID]) == os.getpid()

    def finish(self) -> None:
        """This rank ended normally: the others must not take its exit for a death."""
        self._set(DONE, "", only_from=RUNNING)
        self._stop.set()

    def fail(self, message: str, state: int = FAILED) -> None:
        """This rank failed (``FAILED``) or stops because of another (``STOPPED``), saying why."""
        self._set(state, message, only_from=RUNNING)
        self._stop.set()

    def _set(self, state: int, message: str, only_from: int) -> None:
        row = self.cells[self.local_rank]
        if int(row[STATE]) != only_from or not self.mine:  # (a forked child's exit is not the rank's)
            return
        data = message.encode("utf-8", "replace")[:MESSAGE_BYTES]
        if data:
            row[HEADER:].view(torch.uint8)[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        row[MSGLEN] = len(data)
        row[STATE] = state  # (after the message: a reader that sees the state sees the message)

    # -- the others --------------------------------------------------------------------------------------------------
    def gone(self) -> list[str]:
        """One line per other rank of the host that died or failed (or stopped because of another)."""
        causes, stopped, now, rows = [], [], now_ms(), self.cells.tolist()
        for local, row in enumerate(rows):
            if local == self.local_rank or row[STATE] in (0, DONE):
                continue
            who = f"rank {row[RANK]} (pid {row[PID]})"
            if row[STATE] in (FAILED, STOPPED):
                text = bytes(self.cells[local, HEADER:].view(torch.uint8)[:row[MSGLEN]].tolist()).decode(
                    "utf-8", "replace").removeprefix(PREFIX)
                if row[STATE] == FAILED:
                    causes.append(f"{who} failed: {text}")
                else:
                    stopped.append(f"{who} stopped: {text}")
            elif row[PIDNS] and row[PIDNS] == rows[self.local_rank][PIDNS]:
                if _process_gone(row[PID], row[STARTED]):
                    causes.append(f"{who} died (killed, or it exited without finishing)")
            elif now - row[HEARTBEAT] > self.heartbeat_timeout_s * 1000:
                causes.append(f"{who} stopped answering ({(now - row[HEARTBEAT]) / 1000:.0f} s without a heartbeat)")
        # A rank that failed or died is the cause; one that stopped is its consequence (named when no cause shows).
        return causes or stopped

    def check(self) -> None:
        """Raise ``PeerGone`` naming the ranks gone (PeerCells' waits ask this)."""
        gone = self.gone()
        if gone:
            raise PeerGone(self._message(gone))

    def _message(self, gone: list[str]) -> str:
        return f"{PREFIX}{'; '.join(gone)}; stopping this rank ({self.rank})"

    def _beat(self) -> list[str]:
        self.cells[self.local_rank, HEARTBEAT] = now_ms()
        return self.gone() if self.state == RUNNING else []

    def _stop_process(self, gone: list[str]) -> None:
        message = self._message(gone)
        self.fail(message, STOPPED)
        logger.error(message)
        _flush()
        os._exit(EXIT_CODE)


def _watch(ref: "weakref.ref[Liveness]", stop: threading.Event, poll_s: float) -> None:
    while not stop.wait(poll_s):
        live = ref()
        if live is None:
            return
        gone = live._beat()
        if gone:
            live._stop_process(gone)
        del live


def _retire(cells: torch.Tensor, local_rank: int, stop: threading.Event) -> None:
    stop.set()
    if int(cells[local_rank, STATE]) == RUNNING and int(cells[local_rank, PID]) == os.getpid():
        cells[local_rank, STATE] = DONE


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # (a closed or odd stream must not keep the process alive)
            pass
    for h in list(logging.getLogger().handlers) + list(logger.handlers):
        try:
            h.flush()
        except Exception:
            pass


def finished() -> None:
    """Every row of this process says done: call it before ending a rank with ``os._exit`` (interpreter exit does
    it otherwise), or the other ranks take the exit for a death and stop."""
    for live in list(_live):
        live.finish()


def on_exception(exc_type: type[BaseException], exc: BaseException) -> None:
    """An uncaught exception ends this process: the others hear why (or, if it came from another rank's death,
    that this one stopped because of it)."""
    running = [live for live in list(_live) if live.state == RUNNING and live.mine]
    if not running:
        return
    deadline = time.monotonic() + EXCEPTION_GRACE_S
    while True:  # (a collective that failed because a peer died: the peer's end may show a moment later)
        gone = sorted({line for live in running for line in live.gone()})
        if gone or isinstance(exc, PeerGone) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if isinstance(exc, PeerGone):
        message = str(exc)
    elif gone:
        message = running[0]._message(gone) + f" (this rank raised {exc_type.__name__}: {exc})"
    else:
        message = f"{exc_type.__name__}: {exc}"
    for live in running:
        live.fail(message, STOPPED if gone or isinstance(exc, PeerGone) else FAILED)
    if gone:
        logger.error(message)
    # The exit that follows may hang in a process group's teardown: end it in any case.
    faulthandler.dump_traceback_later(FAILED_EXIT_S, exit=True)


def _install_hooks() -> None:
    global _hooks_pid
    if _hooks_pid == os.getpid():
        return
    _hooks_pid = os.getpid()
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            on_exception(exc_type, exc)
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    atexit.register(finished)
    multiprocessing.util.Finalize(None, finished, exitpriority=100)
