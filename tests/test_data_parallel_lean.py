"""The lean store (``lean_store=True``) with data parallel on the CPU (gloo): 2 processes vs 1 on the same global
batch, with the gradient plane on and off, ``lean_compute_copy``, ``exact_take_back``, clipping on every step and
on some steps only (speculation, take-back, a step skipped on one rank's non-finite shard), weight decay; resume
across process counts; the plans and the planner for N processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner
from hf_megatrain.core.plan import PlanInputs, Stepper, build_plans
from hf_megatrain.parallel import DataParallel
from hf_megatrain.parallel.setup import check_plans, data_parallel_config
from tests import dp_lean_workers as W
from tests.models import tiny
from tests.parity import rel

TOL = 1e-5


def _worst(a: dict, b: dict, steps: int = 0) -> tuple[float, str]:
    """The largest relative difference of a tensor (``steps``: the run's; then, as in tests/parity.py, parameters
    whose true gradient is zero -- k_proj.bias: softmax is shift-invariant -- get only rounding noise, which Adam
    normalises into full-size random steps in both runs: they are compared in absolute terms, within a thousandth
    of one Adam step per element and step)."""
    assert a.keys() == b.keys()
    noise = [n for n in b if steps and n.endswith("k_proj.bias")]
    for n in noise:
        assert float((a[n] - b[n]).abs().max()) <= 1e-3 * W.LR * steps, n
    return max((rel(a[n], b[n]), n) for n in b if n not in noise)


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x / y - 1) for x, y in zip(a, b))


@pytest.mark.slow  # (spawns processes; ~30 s on 2 cores)
def test_lean_two_processes_match_one_and_resume_across_counts(tmp_path):
    """Every case of tests/dp_lean_workers.py: 2 gloo processes end where one process over the same global batch
    ends (every master within 1e-5 relative; the global norm on both ranks and the loss of every step within
    1e-5), with as many re-runs and plane settlements; each rank keeps the plane of its shards only (the host the
    whole plane once). bf16 with the compute copy: the same weights as the full store in the same processes, each
    rank's shard of the shared copy the masters' rounding. A checkpoint of 2 processes resumes exactly in 1, and
    one of 1 in 2."""
    tmp = str(tmp_path)
    refs = {case: W.reference(case, tmp) for case in W.CASES}
    engine, opt, schedule = W.make(W.RESUME, tmp)
    W.run(engine, opt, schedule, 0, W.SAVE_AT)
    W.save(engine, os.path.join(tmp, "lean_ckpt_1proc"))
    del engine, opt

    mp.spawn(W.lean_worker, args=(2, tmp), nprocs=2, join=True)
    out = [torch.load(os.path.join(tmp, f"lean_rank{r}.pt")) for r in (0, 1)]

    worst = {}
    for case, ref in refs.items():
        dp = out[0][case]
        w, name = _worst(dp["weights"], ref["weights"], len(W.CASES[case][2]))
        assert w <= TOL, f"{case}: {name} differs by {w:.2e} relative"
        for r in (0, 1):
            got = out[r][case]
            assert _close(got["norms"], ref["norms"]) < TOL, (case, r, got["norms"], ref["norms"])
            assert _close(got["losses"], ref["losses"]) < TOL, (case, r, got["losses"], ref["losses"])
            assert got["skipped"] == ref["skipped"], case
            if "skip" not in case:  # (a skipped step: one rank re-runs where the other had nothing to take back)
                assert (got["regenerated"], got["plane"]) == (ref["regenerated"], ref["plane"]), case
        worst[case] = max(w, *(_close(out[r][case]["norms"], ref["norms"]) for r in (0, 1)))
        assert out[0][case]["plane_bytes"] + out[1][case]["plane_bytes"] == ref["plane_bytes"], case
        for (lo0, hi0), (lo1, hi1) in zip(out[0][case]["own"], out[1][case]["own"]):
            assert lo0 == 0 and hi0 == lo1 < hi1  # (each rank steps its own shard of every layer)
    # What the cases exercised (in the reference): every step clipped, re-runs without the plane, none with it.
    assert min(refs["plane_every"]["norms"]) > W.CLIP and refs["plane_every"]["regenerated"] == 0
    assert refs["rerun_every"]["regenerated"] == len(W.EVERY)
    assert refs["plane_mix"]["plane"] == 3 and refs["rerun_mix"]["regenerated"] == 3  # (steps 1, 3, 4)
    # The skipped step: rank 0 speculated on every layer and re-runs to take them back; rank 1, which speculated on
    # none (its first landed shard was non-finite), re-runs with it (the re-run is collective). One process, like
    # rank 1, had nothing to take back. With the plane, rank 0 takes back from it and nobody re-runs.
    assert refs["rerun_spec_skip"]["skipped"] == 1
    assert [out[r]["rerun_spec_skip"]["regenerated"] for r in (0, 1)] == [refs["rerun_spec_skip"]["regenerated"] + 1] * 2
    assert [out[r]["plane_spec_skip"]["plane"] for r in (0, 1)] == [refs["plane_spec_skip"]["plane"] + 1,
                                                                    refs["plane_spec_skip"]["plane"]]
    # (exact take-back: rank 0 restores its copies, nobody re-runs)
    assert [out[r]["exact_spec_skip"]["regenerated"] for r in (0, 1)] == [refs["exact_spec_skip"]["regenerated"]] * 2
    assert refs["plane_every"]["plane_bytes"] > 0 and refs["rerun_every"]["plane_bytes"] == 0

    # bf16 + the compute copy: as the full store in the same processes; each rank's shard of the copy exact.
    for case in ("copy_bf16", "copy_rerun_bf16"):
        w, name = _worst(out[0][case]["weights"], out[0]["full_bf16"]["weights"])
        assert w <= TOL, f"{case}: {name} differs from the full store by {w:.2e} relative"
        assert _close(out[0][case]["norms"], out[0]["full_bf16"]["norms"]) < TOL
        assert out[0][case]["copies_exact"] and out[1][case]["copies_exact"]
        worst[case] = w

    # Split updates from the plane (each rank its shards, loads waiting for every rank's new weights) = whole ones.
    assert out[0]["split_bf16"]["split_steps"] > 0 and out[0]["whole_bf16"]["split_steps"] == 0
    for name, t in out[0]["whole_bf16"]["weights"].items():
        assert torch.equal(out[0]["split_bf16"]["weights"][name], t), name
    assert out[0]["split_bf16"]["copies_exact"] and out[1]["split_bf16"]["copies_exact"]

    ref, steps = refs[W.RESUME]["weights"], len(W.CASES[W.RESUME][2])
    w12, name = _worst(out[0]["resumed_1to2"]["weights"], ref, steps)
    assert w12 <= TOL, f"1-process checkpoint resumed in 2: {name} differs by {w12:.2e}"
    w21, name = _worst(W.resumed(tmp, os.path.join(tmp, "lean_ckpt_2proc")), ref, steps)
    assert w21 <= TOL, f"2-process checkpoint resumed in 1: {name} differs by {w21:.2e}"
    print("worst relative differences:", {k: f"{v:.2e}" for k, v in {**worst, "1to2": w12, "2to1": w21}.items()})


def _dp(world: int = 2, nodes: int = 1) -> DataParallel:
    return DataParallel(0, world, 0, torch.device("cpu"), local_world=world // nodes, nodes=nodes)


def test_lean_store_is_accepted_on_one_host_and_refused_across_hosts():
    cfg = data_parallel_config(MegaTrainConfig(lean_store=True, lean_compute_copy=True), _dp())
    assert cfg.lean_store and (cfg.device_layers, cfg.device_step_layers) == (0, 0)
    with pytest.raises(ValueError, match="lean_store=True is not supported .* 2 hosts"):
        data_parallel_config(MegaTrainConfig(lean_store=True), _dp(4, nodes=2))


def test_lean_plans_pass_and_their_plane_is_fp32_with_data_parallel():
    """The ranks' gradients are reduced in FP32 (a mean of bf16 gradients is no bf16 value), so the plane a rank
    keeps is FP32 where one process on a GPU keeps a bf16 one."""
    inputs = dict(numels=[100, 100, 50], frozen_numels=[0, 0, 0], device_type="cuda", gpu_budget=10 ** 12)
    cfg = MegaTrainConfig(compute_dtype="bfloat16", lean_store=True, lean_grad_plane="on")
    one = build_plans(PlanInputs(**inputs), cfg)
    many = build_plans(PlanInputs(**inputs, data_parallel=True), cfg)
    check_plans(many)
    assert [p.stepper for p in many.layers] == [Stepper.LEAN] * 2
    assert {p.grad_plane for p in one.layers} == {2} and {p.grad_plane for p in many.layers} == {4}


def test_planner_counts_the_lean_store_and_its_plane_once():
    """``estimate(gpus=N)`` with the lean store: the store in shared memory once (12 B per streamed parameter, +4
    with the FP32 plane), the plane once per host (each rank holds its shards'), each rank's staging a shard."""
    from tests.models import tiny

    shape = planner.ModelShape.from_model(tiny("llama"))
    streamed = sum(shape.layer_numels)
    for plane, per in (("off", 12), ("on", 16)):
        cfg = MegaTrainConfig(compute_dtype="bfloat16", lean_store=True, lean_grad_plane=plane)
        two = planner.estimate(shape, cfg, 64, 2, device_type="cuda", gpu_free=80 << 30, gpus=2)
        layers = sum(v for k, v in two.host.items() if k in planner.predict.STORE_ROWS + (
            planner.predict.GRAD_PLANE_ROW,))
        assert layers == per * streamed, (plane, layers / streamed)
        one = planner.estimate(shape, cfg, 64, 2, device_type="cuda", gpu_free=80 << 30)
        stage = "executor staging (2 x layer, offload dtype)"
        assert 0 < two.host[stage] <= one.host[stage] + 2 * 64 * 4 * 2


def test_settle_path_per_process():
    """What one process would do with a step's decision; data-parallel ranks of a non-finite step then agree on
    RERUN if any of them needs it (optim/lean.py)."""
    from hf_megatrain.optim.speculation import Settle, StepDecision, settle_path

    nothing = StepDecision(False, [], set())
    spec = StepDecision(True, [3, 2], {3, 2})
    assert settle_path(nothing, True, False, True) is Settle.NOTHING  # (a rank whose first shard was non-finite)
    assert settle_path(spec, True, True, False) is Settle.REPLAY
    assert settle_path(spec, True, False, True) is Settle.RESTORE
    assert settle_path(spec, False, False, True) is Settle.RERUN  # (a clipping step needs the gradients again)
    assert settle_path(spec, True, False, False) is Settle.RERUN


@pytest.mark.slow  # (spawns processes)
def test_lean_trainer_two_processes_match_one_and_resume_in_one(tmp_path):
    """MegaTrainTrainer with the lean store and its plane under 2 gloo processes (accelerate's multi-CPU state):
    the final masters equal one process on the same global batches, and its checkpoint of step 2 resumes in one
    process to the same end."""
    import socket

    tmp = str(tmp_path)
    ref = W.trainer_run(tmp, 1, "lean_trainer_1proc")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(W.trainer_worker, args=(2, tmp, port), nprocs=2, join=True)
    w, name = _worst(torch.load(os.path.join(tmp, "lean_trainer_2proc.pt")), ref)
    assert w <= TOL, f"Trainer, 2 processes vs 1: {name} differs by {w:.2e}"
    resumed = W.trainer_run(tmp, 1, "lean_trainer_2to1",
                            resume=os.path.join(tmp, "lean_trainer_2proc", "checkpoint-2"))
    w, name = _worst(resumed, ref)
    assert w <= TOL, f"Trainer, 2-process checkpoint resumed in 1: {name} differs by {w:.2e}"


@pytest.mark.slow  # (spawns processes)
def test_auto_layout_is_rank_zeros_for_every_rank(tmp_path):
    """``host_layout="auto"`` with 2 processes of one host: only rank 0 is shown too little RAM for the full store;
    every rank builds the lean layout rank 0 chose (one shared store: a rank deciding alone would build another),
    and the 2 processes train as one process given those keys explicitly (1e-5)."""
    tmp = str(tmp_path)
    mp.spawn(W.auto_layout_worker, args=(2, tmp), nprocs=2, join=True)
    out = [torch.load(os.path.join(tmp, f"auto_rank{r}.pt")) for r in (0, 1)]
    assert out[0]["keys"]["lean_store"] and out[0]["keys"] == out[1]["keys"]
    assert out[0]["note"] and out[0]["note"] == out[1]["note"] and "host_layout='auto'" in out[0]["note"]
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", shared_memory_dir=tmp,
                                                            **out[0]["keys"]), device="cpu")
    opt = engine.create_optimizer(lr=W.LR, weight_decay=W.WD, max_grad_norm=W.CLIP)
    for ids, labels in W.batches(2):
        engine(input_ids=ids, labels=labels, num_items_in_batch=int((labels != -100).sum())).loss.backward()
        opt.step()
        opt.zero_grad()
    ref = W.weights(engine)
    for name, t in out[0]["weights"].items():
        assert float((t - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)) < 1e-5 or \
            float((t - ref[name]).abs().max()) < 2e-5, name  # (k_proj biases: absolute, as tests/parity.py)
