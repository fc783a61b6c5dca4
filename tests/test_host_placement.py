"""Where each process's host work runs (issue 45 part 1): its GPU's NUMA node and its share of the cores,
decided by core/numa.py from sysfs, applied by core/threads.py, reported in the run summary. CPU only: the sysfs
of a 2-node host with two GPUs is written into a temporary directory."""

from __future__ import annotations

import os

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.core import numa, threads
from hf_megatrain.engine.summary import format_summary, run_summary

from .models import tiny


def test_cpulist_and_a_gpu_on_node_one(tmp_path):
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    nodes = tmp_path / "node"
    for n, cpus in ((0, "0-7"), (1, "8-15")):
        (nodes / f"node{n}").mkdir(parents=True)
        (nodes / f"node{n}" / "cpulist").write_text(cpus + "\n")
    pci = tmp_path / "pci" / "0000:81:00.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("1\n")
    (pci / "local_cpulist").write_text("8-15\n")
    assert numa.nodes(str(nodes)) == {0: list(range(8)), 1: list(range(8, 16))}
    g = numa.placement_of_pci("0000:81:00.0", str(tmp_path / "pci"))
    assert (g.node, g.cpus) == (1, tuple(range(8, 16)))
    (pci / "numa_node").write_text("-1\n")  # (a VM that hides its topology)
    assert numa.placement_of_pci("0000:81:00.0", str(tmp_path / "pci")).node is None


def test_ranks_split_their_gpus_nodes_and_never_oversubscribe():
    nodes = {0: list(range(8)), 1: list(range(8, 16))}
    every = set(range(16))
    # one GPU per node: each rank takes its node's cores
    assert numa.plan_cores(nodes, every, [0, 1], 0) == (0, list(range(8)))
    assert numa.plan_cores(nodes, every, [0, 1], 1) == (1, list(range(8, 16)))
    # four ranks, two per node: halves of each node, disjoint, covering the host
    shares = [numa.plan_cores(nodes, every, [0, 0, 1, 1], r)[1] for r in range(4)]
    assert sorted(c for s in shares for c in s) == sorted(every) and all(len(s) == 4 for s in shares)
    # no NUMA information (a VM), one node: every rank keeps every core (the thread count is split, not the cores)
    assert numa.plan_cores({0: list(range(16))}, every, [None, None], 1) == (None, list(range(16)))
    assert numa.plan_cores({0: list(range(16))}, every, [0, 0], 1) == (0, list(range(16)))
    # one process, or every GPU on one node of two: not confined to that node (the other node's memory bandwidth
    # serves the host AdamW), not bound
    assert numa.plan_cores(nodes, every, [1], 0) == (None, list(range(16)))
    assert numa.plan_cores(nodes, every, [0, 0], 1) == (None, list(range(16)))
    # one node's cores allowed by the launcher: that node, the processes split it
    assert numa.plan_cores(nodes, {8, 9}, [1, 1, 1], 2) == (1, [8, 9])


def test_place_host_binds_every_thread_and_sizes_the_pool():
    before_aff, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        # rank 1 of 2 whose GPUs sit on no known node: unbound, half the cores' worth of threads
        torch.set_num_threads(1)  # (as torchrun leaves it)
        p = threads.place_host("auto", 0, [None, None], 1)
        cores = sorted(before_aff)
        assert list(p.cores) == cores and not p.bound and os.sched_getaffinity(0) == before_aff
        assert p.threads == threads.share_threads(len(cores) // 2, 2) == torch.get_num_threads()
        assert "cores" in p.describe()
        # rank 1 of 2 whose GPUs sit on the two nodes of a (made-up) host: bound to its node's cores
        if len(cores) >= 2:
            fake = {0: cores[:len(cores) // 2], 1: cores[len(cores) // 2:]}
            real = threads.numa.nodes
            threads.numa.nodes = lambda: fake  # type: ignore[assignment]
            try:
                b = threads.place_host("auto", 0, [0, 1], 1)
            finally:
                threads.numa.nodes = real  # type: ignore[assignment]
            assert b.bound and list(b.cores) == fake[1] == sorted(os.sched_getaffinity(0))
            assert b.threads == threads.share_threads(len(fake[1]), 2)
            os.sched_setaffinity(0, before_aff)
        q = threads.place_host("none", 0, [None, None], 1)  # the launcher's affinity kept
        assert not q.bound and os.sched_getaffinity(0) == before_aff
    finally:
        os.sched_setaffinity(0, before_aff)
        torch.set_num_threads(before_threads)


def test_the_weights_half_of_a_split_update_takes_the_whole_share():
    # two processes on a 32-core host: 12 AdamW threads each, the weights half (the next forward waits for it) 16
    assert threads.share_threads(16, 2) == 12 and threads.weights_half_threads(16, 2, 12, 0) == 16
    assert threads.weights_half_threads(32, 1, 32, 0) == 32  # (one process: every core already)
    assert threads.weights_half_threads(16, 2, 12, 10) == 12  # (a count the user set applies to both halves)
    assert threads.weights_half_threads(16, 2, 20, 0) == 20  # (a larger launcher setting, never lowered)
    before_aff, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        cores = len(before_aff)
        p = threads.place_host("none", 0, [None, None], 1)
        assert p.weights_threads == max(p.threads, cores // 2)
        assert threads.place_host("none", 3, [None, None], 1).weights_threads == 3
        alone = threads.place_host("none", 0, [None], 0)
        assert alone.weights_threads == alone.threads and "weights half" not in alone.describe()
    finally:
        os.sched_setaffinity(0, before_aff)
        torch.set_num_threads(before_threads)


def test_compile_workers_take_the_process_share_of_the_cores():
    assert threads.compile_workers(32, 64, 16) == 16  # (inductor's default on a 64-core host; 4 processes)
    assert threads.compile_workers(32, 64, 48) == 32  # (never more than inductor's own)
    assert threads.compile_workers(8, 64, 16) == 8  # (a count the user set stays)
    assert threads.compile_workers(2, 2, 0) == 1  # (at least one)


def test_several_processes_share_the_compile_workers():
    import torch._inductor.config as inductor

    before_aff, before_threads, before_workers = os.sched_getaffinity(0), torch.get_num_threads(), \
        inductor.compile_threads
    try:
        inductor.compile_threads = min(32, len(before_aff))  # (inductor's default here)
        alone = threads.place_host("none", 0, [None], 0)
        assert alone.compile_workers is None and inductor.compile_threads == min(32, len(before_aff))
        p = threads.place_host("none", 0, [None, None], 1)
        assert p.compile_workers == inductor.compile_threads == min(32, max(len(before_aff) // 2, 1))
        assert "compile workers" in p.describe()
    finally:
        inductor.compile_threads = before_workers
        os.sched_setaffinity(0, before_aff)
        torch.set_num_threads(before_threads)


def test_the_run_summary_says_where_the_host_threads_run():
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    s = run_summary(engine)
    assert s["host_placement"]["threads"] == torch.get_num_threads()
    assert "host threads:" in format_summary(s) and not s["host_placement"]["bound"]  # (a CPU device: never bound)
    # the optimizer runs a split update's weights half on the placement's count (one process: the same count)
    assert engine.create_optimizer().weights_threads == s["host_placement"]["weights_threads"] == torch.get_num_threads()


def test_host_affinity_is_validated():
    with pytest.raises(ValueError, match="host_affinity"):
        MegaTrainConfig(host_affinity="numa")
