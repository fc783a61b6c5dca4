"""Padded training batches as one packed row (``padding_free``, engine/unpad.py): which batches qualify, that the
packed row is the same math as the padded batch in plain HF, the engine's decision, and training through it
against plain HF on the padded batches."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import MegaTrainConfig
from hf_megatrain.engine import unpad

from .models import tiny
from .parity import ROUNDING_TOL, rel, train_batches_against_plain_hf


def _padded(seed: int, lengths: tuple[int, ...] = (9, 16, 5)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(4, 96, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


@pytest.fixture
def ran(monkeypatch) -> list:
    """What each of the engine's calls of ``packed_from_padded`` answered (None: the batch ran padded)."""
    answers: list = []
    real = unpad.packed_from_padded
    monkeypatch.setattr(unpad, "packed_from_padded", lambda *a: answers.append(real(*a)) or answers[-1])
    return answers


def test_a_right_padded_batch_becomes_one_packed_row():
    b = _padded(0, (3, 5, 2))
    p = unpad.packed_from_padded(b["input_ids"], b["attention_mask"], b["labels"], {})
    assert p["input_ids"].shape == (1, 10)
    assert p["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert torch.equal(p["input_ids"][0], b["input_ids"][b["attention_mask"].bool()])
    firsts = p["position_ids"][0] == 0  # each sequence's first label: never a target, padded or packed
    assert (p["labels"][0][firsts] == -100).all()
    assert torch.equal(p["labels"][0][~firsts], b["labels"][b["attention_mask"].bool()][~firsts])
    given = unpad.packed_from_padded(b["input_ids"], b["attention_mask"], None,
                                     {"position_ids": torch.arange(5).expand(3, 5)})
    assert "labels" not in given and torch.equal(given["position_ids"], p["position_ids"])


@pytest.mark.parametrize("what", ["left padding", "a padded label counted", "no padding", "an extra input",
                                  "other positions", "rope sections", "an empty row"])
def test_a_batch_it_would_not_compute_exactly_runs_as_it_came(what):
    b = _padded(1)
    ids, mask, labels, kwargs = b["input_ids"], b["attention_mask"], b["labels"], {}
    if what == "left padding":
        mask = mask.flip(1)
    elif what == "a padded label counted":
        labels = ids.clone()
    elif what == "no padding":
        mask = torch.ones_like(mask)
    elif what == "an extra input":
        kwargs = {"token_type_ids": torch.zeros_like(ids)}
    elif what == "other positions":
        kwargs = {"position_ids": torch.arange(16).expand(3, 16) + 2}
    elif what == "rope sections":
        kwargs = {"position_ids": torch.arange(16).expand(3, 3, 16)}
    else:
        mask[2] = 0
    assert unpad.packed_from_padded(ids, mask, labels, kwargs) is None
    why: list[str] = []
    unpad.packed_from_padded(ids, mask, labels, kwargs, why)
    assert bool(why) == (what != "no padding"), why  # (a batch with padding says why it stays padded)


@pytest.mark.parametrize("num_items", [None, 17])
def test_the_packed_row_is_the_padded_batchs_math_in_plain_hf(num_items):
    """Plain HF (SDPA), float32: the same loss and every gradient, with HF's mean and with Trainer's
    ``num_items_in_batch``."""
    model = tiny("llama")
    twin = copy.deepcopy(model)
    b = _padded(2)
    p = unpad.packed_from_padded(b["input_ids"], b["attention_mask"], b["labels"], {})
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    a = model(**b, use_cache=False, **extra).loss
    c = twin(**p, use_cache=False, **extra).loss
    a.backward()
    c.backward()
    assert rel(c.detach(), a.detach()) < 1e-6
    for (name, x), y in zip(model.named_parameters(), twin.parameters()):
        assert rel(y.grad, x.grad) < 1e-5, name


def test_the_decision():
    head = dict(runs_model=False, unshifted=False, router=False)
    assert unpad.decide("auto", True, **head).on
    off = unpad.decide("auto", False, **head)
    assert not off.on and "dense mask" in off.reason
    assert unpad.decide("on", False, **head).on and not unpad.decide("off", True, **head).on
    assert not unpad.decide("auto", True, **{**head, "router": True}).on
    assert not unpad.decide("auto", True, **head, windowed=True).on and unpad.decide("on", True, **head, windowed=True).on
    assert unpad.windowed_attention(tiny("gemma2").config) and unpad.windowed_attention(tiny("mistral").config) \
        == bool(tiny("mistral").config.sliding_window)
    assert not unpad.windowed_attention(tiny("llama").config)
    with pytest.raises(ValueError, match="padding_free='on' cannot run here: its mask code is not known"):
        unpad.decide("on", False, **head, masks_packed=False)
    with pytest.raises(ValueError, match="padding_free='on' cannot run here: a MoE router"):
        unpad.decide("on", True, **{**head, "router": True})
    with pytest.raises(ValueError, match="padding_free='packed'.*'auto', 'on' or 'off'"):
        MegaTrainConfig(padding_free="packed")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3", "cohere",
                                    "granite", "gptj"])
def test_the_engine_trains_padded_batches_as_packed_rows_like_plain_hf_on_the_padded_ones(family, ran):
    """Across families (sliding windows and soft-capping included): the engine's packed rows against plain HF on
    the padded batches, loss and every updated weight."""
    model = tiny(family)
    if not getattr(model, "_supports_flex_attn", False):
        pytest.skip(f"{family}: padding_free refuses it (its masks are not transformers')")
    cfg = MegaTrainConfig(compute_dtype="float32", padding_free="on", device_layers=0, device_step_layers=0)
    engine, rows = train_batches_against_plain_hf(model, [_padded(3), _padded(4, (7, 2, 12, 12))], cfg,
                                                  device="cpu")
    assert engine.unpadding.on and len(ran) == 2 and all(p is not None for p in ran)
    for r in rows:
        assert r["loss_rel"] < 1e-5 and r["weight_rel"] < ROUNDING_TOL, (family, rows)


@pytest.mark.slow
def test_trl_padded_batches_run_padding_free_like_plain_sfttrainer(tmp_path, ran):
    """TRL's own padded batches (SFTTrainer's collator, Trainer's ``num_items_in_batch``) through
    ``padding_free="on"``: plain SFTTrainer's losses and gradient norms, every batch unpadded."""
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    from hf_megatrain.hf.trl_support import MegaTrainSFTConfig, MegaTrainSFTTrainer

    from .test_trl import logs, sft_dataset, sft_kwargs, tokenizer

    model = tiny("llama")
    ref = SFTTrainer(model=copy.deepcopy(model), args=SFTConfig(**sft_kwargs(tmp_path / "r", eval_strategy="no")),
                     train_dataset=sft_dataset(), processing_class=tokenizer())
    ref.train()
    ours = MegaTrainSFTTrainer(model=copy.deepcopy(model), args=MegaTrainSFTConfig(
        **sft_kwargs(tmp_path / "o", eval_strategy="no"),
        megatrain_config={"compute_dtype": "float32", "padding_free": "on"}),
        train_dataset=sft_dataset(), processing_class=tokenizer())
    ours.train()
    assert ran and all(p is not None for p in ran), "the padded batches did not run as packed rows"
    theirs, mine = logs(ref), logs(ours)
    assert len(theirs) == len(mine) == 4
    for a, b in zip(theirs, mine):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"]), (a, b)


@pytest.mark.slow
def test_a_batch_that_stays_padded_is_said_once(caplog):
    from hf_megatrain import MegaTrainEngine

    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", padding_free="on"), device="cpu")
    left = _padded(5)
    left["attention_mask"] = left["attention_mask"].flip(1)
    left["labels"] = left["input_ids"].masked_fill(left["attention_mask"] == 0, -100)
    with caplog.at_level("WARNING", logger="hf_megatrain"):
        for _ in range(2):
            engine(**left).loss.backward()
    said = [r.getMessage() for r in caplog.records if "padding_free" in r.getMessage()]
    assert len(said) == 1 and "padding_side='right'" in said[0], said

