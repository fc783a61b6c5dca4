"""A rank of a data-parallel run killed or failing, under a launcher that leaves the others alone
(tests/test_dp_faults.py).

``launch_plain`` forks the ranks of a gloo group as a plain process per rank would start them (torch.distributed's
env:// rendezvous: MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE), each with its own log (stdout and stderr) and no
handler on the root logger, as a fresh interpreter has; unlike torchrun's agent (or tests/save_workers.py's
``launch``) it does not end the other ranks when one dies: only the ranks' own liveness watch
(hf_megatrain/parallel/liveness.py) can. A rank's exit is emulated as an interpreter's: a normal return runs the
exit hooks' ``finished()``, an exception goes to ``sys.excepthook`` first.

``trainer_fault_worker`` is one rank of a ``MegaTrainTrainer`` run in which the victim rank, at a Trainer callback
of step ``step``, SIGKILLs itself (``kill``) or raises a simulated out-of-memory error (``oom``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable

import torch

from . import save_workers as S


def launch_plain(fn: Callable[..., None], world: int, logs: str, *args: object,
                 timeout: float = 240.0) -> tuple[list[int], list[float], list[int]]:
    """Run ``fn(rank, world, *args)`` in ``world`` forked processes, each logging to ``logs/rank<r>.log``. Returns
    their exit codes (-9: still running at ``timeout``, then killed), when each ended (``time.monotonic()``) and
    their pids."""
    os.makedirs(logs, exist_ok=True)
    port = S._free_port()
    pids = []
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = os.open(os.path.join(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                for h in list(logging.root.handlers):  # (pytest's capture handlers: a fresh interpreter has none)
                    logging.root.removeHandler(h)
                logging.root.setLevel(logging.WARNING)
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                  WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
                torch.set_num_threads(1)
                from accelerate.state import AcceleratorState
                AcceleratorState._reset_state(reset_partial_state=True)
                fn(rank, world, *args)
                from hf_megatrain.parallel import liveness
                liveness.finished()  # (what the interpreter's exit hooks do; os._exit below skips them)
                code = 0
            except BaseException:
                sys.excepthook(*sys.exc_info())  # (what the interpreter does with an uncaught exception)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < world:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid], ended[pid] = os.waitstatus_to_exitcode(status), time.monotonic()
        if len(codes) < world and time.monotonic() > deadline:
            for pid in pids:  # a hang: what the liveness watch is there to prevent
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid], ended[pid] = -9, time.monotonic()
        time.sleep(0.01)
    return [codes[p] for p in pids], [ended[p] for p in pids], pids


def trainer_fault_worker(rank: int, world: int, out: str, shm: str, victim: int, fault: str, when: str,
                         step: int, blocked: bool = False) -> None:
    """One rank of a 2-process ``MegaTrainTrainer`` run (6 steps); rank ``victim`` meets ``fault`` (``kill``:
    SIGKILL; ``oom``: a ``torch.cuda.OutOfMemoryError``) at the callback ``when`` (``on_step_begin``: before the
    step's forward, its last shard updates possibly unfinished; ``on_pre_optimizer_step``: between the backward
    and the step) of step ``step`` (1-based). ``blocked``: the other ranks then block there for 10 minutes (the
    main thread in a call that never returns, as in an NCCL collective with a dead peer: gloo's would fail)."""
    from transformers import TrainerCallback

    from hf_megatrain import MegaTrainTrainer
    from tests.models import tiny
    from tests.test_trainer import dataset, mt_args

    def strike(state) -> None:
        if rank != victim and blocked and state.global_step + 1 == step:
            time.sleep(600)
        if rank == victim and state.global_step + 1 == step:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated by the test)")

    class Fault(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if when == "on_step_begin":
                strike(state)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if when == "on_pre_optimizer_step":
                strike(state)

    args = mt_args(out, config=dict(compute_dtype="float32", shared_memory_dir=shm), max_steps=6,
                   per_device_train_batch_size=4 // world, ddp_backend="gloo", ddp_timeout=600,
                   save_strategy="no", max_grad_norm=0.5)
    trainer = MegaTrainTrainer(model=tiny("llama"), args=args, train_dataset=dataset(), callbacks=[Fault()])
    trainer.train()
