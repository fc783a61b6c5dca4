"""The two typed seams between the engine's gradient path and the optimizer, so neither reaches into the other.

``GradientPath`` is what the optimizer (the owner of the step, optim/adamw.py) is handed at construction by the
engine (engine/landing.py implements it): the *land* phase of ``step()`` is one call to ``land()``, a dropped step
is ``discard()``, and the lean store's re-run of a step's forward+backward is ``rerun()``.

``GradientSink`` is what the engine hands each landed gradient to (engine/offload.py holds the one sink, the
optimizer, attached where the engine creates it): in the step's last backward a host unit's final gradient goes to
``landed`` (the speculative update starts there: a direct call from whoever lands it), and a lean unit's gradient,
which has no buffer to land in, goes to ``consume``. Nothing registers call-backs on the step state.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class GradientPath(Protocol):
    @property
    def final_backward(self) -> bool:
        """The backward in progress (or just run) is the step's last: gradients that land now are final."""
        ...

    def land(self) -> None:
        """Land every gradient in flight where the plans keep them (the executor's copies, the resident ``.grad``)."""
        ...

    def discard(self) -> None:
        """Drop every gradient of the step (a skipped step, ``zero_grad``): the step is over."""
        ...

    def rerun(self) -> None:
        """Run the step's recorded forward+backward again (lean store); its gradients reach ``consume`` again."""
        ...

    def land_early(self) -> list[torch.Tensor]:
        """Land the resident gradients the loss's backward has finished (an untied output head) now, before the
        layers' backward ends; their flat views of the resident unit's FP32 gradient."""
        ...


class GradientSink(Protocol):
    def first_layer_gradient(self) -> None:
        """The step's last backward sends its first layer gradient (every rank at the same point of its backward):
        the loss's backward, and the output head's gradient, are done."""
        ...

    def landed(self, unit: int, sq: float | None) -> None:
        """The step's last backward: ``unit``'s gradient is final where its plan keeps it (``sq``: its squared
        norm, read on the host, when a single visit produced it)."""
        ...

    def plane_slab(self, unit: int, dtype: torch.dtype | None) -> torch.Tensor | None:
        """Where a lean unit's gradient arriving in ``dtype`` should land instead of a staging slab (its slice of
        the lean store's gradient plane, optim/grad_plane.py), or None."""
        ...

    def consume(self, unit: int, slab: torch.Tensor, sq: torch.Tensor, ready: Any) -> Callable[[], None]:
        """A lean unit's gradient is on its way into host ``slab`` (``sq``: its squared-norm cell, ``ready``: the
        copy's event); returns a wait() that returns once the slab may be reused."""
        ...
