"""MegaTrainPlugin: a custom Accelerate loop matches plain HF + torch AdamW; config comes from env / yaml."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainPlugin
from tests.models import tiny
from tests.parity import reference_optimizer, rel


@pytest.fixture
def fresh_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("MEGATRAIN_"):
            monkeypatch.delenv(k)
    return monkeypatch


def _batches(n, vocab, seed=0, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("tie,ga,clip_in_loop", [(False, 1, True), (True, 2, False)])
def test_accelerate_loop_parity(fresh_accelerate, clean_env, tie, ga, clip_in_loop):
    """model/optimizer/loader/scheduler all through accelerator.prepare; weights within 1e-5 of the reference."""
    from accelerate import Accelerator

    lr, wd, max_norm, steps = 1e-3, 0.1, 1.0, 3
    model = tiny("llama", tie=tie)
    ref = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ga)
    plugin = MegaTrainPlugin({"compute_dtype": "float32"}, device="cpu")
    # Clip either in the optimizer (the recommended way) or with accelerator.clip_grad_norm_ in the loop.
    mt_model, opt = plugin.prepare(model, lr=lr, weight_decay=wd, max_grad_norm=None if clip_in_loop else max_norm)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, 10)
    data = _batches(steps * ga, model.config.vocab_size)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    mt_model, opt_w, loader, sched_w = accelerator.prepare(mt_model, opt, loader, sched)
    assert mt_model.__class__.__name__ == "MegaTrainModel"  # passed through untouched

    ropt = reference_optimizer(ref, lr, wd)
    rsched = transformers.get_linear_schedule_with_warmup(ropt, 1, 10)

    mt_model.train()
    norms = []
    for i, batch in enumerate(loader):
        with accelerator.accumulate(mt_model):
            loss = mt_model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and clip_in_loop:
                norms.append(float(accelerator.clip_grad_norm_(mt_model.parameters(), max_norm)))
            opt_w.step()
            sched_w.step()
            opt_w.zero_grad()
        r = ref(**data[i])
        assert rel(loss.detach(), r.loss.detach()) < 1e-5
        (r.loss / ga).backward()
        if (i + 1) % ga == 0:
            rn = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
            if clip_in_loop:
                assert abs(norms[-1] - rn) <= 1e-5 * rn
            else:
                assert abs(opt.last_grad_norm - rn) <= 1e-5 * rn
            ropt.step()
            rsched.step()
            ropt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(ropt.param_groups[0]["lr"])
    sd = mt_model.state_dict()
    worst = max(rel(sd[n], p.detach()) for n, p in ref.named_parameters() if n in sd)
    assert worst < 1e-5, worst
    moved = max(rel(p.detach(), q.detach()) for p, q in zip(ref.parameters(), tiny("llama", tie=tie).parameters()))
    assert moved > 1e-4  # the weights really trained


def _train_two_steps_and_save(model, path):
    mt_model, opt = MegaTrainPlugin({"compute_dtype": "float32"}, device="cpu").prepare(model, lr=1e-2)
    for b in _batches(2, model.config.vocab_size):
        mt_model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    mt_model.save_pretrained(str(path))
    return mt_model


def test_save_pretrained_roundtrip(clean_env, tmp_path):
    model = tiny("llama", tie=True)
    mt_model = _train_two_steps_and_save(model, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    sd = mt_model.state_dict()
    for n, p in reloaded.named_parameters():
        key = n if n in sd else "model.embed_tokens.weight"  # tied head
        assert torch.equal(p.detach(), sd[key]), n
    b = _batches(1, model.config.vocab_size, seed=5)[0]
    with torch.no_grad():
        assert rel(mt_model(**b).loss, reloaded(**b).loss) < 1e-5


def test_save_pretrained_with_frozen_parts(clean_env, tmp_path):
    model = tiny("llama")
    for n, p in model.named_parameters():
        if n.startswith(("model.embed_tokens", "model.layers.0.")):
            p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    mt_model = _train_two_steps_and_save(model, tmp_path)
    reloaded = dict(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).named_parameters())
    for n, t in frozen.items():
        assert torch.equal(reloaded[n].detach(), t), n
    for n, t in mt_model.engine.named_master_tensors():
        assert torch.equal(reloaded[n].detach(), t), n


def test_parameters_and_forward_like_hf(clean_env):
    model = tiny("llama")
    n = sum(p.numel() for p in model.parameters())
    mt_model, _ = MegaTrainPlugin({"compute_dtype": "float32"}, device="cpu").prepare(model)
    assert sum(p.numel() for p in mt_model.parameters()) == n == mt_model.num_parameters()
    assert mt_model.eval() is mt_model and not mt_model.training
    with torch.no_grad():
        out = mt_model(input_ids=torch.randint(0, 96, (1, 8)), return_logits=True)
    assert out.loss is None and out.logits.shape == (1, 8, 96)
    plugin = MegaTrainPlugin(device="cpu")
    plugin.prepare(tiny("llama"))
    with pytest.raises(RuntimeError, match="already called"):  # one plugin per model
        plugin.prepare(tiny("llama"))


def test_env_filling(clean_env, tmp_path):
    clean_env.setenv("MEGATRAIN_COMPUTE_DTYPE", "float32")
    clean_env.setenv("MEGATRAIN_MICRO_BATCH_SIZE", "2")
    clean_env.setenv("MEGATRAIN_OVERLAP_OPTIMIZER", "false")
    cfg = MegaTrainPlugin().config
    assert (cfg.compute_dtype, cfg.micro_batch_size, cfg.overlap_optimizer) == ("float32", 2, False)

    # A combined launch yaml in MEGATRAIN_CONFIG: its megatrain: section is used, env keys still override.
    y = tmp_path / "combined.yaml"
    y.write_text("distributed_type: 'NO'\nmegatrain:\n  num_slots: 3\n  micro_batch_size: 4\n")
    clean_env.setenv("MEGATRAIN_CONFIG", str(y))
    cfg = MegaTrainPlugin().config
    assert (cfg.num_slots, cfg.micro_batch_size, cfg.compute_dtype) == (3, 2, "float32")

    # An explicit config's keys go over the MEGATRAIN_CONFIG file's, key by key (env keys over both, as in the
    # Trainer): the file is never dropped (issue 47, item 4).
    cfg = MegaTrainPlugin({"loss_chunk_tokens": 64}).config
    assert (cfg.num_slots, cfg.loss_chunk_tokens, cfg.micro_batch_size) == (3, 64, 2)
    cfg = MegaTrainPlugin('{"num_slots": 4}').config
    assert cfg.num_slots == 4
    assert isinstance(MegaTrainPlugin(MegaTrainConfig(num_slots=5)).config, MegaTrainConfig)


def test_unknown_keys_are_errors(clean_env):
    clean_env.setenv("MEGATRAIN_COMPUTE_DTYP", "float32")
    with pytest.raises(ValueError, match="unknown environment variable MEGATRAIN_COMPUTE_DTYP;.*COMPUTE_DTYPE"):
        MegaTrainPlugin()
    clean_env.delenv("MEGATRAIN_COMPUTE_DTYP")
    with pytest.raises(ValueError, match="unknown MegaTrain config keys.*valid keys"):
        MegaTrainPlugin({"slots": 2})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MegaTrainPlugin("/nonexistent/megatrain.yaml")


def test_one_config_resolution(clean_env, tmp_path):
    """The plugin, the Trainer arguments and `megatrain launch` resolve the same inputs to the same config."""
    from hf_megatrain import MegaTrainTrainingArguments, cli
    from hf_megatrain.config import resolve_config

    y = tmp_path / "combined.yaml"
    y.write_text("distributed_type: 'NO'\nmegatrain:\n  num_slots: 3\n  save_dtype: bfloat16\n")
    clean_env.setenv("MEGATRAIN_MICRO_BATCH_SIZE", "2")
    want = resolve_config(str(y))
    assert (want.num_slots, want.save_dtype, want.micro_batch_size) == (3, "bfloat16", 2)
    args = MegaTrainTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[],
                                      megatrain_config=str(y))
    assert MegaTrainPlugin(str(y)).config == args.megatrain_resolved_config() == cli.split_combined(str(y))[1] == want
    clean_env.setenv("MEGATRAIN_CONFIG", str(y))  # no explicit source: the env file, same answer
    assert MegaTrainPlugin().config == resolve_config() == want
    with pytest.raises(ValueError, match="unknown MegaTrain config keys.*optimizer"):  # `optimizer` selects nothing
        resolve_config({"optimizer": "adamw"})
