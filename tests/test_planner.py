"""Memory planner: layouts shared with the engine, host prediction vs measured RSS on three model sizes, the
activation formula vs the allocator, ``check_fits`` errors, and ``megatrain estimate`` (``planner.main``)."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner
from hf_megatrain.core.plan import PlanInputs, Stepper, Where, build_plans
from hf_megatrain.core.store import bytes_per_param
from hf_megatrain.model.layers import find_layer_stack, unit_layouts

from .models import COMMON, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config_dir(tmp_path, **over) -> str:
    transformers.LlamaConfig(**{**COMMON, **over}).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("tie", [False, True])
def test_layouts_and_shape_match_engine(tie):
    meta_cfg = tiny("llama", tie=tie).config
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(meta_cfg)
    meta.tie_weights()
    ul = unit_layouts(meta, find_layer_stack(meta))
    engine = MegaTrainEngine(tiny("llama", tie=tie), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    assert ul.numels == [u.numel for u in engine.store.units]
    assert [[x[0] for x in lay] for lay in ul.layouts] == [[p.name for p in u.params] for u in engine.store.units]
    assert planner.ModelShape.from_model(meta) == planner.ModelShape.from_engine(engine)
    shape = planner.ModelShape.from_model(meta)
    assert shape.tied == tie and shape.trainable == engine.num_parameters()
    keys = ("master fp32", "grad fp32", "exp_avg fp32", "exp_avg_sq fp32", "compute copy")
    n_host = sum(shape.layer_numels)  # the small resident part goes to the GPU (resident_placement="auto")
    plan = planner.estimate(shape, MegaTrainConfig(device_layers=0, device_step_layers=0), 64, 2,
                            device_type="cuda", gpu_free=80 << 30)
    assert sum(plan.host[k] for k in keys) == bytes_per_param(torch.bfloat16) * n_host
    # GPU-stepped layers keep their gradient and moments on the GPU (12 bytes off the host: master + bf16 copy left)
    plan = planner.estimate(shape, MegaTrainConfig(device_layers=0), 64, 2, device_type="cuda", gpu_free=80 << 30)
    assert sum(plan.host[k] for k in keys) == (bytes_per_param(torch.bfloat16) - 12) * n_host
    assert any(k.startswith(f"GPU AdamW: {shape.num_layers} layers") for k in plan.device)
    # auto: with room on the GPU every layer stays there whole (16 B/param on the GPU, nothing on the host)
    plan = planner.estimate(shape, MegaTrainConfig(), 64, 2, device_type="cuda", gpu_free=80 << 30)
    assert sum(plan.host[k] for k in keys) == 0
    assert plan.device[f"{shape.num_layers} layers kept on the GPU (fp32 master, grad, moments)"] == 16 * n_host


def test_layer_placement_rule():
    """Auto placement: whole layers while they fit the share, then GPU-stepped ones, first layers first; layers
    with frozen parameters always stream; lean store and the disk tier keep everything on the host."""
    n, free = 100, 10_000

    def plans(cfg, frozen=(0,) * 6, device="cuda"):  # 6 layers of n parameters, an empty resident unit
        return build_plans(PlanInputs([n] * 6 + [0], list(frozen) + [0], device, free), cfg)

    cfg = MegaTrainConfig(device_step_fraction=0.5)  # budget 5000 B: 3 kept (1600 B each), 200 B left
    p = plans(cfg)
    assert p.kept == [0, 1, 2] and p.device_stepped == []
    cfg = MegaTrainConfig(device_step_fraction=0.5, device_layers=1)  # 3400 B left: 12 B x k + 1200 B buffers
    p = plans(cfg)
    assert p.kept == [0] and p.device_stepped == [1]
    assert plans(MegaTrainConfig(device_layers=3), frozen=(0, 5, 0, 0, 0, 0)).kept == [0, 2, 3]
    assert plans(MegaTrainConfig(), device="cpu").kept == []
    p = plans(MegaTrainConfig(lean_store=True))
    assert p.kept == p.device_stepped == [] and all(u.stepper is Stepper.LEAN for u in p.layers)
    assert all(u.grad is Where.NONE and u.compute is Where.NONE for u in p.layers)
    with pytest.raises(ValueError, match="device_layers"):
        MegaTrainConfig(lean_store=True, device_layers=1)


def _wide_shape() -> "planner.ModelShape":
    """A 14B-width Qwen2 of 8 layers (the benchmark's model) on meta: its layers are GiB-sized, like a real run's."""
    cfg = transformers.Qwen2Config(hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                                   num_key_value_heads=8, vocab_size=152064, num_hidden_layers=8,
                                   tie_word_embeddings=False)
    with torch.device("meta"):
        return planner.ModelShape.from_model(transformers.AutoModelForCausalLM.from_config(cfg))


def test_placement_tokens_fills_the_gpu_for_the_step_it_is_told():
    """With placement_tokens the auto rules keep as many layers as the planner's peak for that many tokens allows:
    more than the fraction rule for a small step, fewer for a large one, never a plan predicted not to fit while a
    smaller one would."""
    shape, free = _wide_shape(), 78 << 30
    base = MegaTrainConfig(compute_dtype="bfloat16", torch_compile=True)

    def kept(tokens: int) -> list[int]:
        cfg = MegaTrainConfig(compute_dtype="bfloat16", torch_compile=True, placement_tokens=tokens)
        plans = planner.unit_plans(shape, cfg, "cuda", free)
        if plans.kept:  # the plan it chose fits a step of that size ...
            assert planner.estimate(shape, cfg, tokens, 1, device_type="cuda", gpu_free=free, plans=plans,
                                    offloaded_layers=0).device_total <= free
        more = build_plans(PlanInputs(shape.layer_numels + [shape.resident_numel], [0] * 9, "cuda",
                                      planner.placement_budget(shape, cfg, free)),
                           MegaTrainConfig(compute_dtype="bfloat16", device_layers=len(plans.kept) + 1,
                                           device_step_layers=0))
        if len(plans.kept) < shape.num_layers:  # ... and one more kept layer would not
            assert planner.estimate(shape, cfg, tokens, 1, device_type="cuda", gpu_free=free, plans=more,
                                    offloaded_layers=0).device_total > free
        return plans.kept

    fraction_rule = planner.unit_plans(shape, base, "cuda", free).kept
    counts = [len(kept(t)) for t in (4096, 8192, 32768, 65536, 1 << 20)]
    assert counts == sorted(counts, reverse=True)  # more tokens, never more kept layers
    assert counts[1] > len(fraction_rule) and counts[-1] == 0
    # No GPU, or explicit placements: the option changes nothing.
    cfg = MegaTrainConfig(placement_tokens=8192, device_layers=2, device_step_layers=0)
    assert planner.unit_plans(shape, cfg, "cuda", free).kept == [0, 1]
    assert planner.unit_plans(shape, MegaTrainConfig(placement_tokens=8192), "cpu", None).kept == []
    with pytest.raises(ValueError, match="placement_tokens"):
        MegaTrainConfig(placement_tokens=-1)


@pytest.mark.slow  # subprocess (integration/measure_memory.py) forking one child per case
def test_host_prediction_close_to_measured(tmp_path):
    """Three Llama sizes x {fp32, bf16}: engine + one train step in forked children of one subprocess; peak RSS
    growth (store + executor buffers + step transients) vs the planner's host total less its baseline constant."""
    out = tmp_path / "mem.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "integration", "measure_memory.py"), "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]  # (after the result header: command, commit, machine, ...)
    assert len(results) == 6
    for r in results:
        # Under-prediction (a run that does not fit) within 10 %; over-prediction (the safe side: a run refused
        # a little early) within 15 %: the 50M fp32 case measures 1.09-1.11 on the 2-core box, on the code of
        # 2026-11-25 as on today's (its extras, ~0.08 GiB beside a 0.6 GiB store, are predicted ~0.07 GiB high).
        # Or within 64 MiB: RSS growth of a ~0.2 GiB case moves by tens of MiB with what the allocator reuses of
        # the warm-up's freed pages (the 10M fp32 case: 0.229 GiB here, 0.200 GiB on a loaded CI box, 1.22x).
        assert r["host_ratio"] >= 0.9, (r, proc.stdout)
        assert r["host_ratio"] <= 1.15 or r["host_predicted"] - r["host_measured"] <= 64 << 20, (r, proc.stdout)


def _alloc_peak(fn) -> int:
    """Peak bytes in use by glibc malloc, sampled after every aten op of ``fn``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MI(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MI

    def inuse() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    class Peak(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Peak.peak = max(Peak.peak, inuse())
            return out

    # Cyclic garbage of earlier tests (engines, trainers) freed by a collection that happens to run inside the window
    # would lower the peak by its size: collect it first, and no collection while measuring.
    gc.collect()
    gc.disable()
    try:
        base = inuse()
        Peak.peak = base
        with Peak():
            fn()
    finally:
        gc.enable()
    return Peak.peak - base


def layer_recompute_probe(dtype: torch.dtype, B: int = 2, T: int = 256, tile=None):
    """A one-layer sdpa Llama (hidden 256) and a function running its recompute + backward on fresh inputs, as the
    executor does (``tile``: applied to the layer first); grads are accumulated into zeroed buffers."""
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    layer = model.model.layers[0]
    if tile is not None:
        tile(layer)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    h, g = torch.randn(B, T, 256, dtype=dtype), torch.randn(B, T, 256, dtype=dtype)
    pos = torch.arange(T)[None].expand(B, T)
    pe = model.model.rotary_emb(h, pos)

    def step():
        x = h.detach().requires_grad_()
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.backward(out, g, inputs=[x] + list(layer.parameters()))

    return model, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_recompute_formula_vs_allocator(dtype):
    B, T = 2, 256
    model, step = layer_recompute_probe(dtype, B, T)
    step()
    measured = _alloc_peak(step)
    predicted = planner.layer_recompute_bytes(planner.ModelShape.from_model(model), B * T, dtype)
    assert 0.95 * measured <= predicted <= 1.2 * measured, (predicted, measured)


def test_check_fits_errors_say_what_to_change():
    shape = planner.ModelShape.from_model(tiny("llama"))
    cfg = MegaTrainConfig()
    with pytest.raises(MemoryError, match=r"needs .* host RAM, .* available .*; reduce"):
        planner.check_fits(shape, cfg, host_available=1 << 20, device_type="cpu")
    assert planner.check_fits(shape, cfg, host_available=1 << 40, device_type="cpu") is None
    with pytest.raises(MemoryError, match=r"GPU memory for seq_len=4096.*reduce seq_len"):
        planner.check_fits(shape, cfg, 4096, 8, host_available=1 << 40, gpu_available=256 << 20, device_type="cuda")
    assert planner.check_fits(shape, cfg, 4096, 8, host_available=1 << 40, gpu_available=1 << 40,
                              device_type="cuda") is None


def test_check_fits_on_a_built_engine():
    """On an engine the store already exists, so the host budget is not checked again; the GPU need is, per step
    shape, and a shortfall names the knobs to turn."""
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    assert planner.check_fits(engine, seq_len=16, batch_size=2) is None  # CPU engine: nothing left to check
    assert planner.check_fits(engine, seq_len=16, batch_size=2, host_available=1, gpu_available=1) is None
    assert planner.check_fits(engine, seq_len=16, batch_size=2, host_available=1, gpu_available=1 << 40,
                              device_type="cuda") is None
    with pytest.raises(MemoryError, match=r"this run does not fit: needs .* GPU memory for seq_len=16, "
                                          r"batch_size=2, .* available .*reduce seq_len or batch_size"):
        planner.check_fits(engine, seq_len=16, batch_size=2, gpu_available=1 << 20, device_type="cuda")


def test_estimate_cli_table_and_verdict(tmp_path, capsys):
    d = _config_dir(tmp_path)
    assert planner.main([d, "--seq-len", "128", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    for key in ("Host RAM", "layers kept on the GPU", "GPU memory", "weight slots", "Disk", "model export", "verdict: "):
        assert key in out, out
    # "this machine" only where its own GPU was checked; without one, the planned 80 GiB GPU is named
    here = ("this machine" if torch.cuda.is_available()
            else "a machine with .* of host RAM available and an 80.0 GiB GPU")
    assert re.search(f"verdict: fits {here}", out), out
    assert planner.main([os.path.join(d, "config.json"), "--compute-dtype", "float32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host"]["compute copy"] == 0 and data["host_fits"] is True
    assert data["params"]["trainable"] == sum(p.numel() for p in tiny("llama").parameters())


def test_estimate_cli_does_not_fit(tmp_path, capsys):
    d = _config_dir(tmp_path, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    assert planner.main([d, "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and re.search(r"verdict: does NOT fit (this machine|a machine with)", out), out


def test_estimate_cli_missing_path(capsys):
    assert planner.main(["/nonexistent/model-dir"]) == 2
    err = capsys.readouterr().err
    assert "no such file or directory" in err and "config.json" in err


# -- the engine runs the planner's checks (host before allocating; GPU at the first step of each shape) ------------
def _refuse_store(monkeypatch):
    import hf_megatrain.engine.builder as builder

    def no_store(*a, **k):
        raise AssertionError("UnitStore was built: the planner's host check must refuse first")

    monkeypatch.setattr(builder, "UnitStore", no_store)


@pytest.mark.parametrize("meta", [False, True])
def test_engine_refuses_model_over_host_ram_before_allocating(monkeypatch, meta):
    monkeypatch.setattr(planner.predict, "available_host_bytes", lambda: 1 << 16)
    _refuse_store(monkeypatch)
    if meta:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, "hidden_size": 1024,
                                                                              "intermediate_size": 4096}))
    else:
        model = tiny("llama")
    with pytest.raises(MemoryError, match=r"needs .* host RAM, 64\.0 KiB available .*; reduce"):
        MegaTrainEngine(model, MegaTrainConfig(), device="cpu")
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # refused before the model was touched


def test_engine_host_check_counts_peft_frozen_base_at_compute_dtype(monkeypatch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    shape = planner.ModelShape.from_model(model)
    assert shape.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad) > shape.trainable
    plan = planner.estimate(shape, MegaTrainConfig(), 16, 1, device_type="cpu")
    assert plan.host["frozen params (compute dtype)"] == 2 * shape.frozen
    assert plan.host["master fp32"] == 4 * shape.trainable
    monkeypatch.setattr(planner.predict, "available_host_bytes", lambda: 1 << 16)
    _refuse_store(monkeypatch)
    with pytest.raises(MemoryError, match=r"needs .* host RAM.*M frozen\); reduce"):
        MegaTrainEngine(model, MegaTrainConfig(), device="cpu")


def test_engine_host_check_knows_the_disk_tier(monkeypatch, tmp_path):
    """optimizer_state_dir takes the AdamW moments out of RAM: a budget between the two needs refuses the RAM run
    and builds the disk-tier one."""
    shape = planner.ModelShape.from_model(tiny("llama"))
    ram, disk = (MegaTrainConfig(compute_dtype="float32", **kw) for kw in ({}, {"optimizer_state_dir": str(tmp_path)}))
    need_ram, need_disk = (planner.estimate(shape, c, 1, 1, device_type="cpu").host_total - planner.HOST_BASELINE_BYTES
                           for c in (ram, disk))
    n_host = sum(shape.layer_numels)  # host-placed units (the resident one is on the CPU "device" here)
    assert need_ram - need_disk == 8 * n_host
    assert planner.estimate(shape, disk, 1, 1, device_type="cpu").disk[
        "AdamW moments while training (optimizer_state_dir)"] == 8 * n_host
    budget = int((need_ram + need_disk) / 2 / ram.host_memory_fraction)
    monkeypatch.setattr(planner.predict, "available_host_bytes", lambda: budget)
    with pytest.raises(MemoryError, match="needs .* host RAM"):
        MegaTrainEngine(tiny("llama"), ram, device="cpu")
    engine = MegaTrainEngine(tiny("llama"), disk, device="cpu")
    assert all(u.plan.moments is Where.DISK for u in engine.layer_units)


def test_gpu_step_check_once_per_shape_in_training_only(monkeypatch):
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    calls = []
    monkeypatch.setattr(planner, "check_fits", lambda eng, seq_len=None, batch_size=1, **k: calls.append(
        (batch_size, seq_len)))
    ids = torch.randint(0, 96, (2, 12))
    engine.model.train()
    engine(input_ids=ids, labels=ids).loss.backward()  # CPU: the GPU check never runs
    assert calls == []
    engine.device = torch.device("cuda")  # only the gate is exercised below: no tensor moves
    for shape in ((2, 12), (2, 12), (1, 12), (2, 12)):
        engine.begin_direct_forward(torch.zeros(shape, dtype=torch.long))
    engine.begin_direct_forward(None, inputs_embeds=torch.zeros(2, 7, 32))
    engine.model.eval()
    engine.begin_direct_forward(torch.zeros(4, 12, dtype=torch.long))
    assert calls == [(2, 12), (1, 12), (2, 7)]


def test_gpu_check_on_an_engine_says_what_to_change():
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    with pytest.raises(MemoryError, match=r"GPU memory for seq_len=4096, batch_size=8.*micro_batch_size \(now 0"
                                          r".*loss_chunk_tokens \(now \d+\)"):
        planner.check_fits(engine, seq_len=4096, batch_size=8, gpu_available=64 << 20, device_type="cuda")
    planner.check_fits(engine, seq_len=16, batch_size=2, gpu_available=1 << 40, device_type="cuda")


def test_engine_gpu_step_check_is_advisory(monkeypatch, caplog):
    """Until calibrated on GPUs, a predicted GPU shortfall is logged, never raised (CUDA OOM still stops a step)."""
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")

    def too_big(*a, **k):
        raise MemoryError("needs 99 GiB GPU memory, 10 GiB available; reduce micro_batch_size")

    monkeypatch.setattr(planner, "check_fits", too_big)
    engine.device = torch.device("cuda")  # only the gate is exercised: no tensor moves
    engine.model.train()
    with caplog.at_level("WARNING"):
        engine.begin_direct_forward(torch.zeros(2, 12, dtype=torch.long))
    assert "reduce micro_batch_size" in caplog.text


def test_activation_estimate_is_per_token_not_per_row():
    """Issue 31's padded batches (many short rows): the GPU peak and the activation-offload decision depend on the
    step's tokens (rows x padded width), not on how they are split into rows -- there is no per-row or rows x
    width^2 term to inflate many short rows (SDPA's mask is not counted at all: <= 0.3 GiB at 10 x 4067 bf16).
    At 14B width (8 layers, streamed, resident state on the GPU) the benchmark's padded steps plan 55-61 GiB
    against an H100's ~79 GiB: no layer offloads."""
    cfg = transformers.Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=8,
                                   num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768)
    with torch.device("meta"):
        shape = planner.ModelShape.from_model(transformers.Qwen2ForCausalLM(cfg))
    config = MegaTrainConfig(device_layers=0, device_step_layers=0)
    gib, budget = 1024 ** 3, 79 * 1024 ** 3
    plans = [planner.estimate(shape, config, t, b, device_type="cuda", gpu_free=budget)
             for b, t in ((117, 486), (2, 28431), (1, 56862))]
    assert plans[0].device_total == plans[1].device_total == plans[2].device_total
    for b, t in ((117, 486), (56, 739), (16, 2524), (39, 1056), (10, 4067)):
        plan = planner.estimate(shape, config, t, b, device_type="cuda", gpu_free=budget)
        assert plan.offloaded_layers == 0 and 50 * gib < plan.device_total < 62 * gib, (b, t, plan.device_total / gib)


def test_lean_step_allocates_no_layer_sized_transient():
    """Issue 31: at 123B width the planner said 102.0 GiB of host RAM and the run's high-water mark was 107.3 (3, 5
    and 6 layers alike: 5.2 GiB, one layer's FP32 bytes). LeanAdamW.step() made a zero gradient the size of the
    largest lean layer every step, for layers no backward reached -- almost never any. The step now allocates
    nothing of that size, so the planner's host total (which has no such row) is the peak."""
    model = tiny("llama", hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", lean_store=True), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, max_grad_norm=1e6)
    layer_bytes = 4 * max(u.numel for u in engine.layer_units)
    ids = torch.randint(0, 96, (2, 12))
    engine.model.train()
    for _ in range(2):  # (the first step takes its norm first; the second speculates: the steady state)
        engine(input_ids=ids, labels=ids).loss.backward()
        peak = _alloc_peak(opt.step)
        opt.zero_grad()
    assert peak < layer_bytes / 2, (peak, layer_bytes)


@pytest.mark.parametrize("run", ["scale_123b/2026-11-25_c7bb5ea_scale_123b_lean_copy_L5_noclip_h100.json",
                                 "scale_123b/2026-11-25_c7bb5ea_scale_123b_lean_copy_L5_clip1_h100.json"])
def test_host_prediction_at_123b_width_within_3_percent(run):
    """Issue 31: the planner's host RAM at 123B width (lean store + bf16 copy, 5 layers, the run's shape) within 3 %
    of the high-water mark measured on the H100 machine after the lean step's transient was removed
    (integration/results/scale_123b/, 2026-11-25; 107.3 GiB measured before, against 102.0 planned)."""
    with open(os.path.join(ROOT, "integration", "results", run)) as f:
        measured = json.load(f)["runs"][0]["vm_hwm_gib"] * 1024 ** 3
    cfg = transformers.MistralConfig(hidden_size=12288, intermediate_size=28672, num_attention_heads=96,
                                     num_key_value_heads=8, head_dim=128, vocab_size=32768, num_hidden_layers=5,
                                     tie_word_embeddings=False)
    with torch.device("meta"):
        shape = planner.ModelShape.from_model(transformers.MistralForCausalLM(cfg))
    cfg = MegaTrainConfig(lean_store=True, lean_compute_copy=True, lean_grad_plane="off")  # (the run's: no plane)
    plan = planner.estimate(shape, cfg, 4096, 4, device_type="cuda", gpu_free=79 << 30)
    assert abs(plan.host_total / measured - 1) <= 0.03, (plan.host_total / 2 ** 30, measured / 2 ** 30)
