"""CPU parity (fp32): hf_megatrain vs plain HF + torch.optim.AdamW, 3 steps, GA 2, clipping, weight decay."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain.core.plan import Stepper, Where
from hf_megatrain import MegaTrainConfig, MegaTrainEngine, linear_cross_entropy

from .models import tiny
from .parity import rel, run_parity


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tie", [False, True])
def test_parity_trainer_style_accumulation(family, tie):
    worst, engine, _ = run_parity(tiny(family, tie=tie))
    if tie:  # tied embeddings stay tied: one master for both names
        names = engine.store.names()
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.parametrize("overlap", [False, True])
def test_parity_split_inside_layer_visit(overlap):
    cfg = MegaTrainConfig(compute_dtype="float32", micro_batch_size=2, overlap_optimizer=overlap)
    run_parity(tiny("llama"), ga=2, batch=2, config=cfg, split_in_layer=True)


def test_parity_clipping_inactive_and_no_decay():
    run_parity(tiny("qwen2"), max_grad_norm=1e6, wd=0.0)


def test_parity_three_slots_four_layers():
    cfg = MegaTrainConfig(compute_dtype="float32", num_slots=3)
    run_parity(tiny("mistral", num_hidden_layers=4), config=cfg)


@pytest.mark.parametrize("overlap", [False, True])
def test_parity_with_device_stepped_layers(overlap):
    """The first two layers (forward order) run AdamW through the DeviceStepper path (on the CPU here),
    concurrently with the rest."""
    cfg = MegaTrainConfig(compute_dtype="float32", device_step_layers=2, overlap_optimizer=overlap)
    worst, engine, _ = run_parity(tiny("llama", num_hidden_layers=4), config=cfg)
    assert [u.plan.stepper for u in engine.layer_units] == [Stepper.DEVICE_STREAMED] * 2 + [Stepper.HOST] * 2


@pytest.mark.parametrize("final_backward", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_parity_with_device_stepped_layers_host_state(overlap, final_backward):
    """device_step_state="host": the GPU-stepped layers' moments live on the host and stream with the master,
    copied in during the step's last backward (``final_backward``: with the speculative CPU step beside it),
    clipping on."""
    cfg = MegaTrainConfig(compute_dtype="float32", device_step_layers=2, overlap_optimizer=overlap,
                          device_step_state="host")
    ga = 1 if final_backward else 2
    worst, engine, _ = run_parity(tiny("llama", num_hidden_layers=4), config=cfg, ga=ga, batch=4 // ga, steps=4,
                                  final_backward=final_backward, clip_schedule=[1e6, 1e6, 0.3, 1e6])
    stepped = engine.layer_units[:2]
    assert [u.plan.stepper for u in engine.layer_units] == [Stepper.DEVICE_STREAMED] * 2 + [Stepper.HOST] * 2
    assert all(u.plan.moments is Where.HOST and u.plan.grad is Where.DEVICE for u in stepped)
    stepper = engine.optimizer.device_stepper
    assert stepper.host_state and not stepper.loaded
    # A prefetched copy is dropped when the master changes outside an update (a checkpoint load touches it).
    stepper.prefetch()
    with torch.no_grad():
        stepped[0].master.add_(1.0)
    engine.state.touch(stepped[0].index)
    stepper.prefetch()
    assert torch.equal(stepper.bufs[0]["master"][:stepped[0].numel], stepped[0].master)


def test_device_stepped_state_comes_in_by_shares():
    """``prefetch(budget)`` queues at most ``budget`` elements per call, in order (master, m, v of each layer), and
    a layer counts as loaded only once all of its state is in; the speculative step gives each CPU layer's landing
    an equal share, so the state is in by the time the GPU-stepped layers' gradients land."""
    cfg = MegaTrainConfig(compute_dtype="float32", device_step_layers=2, device_step_state="host")
    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=4), cfg)
    opt = engine.create_optimizer()
    stepper, stepped = opt.device_stepper, engine.layer_units[:2]
    assert opt.prefetch_share == -(-stepper.state_numel() // 2)  # two CPU layers land before them
    n0 = stepped[0].numel
    stepper.prefetch(n0 + 5)  # layer 0's master and 5 elements of its exp_avg
    assert not stepper.loaded and stepper.queued(0) == n0 + 5
    stepper.prefetch(2 * n0)
    assert list(stepper.loaded) == [0] and stepper.queued(1) == 5
    with torch.no_grad():
        for u in stepped:
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(u, name).copy_(torch.randn(u.numel))
            engine.state.touch(u.index)  # (a changed master: what was queued is stale)
    stepper.prefetch()
    for j, u in enumerate(stepped):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(stepper.bufs[j][name][:u.numel], getattr(u, name)), (j, name)


def test_device_step_state_host_plans_fewer_gpu_bytes():
    from hf_megatrain.core.plan import device_step_bytes, stepper_buffer_bytes

    n = 1000
    assert device_step_bytes(2, n, torch.bfloat16, host_state=True) == 2 * 4 * n + stepper_buffer_bytes(
        2, n, torch.bfloat16, True) == 2 * 4 * n + 2 * 14 * n
    assert device_step_bytes(2, n, torch.bfloat16) == 2 * 12 * n + 2 * 6 * n
    with pytest.raises(ValueError, match="device_step_state"):
        MegaTrainConfig(device_step_state="gpu")


@pytest.mark.parametrize("overlap", [False, True])
def test_parity_with_layers_kept_on_device(overlap):
    """Layer 0 kept whole on the device (master cast into the slot per visit, gradient accumulated there, AdamW
    where the state lives), layer 1 stepped by the DeviceStepper, layers 2-3 on the host CPU AdamW: one model,
    three placements, the same training (GA 2 accumulates into the kept layer's device gradient)."""
    cfg = MegaTrainConfig(compute_dtype="float32", device_layers=1, device_step_layers=1, overlap_optimizer=overlap)
    worst, engine, _ = run_parity(tiny("llama", num_hidden_layers=4), config=cfg)
    assert engine.plans.kept == [0] and engine.plans.device_stepped == [1]
    kept = engine.layer_units[0].plan
    assert (kept.master, kept.grad, kept.compute) == (Where.DEVICE, Where.DEVICE, Where.NONE)  # cast per visit


def test_parity_with_optimizer_state_on_disk(tmp_path):
    """Disk tier: AdamW moments in memory-mapped files (taken off host RAM) give the same training."""
    cfg = MegaTrainConfig(compute_dtype="float32", optimizer_state_dir=str(tmp_path))
    worst, engine, _ = run_parity(tiny("llama"), config=cfg)
    assert all(u.plan.moments is Where.DISK for u in engine.layer_units)
    assert list(tmp_path.iterdir()) == []  # files are unlinked once mapped: nothing to clean up, nothing leaks


def test_disk_tier_rejects_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="optimizer_state_dir"):
        MegaTrainConfig(optimizer_state_dir=str(tmp_path / "nope"))


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_parity_compiled_layers():
    # torch.compile of the layer template (inductor, CPU codegen): fused FP32 reductions round differently than
    # eager's, so the bound is 1e-4 (measured: grads 3e-5, weights 2e-5 on tiny llama with in-layer split).
    cfg = MegaTrainConfig(compute_dtype="float32", torch_compile=True)
    worst, engine, _ = run_parity(tiny("qwen2"), ga=1, steps=2, config=cfg, tol=1e-4)
    assert all(t.compiled is not None for t in engine.executor.templates)  # traced, no fallback to eager


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_loss_matches_autograd_chain(softcap, bias):
    # loss.py's compiled chunk (one read of the logits) vs the eager autograd chain HF's loss runs.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 25, 16, generator=g, requires_grad=True)
    w = torch.randn(37, 16, generator=g, requires_grad=True)
    b = torch.randn(37, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, 37, (2, 25), generator=g)
    labels[0, :5] = -100
    out = []
    for compiled in (False, True):
        for t in (h, w, b):
            if t is not None:
                t.grad = None
        loss = linear_cross_entropy(h, w, labels, bias=b, chunk_tokens=16, softcap=softcap, compiled=compiled,
                                    num_items_in_batch=torch.tensor(40))
        loss.backward()
        out.append([loss.detach()] + [t.grad.clone() for t in (h, w, b) if t is not None])
    for eager, comp in zip(*out):
        assert rel(comp, eager) <= 1e-6


# -- speculative host step: CPU AdamW during the step's last backward ---------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_step_without_clipping_matches(overlap):
    """The backward is the step's last (as Trainer says): each CPU-stepped layer is updated as its gradient lands;
    no step clips, so nothing is taken back, and every weight matches plain HF + torch AdamW."""
    cfg = MegaTrainConfig(compute_dtype="float32", overlap_optimizer=overlap)
    worst, engine, _ = run_parity(tiny("llama"), ga=1, batch=4, steps=4, max_grad_norm=1e6, config=cfg,
                                  final_backward=True)
    opt = engine.optimizer
    assert opt.speculated == 3 * 3 and opt.taken_back == 0  # steps 2-4 (the first takes its norm first), 3 layers


@pytest.mark.parametrize("host_kernel", ["fused", pytest.param("compiled", marks=pytest.mark.slow)])
def test_speculative_step_that_clips_is_taken_back_and_redone(host_kernel):
    """Steps 1-2 do not clip (step 2 speculates), step 3 clips after speculating: its updates are taken back and
    redone with the true factor; step 4 takes its norm first. Every step matches within 1e-5."""
    cfg = MegaTrainConfig(compute_dtype="float32", host_kernel=host_kernel)
    worst, engine, _ = run_parity(tiny("qwen2", tie=True), ga=1, batch=4, steps=4, config=cfg, final_backward=True,
                                  clip_schedule=[1e6, 1e6, 0.3, 0.3])
    opt = engine.optimizer
    assert opt.speculated == 2 * 3 and opt.taken_back == 3


def test_speculation_needs_a_whole_step_gradient():
    """Gradient accumulation: the last backward's gradients are sums, not first visits: no speculation, same math."""
    cfg = MegaTrainConfig(compute_dtype="float32")
    worst, engine, _ = run_parity(tiny("llama"), ga=2, steps=3, max_grad_norm=1e6, config=cfg, final_backward=True)
    assert engine.optimizer.speculated == 0


def test_speculative_worker_takes_the_unit_the_next_forward_needs_first():
    """Landings queued behind a busy worker are taken in the next forward's order, not in landing order; each
    finished update keeps its gradient landed until step() judges it (fakes: a real StepState, a fake update)."""
    from hf_megatrain.core.step_state import Phase, StepState
    from hf_megatrain.optim.speculative_step import SpeculativeWorker

    order = [4, 0, 1, 2, 3]  # (the next forward: the resident unit first, then the layers)
    state, seen = StepState(5), []
    worker = SpeculativeWorker(state, order, overlap=True)
    release = worker.hold()  # the worker is busy while four gradients land, last layer first
    for i in (3, 2, 1, 0):
        worker.submit(i, "hyper", lambda i, hyper: seen.append(i))
    assert all(state.updating(i) for i in range(4))
    release()
    worker.sync()
    assert seen == [0, 1, 2, 3] and state.phase[:4] == [Phase.LANDED] * 4 and state.version[:4] == [1] * 4
    worker.stands({0, 1})  # judged right: ready for the next forward
    assert state.phase[:4] == [Phase.READY, Phase.READY, Phase.LANDED, Phase.LANDED]


def _train_without_waiting(engine, batches, clip):
    """A Trainer-like loop that never waits for the optimizer: the next forward waits per unit."""
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=clip)
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.set_final_backward(True)
        loss.backward()
        engine.finish_backward()
        opt.step()
        opt.zero_grad()
    engine.state.wait_all()
    return {n: t.clone() for n, t in engine.named_master_tensors()}


@pytest.mark.parametrize("clip", [None, 0.05])
def test_step_does_not_wait_for_the_speculative_updates(clip):
    """step() returns while the speculative updates of the step still run (the worker is held here); the next
    forward waits for each unit, and the weights after 4 steps equal the synchronous optimizer's exactly."""
    from hf_megatrain import MegaTrainEngine

    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (2, 10)) for _ in range(4)]
    model = tiny("llama", num_hidden_layers=3)
    sync = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32", overlap_optimizer=False))
    want = _train_without_waiting(sync, batches, clip)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", overlap_optimizer=True))
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=clip)
    if not opt.speculation.overlapped:
        pytest.skip("speculation needs overlap_optimizer")
    # Without clipping every step speculates; in step 2 the worker is held until step() has returned.
    for k, ids in enumerate(batches):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.set_final_backward(True)
        release = opt.speculation.hold() if k == 1 else (lambda: None)
        before = opt.speculated
        try:
            loss.backward()
            engine.finish_backward()
            opt.step()
            held = (opt.speculated - before, [engine.state.updating(u.index) for u in engine.layer_units])
        finally:
            release()
        if k == 1 and clip is None:  # (with clipping every step takes its norm first: nothing to hold)
            assert held == (0, [True] * 3)
        opt.zero_grad()
    engine.state.wait_all()
    got = {n: t.clone() for n, t in engine.named_master_tensors()}
    for n, w in want.items():
        assert torch.equal(got[n], w), n


def test_zero_grad_without_step_leaves_no_stale_speculation():
    """zero_grad() without step() takes the speculative updates back; the next step's updates, held on the worker
    until after step() returns, must still be running then (not marked ready by what the dropped step left)."""
    from hf_megatrain import MegaTrainEngine

    torch.manual_seed(0)
    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=3),
                             MegaTrainConfig(compute_dtype="float32", overlap_optimizer=True))
    opt = engine.create_optimizer(lr=1e-3, max_grad_norm=None)
    if not opt.speculation.overlapped:
        pytest.skip("speculation needs overlap_optimizer")
    ids = torch.randint(0, 64, (2, 10))
    for k in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.set_final_backward(True)
        release = opt.speculation.hold() if k == 1 else (lambda: None)
        try:
            loss.backward()
            engine.finish_backward()
            if k == 0:
                opt.zero_grad()  # the step is dropped: its speculative updates are taken back
                assert opt.taken_back == 3
                continue
            opt.step()
            held = [engine.state.updating(u.index) for u in engine.layer_units]
        finally:
            release()
        assert held == [True] * 3
        opt.zero_grad()
    engine.state.wait_all()


def test_last_layer_gradient_lands_at_the_end_of_the_final_backward():
    """The step's last backward lands layer 0's gradient when that layer's backward ends (its update can start
    then), not when step() lands the rest; a backward that is not the step's last leaves it for land()."""
    from hf_megatrain.core.step_state import Phase

    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=3), MegaTrainConfig(compute_dtype="float32"))
    engine.create_optimizer(max_grad_norm=1e6)
    ids = torch.randint(0, engine.model.config.vocab_size, (2, 8))
    for final in (False, True):
        engine.set_final_backward(final)
        engine(input_ids=ids, labels=ids).loss.backward()
        assert (engine.state.phase[0] is not Phase.ACCUMULATING) == final
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    engine.state.wait_all()


def test_the_next_layer_is_loaded_after_the_current_ones_compute_is_queued():
    """A pass prefetches layer i+1 in ``release(i)`` -- after layer i's compute is queued -- not in ``acquire(i)``:
    a wait there for layer i+1's update (after a clipping step) runs beside layer i's compute on a GPU."""
    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=4), MegaTrainConfig(compute_dtype="float32",
                             device_layers=0, device_step_layers=0), device="cpu")
    slots = engine.executor.weights
    s = slots.acquire(1, +1)
    assert [h[0] for h in slots.held if h is not None] == [1]  # (only the layer itself before its compute)
    slots.release(s)
    assert sorted(h[0] for h in slots.held if h is not None) == [1, 2]
    slots.release(slots.acquire(2, -1))  # the backward's direction: layer 1 next, held already
    assert sorted(h[0] for h in slots.held if h is not None) == [1, 2]
    assert slots.gpu_wait_optimizer_s is None  # (no GPU: nothing measured, not zero)


class _ClockEvent:
    """A stream event whose "GPU time" is the host clock when it was recorded (what a compute stream with nothing
    queued would show)."""

    def __init__(self) -> None:
        import time

        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_ClockEvent") -> float:
        return (end.t - self.t) * 1e3


class _ClockStreams:
    """StreamSet's interface with events on the host clock: the slots' GPU-wait bookkeeping, testable on a CPU."""

    compute, h2d, d2h, is_cuda = "compute", "h2d", "d2h", False

    def record(self, stream, timing=False):
        return _ClockEvent()

    def wait(self, stream, event):
        pass

    def on(self, stream):
        import contextlib

        return contextlib.nullcontext()


def test_gpu_wait_for_an_update_runs_until_the_layer_is_acquired():
    """The GPU's wait for a layer whose update the host waited for lasts until the compute stream has the layer
    (``acquire``: the update's wait *and* the copy after it), not only the host's wait; a prefetch the pass does not
    use next (it turned) is not counted."""
    import threading
    import time

    from hf_megatrain.engine.slots import WeightSlots

    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=3), MegaTrainConfig(compute_dtype="float32",
                             device_layers=0, device_step_layers=0), device="cpu")
    units, state = engine.executor.weights.units, engine.state
    slots = WeightSlots(units, state, _ClockStreams(), device=torch.device("cpu"), compute_dtype=torch.float32,
                        num_slots=2)

    def update_running(i: int, seconds: float) -> threading.Thread:
        state.begin_update(units[i].index)
        t = threading.Thread(target=lambda: (time.sleep(seconds), state.finish_update(units[i].index)))
        t.start()
        return t

    t = update_running(2, 0.05)
    slots.release(slots.acquire(1, +1))  # prefetches layer 2: the host waits ~0.05 s for its update
    t.join()
    waited = slots.wait_optimizer_s
    time.sleep(0.2)  # (the copy, and the previous layer's compute, before the compute stream has layer 2)
    slots.release(slots.acquire(2, +1))
    assert 0.04 <= waited < 0.2 and slots.gpu_wait_optimizer_s >= 0.2 + waited - 0.01
    counted = slots.gpu_wait_optimizer_s
    t = update_running(1, 0.05)
    slots.release(slots.acquire(2, -1))  # prefetches layer 1 (waits for its update) ...
    t.join()
    time.sleep(0.1)
    slots.release(slots.acquire(0, +1))  # ... but the next acquire is another layer: that wait is dropped
    assert slots.wait_optimizer_s > waited + 0.04 and slots.gpu_wait_optimizer_s < counted + 0.05
