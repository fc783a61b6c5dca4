"""Whether a fused-loss library (Liger-Kernel, Cut Cross-Entropy) can run here: one check for every one of them."""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch


def unavailable(device: torch.device, name: str, package: str, module: str, load: Callable[[], object]) -> str | None:
    """Why ``package`` (imported as ``module``, its kernel fetched by ``load``) cannot run on ``device``; None
    when it can."""
    if device.type != "cuda":
        return f"{name} runs Triton kernels on CUDA only (device {device})"
    if importlib.util.find_spec(module) is None:
        return f"{package} is not installed (pip install {package})"
    try:
        load()
    except Exception as e:  # a broken install (no triton, ABI mismatch) must not look like "installed"
        return f"{package} does not import: {type(e).__name__}: {e}"
    return None
