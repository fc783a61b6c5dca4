"""Faults of data-parallel ranks (issue 45, part 5): a rank killed mid-step or mid-save, or failing, ends every
other rank of the host within seconds, naming it, whatever launched them; the last complete checkpoint stays and
resumes; nothing stays in shared memory.

The process tests fork the ranks with ``fault_workers.launch_plain``, which, unlike torchrun's agent, leaves the
other ranks alone: only the ranks' liveness watch (hf_megatrain/parallel/liveness.py) ends them. The unit tests
drive ``Liveness`` and ``PeerCells`` in this process over rows whose processes are real (a child that ends).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import psutil
import pytest
import torch

from hf_megatrain.parallel import liveness as L
from hf_megatrain.parallel.peer_cells import PeerCells

from . import fault_workers as F
from . import save_workers as S

WITHIN_S = 60.0  # every other rank ends this soon after the faulty one (the acceptance)


# -- in this process -------------------------------------------------------------------------------------------------
def _row(cells: torch.Tensor, local: int, rank: int, pid: int, state: int = L.RUNNING) -> None:
    """What ``register`` writes, for another process ``pid``."""
    cells[local, L.RANK], cells[local, L.PID] = rank, pid
    cells[local, L.STARTED] = L.started_us(pid)
    cells[local, L.PIDNS], cells[local, L.HEARTBEAT] = L.pid_namespace(), L.now_ms()
    cells[local, L.STATE] = state


@pytest.fixture
def child():
    """A live child process: another rank's pid."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def _me(cells: torch.Tensor) -> L.Liveness:
    live = L.Liveness(cells, 0, 0)
    live.register()
    return live


def test_a_dead_peer_is_named_and_a_finished_one_is_not(child):
    cells = torch.zeros(3, L.WORDS, dtype=torch.int64)
    me = _me(cells)
    _row(cells, 1, 1, child.pid)
    _row(cells, 2, 2, os.getpid())  # (a live one)
    assert me.gone() == []
    child.kill()
    child.wait()
    gone = me.gone()
    assert gone == [f"rank 1 (pid {child.pid}) died (killed, or it exited without finishing)"], gone
    with pytest.raises(L.PeerGone, match=rf"rank 1 \(pid {child.pid}\) died.*stopping this rank \(0\)"):
        me.check()
    cells[1, L.STATE] = L.DONE  # (it ended normally: not a death)
    assert me.gone() == []
    me.finish()
    assert me.state == L.DONE


def test_a_zombie_is_dead_and_a_reused_pid_is_not_the_peer(child):
    cells = torch.zeros(2, L.WORDS, dtype=torch.int64)
    me = _me(cells)
    _row(cells, 1, 1, child.pid)
    os.kill(child.pid, 9)
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # (not reaped yet: what a launcher may leave)
        time.sleep(0.01)
    assert "died" in me.gone()[0]
    _row(cells, 1, 1, os.getpid())
    cells[1, L.STARTED] -= 10 ** 6  # (the pid now names another process than the one registered)
    assert "died" in me.gone()[0]


def test_a_failed_peer_is_named_with_its_error():
    cells = torch.zeros(3, L.WORDS, dtype=torch.int64)
    me = _me(cells)
    for local in (1, 2):
        _row(cells, local, local, os.getpid())  # (a row is written by its own process: here, this one)
    L.Liveness(cells, 2, 2).fail(L.PREFIX + "rank 1 (pid 7) failed: ...; stopping this rank (2)", L.STOPPED)
    assert me.gone() == ["rank 2 (pid %d) stopped: rank 1 (pid 7) failed: ...; stopping this rank (2)" % os.getpid()]
    L.Liveness(cells, 1, 1).fail("OutOfMemoryError: CUDA out of memory. " + "x" * 5000)  # (cut to the row)
    gone = me.gone()  # (the cause alone: rank 2 stopped because of it)
    assert len(gone) == 1 and gone[0].startswith(f"rank 1 (pid {os.getpid()}) failed: OutOfMemoryError: CUDA out "
                                                 "of memory. xx")
    assert len(gone[0]) < L.MESSAGE_BYTES + 100


def test_a_forked_child_ending_does_not_speak_for_the_rank():
    """A process forked by a rank (a DataLoader worker, a user's fork) inherits the hooks and the shared row: its
    normal exit or its exception must not mark the rank done or failed."""
    cells = torch.zeros(2, L.WORDS, dtype=torch.int64).share_memory_()
    me = _me(cells)
    pid = os.fork()
    if pid == 0:
        L.finished()
        L.on_exception(ValueError, ValueError("in the child"))
        os._exit(0)
    os.waitpid(pid, 0)
    assert me.state == L.RUNNING
    me.finish()


def test_a_peer_in_another_pid_namespace_is_judged_by_its_heartbeat():
    cells = torch.zeros(2, L.WORDS, dtype=torch.int64)
    me = _me(cells)
    cells[1, L.RANK], cells[1, L.PID], cells[1, L.PIDNS] = 1, 4_000_001, cells[0, L.PIDNS] + 1  # (means nothing here)
    cells[1, L.HEARTBEAT], cells[1, L.STATE] = L.now_ms(), L.RUNNING
    assert me.gone() == []  # (its heartbeat is fresh)
    cells[1, L.HEARTBEAT] -= int(L.HEARTBEAT_TIMEOUT_S * 1000) + 5000
    assert "stopped answering" in me.gone()[0]


def test_peer_cells_wait_fails_fast_naming_the_dead_rank(child):
    cells = torch.zeros(2, L.WORDS, dtype=torch.int64)
    me = _me(cells)
    _row(cells, 1, 1, child.pid)
    peers = PeerCells(torch.zeros(2, 3, dtype=torch.int64), 0, liveness=me)
    peers.publish(1, 1)  # (this rank's update 1 of unit 1; rank 1 never writes its shard of it)
    child.kill()
    child.wait()
    t0 = time.monotonic()
    with pytest.raises(L.PeerGone, match=r"rank 1 \(pid \d+\) died"):
        peers.wait(1, 1)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow  # starts an interpreter
def test_the_watch_ends_the_process_naming_the_dead_peer():
    """The watch thread of a process whose peer died logs the peer and exits with ``EXIT_CODE`` on its own, while
    the main thread is blocked (here in a sleep; in a run, an NCCL or gloo call)."""
    code = ("import os, subprocess, sys, time, torch\n"
            "from hf_megatrain.parallel import liveness as L\n"
            "cells = torch.zeros(2, L.WORDS, dtype=torch.int64)\n"
            "p = subprocess.Popen(['sleep', '60'])\n"
            "cells[1, L.RANK], cells[1, L.PID], cells[1, L.STARTED] = 1, p.pid, L.started_us(p.pid)\n"
            "cells[1, L.PIDNS], cells[1, L.STATE] = L.pid_namespace(), L.RUNNING\n"
            "me = L.Liveness(cells, 0, 0, poll_s=0.1); me.register(); me.start()\n"
            "print(time.monotonic(), flush=True); p.kill(); p.wait(); time.sleep(100); sys.exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == L.EXIT_CODE, r.stderr
    assert re.search(r"hf_megatrain data parallel: rank 1 \(pid \d+\) died .*; stopping this rank \(0\)", r.stderr)
    assert time.monotonic() - float(r.stdout.split()[0]) < 30


# -- processes -------------------------------------------------------------------------------------------------------
def _no_shared_memory_left(shm: str, pids: list[int]) -> None:
    assert os.listdir(shm) == [], os.listdir(shm)  # (the run directory: removed once mapped, even on a fault)
    if os.path.isdir("/dev/shm"):
        mine = [f for f in os.listdir("/dev/shm") if any(re.search(rf"(^|\D){p}(\D|$)", f) for p in pids)]
        assert mine == [], mine


def _survivors_named_the_victim(logs: str, codes: list[int], ended: list[float], victim: int, pid: int,
                                verb: str) -> None:
    for rank, code in enumerate(codes):
        if rank == victim:
            continue
        log = open(os.path.join(logs, f"rank{rank}.log")).read()
        assert code not in (0, -9), (rank, code, log[-3000:])  # (-9: still running after the launcher's timeout)
        assert ended[rank] - ended[victim] < WITHIN_S, (rank, ended[rank] - ended[victim])
        assert re.search(rf"hf_megatrain data parallel: rank {victim} \(pid {pid}\) {verb}", log), log[-3000:]


@pytest.mark.slow  # forks 2 processes
@pytest.mark.parametrize("when, blocked", [("on_step_begin", False), ("on_pre_optimizer_step", True)])
def test_a_rank_killed_mid_step_ends_the_others(tmp_path, when, blocked):
    """Rank 1 SIGKILLed before step 3's forward (rank 0's next gloo call fails: its error names rank 1), or
    between its backward and its step while rank 0 is blocked in a call that never returns (an NCCL collective's
    case: the watch thread ends rank 0)."""
    shm, logs = str(tmp_path / "shm"), str(tmp_path / "logs")
    os.makedirs(shm)
    codes, ended, pids = F.launch_plain(F.trainer_fault_worker, 2, logs, str(tmp_path / "out"), shm, 1, "kill",
                                        when, 3, blocked)
    assert codes[1] == -9, codes  # (SIGKILL)
    _survivors_named_the_victim(logs, codes, ended, 1, pids[1], "died")
    if blocked:
        assert codes[0] == L.EXIT_CODE, codes
    _no_shared_memory_left(shm, pids)


@pytest.mark.slow  # forks 2 processes
def test_a_rank_out_of_memory_ends_the_others_naming_it_and_its_error(tmp_path):
    shm, logs = str(tmp_path / "shm"), str(tmp_path / "logs")
    os.makedirs(shm)
    codes, ended, pids = F.launch_plain(F.trainer_fault_worker, 2, logs, str(tmp_path / "out"), shm, 1, "oom",
                                        "on_pre_optimizer_step", 3)
    victim_log = open(os.path.join(logs, "rank1.log")).read()
    assert codes[1] == 1 and "OutOfMemoryError" in victim_log, (codes, victim_log[-3000:])
    _survivors_named_the_victim(logs, codes, ended, 1, pids[1], "failed: OutOfMemoryError: CUDA out of memory")
    _no_shared_memory_left(shm, pids)


@pytest.mark.slow  # forks 2 processes, 3 times
def test_a_rank_killed_mid_save_keeps_the_last_checkpoint_and_resumes(tmp_path):
    """Rank 0, the process that writes, dies in the middle of writing checkpoint-4 (before its 3rd filesystem
    mutation of the save); rank 1, waiting in the save's barrier (for up to a week), ends naming it; checkpoint-2
    verifies and holds what it held; 2 processes resume from it and finish."""
    from .test_crash_safe_saves import folder_tensors, recovered_checkpoints, same

    shm, logs, res = str(tmp_path / "shm"), str(tmp_path / "logs"), str(tmp_path / "res")
    os.makedirs(shm)
    run = str(tmp_path / "run")
    assert S.launch(S.trainer_worker, 2, run, shm, res, 2, False, 0, -1, False, 0.0, None) == [0, 0]
    before = folder_tensors(os.path.join(run, "checkpoint-2"))
    codes, ended, pids = F.launch_plain(S.trainer_worker, 2, logs, run, shm, res, 4, True, 4, 3, False, 0.0, None)
    assert codes[0] == S.KILLED, codes
    _survivors_named_the_victim(logs, codes, ended, 0, pids[0], "died")
    _no_shared_memory_left(shm, pids)
    got = recovered_checkpoints(run)
    assert "checkpoint-2" in got and same(got["checkpoint-2"], before), sorted(got)
    shutil.rmtree(res, ignore_errors=True)
    codes, _, _ = F.launch_plain(S.trainer_worker, 2, logs + "_resumed", run, shm, res, 4, True, 0, -1, False, 0.0,
                                 None)
    assert codes == [0, 0], codes
    assert sorted(recovered_checkpoints(run)) == ["checkpoint-2", "checkpoint-4"]
