"""The step-time model (planner/step_time.py) against every measured run of today's engine that is filed in
integration/results/ (filed per benchmark, H100 80GB) or quoted in issue 31: predicted within +-15 % of the measured step,
from the default ``MachineProfile`` (no constant per case). Measured numbers are read from the result files; the
ones only issue 31 states are typed here once, with that source.

Regimes the model does not predict within 15 % are listed in ``OUTSIDE`` with the reason (xfail, not strict: they
pass once the model or the engine changes what they measure).
"""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, planner
from hf_megatrain.planner.finetune_rows import AttentionKernel, BatchRows
from hf_megatrain.planner.step_time import MachineProfile, layer_costs, predict_step, predict_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "integration", "results")
TOLERANCE = 0.15
GPU = 79 << 30  # an H100 80GB's budget

# The benchmark models (integration/bench_vs_deepspeed.py, scale_123b.py), built on the meta device.
WIDTHS = {
    "14B": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=8,
                vocab_size=152064),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064),
    "123B": dict(hidden_size=12288, intermediate_size=28672, num_attention_heads=96, num_key_value_heads=8,
                 head_dim=128, vocab_size=32768),
}
STREAMED = dict(device_layers=0, device_step_layers=0)  # --regime streamed
COMPILE = dict(torch_compile=True)
SPLIT = dict(split_host_update="auto")  # (the default since session 16: host updates after the norm may split)
H200 = "bench_vs_deepspeed/2026-11-26_50ce58b_"
EAGER = dict(torch_compile=False)  # (the default until session 16; "auto" now compiles on a GPU)


def GPU_STEPPED(k: int) -> dict:  # noqa: N802  (reads as the regime's name)
    """Every layer streamed, the first ``k`` stepped on the GPU with their state in host memory."""
    return dict(device_layers=0, device_step_layers=k, device_step_state="host")
# (measured before the bf16 gradient plane: a clipping step re-ran its forward+backward; "auto" would depend on
# the RAM of the machine running the test)
LEAN_COPY = dict(lean_store=True, lean_compute_copy=True, lean_grad_plane="off")


@functools.lru_cache(maxsize=None)
def shape(width: str, layers: int) -> planner.ModelShape:
    kw = WIDTHS[width]
    cfg = (transformers.MistralConfig if "head_dim" in kw else transformers.Qwen2Config)(
        **kw, num_hidden_layers=layers, tie_word_embeddings=False)
    with torch.device("meta"):
        return planner.ModelShape.from_model(transformers.AutoModelForCausalLM.from_config(cfg))


def measured(path: str, *keys: str) -> float:
    value = json.load(open(os.path.join(RESULTS, path)))
    for k in keys:
        value = value[int(k)] if isinstance(value, list) else value[k]
    return float(value)


def issue31(value: float) -> float:
    """A step time only issue 31 states (measured on the H100 machine the same day; not filed as a result)."""
    return value


SWEEP = "bench_vs_deepspeed/2026-11-26_495f82d_clip1_gpu_step_k_sweep_h100.txt"


def session20_sweep(k: int, tokens: int) -> float:
    """A step time of session 20's sweep of GPU-stepped layers (``SWEEP``: the run's summary lines, one table row
    per regime and size, in K order 0, 2, 4, 8)."""
    text = open(os.path.join(RESULTS, SWEEP)).read()
    rows = re.findall(r"^\| ([\d,]+) \| hf_megatrain \(streamed\w*\) \| [^|]+\| ([\d.]+) \|", text, re.M)
    times = [float(t) for size, t in rows if int(size.replace(",", "")) == tokens]
    return times[(0, 2, 4, 8).index(k)]


def step(width: str, layers: int, config: dict, seq: int, batch: int, clipping: bool, saved: int = 0) -> float:
    """(Runs before session 16 updated every layer whole: ``split_host_update`` off unless the case says; runs
    before session 21 recomputed every layer: ``saved`` is the last layers that kept their forward's graph.)"""
    sh, cfg = shape(width, layers), MegaTrainConfig(**{"split_host_update": "off", **config})
    return predict_step(sh, cfg, planner.unit_plans(sh, cfg, "cuda", GPU), seq, batch, clipping=clipping,
                        saved_graphs=saved).step_s


def finetune(path: str, layout: str, config: dict, kernel: AttentionKernel | None = None,
             saved: int = 0) -> tuple[float, float]:
    """(predicted, measured) mean step of a fine-tune benchmark run (integration/bench/finetune_data.py): each timed
    step's own rows -- the same lengths the run drew, from its seed -- predicted with clipping on every step (the
    bench's ``--max-grad-norm 1.0`` on a random init) and averaged, as the run's ``step_time_s`` averages."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "integration"))
    from bench.finetune_data import FULL_MAX_LEN, step_lengths

    record = json.load(open(os.path.join(RESULTS, path)))["records"]["megatrain:streamed@32768"]
    timed = len(json.loads(str(record["step_times_s"])))
    warmup = len(json.loads(str(record["warmup_times_s"])))
    sh, cfg = shape("14B", 8), MegaTrainConfig(**{"split_host_update": "off", **config})
    plans = planner.unit_plans(sh, cfg, "cuda", GPU)
    steps = step_lengths({"tokens": 32768, "layout": layout}, warmup + timed)[warmup:]
    rows = [BatchRows.padded(n) if layout == "padded" else BatchRows.packed(n, FULL_MAX_LEN) for n in steps]
    return (predict_steps(sh, cfg, plans, rows, clipping=True, kernel=kernel, saved_graphs=saved).step_s,
            float(record["step_time_s"]))


def ft_case(label: str, path: str, layout: str, config: dict, kernel: AttentionKernel | None = None,
            saved: int = 0) -> tuple:
    run = functools.lru_cache(maxsize=None)(lambda: finetune(path, layout, config, kernel, saved))
    return (label, lambda: run()[0], lambda: run()[1])


def layer_visit(width: str, config: dict, seq: int, batch: int, clipping: bool) -> float:
    """One interior layer's GPU visits per step (what scale_123b.py's ``gpu_per_layer_s`` measures): forward and
    backward, each paced by its compute or its weight load, twice when a lean step clips (norm first)."""
    sh, cfg = shape(width, 3), MegaTrainConfig(**config)
    plans = planner.unit_plans(sh, cfg, "cuda", GPU)
    c = layer_costs(sh, cfg, plans, seq, seq * batch, MachineProfile(), clipping)[1]
    return (2 if clipping and cfg.lean_store else 1) * (max(c.forward, c.load) + max(c.backward, c.load))


# (label, predicted seconds, measured seconds); the prediction is a thunk so a failing build shows in its case.
CASES = [
    ("14B x8 streamed, 8k tokens, compile, no clip (session 11)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 4, False),
     lambda: measured("bench_vs_deepspeed/2026-11-24_a3e661b_bench_streamed_dynamic_h100.json", "records", "megatrain:streamed@4", "step_time_s")),
    ("14B x8 streamed, 32k tokens, compile, no clip (session 11)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 16, False),
     lambda: measured("bench_vs_deepspeed/2026-11-24_a3e661b_bench_streamed_dynamic_h100.json", "records", "megatrain:streamed@16", "step_time_s")),
    ("14B x8 streamed, 8k tokens, compile, no clip (session 12)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 4, False),
     lambda: measured("compare_commits/2026-11-25_88d802f_compare_commits_streamed_noclip_h100.json", "new", "rows", "8192", "step_time_s")),
    ("14B x8 streamed, 32k tokens, compile, no clip (session 12)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 16, False),
     lambda: measured("compare_commits/2026-11-25_88d802f_compare_commits_streamed_noclip_h100.json", "new", "rows", "32768", "step_time_s")),
    ("14B x8 streamed, 32k tokens, compile, no clip (issue 31 headline)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 16, False), lambda: issue31(1.299)),
    ("14B x8 streamed, 32k tokens, compile, clipping every step (issue 31)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 16, True), lambda: issue31(1.551)),
    ("14B x8 streamed, 32k tokens, eager, clipping every step (issue 31)",
     lambda: step("14B", 8, STREAMED | EAGER, 2048, 16, True), lambda: issue31(1.821)),
    ("14B x8 streamed, 8k tokens, compile, clipping every step (session 13)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 4, True),
     lambda: measured("bench_vs_deepspeed/2026-11-25_c7bb5ea_bench_streamed_clip1_h100.json", "records", "megatrain:streamed@4", "step_time_s")),
    ("14B x8 streamed, 32k tokens, compile, clipping every step (session 13)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 16, True),
     lambda: measured("bench_vs_deepspeed/2026-11-25_c7bb5ea_bench_streamed_clip1_h100.json", "records", "megatrain:streamed@16", "step_time_s")),
    ("7B x8, 8k tokens, compile, clipping every step (issue 31)",
     lambda: step("7B", 8, STREAMED | COMPILE, 2048, 4, True), lambda: issue31(0.643)),
    # Fine-tune runs (32,768 real tokens per step, clip 1.0): each timed step's rows (``finetune``).
    ft_case("14B x8 fine-tune packed, eager, SDPA dense mask (session 12)",
            "bench_vs_deepspeed/2026-11-25_788d919_finetune_packed_ds_h100.json", "packed", STREAMED | EAGER,
            AttentionKernel.DENSE_MASK),
    ft_case("14B x8 fine-tune packed, compile, SDPA dense mask (session 12)",
            "bench_vs_deepspeed/2026-11-25_a14889b_finetune_packed_compile_h100.json", "packed", STREAMED | COMPILE,
            AttentionKernel.DENSE_MASK),
    ft_case("14B x8 fine-tune packed, compile, SDPA dense mask (session 15)",
            "bench_vs_deepspeed/2026-11-26_f9a8613_finetune_packed_compile_h100.json", "packed", STREAMED | COMPILE,
            AttentionKernel.DENSE_MASK),
    *[(f"14B x8, 32k tokens, compile, clipping every step, {k} GPU-stepped layers with host state (session 15)",
       functools.partial(step, "14B", 8, GPU_STEPPED(k) | COMPILE, 2048, 16, True),
       functools.partial(measured, f"bench_vs_deepspeed/2026-11-26_7d56ef7_bench_clip1_32k_gpu_step_k{k}_held_copies_h100"
                         ".json", "records", "megatrain:auto@16", "step_time_s")) for k in (0, 2, 3, 4)],
    # Session 16, an H200 machine (the profile's H100 rates: same tensor cores, the host AdamW measured 134-140 GB/s)
    ("14B x8 streamed, 32k tokens, compile, clipping every step, whole updates (H200, session 16)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 16, True),
     lambda: measured(f"{H200}clip1_32k_split_off_h200.json", "records", "megatrain:streamed@16", "step_time_s")),
    *[(f"14B x8 streamed, 32k tokens, compile, clipping every step, split host updates (H200, session 16, {run})",
       functools.partial(step, "14B", 8, STREAMED | COMPILE | SPLIT, 2048, 16, True),
       functools.partial(measured, f"{H200}clip1_32k_split_auto{run}_h200.json", "records", "megatrain:streamed@16",
                         "step_time_s")) for run in ("", "_rerun")],
    ("14B x8 streamed, 8k tokens, compile, clipping every step, split auto: declined (H200, session 16)",
     lambda: step("14B", 8, STREAMED | COMPILE | SPLIT, 2048, 4, True),
     lambda: measured(f"{H200}clip1_8k_split_auto_h200.json", "records", "megatrain:streamed@4", "step_time_s")),
    ("14B x8, 32k tokens, compile, clipping every step, split + 2 GPU-stepped layers with host state (H200, session 16)",
     lambda: step("14B", 8, GPU_STEPPED(2) | COMPILE | SPLIT, 2048, 16, True),
     lambda: measured(f"{H200}clip1_32k_split_auto_gpu_step_k2_h200.json", "records", "megatrain:auto@16",
                      "step_time_s")),
    # (The timing of FlexAttention's block-skipping packed attention; its values were wrong -- session 17,
    # integration/results/masked_flex_parity -- so the run is withdrawn as a fine-tune figure, not as a timing.)
    ft_case("14B x8 fine-tune packed, config defaults, flex_attention (H200, session 16)",
            "bench_vs_deepspeed/2026-11-26_976f21a_finetune_packed_flex_defaults_h200.json", "packed",
            STREAMED | SPLIT | dict(torch_compile="auto"), AttentionKernel.FLEX),
    # (Their defaults then: packed rows through SDPA's dense mask, padded batches padded through FlexAttention.)
    *[ft_case(f"14B x8 fine-tune {layout}, config defaults ({kernel}) (H200, {run}, {file[11:18]})",
              f"bench_vs_deepspeed/{file}", layout, STREAMED | SPLIT | dict(torch_compile="auto", padding_free="off"),
              AttentionKernel.DENSE_MASK if layout == "packed" else None)
      for layout, kernel, run, file in (
          ("packed", "SDPA dense mask", "session 16", "2026-11-26_976f21a_finetune_packed_defaults_ds_h200.json"),
          ("packed", "SDPA dense mask", "session 16", "2026-11-26_cd10ebf_finetune_packed_defaults_final_policy_h200.json"),
          ("packed", "SDPA dense mask", "session 17", "2026-11-26_3978ddb_finetune_packed_sdpa_ds_h200.json"),
          ("padded", "FlexAttention", "session 17", "2026-11-26_3978ddb_finetune_padded_flex_ds_h200.json"),
          ("padded", "FlexAttention", "session 17", "2026-11-26_ff454b9_finetune_padded_flex_ds_h200.json"))],
    # Session 19, an H100: the defaults after the flip (packed rows through FlexAttention outside the compiled
    # layers, padded batches unpadded into one packed row), and the padded defaults before it.
    ft_case("14B x8 fine-tune padded, defaults of 9661d41 (FlexAttention over the padding) (H100, session 19)",
            "bench_vs_deepspeed/2026-11-26_9661d41_finetune_padded_defaults_h100.json", "padded",
            STREAMED | SPLIT | dict(torch_compile="auto", padding_free="off")),
    *[ft_case(f"14B x8 fine-tune {layout}, config defaults (FlexAttention{', unpadded' if layout == 'padded' else ''})"
              f" (H100, session 19, {file[11:18]})", f"bench_vs_deepspeed/{file}", layout,
              STREAMED | SPLIT | dict(torch_compile="auto"))
      for layout, file in (("packed", "2026-11-26_bd56a20_finetune_packed_defaults_h100.json"),
                           ("padded", "2026-11-26_bd56a20_finetune_padded_defaults_h100.json"),
                           ("packed", "2026-11-26_99bf080_finetune_packed_defaults_h100.json"))],
    ("7B x8 kept on the GPU, one 262,144-token sequence, inputs offloaded (the attention rate's calibration run)",
     lambda: step("7B", 8, dict(activation_offload="on"), 262144, 1, False),
     lambda: measured("long_context/2026-11-23_6c2de76_long_context_h100_8layers_262k.json", "runs", "0", "step_time_s")),
    ("123B width, lean + copy, 16k tokens, no clip: per layer (session 11)",
     lambda: layer_visit("123B", LEAN_COPY, 4096, 4, False),
     lambda: measured("scale_123b/2026-11-24_a3e661b_scale_123b_lean_copy_L5_noclip_h100.json", "runs", "0", "events", "gpu_per_layer_s")),
    ("123B width, lean + copy, 16k tokens, clip 1.0: per layer (session 11)",
     lambda: layer_visit("123B", LEAN_COPY, 4096, 4, True),
     lambda: measured("scale_123b/2026-11-24_a3e661b_scale_123b_lean_copy_L5_clip1_h100.json", "runs", "0", "events", "gpu_per_layer_s")),
    ("123B width, lean + copy, no clip: per layer (session 13)",
     lambda: layer_visit("123B", LEAN_COPY, 4096, 4, False),
     lambda: measured("scale_123b/2026-11-25_c7bb5ea_scale_123b_lean_copy_L5_noclip_h100.json", "runs", "0", "events", "gpu_per_layer_s")),
    ("123B width, lean + copy, clip 1.0: per layer (session 13)",
     lambda: layer_visit("123B", LEAN_COPY, 4096, 4, True),
     lambda: measured("scale_123b/2026-11-25_c7bb5ea_scale_123b_lean_copy_L5_clip1_h100.json", "runs", "0", "events", "gpu_per_layer_s")),
    ("123B width, lean + copy, 5 layers, no clip: whole step (session 13)",
     lambda: step("123B", 5, LEAN_COPY, 4096, 4, False),
     lambda: measured("scale_123b/2026-11-25_c7bb5ea_scale_123b_lean_copy_L5_noclip_h100.json", "runs", "0", "step_time_s")),
    ("123B width, lean + copy, 5 layers, clip 1.0: whole step (session 13)",
     lambda: step("123B", 5, LEAN_COPY, 4096, 4, True),
     lambda: measured("scale_123b/2026-11-25_c7bb5ea_scale_123b_lean_copy_L5_clip1_h100.json", "runs", "0", "step_time_s")),
    ("123B width, lean + copy, no clip: per layer (issue 31)",
     lambda: layer_visit("123B", LEAN_COPY, 4096, 4, False), lambda: issue31(0.329)),
    ("123B width, lean + copy, clip 1.0: per layer (issue 31)",
     lambda: layer_visit("123B", LEAN_COPY, 4096, 4, True), lambda: issue31(0.658)),
    # Session 20, one H100 start: K of the first layers GPU-stepped with host state, swept (the run's text summary:
    # its JSON did not come back); the model ranks K=2 first at 8k as measured, K=0 / 2 within 4 % at 32k.
    *[(f"14B x8, {tokens // 1024}k tokens, compile, clip every step, split auto, {k} GPU-stepped layers with host "
       "state (session 20)",
       functools.partial(step, "14B", 8, (GPU_STEPPED(k) if k else STREAMED) | COMPILE | SPLIT, 2048, tokens // 2048,
                         True),
       functools.partial(session20_sweep, k, tokens))
      for k in (0, 2, 4, 8) for tokens in (8192, 32768)],
    *[(f"14B x8 streamed, {tokens // 1024}k tokens, compile, clip every step, split auto (session 20, 85ad266)",
       functools.partial(step, "14B", 8, STREAMED | COMPILE | SPLIT, 2048, tokens // 2048, True),
       functools.partial(measured, "bench_vs_deepspeed/2026-11-26_85ad266_clip1_8k_32k_gpu_wait_h100.json", "records",
                         f"megatrain:streamed@{tokens // 2048}", "step_time_s"))
      for tokens in (8192, 32768)],
    # Session 21: the last layers keep their forward's graph (saved_graph_layers auto: the engine logged 8 at 8k,
    # 4 at 32k on the H100's budget; planner/saved_graphs.py gives the same counts for this shape).
    *[(f"14B x8 streamed, {tokens // 1024}k tokens, compile, clip every step, {saved} saved graphs (session 21)",
       functools.partial(step, "14B", 8, STREAMED | COMPILE | SPLIT, 2048, tokens // 2048, True, saved),
       functools.partial(measured, "compare_commits/2026-11-26_ed85d48_vs_19a029c_saved_graphs_clip1_h100.json",
                         "new", "rows", str(tokens), "step_time_s"))
      for tokens, saved in ((8192, 8), (32768, 4))],
    ft_case("14B x8 fine-tune packed, config defaults, 4 saved graphs (H100, session 21, ed85d48)",
            "bench_vs_deepspeed/2026-11-26_ed85d48_finetune_packed_saved_graphs_h100.json", "packed",
            STREAMED | SPLIT | dict(torch_compile="auto"), saved=4),
    # Session 22: another machine start, DeepSpeed beside it (the moments prefaulted: steady steps unchanged).
    *[(f"14B x8 streamed, {tokens // 1024}k tokens, compile, clip every step, {saved} saved graphs (session 22)",
       functools.partial(step, "14B", 8, STREAMED | COMPILE | SPLIT, 2048, tokens // 2048, True, saved),
       functools.partial(measured, "bench_vs_deepspeed/2026-11-26_6b6004d_clip1_8k_32k_prefault_ds_same_start_h100"
                         ".json", "records", f"megatrain:streamed@{tokens // 2048}", "step_time_s"))
      for tokens, saved in ((8192, 8), (32768, 4))],
]

# Measured runs the model does not predict within 15 %, and why.
OUTSIDE = [
    *[(*ft_case(f"14B x8 fine-tune padded, SDPA dense mask ({run})", f"bench_vs_deepspeed/{file}", "padded",
                 STREAMED | config, AttentionKernel.DENSE_MASK),
       "with a mask SDPA runs cuDNN attention, which builds an execution graph for every new shape (0.1-5.2 s on a "
       "padded width's first call: attention_shapes/2026-11-26_6b17243_attention_shapes_h200.json), and a padded "
       "run meets a new width nearly every step; the model has no per-shape cost (the steps after a width's first "
       "are within it: 976f21a's 1.754 s step, predicted 1.77)")
      for run, file, config in (
          ("H200, session 16", "2026-11-26_976f21a_finetune_padded_defaults_ds_h200.json",
           SPLIT | dict(torch_compile="auto")),
          ("session 15", "2026-11-26_f9a8613_finetune_padded_compile_h100.json", COMPILE))],
    ("14B x8 streamed, 8k tokens, compile, no clip (issue 31 headline: 0.760 s)",
     lambda: step("14B", 8, STREAMED | COMPILE, 2048, 4, False), lambda: issue31(0.760),
     "host-bound (the host AdamW is busy ~80 % of the step): the same config measured 0.567 / 0.661 / 0.760 s on "
     "three machine starts; 0.760 s needs ~100 GB/s of host AdamW against the default 140 (in-step 131-157 GB/s "
     "measured in the filed runs). Predicted with the run's own host rate it would fit; the profile has one rate"),
    ("123B width, lean (FP32 H2D + cast on the GPU), no clip: per layer (session 11)",
     lambda: layer_visit("123B", dict(lean_store=True), 4096, 4, False),
     lambda: measured("scale_123b/2026-11-24_a3e661b_scale_123b_lean_L3_h100.json", "runs", "0", "events", "gpu_per_layer_s"),
     "the FP32 master is cast on the GPU in 128 MiB chunks (slots.py): the forward's load runs at ~35 GB/s "
     "(5.5 GB in 0.157 s), not the 45.5 GB/s of a plain copy the profile has"),
    ("123B width, lean + copy, 5 layers, no clip: whole step (session 11)",
     lambda: step("123B", 5, LEAN_COPY, 4096, 4, False),
     lambda: measured("scale_123b/2026-11-24_a3e661b_scale_123b_lean_copy_L5_noclip_h100.json", "runs", "0", "step_time_s"),
     "before the fix: LeanAdamW.step() allocated and zero-filled a layer-sized FP32 tensor every step (5.2 GiB at "
     "this width: the host planner's missing 5 GiB; 0.43 s of the step's 1.00 s optimizer.step() call). "
     "Re-measured after it: 2.192 s (session 13, in CASES)"),
]


@pytest.mark.parametrize("label,predict,measure", CASES, ids=[c[0] for c in CASES])
def test_prediction_within_15_percent(label, predict, measure):
    p, m = predict(), measure()
    assert abs(p / m - 1) <= TOLERANCE, f"{label}: predicted {p:.3f} s, measured {m:.3f} s ({p / m - 1:+.1%})"


@pytest.mark.parametrize("label,predict,measure,why", OUTSIDE, ids=[c[0] for c in OUTSIDE])
def test_known_outside_15_percent(label, predict, measure, why):
    p, m = predict(), measure()
    if abs(p / m - 1) > TOLERANCE:
        pytest.xfail(f"{label}: predicted {p:.3f} s, measured {m:.3f} s ({p / m - 1:+.1%}): {why}")


def test_overlap_structure():
    """Clipping makes the updates wait for the norm (never faster); a host-bound step speeds up with the host rate
    and a GPU-bound one does not; a lean step that clips runs forward+backward twice."""
    sh, cfg = shape("14B", 8), MegaTrainConfig(**STREAMED, **COMPILE)
    plans = planner.unit_plans(sh, cfg, "cuda", GPU)
    slow, fast = MachineProfile(host_adamw_gbps=70), MachineProfile(host_adamw_gbps=280)
    small = [predict_step(sh, cfg, plans, 2048, 4, m) for m in (slow, fast)]
    large = [predict_step(sh, cfg, plans, 2048, 16, m) for m in (slow, fast)]
    assert small[0].step_s > 1.5 * small[1].step_s and small[0].bottleneck.startswith("host AdamW")
    assert large[1].bottleneck == "GPU compute" and large[1].forward_wait_s < 0.05 * large[1].step_s
    clip = predict_step(sh, cfg, plans, 2048, 16, clipping=True)
    assert clip.step_s > large[1].step_s and clip.forward_wait_s > 0.1 * clip.step_s
    lean_cfg = MegaTrainConfig(**LEAN_COPY)
    lean = planner.unit_plans(shape("123B", 3), lean_cfg, "cuda", GPU)
    once, twice = (predict_step(shape("123B", 3), lean_cfg, lean, 4096, 4, clipping=c) for c in (False, True))
    assert (once.passes, twice.passes) == (1, 2) and twice.step_s > 1.6 * once.step_s


def test_estimate_prints_step_time_and_checkpoint(tmp_path, capsys):
    """``megatrain estimate``: step time, tokens/s, MFU and the bottleneck, with and without clipping; the rates
    are overridable; the checkpoint's size and write time at --disk-gbps."""
    transformers.Qwen2Config(**WIDTHS["7B"], num_hidden_layers=2).save_pretrained(tmp_path)
    base = [str(tmp_path), "--seq-len", "2048", "--batch-size", "4", "--device-layers", "0", "--gpu-memory", "80"]
    assert planner.main(base + ["--disk-gbps", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("Step time", "no clipping", "clipping on every step", "tokens/s", "MFU", "bottleneck:",
                "host AdamW 140 GB/s", "Checkpoint time at 2 GB/s", "Trainer checkpoint"):
        assert row in out, out
    assert planner.main(base + ["--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert planner.main(base + ["--json", "--host-adamw-gbps", "20", "--pcie-gbps", "10", "--tflops", "400"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["machine"]["pcie_h2d_gbps"] == slow["machine"]["pcie_d2h_gbps"] == 10
    for k in ("no clipping", "clipping on every step"):
        assert slow["step_time"][k]["step_s"] > default["step_time"][k]["step_s"] > 0
    ck = default["checkpoint"]  # FP32 export + master-less training state: 4 + 8 bytes per parameter
    assert ck["trainer_bytes"] == 12 * default["params"]["trainable"]
    assert planner.main(base + ["--host-adamw-gbps", "0"]) == 2
