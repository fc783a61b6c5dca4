"""TRL's ``SFTTrainer`` trained by hf_megatrain: ``MegaTrainSFTTrainer`` + ``MegaTrainSFTConfig``.

    pip install "hf_megatrain[trl]"

    from hf_megatrain.hf.trl_support import MegaTrainSFTConfig, MegaTrainSFTTrainer
    args = MegaTrainSFTConfig(output_dir="out", bf16=True, megatrain_config={"lean_store": True})
    trainer = MegaTrainSFTTrainer(model="Qwen/Qwen2.5-7B", args=args, train_dataset=dataset)
    trainer.train()

Everything SFTTrainer does to data (chat templates, completion-only / assistant-only masks, packing, padding-free
batches) and its logs are SFTTrainer's; the model is converted after SFTTrainer prepared it (``compose.py``).

The loss. SFTTrainer's own ``compute_loss`` calls the model with TRL's fused LM head (``fused_lm_head=True``:
per-token log-probabilities, entropy and top-1 flags) and logs ``entropy``, ``mean_token_accuracy`` and
``num_tokens``. hf_megatrain computes the loss with its own head loss over the streamed model (the chunked loss, or
a fused one: ``loss_impl``), which never forms the full logits either; the SFT metrics come from the same pass
(``model/loss.TokenStats``: entropy and top-1 per counted token, read off each chunk's logits; one extra no-grad
chunked pass with a fused ``loss_impl``) and are logged exactly as SFTTrainer logs them. The loss is the same
function (the mean NLL over the counted tokens, divided by ``num_items_in_batch``). A batch whose labels are all
``-100``: the model's loss is nan, as in HF; through the Trainer it is logged as loss 0 / grad_norm 0 on transformers
5.24 and leaves the same weights as plain Trainer (tests/test_base_defaults.py::
test_all_masked_batch_trains_like_plain_trainer). What SFTTrainer computes that this does not reproduce is refused
below, loudly.

All trl imports of hf_megatrain live in this module.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import SFTConfig, SFTTrainer

from .compose import megatrain_args_class, megatrain_trainer_class

__all__ = ["MegaTrainSFTConfig", "MegaTrainSFTTrainer"]


# ``SFTConfig`` plus the megatrain switches (``MegaTrainTrainingArguments``), with SFTConfig's own defaults
# (``learning_rate=2e-5``, ``logging_steps=10``; ``bf16`` becomes True when ``fp16`` is not set: bfloat16 compute,
# FP32 masters), built the one way every composed arguments class is (``compose.megatrain_args_class``).
MegaTrainSFTConfig = megatrain_args_class(SFTConfig, "MegaTrainSFTConfig", __name__)


class MegaTrainSFTTrainer(megatrain_trainer_class(SFTTrainer)):
    """``trl.SFTTrainer`` with the model run by hf_megatrain's engine (see the module docstring)."""

    _mt_token_stats = True

    def __init__(self, model: Any, args: MegaTrainSFTConfig | None = None, *pargs: Any, **kwargs: Any) -> None:
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = MegaTrainSFTConfig(f"{str(name).split('/')[-1] or 'model'}-SFT")
        if not isinstance(args, MegaTrainSFTConfig):
            raise TypeError(f"MegaTrainSFTTrainer needs MegaTrainSFTConfig arguments (SFTConfig plus the megatrain "
                            f"switches), got {type(args).__name__}: SFTTrainer would rebuild them as a plain "
                            "SFTConfig and drop the megatrain settings.")
        if args.megatrain:
            _check_supported(args)
        super().__init__(model, args, *pargs, **kwargs)
        if self._mt and self.aux_loss_enabled:
            raise NotImplementedError(
                "this MoE model asks for the router aux loss (config.output_router_logits=True). SFTTrainer adds it "
                "divided by the gradient accumulation steps and logs it as `aux_loss`; hf_megatrain's engine adds it "
                "per forward as the plain model does and does not log it. Set model.config.output_router_logits="
                "False to fine-tune without it, or use MegaTrainTrainer (the plain model's loss).")

    def _mt_log_token_stats(self, stats: Any, inputs: dict[str, Any]) -> None:
        """SFTTrainer.compute_loss's metric block, fed from the engine's ``TokenStats``."""
        mode = "train" if self.model.training else "eval"
        dev = self.args.device

        def t(x: torch.Tensor | float) -> torch.Tensor:
            return torch.as_tensor(x, dtype=torch.float32).to(dev)

        num_valid = self.accelerator.gather_for_metrics(t(stats.count)).sum()
        entropy_sum = self.accelerator.gather_for_metrics(t(stats.entropy_sum)).sum()
        num_correct = self.accelerator.gather_for_metrics(t(stats.correct)).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                num_tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            elif "position_ids" in inputs:
                local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
                num_tokens = self.accelerator.gather_for_metrics(local).sum().item()
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            self._total_train_tokens += num_tokens // getattr(self, "_tp_size", 1)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


def _check_supported(args: MegaTrainSFTConfig) -> None:
    """Refuse the SFT options whose loss or mechanism hf_megatrain's head loss does not reproduce."""
    if args.loss_type != "nll":
        raise ValueError(f"loss_type={args.loss_type!r} is not supported with megatrain=True: hf_megatrain's head "
                         "loss is the token-level NLL (loss_type='nll'); DFT weights each token by its detached "
                         "probability, which needs per-token gradients the fused head does not return.")
    if args.activation_offloading:
        raise ValueError("activation_offloading=True is not used with megatrain=True: the streamed engine keeps "
                         "only layer inputs and recomputes each layer in the backward. Remove it.")
