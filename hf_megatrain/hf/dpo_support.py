"""TRL's ``DPOTrainer`` trained by hf_megatrain: ``MegaTrainDPOTrainer`` + ``MegaTrainDPOConfig``.

    from hf_megatrain.hf.dpo_support import MegaTrainDPOConfig, MegaTrainDPOTrainer
    args = MegaTrainDPOConfig(output_dir="out", precompute_ref_log_probs=True)        # full fine-tuning
    trainer = MegaTrainDPOTrainer(model="Qwen/Qwen2.5-14B", args=args, train_dataset=pairs)
    trainer.train()

``megatrain_trainer_class(DPOTrainer)`` (hf/compose.py) gives the same behaviour: this module's ``DPOPort`` is
placed in front of ``MegaTrainTrainer`` for ``DPOTrainer`` and its subclasses.

The loss is DPOTrainer's own, unchanged. Its ``compute_loss`` calls the converted model with TRL's fused LM head
(``fused_lm_head=True``): the HF backbone runs the decoder loop, whose layers are the engine's streamed proxies
(autograd Functions: the backward streams the layers back and recomputes each, as for the engine's own loss),
and TRL's chunked kernel turns the final hidden states into per-token log-probabilities of the labels in tiles of
4096 tokens x 32768 vocabulary entries, recomputing each tile in the backward: the ``[tokens, vocab]`` logits are
never formed. So chosen / rejected log-probabilities (one pass over the concatenated pair), every loss type,
``ld_alpha``, WPO weighting, f-divergences and the metrics (``rewards/*``, ``logps/*``, ``logits/*``, ``entropy``,
``mean_token_accuracy``, ``num_tokens``) are TRL's code, logged as DPOTrainer logs them. The engine's step
bookkeeping around that call (shared with GRPO) is ``TRLPort``'s, hf/trl_ports.py.

The reference log-probabilities:
- ``precompute_ref_log_probs=True``: DPOTrainer's own no-grad pass over the dataset before training, through the
  same streamed model (full fine-tuning or PEFT);
- PEFT (``peft_config``, or a ``PeftModel`` with one adapter) without precompute: the same streamed base with the
  adapters disabled, no second copy (engine/adapter_switch.py makes PEFT's switch reach the streamed layers);
- a ``ref_model`` passed in (full fine-tuning or PEFT): converted by a second engine with every parameter frozen
  before DPOTrainer sees it (``frozen_reference``): streamed from a host copy in the compute dtype (2 bytes per
  parameter in bf16), no master, gradient or optimizer state;
- full fine-tuning with neither (DPOTrainer as TRL users write it): DPOTrainer would load a second copy of the
  policy's checkpoint as its reference, whole onto the GPU. Here the reference log-probs are precomputed instead,
  by the same streamed model with its initial weights, in eval mode, before training (DPOTrainer's own
  precompute pass over the train and eval datasets: ``implicit_reference``), which gives the reference that copy
  gives; ``args.precompute_ref_log_probs`` keeps the value the user set. The run summary says so. Where a
  precomputed reference cannot serve, refused, saying what to pass: an ``IterableDataset``, ``sync_ref_model``, and
  ``evaluate(new_dataset)`` once training has begun (the initial weights are gone).

Refused, with what to change: a PEFT model whose reference would be a second ("ref") adapter, the lean store (its
re-run replays the engine's own forward), vision datasets and several processes (not checked against plain
DPOTrainer yet), ``activation_offloading``. MoE models train with DPOTrainer's router aux loss (logged as
``aux_loss``), the router logits coming from the engine's tap in the streamed layers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from datasets import IterableDataset, IterableDatasetDict
from torch import nn
from trl import DPOConfig, DPOTrainer

from ..engine.runtime import ENGINE_ATTR
from ..export.peft_support import is_peft_model
from .compose import megatrain_args_class, megatrain_trainer_class
from .trl_ports import TRLPort, check_one_process, frozen_reference

__all__ = ["DPOPort", "MegaTrainDPOConfig", "MegaTrainDPOTrainer"]

# ``DPOConfig`` plus the megatrain switches, with DPOConfig's own defaults (``learning_rate=1e-6``, ...).
MegaTrainDPOConfig = megatrain_args_class(DPOConfig, "MegaTrainDPOConfig", __name__)


class DPOPort(TRLPort):
    """DPOTrainer's loss on the engine: placed before ``MegaTrainTrainer`` in ``MegaTrain<DPOTrainer>``'s method
    resolution order (compose.py); the loss wrapper, evaluation, dropout and the lean / PEFT checks are
    ``TRLPort``'s (hf/trl_ports.py)."""

    _mt_trl_name = "DPO"
    _mt_implicit_reference = False  # full fine-tuning, no ref_model, no precompute asked: precomputed all the same

    # -- before DPOTrainer.__init__ runs: the reference model ----------------------------------------------------
    def _mt_init_arguments(self, base: type, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """A live reference model is streamed frozen by its own engine *before* DPOTrainer sees it (DPOTrainer would
        place it on the GPU whole); without one, full fine-tuning must precompute (DPOTrainer would load a second
        full copy)."""
        bound = inspect.signature(base.__init__).bind_partial(self, *args, **kwargs)
        given = bound.arguments
        targs = given.get("args")
        if targs is None or not getattr(targs, "megatrain", False):
            return args, kwargs
        check_one_process(targs, "DPOTrainer")
        model, ref = given.get("model"), given.get("ref_model")
        peft = given.get("peft_config") is not None or is_peft_model(model)
        self._mt_implicit_reference = ref is None and not peft and not targs.precompute_ref_log_probs
        if self._mt_implicit_reference:
            check_implicit_reference(targs, given.get("train_dataset"), given.get("eval_dataset"))
        self._mt_reference_note = _reference_note(ref, peft, targs.precompute_ref_log_probs)
        if isinstance(ref, nn.Module) and getattr(getattr(ref, ENGINE_ATTR, None), "model", None) is not ref:
            bound.arguments["ref_model"] = frozen_reference(ref, targs)
            return bound.args[1:], bound.kwargs
        return args, kwargs

    def _mt_run_base_init(self, base: type, args: tuple, kwargs: dict[str, Any]) -> None:
        """The implicit reference: DPOTrainer.__init__ runs with ``precompute_ref_log_probs`` reading True (so it loads
        no second copy and precomputes the reference log-probs of its train and eval datasets with the policy as
        given, before any step); the user's value is restored afterwards (saved with every checkpoint)."""
        if not self._mt_implicit_reference:
            return super()._mt_run_base_init(base, args, kwargs)
        targs = inspect.signature(base.__init__).bind_partial(None, *args, **kwargs).arguments["args"]
        targs.precompute_ref_log_probs = True
        try:
            super()._mt_run_base_init(base, args, kwargs)
        finally:
            targs.precompute_ref_log_probs = False

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """DPOTrainer's precompute pass. As the implicit reference, it runs as the copy DPOTrainer would load runs:
        in eval mode (the copy is prepared with ``evaluation_mode=True``: no dropout even where
        ``disable_dropout=False``), and it leaves the RNG as the copy's load does (the pass's data loader draws a
        seed, which would change the training order)."""
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

    # -- before the model is converted (DPOTrainer has applied peft_config) -------------------------------------
    def _mt_setup(self, model: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if args is not None and getattr(args, "megatrain", False) and is_peft_model(model) \
                and "ref" in model.peft_config:
            raise ValueError(
                "this PEFT model carries a second adapter 'ref' (DPOTrainer adds it as the reference of a PeftModel "
                "handed over with a trained adapter); hf_megatrain streams one adapter. Pass the plain base model "
                "with peft_config=... (the reference is then the base with adapters disabled), or "
                "precompute_ref_log_probs=True on a model without the 'ref' adapter.")
        return super()._mt_setup(model, args, kwargs)

    def _mt_check_port(self) -> None:
        """What DPOTrainer decides after ``Trainer.__init__`` (the reference model, the dataset kind). (MoE: the
        router logits DPOTrainer's fused head reads for its aux loss are the engine's router tap's, recorded in the
        streamed layers' forward: tests/test_dpo.py checks it on Mixtral.)"""
        ref = getattr(self, "ref_model", None)
        if ref is not None and not self.precompute_ref_logps and getattr(ref, ENGINE_ATTR, None) is None:
            raise ValueError("this reference model is not streamed by hf_megatrain (a second full copy on the GPU): "
                             "pass it as ref_model to MegaTrainDPOTrainer / megatrain_trainer_class(DPOTrainer), "
                             "which stream it frozen, or set precompute_ref_log_probs=True.")
        if getattr(self, "_is_vision_dataset", False):
            raise NotImplementedError("vision preference datasets are not supported with megatrain=True yet "
                                      "(not tested against plain DPOTrainer).")


def check_implicit_reference(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """Refuse, before anything is loaded, what a reference precomputed with the initial weights cannot serve."""
    pass_ref = ("pass ref_model=<the initial model, loaded on the CPU> (hf_megatrain streams it frozen in the compute "
                "dtype, 2 bytes per parameter in bf16 on the host)")
    if args.sync_ref_model:
        raise ValueError("sync_ref_model=True is not supported with megatrain=True yet (its callback copies the "
                         "policy's parameters, which live in the engine, into the reference). Set it to False.")
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if any(isinstance(d, (IterableDataset, IterableDatasetDict)) for d in (train_dataset, *evals)):
        raise ValueError(
            "no ref_model was given, and with megatrain=True DPOTrainer's reference is then precomputed with the "
            "initial weights (DPOTrainer would load a second full copy onto the GPU); an IterableDataset cannot carry "
            f"precomputed log-probs. Use a map-style Dataset, or {pass_ref}, or train LoRA (peft_config=...: the "
            "reference is the streamed base with the adapters disabled).")
    sample = next(iter(train_dataset)) if train_dataset is not None else {}
    if isinstance(sample, dict) and ("image" in sample or "images" in sample):
        raise NotImplementedError("vision preference datasets are not supported with megatrain=True yet (not tested "
                                  "against plain DPOTrainer).")


def _reference_note(ref: Any, peft: bool, precompute: bool) -> str:
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
    return "log-probs precomputed with the initial weights (ref_model not given)"


class MegaTrainDPOTrainer(megatrain_trainer_class(DPOTrainer)):
    """``trl.DPOTrainer`` with the model run by hf_megatrain's engine (see the module docstring)."""

    def __init__(self, model: Any, ref_model: Any = None, args: MegaTrainDPOConfig | None = None, *pargs: Any,
                 **kwargs: Any) -> None:
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = MegaTrainDPOConfig(f"{str(name).split('/')[-1] or 'model'}-DPO")
        if not isinstance(args, MegaTrainDPOConfig):
            raise TypeError(f"MegaTrainDPOTrainer needs MegaTrainDPOConfig arguments (DPOConfig plus the megatrain "
                            f"switches), got {type(args).__name__}: DPOTrainer would rebuild them as a plain "
                            "DPOConfig and drop the megatrain settings.")
        super().__init__(model, ref_model, args, *pargs, **kwargs)
