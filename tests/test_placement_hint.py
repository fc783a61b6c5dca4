"""Auto placement plans the GPU for the train dataset's micro-batch when the user did not say (hf/placement_hint.py):
``placement_tokens`` = per-device batch x the longest ``input_ids`` row (rounded up to 64), through Trainer and TRL's
SFTTrainer; an explicit value, a fixed placement or a dataset without ``input_ids`` rows leave it alone."""

from __future__ import annotations

import json

import pytest
import torch

from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments
from hf_megatrain.hf.placement_hint import longest_row

from .models import tiny

datasets = pytest.importorskip("datasets")


def _rows(lengths: list[int]) -> "datasets.Dataset":
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def _args(tmp_path, **over) -> MegaTrainTrainingArguments:
    kw = dict(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[], per_device_train_batch_size=3,
              save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    kw.update(over)
    return MegaTrainTrainingArguments(**kw)


def test_placement_tokens_come_from_the_longest_row(tmp_path):
    data = _rows([5, 70, 12, 33])
    assert longest_row(data) == 70 and longest_row(data.select([0, 2])) >= 12  # (a view: the backing table's rows)
    trainer = MegaTrainTrainer(model=tiny("llama", num_hidden_layers=2), args=_args(tmp_path), train_dataset=data,
                               data_collator=_pad)
    assert trainer.engine.config.placement_tokens == 3 * 128  # (70 rounded up to 128, x 3 rows)
    trainer.train()  # (the collated batches fit what was planned)
    summary = json.loads((tmp_path / "_megatrain_run.json").read_text())
    assert "placement_tokens=384 from the train dataset" in json.dumps(summary)


def test_a_positional_dataset_counts_too(tmp_path):
    trainer = MegaTrainTrainer(tiny("llama", num_hidden_layers=2), _args(tmp_path), _pad, _rows([100, 7]))
    assert trainer.engine.config.placement_tokens == 3 * 128


@pytest.mark.parametrize("over, dataset, expect", [
    ({"megatrain_config": {"placement_tokens": 1000}}, _rows([70]), 1000),  # (the user's value wins)
    ({"megatrain_config": {"device_layers": 0, "device_step_layers": 0}}, _rows([70]), 0),  # (no auto rule)
    ({}, [{"input_ids": torch.arange(70), "labels": torch.arange(70)}], 0),  # (not a datasets.Dataset)
    ({}, None, 0),
])
def test_left_alone(tmp_path, over, dataset, expect):
    trainer = MegaTrainTrainer(model=tiny("llama", num_hidden_layers=2), args=_args(tmp_path, **over),
                               train_dataset=dataset, data_collator=_pad)
    assert trainer.engine.config.placement_tokens == expect


def test_sft_trainer_plans_for_its_prepared_rows(tmp_path):
    pytest.importorskip("trl")
    from hf_megatrain.hf.trl_support import MegaTrainSFTConfig, MegaTrainSFTTrainer

    from .test_trl import sft_dataset, sft_kwargs, tokenizer

    data = sft_dataset()  # (rows of 8-14 tokens)
    trainer = MegaTrainSFTTrainer(model=tiny("llama"), args=MegaTrainSFTConfig(
        **sft_kwargs(tmp_path, eval_strategy="no"), megatrain_config={"compute_dtype": "float32"}),
        train_dataset=data, processing_class=tokenizer())
    assert trainer.engine.config.placement_tokens == 2 * 64


def _pad(rows: list[dict]) -> dict[str, torch.Tensor]:
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.as_tensor(r["input_ids"])
        labels[i, :k] = torch.as_tensor(r["labels"])
    return {"input_ids": ids, "labels": labels}
