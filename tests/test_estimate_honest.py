"""``megatrain estimate`` is honest at every figure a user acts on (issue 47, items 2, 3, 5 and 7): the disk tier's
step time counts the disk, the GPU check always runs against the GPU planned for, MLA attention is counted at its
real head dims, and a run that does not fit says what would. Config-only models (config.json in tmp_path, built on
the meta device by the CLI itself), through the console script's entry point ``hf_megatrain.cli.main``."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hf_megatrain import cli
from tests.test_moe_flops import DEEPSEEK_V3

GiB = 2 ** 30


def _model(tmp_path, name: str, **cfg) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _llama(tmp_path, name: str = "llama", **over) -> str:
    return _model(tmp_path, name, **{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, **over})


def _estimate(capsys, *args: str) -> str:
    assert cli.main(["estimate", *args]) == 0
    return capsys.readouterr().out


def _json(capsys, *args: str) -> dict:
    return json.loads(_estimate(capsys, *args, "--json"))


@pytest.fixture
def no_gpu(monkeypatch):
    """The estimate as a machine without a GPU runs it (also where the test machine has one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- item 2: the disk tier's step time counts the disk ---------------------------------------------------------------
def test_disk_tier_step_time_counts_the_disk(tmp_path, capsys, no_gpu):
    """With ``optimizer_state_dir`` the moments are memory-mapped: once the RAM the plan leaves cannot cache them,
    every step reads and writes them at the disk's rate (docs/lean_store.md: 16 B/param through the disk), and the
    estimate's step time is at least that, bound by the disk; while they fit the page cache, the in-RAM rate."""
    model = _llama(tmp_path)
    (tmp_path / "moments").mkdir()
    disk_yaml = tmp_path / "disk.yaml"
    disk_yaml.write_text(f"optimizer_state_dir: {tmp_path / 'moments'}\n")
    ram_yaml = tmp_path / "ram.yaml"  # (the disk tier streams every layer: so does the in-RAM run compared)
    ram_yaml.write_text("device_layers: 0\ndevice_step_layers: 0\n")
    base = [model, "--seq-len", "512", "--gpu-memory", "80", "--disk-gbps", "0.5"]
    in_ram = _json(capsys, *base, "--host-memory", "64", "--config", str(ram_yaml))
    roomy = _json(capsys, *base, "--host-memory", "64", "--config", str(disk_yaml))
    on_disk = roomy["disk"]["AdamW moments while training (optimizer_state_dir)"]
    assert on_disk >= 8 * 4 * (4 * 1024 * 1024)
    # Room for all of the plan but half of the moments in the page cache: they stream through the disk.
    tight_gib = (roomy["host_total"] + on_disk / 2) / 0.9 / GiB
    tight_args = [*base, "--host-memory", f"{tight_gib:.4f}", "--config", str(disk_yaml)]
    tight = _json(capsys, *tight_args)
    assert tight["host_fits"]
    disk_s = 2 * on_disk / 0.5e9  # read + written back per step at --disk-gbps 0.5
    for case in ("no clipping", "clipping on every step"):
        ram_s, cached_s, s = (x["step_time"][case] for x in (in_ram, roomy, tight))
        assert cached_s["step_s"] == pytest.approx(ram_s["step_s"], rel=0.05)  # (page cache: the in-RAM rate)
        assert s["step_s"] >= disk_s > 5 * ram_s["step_s"], (s["step_s"], disk_s, ram_s["step_s"])
        assert s["busy_s"]["disk tier"] == pytest.approx(disk_s, rel=0.01)
        assert s["bottleneck"].startswith("disk tier (optimizer_state_dir")
    assert roomy["disk_tier"]["moments_cached"] is True and tight["disk_tier"]["moments_cached"] is False
    out = _estimate(capsys, *tight_args)
    assert re.search(r"bottleneck: disk tier \(optimizer_state_dir: [\d.,]+ GB of AdamW moments read and written "
                     r"back per step at 0.5 GB/s", out), out
    assert "disk 0.5 GB/s (--disk-gbps)" in out and "every step reads them and writes them back" in out


# -- item 3: the GPU check runs against the planned GPU; "this machine" only when it is this one ----------------------
# deepseek-ai/DeepSeek-V3's layer shapes (tests/test_moe_flops.py) with 4 layers: one MoE layer is 11.5B parameters.
DEEPSEEK_V3_SHAPED = {**DEEPSEEK_V3, "num_hidden_layers": 4, "first_k_dense_replace": 1}


def test_no_gpu_here_is_checked_against_the_planned_gpu(tmp_path, capsys, no_gpu):
    """A DeepSeek-V3 layer does not fit an 80 GiB GPU in two weight slots: with no GPU here the estimate checks
    the 80 GiB H100 it plans for, says the layer is too big and that expert-by-expert streaming is not supported,
    and never says "fits"."""
    model = _model(tmp_path, "dsv3", **DEEPSEEK_V3_SHAPED)
    args = [model, "--seq-len", "4096", "--host-memory", "16000"]  # (RAM enough: the GPU decides)
    data = _json(capsys, *args)
    assert data["host_fits"] and data["gpu_available"] == 80 * GiB and data["gpu_total"] > 150 * GiB
    assert data["gpu_fits"] is False and data["this_machine"] is False
    assert data["would_suffice"]["layer_too_big"] and data["would_suffice"]["layer_floor"] > 80 * GiB
    out = _estimate(capsys, *args)
    assert "fits this machine" not in out and "verdict: fits" not in out
    assert re.search(r"^verdict: does NOT fit a machine with 15\.6 TiB of host RAM available and an 80\.0 GiB GPU "
                     r"\(GPU\)$", out, re.M), out
    assert "(no GPU here: a 80.0 GiB GPU planned, --gpu-memory)" in out or "80.0 GiB GPU planned" in out
    assert re.search(r"one decoder layer \(11\.\d\dB parameters\) needs [\d.]+ GiB of the GPU before any activation "
                     r"\(2 weight slots", out), out
    assert "streaming a MoE layer expert by expert is not supported" in out
    # Named explicitly, the same GPU gives the same answer.
    assert _json(capsys, *args, "--gpu-memory", "80")["gpu_fits"] is False


def test_fits_this_machine_only_when_it_is_this_machine(tmp_path, capsys, monkeypatch):
    """"fits this machine" where the GPU and RAM checked are this machine's own, as detected; a GPU or RAM given on
    the command line (or the default GPU where there is none) names the machine checked instead."""
    import hf_megatrain.planner.cli as planner_cli

    model = _llama(tmp_path, num_hidden_layers=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a 40 GiB GPU, detected)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(planner_cli, "gpu_budget", lambda dev: 40 * GiB)
    monkeypatch.setattr(planner_cli, "available_host_bytes", lambda: 64 * GiB)
    here = [model, "--seq-len", "256"]
    assert re.search(r"^verdict: fits this machine$", _estimate(capsys, *here), re.M)
    assert re.search(r"^verdict: fits a machine with 64\.0 GiB of host RAM available and an 80\.0 GiB GPU$",
                     _estimate(capsys, *here, "--gpu-memory", "80"), re.M)
    assert re.search(r"^verdict: fits a machine with 32\.0 GiB of host RAM available and a 40\.0 GiB GPU$",
                     _estimate(capsys, *here, "--host-memory", "32"), re.M)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = _estimate(capsys, *here)
    assert re.search(r"^verdict: fits a machine with 64\.0 GiB of host RAM available and an 80\.0 GiB GPU$", out,
                     re.M), out


# -- item 5: MLA attention FLOPs at the q/k and v head dims ---------------------------------------------------------
MLA = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": 96,
       "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 24, "vocab_size": 1000,
       "max_position_embeddings": 4096, "tie_word_embeddings": False, "first_k_dense_replace": 1,
       "num_experts_per_tok": 2, "norm_topk_prob": True}
MLA_FAMILIES = {
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 4,
                    "n_shared_experts": 1, "n_group": 1, "topk_group": 1},
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "n_routed_experts": 4,
                    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy"},
}


@pytest.mark.parametrize("family", list(MLA_FAMILIES))
def test_mla_attention_flops_use_its_head_dims(tmp_path, capsys, family, no_gpu):
    """Multi-head latent attention: QK^T runs over qk_nope + qk_rope (48 here; 192 in DeepSeek-V3), AV over
    v_head_dim (24; 128), not over head_dim (the 16-wide RoPE part): 12 x layers x heads x (48 + 24) / 2 x seq."""
    model = _model(tmp_path, family, **MLA, **MLA_FAMILIES[family])
    seq = 2048
    data = _json(capsys, model, "--seq-len", str(seq), "--gpu-memory", "80", "--host-memory", "64")
    heads, layers = MLA["num_attention_heads"], MLA["num_hidden_layers"]
    qk, v = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"], MLA["v_head_dim"]
    flops = data["flops_per_token"]
    assert flops["attention"] == pytest.approx(12 * layers * heads * (qk + v) / 2 * seq)
    assert flops["model"] == pytest.approx(flops["dense_6n"] + flops["attention"])
    assert data["shape"]["q_dim"] == heads * qk  # (q after RoPE: the flash kernel's dq and the saved q)


# -- item 7: a run that does not fit says what would ---------------------------------------------------------------
def test_what_would_suffice_when_nothing_fits(tmp_path, capsys, no_gpu):
    """No exact layout fits the RAM in memory: the estimate lists the RAM (and GPU) each needs, the disk tier with
    its real step time (bound by the disk), and the cheapest change that fits -- here the disk tier."""
    model = _llama(tmp_path, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256)  # (Llama-3-8B's shape)
    args = [model, "--seq-len", "1024", "--gpu-memory", "24", "--host-memory", "64", "--disk-gbps", "2"]
    data = _json(capsys, *args)
    assert not data["host_fits"] and not any(x["fits"] for x in data["host_layouts"])
    s = data["would_suffice"]
    assert [x["name"] for x in s["layouts"]] == [x["name"] for x in data["host_layouts"]]
    for x in s["layouts"]:  # RAM each exact layout needs, moments in RAM: more than this machine's share
        assert x["host_total"] > 0.9 * 64 * GiB and 0 < x["gpu_total"] <= 24 * GiB and not x["host_fits"]
    lean_disk = {x["name"]: x for x in s["disk_tier_layouts"]}["lean"]
    assert lean_disk["fits"] and lean_disk["disk_bytes"] > 0
    assert lean_disk["step_s"] >= 2 * lean_disk["disk_bytes"] / 2e9  # (its real step: the moments cross the disk)
    assert "disk tier" in lean_disk["bottleneck"]
    assert "optimizer_state_dir" in s["cheapest"] and "lean_store=True" in s["cheapest"]
    out = _estimate(capsys, *args)
    section = out[out.index("What would suffice"):]
    assert re.search(r"[\d.]+ B/param  full store\s+RAM\s+[\d.]+ GiB\s+GPU\s+[\d.]+ GiB\s+[\d.,]+ s/step\s+does not "
                     r"fit: RAM", section), section
    assert re.search(r"lean \+ disk tier\s+RAM\s+[\d.]+ GiB\s+GPU\s+[\d.]+ GiB\s+[\d.,]+ s/step, bound by the disk"
                     r"\s+fits", section), section
    assert re.search(r"cheapest change that fits: .*optimizer_state_dir", section)
    assert re.search(r"least hardware that fits \(moments in RAM\): [\d.]+ GiB of host RAM available", section)
    assert "verdict: does NOT fit a machine with 64.0 GiB of host RAM available and a 24.0 GiB GPU (host RAM)" in out
