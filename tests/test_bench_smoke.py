"""CPU smoke test of the side-by-side benchmark harness (integration/bench_vs_deepspeed.py): the plumbing only.

DeepSpeed needs CUDA and is not run here; hf_megatrain (both regimes), plain HF training and FSDP2 run on a tiny
Qwen2 in subprocesses exactly as on the GPU, and the trace parser, retry plan, merge and table are checked directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

import bench_vs_deepspeed as bench  # noqa: E402
from bench.common import phase_breakdown  # noqa: E402

FAST = ["--env", "OMP_WAIT_POLICY=PASSIVE"]  # 2 cores: keep the optimizer thread's OpenMP team from spinning


def _ev(cat, name, ts, dur, stream=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream or 1}
    if stream is not None:
        e["args"] = {"stream": stream, "device": 0}
    return e


def test_phase_breakdown_from_trace():
    trace = {"traceEvents": [
        _ev("user_annotation", "bench.step", 1000, 1000),
        _ev("kernel", "gemm", 1100, 300, stream=7),
        _ev("kernel", "gemm", 1300, 200, stream=7),  # overlaps the first: union 1100..1500
        _ev("kernel", "small", 1800, 100, stream=7),
        _ev("kernel", "side", 1000, 50, stream=20),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000, 200, stream=20),  # half under compute
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1900, 200, stream=21),  # clipped to 1900..2000
        _ev("kernel", "outside", 5000, 100, stream=7),  # after the window: ignored
    ]}
    p = phase_breakdown(trace)
    assert p["compute_stream"] == 7
    assert p["window_ms"] == pytest.approx(1.0)
    assert p["compute_ms"] == pytest.approx(0.6)
    assert p["compute_busy_ms"] == pytest.approx(0.5)
    assert p["gpu_idle_ms"] == pytest.approx(0.5)
    assert p["h2d_ms"] == pytest.approx(0.2) and p["h2d_under_compute_frac"] == pytest.approx(0.5)
    assert p["d2h_ms"] == pytest.approx(0.1) and p["d2h_under_compute_frac"] == pytest.approx(0.0)
    assert p["other_stream_kernels_ms"] == pytest.approx(0.05)
    assert "error" in phase_breakdown({"traceEvents": [_ev("cpu_op", "aten::mm", 0, 10)]})


def test_retry_plan():
    a = bench.parse_args(["--megatrain-mode", "engine"])
    assert [t["micro_batch"] for t in bench.attempts("deepspeed", 16, a)] == [16, 8, 4]
    assert [t["grad_accum"] for t in bench.attempts("fsdp2", 16, a)] == [1, 2, 4]
    assert [t["micro_batch"] for t in bench.attempts("fsdp2", 4, a)] == [4, 2, 1]
    assert [t["micro_batch"] for t in bench.attempts("plain", 16, a)] == [16, 8, 4]
    mt = bench.attempts("megatrain", 16, a)
    assert [t["megatrain_config"]["micro_batch_size"] for t in mt] == [0, 4] and mt[0]["mode"] == "engine"
    assert a.regimes == ["streamed"] and mt[0]["regime"] == "streamed"  # the default: every layer streamed
    assert mt[0]["megatrain_config"]["device_layers"] == 0 and mt[0]["megatrain_config"]["device_step_layers"] == 0
    auto = bench.attempts("megatrain", 16, a, "auto")[0]
    assert auto["regime"] == "auto" and "device_layers" not in auto["megatrain_config"]
    a = bench.parse_args(["--ds-micro", "8", "--ds-prefetch-bucket", "1e8", "--ds-offload-ratio", "0.5",
                          "--megatrain-split", "4", "--megatrain-config", '{"num_slots": 3}'])
    ds = bench.attempts("deepspeed", 16, a)
    assert len(ds) == 1 and ds[0]["grad_accum"] == 2
    assert ds[0]["ds"]["zero_optimization"]["stage3_prefetch_bucket_size"] == 100_000_000
    assert ds[0]["ds"]["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
    assert bench.attempts("megatrain", 16, a)[0]["megatrain_config"] == {
        "torch_compile": True, "num_slots": 3, "device_layers": 0, "device_step_layers": 0, "micro_batch_size": 4}
    a = bench.parse_args(["--plain-micro", "4", "--regime", "auto,streamed"])
    assert [(t["micro_batch"], t["grad_accum"]) for t in bench.attempts("plain", 16, a)] == [(4, 4)]
    assert a.regimes == ["auto", "streamed"]


def test_regime_flag_refuses_contradictions(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--regime", "streamed", "--megatrain-config", '{"device_layers": 2}'])
    assert "device_layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--regime", "planner"])
    a = bench.parse_args(["--regime", "auto", "--megatrain-config", '{"device_layers": 2}'])
    assert bench.attempts("megatrain", 4, a, "auto")[0]["megatrain_config"]["device_layers"] == 2


def test_compare_commits_shares_the_regimes():
    import compare_commits
    from bench.common import REGIMES

    assert compare_commits.REGIMES is REGIMES


def test_deepspeed_config_merge():
    from bench.run_deepspeed import ds_config

    cfg = ds_config({"zero_optimization": {"sub_group_size": 5, "offload_optimizer": {"ratio": 0.3}}})
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["sub_group_size"] == 5
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.3}
    assert z["offload_param"]["pin_memory"] is True and cfg["bf16"]["enabled"] == "auto"


def _rec(system, batch, tps, **kw):
    return {"system": system, "batch": batch, "status": "ok", "tokens_per_s": tps, "step_time_s": 1.0,
            "model_tflops": 1.0, "mfu": 0.1, "micro_batch": batch, "grad_accum": 1, "n_params": 10, **kw}


def test_merge_ratios_and_table(tmp_path):
    path = str(tmp_path / "bench_vs_deepspeed_x.json")
    spec = {"tiny": False, "layers": 8, "seq": 2048, "peak_tflops": 800.0}
    run = {"command": "one", "started": "t0"}
    doc = bench.merge_and_write(path, {"gpu": "X", "date": "d", "versions": {}, "spec": spec, "run": run,
                                       "records": {"new": _rec("megatrain", 4, 6000.0, regime="streamed")}},
                                fresh=True)
    assert doc["ratios"]["4"] == {"streamed": {"ours_tokens_per_s": 6000.0,
                                               "ours_over_best_published_peer": 6000 / 4261}}
    run2 = {"command": "two", "started": "t1"}
    doc = bench.merge_and_write(path, {"gpu": "X", "date": "d", "versions": {}, "spec": spec, "run": run2,
                                       "records": {"deepspeed@4": _rec("deepspeed", 4, 3000.0),
                                                   "fsdp2@4": _rec("fsdp2", 4, 4000.0),
                                                   "fsdp2@16": {"system": "fsdp2", "batch": 16, "status": "error",
                                                                "error": "OutOfMemoryError: boom"}}}, fresh=False)
    assert set(doc["records"]) == {"megatrain:streamed@4", "deepspeed@4", "fsdp2@4", "fsdp2@16"}
    assert doc["ratios"]["4"]["best_peer"] == "fsdp2"
    assert doc["ratios"]["4"]["streamed"]["ours_over_best_peer"] == pytest.approx(1.5)
    # The auto regime beside it (kept apart), against plain; the host AdamW rate and the wait share in the table.
    doc = bench.merge_and_write(path, {"gpu": "X", "date": "d", "versions": {}, "spec": spec, "run": run2, "records": {
        "a": _rec("megatrain", 4, 9000.0, regime="auto", cpu_optimizer={"forward_wait_for_optimizer_s": 0.03},
                  host_adamw={"gparam_per_s": 5.25, "bytes_per_param": 30.0, "gb_per_s": 157.5}),
        "b": _rec("plain", 4, 10000.0)}}, fresh=False)
    assert doc["records"]["megatrain:streamed@4"]["tokens_per_s"] == 6000.0
    assert doc["ratios"]["4"]["auto"]["ours_over_plain"] == pytest.approx(0.9)
    assert doc["ratios"]["4"]["streamed"]["ours_over_plain"] == pytest.approx(0.6)
    assert [r["command"] for r in doc["runs"]] == ["one", "two"]
    doc = bench.merge_and_write(path, {"gpu": "X", "date": "d", "versions": {}, "spec": spec, "run": run2,
                                       "records": {"deepspeed@4": {"system": "deepspeed", "batch": 4,
                                                                   "status": "skipped"}}}, fresh=False)
    assert doc["records"]["deepspeed@4"]["status"] == "ok"  # a run skipped for time keeps the earlier result
    md = open(path[:-5] + ".md").read()
    assert "1.50x FSDP2 CPU offload" in md and "0.90x plain" in md and "OutOfMemoryError" in md and "3,798" in md
    assert "hf_megatrain (streamed)" in md and "hf_megatrain (auto)" in md and "plain HF on the GPU" in md
    assert "| 5.25 | 30.0 | 157.5 |" in md and "0.030 (3.0%)" in md
    # A file from before --regime: its megatrain@4 ran the planner's placement, so it merges as the auto regime.
    doc["records"] = {"megatrain@4": _rec("megatrain", 4, 7000.0, spec={"megatrain_config": {"micro_batch_size": 0}}),
                      "megatrain@16": _rec("megatrain", 16, 8000.0, spec={"megatrain_config": {
                          "device_layers": 0, "device_step_layers": 0}})}
    with open(path, "w") as f:
        json.dump(doc, f)
    doc = bench.merge_and_write(path, {"gpu": "X", "date": "d", "versions": {}, "spec": spec, "run": run2,
                                       "records": {}}, fresh=False)
    assert set(doc["records"]) == {"megatrain:auto@4", "megatrain:streamed@16"}
    with pytest.raises(SystemExit):  # a different model must not be merged into these results
        bench.merge_and_write(path, {"gpu": "X", "date": "d", "versions": {}, "spec": {**spec, "layers": 4},
                                     "run": run, "records": {}}, fresh=False)


def _load(out):
    (name,) = [f for f in os.listdir(out) if f.endswith(".json")]
    with open(os.path.join(out, name)) as f:
        return json.load(f)


@pytest.mark.slow  # subprocess: one benchmark run per batch size
def test_tiny_engine_end_to_end(tmp_path):
    out = str(tmp_path)
    assert bench.main(["--tiny", "--systems", "megatrain", "--megatrain-mode", "engine", "--sizes", "4,8",
                       "--steps", "2", "--warmup", "1", "--out", out, "--megatrain-split", "4", *FAST]) == 0
    doc = _load(out)
    for b in (4, 8):
        r = doc["records"][f"megatrain:streamed@{b}"]
        assert r["status"] == "ok", r.get("error")
        assert r["mode"] == "engine" and r["tokens_per_step"] == b * 64 and len(r["step_times_s"]) == 2
        assert r["tokens_per_s"] > 0 and r["n_params"] > 0 and r["peak_host_rss_gib"] > 0
        assert r["megatrain_config"]["micro_batch_size"] == 4
        assert all(x == x for x in r["losses"])  # finite, not NaN
    assert doc["records"]["megatrain:streamed@8"]["in_layer_split"] == 4
    assert os.path.exists(os.path.join(out, "logs", "megatrain_streamed_b4.log"))
    # the result header (bench/record.py): the machine, and the tree of each call merged into the file
    assert doc["machine"]["cpu_count"] >= 1 and "commit" in doc and doc["runs"][-1]["commit"] == doc["commit"]


@pytest.mark.slow  # subprocess: one benchmark run per system
def test_failed_run_is_recorded_and_the_next_one_goes_on(tmp_path):
    out = str(tmp_path)
    bench.main(["--tiny", "--systems", "megatrain,fsdp2", "--sizes", "4", "--steps", "1", "--warmup", "1",
                "--megatrain-mode", "engine", "--megatrain-config", '{"no_such_key": 1}', "--out", out, *FAST])
    doc = _load(out)
    bad = doc["records"]["megatrain:streamed@4"]
    assert bad["status"] == "error" and "no_such_key" in bad["error"] and bad["attempts_before"] == []
    assert doc["records"]["fsdp2@4"]["status"] == "ok"
    assert "**error**" in open(os.path.join(out, [f for f in os.listdir(out) if f.endswith(".md")][0])).read()


@pytest.mark.slow  # subprocess: a benchmark run
@pytest.mark.skipif(importlib.util.find_spec("hf_megatrain.hf.trainer") is None,
                    reason="hf_megatrain.hf.trainer not written yet")
def test_tiny_trainer_end_to_end(tmp_path):
    out = str(tmp_path)
    bench.main(["--tiny", "--systems", "megatrain", "--megatrain-mode", "trainer", "--sizes", "4", "--steps", "2",
                "--warmup", "1", "--timeline", "--out", out, *FAST])
    r = _load(out)["records"]["megatrain:streamed@4"]
    assert r["status"] == "ok", r.get("error")
    assert r["mode"] == "trainer" and len(r["step_times_s"]) == 2 and r["tokens_per_s"] > 0
    # --timeline: the host spans of each step, the weight slots' wait per unit among them
    assert all("wait" in s["spans_ms"] and "forward" in s["spans_ms"] for s in r["timeline"]["steps"])
    assert all("batch" in s["spans_ms"] and "train_step" in s["spans_ms"] for s in r["timeline"]["steps"][1:])
    assert r["host_adamw"]["gparam_per_s"] > 0 and r["forward_wait_share"] is not None
    assert r["forward_gpu_wait_share"] is None  # (the GPU's idle across the waits: no GPU, nothing measured)


@pytest.mark.slow  # subprocess: one benchmark run per system / regime
def test_tiny_streamed_auto_and_plain_end_to_end(tmp_path):
    out = str(tmp_path)
    assert bench.main(["--tiny", "--systems", "megatrain,plain", "--regime", "streamed,auto", "--sizes", "4",
                       "--megatrain-mode", "engine", "--plain-micro", "2", "--steps", "2", "--warmup", "1",
                       "--out", out, *FAST]) == 0
    doc = _load(out)
    assert set(doc["records"]) == {"megatrain:streamed@4", "megatrain:auto@4", "plain@4"}
    for key, r in doc["records"].items():
        assert r["status"] == "ok", (key, r.get("error"))
        assert r["tokens_per_step"] == 4 * 64 and len(r["step_times_s"]) == 2 and r["tokens_per_s"] > 0
    s, a = doc["records"]["megatrain:streamed@4"], doc["records"]["megatrain:auto@4"]
    assert s["megatrain_config"]["device_layers"] == 0 and s["megatrain_config"]["device_step_layers"] == 0
    assert a["megatrain_config"]["device_layers"] == -1  # the planner decides
    h = s["host_adamw"]
    # bf16 compute copy on the host units: fused kernel 28 B + copy pass (4 + 2), + 4 on the steps that clipped;
    # the compiled kernel 28 + 2 whether or not.
    assert h["gparam_per_s"] > 0
    assert (34.0 <= h["bytes_per_param"] <= 38.0) if h["host_kernel"] == "fused" else h["bytes_per_param"] == 30.0
    assert h["gb_per_s"] == pytest.approx(h["gparam_per_s"] * h["bytes_per_param"])
    assert 0 <= s["forward_wait_share"] < 1
    p = doc["records"]["plain@4"]
    assert (p["micro_batch"], p["grad_accum"]) == (2, 2) and "fused=True" in p["optimizer"]
    assert doc["ratios"]["4"]["auto"]["ours_over_plain"] > 0
    md = open(os.path.join(out, [f for f in os.listdir(out) if f.endswith(".md")][0])).read()
    assert "x plain" in md and "host AdamW G param/s" in md


def test_negative_clip_threshold_is_refused(capsys):


    with pytest.raises(SystemExit):
        bench.parse_args(["--max-grad-norm", "-1"])
    assert "use 0 (no clipping) or a positive threshold" in capsys.readouterr().err


@pytest.mark.slow  # (~17 s each: two runner subprocesses)
@pytest.mark.parametrize("layout,mode", [("padded", "engine"), ("packed", "trainer")])
def test_tiny_finetune_regime_end_to_end(tmp_path, layout, mode):
    """--data finetune (issue 31): variable-length steps of exactly --tokens real tokens, the same for every system;
    hf_megatrain on the config's defaults (no torch_compile forced), clipping at Trainer's default 1.0; rates count
    real tokens, padding reported beside them."""
    assert bench.main(["--tiny", "--data", "finetune", "--layout", layout, "--systems", "megatrain,plain",
                       "--megatrain-mode", mode, "--steps", "2", "--warmup", "1", "--no-profile",
                       "--out", str(tmp_path), "--fresh"] + FAST) == 0
    doc = json.load(open(tmp_path / f"bench_vs_deepspeed_finetune_{layout}_cpu_tiny.json"))
    recs = doc["records"]
    assert set(recs) == {"megatrain:streamed@512", "plain@512"}, recs
    mt, plain = recs["megatrain:streamed@512"], recs["plain@512"]
    assert mt["status"] == "ok" and plain["status"] == "ok", (mt.get("error"), plain.get("error"))
    assert mt["spec"]["max_grad_norm"] == 1.0 and "torch_compile" not in mt["spec"]["megatrain_config"]
    for r in (mt, plain):
        assert r["tokens_per_step"] == 512 and r["real_tokens_per_s"] == r["tokens_per_s"] > 0
        assert r["data"]["layout"] == layout and r["data"]["lengths"]["synthetic"]
        assert len(set(r["data"]["total_tokens_per_step"])) > 1 or layout == "packed"
    assert mt["data"]["total_tokens_per_step"] == plain["data"]["total_tokens_per_step"]  # the same batches
    if layout == "padded":
        assert mt["timed_padding_frac"] > 0 and mt["total_tokens_per_s"] > mt["tokens_per_s"]
    else:
        assert mt["timed_padding_frac"] == 0 and set(mt["data"]["rows_per_step"]) == {8}
    assert "Fine-tune regime" in open(tmp_path / f"bench_vs_deepspeed_finetune_{layout}_cpu_tiny.md").read()


@pytest.mark.slow  # (~20 s: one process, then two through torchrun)
def test_tiny_finetune_two_processes(tmp_path):
    """--nproc 2 with the fine-tune data: each rank trains its own steps of --tokens real tokens (the rates count
    every rank's); the scaling row compares with one process of the same call."""
    assert bench.main(["--tiny", "--data", "finetune", "--layout", "packed", "--systems", "megatrain",
                       "--megatrain-mode", "trainer", "--nproc", "1,2", "--steps", "2", "--warmup", "1",
                       "--no-profile", "--out", str(tmp_path), "--fresh"] + FAST) == 0
    doc = json.load(open(tmp_path / "bench_vs_deepspeed_finetune_packed_cpu_tiny.json"))
    one, two = doc["records"]["megatrain:streamed@512"], doc["records"]["megatrain:streamed@512x2"]
    assert one["status"] == two["status"] == "ok", (one.get("error"), two.get("error"))
    assert (one["tokens_per_step"], two["tokens_per_step"], two["processes"]) == (512, 1024, 2)
    assert [row["key"] for row in doc["scaling"]] == ["megatrain:streamed@512x2"]


def test_finetune_steps_hold_exact_real_tokens():
    from bench.finetune_data import IGNORE, label_items, micro_batches, real_tokens, step_batches

    for layout in ("padded", "packed"):
        spec = {"tokens": 512, "tiny": True, "layout": layout, "vocab_size": 512, "seed": 0}
        steps = step_batches(spec, 6)
        assert all(real_tokens(b) == 512 for b in steps)
        assert [b["input_ids"].shape for b in step_batches(spec, 6)] == [b["input_ids"].shape for b in steps]
        for b in steps:
            parts = micro_batches(b, 2)
            assert sum(label_items(p) for p in parts) <= label_items(b) and sum(real_tokens(p) for p in parts) == 512
        if layout == "packed":  # positions restart at each sequence; its first token predicts nothing
            b = steps[0]
            starts = (b["position_ids"] == 0)
            assert (b["labels"][starts] == IGNORE).all() and "attention_mask" not in b


def test_idle_gaps_places_each_gap_with_its_copies_and_open_host_ranges(tmp_path):
    """integration/idle_gaps.py: a gap between kernels, the host wait open across it, and a copy issued late inside
    it (issued / started / ended relative to the gap); gaps shorter than the threshold are not listed."""
    import gzip

    import idle_gaps

    ev = [{"ph": "X", "cat": "kernel", "name": "k0", "ts": 0, "dur": 1000},
          {"ph": "X", "cat": "kernel", "name": "k1", "ts": 1100, "dur": 900},  # (a 0.1 ms gap: under the threshold)
          {"ph": "X", "cat": "kernel", "name": "k2", "ts": 5000, "dur": 500},  # a 3 ms gap
          {"ph": "X", "cat": "user_annotation", "name": "megatrain.wait_optimizer", "ts": 1500, "dur": 2500},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 4000, "dur": 5, "args": {"correlation": 7}},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 4010, "dur": 990, "args": {"correlation": 7}}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    r = idle_gaps.gaps(idle_gaps.load_events(str(path)), min_ms=0.5)
    assert r["window_ms"] == 5.5 and r["gaps_ms_total"] == 3.0 and len(r["gaps"]) == 1
    g = r["gaps"][0]
    assert (g["at_ms"], g["after"], g["before"], g["host_open"]) == (2.0, "k1", "k2", ["megatrain.wait_optimizer"])
    assert g["copies"] == [{"copy": "Memcpy HtoD", "issued": 2.0, "started": 2.01, "ended": 3.0}]
    assert r["by_host_range"] == {"megatrain.wait_optimizer": 3.0}
