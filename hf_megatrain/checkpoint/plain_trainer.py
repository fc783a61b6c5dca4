"""Checkpoints across trainers: plain ``transformers.Trainer``'s ``optimizer.pt`` into the host AdamW state, exactly,
and a note in every hf_megatrain checkpoint for plain Trainer users (``RESUME_NOTE``).

A user who switches mid-run from plain Trainer to hf_megatrain resumes from a ``checkpoint-N`` that holds the model
weights, ``scheduler.pt`` and ``optimizer.pt``: ``torch.optim.AdamW.state_dict()``, whose per-parameter state is
keyed by position. Trainer builds its optimizer from two groups, in ``model.named_parameters()`` order: the
trainable parameters that decay, then those that do not (``Trainer.get_decay_parameter_names``). The converted
model presents the original ``named_parameters`` order (``engine/model_view.py``) and the store knows each parameter's
decay flag, so the positions map to names; every count, shape and group is checked before anything is written, and a
mismatch (another optimizer, a grouping of the user's own) is refused with a message rather than loaded into the wrong
parameters. ``torch.load(weights_only=True)``: tensors and plain containers only, no code runs.

The AdamW step count is per parameter in torch and per unit (plus per-parameter missed steps) here: a unit's count is
its parameters' largest, and each parameter's difference is recorded as missed steps, as for a parameter that had no
gradient in some steps.

The other way has no such route: plain Trainer resumes only from ``optimizer.pt`` and silently starts AdamW (and its
schedule) fresh without it, and writing one would double the checkpoint's optimizer bytes. So every hf_megatrain
checkpoint carries ``RESUME_NOTE`` (a short markdown file a user listing the folder sees) saying how to resume it.
"""

from __future__ import annotations

import os
from typing import Iterator, Mapping

import torch

from ..core.engine_view import EngineView
from .names import CheckpointError

OPTIMIZER_NAME = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME (checkpoint/ does not import transformers)

RESUME_NOTE = "MEGATRAIN_CHECKPOINT.md"

__all__ = ["OPTIMIZER_NAME", "RESUME_NOTE", "has_torch_optimizer", "load_torch_adamw", "write_resume_note"]

_NOTE = """# hf_megatrain checkpoint

This folder was written by hf_megatrain's `MegaTrainTrainer`. The model weights are standard (`from_pretrained`
loads them), but the optimizer state is in `megatrain_optimizer.safetensors` / `megatrain_optimizer.json` (FP32 AdamW
moments per streamed unit), not in `optimizer.pt`.

- Resume training with `MegaTrainTrainer(...).train(resume_from_checkpoint=...)`: exact (weights, AdamW, schedule,
  RNG).
- Plain `transformers.Trainer` resuming from this folder finds no `optimizer.pt` and **restarts AdamW and the
  learning-rate schedule without a warning**. To continue with plain Trainer, start a new run from the weights
  (`from_pretrained` this folder) and expect a fresh optimizer.
"""


def write_resume_note(folder: str) -> str:
    """Write ``RESUME_NOTE`` into checkpoint ``folder``; returns its name (a file of the checkpoint's manifest)."""
    with open(os.path.join(folder, RESUME_NOTE), "w") as f:
        f.write(_NOTE)
    return RESUME_NOTE


def has_torch_optimizer(path: str) -> bool:
    return os.path.isfile(os.path.join(path, OPTIMIZER_NAME))


def _trainer_order(engine: EngineView) -> list[str]:
    """Parameter names in the order plain Trainer's AdamW numbered them: decayed trainable ones, then the rest."""
    names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    decay = [n for n in names if engine.store.by_name[n][1].decay]
    return decay + [n for n in names if not engine.store.by_name[n][1].decay]


def load_torch_adamw(engine: EngineView, path: str) -> None:
    """Load ``path/optimizer.pt`` (plain Trainer's ``torch.optim.AdamW``) into ``engine.optimizer``'s state."""
    file = os.path.join(path, OPTIMIZER_NAME)
    opt = engine.optimizer
    if opt is None:
        raise RuntimeError("load_torch_adamw needs the engine's optimizer: call engine.create_optimizer() first")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
        groups, state = saved["param_groups"], saved["state"]
    except Exception as e:  # (a corrupt file, another format)
        raise CheckpointError(f"{file} is not a torch optimizer state_dict ({type(e).__name__}: {e})") from e
    order = _trainer_order(engine)
    ndecay = sum(1 for n in order if engine.store.by_name[n][1].decay)
    sizes = [len(g["params"]) for g in groups]
    expected = [ndecay, len(order) - ndecay]
    if sizes != expected and [s for s in sizes if s] != [s for s in expected if s]:
        raise CheckpointError(
            f"{file} holds {len(groups)} parameter groups of {sizes} parameters; plain Trainer's AdamW for this model "
            f"has {expected} (decayed, not decayed trainable parameters). It was written by another optimizer or "
            "parameter grouping: resume with plain Trainer, or remove optimizer.pt to start AdamW fresh (weights and "
            "schedule still resume).")
    for g in groups:
        if any(k in g and g[k] for k in ("amsgrad", "maximize", "capturable_amsgrad")):
            raise CheckpointError(f"{file}: AdamW with amsgrad/maximize is not what hf_megatrain runs; remove "
                                  "optimizer.pt to start AdamW fresh")
    position = [i for g in groups for i in g["params"]]
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for pos, name in zip(position, order):
        s = state.get(pos, state.get(str(pos)))
        if s is None:
            continue  # never had a gradient: step 0, zero moments (as torch would start it)
        shape = engine.store.by_name[name][1].shape
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in s or tuple(s[key].shape) != tuple(shape):
                got = tuple(s[key].shape) if key in s else "missing"
                raise CheckpointError(f"{file}: state {pos} ({name}) {key} is {got}, the parameter is {tuple(shape)}: "
                                      "this optimizer.pt belongs to another model or parameter order")
        by_name[name] = s
    opt.load_state_tensors(_UnitState(engine, by_name))
    # The hyper-parameters as plain Trainer's resume restores them (torch's load_state_dict takes each group's own:
    # lr and the scheduler's initial_lr, betas, eps, weight_decay), group for group where the grouping is Trainer's.
    keys = ("lr", "initial_lr", "betas", "eps", "weight_decay")
    saved_groups = groups if len(groups) == len(opt.param_groups) else [groups[0]] * len(opt.param_groups)
    hyper = [{k: g[k] for k in keys if k in g and k in ours} for g, ours in zip(saved_groups, opt.param_groups)]
    if len(groups) != len(opt.param_groups):  # (an empty group dropped: only the learning rate is common to both)
        hyper = [{k: v for k, v in h.items() if k in ("lr", "initial_lr")} for h in hyper]
    opt.load_hyper_state({"param_groups": hyper, "skipped_steps": 0})


class _UnitState(Mapping[str, torch.Tensor]):
    """The per-unit flat tensors ``UnitAdamW.load_state_tensors`` reads, built one unit at a time from torch's
    per-parameter state (one unit's moments in memory at once, never the whole model's)."""

    def __init__(self, engine: EngineView, by_name: dict[str, dict[str, torch.Tensor]]) -> None:
        self._units = {u.index: u for u in engine.store.units}
        self._by_name = by_name
        self._steps = {i: [self._step(p.name) for p in u.params] for i, u in self._units.items()}

    def _step(self, name: str) -> int:
        s = self._by_name.get(name)
        return 0 if s is None else int(torch.as_tensor(s.get("step", 0)).item())

    def _flat(self, index: int, key: str) -> torch.Tensor:
        u = self._units[index]
        out = torch.zeros(u.numel, dtype=torch.float32)
        for p in u.params:
            s = self._by_name.get(p.name)
            if s is not None:
                out[p.offset:p.offset + p.numel].copy_(s[key].reshape(-1))
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        kind, _, index = key.rpartition(".")
        if key == "unit_steps":
            return torch.tensor([max(self._steps[i], default=0) for i in sorted(self._units)], dtype=torch.float32)
        if kind in ("exp_avg", "exp_avg_sq"):
            return self._flat(int(index), kind)
        if kind == "missed_steps" and int(index) in self._missed():
            return torch.tensor(self._missed()[int(index)], dtype=torch.float32)
        raise KeyError(key)

    def _missed(self) -> dict[int, list[int]]:
        out = {}
        for i, steps in self._steps.items():
            top = max(steps, default=0)
            if any(s != top for s in steps):
                out[i] = [top - s for s in steps]
        return out

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except (KeyError, ValueError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        yield "unit_steps"
        for i in sorted(self._units):
            yield f"exp_avg.{i}"
            yield f"exp_avg_sq.{i}"
        for i in self._missed():
            yield f"missed_steps.{i}"

    def __len__(self) -> int:
        return sum(1 for _ in self)
