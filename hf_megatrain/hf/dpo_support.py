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
``mean_token_accuracy``, ``num_tokens``) are TRL's code, logged as DPOTrainer logs them. This port only keeps the
engine's step bookkeeping right around that call: gradients of an accumulation step land (FP32) before the next
forward, and the step's last backward is marked (what ``MegaTrainTrainer.compute_loss`` does around its loss).

The reference log-probabilities:
- ``precompute_ref_log_probs=True``: DPOTrainer's own no-grad pass over the dataset before training, through the
  same streamed model (full fine-tuning or PEFT);
- PEFT (``peft_config``, or a ``PeftModel`` with one adapter) without precompute: the same streamed base with the
  adapters disabled, no second copy (engine/adapter_switch.py makes PEFT's switch reach the streamed layers);
- full fine-tuning without precompute would need a live frozen reference (a second copy of the model): refused,
  with what to set.

Refused, with what to change: a live ``ref_model`` (PEFT without precompute, or full fine-tuning), a PEFT model
whose reference would be a second ("ref") adapter, the lean store (its re-run replays the engine's own forward),
vision datasets (not tested yet), ``activation_offloading``. MoE models train with DPOTrainer's router aux loss
(logged as ``aux_loss``), the router logits coming from the engine's tap in the streamed layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from trl import DPOConfig, DPOTrainer
from trl.trainer.utils import disable_dropout_in_model

from ..core.plan import Stepper
from ..engine.adapter_switch import follows_adapter_switches
from ..export.peft_support import is_peft_model
from .compose import megatrain_args_class, megatrain_trainer_class
from .trainer import MegaTrainTrainer

__all__ = ["DPOPort", "MegaTrainDPOConfig", "MegaTrainDPOTrainer"]

# ``DPOConfig`` plus the megatrain switches, with DPOConfig's own defaults (``learning_rate=1e-6``, ...).
MegaTrainDPOConfig = megatrain_args_class(DPOConfig, "MegaTrainDPOConfig", __name__)


class DPOPort(MegaTrainTrainer):
    """DPOTrainer's loss on the engine: placed before ``MegaTrainTrainer`` in ``MegaTrain<DPOTrainer>``'s method
    resolution order (compose.py); ``super(MegaTrainTrainer, self)`` reaches DPOTrainer's own methods."""

    _mt_dpo_checked = False

    # -- before the model is converted (DPOTrainer has applied peft_config; no reference model built yet) -----------
    def _mt_setup(self, model: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if args is not None and getattr(args, "megatrain", False) and model is not None:
            _check_before_conversion(model, args)
        return super()._mt_setup(model, args, kwargs)

    def _mt_convert(self, model: nn.Module, args: Any) -> nn.Module:
        model = super()._mt_convert(model, args)
        engine = self.engine
        if any(u.stepper is Stepper.LEAN for u in engine.plans.units):
            raise ValueError("lean_store (or the optimizer state on disk) is not supported with DPO yet: its second "
                             "forward+backward replays the engine's own loss, and DPOTrainer's loss runs the model's "
                             "forward with TRL's fused head. Remove lean_store / optimizer_state_dir from "
                             "megatrain_config.")
        # PEFT: "adapters disabled" (DPO's reference) must reach the streamed layers, not only the visible modules:
        # the engine makes PEFT's switch do so (engine/adapter_switch.py); a model without it would train silently
        # against its own adapters.
        if is_peft_model(engine.model) and not follows_adapter_switches(engine):
            raise RuntimeError("hf_megatrain: this engine's PEFT model does not follow adapter switches "
                               "(engine/adapter_switch.py); DPO's reference (adapters disabled) would be wrong")
        # DPOTrainer disables dropout (disable_dropout=True) by walking model.modules() after Trainer.__init__, before
        # its reference precompute: the streamed layers' modules are the executor's templates, so do it there too.
        if getattr(args, "disable_dropout", False):
            for template in engine.executor.templates:
                disable_dropout_in_model(template.module)
        return model

    # -- loss -----------------------------------------------------------------------------------------------------------
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        if not self._mt:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self._mt_dpo_checked:
            self._mt_check_dpo()
        engine = self.engine
        # (the accumulation step's gradients land first; activation placement and the fits check for this shape)
        engine.begin_direct_forward(inputs.get("input_ids"), inputs_embeds=inputs.get("inputs_embeds"))
        out = super(MegaTrainTrainer, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # As MegaTrainTrainer.compute_loss: the backward about to run is the step's last when accelerate will sync.
        engine.set_final_backward(model.training and torch.is_grad_enabled() and self.accelerator.sync_gradients)
        return out

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        # DPOTrainer's (it always computes its loss; the batch has no labels), never MegaTrainTrainer's.
        return super(MegaTrainTrainer, self).prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _mt_check_dpo(self) -> None:
        """What DPOTrainer decides after ``Trainer.__init__`` (the reference model, the dataset kind): checked
        once. (MoE: the router logits DPOTrainer's fused head reads for its aux loss are the engine's router tap's,
        recorded in the streamed layers' forward: tests/test_dpo.py checks it on Mixtral.)"""
        if getattr(self, "ref_model", None) is not None and not self.precompute_ref_logps:
            raise ValueError("a live ref_model is not supported with megatrain=True: it would be a second full copy of "
                             "the model on the GPU, and hf_megatrain streams only the policy. Set "
                             "precompute_ref_log_probs=True (the reference log-probs are computed once before "
                             "training), or, with PEFT, drop ref_model (the reference is then the same streamed base "
                             "with the adapters disabled).")
        if getattr(self, "_is_vision_dataset", False):
            raise NotImplementedError("vision preference datasets are not supported with megatrain=True yet "
                                      "(not tested against plain DPOTrainer).")
        self._mt_dpo_checked = True


def _check_before_conversion(model: nn.Module, args: Any) -> None:
    """Refuse what the engine cannot reproduce, before anything is converted or a reference model is loaded."""
    if getattr(args, "activation_offloading", False):
        raise ValueError("activation_offloading=True is not used with megatrain=True: the streamed engine keeps only "
                         "layer inputs and recomputes each layer in the backward. Remove it.")
    if is_peft_model(model):
        if "ref" in model.peft_config:
            raise ValueError(
                "this PEFT model carries a second adapter 'ref' (DPOTrainer adds it as the reference of a PeftModel "
                "handed over with a trained adapter); hf_megatrain streams one adapter. Pass the plain base model "
                "with peft_config=... (the reference is then the base with adapters disabled), or set "
                "precompute_ref_log_probs=True on a model without the 'ref' adapter.")
        return
    if not args.precompute_ref_log_probs:
        raise ValueError(
            "full fine-tuning with megatrain=True needs precompute_ref_log_probs=True: the reference log-probs are "
            "then computed by the same streamed model in one no-grad pass before training. A live frozen reference "
            "(ref_model, or DPOTrainer loading a second copy) is not streamed by hf_megatrain yet. Or train LoRA "
            "(peft_config=...): the reference is then the same streamed base with the adapters disabled.")


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
