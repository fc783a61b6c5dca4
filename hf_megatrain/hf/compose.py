"""Combine ``MegaTrainTrainer`` with any ``transformers.Trainer`` subclass (TRL's SFT, DPO, ... or a user's own).

``megatrain_trainer_class(Base)`` builds ``MegaTrain<Base>`` whose method resolution order is

    MegaTrain<Base> -> MegaTrainTrainer -> Base -> (Base's parents) -> _ConvertAtTrainerInit -> Trainer

so that

- the engine-owned methods (optimizer, gradient clipping, loss via the engine, evaluation, saving, loading,
  device placement) are MegaTrainTrainer's; each falls through to ``Base``'s (``super()``) when ``megatrain=False``;
- everything else (``Base``'s data preparation, collators, ``training_step``, ``log``, its metrics) is ``Base``'s;
- ``Base.__init__`` runs *first*, on the user's model as given (a Hub id it loads, a PEFT wrapping it applies, token
  resizing), and the model is converted only when ``Base`` hands it to ``Trainer.__init__``: ``MegaTrainTrainer``'s
  own ``__init__`` is skipped, its ``_mt_setup`` runs in ``_ConvertAtTrainerInit``, the last class before Trainer.

``megatrain_args_class(BaseArgs)`` is the matching arguments dataclass (``MegaTrainTrainingArguments`` fields and
checks plus ``BaseArgs``' fields, ``BaseArgs``' defaults). A trainer whose ``compute_loss`` does more than the
causal-LM loss (SFT's metrics, DPO's pairs) needs that part ported on top (``trl_support.py`` does it for SFT):
MegaTrainTrainer's ``compute_loss`` runs the engine's loss, not ``Base``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from typing import Any

from transformers import Trainer, TrainingArguments

from .trainer import MegaTrainTrainer
from .training_args import MegaTrainTrainingArguments

__all__ = ["megatrain_trainer_class", "megatrain_args_class"]


class _ConvertAtTrainerInit(Trainer):
    """Last stop before ``Trainer.__init__``: validate the arguments and convert the model ``Base`` prepared."""

    def _mt_init_arguments(self, base: type[Trainer], args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """What ``MegaTrain<Base>.__init__`` hands ``Base.__init__``: unchanged unless a port overrides it."""
        return args, kwargs

    def _mt_run_base_init(self, base: type[Trainer], args: tuple, kwargs: dict[str, Any]) -> None:
        """Run ``base.__init__``; a port may wrap it (GRPO streams the reference GRPOTrainer would load:
        hf/grpo_support.py)."""
        base.__init__(self, *args, **kwargs)  # -> ... -> _ConvertAtTrainerInit.__init__ -> Trainer.__init__

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *pargs: Any, **kwargs: Any) -> None:
        model = self._mt_setup(model, args, kwargs)  # (MegaTrainTrainer's, found through self)
        super().__init__(model, args, *pargs, **kwargs)
        self._mt_after_init()


@functools.cache
def megatrain_trainer_class(base: type[Trainer]) -> type[MegaTrainTrainer]:
    """``MegaTrain<base>``: ``base``'s behaviour with the model trained by hf_megatrain (module docstring)."""
    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise TypeError(f"megatrain_trainer_class needs a transformers.Trainer subclass, got {base!r}")
    if issubclass(base, MegaTrainTrainer):
        raise TypeError(f"{base.__name__} is already a MegaTrainTrainer")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (a port may prepare what base.__init__ takes, e.g. DPO's reference model: hf/dpo_support.py)
        args, kwargs = self._mt_init_arguments(base, args, kwargs)
        self._mt_run_base_init(base, args, kwargs)

    name = f"MegaTrain{base.__name__}"
    return type(name, (_port_for(base), base, _ConvertAtTrainerInit),
                {"__init__": __init__, "__module__": base.__module__, "__qualname__": name,
                 "__doc__": f"{base.__name__} trained by hf_megatrain (hf_megatrain.hf.compose)."})


# Trainers whose loss is ported onto the engine: the base's qualified name (found on a subclass's MRO too) -> the
# port, "module:class", a MegaTrainTrainer subclass taking MegaTrainTrainer's place (imported only when asked for).
_PORTS = {"trl.trainer.dpo_trainer.DPOTrainer": "hf_megatrain.hf.dpo_support:DPOPort",
          "trl.trainer.kto_trainer.KTOTrainer": "hf_megatrain.hf.kto_support:KTOPort",
          "trl.trainer.grpo_trainer.GRPOTrainer": "hf_megatrain.hf.grpo_support:GRPOPort"}


def _port_for(base: type[Trainer]) -> type[MegaTrainTrainer]:
    for cls in base.__mro__:
        spec = _PORTS.get(f"{cls.__module__}.{cls.__qualname__}")
        if spec is not None:
            module, attr = spec.split(":")
            return getattr(importlib.import_module(module), attr)
    return MegaTrainTrainer


def megatrain_args_class(base: type[TrainingArguments], name: str | None = None,
                         module: str | None = None) -> type[MegaTrainTrainingArguments]:
    """A dataclass with ``MegaTrainTrainingArguments``' switches and checks and ``base``'s fields and defaults.

    Trainer pickles its arguments into every save (``training_args.bin``): bind the result to the module-level
    name ``name`` (default ``MegaTrain<base>``) of ``module`` (default: the caller's) so pickle can find it."""
    if not (isinstance(base, type) and issubclass(base, TrainingArguments)):
        raise TypeError(f"megatrain_args_class needs a TrainingArguments subclass, got {base!r}")
    if issubclass(base, MegaTrainTrainingArguments):
        return base
    name = name or f"MegaTrain{base.__name__}"
    if module is None:
        module = sys._getframe(1).f_globals.get("__name__", "__main__")
    namespace: dict[str, Any] = {"__module__": module, "__qualname__": name, "__doc__": base.__doc__,
                                 **base_field_overrides(base)}
    cls = type(name, (MegaTrainTrainingArguments, base), namespace)
    return dataclasses.dataclass(cls)


def base_field_overrides(base: type[TrainingArguments]) -> dict[str, Any]:
    """Class-body entries (``__annotations__`` and ``field(...)``s) re-declaring every field ``base`` (or a class
    between it and ``TrainingArguments``) declared anew: its default, factory and help text.

    Why: ``dataclass`` collects inherited fields walking the MRO backwards, and ``MegaTrainTrainingArguments``
    (first in the MRO) carries ``TrainingArguments``' own field objects, so without this its defaults would win over
    the base's: ``SFTConfig``'s ``learning_rate=2e-5`` would silently become 5e-5 and DPOConfig's 1e-6 too, ``bf16``
    would lose its base default, ``logging_steps`` 500 instead of 10. Re-declared in the class body, the base's
    field takes its inherited place in the field order with the base's values."""
    own = MegaTrainTrainingArguments.__dataclass_fields__
    ours = {n for n in own if n not in TrainingArguments.__dataclass_fields__}
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {"__annotations__": annotations}
    for fname, f in base.__dataclass_fields__.items():
        if fname in ours:
            raise TypeError(f"{base.__name__} declares a field {fname!r} that MegaTrainTrainingArguments also "
                            "declares: rename it in one of the two")
        if f._field_type is not dataclasses._FIELD or own.get(fname) is f:  # (unchanged TrainingArguments field)
            continue
        annotations[fname] = f.type
        kwargs: dict[str, Any] = dict(init=f.init, repr=f.repr, hash=f.hash, compare=f.compare,
                                      metadata=f.metadata, kw_only=f.kw_only)
        if f.default is not dataclasses.MISSING:
            kwargs["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kwargs["default_factory"] = f.default_factory
        namespace[fname] = dataclasses.field(**kwargs)
    return namespace
