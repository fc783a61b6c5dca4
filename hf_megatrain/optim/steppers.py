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
``prepare()`` runs on the main thread before the worker that calls ``run`` starts. ``update``'s optional fourth
argument is the ``kernels.UpdatePart`` of a split update (optim/split_update.py): ``KernelStepper`` splits the units
in its ``split`` set, which the optimizer sets before each launch.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..core.kernels import UpdatePart
from ..core.step_state import StepState
from ..core.store import Unit

Update = Callable[..., None]  # (unit, [master, grad, exp_avg, exp_avg_sq], refresh[, part])


class UnitStepper(Protocol):
    def prepare(self) -> None: ...

    def run(self, units: list[Unit], update: Update) -> None: ...


class KernelStepper:
    """HOST or DEVICE units: the kernel runs where the unit's buffers are (CPU threads, or GPU launches)."""

    def __init__(self, state: StepState, grad_of: Callable[[Unit], torch.Tensor]) -> None:
        self.state = state
        self.grad_of = grad_of  # the unit's gradient as this step holds it (FP32, or narrow: engine/offload.py)
        self.split: frozenset[int] = frozenset()  # units whose update this launch splits (set before it starts)

    def prepare(self) -> None:
        pass

    def run(self, units: list[Unit], update: Update) -> None:
        deferred: list[tuple[Unit, list[torch.Tensor]]] = []
        for u in units:
            flats = [u.master, self.grad_of(u), u.exp_avg, u.exp_avg_sq]
            if u.index in self.split:
                with torch.profiler.record_function("megatrain.optimizer.host_unit_weights"):
                    update(u, flats, True, UpdatePart.WEIGHTS)
                self.state.finish_weights(u.index)
                deferred.append((u, flats))
                continue
            with torch.profiler.record_function("megatrain.optimizer.host_unit"):
                update(u, flats, True)
            self.state.finish_update(u.index)
        for u, flats in reversed(deferred):  # (the backward lands the last layer's gradient first)
            with torch.profiler.record_function("megatrain.optimizer.host_unit_state"):
                update(u, flats, False, UpdatePart.STATE)
            self.state.finish_update(u.index)
