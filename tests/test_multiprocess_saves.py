"""The multi-process save killed at every filesystem mutation (issue 29's acceptance, data parallel).

Two data-parallel ranks of one host (gloo, CPU) run ``MegaTrainTrainer``: resumed from checkpoint-2, they train to
step 4, save checkpoint-4 (``save_total_limit=1`` rotates checkpoint-2 away) and export with ``save_model`` over
an earlier export. Rank 0, the process that writes, is killed just before its k-th filesystem mutation counted
from the end of step 4 (audit events of tests/test_crash_safe_saves.py: filesystem calls, not file names), for
k = 1, 2, ... until the run completes; the other rank is killed with it. After each kill:

- every ``checkpoint-N`` (after the recovery the next run does) verifies and holds, tensor by tensor, the
  uninterrupted run's checkpoint of that step, and at least one is there;
- the export loads in plain ``from_pretrained`` as the old or the new model entirely;
- resuming the killed folder with 2 processes ends with the uninterrupted run's FP32 masters, bitwise (run once
  for each distinct state the kills leave: the same leftovers resume the same way).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from hf_megatrain import checkpoint as ckpt

from . import save_workers as S
from .test_crash_safe_saves import folder_tensors, hf_load, recovered_checkpoints, same

WORLD = 2


def _run(out: str, shm: str, results: str, max_steps: int, resume: bool, kill_at: int = -1,
         export: bool = True, dropout: float = 0.0, keep: int | None = 1) -> list[int]:
    shutil.rmtree(results, ignore_errors=True)
    return S.launch(S.trainer_worker, WORLD, out, shm, results, max_steps, resume, 4, kill_at, export, dropout,
                    keep)


def _state(path: str) -> tuple:
    """What a kill left, up to pids and random suffixes: entries, and which copies are complete."""
    out = []
    for f in sorted(os.listdir(path)):
        p = os.path.join(path, f)
        name = re.sub(r"-\d+-[A-Za-z0-9_]+$", "-*", f)
        complete = any(os.path.isfile(os.path.join(q, ckpt.MANIFEST)) for q in (p, os.path.join(p, "x")))
        out.append((name, complete, tuple(sorted(os.listdir(p))) if f == "final" else ()))
    return tuple(sorted(out))


@pytest.mark.slow  # forks 2 processes per kill point (~2-3 minutes on 2 cores)
def test_data_parallel_save_killed_at_every_mutation(tmp_path):
    shm, res = str(tmp_path / "shm"), str(tmp_path / "res")
    os.makedirs(shm)
    template, ref = str(tmp_path / "template"), str(tmp_path / "ref")
    assert _run(template, shm, res, max_steps=2, resume=False) == [0, 0]  # checkpoint-2 and the old export
    shutil.copytree(template, ref)
    assert _run(ref, shm, res, max_steps=4, resume=True, kill_at=0) == [0, 0]  # uninterrupted; counts mutations
    n = int(open(os.path.join(res, "count")).read())
    final = torch.load(os.path.join(res, "weights.pt"))
    natural = {**recovered_checkpoints(template), **recovered_checkpoints(ref)}
    assert sorted(natural) == ["checkpoint-2", "checkpoint-4"]
    old_export, new_export = hf_load(os.path.join(template, "final")), hf_load(os.path.join(ref, "final"))
    assert not same(old_export, new_export)
    assert n >= 20, n  # (the checkpoint's files, the rotation and the export)

    work, killed = str(tmp_path / "work"), str(tmp_path / "killed")
    seen_exports, seen_checkpoints, resumed = set(), set(), {}
    for k in range(1, n + 2):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(template, work)
        codes = _run(work, shm, res, max_steps=4, resume=True, kill_at=k)
        assert codes[0] == (S.KILLED if k <= n else 0), (k, codes)
        shutil.rmtree(killed, ignore_errors=True)
        shutil.copytree(work, killed)  # (as the kill left it, for the resume below)

        got = recovered_checkpoints(work)
        assert got, f"kill before mutation {k}: no checkpoint left"
        for name, tensors in got.items():
            assert same(tensors, natural[name]), f"kill before mutation {k}: {name} is not the saved state"
        seen_checkpoints.add(tuple(sorted(got)))
        export = hf_load(os.path.join(work, "final"))
        which = "old" if same(export, old_export) else "new" if same(export, new_export) else None
        assert which is not None, f"kill before mutation {k}: from_pretrained loaded a mix of two exports"
        seen_exports.add(which)

        state = _state(killed)
        if state not in resumed:  # resume the folder as the kill left it, with 2 processes
            codes = _run(killed, shm, res, max_steps=4, resume=True, export=False)
            assert codes == [0, 0], f"kill before mutation {k}: resuming failed ({codes})"
            got = torch.load(os.path.join(res, "weights.pt"))
            for name, t in final.items():
                assert torch.equal(got[name], t), f"kill before mutation {k}: resumed {name} differs"
            resumed[state] = k
    assert seen_exports == {"old", "new"}
    assert {("checkpoint-2",), ("checkpoint-2", "checkpoint-4"), ("checkpoint-4",)} <= seen_checkpoints
    assert len(resumed) >= 5, resumed
    assert same(folder_tensors(os.path.join(work, "checkpoint-4")), natural["checkpoint-4"])


@pytest.mark.slow  # forks 2 processes, 3 times
def test_data_parallel_resume_restores_every_ranks_rng(tmp_path):
    """Attention dropout draws each rank's masks from its own RNG: a checkpoint holds every rank's RNG state
    (``rng_state_<rank>.pth``, as plain Trainer writes them) and a 2-process resume ends bitwise where the
    uninterrupted run ends."""
    shm, res = str(tmp_path / "shm"), str(tmp_path / "res")
    os.makedirs(shm)
    run, again = str(tmp_path / "run"), str(tmp_path / "again")
    assert _run(run, shm, res, max_steps=4, resume=False, export=False, dropout=0.3, keep=None) == [0, 0]
    final = torch.load(os.path.join(res, "weights.pt"))
    assert {f"rng_state_{r}.pth" for r in range(WORLD)} <= set(os.listdir(os.path.join(run, "checkpoint-2")))
    shutil.copytree(os.path.join(run, "checkpoint-2"), os.path.join(again, "checkpoint-2"))
    assert _run(again, shm, res, max_steps=4, resume=True, export=False, dropout=0.3) == [0, 0]
    got = torch.load(os.path.join(res, "weights.pt"))
    for name, t in final.items():
        assert torch.equal(got[name], t), f"resumed {name} differs from the uninterrupted run"


@pytest.mark.slow  # forks 2 processes, twice
def test_data_parallel_resume_of_a_corrupt_checkpoint_is_refused_on_every_rank(tmp_path):
    """The main process verifies the checkpoint (one reader of every byte per host) and every rank raises its
    verdict: none loads, none waits for the others forever."""
    shm, res, run = str(tmp_path / "shm"), str(tmp_path / "res"), str(tmp_path / "run")
    os.makedirs(shm)
    assert _run(run, shm, res, max_steps=2, resume=False, export=False) == [0, 0]
    path = os.path.join(run, "checkpoint-2", ckpt.OPTIMIZER_TENSORS)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 1
    open(path, "wb").write(bytes(data))
    shutil.rmtree(res)
    os.makedirs(res)
    assert S.launch(S.refused_resume_worker, WORLD, run, shm, res) == [0, 0]
    for rank in range(WORLD):
        error = open(os.path.join(res, f"error_{rank}")).read()
        assert ckpt.OPTIMIZER_TENSORS in error and "corrupt" in error, (rank, error)
