"""Switching trainers mid-run: hf_megatrain resumes a plain ``Trainer`` checkpoint exactly (its ``optimizer.pt`` into
the host AdamW state), and an hf_megatrain checkpoint tells plain Trainer users what it holds."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments

from .models import tiny
from .parity import rel

datasets = pytest.importorskip("datasets")


def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (16, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _kw(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2, weight_decay=0.1,
              max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, report_to=[],
              use_cpu=True, save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True, data_seed=0,
              dataloader_num_workers=0)
    kw.update(over)
    return kw


def test_megatrain_resumes_a_plain_trainer_checkpoint_exactly(tmp_path, caplog):
    model = tiny("llama")
    plain = Trainer(model=copy.deepcopy(model), args=TrainingArguments(**_kw(tmp_path / "plain")),
                    train_dataset=_data())
    plain.train()
    reference = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    assert os.path.isfile(tmp_path / "plain" / "checkpoint-2" / "optimizer.pt")

    ours = MegaTrainTrainer(model=copy.deepcopy(model), args=MegaTrainTrainingArguments(**_kw(tmp_path / "ours")),
                            train_dataset=_data())
    with caplog.at_level("WARNING"):
        ours.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    assert not any("AdamW starts fresh" in r.getMessage() for r in caplog.records)
    assert ours.state.global_step == 4
    engine = ours.engine
    worst = max(rel(engine.store.master_tensor(n), reference[n]) for n in reference)
    assert worst <= 1e-5, worst  # a fresh AdamW would be ~1e-1 away after two steps at lr 1e-2


def test_optimizer_of_another_grouping_is_refused(tmp_path):
    model = tiny("llama")
    plain = Trainer(model=copy.deepcopy(model), args=TrainingArguments(**_kw(tmp_path / "plain", max_steps=2)),
                    train_dataset=_data())
    plain.train()
    ckpt = tmp_path / "plain" / "checkpoint-2"
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    state["param_groups"] = [{**state["param_groups"][0], "params": state["param_groups"][0]["params"][:-1]},
                             *state["param_groups"][1:]]
    torch.save(state, ckpt / "optimizer.pt")
    ours = MegaTrainTrainer(model=copy.deepcopy(model),
                            args=MegaTrainTrainingArguments(**_kw(tmp_path / "ours", max_steps=3)),
                            train_dataset=_data())
    with pytest.raises(Exception, match="parameter groups"):
        ours.train(resume_from_checkpoint=str(ckpt))


def test_megatrain_checkpoint_tells_plain_trainer_users_how_to_resume(tmp_path):
    from hf_megatrain.checkpoint.plain_trainer import RESUME_NOTE

    ours = MegaTrainTrainer(model=tiny("llama"), args=MegaTrainTrainingArguments(**_kw(tmp_path, max_steps=2)),
                            train_dataset=_data())
    ours.train()
    folder = tmp_path / "checkpoint-2"
    assert not (folder / "optimizer.pt").exists()  # (plain Trainer resumes AdamW only from that)
    note = (folder / RESUME_NOTE).read_text()
    assert "MegaTrainTrainer" in note and "restarts AdamW and the" in note
    import json
    assert RESUME_NOTE in json.loads((folder / "megatrain_manifest.json").read_text())["files"]


def test_unverifiable_checkpoint_is_refused_unless_accepted_knowingly(tmp_path):
    ours = MegaTrainTrainer(model=tiny("llama"), args=MegaTrainTrainingArguments(**_kw(tmp_path, max_steps=2)),
                            train_dataset=_data())
    ours.train()
    folder = tmp_path / "checkpoint-2"
    (folder / "megatrain_manifest.json").unlink()
    again = MegaTrainTrainer(model=tiny("llama"), args=MegaTrainTrainingArguments(**_kw(tmp_path / "b", max_steps=3)),
                             train_dataset=_data())
    with pytest.raises(Exception, match="manifest"):
        again.train(resume_from_checkpoint=str(folder))
    knowingly = MegaTrainTrainer(model=tiny("llama"), train_dataset=_data(), args=MegaTrainTrainingArguments(
        **_kw(tmp_path / "c", max_steps=3), megatrain_allow_unverified_checkpoint=True))
    knowingly.train(resume_from_checkpoint=str(folder))
    assert knowingly.state.global_step == 3


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_resumed_hyper_parameters_are_the_checkpoint_s_as_in_plain_trainer(tmp_path):
    """Plain Trainer's resume takes each group's betas / eps / weight decay from optimizer.pt (torch's
    load_state_dict), whatever the new arguments say; so does hf_megatrain's."""
    model = tiny("llama")
    plain = Trainer(model=copy.deepcopy(model), train_dataset=_data(),
                    args=TrainingArguments(**_kw(tmp_path / "plain", adam_beta2=0.99, adam_epsilon=1e-6)))
    plain.train()
    reference = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    ours = MegaTrainTrainer(model=copy.deepcopy(model), args=MegaTrainTrainingArguments(**_kw(tmp_path / "ours")),
                            train_dataset=_data())
    ours.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    assert ours.optimizer.param_groups[0]["betas"] == (0.9, 0.99) and ours.optimizer.param_groups[0]["eps"] == 1e-6
    worst = max(rel(ours.engine.store.master_tensor(n), reference[n]) for n in reference)
    assert worst <= 1e-5, worst
