"""What the TRL trainers whose own loss runs on the engine share (hf/dpo_support.py, kto_support.py, grpo_support.py;
DPO's and KTO's reference model: hf/trl_reference.py).

DPOTrainer, KTOTrainer and GRPOTrainer compute their losses from per-token log-probabilities of the labels, which
they get by calling the model with TRL's fused LM head (``fused_lm_head=True``): the HF backbone runs the decoder
loop, whose layers are the engine's streamed proxies (autograd Functions: the backward streams the layers back and
recomputes each, as for the engine's own loss), and TRL's chunked kernel turns the final hidden states into
log-probabilities in tiles, never forming the ``[tokens, vocab]`` logits. So the loss, its variants and the metrics
are TRL's code, unchanged. ``TRLPort`` only keeps the engine's step bookkeeping right around that call (what
``MegaTrainTrainer.compute_loss`` does around its own loss): an accumulation step's gradients land (FP32) before the
next forward, and the step's last backward is marked. It also makes the trainer's switches reach the streamed layers
(dropout off; PEFT's adapters off for a reference) and refuses what the engine does not reproduce.

A port is a ``MegaTrainTrainer`` subclass placed in front of it in ``MegaTrain<Base>``'s method resolution order
(hf/compose.py ``_PORTS``); ``super(MegaTrainTrainer, self)`` reaches the TRL trainer's own methods.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from trl.trainer.utils import disable_dropout_in_model

from ..core.plan import Stepper
from ..engine.adapter_switch import follows_adapter_switches
from ..engine.runtime import MegaTrainEngine
from ..export.peft_support import is_peft_model
from .trainer import MegaTrainTrainer
from .training_args import model_param_dtype

__all__ = ["TRLPort", "check_one_process", "disable_streamed_dropout", "frozen_reference"]


class TRLPort(MegaTrainTrainer):
    """The TRL trainer's ``compute_loss`` / ``prediction_step`` over the streamed model (module docstring)."""

    _mt_trl_name = "this TRL trainer"  # (messages)
    _mt_port_checked = False

    def _mt_convert(self, model: nn.Module, args: Any) -> nn.Module:
        model = super()._mt_convert(model, args)
        engine = self.engine
        if any(u.stepper is Stepper.LEAN for u in engine.plans.units):
            raise ValueError(f"lean_store (or the optimizer state on disk) is not supported with {self._mt_trl_name} "
                             "yet: its second forward+backward replays the engine's own loss, and the TRL loss runs "
                             "the model's forward with TRL's fused head. Remove lean_store / optimizer_state_dir from "
                             "megatrain_config.")
        # PEFT: "adapters disabled" (a TRL reference) must reach the streamed layers, not only the visible modules:
        # the engine makes PEFT's switch do so (engine/adapter_switch.py); a model without it would train silently
        # against its own adapters.
        if is_peft_model(engine.model) and not follows_adapter_switches(engine):
            raise RuntimeError("hf_megatrain: this engine's PEFT model does not follow adapter switches "
                               "(engine/adapter_switch.py); a reference with adapters disabled would be wrong")
        # The TRL trainer disables dropout (disable_dropout=True) after Trainer.__init__, walking model.modules().
        if getattr(args, "disable_dropout", False):
            disable_streamed_dropout(engine)
        return model

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        if not self._mt:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self._mt_port_checked:
            self._mt_check_port()
            self._mt_port_checked = True
        engine = self.engine
        # (the accumulation step's gradients land first; activation placement and the fits check for this shape)
        engine.begin_direct_forward(self._mt_batch_ids(inputs), inputs_embeds=inputs.get("inputs_embeds"))
        out = super(MegaTrainTrainer, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # As MegaTrainTrainer.compute_loss: the backward about to run is the step's last when accelerate will sync.
        engine.set_final_backward(model.training and torch.is_grad_enabled() and self.accelerator.sync_gradients)
        return out

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        # The TRL trainer's own (it always computes its loss; the batch has no labels), never MegaTrainTrainer's.
        return super(MegaTrainTrainer, self).prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _mt_batch_ids(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """The ``[batch, seq]`` token ids the loss's forward will run on (their shape places the activations)."""
        return inputs.get("input_ids")

    def _mt_check_port(self) -> None:
        """What the TRL trainer decides after ``Trainer.__init__``, checked once at the first loss."""


def check_one_process(args: Any, name: str) -> None:
    """Refuse several processes and ``activation_offloading``, before anything is converted or loaded."""
    if args.world_size > 1:
        raise NotImplementedError(
            f"{name} through hf_megatrain runs in one process for now (several processes of one host have not been "
            f"checked against plain {name} yet). Launch one process, or use MegaTrainTrainer / SFT for "
            "data-parallel runs.")
    if getattr(args, "activation_offloading", False):
        raise ValueError("activation_offloading=True is not used with megatrain=True: the streamed engine keeps only "
                         "layer inputs and recomputes each layer in the backward. Remove it.")


def frozen_reference(ref: nn.Module, args: Any) -> nn.Module:
    """``ref`` converted by its own engine with every parameter frozen: its layers streamed from a host copy in the
    compute dtype (2 bytes per parameter in bf16), no FP32 master, no gradient, no optimizer state; called
    directly by the TRL trainer (no-grad, TRL's fused head) like the policy."""
    ref.requires_grad_(False)
    config = args.megatrain_resolved_config(model_dtype=model_param_dtype(ref))
    engine = MegaTrainEngine(ref, config, device=args.device)
    if getattr(args, "disable_dropout", False):
        disable_streamed_dropout(engine)
    return engine.model


def disable_streamed_dropout(engine: MegaTrainEngine) -> None:
    """TRL disables dropout (disable_dropout=True) by walking model.modules(); the streamed layers' modules are the
    executor's templates, which that walk does not reach."""
    for module in engine.layer_templates():
        disable_dropout_in_model(module)
