"""The reference model of the TRL trainers built like ``DPOTrainer`` (DPO, KTO) when they run on the engine.

These trainers take their reference log-probabilities from one of four places, and each is served here without a
second full copy of the model on the GPU:

- ``precompute_ref_log_probs=True``: the trainer's own no-grad pass over its datasets before training, through the
  same streamed model (full fine-tuning or PEFT);
- PEFT (``peft_config``, or a ``PeftModel`` with one adapter) without precompute: the same streamed base with the
  adapters disabled (engine/adapter_switch.py makes PEFT's switch reach the streamed layers);
- a ``ref_model`` passed in: converted by a second engine with every parameter frozen before the trainer sees it
  (``frozen_reference``): streamed from a host copy in the compute dtype (2 bytes per parameter in bf16), no master,
  gradient or optimizer state;
- full fine-tuning with none of these, as TRL users write it (``ref_model`` left out): the TRL trainer would load a
  second copy of the policy's checkpoint (``config._name_or_path``) as its reference, whole onto the GPU. Here the
  reference log-probs are precomputed instead, with the policy's initial weights, before any step (the "implicit
  reference"): the trainer's own precompute pass over its train and eval datasets, run as that copy runs (eval
  mode, RNG untouched). The same reference, provided the model handed over is the checkpoint as loaded (TRL's copy
  reloads it; changes made to the model in memory before are in both policies, and here in the reference too).
  ``args.precompute_ref_log_probs`` keeps the user's value. Refused, saying what to pass, where precomputed
  log-probs cannot serve: an ``IterableDataset``, ``sync_ref_model``, ``evaluate(new_dataset)`` once training has
  begun (the initial weights are gone by then).

The run summary's ``reference`` line says which (``_mt_reference_note``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from datasets import IterableDataset, IterableDatasetDict
from torch import nn

from ..engine.runtime import ENGINE_ATTR
from ..export.peft_support import is_peft_model
from .trl_ports import TRLPort, check_one_process, frozen_reference

__all__ = ["ReferencePort", "check_implicit_reference", "reference_note"]

IMPLICIT_NOTE = "log-probs precomputed with the initial weights (ref_model not given)"
_PASS_REF = ("pass ref_model=<the initial model, loaded on the CPU> (hf_megatrain streams it frozen in the compute "
             "dtype, 2 bytes per parameter in bf16 on the host)")


class ReferencePort(TRLPort):
    """``TRLPort`` plus the reference model of a ``DPOTrainer``-like TRL trainer (module docstring)."""

    _mt_implicit_reference = False  # full fine-tuning, no ref_model, no precompute asked: precomputed all the same

    @property
    def _mt_trainer_name(self) -> str:
        return f"{self._mt_trl_name}Trainer"

    # -- before the TRL trainer's __init__ runs ---------------------------------------------------------------------
    def _mt_init_arguments(self, base: type, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """A live reference model is streamed frozen by its own engine *before* the trainer sees it (it would place
        it on the GPU whole); without one, full fine-tuning precomputes (it would load a second full copy)."""
        bound = inspect.signature(base.__init__).bind_partial(self, *args, **kwargs)
        given = bound.arguments
        targs = given.get("args")
        if targs is None or not getattr(targs, "megatrain", False):
            return args, kwargs
        check_one_process(targs, self._mt_trainer_name)
        model, ref = given.get("model"), given.get("ref_model")
        peft = given.get("peft_config") is not None or is_peft_model(model)
        self._mt_implicit_reference = ref is None and not peft and not targs.precompute_ref_log_probs
        if self._mt_implicit_reference:
            check_implicit_reference(targs, given.get("train_dataset"), given.get("eval_dataset"),
                                     self._mt_trainer_name)
        self._mt_reference_note = reference_note(ref, peft, targs.precompute_ref_log_probs)
        if isinstance(ref, nn.Module) and getattr(getattr(ref, ENGINE_ATTR, None), "model", None) is not ref:
            bound.arguments["ref_model"] = frozen_reference(ref, targs)
            return bound.args[1:], bound.kwargs
        return args, kwargs

    def _mt_run_base_init(self, base: type, args: tuple, kwargs: dict[str, Any]) -> None:
        """The implicit reference: the trainer's ``__init__`` runs with ``precompute_ref_log_probs`` reading True (so
        it loads no second copy and precomputes the reference log-probs of its train and eval datasets with the
        policy as given, before any step); the user's value is restored afterwards (saved with every checkpoint)."""
        if not self._mt_implicit_reference:
            return super()._mt_run_base_init(base, args, kwargs)
        targs = inspect.signature(base.__init__).bind_partial(None, *args, **kwargs).arguments["args"]
        targs.precompute_ref_log_probs = True
        try:
            super()._mt_run_base_init(base, args, kwargs)
        finally:
            targs.precompute_ref_log_probs = False

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """The TRL trainer's precompute pass. As the implicit reference it runs as the copy the trainer would load
        runs: in eval mode (the copy is prepared with ``evaluation_mode=True``: no dropout even where
        ``disable_dropout=False``), leaving the RNG as the copy's load does (the pass's data loader draws a seed,
        which would change the training order and the policy's dropout masks)."""
        if not (self._mt and self._mt_implicit_reference):
            return super()._precompute_ref_logps(dataset, name, batch_size)
        model = self.model
        was_training = model.training
        devices = [self.args.device] if self.args.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            model.eval()
            try:
                return super()._precompute_ref_logps(dataset, name, batch_size)
            finally:
                model.train(was_training)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        if self._mt and self._mt_implicit_reference and self.state.global_step > 0 and eval_dataset is not None \
                and not isinstance(eval_dataset, str):
            raise ValueError(
                "evaluate(eval_dataset=<a new dataset>) after training has begun: no ref_model was given, so the "
                "reference log-probs were precomputed with the initial weights for the train and eval datasets "
                "given at __init__, and the initial weights are gone now. Pass this dataset as eval_dataset when "
                "building the trainer (a dict of datasets works), or pass ref_model=<the initial model, loaded on "
                "the CPU> (hf_megatrain streams it frozen).")
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # -- before the model is converted (the trainer has applied peft_config) ----------------------------------------
    def _mt_setup(self, model: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if args is not None and getattr(args, "megatrain", False) and is_peft_model(model) \
                and "ref" in model.peft_config:
            raise ValueError(
                f"this PEFT model carries a second adapter 'ref' ({self._mt_trainer_name} adds it as the reference of "
                "a PeftModel handed over with a trained adapter); hf_megatrain streams one adapter. Pass the plain "
                "base model with peft_config=... (the reference is then the base with adapters disabled), or "
                "precompute_ref_log_probs=True on a model without the 'ref' adapter.")
        return super()._mt_setup(model, args, kwargs)

    def _mt_check_port(self) -> None:
        """What the trainer decides after ``Trainer.__init__`` (the reference model, the dataset kind). (MoE: the
        router logits the fused head reads for the aux loss are the engine's router tap's, recorded in the streamed
        layers' forward: tests/test_dpo.py checks it on Mixtral.)"""
        ref = getattr(self, "ref_model", None)
        if ref is not None and not self.precompute_ref_logps and getattr(ref, ENGINE_ATTR, None) is None:
            raise ValueError(f"this reference model is not streamed by hf_megatrain (a second full copy on the GPU): "
                             f"pass it as ref_model to megatrain_trainer_class({self._mt_trainer_name}), which "
                             "streams it frozen, or set precompute_ref_log_probs=True.")
        if getattr(self, "_is_vision_dataset", False):
            raise NotImplementedError(f"vision preference datasets are not supported with megatrain=True yet (not "
                                      f"tested against plain {self._mt_trainer_name}).")


def check_implicit_reference(args: Any, train_dataset: Any, eval_dataset: Any, trainer: str) -> None:
    """Refuse, before anything is loaded, what a reference precomputed with the initial weights cannot serve."""
    if args.sync_ref_model:
        raise ValueError("sync_ref_model=True is not supported with megatrain=True yet (its callback copies the "
                         "policy's parameters, which live in the engine, into the reference). Set it to False.")
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if any(isinstance(d, (IterableDataset, IterableDatasetDict)) for d in (train_dataset, *evals)):
        raise ValueError(
            f"no ref_model was given, and with megatrain=True {trainer}'s reference is then precomputed with the "
            f"initial weights ({trainer} would load a second full copy onto the GPU); an IterableDataset cannot "
            f"carry precomputed log-probs. Use a map-style Dataset, or {_PASS_REF}, or train LoRA (peft_config=...: "
            "the reference is the streamed base with the adapters disabled).")
    sample = next(iter(train_dataset)) if train_dataset is not None else {}
    if isinstance(sample, dict) and ("image" in sample or "images" in sample):
        raise NotImplementedError(f"vision preference datasets are not supported with megatrain=True yet (not "
                                  f"tested against plain {trainer}).")


def reference_note(ref: Any, peft: bool, precompute: bool) -> str:
    """The run summary's ``reference`` line."""
    if ref is not None:
        return ("ref_model, log-probs precomputed with it before training" if precompute else
                "ref_model, streamed frozen by its own engine in the compute dtype (no master, gradient or optimizer "
                "state)")
    if peft:
        return ("log-probs precomputed with the base, adapters disabled (precompute_ref_log_probs=True)" if precompute
                else "the streamed base with the adapters disabled")
    if precompute:
        return "log-probs precomputed with the initial weights (precompute_ref_log_probs=True)"
    return IMPLICIT_NOTE
