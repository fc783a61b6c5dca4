"""Saved graphs: which layers' training forward keeps its graph for the backward, and the graphs alive.

The streamed backward recomputes each layer from its saved input (engine/executor.py). For the layers in
``SavedGraphs.layers`` -- the last ones in forward order, as many as the planner fits beside the step's GPU peak
(planner/saved_graphs.py; the engine sets them per step shape) -- the forward runs with grad on the visit's own copy
of the layer's weights and hands the proxy a ``SavedGraph``; the backward differentiates it instead of recomputing.

The planner fits one forward's worth. A second training forward before the backward (two losses summed, a
contrastive pair) would keep another set, so a visit keeps its graph only while fewer are alive than one forward
keeps; the rest recompute as before. A graph is alive until its backward takes it or its forward's graph is
dropped unused, whichever thread collects it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SavedGraph:
    """A layer visit's training forward kept whole for its backward: the graph's leaves (the inputs that want a
    gradient, None where none does), its raw output, its side outputs, and the parameters it ran with -- views of
    the visit's own copy of the layer's weights, since the slot it was loaded into is refilled long before the
    backward comes."""

    params: dict[str, torch.Tensor]
    leaves: list[torch.Tensor | None]
    out: Any
    side: list[torch.Tensor] = field(default_factory=list)


class SavedGraphs:
    """The one owner of which layers keep their forward graph and of how many such graphs are alive."""

    def __init__(self) -> None:
        self.layers: frozenset[int] = frozenset()
        # Serials of the graphs alive: a set, since set.add / discard are atomic where a counter's ``+= 1`` is not.
        self._live: set[int] = set()
        self._serial = 0

    def wanted(self, index: int) -> bool:
        """Layer ``index`` is chosen, and fewer graphs are alive than one forward keeps."""
        return index in self.layers and len(self._live) < len(self.layers)

    def track(self, graph: SavedGraph) -> SavedGraph:
        """Count ``graph`` alive until it is collected (its backward took it, or its forward's graph was dropped)."""
        self._serial += 1
        self._live.add(self._serial)
        weakref.finalize(graph, self._live.discard, self._serial)
        return graph

    @property
    def live(self) -> int:
        return len(self._live)
