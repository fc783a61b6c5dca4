"""The disk tier (``optimizer_state_dir``) in the plan: whether the AdamW moments it keeps on disk stay in the page
cache, so that a step runs at the in-RAM rate, or cross the disk on every step.

The moments are memory-mapped files (optim/, docs/lean_store.md). Measured on the 2-core CPU box
(integration/results/disk_tier/): while they fit in the page cache a step runs as in RAM (the first one faults them
in, 5x); once they exceed the RAM the plan leaves, every step reads them in and writes them back, 16 bytes per
parameter at the disk's rate (~20 s per billion parameters at its 0.8 GB/s). The page cache only gets what the
plan leaves of the RAM the engine may use (``host_memory_fraction``), and an LRU-like cache that is swept in a
cycle longer than itself keeps nothing of it for the next sweep: either all of it is cached, or none is counted.
"""

from __future__ import annotations

import dataclasses
import os

from ..config import MegaTrainConfig
from ..core.memory import format_bytes
from .predict import DISK_MOMENTS_ROW, MemoryPlan

__all__ = ["disk_moment_bytes", "page_cache_room", "moments_cached", "with_disk_tier", "disk_tier_note"]


def disk_moment_bytes(plan: MemoryPlan) -> int:
    """Bytes of AdamW moments the plan keeps on disk (0: no disk tier)."""
    return plan.disk.get(DISK_MOMENTS_ROW, 0)


def page_cache_room(plan: MemoryPlan, config: MegaTrainConfig, host_available: int) -> int:
    """Host bytes the plan leaves to the page cache: the engine's share of the RAM less the plan's peak."""
    return max(int(config.host_memory_fraction * host_available) - plan.host_total, 0)


def moments_cached(plan: MemoryPlan, config: MegaTrainConfig, host_available: int) -> bool:
    """The disk tier's moments fit the page cache beside the plan (no steady-state disk traffic)."""
    return disk_moment_bytes(plan) <= page_cache_room(plan, config, host_available)


def with_disk_tier(config: MegaTrainConfig) -> MegaTrainConfig:
    """``config`` with the AdamW moments on disk, for planning only (nothing is written): the directory is the
    user's, or the working directory standing in for the one they would choose."""
    return dataclasses.replace(config, optimizer_state_dir=config.optimizer_state_dir or os.curdir)


def disk_tier_note(plan: MemoryPlan, config: MegaTrainConfig, host_available: int, disk_gbps: float) -> str:
    """What the estimate says about the disk tier's traffic (empty without one)."""
    on_disk = disk_moment_bytes(plan)
    if not on_disk:
        return ""
    room = page_cache_room(plan, config, host_available)
    if on_disk <= room:
        return (f"disk tier: {format_bytes(on_disk)} of AdamW moments on disk fit the page cache beside the plan "
                f"({format_bytes(room)} left): steady steps run at the in-RAM rate (measured; the first step faults "
                "them in, ~5x slower: docs/lean_store.md)")
    return (f"disk tier: {format_bytes(on_disk)} of AdamW moments on disk, {format_bytes(room)} of RAM left for the "
            f"page cache: every step reads them and writes them back ({format_bytes(2 * on_disk)}) at "
            f"{disk_gbps:g} GB/s (--disk-gbps), {2 * on_disk / (disk_gbps * 1e9):,.0f} s of disk per step, counted "
            "in the step time")
