"""Component tests on plain tensors and fakes (no HF model): the AdamW kernels and their undo, the step state's
lifecycle, the lean store's decisions, and the placement plans."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from hf_megatrain import MegaTrainConfig
from hf_megatrain.core import kernels
from hf_megatrain.core.plan import PlanInputs, Stepper, Where, build_plans
from hf_megatrain.core.step_state import Phase, StepState
from hf_megatrain.optim.speculation import Act, SpeculationPolicy

from .parity import rel


# -- kernels ---------------------------------------------------------------------------------------------------------
def _flat_state(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)]


IMPLS = [kernels.HostKernel.FUSED, kernels.HostKernel.NATIVE,
         pytest.param(kernels.HostKernel.COMPILED, marks=pytest.mark.slow)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_scale", [None, 4.0])
def test_adamw_matches_torch_adamw_per_group(grad_scale, impl):
    """Two spans with different hyper-parameters (decayed / not) over one flat buffer, three steps, against
    torch.optim.AdamW on separate parameters with the gradient divided by grad_scale."""
    n, cut = 64, 40
    master, grad, m, v = _flat_state(n)
    ref = [torch.nn.Parameter(master[:cut].clone()), torch.nn.Parameter(master[cut:].clone())]
    ropt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    hyper = [kernels.Hyper.of(g) for g in ropt.param_groups]
    groups = [(hyper[0], [(0, cut)]), (hyper[1], [(cut, n)])]
    for step in range(1, 4):
        g = grad * step
        ref[0].grad, ref[1].grad = (g[:cut] / (grad_scale or 1)).clone(), (g[cut:] / (grad_scale or 1)).clone()
        ropt.step()
        kernels.adamw_(master, g.clone(), m, v, groups, step, grad_scale, impl=impl)
    assert rel(master, torch.cat([p.detach() for p in ref])) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # (ATen's lerp switches form at weight 0.5)
def test_compiled_host_kernel_is_the_fused_kernel_with_its_copy(beta1):
    """One pass: master, moments and the bf16 compute copy as the fused kernel + a copy pass give them, over spans
    of two groups with a gap between them (a span not stepped keeps its copy), clipped and not."""
    n = 4099  # (not a multiple of the vector width: the scalar tail too)
    h = [kernels.Hyper(3e-3, (beta1, 0.98), 1e-8, 0.1), kernels.Hyper(3e-3, (beta1, 0.98), 1e-8, 0.0)]
    groups = [(h[0], [(0, 1000), (1500, 3000)]), (h[1], [(3000, n)])]
    fused, comp = _flat_state(n, seed=3), _flat_state(n, seed=3)
    copies = [torch.full((n,), 7.0, dtype=torch.bfloat16) for _ in range(2)]
    for step in range(1, 5):
        g = torch.randn(n, generator=torch.Generator().manual_seed(10 + step))
        scale = None if step % 2 else 3.0
        kernels.adamw_(*fused[:1], g.clone(), *fused[2:], groups, step, scale, copies[0], kernels.HostKernel.FUSED)
        kernels.adamw_(*comp[:1], g.clone(), *comp[2:], groups, step, scale, copies[1], kernels.HostKernel.COMPILED)
    for a, b in zip(comp[:1] + comp[2:], fused[:1] + fused[2:]):
        assert rel(a, b) <= 1e-6
    assert torch.equal(copies[1][1000:1500], torch.full((500,), 7.0, dtype=torch.bfloat16))
    assert (copies[0] != copies[1]).sum() <= 4  # (only where a 1-ulp fp32 difference crosses a bf16 rounding edge)


@pytest.mark.parametrize("beta1", [0.9, 0.3])
@pytest.mark.parametrize("narrow", [False, True])
def test_native_host_kernel_is_the_fused_kernel_with_its_copy(beta1, narrow):
    """The native single pass gives what the fused kernel + a copy pass give, over spans of two groups with a gap
    (a span not stepped keeps its copy), clipped and not; a narrow (bf16) gradient reads as its FP32 value."""
    n = 4099
    h = [kernels.Hyper(3e-3, (beta1, 0.98), 1e-8, 0.1), kernels.Hyper(3e-3, (beta1, 0.98), 1e-8, 0.0)]
    groups = [(h[0], [(0, 1000), (1500, 3000)]), (h[1], [(3000, n)])]
    fused, nat = _flat_state(n, seed=3), _flat_state(n, seed=3)
    copies = [torch.full((n,), 7.0, dtype=torch.bfloat16) for _ in range(2)]
    for step in range(1, 5):
        g = torch.randn(n, generator=torch.Generator().manual_seed(10 + step)).bfloat16().float()
        scale = None if step % 2 else 3.0
        kernels.adamw_(*fused[:1], g.clone(), *fused[2:], groups, step, scale, copies[0], kernels.HostKernel.FUSED)
        kernels.adamw_(*nat[:1], g.bfloat16() if narrow else g.clone(), *nat[2:], groups, step, scale, copies[1],
                       kernels.HostKernel.NATIVE)
    for a, b in zip(nat[:1] + nat[2:], fused[:1] + fused[2:]):
        assert rel(a, b) <= 1e-6
    assert torch.equal(copies[1][1000:1500], torch.full((500,), 7.0, dtype=torch.bfloat16))
    assert (copies[0] != copies[1]).sum() <= 4  # (only where a 1-ulp fp32 difference crosses a bf16 rounding edge)
    nan = torch.full((8,), float("nan"))
    kernels.adamw_(nan, torch.ones(8), torch.zeros(8), torch.zeros(8), [(h[0], [(0, 8)])], 1, None, copies[1][:8],
                   kernels.HostKernel.NATIVE)
    assert torch.isnan(copies[1][:8].float()).all()  # (NaN stays NaN in the copy, as torch's cast keeps it)


def test_native_host_kernel_releases_the_gil():
    """The overlapped optimizer updates a layer while Python drives the backward on another thread: the native
    kernel must let that thread run (inductor's binding of the compiled kernel holds the GIL for the whole call:
    the other thread's longest pause is then the call itself). A loaded machine can also deschedule the watching
    thread for a while: the best of three tries is judged (a kernel holding the GIL pauses it in every try)."""
    import threading
    import time

    # A call long enough (~50 ms on one core) that the watching thread's pauses from the OS -- another test process
    # on the other core (the suite runs on 2 workers), the 5 ms GIL switch interval -- stay well under half of it
    # (with 16M elements a call took ~12 ms and such pauses ~7 ms).
    n = 1 << 26
    state = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    groups = [(kernels.Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0), [(0, n)])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a core left for the Python thread, so its pauses are the GIL's, not the OS's)
    tries = []
    try:
        kernels.adamw_(*state, groups, 1, None, None, kernels.HostKernel.NATIVE)  # (built)
        for attempt in range(3):
            t0 = time.perf_counter()
            kernels.adamw_(*state, groups, 2, None, None, kernels.HostKernel.NATIVE)
            one_call = time.perf_counter() - t0
            done = threading.Event()

            def update():
                for step in range(3, 7):
                    kernels.adamw_(*state, groups, step, None, None, kernels.HostKernel.NATIVE)
                done.set()

            t = threading.Thread(target=update)
            t.start()
            last, pause = time.perf_counter(), 0.0
            while not done.is_set():
                now = time.perf_counter()
                pause, last = max(pause, now - last), now
            t.join()
            tries.append((pause, one_call))
            if pause < 0.5 * one_call:
                break
    finally:
        torch.set_num_threads(threads)
    assert any(pause < 0.5 * one_call for pause, one_call in tries), tries


@pytest.mark.parametrize("impl", IMPLS)
def test_undo_takes_back_an_update(impl):
    n = 128
    master, grad, m, v = _flat_state(n, seed=1)
    h = kernels.Hyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    groups = [(h, [(0, n)])]
    kernels.adamw_(master, grad.clone(), m, v, groups, 1, impl=impl)
    before = [t.clone() for t in (master, m, v)]
    g2 = torch.randn(n, generator=torch.Generator().manual_seed(2))
    kernels.adamw_(master, g2.clone(), m, v, groups, 2, grad_scale=2.0, impl=impl)
    kernels.undo_master_(master, m, v, groups, 2)
    kernels.undo_moments_(g2, m, v, groups, 2, grad_scale=2.0)
    for a, b in zip((master, m, v), before):
        assert rel(a, b) <= 1e-6
    kernels.undo_master_(master, m, v, groups, 1)
    kernels.undo_moments_(grad, m, v, groups, 1, None)
    assert torch.count_nonzero(m) == 0 and torch.count_nonzero(v) == 0  # the first update undoes exactly


# -- step state --------------------------------------------------------------------------------------------------------
def test_step_state_lifecycle():
    st = StepState(2)
    assert st.accumulate(0, torch.tensor(4.0)) is True and st.grad_sq[0] is not None
    assert st.accumulate(0, torch.tensor(1.0)) is False and st.grad_sq[0] is None  # a second visit voids the norm
    st.landed(0)
    assert st.phase == [Phase.LANDED, Phase.EMPTY] and st.has_grad(0) and not st.has_grad(1)
    # The lifecycle only: nothing registers call-backs here, and an old loop's "last backward" write is refused.
    assert not any(hasattr(st, n) for n in ("add_lander", "add_joiner", "consumer", "on_landed", "land", "replay"))
    with pytest.raises(AttributeError, match="set_final_backward"):
        st.final_backward = True
    st.begin_update(0)
    st.finish_update(0)
    assert st.phase[0] is Phase.READY and st.version == [1, 0]
    st.finish_update(1, changed=False)
    assert st.version == [1, 0]
    st.accumulate(1)
    st.discard()
    assert not st.any_grad()


def test_step_state_waiters_block_until_ready_and_see_failures():
    st = StepState(1)
    st.begin_update(0)
    done: list[float] = []
    t = threading.Thread(target=lambda: (st.wait_ready(0), done.append(time.perf_counter())))
    t.start()
    time.sleep(0.05)
    assert not done  # still updating
    finished = time.perf_counter()
    st.finish_update(0)
    t.join()
    assert done and done[0] >= finished
    st.begin_update(0)
    st.fail(ValueError("kernel blew up"))
    with pytest.raises(RuntimeError, match="optimizer step failed"):
        st.wait_ready(0)


def test_step_state_readers_arrived_releases_held_copies():
    """An updater holding its copies back (optim/device_stepper.py) is released by the first weight load, by any
    wait that would block, and by ``wait_all`` -- never by a wait that returns at once (the forward's preamble
    waits for the resident unit, already ready, before the reads the hold protects)."""
    st = StepState(2)
    st.readers_arrived.clear()
    st.wait_ready(1)  # ready: returns at once, releases nothing
    assert not st.readers_arrived.is_set()
    st.wait_loadable(1)
    assert st.readers_arrived.is_set()
    st.readers_arrived.clear()
    st.wait_all()
    assert st.readers_arrived.is_set()
    st.readers_arrived.clear()
    st.begin_update(0)
    t = threading.Thread(target=st.wait_ready, args=(0,))
    t.start()
    assert st.readers_arrived.wait(5)  # a blocked waiter releases the hold (else it would wait on the copies)
    st.finish_update(0)
    t.join()


# -- step counts (fakes: units as spans) ------------------------------------------------------------------------------
def test_step_counts_per_parameter_only_where_some_skipped():
    from types import SimpleNamespace as NS

    from hf_megatrain.optim.step_counts import StepCounts

    params = [NS(decay=True, offset=0, numel=4), NS(decay=False, offset=4, numel=2), NS(decay=True, offset=6, numel=3)]
    counts = StepCounts([NS(index=0, params=params)], {0: 0, 1: 1})
    hyper = ["decayed", "not decayed"]
    counts.add(0)
    assert counts.by_step(0, hyper, None) == [(1, [("decayed", [(0, 4), (6, 9)]), ("not decayed", [(4, 6)])])]
    counts.add(0)  # the second parameter gets no gradient: left out, its skip counted
    assert counts.by_step(0, hyper, [True, False, True]) == [(2, [("decayed", [(0, 4), (6, 9)])])]
    assert counts.skipped_some(0) and counts.missed() == {0: [0, 1, 0]}
    counts.add(0)  # all reached: the second parameter is one step behind
    assert counts.by_step(0, hyper, None) == [(2, [("not decayed", [(4, 6)])]), (3, [("decayed", [(0, 4), (6, 9)])])]
    counts.take_back(0)
    state = counts.state_tensors()
    again = StepCounts([NS(index=0, params=params)], {0: 0, 1: 1})
    again.load_state_tensors(state)
    assert again.of(0) == 2 and again.missed() == {0: [0, 1, 0]}


# -- background jobs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_jobs_run_in_order_and_sync_reraises(overlap):
    from hf_megatrain.optim.jobs import Jobs

    jobs, seen = Jobs("test-jobs", overlap), []
    release = jobs.hold()
    waits = [jobs.submit(lambda k=k: seen.append(k)) for k in range(3)]
    assert seen == ([] if overlap else [0, 1, 2])  # (held: nothing ran yet)
    release()
    waits[-1]()
    assert seen == [0, 1, 2] and jobs.sync() is overlap

    def fail() -> None:
        raise ValueError("boom")

    if overlap:
        jobs.submit(fail)
        with pytest.raises(ValueError, match="boom"):
            jobs.sync()
        assert jobs.sync() is False  # (reported once)
    else:
        with pytest.raises(ValueError, match="boom"):
            jobs.submit(fail)


# -- speculation policy (fakes: unit indices, norms and keys only) ------------------------------------------------------------
def test_speculation_policy_speculates_then_takes_back_when_the_step_clips():
    p = SpeculationPolicy(norm_first=False)
    key = (None, ("h",))
    assert p.first_pass(2, 1.0, key) is Act.UPDATE and p.first_pass(1, 4.0, key) is Act.UPDATE
    assert p.mode is False
    clipped = (0.5, ("h",))
    d = p.decide(skip=False, want=clipped, skip_nonfinite=True)
    assert d.rerun and sorted(d.take_back) == [1, 2] and d.expected == {1, 2}
    p.rerun = (0.5, False, clipped)
    assert p.regenerated(2, 1.0) is Act.REDO and p.applied[2] == clipped
    assert p.regenerated(1, 4.0) is Act.REDO
    p.rerun = None
    p.end(clipped=True)
    assert p.norm_first and not p.seen and not p.applied


def test_speculation_policy_norm_first_and_nonfinite_and_accumulation():
    p = SpeculationPolicy(norm_first=True)
    key = (None, ("h",))
    assert p.first_pass(1, 9.0, key) is Act.KEEP and p.first_pass(0, float("inf"), key) is Act.KEEP
    assert p.nonfinite == {0}
    d = p.decide(skip=True, want=(None, ("h",)), skip_nonfinite=True)  # non-finite: nothing applied, no re-run
    assert not d.rerun and d.take_back == []
    d = p.decide(skip=False, want=(2.0, ("h",)), skip_nonfinite=True)
    assert d.rerun and d.take_back == [] and d.expected == {1}
    p.rerun = (2.0, False, (2.0, ("h",)))
    assert p.regenerated(1, 9.0) is Act.UPDATE
    with pytest.raises(RuntimeError, match="second gradient"):
        p.first_pass(1, 1.0, key)


# -- plans -------------------------------------------------------------------------------------------------------------
def test_plans_place_every_buffer_once():
    n = 1000
    inputs = PlanInputs([n] * 4 + [10], [0] * 5, "cuda", 10 ** 9)
    p = build_plans(inputs, MegaTrainConfig(device_layers=1, device_step_layers=1))
    assert [u.stepper for u in p.layers] == [Stepper.DEVICE, Stepper.DEVICE_STREAMED, Stepper.HOST, Stepper.HOST]
    assert p.resident.stepper is Stepper.DEVICE and p.resident_on_device
    bf16 = torch.bfloat16
    assert p.layers[0].nbytes(Where.HOST, bf16) == 0 and p.layers[0].nbytes(Where.DEVICE, bf16) == 16 * n
    assert p.layers[1].nbytes(Where.HOST, bf16) == 6 * n and p.layers[1].nbytes(Where.DEVICE, bf16) == 12 * n
    assert p.layers[2].nbytes(Where.HOST, bf16) == 18 * n
    lean = build_plans(inputs, MegaTrainConfig(lean_store=True, resident_placement="host"))
    assert all(u.nbytes(Where.HOST, bf16) == 12 * n for u in lean.layers)
    assert lean.resident.stepper is Stepper.HOST and lean.resident.grad is Where.HOST
    disk = build_plans(PlanInputs([n, 10], [0, 0], "cpu"), MegaTrainConfig(optimizer_state_dir="/tmp"))
    assert disk.layers[0].moments is Where.DISK and disk.layers[0].nbytes(Where.DISK, bf16) == 8 * n


def test_compiled_host_kernel_failure_says_what_to_do(monkeypatch):
    """Where the kernel cannot be compiled (no C++ compiler), the error names the fix; auto falls back to fused."""
    def broken(*a, **k):
        raise OSError("g++ not found")

    monkeypatch.setattr(kernels, "compiled_kernel", broken)
    with pytest.raises(RuntimeError, match="host_kernel='fused'"):
        kernels.warm_up(torch.bfloat16)


def test_native_host_kernel_failure_says_what_to_do(monkeypatch):
    """No C compiler (or a build that fails): the error names the fix; an unknown kernel name lists the choices."""
    from hf_megatrain import MegaTrainConfig
    from hf_megatrain.core import native_adamw

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)  # no cc, gcc or clang on the PATH
    monkeypatch.setattr(native_adamw, "library", native_adamw.build)  # (not the kernel built earlier: a new build)
    with pytest.raises(RuntimeError, match="host_kernel='fused'"):
        kernels.warm_up_native()
    with pytest.raises(ValueError, match="'native'"):
        MegaTrainConfig(host_kernel="c")


CONCURRENT = RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function. "
                          "This is not supported at the moment.")


def test_host_kernel_refused_while_another_thread_compiles_runs_the_fused_kernel(monkeypatch):
    """Dynamo refuses a compiled call while another thread traces (core/compiling.py): that span is updated by
    torch's fused kernel instead, once, and the rest by the compiled kernel."""
    n = 300
    h = kernels.Hyper(1e-3, (0.9, 0.999), 1e-8, 0.1)
    groups = [(h, [(0, 100)]), (kernels.Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0), [(100, n)])]
    calls = []

    def flaky(p, g, m, v, out, c, small):  # refuses the first span, does the second like the real kernel would
        calls.append(p.numel())
        if len(calls) == 1:
            raise CONCURRENT
        kernels.adamw_(p, g, m, v, [(groups[1][0], [(0, p.numel())])], 1, None, out)

    monkeypatch.setattr(kernels, "compiled_kernel", lambda: flaky)
    got, want = _flat_state(n, seed=4), _flat_state(n, seed=4)
    copies = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
    kernels.adamw_(*got, groups, 1, None, copies[0], kernels.HostKernel.COMPILED)
    kernels.adamw_(*want, groups, 1, None, copies[1], kernels.HostKernel.FUSED)
    assert calls == [100, 200]
    for a, b in zip(got + copies[:1], want + copies[1:]):
        assert torch.equal(a, b)


def _bare_template(layer: torch.nn.Module, stochastic: bool, compiled):
    """A LayerTemplate around ``layer`` with ``compiled`` standing in for torch.compile's function."""
    from hf_megatrain.model.template import LayerTemplate

    t = LayerTemplate.__new__(LayerTemplate)
    t.module, t.stochastic, t.compiled = layer, stochastic, compiled
    return t


def test_layer_template_refused_while_another_thread_compiles_runs_eagerly_once():
    """The layer template runs that call eagerly and keeps its compiled function; other compile failures make it
    eager for good."""
    calls = []

    def refusing(tensors, args, kwargs):
        calls.append(1)
        raise CONCURRENT

    layer = torch.nn.Linear(4, 4)
    t = _bare_template(layer, False, refusing)
    params = dict(layer.named_parameters())
    x = torch.randn(2, 4)
    assert torch.equal(t(params, {}, True, (x,), {}), layer(x))
    assert t.compiled is refusing and calls == [1]
    t.compiled = lambda *a: (_ for _ in ()).throw(ValueError("unsupported op"))
    assert torch.equal(t(params, {}, True, (x,), {}), layer(x))
    assert t.compiled is None


def test_step_state_published_copy_is_loadable_before_the_update_finishes():
    """A GPU updater publishes the new weights before its copies to the host finish: the unit is loadable at the
    coming version at once; the copy stays valid after the update finishes and is dropped by the next update or
    an outside change of the master."""
    import threading

    from hf_megatrain.core.step_state import StepState

    s = StepState(2)
    s.begin_update(1)
    t = threading.Thread(target=s.wait_loadable, args=(1,))
    t.start()
    t.join(0.05)
    assert t.is_alive()  # neither published nor ready
    s.publish_copy(1, "copy", "event")
    t.join(1)
    assert not t.is_alive()
    assert s.wait_loadable(1) == ("copy", "event", 1) and s.updating(1)  # before the update has finished
    s.finish_update(1)
    assert s.early_copy(1) == ("copy", "event", 1) and s.version[1] == 1
    s.touch(1)
    assert s.early_copy(1) is None and s.wait_loadable(1) is None
    s.begin_update(0)
    s.publish_copy(0, "c0", None)
    s.begin_update(0)  # a later update: the old copy is not its weights
    assert s.early_copy(0) is None


def test_layer_template_eager_rerun_starts_from_the_same_random_state():
    """A compiled call that drew random numbers before failing: the eager rerun of a stochastic layer (dropout)
    draws from the state the call started with, so the backward's recompute (which replays it) sees the same mask."""
    def draws_then_refuses(tensors, args, kwargs):
        torch.rand(100)
        raise CONCURRENT

    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    t = _bare_template(layer, True, draws_then_refuses)
    params = dict(layer.named_parameters())
    x = torch.randn(8, 4)
    torch.manual_seed(5)
    got = t(params, {}, True, (x,), {})
    torch.manual_seed(5)
    want = layer(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("grad_scale", [None, 2.0])
def test_host_kernel_fallback_leaves_the_gradient_untouched(monkeypatch, grad_scale):
    """Every span refused: the fused kernel steps them all, to the same values, and the gradient stays as the
    compiled kernel leaves it (unscaled gradient not written back), so an undo from it stays exact."""
    def refusing(*a):
        raise CONCURRENT

    monkeypatch.setattr(kernels, "compiled_kernel", lambda: refusing)
    n = 257
    groups = [(kernels.Hyper(1e-3, (0.9, 0.999), 1e-8, 0.1), [(0, 100), (130, n)])]
    got, want = _flat_state(n, seed=6), _flat_state(n, seed=6)
    grad0 = got[1].clone()
    copies = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
    kernels.adamw_(*got, groups, 2, grad_scale, copies[0], kernels.HostKernel.COMPILED)
    kernels.adamw_(*want, groups, 2, grad_scale, copies[1], kernels.HostKernel.FUSED)
    assert torch.equal(got[1], grad0)
    for a, b in zip([got[0], got[2], got[3], copies[0]], [want[0], want[2], want[3], copies[1]]):
        assert torch.equal(a, b)
