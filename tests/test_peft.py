"""PEFT/LoRA on a streamed base and frozen parameters (CPU, fp32 unless stated).

Parity: plain ``peft`` + torch AdamW vs hf_megatrain on the same LoRA model, 3 steps, GA 2, clipping, weight decay:
loss, adapter gradients and adapter weights within 1e-5 relative, base untouched. Memory: the frozen base costs
its compute-dtype copy only (2 host bytes per parameter in bf16). Exports: the adapter folder loads with
``PeftModel.from_pretrained``, the merged checkpoint with plain ``from_pretrained``; both give our logits.
Dropout: the recompute replays the forward's RNG, so attention and LoRA dropout gradients are exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, MegaTrainTrainer, MegaTrainTrainingArguments
from hf_megatrain.engine import default_decay_names
from hf_megatrain.export.peft_support import save_adapter, save_merged

from .models import tiny
from .parity import random_batches, rel

FP32 = MegaTrainConfig(compute_dtype="float32")
TARGETS = ["q_proj", "v_proj", "up_proj"]


def lora(model, dropout=0.0, targets=TARGETS):
    torch.manual_seed(7)  # init_lora_weights=False: random A *and* B, so every adapter gets a gradient at step 1
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout,
                                            init_lora_weights=False))


def ref_optimizer(model, lr, wd):
    decay = default_decay_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": wd},
                              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=lr)


def train_parity(model, *, steps=3, ga=2, lr=1e-3, wd=0.1, clip=1.0, config=FP32, seed_forward=False):
    """Train copies of ``model`` (trainable = requires_grad) with plain torch and with the engine; compare."""
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    ref.train()
    ours.train()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = MegaTrainEngine(ours, config, device="cpu")
    opt = engine.create_optimizer(lr=lr, weight_decay=wd, max_grad_norm=clip)
    ropt = ref_optimizer(ref, lr, wd)
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert sorted(engine.store.names()) == sorted(trainable)  # only trainable parameters get a master
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    for step, micro in enumerate(random_batches(steps, ga, 2, 12, 96, seed=0)):
        n_items = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)
        for k, (ids, lab) in enumerate(micro):
            if seed_forward:
                torch.manual_seed(100 * step + k)
            rl = ref(input_ids=ids, labels=lab, num_items_in_batch=torch.tensor(n_items)).loss
            rl.backward()
            if seed_forward:
                torch.manual_seed(100 * step + k)
            loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items).loss
            loss.backward()
            worst["loss"] = max(worst["loss"], rel(loss.detach(), rl.detach()))
        engine.finish_backward()
        for n in trainable:
            unit, ps = engine.store.by_name[n]
            worst["grad"] = max(worst["grad"], rel(unit.view(unit.grad, ps), ref.get_parameter(n).grad))
        ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.wait()
        worst["norm"] = max(worst.get("norm", 0.0), abs(opt.last_grad_norm / float(ref_norm) - 1))
        for n in trainable:
            worst["weight"] = max(worst["weight"], rel(engine.store.master_tensor(n), ref.get_parameter(n).detach()))
    for n, t in engine.named_frozen_tensors():  # the base never moves
        assert torch.equal(t.cpu(), frozen_before[n]), n
    assert set(dict(engine.named_frozen_tensors())) == set(frozen_before)
    return worst, engine, ref


# -- LoRA parity -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_parity_with_plain_peft(family):
    worst, engine, ref = train_parity(lora(tiny(family)))
    print(f"lora parity {family}: {worst}")
    assert max(worst.values()) <= 1e-5, worst
    assert all(u.frozen is not None for u in engine.layer_units)
    assert engine.store.numel == sum(p.numel() for n, p in ref.named_parameters() if "lora_" in n)


def test_frozen_embeddings_and_layer_match_plain_hf():
    """Non-PEFT: frozen embeddings (no master) and a fully frozen middle layer that still passes gradients."""
    model = tiny("llama", num_hidden_layers=4)
    model.get_input_embeddings().requires_grad_(False)
    model.model.layers[1].requires_grad_(False)
    worst, engine, _ = train_parity(model)
    assert max(worst.values()) <= 1e-5, worst
    assert "model.embed_tokens.weight" not in engine.store.names()
    assert engine.layer_units[1].numel == 0 and engine.layer_units[1].frozen_numel > 0
    assert len(engine.executor.templates) == 2  # trainable and frozen layers bind differently


def test_first_layer_frozen_skips_its_recompute():
    model = tiny("qwen2")
    model.get_input_embeddings().requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    worst, engine, _ = train_parity(model, steps=2)
    assert max(worst.values()) <= 1e-5, worst


# -- memory ------------------------------------------------------------------------------------------------------------
def test_host_bytes_per_base_parameter_bf16():
    engine = MegaTrainEngine(lora(tiny("llama")), MegaTrainConfig(compute_dtype="bfloat16",
                                                                  resident_placement="host"), device="cpu")
    store = engine.store
    streamed_base = sum(u.frozen_numel for u in engine.layer_units)
    assert store.frozen_numel == streamed_base > 0
    assert store.frozen_nbytes / streamed_base == 2.0  # pinned bf16 copy only: no master, grad or AdamW state
    assert store.nbytes - store.frozen_nbytes == 18 * store.numel  # adapters: the full trainable layout
    assert all(u.exp_avg.numel() == u.numel for u in store.units)
    # Resident base parts (embeddings, lm_head, norm) stay on the device in compute dtype, not in the store.
    assert all(p.dtype == torch.bfloat16 for p in engine.frozen_resident.values())


# -- exports -----------------------------------------------------------------------------------------------------------
def _trained_engine(family="llama", steps=2):
    model = lora(tiny(family))
    engine = MegaTrainEngine(model, FP32, device="cpu")
    opt = engine.create_optimizer(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    for micro in random_batches(steps, 1, 2, 12, 96, seed=3):
        ids, lab = micro[0]
        engine(input_ids=ids, labels=lab).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.wait()
    return engine


def _our_logits(engine, ids):
    engine.model.eval()
    with torch.no_grad():
        return engine(input_ids=ids, return_logits=True).logits


def test_adapter_loads_with_peft_from_pretrained(tmp_path):
    engine = _trained_engine()
    files = save_adapter(engine, str(tmp_path))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(files)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    loaded = PeftModel.from_pretrained(tiny("llama"), str(tmp_path)).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits
    assert rel(_our_logits(engine, ids), theirs) <= 1e-6


def test_merged_checkpoint_loads_with_plain_from_pretrained(tmp_path):
    engine = _trained_engine("qwen2")
    save_merged(engine, str(tmp_path), max_shard_size="20KB")  # several shards + index
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = merged(input_ids=ids).logits
    assert rel(_our_logits(engine, ids), theirs) <= 1e-5


def test_lora_on_lm_head_is_refused():
    with pytest.raises(ValueError, match="lm_head"):
        MegaTrainEngine(lora(tiny("llama"), targets=["q_proj", "lm_head"]), FP32, device="cpu")


# -- dropout: exact recompute ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("peft_on", [True, False])
def test_dropout_gradients_exact(peft_on):
    model = tiny("llama", attention_dropout=0.1, attn_implementation="eager")
    model = lora(model, dropout=0.1) if peft_on else model
    worst, engine, _ = train_parity(model, steps=2, seed_forward=True)
    assert all(t.stochastic for t in engine.executor.templates)
    assert max(worst.values()) <= 1e-5, worst


def test_dropout_replay_is_what_makes_it_exact(monkeypatch):
    """Control: without the RNG replay the recompute draws other masks and the gradients are wrong."""
    from hf_megatrain.model import template

    monkeypatch.setattr(template, "is_stochastic", lambda module: False)  # (no layer keeps its RNG state to replay)
    model = lora(tiny("llama", attention_dropout=0.1, attn_implementation="eager"), dropout=0.1)
    worst, _, _ = train_parity(model, steps=1, seed_forward=True)
    assert worst["grad"] > 1e-2


def test_router_jitter_recompute():
    """Mixtral's router jitter scales its input in place with fresh noise: replayed exactly."""
    model = tiny("mixtral", router_jitter_noise=0.1)
    worst, engine, _ = train_parity(model, steps=1, seed_forward=True)
    assert engine.executor.templates[0].stochastic
    assert max(worst.values()) <= 1e-5, worst


# -- Trainer -----------------------------------------------------------------------------------------------------------
def _dataset(n=8):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 96, (12,), generator=g)), "labels": ids.clone()} for _ in range(n)]


def _kw(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
              learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, report_to=[], use_cpu=True,
              save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    kw.update(over)
    return kw


def _args(out, **over):
    return MegaTrainTrainingArguments(**_kw(out, **over), megatrain_config={"compute_dtype": "float32"})


def test_trainer_with_peft_model_matches_plain_trainer_and_saves_adapter(tmp_path):
    model = lora(tiny("llama"))
    ref = transformers.Trainer(model=copy.deepcopy(model), args=transformers.TrainingArguments(
        **_kw(tmp_path / "r", logging_steps=1)), train_dataset=_dataset())
    ref.train()
    trainer = MegaTrainTrainer(model=model, args=_args(tmp_path / "mt", logging_steps=1), train_dataset=_dataset())
    trainer.train()
    ref_loss = [h["loss"] for h in ref.state.log_history if "loss" in h]
    our_loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(our_loss) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(our_loss, ref_loss))
    trainer.save_model(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(tiny("llama"), str(tmp_path / "adapter"))
    for n, p in ref.model.named_parameters():
        if p.requires_grad:
            assert rel(loaded.get_parameter(n), p.detach()) <= 1e-5, n
    trainer.save_merged_model(str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())  # adapters folded into the base weights
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = merged(input_ids=ids).logits
    assert rel(_our_logits(trainer.engine, ids), theirs) <= 1e-5


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_trainer_peft_checkpoint_resume(tmp_path):
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    full = MegaTrainTrainer(model=lora(tiny("llama")), args=_args(tmp_path / "a", **args), train_dataset=_dataset())
    full.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    resumed = MegaTrainTrainer(model=lora(tiny("llama")), args=_args(tmp_path / "b", **args),
                               train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(ckpt))
    full.engine.optimizer.wait()
    resumed.engine.optimizer.wait()
    for n, t in full.engine.named_master_tensors():
        assert torch.equal(t, resumed.engine.store.master_tensor(n)), n


def test_get_peft_model_after_conversion_is_refused_clearly(tmp_path):
    """Wrapping an already converted model: PEFT finds no layer modules, and hf_megatrain says what to do."""
    trainer = MegaTrainTrainer(model=tiny("llama"), args=_args(tmp_path), train_dataset=_dataset())
    with pytest.raises(ValueError):
        get_peft_model(trainer.model, LoraConfig(r=4, target_modules=TARGETS))  # PEFT: targets not found
    wrapped = get_peft_model(trainer.model, LoraConfig(r=4, target_modules=["embed_tokens"]))
    with pytest.raises(ValueError, match=r"before\* handing it"):
        MegaTrainTrainer(model=wrapped, args=_args(tmp_path), train_dataset=_dataset())


# -- Accelerate plugin -------------------------------------------------------------------------------------------------
def test_plugin_with_peft_model(tmp_path):
    from hf_megatrain import MegaTrainPlugin

    model, opt = MegaTrainPlugin({"compute_dtype": "float32"}, device="cpu").prepare(
        lora(tiny("llama")), lr=1e-2, max_grad_norm=1.0)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all("lora_" in n for n, _ in model.named_parameters())
    model.save_pretrained(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(tiny("llama"), str(tmp_path / "adapter")).eval()
    model.save_merged(str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        ours = _our_logits(model.engine, ids)
        assert rel(ours, loaded(input_ids=ids).logits) <= 1e-6
        assert rel(ours, merged(input_ids=ids).logits) <= 1e-5


def test_trainer_saves_frozen_layer_weights(tmp_path):
    """Non-PEFT save: frozen streamed weights (store-only, compute dtype) are part of the standard checkpoint."""
    model = tiny("llama")
    model.model.layers[1].requires_grad_(False)
    want = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = MegaTrainTrainer(model=model, args=_args(tmp_path), train_dataset=_dataset())
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for n, t in want.items():
        assert torch.equal(loaded.get_parameter(n), t), n
    for n, t in trainer.engine.named_master_tensors():
        assert torch.equal(loaded.get_parameter(n), t), n


def test_lora_bf16_compute_trains():
    """bf16 streaming: adapters stream as bf16 copies of their FP32 masters, the base as its bf16 copy."""
    model = lora(tiny("llama"))
    ref_loss = float(copy.deepcopy(model)(input_ids=(ids := torch.randint(0, 96, (2, 12))), labels=ids).loss.detach())
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="bfloat16"), device="cpu")
    opt = engine.create_optimizer(lr=1e-2)
    losses = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    opt.wait()
    assert abs(losses[0] - ref_loss) <= 2e-2 * ref_loss and losses[-1] < losses[0]
    assert all(m.dtype == torch.float32 for _, m in engine.named_master_tensors())


def test_set_peft_model_state_dict_loads_adapters_into_streamed_layers():
    """PEFT's own loader on a converted model: it cannot see the tuner layers inside streamed layers, so it hands
    load_state_dict keys without the adapter name; they still reach the adapters' FP32 masters."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    model = lora(tiny("llama"))
    ref = copy.deepcopy(model)
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"))
    sd = {k: v + 1.0 for k, v in get_peft_model_state_dict(ref).items()}
    res = set_peft_model_state_dict(model, sd)
    assert res.unexpected_keys == []
    names = [n for n in engine.store.names() if "lora_" in n]
    assert names and all(torch.equal(engine.store.master_tensor(n), sd[n.replace(".default.", ".")]) for n in names)


def test_lora_and_frozen_layers_with_saved_graphs():
    """Kept forward graphs (``saved_graph_layers``) over LoRA layers (their frozen base streams in the same slot and
    is copied with the weights) and over a fully frozen layer that only passes gradients through."""
    cfg = MegaTrainConfig(compute_dtype="float32", saved_graph_layers=2)
    worst, engine, _ = train_parity(lora(tiny("llama")), config=cfg)
    assert max(worst.values()) <= 1e-5, worst
    model = tiny("llama", num_hidden_layers=3)
    model.model.layers[2].requires_grad_(False)
    worst, engine, _ = train_parity(model, config=cfg)
    assert max(worst.values()) <= 1e-5, worst
    assert engine.executor.graph_layers == frozenset({1, 2})
