"""Where a process's host work runs: its GPU's NUMA node, and the cores it takes there.

A training step's host side is the AdamW pass over the FP32 state and the DMA of each layer in and its gradient
out. Both are bound by host memory bandwidth; both are slower when the memory or the cores sit on another NUMA node
than the GPU's PCIe root (every byte crosses the socket link). So where the processes' GPUs cover every node, each
process runs its threads on its GPU's node; the pages it touches first (its moments, its shard, its pinned staging)
then land there too, since Linux places a page on the node of the thread that first writes it. Where they do not
(one process on a two-socket host), confining it to one node would halve the memory bandwidth the AdamW lives on:
the processes split all the cores instead. Either way processes split cores instead of each taking all of them
(N ranks x all cores oversubscribes the host and the spinning OpenMP teams fight).

Mechanism only: reads sysfs (what the kernel says about this machine), takes the decision's inputs as arguments.
The decision is ``plan_cores``; ``bind_process`` applies it to every thread of the process.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import asdict, dataclass

SYS_NODES = "/sys/devices/system/node"
SYS_PCI = "/sys/bus/pci/devices"


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def nodes(root: str = SYS_NODES) -> dict[int, list[int]]:
    """NUMA node -> its cores, as the kernel lists them; one node 0 holding every core where there is no sysfs."""
    found: dict[int, list[int]] = {}
    for d in glob.glob(os.path.join(root, "node[0-9]*")):
        m = re.search(r"node(\d+)$", d)
        text = _read(os.path.join(d, "cpulist"))
        if m and text is not None:
            found[int(m.group(1))] = parse_cpulist(text)
    return dict(sorted(found.items())) or {0: list(range(os.cpu_count() or 1))}


@dataclass(frozen=True)
class GpuPlacement:
    """A GPU's PCIe address and the NUMA node / cores the kernel says are local to it (None: not known)."""

    pci: str | None
    node: int | None
    cpus: tuple[int, ...]

    def as_dict(self) -> dict:
        return asdict(self)


def gpu_placement(index: int, root: str = SYS_PCI) -> GpuPlacement:
    """``cuda:index``'s placement, read from sysfs by its PCI address (CUDA's numbering, as torch sees it)."""
    import torch

    p = torch.cuda.get_device_properties(index)
    ids = [getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(v is None for v in ids):
        return GpuPlacement(None, None, ())
    pci = f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
    return placement_of_pci(pci, root)


def placement_of_pci(pci: str, root: str = SYS_PCI) -> GpuPlacement:
    node_text = _read(os.path.join(root, pci, "numa_node"))
    node = int(node_text) if node_text not in (None, "") else None
    cpus = _read(os.path.join(root, pci, "local_cpulist"))
    return GpuPlacement(pci, node if node is not None and node >= 0 else None,
                        tuple(parse_cpulist(cpus)) if cpus else ())


def plan_cores(node_cpus: dict[int, list[int]], allowed: set[int], gpu_nodes: list[int | None],
               local_rank: int) -> tuple[int | None, list[int]]:
    """(node, cores) for the process of ``local_rank`` among the host's processes whose GPUs sit on
    ``gpu_nodes`` (one entry per local rank, in order; None where unknown or no GPU).

    When the processes' GPUs cover every NUMA node that has allowed cores, each process takes its GPU's node's
    allowed cores, split evenly in local-rank order among the processes on that node: every node's memory
    bandwidth then serves its own ranks' shards. Otherwise (one node, no NUMA information, one process, or every GPU
    on one node of several) every process keeps every allowed core, unbound (the caller splits the thread count):
    confining them to the GPUs' node would leave the other nodes' memory bandwidth, which the memory-bound host
    AdamW needs more than a nearer PCIe root, unused, and splitting the cores of one node gains no locality while
    a rank's other threads (the training loop, autograd's, NCCL's, the CUDA driver's) then preempt its AdamW
    threads on its few cores: measured on a 2-GPU host of one node, each rank's weights pass ended on the 4 ms
    scheduler tick (36 / 40 ms per layer instead of ~34; integration/PERF.md, lever 79). Each share keeps at least
    one core; a share that would be empty (more processes than cores) falls back to every core of its pool.
    """
    busy = {n for n, cpus in node_cpus.items() if set(cpus) & allowed}
    node = gpu_nodes[local_rank]
    pool = sorted(set(node_cpus.get(node, ())) & allowed) if node is not None else []
    if not (pool and len(busy) > 1 and busy <= set(gpu_nodes)):
        return (node if len(busy) == 1 else None), sorted(allowed)
    peers = [r for r, n in enumerate(gpu_nodes) if n == node]
    k, i = len(peers), peers.index(local_rank)
    share = len(pool) // k
    if share == 0:
        return node, pool
    return node, pool[i * share:(i + 1) * share]


def bind_process(cpus: list[int]) -> int:
    """Run every thread of this process (and threads it starts later) on ``cpus``; returns threads moved. A
    thread that ended meanwhile is skipped."""
    target = set(cpus)
    moved = 0
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), target)
            moved += 1
        except (ProcessLookupError, PermissionError):
            continue
    return moved
