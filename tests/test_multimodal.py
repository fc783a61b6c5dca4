"""Multimodal models' language models: ``...ForConditionalGeneration`` trained exactly like plain transformers.

The decoder layers stream, the vision tower and projector are resident (trainable, or frozen with
``requires_grad_(False)``), and the model's own forward runs (model/multimodal.py). The referee is plain transformers
+ ``torch.optim.AdamW`` on the same batches -- text-only and image+text steps in one run -- comparing the loss, every
gradient, the clipped gradient norm and every updated weight over 3 steps with clipping and weight decay.

Rounding: a weight more than ``tol`` from the fp32 referee still passes when it is no further from a float64 run
than twice the fp32 referee is (rounding that Adam amplified in elements with tiny gradients: ``tests/parity.py``'s
rule); a parameter whose gradient the float64 run shows to be zero (a vision attention ``k_proj.bias``: softmax is
shift-invariant) is moved by Adam out of pure rounding noise in both fp32 runs and is checked to move less than one
Adam step per element per step, not against the referee.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.hf.pretrained import from_pretrained_streamed
from tests.multimodal_models import FAMILIES, multimodal_batch, tiny_multimodal
from tests.parity import reference_optimizer, rel

LR, WD, MAX_NORM = 1e-3, 0.1, 1.0
IMAGE_TEXT_IMAGE = (True, False, True)  # the 3 steps: image+text, text only, image+text


def _double(kw: dict) -> dict:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _plain_works(model, batch) -> str | None:
    """None, or why plain transformers itself cannot run ``model``'s forward (no referee)."""
    ids, labels, kw = batch
    try:
        with torch.no_grad():
            copy.deepcopy(model)(input_ids=ids, labels=labels, **kw)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def train_both(model, family: str, steps=IMAGE_TEXT_IMAGE, *, config: MegaTrainConfig | None = None, tol=1e-5):
    """Train ``model`` with hf_megatrain and with plain transformers; assert they match (module docstring).
    Returns the worst relative errors (``weight_raw``: before the float64 rule) and the engine."""
    ref, ref64, ours = copy.deepcopy(model), copy.deepcopy(model).double(), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, config or MegaTrainConfig(compute_dtype="float32"), device="cpu")
    opt = engine.create_optimizer(lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
    ropt, ropt64 = reference_optimizer(ref, LR, WD), reference_optimizer(ref64, LR, WD)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    worst = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0, "weight": 0.0, "weight_raw": 0.0}
    null: set[str] = set()
    for step, image in enumerate(steps):
        ids, labels, kw = multimodal_batch(family, step, image)
        n_items = int((labels[:, 1:] != -100).sum())
        r = ref(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(n_items), **kw)
        r.loss.backward()
        if ref64 is not None:
            try:
                ref64(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(n_items),
                      **_double(kw)).loss.backward()
            except RuntimeError:  # (a kernel without float64, e.g. MoE grouped matmuls): no float64 referee
                ref64 = ropt64 = None
        loss = engine(input_ids=ids, labels=labels, num_items_in_batch=n_items, **kw).loss
        loss.backward()
        worst["loss"] = max(worst["loss"], rel(loss.detach(), r.loss.detach()))
        engine.finish_backward()
        # Null gradients: zero in the float64 run (else: below 1e-6 of the fp32 total, as tests/parity.py)
        judge = ref64 if ref64 is not None else ref
        g64 = dict(judge.named_parameters())
        total64 = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in judge.parameters() if p.grad is not None))
        null_rel = 1e-9 if ref64 is not None else 1e-6
        for n, p in trainable(ref):
            unit, ps = engine.store.by_name[n]
            if p.grad is None:  # not in this step's graph (a text-only step's vision tower): skipped by AdamW
                assert unit.grad is None or float(unit.view(unit.grad, ps).abs().max()) == 0.0, n
                continue
            if float(g64[n].grad.norm()) <= null_rel * float(total64):  # a true zero gradient: rounding noise only
                null.add(n)
                continue
            worst["grad"] = max(worst["grad"], rel(unit.view(opt.grad_of(unit), ps), p.grad))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        if ref64 is not None:
            torch.nn.utils.clip_grad_norm_(ref64.parameters(), MAX_NORM)
            ropt64.step()
            ropt64.zero_grad()
        ropt.step(), opt.step()
        opt.wait()
        ropt.zero_grad(), opt.zero_grad()
        worst["grad_norm"] = max(worst["grad_norm"], abs(opt.last_grad_norm - ref_norm) / ref_norm)
        for n, p in trainable(ref):
            w = engine.store.master_tensor(n)
            if n in null:  # at most one Adam step (lr, plus decay) per element per step away from the start
                assert float((w - before[n]).abs().max()) <= (step + 1) * 1.01 * LR * (1 + float(before[n].abs().max())), n
                continue
            err = rel(w, p.detach())
            worst["weight_raw"] = max(worst["weight_raw"], err)
            if err > tol and ref64 is not None:
                w64 = g64[n].detach().float()
                if rel(w, w64) <= 2 * rel(p.detach(), w64) + tol:
                    err = 0.0
            worst["weight"] = max(worst["weight"], err)
    for k in ("loss", "grad", "grad_norm", "weight"):
        assert worst[k] <= tol, f"{family}: {k} mismatch {worst[k]:.3e} > {tol:.0e} ({worst})"
    return worst, engine


REQUIRED = ["gemma3", "qwen2_5_vl", "mistral3", "llama4"]
OTHERS = [f for f in FAMILIES if f not in REQUIRED]


def _parity(family: str, freeze_vision: bool = False) -> dict:
    model = tiny_multimodal(family)
    why = _plain_works(model, multimodal_batch(family, 0, True))
    if why is not None:
        pytest.skip(f"plain transformers {transformers.__version__} cannot run {type(model).__name__}'s forward "
                    f"itself (no referee): {why}")
    if freeze_vision:
        for n, p in model.named_parameters():
            if "language_model" not in n and "lm_head" not in n:
                p.requires_grad_(False)
    worst, engine = train_both(model, family)
    print(f"{family}: {worst}")
    return worst


@pytest.mark.parametrize("family", REQUIRED)
def test_conditional_generation_parity_text_and_image_steps(family):
    """Vision tower and projector trained (resident), decoder layers streamed: exact on image+text and text
    steps (a text-only step leaves the tower without a gradient: not stepped, as torch's AdamW)."""
    _parity(family)


@pytest.mark.parametrize("family", OTHERS)
def test_other_conditional_generation_parity(family):
    _parity(family)


def test_frozen_vision_tower_parity_and_no_masters():
    """Vision tower and projector frozen by the user: no FP32 master or optimizer state for them, exact training
    of the rest on image+text batches."""
    model = tiny_multimodal("qwen2_5_vl")
    for n, p in model.named_parameters():
        if n.startswith("model.visual."):
            p.requires_grad_(False)
    worst, engine = train_both(model, "qwen2_5_vl")
    assert not [n for n in engine.store.by_name if n.startswith("model.visual.")]
    frozen = {n: t for n, t in engine.named_frozen_tensors() if n.startswith("model.visual.")}
    assert frozen and all(torch.equal(t, model.get_parameter(n)) for n, t in frozen.items())
    assert engine.stack.path == "model.language_model.layers"


def test_save_pretrained_writes_the_whole_multimodal_checkpoint(tmp_path):
    """After training, ``save_pretrained`` writes every tensor (tower, projector, layers, head) that plain
    ``from_pretrained`` of the same class loads, with the trained values; ``from_pretrained_streamed`` loads it
    back into an engine that computes the same image+text loss."""
    model = tiny_multimodal("gemma3")
    _, engine = train_both(model, "gemma3", steps=(True,))
    engine.model.save_pretrained(str(tmp_path))
    plain, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    masters = dict(engine.named_master_tensors())
    for n, p in plain.named_parameters():
        assert n in masters and torch.equal(p.detach(), masters[n]), n
    ids, labels, kw = multimodal_batch("gemma3", 5, True)
    plain.config._attn_implementation = "eager"
    for k in plain.config.sub_configs:
        getattr(plain.config, k)._attn_implementation = "eager"
    want = plain(input_ids=ids, labels=labels, **kw).loss
    back = from_pretrained_streamed(str(tmp_path), MegaTrainConfig(compute_dtype="float32"), device="cpu",
                                    attn_implementation="eager")
    got = back(input_ids=ids, labels=labels, **kw).loss
    assert type(back.model) is transformers.Gemma3ForConditionalGeneration
    assert rel(got.detach(), want.detach()) <= 1e-6


def test_hf_forward_and_generate_of_the_converted_model():
    """The converted model's own forward (what ``generate`` and evaluation loops call) gives plain transformers'
    logits on an image+text batch, and ``generate`` the same tokens."""
    model = tiny_multimodal("qwen2_5_vl")
    plain, ours = copy.deepcopy(model).eval(), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    engine.model.eval()
    ids, _, kw = multimodal_batch("qwen2_5_vl", 0, True, batch=1)
    with torch.no_grad():
        assert rel(engine.model(input_ids=ids, **kw).logits, plain(input_ids=ids, **kw).logits) <= 1e-6
        out = engine.model.generate(input_ids=ids, **kw, max_new_tokens=4, do_sample=False)
        want = plain.generate(input_ids=ids, **kw, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, want)


def test_lm_head_input_not_aligned_with_labels_is_refused():
    """Labels that do not pair one-to-one with the sequence the model hands lm_head are refused, naming the shapes
    (the shifted loss would pair hidden states with the wrong tokens)."""
    engine = MegaTrainEngine(tiny_multimodal("mistral3"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    ids, labels, kw = multimodal_batch("mistral3", 0, True)
    with pytest.raises(RuntimeError, match=r"lm_head an input of shape \(2, 16, 32\).*labels \(2, 15\)"):
        engine(input_ids=ids, labels=labels[:, 1:], **kw)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_in_layer_batch_split_parity(family):
    """``micro_batch_size``: the language model's per-layer-type mask dict (Gemma 3) and M-RoPE position ids
    ``[sections, batch, seq]`` (Qwen-VL) are cut per sequence (engine/batch_rows.py's probe grows them too)."""
    train_both(tiny_multimodal(family), family, config=MegaTrainConfig(compute_dtype="float32", micro_batch_size=1))


def test_in_layer_batch_split_refused_where_the_probe_cannot_decide():
    """Qwen3-VL's deepstack features are per image, not per sequence: the probe cannot re-run the language model on
    one more sequence, and the split is refused with the way out instead of guessing."""
    engine = MegaTrainEngine(tiny_multimodal("qwen3_vl"), MegaTrainConfig(compute_dtype="float32", micro_batch_size=1),
                             device="cpu")
    ids, labels, kw = multimodal_batch("qwen3_vl", 0, True)
    with pytest.raises(RuntimeError, match="micro_batch_size=0"):
        engine(input_ids=ids, labels=labels, **kw)


def test_head_extras_only_where_the_multimodal_forward_applies_them():
    """Gemma 3's text config may set ``final_logit_softcapping``; ``Gemma3ForCausalLM`` applies it, the multimodal
    ``Gemma3ForConditionalGeneration.forward`` does not: training matches plain transformers either way."""
    model = tiny_multimodal("gemma3")
    model.config.text_config.final_logit_softcapping = 0.1  # would bend tiny logits, were it applied
    worst, engine = train_both(model, "gemma3", steps=(True, False))
    assert engine.head_extras.softcap is None


def test_lora_on_the_language_model():
    """``get_peft_model`` over a multimodal model (LoRA on the language model's attention, the rest frozen): the
    model's own forward runs under the PEFT wrapper; loss and every adapter gradient as plain PEFT."""
    peft = pytest.importorskip("peft")
    model = tiny_multimodal("qwen2_5_vl")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)", lora_dropout=0.0)
    ref = peft.get_peft_model(copy.deepcopy(model), cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)  # (B starts at zero: give the adapters a trained-like value)
    ours = copy.deepcopy(ref)
    engine = MegaTrainEngine(ours, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    opt = engine.create_optimizer(lr=LR)
    ids, labels, kw = multimodal_batch("qwen2_5_vl", 0, True)
    want = ref(input_ids=ids, labels=labels, **kw).loss
    want.backward()
    got = engine(input_ids=ids, labels=labels, **kw).loss
    got.backward()
    engine.finish_backward()
    assert rel(got.detach(), want.detach()) <= 1e-6
    lora = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    assert lora and sorted(engine.store.by_name) == sorted(n for n, _ in lora)
    for n, p in lora:
        unit, ps = engine.store.by_name[n]
        assert rel(unit.view(opt.grad_of(unit), ps), p.grad) <= 1e-5, n


def test_trainer_parity_on_image_text_rows(tmp_path):
    """MegaTrainTrainer vs plain ``transformers.Trainer`` on rows holding an image (``pixel_values``,
    ``token_type_ids``: the default collator stacks them), gradient accumulation 2, clipping, decay, a schedule."""
    from hf_megatrain import MegaTrainTrainer
    from tests.test_trainer import common_args, losses, mt_args

    rows = []
    for i in range(12):
        ids, labels, kw = multimodal_batch("gemma3", i, True, batch=1)
        rows.append({"input_ids": ids[0], "labels": labels[0], **{k: v[0] for k, v in kw.items()}})
    model = tiny_multimodal("gemma3")
    ref = transformers.Trainer(model=copy.deepcopy(model), train_dataset=rows,
                               args=transformers.TrainingArguments(**common_args(tmp_path / "ref")))
    ref.train()
    ours = MegaTrainTrainer(model=copy.deepcopy(model), args=mt_args(tmp_path / "mt"), train_dataset=rows)
    ours.train()
    ref_log, our_log = losses(ref), losses(ours)
    assert [s for s, _, _ in our_log] == [1, 2, 3]
    for (s, rl, rg), (_, ol, og) in zip(ref_log, our_log):
        assert abs(ol - rl) <= 1e-5 * abs(rl), (s, ol, rl)
        assert abs(og - rg) <= 1e-5 * abs(rg), (s, og, rg)
    ours.engine.optimizer.wait()
    for n, p in ref.model.named_parameters():
        assert rel(ours.engine.store.master_tensor(n), p.detach()) <= 1e-5 or n.endswith("k_proj.bias"), n
