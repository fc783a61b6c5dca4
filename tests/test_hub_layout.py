"""Exports are written in the layout transformers' own ``save_pretrained`` writes (checkpoint/hub_layout.py): for
MoE families transformers keeps fused experts in memory but writes one tensor per expert (and Mixtral's
``block_sparse_moe`` names) to disk, which is what serving stacks read. Compared key by key and tensor by tensor."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors import safe_open

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.export.weights import export_model
from hf_megatrain.hf.pretrained import from_pretrained_streamed

from .models import tiny

FP32 = MegaTrainConfig(compute_dtype="float32")


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as s:
                out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "llama"])
def test_export_matches_save_pretrained_key_by_key(family, tmp_path):
    model = tiny(family)
    model.save_pretrained(tmp_path / "plain")
    engine = MegaTrainEngine(model, FP32, device="cpu")
    export_model(engine, str(tmp_path / "ours"), dtype=torch.float32)
    want, got = _tensors(tmp_path / "plain"), _tensors(tmp_path / "ours")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_hub_layout_export_loads_back_exactly(family, tmp_path):
    """Plain from_pretrained and from_pretrained_streamed both read the per-expert files back into the fused
    in-memory tensors, bit for bit."""
    model = tiny(family)
    engine = MegaTrainEngine(model, FP32, device="cpu")
    export_model(engine, str(tmp_path / "ours"), dtype=torch.float32)
    ref = dict(engine.named_master_tensors())
    plain = getattr(transformers, type(model).__name__).from_pretrained(tmp_path / "ours", dtype=torch.float32)
    for n, p in plain.named_parameters():
        assert torch.equal(p, ref[n]), n
    again = from_pretrained_streamed(str(tmp_path / "ours"), FP32, device="cpu")
    for n, t in again.named_master_tensors():
        assert torch.equal(t, ref[n]), n


def test_merged_lora_export_matches_peft_merge_and_save(tmp_path):
    """The merged export of a LoRA MoE is what PEFT's merge_and_unload + save_pretrained write: the Hub layout,
    every key, the values to rounding of the merge."""
    from peft import LoraConfig, get_peft_model

    from hf_megatrain.export.peft_support import save_merged

    def wrapped():
        torch.manual_seed(0)
        return get_peft_model(tiny("mixtral"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))

    engine = MegaTrainEngine(wrapped(), FP32, device="cpu")
    save_merged(engine, str(tmp_path / "ours"))
    wrapped().merge_and_unload().save_pretrained(tmp_path / "plain")
    want, got = _tensors(tmp_path / "plain"), _tensors(tmp_path / "ours")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6), k
