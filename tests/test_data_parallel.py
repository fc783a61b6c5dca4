"""Data parallel over processes of one host (issue 19), on the CPU with gloo: 2 processes vs 1 on the same global
batch, resume across process counts, the one shared store, and the combinations the first version refuses."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from hf_megatrain import MegaTrainConfig
from hf_megatrain.core.plan import PlanInputs, build_plans
from hf_megatrain.parallel import DataParallel
from hf_megatrain.parallel.setup import check_plans, data_parallel_config
from hf_megatrain.parallel.shards import ALIGN, clip_spans, shard_range, shard_size
from hf_megatrain.parallel.shared_alloc import new_run_dir, stale_run_dirs
from tests import dp_workers as W
from tests.parity import rel


def _spawn(fn, tmp: str, world: int = 2) -> None:
    mp.spawn(fn, args=(world, tmp), nprocs=world, join=True)


def _assert_close(a: dict, b: dict, what: str, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    worst = max((rel(a[n], b[n]), n) for n in b)
    assert worst[0] <= tol, f"{what}: {worst[1]} differs by {worst[0]:.2e} relative"


@pytest.mark.slow  # (spawns processes)
def test_two_processes_match_one_and_resume_across_counts(tmp_path):
    """fp32, 3 steps (2 micro-batches each), every step clipped, weight decay: 2 gloo processes end where one
    process on the same global batch ends (1e-5 relative per tensor); a checkpoint of 2 processes resumed in 1, and
    of 1 resumed in 2, end there too. bf16 compute: the shared compute copies equal the masters' rounding. LoRA
    (the frozen base in the shared store) matches too."""
    tmp = str(tmp_path)
    engine, opt = W.make_engine(None, tmp)
    start = W.weights(engine)
    norms = W.run_steps(engine, opt, 0, 2)
    W.save(engine, os.path.join(tmp, "ckpt_1proc"))
    norms += W.run_steps(engine, opt, 2, W.STEPS)
    ref = W.weights(engine)
    assert min(norms) > W.CLIP  # (every step clipped)
    assert all(rel(ref[n], start[n]) > 1e-4 for n in ref)  # (every tensor moved)

    _spawn(W.train_worker, tmp)
    # The global gradient norm (scale-sensitive, where clipped AdamW is not) on both ranks, each step.
    for rank in (0, 1):
        dp_norms = torch.load(os.path.join(tmp, f"norms_rank{rank}.pt"))
        assert max(abs(a / b - 1) for a, b in zip(dp_norms, norms)) < 1e-5, (dp_norms, norms)
    _assert_close(torch.load(os.path.join(tmp, "final_2proc.pt")), ref, "2 processes vs 1")
    _assert_close(torch.load(os.path.join(tmp, "resumed_1to2.pt")), ref, "1-process checkpoint resumed in 2")

    # bf16: rounding depends on how rows are grouped (2-row chunks vs 4 rows moves weights by ~2e-2 relative after
    # two steps at this LR, in one process). The 2 processes must stay within that noise of one process; the exact
    # part (each rank refreshes the shared compute copy over its shard) is checked in rank 0.
    runs = {}
    for mb in (0, 2):
        bf16, opt = W.make_engine(None, tmp, "bfloat16", micro_batch_size=mb)
        W.run_steps(bf16, opt, 0, 2)
        runs[mb] = W.weights(bf16)
    noise = max(rel(runs[2][n], runs[0][n]) for n in runs[0])
    _assert_close(torch.load(os.path.join(tmp, "bf16_2proc.pt")), runs[2], "bf16 compute", tol=noise)

    lora, opt = W.make_engine(None, tmp, peft=True)
    W.run_steps(lora, opt, 0, W.STEPS)
    _assert_close(torch.load(os.path.join(tmp, "lora_2proc.pt")), W.weights(lora), "LoRA (frozen base shared)")

    engine, opt = W.make_engine(None, tmp)
    W.resume(engine, os.path.join(tmp, "ckpt_2proc"))
    W.run_steps(engine, opt, 2, W.STEPS)
    _assert_close(W.weights(engine), ref, "2-process checkpoint resumed in 1")

    # One copy per host: both ranks mapped the very same files (same device:inode), one per host buffer.
    files = torch.load(os.path.join(tmp, "mapped.pt"))
    assert files[0] and files[0] == files[1]
    assert not [d for d in os.listdir(tmp) if d.startswith("megatrain-")]  # (removed once mapped)


@pytest.mark.slow  # (spawns processes)
def test_shared_store_is_one_copy(tmp_path):
    _spawn(W.shared_store_worker, str(tmp_path))


def test_shards_cover_each_unit_once():
    for n in (0, 1, 63, 64, 65, 1000, 9280):
        for world in (1, 2, 3, 8):
            s = shard_size(n, world)
            assert s % ALIGN == 0 and s * world >= n
            ranges = [shard_range(n, r, world) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert all((lo % ALIGN == 0 or lo == n) and hi - lo <= s for lo, hi in ranges)
    assert clip_spans([(0, 10), (10, 30), (40, 50)], 5, 45) == [(5, 10), (10, 30), (40, 45)]
    assert clip_spans([(0, 10)], 10, 20) == []


def _dp(world: int = 2) -> DataParallel:
    return DataParallel(0, world, 0, torch.device("cpu"))


@pytest.mark.parametrize("over, needle", [
    (dict(device_layers=2), "device_layers"),
    (dict(device_step_layers=1), "device_step_layers"),
    (dict(resident_placement="host"), "resident_placement"),
    (dict(grad_offload_dtype="bfloat16"), "grad_offload_dtype"),
])
def test_unsupported_combinations_say_what_to_change(over, needle):
    with pytest.raises(ValueError, match=needle):
        data_parallel_config(MegaTrainConfig(**over), _dp())


def test_disk_state_refused(tmp_path):
    with pytest.raises(ValueError, match="optimizer_state_dir"):
        data_parallel_config(MegaTrainConfig(optimizer_state_dir=str(tmp_path)), _dp())


def test_auto_placement_resolves_to_host_layers():
    cfg = data_parallel_config(MegaTrainConfig(), _dp())
    assert (cfg.device_layers, cfg.device_step_layers) == (0, 0)


def test_plans_the_path_cannot_run_are_refused():
    inputs = PlanInputs([100, 100, 50], [0, 0, 0], "cuda", 10 ** 12)
    check_plans(build_plans(inputs, MegaTrainConfig(device_layers=0, device_step_layers=0,
                                                    resident_placement="device")))
    with pytest.raises(ValueError, match="resident_placement='device'"):
        check_plans(build_plans(inputs, MegaTrainConfig(device_layers=0, device_step_layers=0,
                                                        resident_placement="host")))
    with pytest.raises(ValueError, match="layer 0"):
        check_plans(build_plans(inputs, MegaTrainConfig(device_layers=1, device_step_layers=0,
                                                        resident_placement="device")))


def test_needs_torch_distributed():
    if torch.distributed.is_initialized():
        pytest.skip("a process group exists")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DataParallel.from_process_group()


def test_stale_run_dirs_removed(tmp_path):
    dead = tmp_path / "megatrain-999999999-abc"  # (no such pid)
    dead.mkdir()
    assert stale_run_dirs(str(tmp_path)) == [str(dead)]
    fresh = new_run_dir(str(tmp_path))
    assert not dead.exists() and os.path.isdir(fresh) and stale_run_dirs(str(tmp_path)) == []


@pytest.mark.slow  # (spawns processes)
def test_trainer_two_processes_match_one_and_resume(tmp_path):
    """MegaTrainTrainer under 2 gloo processes (accelerate's multi-CPU state; the model is not DDP-wrapped):
    final weights equal one process on the same global batches, resume 1 -> 2 (the model from
    ``from_pretrained_streamed``, which finds the launch's ranks) and 2 -> 1 included; so does ``evaluate()``'s
    loss (the eval batches split over the processes, their losses gathered by Trainer); and with rank 1's model
    built on the meta device (only rank 0 holds the weights in RAM)."""
    import socket

    tmp = str(tmp_path)
    W.tiny("llama").save_pretrained(os.path.join(tmp, "init_model"))  # (for from_pretrained_streamed, resume 1 -> 2)
    ref = W.trainer_run(tmp, 1, "trainer_1proc")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(W.trainer_worker, args=(2, tmp, port), nprocs=2, join=True)
    _assert_close(torch.load(os.path.join(tmp, "trainer_final_2proc.pt")), ref, "Trainer: 2 processes vs 1")
    _assert_close(torch.load(os.path.join(tmp, "trainer_resumed_1to2.pt")), ref, "Trainer: resumed 1 -> 2")
    _assert_close(torch.load(os.path.join(tmp, "trainer_meta_follower.pt")), ref, "Trainer: rank 1's model on meta")
    # save_model on both processes: one standard checkpoint, written once, that plain transformers loads
    import transformers
    loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "trainer_2proc", "final"))
    for name, p in loaded.named_parameters():
        assert rel(p.detach(), ref[name]) < 1e-5, name
    resumed = W.trainer_run(tmp, 1, "trainer_2to1", resume=os.path.join(tmp, "trainer_2proc", "checkpoint-2"))
    _assert_close(resumed, ref, "Trainer: resumed 2 -> 1")


@pytest.mark.slow  # (spawns processes)
def test_followers_may_hold_a_meta_model(tmp_path):
    """Only rank 0 needs the weights in RAM: rank 1's model on the meta device (accelerate's init_empty_weights)
    trains to where one process ends (the store and the replicated state are rank 0's). Rank 0's model on meta is
    refused on both ranks -- no rank left waiting in a collective -- saying what to do."""
    tmp = str(tmp_path)
    engine, opt = W.make_engine(None, tmp)
    W.run_steps(engine, opt, 0, W.STEPS)
    _spawn(W.meta_follower_worker, tmp)
    _assert_close(torch.load(os.path.join(tmp, "meta_follower.pt")), W.weights(engine), "rank 1 on meta vs 1 process")
    errors = [torch.load(os.path.join(tmp, f"meta_leader_rank{r}.pt")) for r in (0, 1)]
    assert "rank 0" in errors[0] and "meta device" in errors[0] and "from_pretrained_streamed" in errors[0], errors
    assert "failed on rank(s) [0]" in errors[1], errors


def test_meta_model_alone_refused():
    """One process with a model on the meta device: a clear error, not a tensor-type failure deep in conversion."""
    with pytest.raises(ValueError, match="meta device.*from_pretrained_streamed"):
        W.make_engine(None, "/dev/shm", meta=True)


def test_moved_model_refused_rather_than_trained_stale():
    """A converted model moved with ``.to`` (accelerate's multi-process CPU device is "cpu:0": the copy leaves
    the resident parameters apart from the engine's buffers) raises at the next forward instead of training on
    weights the optimizer no longer updates."""
    engine, _ = W.make_engine(None, "/tmp")
    engine.model.to(torch.device("cpu", 0))
    ids, labels = W.batches()[0][0]
    with pytest.raises(RuntimeError, match="no longer shares"):
        engine(input_ids=ids, labels=labels)


@pytest.mark.slow  # (spawns processes)
def test_conversion_failing_on_one_rank_fails_on_all(tmp_path):
    tmp = str(tmp_path)
    _spawn(W.failing_conversion_worker, tmp)
    assert "rank 1 out of memory" in torch.load(os.path.join(tmp, "error_rank1.pt"))
    assert "failed on rank(s) [1]" in torch.load(os.path.join(tmp, "error_rank0.pt"))
    assert not [d for d in os.listdir(tmp) if d.startswith("megatrain-")]


def test_a_unit_loads_only_once_every_rank_wrote_its_shard():
    """StepState.peers: a finished update is published as this rank's count; a load (and wait_all) waits until every
    rank's cell reaches the reader's own count, so no step-end barrier is needed (fake peers: a tensor + a thread)."""
    import threading
    import time

    from hf_megatrain.core.step_state import StepState
    from hf_megatrain.parallel.peer_cells import PeerCells

    cells = torch.zeros(2, 3, dtype=torch.int64)  # 2 ranks, 3 units; this process is rank 0
    state = StepState(3)
    state.peers = PeerCells(cells, 0, poll_s=1e-4)
    state.begin_update(1)
    state.finish_update(1)
    assert cells[0].tolist() == [0, 1, 0] and state.updates == [0, 1, 0]
    state.touch(1)  # a checkpoint load moves the version, not the update count
    assert state.updates[1] == 1 and cells[0, 1] == 1
    state.wait_loadable(0)  # nothing updated yet: no wait

    loaded = threading.Event()
    t = threading.Thread(target=lambda: (state.wait_loadable(1), loaded.set()))
    t.start()
    time.sleep(0.05)
    assert not loaded.is_set()  # rank 1 has not written its shard of update 1
    cells[1, 1] = 1
    t.join(5)
    assert loaded.is_set()
    cells[1, 1] = 2  # a peer one update ahead (its next update of the unit) does not block
    state.wait_loadable(1)
    state.wait_all()
    with pytest.raises(ValueError, match="int64"):
        PeerCells(torch.zeros(2, 3), 0)
    # A speculative update counts for the other ranks only once judged right; one taken back never counts.
    state.begin_update(2)
    state.finish_update(2, changed=True, keep_grad=True)  # speculative, not judged yet
    assert cells[0, 2] == 0 and state.updates[2] == 0
    state.finish_update(2, changed=False)  # judged right
    assert cells[0, 2] == 1
    state.begin_update(2)
    state.finish_update(2, changed=True, keep_grad=True)
    state.touch(2)  # taken back (the step clipped) ...
    state.begin_update(2)
    state.finish_update(2)  # ... and redone with the true factor: one update
    assert cells[0, 2] == 2 and state.updates[2] == 2
    stuck = PeerCells(torch.zeros(2, 1, dtype=torch.int64), 0, poll_s=1e-4, timeout_s=0.02)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0, 1\] have not written"):
        stuck.wait(0, 1)


@pytest.mark.slow  # spawns 4 + 2 processes (~30 s on 2 cores)
def test_multi_gpu_script_tiny(tmp_path):
    """integration/multi_gpu.py (the GPU parity / scaling script) end to end on the CPU with gloo."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "integration", "multi_gpu.py"), "--tiny", "--out",
                          str(tmp_path), "--shm", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.load(open(tmp_path / "multi_gpu_cpu.json"))
    fp32 = next(p for p in res["parity"] if p["compute_dtype"] == "float32")
    assert fp32["max_rel"] < 1e-4
    assert res["scaling"]["many"]["processes"] == 2 and res["scaling"]["speedup"] > 0


def test_planner_counts_the_shared_store_once():
    """``estimate(gpus=N)``: the placement the data-parallel path runs (every layer on the host), the store once,
    each process's own host buffers N times; an option the path refuses is refused by the planner too."""
    from hf_megatrain import planner
    from tests.models import tiny

    shape = planner.ModelShape.from_model(tiny("llama"))
    cfg = MegaTrainConfig(compute_dtype="bfloat16")
    one = planner.estimate(shape, cfg, 64, 2, device_type="cuda", gpu_free=80 << 30)
    two = planner.estimate(shape, cfg, 64, 2, device_type="cuda", gpu_free=80 << 30, gpus=2)
    alone = planner.estimate(shape, MegaTrainConfig(compute_dtype="bfloat16", device_layers=0, device_step_layers=0),
                             64, 2, device_type="cuda", gpu_free=80 << 30)
    assert one.store_host_bytes == 0  # (one process keeps this tiny model on the GPU) ...
    assert two.store_host_bytes == alone.store_host_bytes > 0  # ... N processes step every layer on the host, once
    stage = "executor staging (2 x layer, offload dtype)"  # (each process lands its shard of a gradient only)
    for key, v in alone.host.items():
        assert two.host[key] == (v if key in planner.predict.STORE_ROWS else 2 * v if key != stage else
                                 2 * 2 * 4 * shard_size(max(shape.layer_numels), 2)), key
    with pytest.raises(ValueError, match="device_layers"):
        planner.estimate(shape, MegaTrainConfig(device_layers=1), 64, 2, device_type="cuda", gpus=2)


@pytest.mark.slow  # (spawns processes)
def test_speculative_shard_updates_match_one_process(tmp_path):
    """Speculation across processes: each rank updates its shard as the reduce-scattered gradient lands, the global
    norm judges it at step(); updates that stand count for the other ranks' loads only once judged, a clipping step
    takes back and redoes each rank's shard. 2 processes end where one process ends (1e-5)."""
    tmp = str(tmp_path)
    engine, opt = W.make_engine(None, tmp)
    spec, back = W.run_speculative_steps(engine, opt)
    assert spec > 0 and back > 0  # (both paths ran in the reference)
    ref = W.weights(engine)
    _spawn(W.speculative_worker, tmp)
    for rank in (0, 1):
        assert torch.load(os.path.join(tmp, f"spec_counts_rank{rank}.pt")) == (spec, back)
    _assert_close(torch.load(os.path.join(tmp, "spec_2proc.pt")), ref, "speculative, 2 processes vs 1")


def test_shared_store_refuses_a_too_small_ram_file_system(tmp_path):
    """The shared files are sparse until written: a /dev/shm smaller than the store would fail with SIGBUS in the
    middle of training. The allocator refuses up front, saying what to change."""
    from hf_megatrain.core.memory import HostMemoryError
    from hf_megatrain.parallel.shared_alloc import SharedHostAllocator

    alloc = SharedHostAllocator(new_run_dir(str(tmp_path)), capacity=1000)
    alloc(200, torch.float32, pin=False)  # 800 bytes
    with pytest.raises(HostMemoryError, match="shm-size|shared_memory_dir"):
        alloc(100, torch.float32, pin=False)


@pytest.mark.slow  # (spawns 4 processes)
def test_two_simulated_hosts_match_one_process_and_resume(tmp_path):
    """Several hosts, simulated: 4 gloo processes as 2 hosts x 2 local ranks (``host=`` names each process's node;
    each host its own ``shared_memory_dir``: one store per node), fp32, 3 steps x 2 micro-batches, every step
    clipped, weight decay, vs one process on the same global batch: every tensor within 1e-5 relative, the global
    norm of every step on every rank too (each shard counted once, not once per node); both hosts' stores start
    from rank 0's weights (host 1's model held others) and end bit-identical; a checkpoint written by the 2x2 run
    (rank 0) resumes in one process."""
    tmp = str(tmp_path)
    for node in range(W.HOSTS):
        os.makedirs(os.path.join(tmp, f"host{node}"))
    engine, opt = W.make_engine(None, tmp)
    start = W.weights(engine)
    norms = W.run_steps(engine, opt, 0, W.STEPS)
    ref = W.weights(engine)
    assert min(norms) > W.CLIP  # (every step clipped)

    _spawn(W.simulated_hosts_worker, tmp, world=W.HOSTS * W.PER_HOST)
    for node in range(W.HOSTS):
        _assert_close(torch.load(os.path.join(tmp, f"hosts_start_node{node}.pt")), start, f"host {node}'s start",
                      tol=0.0)
    for rank in range(W.HOSTS * W.PER_HOST):
        dp_norms = torch.load(os.path.join(tmp, f"hosts_norms_rank{rank}.pt"))
        assert max(abs(a / b - 1) for a, b in zip(dp_norms, norms)) < 1e-5, (rank, dp_norms, norms)
    final = [torch.load(os.path.join(tmp, f"hosts_final_node{node}.pt")) for node in range(W.HOSTS)]
    _assert_close(final[1], final[0], "host 1's store vs host 0's", tol=0.0)  # (the same steps, bit for bit)
    _assert_close(final[0], ref, "2 hosts x 2 processes vs 1")

    # One store per host: the ranks of a host mapped the same files, the two hosts different ones, each in its own
    # directory, removed once mapped.
    files = torch.load(os.path.join(tmp, "hosts_mapped.pt"))
    assert files[0] and files[0] == files[1] and files[2] == files[3]
    assert not {f for f, _ in files[0]} & {f for f, _ in files[2]}
    for node in range(W.HOSTS):
        assert not os.listdir(os.path.join(tmp, f"host{node}"))

    engine, opt = W.make_engine(None, tmp)
    W.resume(engine, os.path.join(tmp, "ckpt_2x2"))
    W.run_steps(engine, opt, 2, W.STEPS)
    _assert_close(W.weights(engine), ref, "2x2 checkpoint resumed in 1")


def test_nodes_of_unequal_size_are_refused():
    """A node with fewer ranks would step other shards of its store than the others hold: refused."""
    with pytest.raises(ValueError, match="same number"):
        DataParallel(0, 3, 0, torch.device("cpu"), local_world=2, nodes=2)


@pytest.mark.slow
def test_split_shard_updates_are_the_whole_ones(tmp_path):
    """Data parallel with split host updates (new weights first, each rank's shard): a rank's load of a layer waits
    for every rank's WEIGHTS pass (parallel/peer_cells.py ``wait_weights``), not for their whole updates. The same
    bits as whole updates: masters, moments and the shared compute copies."""
    tmp = str(tmp_path)
    _spawn(W.split_worker, tmp)
    off, on = (torch.load(os.path.join(tmp, f"split_{s}.pt")) for s in ("off", "on"))
    assert off["split_steps"] == 0 and on["split_steps"] >= 2
    for name, t in off["weights"].items():
        assert torch.equal(on["weights"][name], t), name
    for key, t in off["state"].items():
        assert torch.equal(on["state"][key], t), key
    for a, b in zip(on["compute"], off["compute"]):
        assert torch.equal(a, b)


def test_loads_wait_for_the_ranks_weights_and_saves_for_their_whole_updates():
    """StepState with peers: a split update publishes its weights count at its WEIGHTS pass and its update count
    when final; a whole update publishes both at once; a load asks for the weights, ``wait_all`` for the updates."""
    from hf_megatrain.core.step_state import StepState

    class Peers:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda unit, count: self.calls.append((name, unit, count))

    peers = Peers()
    s = StepState(1, peers=peers)
    s.begin_update(0)
    s.finish_weights(0)  # (split: the new compute copy is written)
    s.wait_loadable(0)
    s.finish_update(0)
    s.begin_update(0)
    s.finish_update(0)  # (whole)
    s.wait_loadable(0)
    s.wait_all()
    assert peers.calls == [("publish_weights", 0, 1), ("wait_weights", 0, 1), ("publish", 0, 1),
                           ("publish_weights", 0, 2), ("publish", 0, 2), ("wait_weights", 0, 2), ("wait", 0, 2)]
