"""DataParallel: the ranks of one host that train one model together, and the collectives the engine needs.

Every rank runs the same engine on its part of the global batch. Host-stepped units live once per host in shared
memory (parallel/shared_alloc.py) and are *sharded*: each rank receives, by ``reduce_scatter``, the mean over ranks of
its shard's gradient and steps only that shard. Units on the device (the resident embeddings / norm / lm_head) are
*replicated*: their gradient is ``all_reduce``d and every rank runs the same update. Gradients are averaged, as DDP
does, so Trainer's loss scaling (``loss * num_processes`` with ``average_tokens_across_devices``) carries over.

Collectives of gradients run on ``group`` (NCCL on GPUs, gloo on the CPU); barriers and small objects go through
``cpu_group`` (gloo). Built from an initialised ``torch.distributed``: nothing here reads the environment.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core.plan import Stepper
from ..core.store import Unit
from .shards import shard_range, shard_size


@dataclass
class DataParallel:
    rank: int
    world: int
    local_rank: int
    device: torch.device  # where gradient collectives run (the backend's device)
    group: Any = None  # process group of the gradient collectives (None: the default group)
    cpu_group: Any = None  # gloo group: barriers, objects
    wait_group: Any = None  # gloo group whose own timeout is a week: barriers given theirs (the checkpoint save's)

    @classmethod
    def from_process_group(cls, group: Any = None) -> "DataParallel":
        """The data-parallel ranks of ``group`` (default: the world). One host only: multi-node (one store per
        node) is designed in integration/MULTI_GPU_DESIGN.md, not built; it is refused here."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("hf_megatrain data parallel needs torch.distributed initialised (accelerate launch / "
                               "torchrun do it; or call torch.distributed.init_process_group)")
        backend = dist.get_backend(group)
        ranks = None if group is None else dist.get_process_group_ranks(group)
        cpu_group = group if backend == "gloo" else dist.new_group(ranks=ranks, backend="gloo")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=cpu_group)
        if len(set(hosts)) > 1:
            raise NotImplementedError(
                f"hf_megatrain data parallel runs on one host; these {world} processes span hosts {sorted(set(hosts))}."
                " Multi-node (one shared store per node) is not built yet: launch on a single machine.")
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        wait_group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(days=7))
        return cls(rank, world, rank, device, group, cpu_group, wait_group)

    @classmethod
    def current(cls) -> "DataParallel | None":
        """The ranks of the initialised default process group when it has several processes, else None."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls.from_process_group()
        return None

    @property
    def is_leader(self) -> bool:
        """Local rank 0: creates and removes the host's shared files, writes checkpoints."""
        return self.local_rank == 0

    # -- shards --------------------------------------------------------------------------------------------------------
    def shard(self, n: int) -> tuple[int, int]:
        return shard_range(n, self.rank, self.world)

    def shard_size(self, n: int) -> int:
        return shard_size(n, self.world)

    def owns(self, unit: Unit) -> tuple[int, int]:
        """The range of ``unit``'s flat buffers this rank writes: its shard of a host-stepped unit (shared by the
        ranks), all of a replicated one (its own copy on its device)."""
        return self.shard(unit.numel) if unit.plan.stepper is Stepper.HOST else (0, unit.numel)

    def writes_shared(self, unit: Unit) -> bool:
        """Whether this rank fills ``unit``'s masters on a load: local rank 0 the shared ones, every rank its own."""
        return self.is_leader or unit.plan.stepper is not Stepper.HOST

    # -- collectives ---------------------------------------------------------------------------------------------------
    def barrier(self, timeout_s: float | None = None) -> None:
        """Wait for every rank. ``timeout_s``: this wait's own limit (a ``RuntimeError`` after it), longer or shorter
        than the process group's (30 minutes by default): on ``wait_group``, whose own limit is a week."""
        if timeout_s is None:
            dist.barrier(group=self.cpu_group)
        else:
            work = dist.barrier(group=self.wait_group or self.cpu_group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_(self, t: torch.Tensor) -> None:
        """Rank 0's values of ``t`` into ``t`` on every rank (replicated state after conversion)."""
        x = t if t.device == self.device else t.to(self.device)
        dist.broadcast(x, src=self._global(0), group=self.group)
        if x is not t:
            t.copy_(x)

    def reduce_scatter_mean_(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` (``full.numel() / world`` elements) = this rank's shard of the mean of ``full`` over ranks."""
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=self.group)
        out.mul_(1.0 / self.world)

    def all_reduce_mean_(self, t: torch.Tensor) -> None:
        self.all_reduce_sum_(t)
        t.mul_(1.0 / self.world)

    def all_reduce_sum_(self, t: torch.Tensor) -> None:
        x = t if t.device == self.device else t.to(self.device)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        if x is not t:
            t.copy_(x)

    def any_flags(self, flags: Sequence[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over ranks (which parameters some rank's backward reached)."""
        if not flags:
            return []
        t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32)
        self.all_reduce_sum_(t)
        return [bool(v > 0) for v in t.tolist()]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)
