"""MoE checkpoints as transformers' own ``save_pretrained`` writes them (legacy per-expert keys, renamed modules)
loaded by ``from_pretrained_streamed`` through transformers' conversion mapping, one target tensor at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain import checkpoint as ckpt
from hf_megatrain.hf.pretrained import from_pretrained_streamed

from .models import tiny
from .parity import random_batches, reference_optimizer, rel
from .test_checkpoint import REPO, clean_env

FP32 = MegaTrainConfig(compute_dtype="float32")
MOE = ["mixtral", "qwen3_moe", "gpt_oss"]


def _save(model, path, **kw) -> str:
    model.save_pretrained(path, **kw)
    return str(path)


def _assert_masters_equal(engine, model):
    for n, p in model.named_parameters():
        assert torch.equal(engine.store.master_tensor(n), p.detach()), n


@pytest.mark.parametrize("family", MOE)
def test_save_pretrained_moe_loads_streamed(tmp_path, family):
    model = tiny(family)
    path = _save(model, tmp_path / "hf", max_shard_size="20KB")  # experts of one layer spread over shards
    engine = from_pretrained_streamed(path, FP32, device="cpu")
    _assert_masters_equal(engine, model)
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_masters_equal(engine, plain)


def test_legacy_expert_keys_are_what_transformers_writes(tmp_path):
    """Guard for the test above: the checkpoint really is in the per-expert layout (else it tests nothing)."""
    path = _save(tiny("mixtral"), tmp_path / "hf")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)


def test_expert_order_is_numeric(tmp_path):
    """12 experts: expert 10 must be stacked after expert 9, not after expert 1."""
    model = tiny("mixtral", num_local_experts=12)
    engine = from_pretrained_streamed(_save(model, tmp_path / "hf"), FP32, device="cpu")
    _assert_masters_equal(engine, model)


def test_own_export_with_in_memory_names_still_loads(tmp_path):
    """Exports now take transformers' save layout (test_hub_layout.py); a folder in the in-memory layout (earlier
    hf_megatrain exports, save_pretrained(save_original_format=False)) still loads."""
    model = tiny("qwen3_moe")
    engine = MegaTrainEngine(tiny("qwen3_moe"), FP32, device="cpu")
    os.makedirs(tmp_path / "mt")
    save_file({n: t.contiguous() for n, t in engine.named_master_tensors()}, str(tmp_path / "mt" / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path / "mt")
    with safe_open(str(tmp_path / "mt" / "model.safetensors"), "pt") as f:
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())  # fused, in-memory names
    loaded = from_pretrained_streamed(str(tmp_path / "mt"), FP32, device="cpu")
    _assert_masters_equal(loaded, model)


def test_missing_expert_refuses_before_loading(tmp_path):
    path = _save(tiny("mixtral"), tmp_path / "hf")
    file = os.path.join(path, "model.safetensors")
    with safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.block_sparse_moe.experts.3.w2.weight"}
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ckpt.CheckpointError, match="down_proj"):
        from_pretrained_streamed(path, FP32, device="cpu")


def test_missing_fused_source_lacks_parameter(tmp_path):
    """All of one converter's sources gone: the target is reported missing, as for any parameter."""
    path = _save(tiny("qwen3_moe"), tmp_path / "hf")
    file = os.path.join(path, "model.safetensors")
    with safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "layers.0.mlp.experts" not in k}
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ckpt.CheckpointError, match="lacks 2 parameters"):
        from_pretrained_streamed(path, FP32, device="cpu")


@pytest.mark.parametrize("family", MOE)
def test_training_from_converted_checkpoint_matches_plain(tmp_path, family):
    """Two AdamW steps from the same save_pretrained checkpoint: streamed engine vs plain transformers."""
    path = _save(tiny(family), tmp_path / "hf")
    engine = from_pretrained_streamed(path, FP32, device="cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.train()
    engine.model.train()
    lr, wd = 1e-3, 0.1
    opt = engine.create_optimizer(lr=lr, weight_decay=wd, max_grad_norm=1.0)
    ropt = reference_optimizer(ref, lr, wd)
    for micro in random_batches(2, 1, 2, 12, ref.config.vocab_size, seed=0):
        (ids, lab), = micro
        ref_loss = ref(input_ids=ids, labels=lab).loss
        ref_loss.backward()
        loss = engine(input_ids=ids, labels=lab).loss
        loss.backward()
        engine.finish_backward()
        assert rel(loss.detach(), ref_loss.detach()) <= 1e-5
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.wait()
        opt.zero_grad()
        for n, p in ref.named_parameters():
            ours = engine.store.master_tensor(n)
            assert float((ours - p.detach()).abs().max()) <= 1e-3 * lr or rel(ours, p.detach()) <= 1e-5, n


RSS_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    import torch
    from hf_megatrain import MegaTrainConfig
    from hf_megatrain.hf.pretrained import from_pretrained_streamed

    def hwm():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    base = hwm()
    engine = from_pretrained_streamed(sys.argv[1], MegaTrainConfig(compute_dtype="float32"), device="cpu")
    peak = hwm()
    inter = engine.model.config.intermediate_size
    w = engine.store.master_tensor("model.layers.3.mlp.experts.gate_up_proj")[5, :inter]
    print(json.dumps({{"base": base, "peak": peak, "store": engine.store.nbytes, "probe": float(w.double().sum())}}))
""")


@pytest.mark.slow  # subprocess: peak RSS measured in a child process
def test_legacy_moe_load_peak_rss(tmp_path):
    """Per-expert checkpoint converted on load: peak RSS stays <= 1.15 x the host store (no second copy)."""
    cfg = transformers.MixtralConfig(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_hidden_layers=8,
                                     num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
                                     max_position_embeddings=64)
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = transformers.MixtralForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    items, probe = [], None
    for n, p in skeleton.named_parameters():
        if ".mlp.experts." in n:
            continue
        items.append((n.replace(".mlp.gate.", ".block_sparse_moe.gate."), torch.randn(p.shape, generator=g) * 0.02))
    for i in range(cfg.num_hidden_layers):
        for e in range(cfg.num_local_experts):
            for w, shape in (("w1", (1024, 1024)), ("w2", (1024, 1024)), ("w3", (1024, 1024))):
                t = torch.randn(shape, generator=g) * 0.02
                items.append((f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight", t))
                if (i, e, w) == (3, 5, "w1"):
                    probe = float(t.double().sum())
    ckpt.save_weights(str(tmp_path), items, dtype=torch.float32, max_shard_size="200MB")
    del items
    r = subprocess.run([sys.executable, "-c", RSS_CHILD.format(repo=REPO), str(tmp_path)], env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["probe"] == probe
    print(f"peak RSS {res['peak'] / 2**30:.2f} GiB, store {res['store'] / 2**30:.2f} GiB")
    assert res["peak"] <= 1.15 * res["store"], res


# -- every load path: the Trainer's resume / best-model loads too -------------------------------------------------------
def _qwen2_moe() -> transformers.PreTrainedModel:
    from .models import COMMON

    cfg = transformers.Qwen2MoeConfig(**{**COMMON, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
                                         "decoder_sparse_step": 1, "output_router_logits": True,
                                         "router_aux_loss_coef": 0.02})
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(cfg).float()


MOE_BUILDERS = {"mixtral": lambda: tiny("mixtral"), "qwen2_moe": _qwen2_moe}


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen2_moe"])  # (fast tier: one)
def test_trainer_resumes_from_plain_trainer_moe_checkpoint(tmp_path, family):
    """A checkpoint of plain transformers' Trainer (save_pretrained: per-expert keys on disk) resumed by
    MegaTrainTrainer: the weights are the checkpoint's, converted as from_pretrained converts them."""
    from .test_trainer import common_args, dataset, mt_args
    from hf_megatrain import MegaTrainTrainer

    kw = dict(max_steps=1, save_strategy="steps", save_steps=1)
    plain = transformers.Trainer(model=MOE_BUILDERS[family](), args=transformers.TrainingArguments(
        **common_args(tmp_path / "plain", **kw)), train_dataset=dataset())
    plain.train()
    ck = tmp_path / "plain" / "checkpoint-1"
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # the per-expert layout (else this tests nothing)
    ours = MegaTrainTrainer(model=MOE_BUILDERS[family](), args=mt_args(tmp_path / "mt", **kw),
                            train_dataset=dataset())
    ours.train(resume_from_checkpoint=str(ck))  # (at max_steps already: loads, trains no further step)
    _assert_masters_equal(ours.engine, transformers.AutoModelForCausalLM.from_pretrained(str(ck),
                                                                                       dtype=torch.float32))


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_trainer_exact_resume_moe(tmp_path):
    """MegaTrainTrainer's own MoE checkpoint (fused in-memory names) resumed: bit for bit as uninterrupted."""
    from .test_trainer import dataset, losses, mt_args
    from hf_megatrain import MegaTrainTrainer

    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    full = MegaTrainTrainer(model=_qwen2_moe(), args=mt_args(tmp_path / "a", **kw), train_dataset=dataset())
    full.train()
    resumed = MegaTrainTrainer(model=_qwen2_moe(), args=mt_args(tmp_path / "b", **kw), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert losses(full) == losses(resumed)
    full.engine.optimizer.wait()
    resumed.engine.optimizer.wait()
    for n in full.engine.store.names():
        assert torch.equal(full.engine.store.master_tensor(n), resumed.engine.store.master_tensor(n)), n


def test_checkpoint_of_a_class_no_auto_class_maps_loads_streamed(tmp_path):
    """``MllamaForCausalLM.save_pretrained`` writes its text config (``mllama_text_model``), which
    ``AutoModelForCausalLM`` does not map; the class named in ``architectures`` builds the skeleton, as plain
    ``MllamaForCausalLM.from_pretrained`` would."""
    cfg = transformers.MllamaTextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[],
                                        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.MllamaForCausalLM(cfg).float()
    path = _save(model, tmp_path / "hf")
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForCausalLM.from_pretrained(path)
    engine = from_pretrained_streamed(path, FP32, device="cpu")
    assert type(engine.model).__name__ == "MllamaForCausalLM"
    _assert_masters_equal(engine, model)
