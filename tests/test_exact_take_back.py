"""With ``exact_take_back=True`` taking back a speculative update is bit-exact (optim/take_back.py): a skipped
non-finite step leaves every weight, moment and step count untouched, and a step that clips after speculating equals
one that never speculated, for the speculative host step (``speculative_step``) and the lean store. By default (no
copies) a non-finite gradient that lands first (the usual overflow) still updates nothing: the skip is exact too."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

from .models import tiny
from .parity import random_batches

# max_grad_norm per step: steps 1-2 do not clip (step 2 speculates), step 3 clips after speculating (taken back and
# redone), step 4 takes its norm first, step 5 speculates, step 6 is non-finite after speculating (skipped: taken
# back), step 7 speculates again.
CLIP = [1e6, 1e6, 0.05, 1e6, 1e6, 1e6, 1e6]
POISON_STEP = 5


def state_of(engine) -> list[torch.Tensor]:
    opt = engine.optimizer
    opt.wait()
    out = [u.master.clone() for u in engine.store.units]
    out += [t.clone() for _, t in sorted(opt.state_tensors().items())]
    return out


def poison_first_layer(engine, on: dict, layer: int = 0) -> None:
    """While ``on["now"]``, layer 0's gradient (the last to land) becomes inf, as a bf16 overflow in its backward
    would make it: the later layers have landed (and been speculated on) before."""
    opt, unit = engine.optimizer, engine.layer_units[layer]
    if hasattr(opt, "gradient_hooks"):  # lean: the gradient is consumed from a staging slab

        def hook(index, first_pass, grad, sq):
            if on["now"] and first_pass and index == unit.index:
                grad.fill_(float("inf"))
                sq.fill_(float("inf"))

        opt.gradient_hooks.append(hook)
        return
    # Host units: the optimizer is the sink each final gradient is handed to as it lands (optim/gradient_path.py).
    state, landed = engine.state, opt.landed

    def poisoned(i, sq):
        if on["now"] and i == unit.index:
            unit.grad.fill_(float("inf"))
            state.grad_sq[i] = torch.tensor(float("inf"))
            sq = None if sq is None else float("inf")
        landed(i, sq)

    opt.landed = poisoned


def train(model, config: MegaTrainConfig, budget: int | None = None, poison_layer: int = 0
          ) -> tuple[list[list[torch.Tensor]], MegaTrainEngine]:
    engine = MegaTrainEngine(copy.deepcopy(model), config, device="cpu")
    opt = engine.create_optimizer(lr=1e-2, weight_decay=0.1, max_grad_norm=1e6)
    if budget is not None:
        opt.take_back_copies.budget = budget
    on = {"now": False}
    poison_first_layer(engine, on, poison_layer)
    states = []
    for step, ((ids, lab),) in enumerate(random_batches(len(CLIP), 1, 2, 10, 96, seed=3)):
        opt.max_grad_norm = CLIP[step]
        on["now"] = step == POISON_STEP
        loss = engine(input_ids=ids, labels=lab).loss
        engine.set_final_backward(True)  # (as the Trainer marks a step's last backward: speculation on)
        loss.backward()
        engine.finish_backward()
        opt.step()
        opt.zero_grad()
        states.append(state_of(engine))
    assert opt.skipped_steps == 1
    return states, engine


def assert_identical(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for k, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {step + 1}, tensor {k}"


@pytest.mark.parametrize("kernel", ["fused", "native"])
def test_speculative_step_is_bit_identical_to_none(kernel):
    model = tiny("llama")
    cfg = dict(compute_dtype="float32", host_kernel=kernel, resident_placement="host")
    try:
        want, _ = train(model, MegaTrainConfig(**cfg, speculative_step=False))
    except RuntimeError as e:  # (no C compiler here)
        pytest.skip(str(e))
    got, engine = train(model, MegaTrainConfig(**cfg, speculative_step=True, exact_take_back=True))
    opt = engine.optimizer
    assert opt.taken_back == 3 + 2  # step 3 (clips): the 3 layers; step 6 (skipped): layers 2, 1 (0 is inf)
    assert opt.speculated >= 4 * 3
    assert_identical(got, want)
    assert_identical([got[POISON_STEP]], [got[POISON_STEP - 1]])  # the skipped step changed nothing


def test_lean_store_take_back_is_bit_identical():
    """The lean store speculates whenever the previous step did not clip; its clipped redo and its skipped step
    equal the full store stepping without speculation, bit for bit, and the skip needs no re-run."""
    model = tiny("llama")
    want, _ = train(model, MegaTrainConfig(compute_dtype="float32", speculative_step=False,
                                           resident_placement="host"))
    got, engine = train(model, MegaTrainConfig(compute_dtype="float32", lean_store=True, resident_placement="host",
                                               exact_take_back=True, lean_grad_plane="off"))  # (re-runs)
    assert engine.optimizer.regenerated_steps == 3  # step 1 (norm first), 3 (clips), 4 (norm first); not the skip
    assert_identical(got, want)


def test_without_room_for_copies_speculation_stands_aside():
    """With no host memory for the copies the speculative host step does not speculate (each layer is stepped
    after the backward: exact still); the lean store, which must consume each gradient as it lands, takes back
    arithmetically (within an ulp) and says so."""
    model = tiny("llama")
    cfg = dict(compute_dtype="float32", resident_placement="host")
    want, _ = train(model, MegaTrainConfig(**cfg, speculative_step=False))
    got, engine = train(model, MegaTrainConfig(**cfg, exact_take_back=True), budget=0)
    assert engine.optimizer.speculated == 0 and engine.optimizer.taken_back == 0
    assert_identical(got, want)


@pytest.mark.parametrize("lean_store", [False, True])
def test_default_skip_is_exact_when_the_first_gradient_to_land_is_nonfinite(lean_store):
    """Without copies (the default): the last layer's gradient lands first; when it is non-finite (as with a
    non-finite loss, where every gradient is) nothing is updated speculatively, so the skipped step leaves the
    state bit-identical; the other steps (one clips after speculating: taken back arithmetically) stay within
    rounding of a run that never speculated."""
    model = tiny("llama")
    cfg = dict(compute_dtype="float32", resident_placement="host")
    want, _ = train(model, MegaTrainConfig(**cfg, speculative_step=False), poison_layer=2)
    got, engine = train(model, MegaTrainConfig(**cfg, lean_store=lean_store), poison_layer=2)
    assert_identical([got[POISON_STEP]], [got[POISON_STEP - 1]])  # the skipped step changed nothing
    for g, w in zip(got[-1], want[-1]):
        assert float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)) <= 1e-4  # (Adam-amplified)
