"""A step skipped for a non-finite gradient norm does not advance the LR schedule, as plain Trainer does not after
a skipped step (accelerate's ``optimizer_step_was_skipped``); ``global_step`` still counts it."""

from __future__ import annotations

import torch

from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments

from .models import tiny
from .test_trainer import common_args, dataset


class NanOnSecondStep(MegaTrainTrainer):
    calls = 0

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        NanOnSecondStep.calls += 1
        return loss * float("nan") if NanOnSecondStep.calls == 2 else loss


def test_skipped_step_keeps_the_learning_rate(tmp_path):
    args = MegaTrainTrainingArguments(**common_args(tmp_path, gradient_accumulation_steps=1, max_steps=4,
                                                    warmup_steps=0, max_grad_norm=0.0),
                                      megatrain_config={"compute_dtype": "float32"})
    trainer = NanOnSecondStep(model=tiny("llama"), args=args, train_dataset=dataset())
    trainer.train()
    assert trainer.engine.optimizer.skipped_steps == 1 and trainer.state.global_step == 4
    assert trainer.lr_scheduler.last_epoch == 3  # 4 steps, one skipped
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs[2] == lrs[1] and lrs[3] < lrs[2]  # (the LR each step used) step 2 skipped: step 3 uses its LR
    assert torch.isfinite(trainer.engine.store.units[0].master).all()
