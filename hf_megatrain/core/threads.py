"""How many CPU threads the host AdamW gets: the one place the process's intra-op thread count is decided.

The host AdamW is memory-bound and wants every core the process may run on. Launchers often leave one:
``accelerate launch`` sets ``OMP_NUM_THREADS`` to ``--num_cpu_threads_per_process`` (default 1, multi-GPU or not)
and torchrun sets 1 per process, which would run the whole optimizer on one core (several times slower steps).
``auto`` gives each process its share of the cores (the data-parallel processes of one host share them; with
several, less the cores each one's other busy threads need: ``share_threads``) and only ever raises the count: a
larger setting the user chose stays.

``torch.compile``'s Triton compile workers are decided the same way: inductor sizes its worker pool at import, from
every core of the host (``min(32, cores)``), in every process; N data-parallel processes would start N such pools,
oversubscribing the cores while they compile. Each process of several keeps its share of the cores for them too; a
count the user set otherwise stays. (Their memory is not the cost it looks: the workers are forked, their resident
pages mostly shared with the sidecar's. Quiescing them after the first step left the host's used memory unchanged
in one and two processes, PERF lever 88.)
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import numa


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


# Busy threads of one training process besides the host AdamW's: the main thread launching kernels, the loader and
# landing threads, the optimizer worker, NCCL's proxy. One process alone runs its AdamW on every core (measured best
# on one GPU); with several, each one's AdamW leaves its share's cores for these, or a descheduled AdamW thread holds
# back a memory-bound pass that ends only with its slowest thread (2 processes on a 32-core H200 host, 32k tokens
# per GPU: 16 threads each 1.124 s, 14 1.126 s, 12 1.095 s a step; integration/PERF.md lever 87).
OTHER_BUSY_THREADS = 4


def share_threads(share: int, processes: int) -> int:
    """Host AdamW threads for a process whose share of the cores is ``share``: all of it alone, else the share less
    ``OTHER_BUSY_THREADS`` (at least half of it, at least 1)."""
    if processes <= 1:
        return max(share, 1)
    return max(share - OTHER_BUSY_THREADS, share // 2, 1)


def weights_half_threads(share: int, processes: int, threads: int, requested: int) -> int:
    """Threads for the weights half of a split update (optim/split_update.py) in a process running ``threads``
    elsewhere: the whole ``share`` of the cores where it is one of several processes and the count is auto.

    The next forward waits for that half, layer by layer: meanwhile the process's other busy threads are idle (the
    main thread waits for the layer, its copies are DMA), so the cores ``share_threads`` leaves them are free, and
    the half is memory-bound on a host the processes share. Measured on a 32-core 2 x H200 host with no GPU work
    (integration/probes/host_adamw_processes.py): the weights half of 2 processes at once, 12 threads each 139 GB/s,
    16 each 162 GB/s; training, 2 processes at 16k tokens each: 0.791 -> 0.740 s a step. The state half runs
    beside the backward, whose threads are busy: it keeps ``threads`` (on 16 as well: 0.793 s; PERF levers 95-96).
    A count the user set (``requested``) applies to both halves."""
    if requested > 0 or processes <= 1:
        return threads
    return max(threads, share)


def host_threads(requested: int, processes: int, current: int, cores: int) -> int:
    """Threads to use: ``requested`` when > 0, else (auto) ``share_threads`` of this process's share of ``cores``
    among ``processes``, never fewer than the ``current`` setting."""
    if requested > 0:
        return requested
    return max(current, share_threads(cores // max(processes, 1), processes))


def compile_workers(current: int, cores_at_import: int, share: int) -> int:
    """Inductor's compile workers for a process of several: its ``share`` of the cores where ``current`` is still
    inductor's own default for the host (``min(32, cores_at_import)``), never more than that; else ``current``."""
    default = min(32, cores_at_import)
    return min(current, max(share, 1)) if current == default else current


def _share_compile_workers(share: int, cores_at_import: int) -> int | None:
    """Apply ``compile_workers`` to inductor's config (before this process compiles anything); the count, or None
    where inductor is not importable."""
    try:
        import torch._inductor.config as inductor
    except ImportError:  # (a build without inductor: nothing compiles)
        return None
    current = inductor.compile_threads
    if current is None:  # (inductor decides elsewhere)
        return None
    inductor.compile_threads = compile_workers(current, cores_at_import, share)
    return inductor.compile_threads


@dataclass(frozen=True)
class HostPlacement:
    """Where this process's host work runs: its GPU's NUMA node (None: unknown / no GPU), the cores its threads
    may use, the host AdamW's thread count, and whether the process was bound to those cores."""

    node: int | None
    cores: tuple[int, ...]
    threads: int
    bound: bool
    threads_before: int
    compile_workers: int | None = None  # torch.compile's worker pool (None: left as inductor set it)
    weights_threads: int | None = None  # a split update's weights half (``weights_half_threads``; None: ``threads``)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        where = f"NUMA node {self.node}" if self.node is not None else "no NUMA node known"
        how = "bound to" if self.bound else "free on"
        workers = f", {self.compile_workers} compile workers" if self.compile_workers is not None else ""
        half = (f" ({self.weights_threads} for a split update's weights half)"
                if self.weights_threads not in (None, self.threads) else "")
        return (f"{where}; {how} {len(self.cores)} cores ({_span(self.cores)}), host AdamW on {self.threads} "
                f"threads{half}{workers}")


def _span(cores: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out, run = [], []
    for c in cores:
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def place_host(affinity: str, requested_threads: int, gpu_nodes: list[int | None], local_rank: int) -> HostPlacement:
    """Decide and apply this process's cores and host threads (``host_affinity``, ``host_threads``).

    ``gpu_nodes``: the NUMA node of each local process's GPU, in local-rank order (``[node]`` alone). ``"auto"``
    binds the process to its share of the cores (``numa.plan_cores``) when that share is not already every core it
    may use, and runs ``share_threads`` of it; the pages its threads touch first then sit on its node.
    Unbound (``"none"``, or a share of every core) the thread count is ``host_threads``' share, never lowered."""
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(usable_cores()))
    before = torch.get_num_threads()
    node, cores, bound = gpu_nodes[local_rank], sorted(allowed), False
    if affinity == "auto" and hasattr(os, "sched_setaffinity"):
        node, cores = numa.plan_cores(numa.nodes(), allowed, gpu_nodes, local_rank)
        bound = set(cores) != allowed
    if bound:
        numa.bind_process(cores)
        after = requested_threads if requested_threads > 0 else share_threads(len(cores), len(gpu_nodes))
    else:
        after = host_threads(requested_threads, len(gpu_nodes), before, len(cores))
    if after != before:
        torch.set_num_threads(after)
    workers = None
    share = len(cores) if bound else max(len(cores) // len(gpu_nodes), 1)
    if len(gpu_nodes) > 1:  # (one of several processes of this host)
        workers = _share_compile_workers(share, len(allowed))
    weights = weights_half_threads(share, len(gpu_nodes), after, requested_threads)
    return HostPlacement(node, tuple(cores), after, bound, before, workers, weights)


def place_host_for(config: Any, device: torch.device, ranks: Any) -> HostPlacement:
    """``place_host`` for an engine on ``device``: its GPU's NUMA node, gathered from the processes of this host
    (``ranks``, optim/ranks.py: local-rank order). A CPU device is never bound: no PCIe root to be near, and the
    CPU's own processes (tests, gloo) share the few cores better unbound."""
    mine = numa.gpu_placement(device.index if device.index is not None else torch.cuda.current_device()).node \
        if device.type == "cuda" else None
    affinity = config.host_affinity if device.type == "cuda" else "none"
    return place_host(affinity, config.host_threads, ranks.node_gather_object(mine), ranks.local_rank)
