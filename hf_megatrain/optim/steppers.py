"""One stepper per kind of unit (core/plan.py ``Stepper``), behind one interface, chosen from the plans once.

    HOST             ``KernelStepper``: the AdamW kernel on the CPU, where master, gradient and moments live
    DEVICE           ``KernelStepper``: the same kernel launched on the GPU, where all of them live (GPU-resident)
    DEVICE_STREAMED  ``DeviceStepper`` (device_stepper.py): master (and moments) streamed to the GPU, the kernel
                     there, the new state streamed back, pipelined over its units
    LEAN             no gradient buffer, so never launched: each unit is updated as its gradient is consumed
                     (``LeanAdamW.consume``, optim/lean.py)

``run(units, update)`` steps ``units`` in the order given and moves each through the step state
(``finish_update``; ``publish_copy`` where new weights are on the GPU before they are back in host memory).
``update(unit, [master, grad, exp_avg, exp_avg_sq], refresh)`` is the optimizer's: one AdamW update on whichever
buffers the stepper hands it (hyper-parameters, clip factor and per-parameter step counts are the same for every
kind, so the math does not depend on who steps a unit); ``refresh``: also write the unit's compute copy.
``prepare()`` runs on the main thread before the worker that calls ``run`` starts.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..core.step_state import StepState
from ..core.store import Unit

Update = Callable[[Unit, list[torch.Tensor], bool], None]


class UnitStepper(Protocol):
    def prepare(self) -> None: ...

    def run(self, units: list[Unit], update: Update) -> None: ...


class KernelStepper:
    """HOST or DEVICE units: the kernel runs where the unit's buffers are (CPU threads, or GPU launches)."""

    def __init__(self, state: StepState, grad_of: Callable[[Unit], torch.Tensor]) -> None:
        self.state = state
        self.grad_of = grad_of  # the unit's gradient as this step holds it (FP32, or narrow: engine/offload.py)

    def prepare(self) -> None:
        pass

    def run(self, units: list[Unit], update: Update) -> None:
        for u in units:
            with torch.profiler.record_function("megatrain.optimizer.host_unit"):
                update(u, [u.master, self.grad_of(u), u.exp_avg, u.exp_avg_sq], True)
            self.state.finish_update(u.index)
