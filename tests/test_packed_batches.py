"""Packed / padding-free batches (``DataCollatorWithFlattening``, TRL's ``padding_free``): several sequences in one row,
``position_ids`` restarting at each, no attention mask. transformers builds a block-causal mask from the positions,
so no token attends across a boundary and no padding is computed. Through the streamed layers: exact against plain
HF on the same packed batch (loss, every gradient, every updated weight), and equal to the sequences run one by one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

from .models import tiny
from .parity import reference_optimizer, rel


def _packed(lengths: tuple[int, ...], seed: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, 96, (n,), generator=g) for n in lengths]
    batch = DataCollatorWithFlattening()([{"input_ids": s.tolist(), "labels": s.tolist()} for s in seqs])
    return batch, seqs


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_packed_batch_trains_like_plain_hf(family):
    model = tiny(family)
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
    ropt = reference_optimizer(ref, 1e-3, 0.1)
    for step, lengths in enumerate([(5, 9, 7), (11, 3, 6, 4)]):
        batch, seqs = _packed(lengths, seed=step)
        # use_cache=False: with a cache, transformers skips the packed-sequence mask (a training forward has none)
        out = ref(**batch, use_cache=False)
        out.loss.backward()
        loss = engine(**batch).loss
        loss.backward()
        engine.finish_backward()
        assert rel(loss.detach(), out.loss.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            unit, ps = engine.store.by_name[n]
            assert rel(unit.view(opt.grad_of(unit), ps), p.grad) <= 1e-5, n
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.wait()
        opt.zero_grad()
        for n, p in ref.named_parameters():
            assert rel(engine.store.master_tensor(n), p.detach()) <= 1e-5, n


def test_packed_batch_respects_sequence_boundaries():
    model = tiny("llama")
    engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    batch, seqs = _packed((5, 9, 7), seed=0)
    n_items = sum(len(s) - 1 for s in seqs)
    with torch.no_grad():
        packed = engine(**batch).loss
        one_by_one = sum(model(input_ids=s[None], labels=s[None], num_items_in_batch=torch.tensor(n_items)).loss
                         for s in seqs)
    assert rel(packed, one_by_one) <= 1e-5


@pytest.mark.parametrize("opts", [{"padding_free": True, "max_length": None},
                                  pytest.param({"packing": True, "max_length": 24}, marks=pytest.mark.slow)],
                         ids=["padding_free", "packing"])
def test_trl_padding_free_and_packing_match_plain_sfttrainer(tmp_path, opts):
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    from hf_megatrain.hf.trl_support import MegaTrainSFTConfig, MegaTrainSFTTrainer

    from .test_trl import logs, sft_dataset, sft_kwargs, tokenizer

    model = tiny("llama")
    ref = SFTTrainer(model=copy.deepcopy(model), args=SFTConfig(**sft_kwargs(tmp_path / "r", eval_strategy="no"),
                                                                **opts),
                     train_dataset=sft_dataset(), processing_class=tokenizer())
    ref.train()
    ours = MegaTrainSFTTrainer(model=copy.deepcopy(model), args=MegaTrainSFTConfig(
        **sft_kwargs(tmp_path / "o", eval_strategy="no"), **opts, megatrain_config={"compute_dtype": "float32"}),
        train_dataset=sft_dataset(), processing_class=tokenizer())
    ours.train()
    theirs, mine = logs(ref), logs(ours)
    assert len(theirs) == len(mine) == 4
    for a, b in zip(theirs, mine):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"]), (a, b)
