"""WeightGather: the data-parallel ranks of a host bring a layer's weights in from host memory once between them.

Without it every rank copies every layer's whole compute copy out of the node's shared store over its own PCIe
link: N processes read each layer N times from host DRAM, and in the forward after a clipping step those reads
compete with the host AdamW's weights pass, which the forward waits on layer by layer (the host's memory
bandwidth is what both use; integration/PERF.md, lever 77). Gathered, each rank copies only its shard of the layer
(the range it steps, parallel/shards.py) into its slot and one all-gather over the GPUs' links (NVLink) fills in
the others': the same bytes -- every rank reads its shard from the same shared memory once every rank's shard of
the update is written (``StepState.wait_loadable``) -- with 1/N of the host reads and of each GPU's PCIe traffic.

A collective needs every rank of the node to make the same calls in the same order, and where loads happen differs
between ranks: a rank's slots may still hold a layer, a backward keeps the forward graphs of some layers by its own
batch's shape, one rank may run a forward alone (a sample generation on the main process). So gathering is
confined to what every rank runs alike, the *training forward* (grad enabled, the layer stack in training mode:
each rank's training step runs one per micro-batch), and within it to a fixed sequence: every eligible unit
exactly once, in unit order, whatever the slots hold. A pass that reaches a unit out of order gathers the units
before it first; the pass's end gathers those it never reached (a layer skipped, e.g. LayerDrop). Every other load
(the backward, evaluation, generation, a unit's second visit in one forward) copies the whole layer from the host
as before, with no collective.

Eligible, decided once per unit: a unit the node's ranks share and step by shards (``parallel.shards``), loaded
from its compute copy in host memory (no cast on the way in), on a node of two or more ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.store import Unit
from ..core.streams import StreamSet
from ..parallel.group import sharded
from ..parallel.shards import shard_size

if TYPE_CHECKING:
    from ..parallel.group import DataParallel


class WeightGather:
    def __init__(self, units: list[Unit], dp: DataParallel, compute_dtype: torch.dtype) -> None:
        self.dp = dp
        self.eligible = [gatherable(u, dp, compute_dtype) for u in units]
        self.order = [i for i, ok in enumerate(self.eligible) if ok]  # the gathers of one pass, in this order
        self.active = False  # a training forward is running (``begin_pass``)
        self._next = 0  # position in ``order`` of the pass's next gather

    def slot_numel(self, units: list[Unit]) -> int:
        """Elements a slot needs for a gathered load: the unit padded to the node's equal shards."""
        return max((shard_size(units[i].numel, self.dp.local_world) * self.dp.local_world for i in self.order),
                   default=0)

    def begin_pass(self, training_forward: bool) -> None:
        """A forward of the layer stack starts: gathered when it is a training forward (every rank runs it)."""
        self.active = training_forward and bool(self.order)
        self._next = 0

    def due(self, index: int) -> list[int]:
        """Loading unit ``index`` in this pass: the units to gather first, in order, ending with ``index`` when it is
        its first gathered load of the pass (the caller gathers each and marks the sequence done as it goes); []
        outside a gathered pass or for a unit it gathered already."""
        if not self.active:
            return []
        out = []
        while self._next < len(self.order) and self.order[self._next] <= index:
            out.append(self.order[self._next])
            self._next += 1
        return out

    def end_pass(self) -> list[int]:
        """The training forward ended: the units it never loaded, still to be gathered (in order)."""
        rest = self.order[self._next:] if self.active else []
        self.active = False
        self._next = len(self.order)
        return rest

    def fill(self, streams: StreamSet, slot: torch.Tensor, unit: Unit) -> int:
        """Unit ``unit``'s compute copy into ``slot`` (the caller's H2D stream current and ordered after the slot's
        last reader): this rank's shard from host memory, the others' from their GPUs. Host bytes read."""
        dp = self.dp
        size = shard_size(unit.numel, dp.local_world)
        lo, hi = dp.shard(unit.numel)
        at = dp.local_rank * size  # (== lo while the shard is not empty)
        if hi > lo:
            slot[at:at + hi - lo].copy_(unit.source[lo:hi], non_blocking=True)
        dp.all_gather_shards_(slot[:size * dp.local_world])
        return (hi - lo) * unit.source.element_size()


def gatherable(u: Unit, dp: DataParallel, compute_dtype: torch.dtype) -> bool:
    """Whether the node's ranks load ``u`` by shards: shared and stepped by shards on the host, loaded from its
    compute copy in host memory as is, on a node of several ranks."""
    return (dp.local_world > 1 and u.numel > 0 and sharded(u) and u.source.device.type == "cpu"
            and u.source.dtype == compute_dtype)
