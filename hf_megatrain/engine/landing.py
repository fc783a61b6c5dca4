"""GradientLanding: the one place a step's gradients land, and the engine's side of the step the optimizer owns.

The optimizer (optim/adamw.py) owns the step and runs it in named phases; it is handed this object at
construction (typed as ``optim.gradient_path.GradientPath``) and calls it directly:

    land      the executor's gradients in flight (D2H copies into host buffers: engine/offload.py), then the resident
              parameters' compute-dtype ``.grad`` added into the resident unit's FP32 gradient
    discard   the step's gradients dropped (a skipped step, ``zero_grad``): unit phases, the recorded forward, and
              the "last backward" mark
    rerun     the lean store's second forward+backward of the step (engine/replay.py)

It also holds what only the engine decides about the step in progress: whether the backward is the step's last
(``set_final_backward``, the one writer; the offload reads it) and the recorded forward of a lean step (``replay``).
In the step's last backward every landing is handed to the optimizer (the gradient sink) by whoever lands it: the
offload for layers, this module for the resident unit, the optimizer itself for the units no backward reached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.step_state import StepState
from ..core.store import Unit

if TYPE_CHECKING:
    from .executor import StreamingExecutor
    from .replay import StepReplay


class GradientLanding:
    def __init__(self, state: StepState, executor: StreamingExecutor, resident: Unit,
                 resident_params: dict[str, nn.Parameter], early_names: frozenset[str] = frozenset()) -> None:
        self.state, self.executor = state, executor
        self.resident, self.resident_params = resident, resident_params
        self.replay: StepReplay | None = None  # the recorded forward of the step being computed (lean store)
        # Resident parameters whose gradient is final once the loss's backward has run (an untied output head):
        # ``land_early`` lands them before the layers' backward, and which of them a backward reached is kept here
        # until the land phase records it.
        self.early_names = early_names
        self._early: dict[str, bool] = {}

    # -- the step's last backward --------------------------------------------------------------------------------------
    @property
    def final_backward(self) -> bool:
        return self.executor.grads.final_backward

    def set_final_backward(self, final: bool) -> None:
        """The backward about to run is (or is not) the step's last; stays set until the step's gradients are
        discarded or the next call."""
        self.executor.grads.final_backward = bool(final)

    # -- phases --------------------------------------------------------------------------------------------------------
    @property
    def unlanded(self) -> bool:
        """A backward produced gradients that ``land`` has not landed yet (an accumulation step's next forward
        lands them first, so the next backward adds to FP32 values)."""
        return self.executor.grads.unlanded or any(p.grad is not None for p in self.resident_params.values())

    def land(self) -> None:
        """Land every gradient in flight: the one place gradients land (the optimizer's *land* phase, before the
        next forward of an accumulation, before ``parameters()`` hands them out)."""
        self.executor.land()
        self._land_resident()

    def land_early(self) -> list[torch.Tensor]:
        """The step's last backward has sent its first layer gradient, so the loss's backward is over: land the
        ``early_names`` parameters' gradients into the resident unit's FP32 gradient now (added to what earlier
        micro-batches landed; zeros where this backward reached none), so their reduction over data-parallel ranks
        can run beside the layers' backward. Returns their flat views of the unit's gradient."""
        u = self.resident
        if not self.early_names or u.grad is None:
            return []
        first = not self.state.has_grad(u.index)
        out = []
        for p in u.params:
            if p.name not in self.early_names:
                continue
            g, dst = self.resident_params[p.name].grad, u.view(u.grad, p)
            if g is None:
                if first:
                    dst.zero_()
            elif first:
                dst.copy_(g)
            else:
                dst.add_(g.to(torch.float32))
            self.resident_params[p.name].grad = None
            self._early[p.name] = g is not None
            out.append(u.grad[p.offset:p.offset + p.numel])
        return out

    def _land_resident(self) -> None:
        """The resident parameters' compute-dtype ``.grad`` into the unit's FP32 gradient (those ``land_early``
        landed already are only recorded)."""
        u = self.resident
        grads = {p.name: self.resident_params[p.name].grad for p in u.params}
        early, self._early = self._early, {}
        late = [n for n in early if grads[n] is not None]
        if late:  # (its reduction over the ranks has run without this part: refuse rather than train on it)
            raise RuntimeError(f"hf_megatrain: the gradient of {late[0]} grew after the loss's backward (this model "
                               "uses its output head's weight elsewhere too). With several processes that gradient "
                               "is averaged as soon as the loss's backward ends, so this step cannot be trained "
                               "exactly: train this model with one process, and please report it")
        if all(g is None for g in grads.values()) and not early:
            return
        first = self.state.accumulate(u.index)
        self.executor.reach.record(u.index, [early[n] if n in early else grads[n] is not None for n in grads], first)
        for p in u.params:
            if p.name in early:
                continue
            g, dst = grads[p.name], u.view(u.grad, p)
            if g is None:  # no gradient reached this parameter: it contributes zeros
                if first:
                    dst.zero_()
                continue
            if first:
                dst.copy_(g)
            else:
                dst.add_(g.to(torch.float32))
            self.resident_params[p.name].grad = None
        self.executor.grads.landed(u.index, None)

    def zero_unreached(self) -> None:
        """Once any unit has a gradient, units no backward reached get a zero one (what ``parameters()`` shows)."""
        if not self.state.any_grad():
            return
        for u in [*self.executor.units, self.resident]:
            if u.grad is not None and not self.state.has_grad(u.index):  # (a lean unit has no buffer to zero)
                self.state.wait_state(u.index)  # (a split update's second pass may still read it)
                u.grad.zero_()
                self.state.accumulate(u.index)
                self.executor.grads.landed(u.index, None)
                self.executor.reach.record(u.index, [False] * len(u.params), first=True)  # none reached

    def discard(self) -> None:
        """Drop every gradient of the step: units become READY (masters unchanged), the step is over."""
        self._early = {}
        self.state.discard()
        self.replay = None
        self.set_final_backward(False)

    def rerun(self) -> None:
        """Run the step's recorded forward+backward again (same inputs, RNG, autocast, weights)."""
        if self.replay is None:
            raise RuntimeError("hf_megatrain: lean_store must re-run this step's forward+backward, but no training "
                               "forward of it was recorded (was the backward run on the engine's outputs?)")
        self.replay.rerun()
