"""TRL's ``KTOTrainer`` trained by hf_megatrain: ``MegaTrainKTOTrainer`` + ``MegaTrainKTOConfig``.

    from hf_megatrain.hf.kto_support import MegaTrainKTOConfig, MegaTrainKTOTrainer
    args = MegaTrainKTOConfig(output_dir="out")   # full fine-tuning: the reference precomputed before training
    trainer = MegaTrainKTOTrainer(model="Qwen/Qwen2.5-14B", args=args, train_dataset=unpaired)
    trainer.train()

``megatrain_trainer_class(KTOTrainer)`` (hf/compose.py) gives the same behaviour: this module's ``KTOPort`` is placed
in front of ``MegaTrainTrainer`` for ``KTOTrainer`` and its subclasses.

The loss is KTOTrainer's own, unchanged, as DPO's is (hf/dpo_support.py): its ``compute_loss`` calls the converted
model with TRL's fused LM head, once without gradients over the batch's mismatched "KL" completions (the KL
estimate, ``loss_type='kto'``) and once with gradients over the completions; the layers are the engine's streamed
proxies, the step bookkeeping around the call ``TRLPort``'s (hf/trl_ports.py). The reference is served as DPO's
(hf/trl_reference.py): precomputed, the base with the adapters disabled, a ``ref_model`` streamed frozen, or, with
none given in full fine-tuning (KTOTrainer would load a second copy onto the GPU), precomputed with the initial
weights before training (log-probs of the completions and of the KL completions).

Refused, with what to change: as for DPO (a second "ref" PEFT adapter, the lean store, vision datasets, several
processes, ``activation_offloading``, ``sync_ref_model``).
"""

from __future__ import annotations

from typing import Any

from trl import KTOConfig, KTOTrainer

from .compose import megatrain_args_class, megatrain_trainer_class
from .trl_reference import ReferencePort

__all__ = ["KTOPort", "MegaTrainKTOConfig", "MegaTrainKTOTrainer"]

# ``KTOConfig`` plus the megatrain switches, with KTOConfig's own defaults (``learning_rate=1e-6``, ...).
MegaTrainKTOConfig = megatrain_args_class(KTOConfig, "MegaTrainKTOConfig", __name__)


class KTOPort(ReferencePort):
    """KTOTrainer's loss on the engine (see the module docstring)."""

    _mt_trl_name = "KTO"


class MegaTrainKTOTrainer(megatrain_trainer_class(KTOTrainer)):
    """``trl.KTOTrainer`` with the model run by hf_megatrain's engine (see the module docstring)."""

    def __init__(self, model: Any, ref_model: Any = None, args: MegaTrainKTOConfig | None = None, *pargs: Any,
                 **kwargs: Any) -> None:
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = MegaTrainKTOConfig(f"{str(name).split('/')[-1] or 'model'}-KTO")
        if not isinstance(args, MegaTrainKTOConfig):
            raise TypeError(f"MegaTrainKTOTrainer needs MegaTrainKTOConfig arguments (KTOConfig plus the megatrain "
                            f"switches), got {type(args).__name__}: KTOTrainer would rebuild them as a plain "
                            "KTOConfig and drop the megatrain settings.")
        super().__init__(model, ref_model, args, *pargs, **kwargs)
