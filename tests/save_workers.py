"""Data-parallel saves killed at a filesystem mutation (tests/test_multiprocess_saves.py).

``launch`` forks the ranks of a gloo group from the test process, which has imported torch / transformers /
hf_megatrain already: a fork starts in milliseconds where a spawned interpreter spends seconds importing, and the
fault-injection test launches a group per kill point. Each child runs with one intra-op thread (no OpenMP team is
inherited across the fork) and a fresh accelerate state (the test process may hold a single-process one).

``trainer_worker`` is one rank of a ``MegaTrainTrainer`` run that saves Trainer checkpoints (``save_steps=2``,
``save_total_limit=1``: the save at step 4 rotates checkpoint-2 away) and exports with ``save_model``. Rank 0, the
process that writes, can be armed at the end of a step to die (``os._exit(9)``) just before its k-th filesystem
mutation, counted with the audit hook of tests/test_crash_safe_saves.py (filesystem calls, not file names); when a
rank dies, ``launch`` kills the others, as torchrun's agent does.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from typing import Callable

import torch

KILLED = 9  # the exit code of a rank killed by its audit hook


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable[..., None], world: int, *args: object, timeout: float = 120.0) -> list[int]:
    """Run ``fn(rank, world, *args)`` in ``world`` forked processes (torch.distributed env:// rendezvous on a free
    port); returns their exit codes (0: done, 9: killed at a mutation, 3: raised, -9: killed by this function once
    another rank had failed, or on ``timeout``)."""
    port = _free_port()
    pids = []
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                  WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
                torch.set_num_threads(1)
                sys.dont_write_bytecode = True  # (a .pyc write would be a mutation that happens once)
                from accelerate.state import AcceleratorState
                AcceleratorState._reset_state(reset_partial_state=True)
                fn(rank, world, *args)
                from hf_megatrain.parallel import liveness
                liveness.finished()  # (os._exit skips the exit hooks that say so: the others would stop)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < world:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) < world and (any(c != 0 for c in codes.values()) or time.monotonic() > deadline):
            for pid in pids:  # a rank died (or the group hangs): the others go too
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -9
        time.sleep(0.01)
    return [codes[p] for p in pids]


def trainer_worker(rank: int, world: int, out: str, shm: str, results: str, max_steps: int,
                   resume: bool, kill_step: int = 0, kill_at: int = -1, export: bool = True,
                   dropout: float = 0.0, keep: int | None = 1) -> None:
    """One rank of a MegaTrainTrainer run in ``out`` (``resume``: from its last checkpoint) to ``max_steps``,
    then (``export``) ``save_model(out/final)``. Rank 0 writes its final FP32 masters to ``results/weights.pt``
    and, when armed (``kill_at >= 0`` at the end of step ``kill_step``), its mutation count to ``results/count``;
    ``kill_at = k > 0`` kills it just before its k-th mutation. ``dropout``: the model's attention dropout (each
    rank draws its own masks from its own RNG, which a resume must restore); ``keep``: ``save_total_limit``."""
    from transformers import TrainerCallback

    from hf_megatrain import MegaTrainTrainer
    from tests.models import tiny
    from tests.test_crash_safe_saves import is_mutation
    from tests.test_trainer import dataset, mt_args

    count, armed = [0], [False]

    def hook(event: str, hook_args: tuple) -> None:
        if armed[0] and is_mutation(event, hook_args):
            count[0] += 1
            if count[0] == kill_at:
                os._exit(KILLED)

    class Arm(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # (the step's save follows)
            if rank == 0 and kill_at >= 0 and state.global_step == kill_step and not armed[0]:
                sys.addaudithook(hook)
                armed[0] = True

    args = mt_args(out, config=dict(compute_dtype="float32", shared_memory_dir=shm), max_steps=max_steps,
                   per_device_train_batch_size=4 // world, ddp_backend="gloo", ddp_timeout=60,
                   save_strategy="steps", save_steps=2, save_total_limit=keep, max_grad_norm=0.5)
    trainer = MegaTrainTrainer(model=tiny("llama", attention_dropout=dropout), args=args, train_dataset=dataset(), callbacks=[Arm()])
    trainer.train(resume_from_checkpoint=resume or None)
    if export:
        trainer.save_model(os.path.join(out, "final"))
    trainer.accelerator.wait_for_everyone()
    armed[0] = False
    if rank == 0:
        os.makedirs(results, exist_ok=True)
        torch.save({n: t.clone() for n, t in trainer.engine.named_master_tensors()},
                   os.path.join(results, "weights.pt"))
        with open(os.path.join(results, "count"), "w") as f:
            f.write(str(count[0]))


def refused_resume_worker(rank: int, world: int, out: str, shm: str, results: str) -> None:
    """Resume ``out``'s last checkpoint; the ``CheckpointError`` this rank raises goes to ``results/error_<rank>``."""
    from hf_megatrain.checkpoint import CheckpointError

    try:
        trainer_worker(rank, world, out, shm, results, 4, True, export=False)
    except CheckpointError as e:
        with open(os.path.join(results, f"error_{rank}"), "w") as f:
            f.write(str(e))
