"""Which part of each update this process makes: alone (every unit whole) or as one of the data-parallel ranks
sharing the host's store (parallel/group.py). Chosen once (``ranks_of``), when the engine and its optimizer are
built; the optimizer's phases, the engine's master refreshes and the Trainer's save coordination (barriers, the
main process's verdict, every rank's RNG state: hf/trainer.py) call it without asking which.

With data parallel each rank steps only its shard of every HOST unit (in its node's shared store) and the whole of
the replicated DEVICE units, whose gradients it all-reduces before the norm; the norm sums the squared norms of one
node's shards (every node holds the same ones: counted once) in one all-reduce; a parameter some rank's backward
reached is stepped on every rank (the others contributed zeros to its mean gradient), as one process over the whole
batch would.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core.plan import Stepper
from ..core.step_state import StepState
from ..core.store import Unit

if TYPE_CHECKING:
    from ..core.grad_reach import GradReach
    from ..parallel.group import DataParallel


# A replicated matrix with at least this many rows is reduced by the rows some rank touched (an embedding table).
ROWS_MIN = 1024


class Alone:
    """One process: every unit whole."""

    world = 1
    on_host = 1  # processes sharing this host's store and cores
    local_rank = 0  # this process's index among them
    is_node_leader = True  # the host's first process (shows progress, creates shared files)

    def node_gather_object(self, obj: Any) -> list[Any]:
        """Every process of this host's ``obj``, by local rank: alone, ``[obj]``."""
        return [obj]

    def own(self, u: Unit) -> tuple[int, int]:
        return 0, u.numel

    def reduce_early(self, views: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        """Alone: nothing to reduce."""
        return []

    def before_norm(self, units: list[Unit], state: StepState, reach: GradReach | None,
                    early: list[tuple[torch.Tensor, Any]] | None = None) -> None:
        pass

    def grad_norm(self, units: list[Unit], state: StepState, unit_norm: Callable[[Unit], torch.Tensor]) -> float:
        """Global L2 norm (per-unit norms, then the norm of norms, like clip_grad_norm_)."""
        return float(torch.linalg.vector_norm(torch.stack([unit_norm(u) for u in units])))

    def reached(self, i: int, taken: list[bool] | None) -> list[bool] | None:
        """Which parameters of unit ``i`` this step updates (None: all): what this process's backward reached."""
        return taken

    def writes_shared(self, u: Unit) -> bool:
        """Whether this process fills ``u``'s masters on a load (checkpoint/folders.py): alone, every one."""
        return True

    def any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over the processes (a decision every rank must take alike): alone, ``flag``."""
        return flag

    def barrier(self, timeout_s: float | None = None) -> None:
        pass

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's ``obj`` on every process: alone, ``obj``."""
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, by rank: alone, ``[obj]``."""
        return [obj]


class SharedHostRanks:
    """Data-parallel ranks, each node's sharing one store (see the module docstring)."""

    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp
        self.world = dp.world
        self.on_host = dp.local_world  # (the node's ranks share its store and its cores)
        self.local_rank = dp.local_rank
        self.is_node_leader = dp.is_leader
        self.node_gather_object = dp.node_gather_object
        self._reached: dict[int, list[bool]] = {}  # each unit's flags OR-ed over the ranks (``before_norm``)
        # (rows touched, rows) of the latest matrices reduced by rows (diagnostics, tests; bounded: one per step)
        self.rows_reduced: deque[tuple[int, int]] = deque(maxlen=64)

    def own(self, u: Unit) -> tuple[int, int]:
        """This rank's shard of a HOST unit shared by the node's ranks, else all of it."""
        return self.dp.owns(u)

    def reduce_early(self, views: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        """Start the sum over ranks of ``views`` (parts of a replicated unit's gradient that the loss's backward
        finished: optim/adamw.py ``first_layer_gradient``) beside the layers' backward; ``before_norm`` waits for
        them and makes them means. Every rank calls this at the same point of its backward (its first layer
        gradient), right after that gradient's own collective: the same order everywhere."""
        return [(v, self.dp.all_reduce_sum_async(v)) for v in views]

    def before_norm(self, units: list[Unit], state: StepState, reach: GradReach | None,
                    early: list[tuple[torch.Tensor, Any]] | None = None) -> None:
        """The mean over ranks of each replicated (device-stepped) unit's gradient (``early``: parts of it whose
        sums ``reduce_early`` started; the rest reduced here); the reached flags merged. Over every unit, in one
        order on all ranks: which units a rank launches differs where one speculated and another did not (a
        speculating rank's flags were all set, so the merged ones are too: the same update)."""
        started = []
        for view, work in early or ():
            work.wait()
            view.mul_(1.0 / self.dp.world)
            started.append(view)
        for u in units:
            if u.plan.stepper is Stepper.DEVICE and u.numel and state.has_grad(u.index):
                for lo, hi in ranges_outside(u.grad, started):
                    self._reduce_range(u, lo, hi)
                state.void_norm(u.index)
        flags = [f for u in units for f in ((reach.peek(u.index) if reach is not None else None)
                                            or [True] * len(u.params))]
        merged = self.dp.any_flags(flags)
        self._reached = {}
        for u in units:
            self._reached[u.index], merged = merged[:len(u.params)], merged[len(u.params):]

    def _reduce_range(self, u: Unit, lo: int, hi: int) -> None:
        """The mean over ranks of ``u.grad[lo:hi]``: an embedding matrix inside it by the rows some rank's backward
        touched (the others are zero on every rank, so their mean is too: the same values as the whole matrix's
        mean, a fraction of the bytes when the batches use a fraction of the vocabulary), the rest whole."""
        at = lo
        for p in sorted(u.params, key=lambda p: p.offset):
            if not (lo <= p.offset and p.offset + p.numel <= hi and len(p.shape) == 2 and p.shape[0] >= ROWS_MIN):
                continue
            if p.offset > at:
                self.dp.all_reduce_mean_(u.grad[at:p.offset])
            self._reduce_rows(u.grad[p.offset:p.offset + p.numel].view(p.shape))
            at = p.offset + p.numel
        if at < hi:
            self.dp.all_reduce_mean_(u.grad[at:hi])

    def _reduce_rows(self, g: torch.Tensor) -> None:
        """The mean over ranks of matrix ``g``, over the rows that are not zero on some rank (every rank learns the
        same rows, so all decide alike); whole where most rows are touched."""
        touched = g.ne(0).any(dim=1).to(torch.float32)
        self.dp.all_reduce_sum_(touched)
        rows = touched.nonzero().squeeze(1)
        self.rows_reduced.append((rows.numel(), g.shape[0]))
        if rows.numel() * 2 > g.shape[0]:
            self.dp.all_reduce_mean_(g)
            return
        part = g.index_select(0, rows)
        self.dp.all_reduce_mean_(part)
        g.index_copy_(0, rows, part)

    def grad_norm(self, units: list[Unit], state: StepState, unit_norm: Callable[[Unit], torch.Tensor]) -> float:
        """Each unit's squared norm summed over the shards of one node (node 0's: every node holds the same reduced
        shards), a replicated unit counted once (rank 0's); every rank gets the same sum (one all-reduce)."""
        sq = []
        for u in units:
            lo, hi = self.own(u)
            s = state.grad_sq[u.index]
            if u.grad is None:  # (a lean unit: its gradient is gone, the optimizer kept its shard's norm)
                s = unit_norm(u).square()
            elif s is None:
                s = torch.linalg.vector_norm(u.grad[lo:hi], dtype=torch.float32).square()
            if not self.dp.counts_in_norm(u):  # (a copy of what another rank counts)
                s = torch.zeros(())
            sq.append(s.reshape(()).float().cpu())
        total = torch.stack(sq)
        self.dp.all_reduce_sum_(total)
        return float(torch.linalg.vector_norm(total.sqrt()))

    def reached(self, i: int, taken: list[bool] | None) -> list[bool] | None:
        """Unit ``i``'s flags merged over the ranks (this rank's own, ``taken``, are in them)."""
        return self._reached.pop(i)

    def writes_shared(self, u: Unit) -> bool:
        """Each node's local rank 0 fills its shared (HOST) units' masters on a load, every rank its own replicated
        ones."""
        return self.dp.writes_shared(u)

    def any_rank(self, flag: bool) -> bool:
        return self.dp.any_flags([flag])[0]

    def barrier(self, timeout_s: float | None = None) -> None:
        self.dp.barrier(timeout_s)

    def broadcast_object(self, obj: Any) -> Any:
        return self.dp.broadcast_object(obj)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.dp.all_gather_object(obj)


def ranges_outside(flat: torch.Tensor, parts: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The ranges of ``flat`` outside ``parts`` (views of it, or of other tensors: ignored), in order."""
    size, base = flat.element_size(), flat.data_ptr()
    taken = sorted(((p.data_ptr() - base) // size, (p.data_ptr() - base) // size + p.numel()) for p in parts
                   if p.numel() and base <= p.data_ptr() < base + flat.numel() * size)
    out, at = [], 0
    for lo, hi in taken:
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < flat.numel():
        out.append((at, flat.numel()))
    return out


Ranks = Alone | SharedHostRanks


def ranks_of(dp: DataParallel | None) -> Ranks:
    """The one place a process's share is decided: alone (no group, or a group of one), or this rank's."""
    return Alone() if dp is None or dp.world <= 1 else SharedHostRanks(dp)
