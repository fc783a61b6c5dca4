"""StepReplay: one training forward kept until its step ends, so the step's forward+backward can run again exactly.

The lean optimizer (optim/lean.py) re-runs a step whose clip factor it did not know while the layer gradients
streamed by; the step state holds the replay of the step in progress (``StepState.replay``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Callable, Iterator

import torch


class StepReplay:
    """One training forward kept until its step ends, so the step's forward+backward can run again exactly:
    the inputs, the RNG states and autocast state it started with, train/eval mode, and the gradients the backward
    fed into its outputs (the loss as the user scaled it, or the logits)."""

    def __init__(self, kwargs: dict[str, Any], device: torch.device, training: bool,
                 runner: Callable[["StepReplay"], None]) -> None:
        self.runner = runner  # runs forward + ``backward`` under ``replaying`` (the engine's)
        self.kwargs = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        self.device = device
        self.training = training
        self.cpu_rng = torch.get_rng_state()
        self.dev_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                         for t in dict.fromkeys(("cpu", device.type))}
        self.grads: dict[str, torch.Tensor] = {}

    def watch(self, outputs: dict[str, torch.Tensor | None], on_backward: Callable[["StepReplay"], None]) -> None:
        """Capture the gradient each output receives; ``on_backward(self)`` runs when the first one arrives."""
        for name, t in outputs.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(partial(self._capture, name, on_backward))

    def _capture(self, name: str, on_backward: Callable[["StepReplay"], None], grad: torch.Tensor) -> None:
        on_backward(self)
        self.grads[name] = grad.detach().clone()

    @contextmanager
    def replaying(self, model: torch.nn.Module) -> Iterator[None]:
        """Run with the recorded RNG / autocast / mode and gradients on; the caller's RNG state is restored after,
        so the re-run draws no random numbers from the training's stream."""
        cuda = self.dev_rng is not None
        was_training = model.training
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[self.device] if cuda else [],
                                                      device_type="cuda" if cuda else "cpu"))
            torch.set_rng_state(self.cpu_rng)
            if cuda:
                torch.cuda.set_rng_state(self.dev_rng, self.device)
            for t, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(t, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            model.train(self.training)
            try:
                yield
            finally:
                model.train(was_training)

    def backward(self, outputs: dict[str, torch.Tensor | None]) -> None:
        pairs = [(outputs[n], g) for n, g in self.grads.items() if outputs.get(n) is not None]
        if not pairs:
            raise RuntimeError("lean_store: the recorded forward received no gradient; nothing to re-run")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def rerun(self) -> None:
        """Run the recorded forward+backward again."""
        self.runner(self)
