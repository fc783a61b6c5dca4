"""integration/full_32b_hub.py --hub-checkpoint (issue 46 parts 1 and 5) at tiny width on the CPU: a Hub-layout bf16
checkpoint written shard by shard, loaded as a user loads it (``from_pretrained_streamed``), trained through
``MegaTrainTrainer`` on packed fine-tune rows, exported with ``save_model``, reloaded by plain transformers with the
trained model's logits."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

import full_32b_hub  # noqa: E402
import hub_32b  # noqa: E402


def tiny_spec(folder: str, shard_gb: float = 1e-4) -> dict:
    spec = full_32b_hub.make_spec(full_32b_hub.parse_args(["--hub-checkpoint", folder, "--tiny"]))
    return {**spec, "shard_gb": shard_gb}


def test_written_checkpoint_has_the_hub_layout_and_loads_both_ways(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hf_megatrain import from_pretrained_streamed

    folder = str(tmp_path / "hub")
    spec = tiny_spec(folder)
    rec = hub_32b.run_write(spec)
    shards = hub_32b.shard_paths(folder)
    assert rec["shards"] == len(shards) > 1 and hub_32b.has_checkpoint(folder)
    assert [os.path.basename(p) for p in shards] == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                                                     for k in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / "hub" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == rec["bytes"] == sum(os.path.getsize(p) for p in shards) - sum(
        8 + int.from_bytes(open(p, "rb").read(8), "little") for p in shards)
    names = [n for n, _ in hub_32b.tensor_specs(spec)]
    assert sorted(index["weight_map"]) == sorted(names) and len(names) == 2 * 12 + 3
    # seeded per tensor: the values do not depend on the shard size
    again = str(tmp_path / "one_shard")
    assert hub_32b.run_write({**spec, "hub_dir": again, "shard_gb": 1.0})["shards"] == 1
    with safe_open(os.path.join(folder, index["weight_map"]["model.layers.1.mlp.up_proj.weight"]), "pt") as f:
        up = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    with safe_open(os.path.join(again, "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.1.mlp.up_proj.weight"), up)
    assert up.dtype == torch.bfloat16 and 0.015 < float(up.float().std()) < 0.025
    assert torch.equal(up, hub_32b.random_value("model.layers.1.mlp.up_proj.weight", tuple(up.shape),
                                                torch.device("cpu"), names.index("model.layers.1.mlp.up_proj.weight")))
    # plain transformers: every key found, bf16
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert plain.config.num_hidden_layers == 2 and plain.config.vocab_size == 512
    assert torch.equal(plain.state_dict()["model.layers.1.mlp.up_proj.weight"], up)
    # the user's streamed load: the FP32 master holds the bf16 values exactly; a shallower model takes the first layer
    engine = from_pretrained_streamed(folder, {"compute_dtype": "bfloat16"}, device="cpu", show_progress=False)
    assert torch.equal(dict(engine.model.named_parameters())["model.layers.1.mlp.up_proj.weight"].detach(),
                       up.float())
    over = hub_32b.depth_overrides(folder, 1)
    assert over == {"num_hidden_layers": 1, "layer_types": ["full_attention"]}
    assert not hub_32b.depth_overrides(folder, 2)
    one = from_pretrained_streamed(folder, {"compute_dtype": "bfloat16"}, device="cpu", show_progress=False, **over)
    assert one.num_parameters() < engine.num_parameters() and len(one.layer_units) == 1
    one.model.save_pretrained(str(tmp_path / "one_layer"))  # its export loads in plain transformers
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "one_layer")).config.num_hidden_layers == 1


def test_planner_chooses_a_layout_or_a_depth(tmp_path):
    """The parent's choices at full width on the 512 GiB host (no subprocess run: the planner in this process)."""
    folder = str(tmp_path / "cfg")
    os.makedirs(folder)
    spec = full_32b_hub.make_spec(full_32b_hub.parse_args(["--hub-checkpoint", folder]))
    hub_32b.hf_config(spec).save_pretrained(folder)
    base = {"compute_dtype": "bfloat16", "placement_tokens": 32768}
    # (53 since each process stages its shard of a layer's gradient, not the layer: 52 before)
    assert full_32b_hub.deepest_layers({**spec, "nproc": 4}, base, 499.0, 79.2, shm_free=10 ** 15) == 53
    assert full_32b_hub.deepest_layers({**spec, "nproc": 4}, base, 499.0, 79.2, shm_free=250 * 2 ** 30) < 53
    assert full_32b_hub.deepest_layers({**spec, "nproc": 1}, {**base, "lean_store": True, "lean_grad_plane": "on"},
                                       499.0, 79.2) == 64


@pytest.mark.slow  # four subprocesses: write, the planner's CLI, train, reload
def test_tiny_hub_path_end_to_end(tmp_path):
    hub, out = str(tmp_path / "hub"), str(tmp_path / "out")
    assert full_32b_hub.main(["--hub-checkpoint", hub, "--tiny", "--out", out, "--raw-read", "both"]) == 0
    doc = json.loads((tmp_path / "out" / "full_32b_hub_cpu_tiny_1gpu.json").read_text())
    assert (tmp_path / "out" / "full_32b_hub_cpu_tiny_1gpu.md").exists()
    write, train, reload = doc["write"], doc["train"], doc["reload"]
    for rec in (write, train, reload):
        assert rec["status"] == "ok", rec.get("error")
    assert write["shards"] > 1 and write["bytes"] > 0 and write["write_gb_per_s"] > 0
    assert doc["raw_read"]["bytes"] >= write["bytes"] and doc["raw_read"]["buffered_gb_per_s"] > 0
    assert train["load_s"] > 0 and train["n_params"] == 152128 and train["processes"] == 1
    assert len(train["step_times_s"]) == 2 and len(train["losses"]) == 3 and train["loss_finite"]
    assert train["data"]["layout"] == "packed" and train["tokens_per_step"] == 256
    assert train["megatrain_config"]["save_dtype"] == "bfloat16" and train["export_gb"] > 0
    assert "model.safetensors.index.json" in train["export_files"] or "model.safetensors" in train["export_files"]
    assert reload["logits_match"] and reload["rel_max_diff"] <= hub_32b.LOGIT_TOL
    assert doc["prediction"]["command"].startswith("megatrain estimate") and doc["acceptance"] == {
        "trained": True, "export_reloads_with_matching_logits": True}
    assert not os.path.exists(hub + "_export")  # removed unless --keep-export
    # trained: the export's logits are not the starting checkpoint's
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.bfloat16)
    with torch.no_grad():
        before = start(input_ids=hub_32b.heldout_ids(doc["spec"])).logits.float()
    trained = torch.load(doc["spec"]["logits_path"])
    assert float((before - trained).abs().max()) > 10 * reload["max_abs_diff"] + 1e-3
