"""The examples' data travels in the wheel: the default job (hf/default_job.py) runs from an installed package
without the checkout (``examples/`` is not in the wheel; its data is package data, hf_megatrain/examples_data/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import os, sys
import hf_megatrain
from hf_megatrain.hf import default_job
assert hf_megatrain.__file__.startswith(sys.argv[1]), hf_megatrain.__file__  # the wheel's copy, not the checkout
tok = default_job.load_tokenizer()
assert len(tok) == default_job.VOCAB_SIZE
assert all(os.path.getsize(f) > 0 for f in default_job.data_files().values())
assert (default_job.ACCURACY_METRIC / "accuracy.py").is_file()
print("ok", default_job.tiny_llama_config(tok).vocab_size)
"""


@pytest.mark.slow  # (spawns pip and a fresh interpreter)
def test_the_wheel_carries_the_default_jobs_data(tmp_path):
    src = tmp_path / "src"  # (a copy: no build/ folder in the checkout, nothing stale from an earlier build)
    src.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hf_megatrain", src / "hf_megatrain", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("hf_megatrain-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    for f in ("data/train.txt", "data/validation.txt", "tokenizer/tokenizer.json", "metrics/accuracy/accuracy.py"):
        assert f"hf_megatrain/examples_data/{f}" in names, f
    r = subprocess.run([sys.executable, "-c", CHILD, str(site)], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                            "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]
