"""CPU smoke test of the DPO benchmark harness (integration/bench_dpo.py): the plumbing only.

DeepSpeed needs CUDA and is not run here: its runner must leave an error record, not a crash. hf_megatrain's runner
trains a tiny Qwen2 with MegaTrainDPOTrainer in a subprocess exactly as on the GPU (slow); the pairs, the tokenizer,
the retry plan, the merge and the table are checked directly.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

import bench_dpo  # noqa: E402
from bench import run_dpo_common as dpo  # noqa: E402

SPEC = {"tiny": True, "prompt_len": 16, "completion_len": 48, "pairs": 2, "warmup": 1, "steps": 2, "seed": 0}


def test_pairs_tokenize_back_to_exact_lengths():
    tok, data = dpo.tokenizer(SPEC), dpo.pair_dataset(SPEC)
    assert len(data) == dpo.total_pairs(SPEC) == 6
    assert tok("t15 t30 t11 <eos>")["input_ids"] == [15, 30, 11, tok.eos_token_id]  # no special token splits a word
    for row in data:
        prompt = tok(row["prompt"])["input_ids"]
        for key in ("chosen", "rejected"):
            full = tok(row["prompt"] + row[key])["input_ids"]
            assert len(prompt) == 16 and len(full) == 64 and full[:16] == prompt
            assert full[-1] == tok.eos_token_id and dpo.UNK not in full
    assert data[0]["chosen"] != data[0]["rejected"]
    assert dpo.pair_dataset(SPEC)[3] == data[3]  # the same pairs for every system


def test_plan_and_defaults():
    a = bench_dpo.parse_args([])
    assert (a.pair_list, a.prompt_len, a.completion_len, a.layers) == ([4, 8], 512, 1536, 8)
    assert [t["micro_pairs"] for t in bench_dpo.attempts("deepspeed", 8, a)] == [8, 4, 2]
    assert [t["grad_accum"] for t in bench_dpo.attempts("megatrain", 4, a)] == [1, 2, 4]
    assert bench_dpo.attempts("megatrain", 4, a)[0]["regime"] == "streamed"
    t = bench_dpo.parse_args(["--tiny", "--micro", "1"])
    assert (t.pair_list, t.prompt_len + t.completion_len, t.layers) == ([2], 64, 2)
    assert [x["grad_accum"] for x in bench_dpo.attempts("megatrain", 2, t)] == [2]
    with pytest.raises(SystemExit):
        bench_dpo.parse_args(["--systems", "megatrain,fsdp2"])


def test_merge_ratios_and_table(tmp_path):
    path = str(tmp_path / "bench_dpo_x.json")
    ok = dict(status="ok", tokens_per_step=32768, micro_pairs=8, grad_accum=1, step_time_s=2.0, pairs_per_s=4.0,
              model_tflops=100.0, mfu=0.125, ref_precompute_s=10.0, ref_precompute_tokens_per_s=1e4,
              peak_gpu_reserved_gib=40.0, peak_host_rss_gib=60.0, losses=[0.69, 0.6])
    head = {"gpu": "H100", "date": "now", "versions": {},
            "spec": {"tiny": False, "layers": 8, "prompt_len": 512, "completion_len": 1536, "max_grad_norm": 1.0,
                     "peak_tflops": 800.0}}
    run = {"command": "python integration/bench_dpo.py --pairs 8", "started": "t0"}
    bench_dpo.merge_and_write(path, {**head, "run": run, "records": [
        {"system": "megatrain", "pairs": 8, "tokens_per_s": 16384.0, **ok}]}, fresh=True)
    doc = bench_dpo.merge_and_write(path, {**head, "run": run, "records": [
        {"system": "deepspeed", "pairs": 8, "tokens_per_s": 8192.0, **ok},
        {"system": "deepspeed", "pairs": 4, "status": "error", "error": "RuntimeError: boom\nmore"}]}, fresh=False)
    assert sorted(doc["records"]) == ["deepspeed@4", "deepspeed@8", "megatrain@8"]
    assert doc["ratios"] == {"8": {"megatrain_over_deepspeed": 2.0}} and len(doc["runs"]) == 1
    md = open(path[:-5] + ".md").read()
    assert "error: RuntimeError: boom |" in md and "0.6900→0.6000" in md and "2.00x" in md
    assert "python integration/bench_dpo.py --pairs 8" in md


@pytest.mark.slow  # subprocesses: a tiny DPO run per system (~15 s)
def test_tiny_end_to_end_and_missing_deepspeed_is_a_record(tmp_path):
    out = tmp_path / "out"
    assert bench_dpo.main(["--tiny", "--out", str(out), "--warmup", "1", "--steps", "2",
                           "--env", "OMP_WAIT_POLICY=PASSIVE"]) == 0
    doc = json.loads((out / "bench_dpo_cpu_tiny.json").read_text())
    ours = doc["records"]["megatrain@2"]
    assert ours["status"] == "ok", ours.get("error")
    assert ours["tokens_per_step"] == 2 * 2 * 64 and len(ours["step_times_s"]) == 2
    assert ours["ref_precompute_calls"] == 1 and ours["ref_precompute_tokens"] == 3 * 2 * 2 * 64
    assert ours["megatrain_config"]["device_layers"] == 0 and ours["megatrain_config"]["device_step_layers"] == 0
    assert "rewards/margins" in ours["last_log"] and len(ours["losses"]) == 3
    ds = doc["records"]["deepspeed@2"]
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        assert ds["status"] == "error" and "deepspeed is not importable" in ds["error"]
    assert "bench_dpo.main(" in doc["runs"][0]["command"]
