"""The lean store's gradient plane (``lean_grad_plane``, optim/grad_plane.py): each layer's gradient of the step
stays on the host (bf16 where it crosses narrow, else FP32), so a step that clips updates every layer from it --
no second forward+backward -- and matches plain HF + torch AdamW (FP32) or the re-run path bit for bit (bf16, with
and without ``lean_compute_copy``). The planner counts its bytes and picks it where the RAM has room."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner

from .models import COMMON, tiny
from .parity import random_batches, rel, run_parity


def lean(**kw) -> MegaTrainConfig:
    return MegaTrainConfig(**{"compute_dtype": "float32", "lean_store": True, "lean_grad_plane": "on", **kw})


def count_forwards(engine) -> list[int]:
    """Forward passes of the model (the embedding runs once per forward, a re-run's included)."""
    calls = [0]
    engine.model.get_input_embeddings().register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


# -- FP32: parity with plain HF + torch.optim.AdamW ------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_clipping_every_step_updates_from_the_plane_without_a_rerun(overlap):
    """max_grad_norm well below the norm: every step clips; every layer is updated from the plane with the clip
    factor after the backward. Loss, every gradient and every weight match HF + clip_grad_norm_ + torch AdamW to
    1e-5 (run_parity), and the forward runs once per step."""
    worst, engine, _ = run_parity(tiny("llama"), ga=1, batch=4, max_grad_norm=0.3,
                                  config=lean(overlap_optimizer=overlap))
    opt = engine.optimizer
    assert opt.regenerated_steps == 0 and opt.plane_steps == 3
    assert opt.plane is not None and opt.plane.dtype == torch.float32
    assert opt.plane.nbytes == 4 * sum(u.numel for u in engine.layer_units)


def test_a_step_that_does_not_clip_then_one_that_clips_after_speculating():
    """Steps 1-2 do not clip (step 2 speculates: each layer updated as its gradient lands); step 3 clips: its
    speculated updates are taken back and redone from the plane, no re-run; step 4 clips again (norm first, from
    the plane). Every step matches the reference (run_parity)."""
    worst, engine, _ = run_parity(tiny("qwen2", tie=True), steps=4, ga=1, batch=4, max_grad_norm=1e6,
                                  clip_schedule=[1e6, 1e6, 0.3, 0.3], config=lean())
    assert engine.optimizer.regenerated_steps == 0
    assert engine.optimizer.plane_steps == 3  # step 1 (norm first), 3 (taken back, redone), 4 (norm first)


def test_forward_runs_once_per_clipping_step():
    """Counted: with the plane each clipping step runs one forward; without it, two (the norm-first re-run)."""
    model = tiny("llama")
    batches = [m[0] for m in random_batches(3, 1, 4, 12, 96, seed=3)]
    counts = {}
    for plane in ("on", "off"):
        engine = MegaTrainEngine(copy.deepcopy(model), lean(lean_grad_plane=plane), device="cpu")
        opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=0.3)
        calls = count_forwards(engine)
        for ids, lab in batches:
            engine(input_ids=ids, labels=lab).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.wait()
        counts[plane] = (calls[0], opt.regenerated_steps)
    assert counts == {"on": (3, 0), "off": (6, 3)}


def test_skipped_step_and_dropped_backward_need_no_rerun():
    """A NaN loss after a speculated step: nothing is updated (the first landed gradient is non-finite), the step
    is skipped bit-identically; a backward dropped with zero_grad() takes its speculated updates back from the
    plane (within rounding). Neither re-runs."""
    model = tiny("llama")
    engine = MegaTrainEngine(copy.deepcopy(model), lean(), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1e6)
    (a, la), (b, lb), (c, lc) = [m[0] for m in random_batches(3, 1, 4, 12, 96, seed=5)]
    for ids, lab in ((a, la), (b, lb)):  # step 1 norm first, step 2 speculates
        engine(input_ids=ids, labels=lab).loss.backward()
        opt.step(), opt.zero_grad()
    opt.wait()
    before = [t.clone() for u in engine.layer_units for t in (u.master, u.exp_avg, u.exp_avg_sq)]
    (engine(input_ids=c, labels=lc).loss * float("nan")).backward()
    opt.step(), opt.zero_grad()
    opt.wait()
    after = [t.clone() for u in engine.layer_units for t in (u.master, u.exp_avg, u.exp_avg_sq)]
    assert opt.skipped_steps == 1 and all(torch.equal(x, y) for x, y in zip(before, after))
    engine(input_ids=c, labels=lc).loss.backward()  # speculates (the skipped step set no mode) ...
    opt.zero_grad()  # ... and is dropped: taken back from the plane
    opt.wait()
    dropped = [t.clone() for u in engine.layer_units for t in (u.master, u.exp_avg, u.exp_avg_sq)]
    assert all(rel(y, x) <= 1e-6 for x, y in zip(before, dropped) if x.norm() > 0)
    assert opt.regenerated_steps == 0 and int(opt.unit_steps[:-1].max()) == 2


# -- bf16: the plane is bf16 (narrow gradients), bit-identical to the re-run path ------------------------------------
@pytest.mark.parametrize("with_copy", [False, True])
def test_bf16_plane_trains_bit_identically_to_the_rerun(with_copy):
    """bf16 compute, the native host kernel (narrow gradients): the plane holds the bf16 gradients (2 B/param);
    steps that clip, one that does not and one that clips after it give the same losses, gradients and weights as
    the re-run path, bit for bit, with and without ``lean_compute_copy`` -- and the re-run path matches the full
    store (tests/test_lean_store.py), which matches HF."""
    model = tiny("llama", num_hidden_layers=3)
    clips = [0.05, 0.05, 1e6, 1e6, 0.05]
    out = {}
    for plane in ("on", "off"):
        cfg = MegaTrainConfig(compute_dtype="bfloat16", lean_store=True, lean_compute_copy=with_copy,
                              lean_grad_plane=plane, host_kernel="native", overlap_optimizer=False,
                              resident_placement="host")
        e = MegaTrainEngine(copy.deepcopy(model), cfg, device="cpu")
        opt = e.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=clips[0])
        grads: list[torch.Tensor] = []
        opt.gradient_hooks.append(lambda i, first, g, sq: grads.append(g.float().clone()) if first else None)
        losses = []
        for clip, micro in zip(clips, random_batches(len(clips), 1, 4, 12, 96, seed=5)):
            opt.max_grad_norm = clip
            ids, lab = micro[0]
            loss = e(input_ids=ids, labels=lab).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        e.state.wait_all()
        out[plane] = (torch.stack(losses), grads, {n: e.store.master_tensor(n).clone() for n in e.store.names()},
                      opt.regenerated_steps)
        if plane == "on":
            assert opt.plane.dtype == torch.bfloat16 and opt.plane_steps == 4 and opt.regenerated_steps == 0
    (l1, g1, w1, _), (l0, g0, w0, r0) = out["on"], out["off"]
    assert r0 == 4
    assert torch.equal(l1, l0)
    assert len(g1) == len(g0) and all(torch.equal(a, b) for a, b in zip(g1, g0))
    for n in w0:
        assert torch.equal(w1[n], w0[n]), n


def test_split_visit_falls_back_to_the_rerun_and_says_why(caplog):
    """A bf16 plane cannot hold a gradient summed over in-layer micro-batches (FP32): such a step re-runs its
    forward+backward, with a log line naming the cause; results stay exact (same as the plane-less path)."""
    model = tiny("llama", num_hidden_layers=2)
    cfg = dict(compute_dtype="bfloat16", lean_store=True, host_kernel="native", overlap_optimizer=False,
               micro_batch_size=2)
    weights = {}
    for plane in ("on", "off"):
        e = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(**cfg, lean_grad_plane=plane), device="cpu")
        opt = e.create_optimizer(lr=1e-3, max_grad_norm=0.05)
        with caplog.at_level(logging.WARNING, logger="hf_megatrain.optim.lean"):
            for micro in random_batches(2, 1, 4, 12, 96, seed=2):
                e(input_ids=micro[0][0], labels=micro[0][1]).loss.backward()
                opt.step(), opt.zero_grad()
        e.state.wait_all()
        assert opt.regenerated_steps == 2
        weights[plane] = {n: e.store.master_tensor(n).clone() for n in e.store.names()}
    assert "not all on the gradient plane" in caplog.text and "micro_batch_size" in caplog.text
    assert all(torch.equal(weights["on"][n], weights["off"][n]) for n in weights["off"])


def test_config_and_plans():
    with pytest.raises(ValueError, match="lean_grad_plane"):
        MegaTrainConfig(lean_store=True, lean_grad_plane="yes")
    with pytest.raises(ValueError, match="lean_store=True too"):
        MegaTrainConfig(lean_grad_plane="on")
    # auto, bf16 with micro-batch splits: no plane (a split visit's gradient is an FP32 sum), and the why says so
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(lean_store=True, host_kernel="native",
                                                            micro_batch_size=2), device="cpu")
    assert not any(p.grad_plane for p in engine.plans.units) and "micro_batch_size" in engine.plans.grad_plane_why
    assert engine.create_optimizer(max_grad_norm=1.0).plane is None
    # without clipping the plane is planned but not allocated
    engine = MegaTrainEngine(tiny("llama"), lean(), device="cpu")
    assert engine.create_optimizer(max_grad_norm=None).plane is None


# -- the planner: bytes and the choice by RAM ------------------------------------------------------------------------
def test_planner_counts_the_plane_and_chooses_by_ram(tmp_path, capsys):
    """``megatrain estimate --lean-store``: with RAM to spare the plane is planned (2 B/param with bf16 gradients,
    16 B/param with the copy) and said; with too little RAM for it, the 12 / 14 B/param plan stands and the note
    says why; ``lean_grad_plane: off`` overrides."""
    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path)
    (tmp_path / "streamed.yaml").write_text("device_step_layers: 0\n")
    (tmp_path / "off.yaml").write_text("device_step_layers: 0\nlean_grad_plane: 'off'\n")

    def est(*extra: str, config: str = "streamed.yaml") -> dict:
        assert planner.main([str(tmp_path), "--seq-len", "64", "--gpu-memory", "80", "--device-layers", "0",
                             "--config", str(tmp_path / config), "--json", "--lean-store", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    roomy = est("--lean-compute-copy", "--host-memory", "64")
    layers = roomy["host"]["master fp32"] // 4
    assert roomy["host"]["lean grad plane"] == 2 * layers  # (bf16: the planner assumes the native kernel on a GPU)
    per_param = sum(roomy["host"][k] for k in ("master fp32", "exp_avg fp32", "exp_avg_sq fp32", "compute copy",
                                               "lean grad plane"))
    assert per_param == 16 * layers
    assert any("bf16 gradient plane" in n and "fits" in n for n in roomy["notes"])
    assert roomy["step_time"]["clipping on every step"]["passes"] == 1
    tight_gib = (roomy["host_total"] - layers) / 0.9 / 2 ** 30  # room for all but half the plane
    tight = est("--lean-compute-copy", "--host-memory", f"{tight_gib:.6f}")
    assert tight["host"].get("lean grad plane", 0) == 0 and tight["host"]["compute copy"] == 2 * layers
    assert any("do not fit the host's RAM" in n for n in tight["notes"])
    assert tight["step_time"]["clipping on every step"]["passes"] == 2
    for answer in (roomy, tight):  # the layout table: the fastest of those that fit is the choice
        rows = {x["name"]: x for x in answer["host_layouts"]}
        assert len(rows) == 5 and rows[answer["host_layout_choice"]]["fits"]
        best = rows[answer["host_layout_choice"]]["step_s"]
        assert all(x["step_s"] >= best for x in rows.values() if x["fits"])
    assert not {x["name"]: x for x in tight["host_layouts"]}["lean + bf16 copy + grad plane"]["fits"]
    off = est("--host-memory", "64", config="off.yaml")
    assert off["host"].get("lean grad plane", 0) == 0 and any("lean_grad_plane='off'" in n for n in off["notes"])
    shape = planner.ModelShape.from_model(tiny("llama"))
    plans = planner.unit_plans(shape, MegaTrainConfig(lean_store=True), "cuda", 80 << 30, host_free=64 << 30)
    assert all(p.grad_plane == 2 for p in plans.layers) and not plans.resident.grad_plane


def test_exact_take_back_from_the_plane_is_bit_identical():
    """With ``exact_take_back`` the speculated updates of a step that clips, or is skipped, are restored from their
    copies and redone from the plane: the run equals the full store stepping without speculation, bit for bit, and
    no step re-runs (tests/test_exact_take_back.py's schedule: speculated steps, a clip, a skip)."""
    from .test_exact_take_back import assert_identical, train

    model = tiny("llama")
    want, _ = train(model, MegaTrainConfig(compute_dtype="float32", speculative_step=False,
                                           resident_placement="host"))
    got, engine = train(model, lean(resident_placement="host", exact_take_back=True))
    assert engine.optimizer.regenerated_steps == 0 and engine.optimizer.plane_steps == 4
    assert_identical(got, want)
