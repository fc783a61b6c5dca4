"""How many CPU threads the host AdamW gets: the one place the process's intra-op thread count is decided.

The host AdamW is memory-bound and wants every core the process may run on. Launchers often leave one:
``accelerate launch`` sets ``OMP_NUM_THREADS`` to ``--num_cpu_threads_per_process`` (default 1, multi-GPU or not)
and torchrun sets 1 per process, which would run the whole optimizer on one core (several times slower steps).
``auto`` gives each process its share of the cores (the data-parallel processes of one host share them) and only
ever raises the count: a larger setting the user chose stays.
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def host_threads(requested: int, processes: int, current: int, cores: int) -> int:
    """Threads to use: ``requested`` when > 0, else (auto) this process's share of ``cores`` among ``processes``
    (at least 1), never fewer than the ``current`` setting."""
    if requested > 0:
        return requested
    return max(current, cores // max(processes, 1), 1)


def apply_host_threads(requested: int, processes: int) -> tuple[int, int]:
    """Set torch's intra-op threads (the host AdamW's, compiled kernel included: it reads them when it is built)
    by ``host_threads``; returns (before, after)."""
    before = torch.get_num_threads()
    after = host_threads(requested, processes, before, usable_cores())
    if after != before:
        torch.set_num_threads(after)
    return before, after
