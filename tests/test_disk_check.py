"""A checkpoint's size, known before training (issue 46 part 4): the run summary and ``megatrain estimate`` print it
(one formula, checkpoint/space.py), it matches the bytes a save writes, and a run whose checkpoints cannot fit the
output folder's free space is refused before the first step with both numbers (hf/disk_check.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil

import pytest
import torch

from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments, planner
from hf_megatrain.checkpoint.space import checkpoints_at_once
from hf_megatrain.core.memory import format_bytes

from .models import tiny

# Large enough that the checkpoint's small files (JSON, RNG, scheduler, headers: tens of KB) are ~1 % of it.
WIDE = dict(hidden_size=128, intermediate_size=256, vocab_size=512)


def _data(n: int = 8, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 96, (n, seq), generator=g)]


def _trainer(out, model=None, config=None, **over) -> MegaTrainTrainer:
    kw = dict(output_dir=str(out), max_steps=3, use_cpu=True, report_to=[], per_device_train_batch_size=2,
              save_strategy="steps", save_steps=2, disable_tqdm=True, learning_rate=1e-3, dataloader_num_workers=0)
    kw.update(over)
    args = MegaTrainTrainingArguments(**kw, megatrain_config={"compute_dtype": "float32", **(config or {})})
    return MegaTrainTrainer(model=model if model is not None else tiny("llama"), args=args, train_dataset=_data())


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**13, 10**13 - free, free))


def _checkpoint_bytes(trainer: MegaTrainTrainer) -> int:
    with open(os.path.join(trainer.args.output_dir, "_megatrain_run.json")) as f:
        return json.load(f)["checkpoint"]["bytes"]


def _folder_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16"])  # (bfloat16: the FP32 master is written beside it)
def test_summary_and_estimate_give_the_bytes_one_save_writes(tmp_path, caplog, capsys, save_dtype):
    model = tiny("llama", **WIDE)
    model.config.save_pretrained(tmp_path / "config")
    trainer = _trainer(tmp_path / "run", model, {"save_dtype": save_dtype}, max_steps=1, save_steps=1)
    with caplog.at_level(logging.INFO, logger="hf_megatrain"):
        trainer.train()
    said = _checkpoint_bytes(trainer)
    written = _folder_bytes(tmp_path / "run" / "checkpoint-1")
    assert said <= written and said == pytest.approx(written, rel=0.03), (said, written)  # (+ the small files)
    n = trainer.engine.num_parameters()
    assert said == n * (4 if save_dtype == "float32" else 2 + 4) + 8 * n  # export [+ FP32 master] + AdamW m, v
    assert any(f"checkpoint: {format_bytes(said)} per Trainer checkpoint" in r.getMessage() for r in caplog.records)
    # megatrain estimate: the same formula over the config's parameter counts, the same bytes
    cfg = ["--config", str(tmp_path / "megatrain.yaml")]
    (tmp_path / "megatrain.yaml").write_text(f"save_dtype: {save_dtype}\n")
    capsys.readouterr()  # (what training printed)
    assert planner.main([str(tmp_path / "config"), "--seq-len", "64", "--json", *cfg]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"]["trainer_bytes"] == said
    assert planner.main([str(tmp_path / "config"), "--seq-len", "64", *cfg]) == 0
    assert format_bytes(said) in capsys.readouterr().out


def test_run_whose_checkpoints_do_not_fit_is_refused_before_the_first_step(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    _free(monkeypatch, 10**5)  # 100 KB free; no save_total_limit: both saves (steps 2 and 3) stay
    with pytest.raises(ValueError, match="do not fit") as e:
        trainer.train()
    one = _checkpoint_bytes(trainer)  # (the run summary is written before the check)
    msg = str(e.value)
    assert f"{format_bytes(2 * one)} needed, {format_bytes(10**5)} free" in msg, msg
    assert f"{2 * one:,} > {10**5:,} bytes" in msg
    for fix in ("output_dir", "save_total_limit=1", "save_only_model=True", "megatrain_skip_disk_check=True"):
        assert fix in msg, (fix, msg)
    assert trainer.state.global_step == 0 and not any(f.startswith("checkpoint") for f in os.listdir(tmp_path))


def test_save_total_limit_counts_the_checkpoint_written_before_the_oldest_goes(tmp_path, monkeypatch):
    one = _checkpoint_bytes(_started(tmp_path / "probe"))
    # save_total_limit=1 over 4 saves: the new checkpoint and the one it replaces (2) exist at once
    trainer = _trainer(tmp_path / "a", max_steps=4, save_steps=1, save_total_limit=1)
    _free(monkeypatch, 2 * one - 1)
    with pytest.raises(ValueError, match=r"save_total_limit=1: a new checkpoint is written before the oldest is "
                                         r"removed, so 2 new ones coexist") as e:
        trainer.train()
    assert f"{format_bytes(2 * one)} needed" in str(e.value)
    _free(monkeypatch, 2 * one + 10**6)  # (+ the small files)
    trainer = _trainer(tmp_path / "b", max_steps=4, save_steps=1, save_total_limit=1)
    trainer.train()
    assert sorted(os.listdir(tmp_path / "b")) == ["_megatrain_run.json", "checkpoint-4"]
    # checkpoints already in the folder occupy the disk already: with save_total_limit=2 and one there, 2 more
    assert checkpoints_at_once(2, 4, existing=1, keep_best=False) == 2
    assert checkpoints_at_once(2, 4, existing=5, keep_best=False) == 1  # (rotated down after the first new one)
    assert checkpoints_at_once(1, 4, existing=0, keep_best=True) == 3  # (the best one kept beside the newest)
    assert checkpoints_at_once(None, 7, existing=3, keep_best=False) == 7 and checkpoints_at_once(3, 1, 0, False) == 1


def _started(out) -> MegaTrainTrainer:
    """A trainer that wrote its run summary (0 steps: save_strategy "no")."""
    trainer = _trainer(out, save_strategy="no", max_steps=1)
    trainer.train()
    return trainer


def test_save_strategy_no_never_checks_and_skip_key_starts_anyway(tmp_path, monkeypatch):
    _free(monkeypatch, 0)
    trainer = _started(tmp_path / "no")  # nothing to save: no check, the run trains
    assert trainer.state.global_step == 1
    trainer = _trainer(tmp_path / "skip", megatrain_skip_disk_check=True)
    with pytest.raises(OSError) as e:  # started; the first save then refuses without writing (staged.py)
        trainer.train()
    assert e.value.errno == errno.ENOSPC and trainer.state.global_step == 2
    assert not any(f.startswith("checkpoint-") for f in os.listdir(tmp_path / "skip"))


def test_save_only_model_checks_the_export_alone(tmp_path, monkeypatch):
    one = _checkpoint_bytes(_started(tmp_path / "probe"))
    n = sum(p.numel() for p in tiny("llama").parameters())
    _free(monkeypatch, 2 * 4 * n + 10**5)  # two FP32 exports fit, two full checkpoints (2 x 12 B/param) do not
    assert one == 12 * n and 2 * one > 2 * 4 * n + 10**5
    trainer = _trainer(tmp_path / "run", save_only_model=True)
    trainer.train()
    assert trainer.state.global_step == 3


def _refused_rank(rank: int, world: int, out: str, shm: str, results: str) -> None:
    """One data-parallel rank: the main process's disk has 100 KB free; any other rank's check would fail loudly
    (only the main process checks). The ValueError this rank raises goes to ``results/error_<rank>``."""
    from tests.test_trainer import dataset, mt_args

    def disk_usage(path):
        assert rank == 0, "a rank other than the main process checked the disk"
        return shutil._ntuple_diskusage(10**13, 10**13 - 10**5, 10**5)

    args = mt_args(out, config=dict(compute_dtype="float32", shared_memory_dir=shm), max_steps=2,
                   per_device_train_batch_size=2, ddp_backend="gloo", ddp_timeout=60, save_strategy="steps",
                   save_steps=1)
    trainer = MegaTrainTrainer(model=tiny("llama"), args=args, train_dataset=dataset())
    shutil.disk_usage = disk_usage  # (a forked child: the test process keeps its own; after the shared store)
    try:
        trainer.train()
    except ValueError as e:
        with open(os.path.join(results, f"error_{rank}"), "w") as f:
            f.write(f"{trainer.state.global_step} {e}")


@pytest.mark.slow  # forks 2 processes
def test_data_parallel_ranks_refuse_together_on_the_main_process_verdict(tmp_path):
    from . import save_workers as S

    shm, res, run = tmp_path / "shm", tmp_path / "res", tmp_path / "run"
    shm.mkdir()
    res.mkdir()
    assert S.launch(_refused_rank, 2, str(run), str(shm), str(res)) == [0, 0]
    for rank in range(2):
        error = (res / f"error_{rank}").read_text()
        assert error.startswith("0 hf_megatrain: this run's checkpoints do not fit") and "97.7 KiB free" in error
