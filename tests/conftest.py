"""Shared fixtures: tiny HF models built from configs in code (no Hub), fresh random data."""

from __future__ import annotations

import os

# The overlapped optimizer runs OpenMP kernels on a worker thread while the main thread runs its own; with
# OpenMP's default spin-waiting the two fight over 2 CPU cores (a tiny step went from 0.05 s to 0.8 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield
