"""Refuse a run whose checkpoints cannot fit its output folder's disk, before the first step, not at the first save.

A full-state checkpoint is 16 bytes per trainable parameter (FP32 export or master + AdamW m, v): a 32B model's is
~393 GB, more than the 235 GiB disk of the machine it trains on. Without this check the run trains for hours and
fails when the first ``save_steps`` checkpoint is written (the writer refuses a save that does not fit before
writing a byte: checkpoint/staged.py ``check_free_space``, so no half-written folder, but the run is lost).

At ``on_train_begin`` (the model built, a resume loaded, ``max_steps`` known) the processes that save compare the
free space of the output folder with the bytes its checkpoints will hold at once (checkpoint/space.py: one
checkpoint's bytes x the checkpoints ``save_total_limit`` or the planned saves keep at the same time, the folder's
existing checkpoints counted); every rank learns every verdict (``all_gather_object``), so all refuse together.
``megatrain_skip_disk_check=True`` starts anyway (a user who frees space as the run goes).
"""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback

from ..checkpoint.space import checkpoints_at_once, existing_checkpoints, free_bytes
from ..core.memory import format_bytes
from ..export.weights import checkpoint_bytes

__all__ = ["CheckpointSpaceCheck", "planned_saves", "space_error"]


def _strategy(args: Any) -> str:
    return str(getattr(args.save_strategy, "value", args.save_strategy))


def planned_saves(args: Any, state: Any) -> int | None:
    """Checkpoints this run writes from ``state.global_step`` on (Trainer's DefaultFlowCallback: every
    ``save_steps`` steps and at ``max_steps``; or once an epoch); None when unknown (``save_strategy="best"``)."""
    strategy = _strategy(args)
    if strategy == "steps":
        every, end, start = max(int(state.save_steps or 1), 1), state.max_steps, state.global_step
        return max(end // every - start // every + (1 if end % every else 0), 0) if end > start else 0
    if strategy == "epoch":
        return max(math.ceil(state.num_train_epochs) - math.floor(state.epoch or 0), 0)
    return None


def space_error(trainer: Any, args: Any, state: Any) -> str | None:
    """Why this process's checkpoints do not fit its output folder, in words with what to change; None if they
    fit (or this run saves nothing more)."""
    run_dir = trainer._get_output_dir(trial=getattr(trainer, "_trial", None))
    ck = checkpoint_bytes(trainer.engine)
    one = ck.saved(args.save_only_model)
    saves = planned_saves(args, state)
    existing = existing_checkpoints(run_dir)
    limit = args.save_total_limit if args.save_total_limit and args.save_total_limit > 0 else None
    count = checkpoints_at_once(limit, saves, existing, keep_best=args.metric_for_best_model is not None)
    need, free = count * one, free_bytes(run_dir)
    if need <= free:
        return None
    what = ("the model export alone (save_only_model=True)" if args.save_only_model else
            f"export in {trainer.engine.config.save_dtype} {format_bytes(ck.export)}"
            + (f" + FP32 master {format_bytes(ck.master)}" if ck.master else "")
            + f" + AdamW moments {format_bytes(ck.moments)}")
    if limit is not None:
        why = (f"save_total_limit={limit}: a new checkpoint is written before the oldest is removed, so {count} "
               f"new ones coexist ({existing} already in the folder)")
    elif saves is None:
        why = "at least one checkpoint"
    else:
        why = f"no save_total_limit: all {saves} checkpoints this run writes (save_strategy={_strategy(args)!r}) stay"
    fixes = ["free space on that disk", "set output_dir to a disk with more free space"]
    if limit is None or limit > 1:
        fixes.append("set save_total_limit=1 (two checkpoints at once while the new one is written)")
    if not args.save_only_model:
        fixes.append(f"set save_only_model=True ({format_bytes(ck.export)} a checkpoint: the weights only, no "
                     "exact resume)")
    if _strategy(args) == "steps":
        fixes.append("save less often (save_steps)")
    return (f"hf_megatrain: this run's checkpoints do not fit {run_dir}: {format_bytes(need)} needed, "
            f"{format_bytes(free)} free on its disk ({need:,} > {free:,} bytes). One checkpoint is "
            f"{format_bytes(one)} ({what}); {why}: {count} x {format_bytes(one)}. Refused before the first step, "
            "not at a save hours in. To train: " + "; or ".join(fixes) + "; or pass megatrain_skip_disk_check=True "
            "to start anyway (a save that does not fit then fails without writing, the earlier checkpoints intact).")


class CheckpointSpaceCheck(TrainerCallback):
    """The check at the start of training (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        engine = self.trainer.engine
        if engine is None or _strategy(args) == "no" or args.megatrain_skip_disk_check:
            return
        mine = space_error(self.trainer, args, state) if args.should_save else None
        errors = [e for e in engine.ranks.all_gather_object(mine) if e]
        if errors:
            raise ValueError(errors[0])
