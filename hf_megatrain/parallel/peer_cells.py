"""PeerCells: when every data-parallel rank of the host has written its shard of a unit's update.

Each rank steps only its shard of a host unit, in shared memory, on its own optimizer threads; a rank's next
forward may load the unit (its compute-dtype copy, all shards) only once every rank's shard of that update is
written. Instead of a barrier at the end of each step (which would keep every rank's AdamW off the next forward),
each rank counts its finished updates per unit and stores the count in its own cell of a shared ``[world, units]``
int64 tensor; a reader waits until every rank's cell for the unit has reached its own count.

Why this is safe without atomics: each cell has one writer (an aligned 8-byte store), counts only grow, and a rank
cannot run ahead of the others by a whole update: its next update of a unit needs the gradient the others'
backward of that unit contributes (a collective), which comes after their loads of the unit for that step. The
shard's data is written before the count (program order on the updating thread; x86 stores are not reordered with
older stores), so a reader that sees the count sees the data.

A rank that died never writes its count: a wait asks ``liveness`` (parallel/liveness.py) every ``CHECK_SECONDS``
and raises naming the dead rank, rather than waiting out the timeout (which remains for a rank that hangs alive).
"""

from __future__ import annotations

import time

import torch

from .liveness import Liveness

# Between polls of a cell that has not caught up: short, since the forward rarely waits (updates run ahead of it).
POLL_SECONDS = 50e-6
# A shard update takes seconds at most; a rank this far behind has died or hangs (outside any collective, so no
# NCCL timeout would ever end the wait).
TIMEOUT_SECONDS = 1800.0
# Between asks whether a rank that is behind is still alive.
CHECK_SECONDS = 1.0


class PeerCells:
    """StepState's ``peers``: ``publish`` a unit's update count for this rank, ``wait`` for every rank's."""

    def __init__(self, cells: torch.Tensor, rank: int, *, poll_s: float = POLL_SECONDS,
                 timeout_s: float = TIMEOUT_SECONDS, liveness: Liveness | None = None,
                 weights: torch.Tensor | None = None) -> None:
        """``cells``: each rank's count of final updates per unit; ``weights``: of updates whose compute copy is
        written (a split update publishes it before it is final; None: loads wait on the final counts, which is safe
        but makes a load wait for every rank's whole update)."""
        for t in (cells, weights if weights is not None else cells):
            if t.dim() != 2 or t.dtype != torch.int64 or not 0 <= rank < t.shape[0] or t.shape != cells.shape:
                raise ValueError(f"peer cells: need int64 [world, units] tensors and a rank in them, got "
                                 f"{tuple(t.shape)} {t.dtype}, rank {rank}")
        self.cells, self.rank, self.poll_s, self.timeout_s = cells, rank, poll_s, timeout_s
        self.weights = weights
        self.liveness = liveness
        self.waited_s = 0.0  # time readers spent waiting for other ranks (diagnostics)

    def publish(self, unit: int, count: int) -> None:
        self.cells[self.rank, unit] = count

    def publish_weights(self, unit: int, count: int) -> None:
        if self.weights is not None:
            self.weights[self.rank, unit] = count

    def wait_weights(self, unit: int, count: int) -> None:
        self._wait(self.weights if self.weights is not None else self.cells, unit, count)

    def wait(self, unit: int, count: int) -> None:
        self._wait(self.cells, unit, count)

    def _wait(self, cells: torch.Tensor, unit: int, count: int) -> None:
        column = cells[:, unit]
        if bool((column >= count).all()):
            return
        t0 = time.perf_counter()
        checked = t0
        while not bool((column >= count).all()):
            now = time.perf_counter()
            if self.liveness is not None and now - checked > CHECK_SECONDS:
                self.liveness.check()
                checked = now
            if now - t0 > self.timeout_s:
                behind = [r for r, n in enumerate(column.tolist()) if n < count]
                raise RuntimeError(f"hf_megatrain data parallel: local rank(s) {behind} have not written their "
                                   f"shard of update {count} of unit {unit} after {self.timeout_s:.0f} s; a process "
                                   "hangs (see its log). The other ranks stop here rather than train on a partial "
                                   "update.")
            time.sleep(self.poll_s)
        self.waited_s += time.perf_counter() - t0
