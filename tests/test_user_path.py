"""What a user meets on the documented path (issue 47): the example resumes, the launcher keeps the yaml's section,
the run summary says what happened in plain words and stays out of what is uploaded."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--max_steps", "4", "--logging_steps", "1", "--eval_strategy", "no", "--block_size", "32",
        "--per_device_train_batch_size", "2", "--max_eval_samples", "2", "--save_strategy", "steps",
        "--save_steps", "2", "--use_cpu", "--disable_tqdm", "true"]


def example():
    """examples/train.py as a module: its ``main(argv)`` is the command line without a new interpreter."""
    spec = importlib.util.spec_from_file_location("megatrain_example_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def fingerprint(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every file's md5, inode and mtime: an atomic re-save (new files renamed in) changes the inodes even when it
    writes the same bytes."""
    out = {}
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            st = f.stat()
            out[str(f.relative_to(folder))] = (hashlib.md5(f.read_bytes()).hexdigest(), st.st_ino, st.st_mtime_ns)
    return out


@pytest.mark.slow  # three short runs of the example (~10 s)
def test_example_resumes_from_checkpoint_and_leaves_it_alone(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("MEGATRAIN_")]:
        monkeypatch.delenv(k)
    train = example()
    out = tmp_path / "run"
    first = train.main([*TINY, "--output_dir", str(out)])
    assert first["global_step"] == 4 and first["start_step"] == 0
    ckpt2, ckpt4 = out / "checkpoint-2", out / "checkpoint-4"
    before = fingerprint(ckpt2)

    # An explicit path: training goes on from its step; the checkpoint it started from is not written again.
    second = train.main([*TINY, "--max_steps", "6", "--output_dir", str(out), "--resume_from_checkpoint", str(ckpt2)])
    assert second["start_step"] == 2 and second["global_step"] == 6
    assert fingerprint(ckpt2) == before
    assert (out / "checkpoint-6").is_dir()

    # "true", as Trainer.train(resume_from_checkpoint=True): the last checkpoint of output_dir.
    marks = fingerprint(out / "checkpoint-6")
    third = train.main([*TINY, "--max_steps", "8", "--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert third["start_step"] == 6 and third["global_step"] == 8 and fingerprint(out / "checkpoint-6") == marks

    # Left out, a folder with checkpoints resumes from the last one (run_clm.py's "Detecting last checkpoint") ...
    fourth = train.main([*TINY, "--max_steps", "10", "--output_dir", str(out)])
    assert fourth["start_step"] == 8 and fourth["global_step"] == 10
    # ... unless --overwrite_output_dir: then it starts again from step 0.
    fresh = train.main([*TINY, "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(out),
                        "--overwrite_output_dir"])
    assert fresh["start_step"] == 0 and fresh["global_step"] == 2
    assert ckpt4.is_dir()
