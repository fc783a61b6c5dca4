"""DataParallel: the ranks that train one model together, on one host or several, and the collectives the engine
needs.

Every rank runs the same engine on its part of the global batch. Host-stepped units live once per *node* (host) in
shared memory (parallel/shared_alloc.py) and are *sharded* over the node's ranks (its local ranks): each rank
receives, by ``reduce_scatter`` among its node's ranks, the sum of its shard's gradient over them; with several
nodes that shard is then ``all_reduce``d among the ranks of the same local rank on every node (which hold the same
shard of their node's store), so every node's store receives the same mean gradient and steps identically. Units
on the device (the resident embeddings / norm / lm_head) are *replicated*: their gradient is ``all_reduce``d over
every rank and every rank runs the same update. Gradients are averaged over all ranks, as DDP does, so Trainer's
loss scaling (``loss * num_processes`` with ``average_tokens_across_devices``) carries over.

Collectives of gradients run on ``group`` (NCCL on GPUs, gloo on the CPU) and, with several nodes, its per-node and
cross-node subgroups; barriers and small objects go through ``cpu_group`` (gloo). Built from an initialised
``torch.distributed``: nothing here reads the environment. Which node a rank is on: its host name, gathered
(``from_process_group(host=...)`` names it instead: tests simulate several hosts on one machine).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core.plan import Where
from ..core.store import Unit
from .shards import shard_range, shard_size


def sharded(unit: Unit) -> bool:
    """Whether ``unit`` lives in the node's shared store, each rank stepping its shard: its master is on the host
    (a host-stepped layer, with a gradient buffer or the lean store's without); else it is replicated on every
    rank's device."""
    return unit.plan.master is Where.HOST


@dataclass
class DataParallel:
    rank: int
    world: int
    local_rank: int  # this rank's index among its node's ranks (by rank): which shard of the node's store it steps
    device: torch.device  # where gradient collectives run (the backend's device)
    group: Any = None  # process group of the gradient collectives (None: the default group)
    cpu_group: Any = None  # gloo group: barriers, objects
    wait_group: Any = None  # gloo group whose own timeout is a week: barriers given theirs (the checkpoint save's)
    # Several nodes (hosts), each with one store and ``local_world`` ranks (the defaults: one node of every rank).
    local_world: int = 0  # ranks per node (0: ``world``)
    node: int = 0  # this rank's node, nodes numbered in the order of their first rank (node 0 holds rank 0)
    nodes: int = 1
    node_group: Any = None  # gradient collectives among this node's ranks (the reduce-scatter); None: ``group``
    node_cpu_group: Any = None  # gloo among this node's ranks (objects); None: ``cpu_group``
    cross_group: Any = None  # this local rank's ranks on every node (shards all-reduced, broadcast); one node: None
    # The layer gradients' reduce-scatter among the node's ranks, when it has a communicator of its own (``cap_reduce``)
    reduce_group: Any = None
    node_leader: int = 0  # rank (in ``group``) of this node's local rank 0
    cross_root: int = 0  # rank (in ``group``) of this local rank on node 0

    def __post_init__(self) -> None:
        if self.local_world == 0:
            self.local_world = self.world
        if self.nodes * self.local_world != self.world or not 0 <= self.local_rank < self.local_world:
            raise ValueError(f"data parallel: every node must run the same number of ranks, but {self.nodes} "
                             f"node(s) x {self.local_world} != {self.world} ranks (or local rank {self.local_rank} "
                             "is outside its node)")

    @classmethod
    def from_process_group(cls, group: Any = None, *, host: str | None = None) -> "DataParallel":
        """The data-parallel ranks of ``group`` (default: the world), on one host or several. The ranks with the same
        host name form a node that shares one store; every node must run the same number of ranks. ``host``: this
        process's node name instead of ``socket.gethostname()`` (tests simulate hosts on one machine; each
        simulated host then needs its own ``shared_memory_dir``). Every process of the default group must call this
        (it creates the per-node and cross-node groups)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("hf_megatrain data parallel needs torch.distributed initialised (accelerate launch / "
                               "torchrun do it; or call torch.distributed.init_process_group)")
        backend = dist.get_backend(group)
        ranks = None if group is None else dist.get_process_group_ranks(group)
        cpu_group = group if backend == "gloo" else dist.new_group(ranks=ranks, backend="gloo")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, host if host is not None else socket.gethostname(), group=cpu_group)
        names = list(dict.fromkeys(hosts))  # (in the order of each node's first rank)
        members = [[r for r, h in enumerate(hosts) if h == name] for name in names]
        sizes = {name: len(m) for name, m in zip(names, members)}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"hf_megatrain data parallel: every node must run the same number of processes (each "
                             f"node steps the same shards of its own store); these {world} processes run {sizes}. "
                             "Launch as many processes per node on every node (e.g. torchrun --nproc-per-node).")
        node = names.index(hosts[rank])
        local_world = len(members[node])
        local_rank = members[node].index(rank)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        wait_group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(days=7))
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        node_group = node_cpu_group = cross_group = None
        if len(names) > 1:
            # (every process creates every group, in one order: torch.distributed requires it of new_group)
            for n, m in enumerate(members):
                g = dist.new_group(ranks=[glob(r) for r in m], backend=backend)
                cg = g if backend == "gloo" else dist.new_group(ranks=[glob(r) for r in m], backend="gloo")
                if n == node:
                    node_group, node_cpu_group = g, cg
            for local in range(local_world):
                g = dist.new_group(ranks=[glob(m[local]) for m in members], backend=backend)
                if local == local_rank:
                    cross_group = g
        return cls(rank, world, local_rank, device, group, cpu_group, wait_group, local_world=local_world,
                   node=node, nodes=len(names), node_group=node_group, node_cpu_group=node_cpu_group,
                   cross_group=cross_group, node_leader=members[node][0], cross_root=members[0][local_rank])

    def cap_reduce(self, max_ctas: int) -> bool:
        """Give the layer gradients' reduce-scatter a communicator of its own among the node's ranks whose kernels
        take at most ``max_ctas`` SMs (NCCL only; 0, another backend, or once done: nothing). It runs beside the
        backward's GEMMs, which lose the SMs a collective holds while it runs, waiting for a slower rank included.
        Every rank must call this with the same value (every process creates every node's group, in one order).
        Whether this rank now has one."""
        if max_ctas <= 0 or self.reduce_group is not None or dist.get_backend(self.group) != "nccl":
            return self.reduce_group is not None
        ranks = self.all_gather_object((self.node, dist.get_rank()))  # (global ranks, by node)
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = max_ctas
        for n in range(self.nodes):
            g = dist.new_group(ranks=[r for node, r in ranks if node == n], backend="nccl", pg_options=opts)
            if n == self.node:
                self.reduce_group = g
        return True

    @classmethod
    def current(cls) -> "DataParallel | None":
        """The ranks of the initialised default process group when it has several processes, else None."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls.from_process_group()
        return None

    @property
    def is_leader(self) -> bool:
        """Local rank 0 of its node: creates and removes the node's shared files, fills its shared masters on a
        load. (Checkpoints are written by rank 0 alone, whose node's store is complete.)"""
        return self.local_rank == 0

    # -- shards --------------------------------------------------------------------------------------------------------
    def shard(self, n: int) -> tuple[int, int]:
        """This rank's shard of a unit of ``n`` elements in its node's store (the node's ranks split each unit)."""
        return shard_range(n, self.local_rank, self.local_world)

    def shard_size(self, n: int) -> int:
        return shard_size(n, self.local_world)

    def owns(self, unit: Unit) -> tuple[int, int]:
        """The range of ``unit``'s flat buffers this rank writes: its shard of a host-stepped unit (shared by the
        node's ranks), all of a replicated one (its own copy on its device)."""
        return self.shard(unit.numel) if sharded(unit) else (0, unit.numel)

    def writes_shared(self, unit: Unit) -> bool:
        """Whether this rank fills ``unit``'s masters on a load: each node's local rank 0 its node's shared ones,
        every rank its own."""
        return self.is_leader or not sharded(unit)

    def counts_in_norm(self, unit: Unit) -> bool:
        """Whether this rank's part of ``unit``'s gradient enters the global norm: a shard once, from node 0 (every
        node holds the same reduced shards); a replicated unit once, from rank 0."""
        return self.node == 0 if sharded(unit) else self.rank == 0

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

    def node_broadcast_object(self, obj: Any) -> Any:
        """This node's local rank 0's ``obj`` on every rank of the node (its run directory, its free memory)."""
        if self.nodes == 1:
            return self.broadcast_object(obj)
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(self.node_leader), group=self.node_cpu_group)
        return box[0]

    def node_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of this node, in local-rank order (e.g. each rank's GPU's NUMA node)."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, (self.node, self.local_rank, obj), group=self.cpu_group)
        mine = sorted((lr, o) for n, lr, o in out if n == self.node)
        return [o for _, o in mine]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_(self, t: torch.Tensor) -> None:
        """Rank 0's values of ``t`` into ``t`` on every rank (replicated state after conversion)."""
        self._broadcast(t, self._global(0), self.group)

    def broadcast_across_nodes_(self, t: torch.Tensor) -> None:
        """Node 0's values of ``t`` (this local rank's part of the node's store) into ``t`` on every node; one
        node: nothing to do."""
        if self.nodes > 1:
            self._broadcast(t, self._global(self.cross_root), self.cross_group)

    def _broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        x = t if t.device == self.device else t.to(self.device)
        dist.broadcast(x, src=src, group=group)
        if x is not t:
            t.copy_(x)

    def reduce_scatter_mean_(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` (``full.numel() / local_world`` elements) = this rank's shard of the mean of ``full`` over every
        rank: summed over the node's ranks, then over the nodes (among the ranks holding the same shard; every
        node receives the same values), divided by ``world``."""
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=self._layer_group)
        self._node_sum_to_mean_(out)

    @property
    def _layer_group(self) -> Any:
        """Where a layer gradient's collective among the node's ranks runs: its own communicator when capped, else
        the node's group (one node: the gradient group)."""
        if self.reduce_group is not None:
            return self.reduce_group
        return self.group if self.node_group is None else self.node_group

    def exchange_mean_(self, out: torch.Tensor, full: torch.Tensor, recv: torch.Tensor) -> None:
        """As ``reduce_scatter_mean_``, the values crossing in ``full``'s dtype (bf16: half an FP32 reduce-scatter's
        bytes): each node rank's part of this rank's shard arrives in ``recv`` (``full.numel()`` elements) and is
        summed here in ``out``'s dtype (FP32), in rank order; then over the nodes, divided by ``world``."""
        dist.all_to_all_single(recv, full, group=self._layer_group)
        torch.sum(recv.view(self.local_world, -1), dim=0, dtype=out.dtype, out=out)
        self._node_sum_to_mean_(out)

    def _node_sum_to_mean_(self, out: torch.Tensor) -> None:
        """``out``, a shard summed over this node's ranks -> the mean over every rank: summed over the nodes too
        (among the ranks holding the same shard), divided by ``world``."""
        if self.nodes > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.cross_group)
        out.mul_(1.0 / self.world)

    def all_gather_shards_(self, full: torch.Tensor) -> None:
        """``full`` (``local_world`` equal shards, this rank's in place at its offset) gets every node rank's shard:
        a layer's weights, each rank having copied in only its own (engine/weight_gather.py)."""
        size = full.numel() // self.local_world
        mine = full[self.local_rank * size:(self.local_rank + 1) * size]
        dist.all_gather_into_tensor(full, mine, group=self.group if self.node_group is None else self.node_group)

    def all_reduce_mean_(self, t: torch.Tensor) -> None:
        self.all_reduce_sum_(t)
        t.mul_(1.0 / self.world)

    def all_reduce_sum_async(self, t: torch.Tensor) -> Any:
        """Start the sum of ``t`` (on this rank's device) over every rank, in place; the returned work's ``wait()``
        orders what follows after it (on a GPU: the waiting stream)."""
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

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
