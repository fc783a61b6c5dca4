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
def test_halves_write_the_bits_of_one_whole_update(grad_dtype, grad_scale):
    n = 70_001  # (several of the kernel's blocks, a ragged end)
    torch.manual_seed(0)
    state = [torch.randn(n), torch.randn(n).to(grad_dtype), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
    groups = [(Hyper(1e-3, (0.9, 0.999), 1e-8, 0.1), [(0, 30_000), (50_000, n)]),
              (Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0), [(30_000, 50_000)]),
              (Hyper(1e-3, (0.3, 0.999), 1e-8, 0.0), [])]  # (beta1 < 0.5: the other lerp endpoint)
    whole, split = [t.clone() for t in state], [t.clone() for t in state]
    copy_whole, copy_split = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    kernels.adamw_(*whole, groups, 7, grad_scale, copy_whole, HostKernel.NATIVE)
    kernels.adamw_(*split, groups, 7, grad_scale, copy_split, HostKernel.NATIVE, UpdatePart.WEIGHTS)
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
    assert not p.decide(10**9)  # nothing measured yet
    p.observe(0.0, 0, 0.0)
    p.observe(1.5, 14 * 10**9, 0.1)  # a 1.5 s step; its updates moved 14 GB in 0.1 s (140 GB/s)
    assert p.rate == pytest.approx(140e9) and p.interval == pytest.approx(1.5)
    assert p.decide(int(140e9 * 1.1))  # 1.1 s of split work <= 0.75 x 1.5 s
    assert not p.decide(int(140e9 * 1.2))
    assert "140 GB/s" in p.describe()
    assert SplitPolicy("on").decide(1) and not SplitPolicy("off").decide(10)
    assert not SplitPolicy("on").decide(0)  # (nothing to split)
    with pytest.raises(ValueError, match="split_host_update"):
        SplitPolicy("sometimes")


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
    assert opt.split_policy.mode == "off"  # (fp32 compute: no compute copy to write first)
    with pytest.raises(ValueError, match="split_host_update='on' needs host_kernel 'native'"):
        MegaTrainEngine(tiny("llama", num_hidden_layers=2),
                        MegaTrainConfig(compute_dtype="bfloat16", host_kernel="fused", split_host_update="on"))
