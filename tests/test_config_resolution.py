"""One config resolution per engine: the Trainer path resolves the user's config once (when its arguments are
built) and hands the ``MegaTrainConfig`` down; the Trainer, the engine and the run summary resolve nothing again.

Resolutions are counted from ``config.resolve_config``'s debug record (one per call, however it was imported).
"""

from __future__ import annotations

import logging

import pytest
import torch

from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments

from .models import tiny

RECORD = "hf_megatrain: config resolved from"


def _resolutions(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.name == "hf_megatrain.config" and r.getMessage().startswith(RECORD) for r in caplog.records)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (4, 12), generator=g)]


def test_trainer_construction_and_a_step_resolve_the_config_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_MICRO_BATCH_SIZE", "2")  # env keys are part of the one resolution
    with caplog.at_level(logging.DEBUG, logger="hf_megatrain.config"):
        args = MegaTrainTrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[],
                                          per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True,
                                          megatrain_config={"device_layers": 0})
        trainer = MegaTrainTrainer(model=tiny("llama", num_hidden_layers=2), args=args, train_dataset=_data())
        trainer.train()
    assert _resolutions(caplog) == 1, [r.getMessage() for r in caplog.records if r.name == "hf_megatrain.config"]
    cfg = trainer.engine.config
    assert (cfg.micro_batch_size, cfg.device_layers, cfg.compute_dtype) == (2, 0, "float32")  # (fp32 model, no bf16)


def test_a_new_source_is_resolved_again(tmp_path, caplog):
    args = MegaTrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                      megatrain_config={"num_slots": 3})
    with caplog.at_level(logging.DEBUG, logger="hf_megatrain.config"):
        assert args.megatrain_base_config().num_slots == 3
        assert _resolutions(caplog) == 0  # kept from when the arguments were built
        args.megatrain_config["num_slots"] = 4  # changed in place
        assert args.megatrain_resolved_config().num_slots == 4
        args.megatrain_config = '{"num_slots": 2}'
        assert args.megatrain_resolved_config().num_slots == 2
        assert _resolutions(caplog) == 2
