"""EngineView: what code below the engine (checkpoint/, planner/, export/ with PEFT) may read of a training engine.

Those packages sit under ``engine/`` in the layering (tests/test_layering.py) and never import it; they get a
``MegaTrainEngine`` as an argument and see it only through this protocol, so the engine's internals (the executor,
the step state, the slots) can change without reaching them. Every member is one attribute deep; the objects it hands
out are core types (``UnitStore``, ``Plans``) or the small protocols below. ``MegaTrainEngine`` satisfies it
(tests/test_engine_view.py checks a real one).

Reading without reaching in:

- the FP32 masters: ``named_master_tensors()`` (it waits for every update in flight first); a loader that writes
  masters through ``store`` calls ``wait_updates()`` first (not the step state's own wait);
- after writing masters (a checkpoint or adapter load): ``sync_device_()`` refreshes every compute copy;
- names, shapes, decay flags and units: ``store`` (``by_name``, ``frozen_by_name``, ``units``, ``names()``);
- the model's structure: ``model`` (the converted HF model: config, generation config, the PEFT wrapper) and
  ``stack`` (where the decoder layers sit in it: ``path``, ``layers`` -- the weightless proxies);
- optimizer state for checkpoints: ``optimizer`` (None before ``create_optimizer``), through ``OptimizerStateIO``.

- each streamed layer's weightless template module (its structure: PEFT's tuner layers, MoE router shapes):
  ``layer_templates()``. The pooled host bytes of offloaded activations are an argument the engine passes to
  ``planner.offloaded_layers_for``, not a member.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Protocol, runtime_checkable

import torch
from torch import nn

from ..config import MegaTrainConfig
from .plan import Plans
from .store import Unit, UnitStore

__all__ = ["EngineView", "LayerStackView", "OptimizerStateIO", "ENGINE_VIEW_MEMBERS"]


@runtime_checkable
class OptimizerStateIO(Protocol):
    """The optimizer's checkpoint interface (``optim/adamw.py`` ``UnitAdamW`` and its lean subclass)."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW moments and per-unit step counts by name (waits for a step in flight)."""
        ...

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        ...

    def hyper_state(self) -> dict:
        """JSON-serialisable state: param groups (LRs, betas...), skipped steps, the speculation mode."""
        ...

    def load_hyper_state(self, state: dict) -> None:
        ...


@runtime_checkable
class LayerStackView(Protocol):
    """Where the decoder layers sit in the converted model (``model/layers.py`` ``LayerStack``)."""

    path: str  # dotted name of the ModuleList inside ``EngineView.model`` ("model.layers")

    @property
    def layers(self) -> nn.ModuleList:  # the layers as the model holds them (weightless proxies after conversion)
        ...


@runtime_checkable
class EngineView(Protocol):
    """A converted model's engine as checkpoint/, planner/ and export/ see it (``engine/runtime.py``)."""

    model: nn.Module  # the converted HF model (a peft.PeftModel when PEFT wrapped it before conversion)
    config: MegaTrainConfig  # resolved once, before the engine was built
    device: torch.device  # where the model computes
    store: UnitStore  # every unit's FP32 state: names, shapes, decay flags
    plans: Plans  # where each unit's buffers live and which stepper runs it
    layer_units: list[Unit]  # the streamed layers' units, in layer order
    resident_unit: Unit  # embeddings, final norm, head
    optimizer: OptimizerStateIO | None  # None until ``create_optimizer``
    stack: LayerStackView

    def named_master_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, FP32 master) per trainable parameter, tied names once; waits for updates in flight first."""
        ...

    def named_frozen_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, compute-dtype value) per frozen parameter."""
        ...

    def named_layer_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) per persistent buffer inside the streamed layers (moved out of the model)."""
        ...

    def layer_templates(self) -> list[nn.Module]:
        """Each streamed layer's weightless (meta) template module, in layer order."""
        ...

    def wait_updates(self) -> None:
        """Block until no optimizer update is in flight (a worker's failure is raised here)."""
        ...

    def sync_device_(self) -> None:
        """After masters were written outside the optimizer: refresh every compute copy."""
        ...

    def writes_master(self, name: str) -> bool:
        """Whether this process writes parameter ``name``'s master on a load (data parallel: shared ones once)."""
        ...


def _members(proto: type) -> frozenset[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names.update(n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property)))
    return frozenset(names)


# The names code below the engine may read off it (tests/test_engine_view.py checks those packages against it).
ENGINE_VIEW_MEMBERS: frozenset[str] = _members(EngineView)

