"""Progress on long work (issue 47, item 6): converting a model, ``from_pretrained_streamed``, checkpoint saves,
verification and loads show a tqdm bar of bytes and their rate, as transformers shows its own (loading shards);
quiet when the caller asks (``show_progress=False``: ``TrainingArguments.disable_tqdm``), when transformers'
progress bars are off, and where stderr is not a terminal."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, MegaTrainTrainer
from hf_megatrain import checkpoint as ckpt
from hf_megatrain.hf.pretrained import from_pretrained_streamed

from .models import tiny

CFG = MegaTrainConfig(compute_dtype="float32")
SAVES = ["Saving model", "Saving training state", "Verifying checkpoint", "Loading weights", "Loading optimizer state"]


class _Terminal(io.StringIO):
    """stderr as a terminal (tqdm draws only there)."""

    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch, out: io.StringIO | None = None) -> io.StringIO:
    """Make ``out`` (a terminal by default) stderr, from inside the test (pytest's capture puts its own stderr back
    between a fixture's setup and the test)."""
    out = _Terminal() if out is None else out
    monkeypatch.setattr(sys, "stderr", out)
    return out


@pytest.fixture
def bars():
    """Every bar made through transformers' tqdm as (its description, the bar), drawn as usual (a bar made off,
    where tqdm keeps no description, is still listed under the one it was given)."""
    made: list = []

    def hook(factory, args, kwargs):
        made.append((kwargs.get("desc"), factory(*args, **kwargs)))
        return made[-1][1]

    previous = hf_logging.set_tqdm_hook(hook)
    try:
        yield made
    finally:
        hf_logging.set_tqdm_hook(previous)


def _data_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensors (the file less its header)."""
    with open(path, "rb") as f:
        return path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]


def _checkpoint_round_trip(root: Path, show: bool = True) -> Path:
    """A Trainer checkpoint's save, verify and load, as the Trainer runs them (hf/trainer.py)."""
    engine = MegaTrainEngine(tiny("llama"), CFG, device="cpu")
    engine.create_optimizer(lr=1e-3)
    out = root / "checkpoint-1"
    with ckpt.atomic_directory(str(out)) as tmp:
        ckpt.save_pretrained_streamed(engine, tmp, dtype=torch.bfloat16, show_progress=show)
        ckpt.save_training_state(engine, tmp, master=True, show_progress=show)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"global_step": 1}, f)
        ckpt.write_manifest(tmp)
    ckpt.verify_checkpoint(str(out), show_progress=show)
    ckpt.load_pretrained_into_engine(engine, str(out), show_progress=show)
    assert ckpt.load_training_state(engine, str(out), show_progress=show)
    return out


def test_checkpoint_save_verify_load_show_their_bytes(tmp_path, monkeypatch, bars):
    terminal = _terminal(monkeypatch)
    out = _checkpoint_round_trip(tmp_path)
    by = dict(bars)
    assert list(by) == ["Converting model", *SAVES]
    for desc, b in bars:  # every byte announced was counted, and the bar was in bytes
        assert b.n == b.total > 0 and b.unit == "B" and b.unit_scale, (desc, b.n, b.total)
    files = sorted(out.iterdir())
    assert by["Saving model"].total == sum(_data_bytes(p) for p in files if p.name.startswith("model"))
    assert by["Saving training state"].total == sum(_data_bytes(p) for p in files if p.suffix == ".safetensors"
                                                    and p.name.startswith("megatrain_"))
    assert by["Verifying checkpoint"].total == sum(p.stat().st_size for p in files if p.name != ckpt.MANIFEST)
    assert by["Loading weights"].total >= sum(_data_bytes(p) for p in files if p.name.startswith(ckpt.MASTER_PREFIX))
    assert by["Loading optimizer state"].total >= _data_bytes(out / ckpt.OPTIMIZER_TENSORS)
    text = terminal.getvalue()
    for desc in SAVES:  # drawn as tqdm draws a byte bar: 100%, sizes in B / kB / MB, the rate
        assert re.search(re.escape(desc) + r": 100%\|.*\| [\d.]+[kMGT]?/[\d.]+[kMGT]? \[.*[kMG]?B/s\]", text), text


def test_conversion_and_from_pretrained_streamed_show_their_bytes(tmp_path, monkeypatch, bars):
    terminal = _terminal(monkeypatch)
    model = tiny("llama")
    model.save_pretrained(tmp_path / "hf")
    bars.clear()  # (transformers' own "Writing model shards")
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    MegaTrainEngine(model, CFG, device="cpu")  # an in-memory model: its layers' weights are copied into the store
    assert [(desc, b.n, b.total) for desc, b in bars] == [("Converting model", layers, layers)]
    bars.clear()
    engine = from_pretrained_streamed(str(tmp_path / "hf"), CFG, device="cpu")  # meta layers: nothing converted
    (desc, bar), = bars
    assert desc == "Loading weights"
    assert bar.n == bar.total >= sum(t.numel() * 4 for _, t in engine.named_master_tensors())
    assert re.search(r"Loading weights: 100%\|.*B/s\]", terminal.getvalue())


@pytest.mark.parametrize("quiet", ["show_progress=False", "transformers' bars off", "stderr not a terminal"])
def test_quiet_when_asked_or_not_a_terminal(tmp_path, monkeypatch, bars, quiet):
    stderr = _terminal(monkeypatch, io.StringIO() if quiet == "stderr not a terminal" else None)
    was_on = hf_logging.is_progress_bar_enabled()
    if quiet == "transformers' bars off":
        hf_logging.disable_progress_bar()
    try:
        show = quiet != "show_progress=False"
        _checkpoint_round_trip(tmp_path, show=show)
        model = tiny("llama")
        model.save_pretrained(tmp_path / "hf")
        if show:  # (conversion takes no switch of its own: transformers' and the terminal's hold)
            MegaTrainEngine(model, CFG, device="cpu")
        from_pretrained_streamed(str(tmp_path / "hf"), CFG, device="cpu", show_progress=show)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    text = stderr.getvalue()
    ours = SAVES if quiet == "show_progress=False" else ["Converting model", *SAVES]
    assert not [desc for desc in ours if desc in text], text
    made = [desc for desc, _ in bars if desc in ours]
    if quiet == "show_progress=False":
        assert not made  # (no bar is made at all)
    else:  # made, and off: transformers' empty bar, or tqdm's own off where stderr is no terminal
        assert set(made) == set(ours)
        off = [isinstance(b, hf_logging.EmptyTqdm) if quiet == "transformers' bars off" else b.disable and b.n == 0
               for desc, b in bars if desc in ours]
        assert all(off), off


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_trainer_checkpoints_follow_disable_tqdm(tmp_path, monkeypatch, bars, disable_tqdm):
    """MegaTrainTrainer's conversion of the model, its checkpoint save and a resume from it show the bars unless
    ``disable_tqdm``."""
    from .test_trainer import dataset, mt_args

    terminal = _terminal(monkeypatch)
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2, disable_tqdm=disable_tqdm)
    MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "a", **kw), train_dataset=dataset(8)).train()
    MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "b", **kw), train_dataset=dataset(8)).train(
        resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    every = ["Converting model", *SAVES]
    shown = [desc for desc in every if re.search(re.escape(desc) + r": 100%\|.*B/s\]", terminal.getvalue())]
    assert shown == ([] if disable_tqdm else every), terminal.getvalue()
