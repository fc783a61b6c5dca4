"""Split host updates (optim/split_update.py): new weights first, master and moments later -- the same bits as one
whole update, the unit loadable between the two passes, the next gradient landing only after the second."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.core import kernels
from hf_megatrain.core.kernels import HostKernel, Hyper, UpdatePart
from hf_megatrain.core.step_state import StepState
from hf_megatrain.optim.split_update import SplitPolicy

from .models import tiny
from .parity import random_batches, reference_optimizer, rel


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [None, 3.7])
@pytest.mark.parametrize("weights_threads", [None, 3])  # (the weights half may run on more threads: same bits)
def test_halves_write_the_bits_of_one_whole_update(grad_dtype, grad_scale, weights_threads):
    n = 70_001  # (several of the kernel's blocks, a ragged end)
    torch.manual_seed(0)
    state = [torch.randn(n), torch.randn(n).to(grad_dtype), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
    groups = [(Hyper(1e-3, (0.9, 0.999), 1e-8, 0.1), [(0, 30_000), (50_000, n)]),
              (Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0), [(30_000, 50_000)]),
              (Hyper(1e-3, (0.3, 0.999), 1e-8, 0.0), [])]  # (beta1 < 0.5: the other lerp endpoint)
    whole, split = [t.clone() for t in state], [t.clone() for t in state]
    copy_whole, copy_split = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    kernels.adamw_(*whole, groups, 7, grad_scale, copy_whole, HostKernel.NATIVE)
    kernels.adamw_(*split, groups, 7, grad_scale, copy_split, HostKernel.NATIVE, UpdatePart.WEIGHTS,
                   threads=weights_threads)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(split, state))  # the state untouched
    assert torch.equal(_bits(copy_split), _bits(copy_whole))
    kernels.adamw_(*split, groups, 7, grad_scale, None, HostKernel.NATIVE, UpdatePart.STATE)
    for a, b in zip(split, whole):
        assert torch.equal(_bits(a), _bits(b))


def test_halves_need_the_native_kernel_and_the_right_copy():
    t = [torch.zeros(4) for _ in range(4)]
    groups = [(Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0), [(0, 4)])]
    with pytest.raises(ValueError, match="native kernel"):
        kernels.adamw_(*t, groups, 1, None, torch.zeros(4, dtype=torch.bfloat16), HostKernel.FUSED,
                       UpdatePart.WEIGHTS)
    with pytest.raises(ValueError, match="compute copy for the weights half"):
        kernels.adamw_(*t, groups, 1, None, None, HostKernel.NATIVE, UpdatePart.WEIGHTS)


def test_policy_splits_only_where_the_host_has_time():
    p = SplitPolicy()
    assert not p.decide(10**9, False)  # nothing measured yet
    p.observe(0.0, 0, 0.0, False)
    p.observe(1.5, 14 * 10**9, 0.1, False)  # a 1.5 s step on whole updates; they moved 14 GB in 0.1 s (140 GB/s)
    assert p.rate == pytest.approx(140e9) and p.whole_interval == pytest.approx(1.5)
    assert not p.decide(int(140e9 * 1.4), False)  # 1.4 s of split work > 0.9 x 1.5 s
    assert p.decide(int(140e9 * 1.3), False)
    assert "140 GB/s" in p.describe()
    p.observe(2.8, 28 * 10**9, 0.2, True)  # the split step took 1.3 s: faster than the whole one, keep splitting
    assert p.split_interval == pytest.approx(1.3) and p.decide(int(140e9 * 1.3), True)
    p.observe(4.4, 42 * 10**9, 0.3, True)  # 1.6 s: slower than the whole step -> whole again (re-measures it)
    assert not p.decide(int(140e9 * 1.3), True)
    assert SplitPolicy("on").decide(1, False) and not SplitPolicy("off").decide(10, False)
    assert not SplitPolicy("on").decide(0, False)  # (nothing to split)
    with pytest.raises(ValueError, match="split_host_update"):
        SplitPolicy("sometimes")


def test_policy_re_measures_the_whole_step_now_and_then():
    p = SplitPolicy(refresh=3)
    p.observe(0.0, 0, 0.0, False)
    p.observe(1.0, 10**9, 0.01, False)
    assert [p.decide(10**6, True) for _ in range(5)] == [True, True, True, False, True]


def test_a_split_unit_is_loadable_before_it_is_ready():
    s = StepState(2)
    s.begin_update(0)
    v = s.version[0]
    s.finish_weights(0)
    assert s.version[0] == v + 1
    assert s.wait_loadable(0) is None  # returns at once: the new weights are in host memory
    released = threading.Event()

    def finish():
        time.sleep(0.05)
        released.set()
        s.finish_update(0)

    threading.Thread(target=finish).start()
    s.wait_state(0)  # (the gradient path, before the next gradient lands in the buffer the second pass reads)
    assert released.is_set() and s.version[0] == v + 1 and s.updates[0] == 1  # one update, one version
    s.wait_state(1)  # (a unit no split update holds: no wait)


def _train(model, split: str, steps: int, clip: float, overlap: bool = False):
    cfg = MegaTrainConfig(compute_dtype="bfloat16", host_kernel="native", split_host_update=split,
                          overlap_optimizer=overlap, device_layers=0, device_step_layers=0)
    engine = MegaTrainEngine(copy.deepcopy(model), cfg)
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=clip)
    split_steps = 0
    for micro in random_batches(steps, 1, 2, 16, model.config.vocab_size, seed=3):
        ids, lab = micro[0]
        loss = engine(input_ids=ids, labels=lab).loss
        engine.set_final_backward(True)
        loss.backward()
        opt.step()
        split_steps += opt.last_step_split
        opt.zero_grad()
    state = opt.state_tensors()  # (waits for every update)
    return engine, opt, split_steps, {k: v.clone() for k, v in state.items()}


def test_split_training_is_bitwise_the_whole_one():
    """Clipping on every step (norm first: every layer's update launched after the norm), bf16 compute, the native
    kernel: split updates give the same masters, moments and compute copies, bit for bit."""
    model = tiny("llama", num_hidden_layers=3)
    runs = {split: _train(model, split, 4, 0.05) for split in ("off", "on")}
    (e_off, _, n_off, s_off), (e_on, _, n_on, s_on) = runs["off"], runs["on"]
    assert n_off == 0 and n_on >= 3  # (the first step speculates; the clipping ones after it take the norm first)
    for name in e_off.store.by_name:
        assert torch.equal(_bits(e_on.store.master_tensor(name)), _bits(e_off.store.master_tensor(name))), name
    for key in s_off:
        assert torch.equal(s_on[key], s_off[key]), key
    for a, b in zip(e_on.layer_units, e_off.layer_units):
        assert torch.equal(_bits(a.compute), _bits(b.compute))


def test_the_weights_half_runs_on_its_own_thread_count(monkeypatch):
    """The optimizer's ``weights_threads`` (core/threads.py ``weights_half_threads``) reaches the kernel for every
    weights half, and only there; the state halves and whole updates keep the process's intra-op count."""
    from hf_megatrain.core import native_adamw

    seen: list[tuple[bool, int | None]] = []
    real = native_adamw.adamw_span_

    def spy(*args, write_state=True, threads=None):
        seen.append((write_state, threads))
        return real(*args, write_state=write_state, threads=threads)

    monkeypatch.setattr(native_adamw, "adamw_span_", spy)
    model = tiny("llama", num_hidden_layers=2)
    cfg = MegaTrainConfig(compute_dtype="bfloat16", host_kernel="native", split_host_update="on",
                          device_layers=0, device_step_layers=0)
    engine = MegaTrainEngine(copy.deepcopy(model), cfg)
    opt = engine.create_optimizer(lr=1e-3, max_grad_norm=0.05)
    opt.weights_threads = 3
    for micro in random_batches(3, 1, 2, 16, model.config.vocab_size, seed=3):
        ids, lab = micro[0]
        engine(input_ids=ids, labels=lab).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.state_tensors()  # (every update done)
    assert {t for w, t in seen if not w} == {3}  # weights halves (split steps ran)
    assert {t for w, t in seen if w} == {None}
    with pytest.raises(ValueError, match="threads=0"):
        real(*[torch.zeros(4)] * 4, None, torch.ones(8), True, threads=0)


def test_overlapped_split_training_matches_torch_adamw():
    """Overlapped (the second passes run while the next forward and backward do), against plain HF + torch AdamW
    with the same clipping; the run splits every norm-first step."""
    model = tiny("llama", num_hidden_layers=3)
    engine, opt, n_split, _ = _train(model, "on", 4, 0.05, overlap=True)
    assert n_split >= 3
    ref = copy.deepcopy(model)
    ref_opt = reference_optimizer(ref, 1e-3, 0.1)
    for micro in random_batches(4, 1, 2, 16, model.config.vocab_size, seed=3):
        ids, lab = micro[0]
        ref(input_ids=ids, labels=lab).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in ref.named_parameters():
        assert rel(engine.store.master_tensor(name).cpu(), p.detach()) < 2e-2, name  # (bf16 compute vs fp32 reference)


def test_split_needs_what_it_says():
    with pytest.raises(ValueError, match="split_host_update"):
        MegaTrainConfig(split_host_update="always")
    engine = MegaTrainEngine(tiny("llama", num_hidden_layers=2),
                             MegaTrainConfig(compute_dtype="float32", split_host_update="auto"))
    opt = engine.create_optimizer()
    assert opt.splits.policy.mode == "off"  # (fp32 compute: no compute copy to write first)
    with pytest.raises(ValueError, match="split_host_update='on' needs host_kernel 'native'"):
        MegaTrainEngine(tiny("llama", num_hidden_layers=2),
                        MegaTrainConfig(compute_dtype="bfloat16", host_kernel="fused", split_host_update="on"))


@pytest.mark.parametrize("overlap", [False, True])
def test_lean_plane_updates_split_bitwise(overlap):
    """Lean store + compute copy + bf16 gradient plane (16 B/param), clipping on every step: the updates from the
    plane run split (weights first, state after) and give the same losses, masters and moments, bit for bit.
    (Overlapped: the next forward loads a layer between its two passes, the next backward's landing on the plane
    waits for the second.)"""
    model = tiny("llama", num_hidden_layers=3)
    out = {}
    for split in ("off", "on"):
        cfg = MegaTrainConfig(compute_dtype="bfloat16", lean_store=True, lean_compute_copy=True,
                              lean_grad_plane="on", host_kernel="native", overlap_optimizer=overlap,
                              resident_placement="host", split_host_update=split)
        e = MegaTrainEngine(copy.deepcopy(model), cfg, device="cpu")
        opt = e.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=0.05)
        losses, n_split = [], 0
        for micro in random_batches(4, 1, 4, 12, 96, seed=5):
            ids, lab = micro[0]
            loss = e(input_ids=ids, labels=lab).loss
            loss.backward()
            opt.step()
            n_split += opt.last_step_split
            opt.zero_grad()
            losses.append(loss.detach())
        state = {k: v.clone() for k, v in opt.state_tensors().items()}
        out[split] = (torch.stack(losses), {n: e.store.master_tensor(n).clone() for n in e.store.names()}, state,
                      n_split, opt.regenerated_steps)
    (l0, w0, s0, n0, r0), (l1, w1, s1, n1, r1) = out["off"], out["on"]
    assert n0 == 0 and n1 >= 3 and r0 == r1 == 0  # (norm first from the plane: no re-run)
    if not overlap:  # (overlapped, the CPU's forward GEMMs share threads with the update: their blocking may differ)
        assert torch.equal(l1, l0)
        for n in w0:
            assert torch.equal(_bits(w1[n]), _bits(w0[n])), n
        for k in s0:
            assert torch.equal(s1[k], s0[k]), k
    else:
        for n in w0:
            assert rel(w1[n], w0[n]) < 1e-2, n
