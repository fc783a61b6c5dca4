"""TRL's ``DPOTrainer`` trained by hf_megatrain: ``MegaTrainDPOTrainer`` + ``MegaTrainDPOConfig``.

    from hf_megatrain.hf.dpo_support import MegaTrainDPOConfig, MegaTrainDPOTrainer
    args = MegaTrainDPOConfig(output_dir="out")   # full fine-tuning: the reference precomputed before training
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

The reference log-probabilities (hf/trl_reference.py): precomputed (``precompute_ref_log_probs=True``) by the
same streamed model; with PEFT, the same streamed base with the adapters disabled; a ``ref_model`` passed in,
streamed frozen by a second engine in the compute dtype; and full fine-tuning with none of these (DPO as TRL users
write it, where DPOTrainer would load a second copy of the checkpoint onto the GPU), precomputed with the initial
weights before training, which the run summary says.

Refused, with what to change: a PEFT model whose reference would be a second ("ref") adapter, the lean store (its
re-run replays the engine's own forward), vision datasets and several processes (not checked against plain
DPOTrainer yet), ``activation_offloading``. MoE models train with DPOTrainer's router aux loss (logged as
``aux_loss``), the router logits coming from the engine's tap in the streamed layers.
"""

from __future__ import annotations

from typing import Any

from trl import DPOConfig, DPOTrainer

from .compose import megatrain_args_class, megatrain_trainer_class
from .trl_reference import ReferencePort

__all__ = ["DPOPort", "MegaTrainDPOConfig", "MegaTrainDPOTrainer"]

# ``DPOConfig`` plus the megatrain switches, with DPOConfig's own defaults (``learning_rate=1e-6``, ...).
MegaTrainDPOConfig = megatrain_args_class(DPOConfig, "MegaTrainDPOConfig", __name__)


class DPOPort(ReferencePort):
    """DPOTrainer's loss on the engine: placed before ``MegaTrainTrainer`` in ``MegaTrain<DPOTrainer>``'s method
    resolution order (compose.py); the loss wrapper, evaluation, dropout and the lean / PEFT checks are
    ``TRLPort``'s (hf/trl_ports.py), the reference model ``ReferencePort``'s (hf/trl_reference.py)."""

    _mt_trl_name = "DPO"


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
