"""One block used at several depths (Zamba2's shared transformer, model/shared_blocks.py), against plain HF +
torch.optim.AdamW (tests/parity.py: 3 clipped AdamW steps, gradient accumulation 2, weight decay):

- every shared parameter has one FP32 master (in the resident unit, under its first name) and one gradient, the sum
  over its uses; loss, every gradient and every weight match, with and without the per-use adapters
  (``use_shared_attention_adapter``), one block or two (``num_mem_blocks``), whole and split visits;
- a frozen shared block (fine-tuning the rest) stays put and the rest matches;
- ``save_pretrained`` of the converted model writes the checkpoint HF's own ``save_pretrained`` writes (the block
  once), plain ``from_pretrained`` loads the trained weights, and ``named_parameters`` / ``state_dict`` present the
  plain model's names; ``from_pretrained_streamed`` loads one (Zamba v1: the shared block first in its layers).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

from .parity import random_batches, reference_optimizer, rel, run_parity

HYBRID, MAMBA = "hybrid", "linear_attention"


def tiny_zamba2(layer_types: list[str], num_mem_blocks: int = 1, adapter: bool = True) -> transformers.PreTrainedModel:
    """A tiny Zamba2 whose shared transformer block(s) serve every ``hybrid`` layer (block ``k % num_mem_blocks``
    at the k-th hybrid layer); with ``adapter`` each use adds its own LoRA-like q/k/v adapters."""
    cfg = transformers.Zamba2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=4, n_mamba_heads=4, mamba_d_state=4, chunk_size=4, layers_block_type=layer_types,
        num_mem_blocks=num_mem_blocks, use_shared_attention_adapter=adapter, adapter_rank=4,
        max_position_embeddings=64, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    return transformers.Zamba2ForCausalLM(cfg).float()


def _uses(model: transformers.PreTrainedModel) -> int:
    """The most layers any one parameter is held by."""
    seen: dict[int, set[int]] = {}
    for i, layer in enumerate(model.model.layers):
        for p in layer.parameters():
            seen.setdefault(id(p), set()).add(i)
    return max(len(v) for v in seen.values())


@pytest.mark.parametrize("layer_types, blocks, adapter", [
    ([HYBRID, MAMBA, HYBRID, MAMBA], 1, True),  # one block at two depths, per-use adapters
    pytest.param([HYBRID, HYBRID, MAMBA, HYBRID, HYBRID], 2, False,  # two blocks, each at two depths
                 marks=pytest.mark.slow),
])
def test_shared_block_trains_with_parity(layer_types, blocks, adapter):
    model = tiny_zamba2(layer_types, blocks, adapter)
    assert _uses(model) >= 2
    worst, engine, _ = run_parity(model)
    store = engine.store
    q = "shared_transformer.self_attn.q_proj.weight"
    assert store.by_name[f"model.layers.0.{q}"][0] is engine.resident_unit  # resident
    assert sum(n.endswith(q) for n in store.names()) == blocks  # one master per block, not per use


@pytest.mark.slow
def test_shared_block_split_visits_and_speculation():
    """Micro-batches inside each visit (the shared parameters are one leaf for all chunks) and the step's last
    backward marked (speculative host updates of the layer units beside the resident one)."""
    cfg = MegaTrainConfig(compute_dtype="float32", micro_batch_size=1)
    run_parity(tiny_zamba2([HYBRID, MAMBA, HYBRID], 1, True), config=cfg, split_in_layer=True)
    run_parity(tiny_zamba2([HYBRID, MAMBA, HYBRID], 1, True), ga=1, batch=4, max_grad_norm=1e6,
               config=MegaTrainConfig(compute_dtype="float32"), final_backward=True)


def test_frozen_shared_block_stays_and_the_rest_matches():
    model = tiny_zamba2([HYBRID, MAMBA, HYBRID], 1, True)
    for n, p in model.named_parameters():
        if "shared_transformer" in n:
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    engine = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    opt = engine.create_optimizer(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
    ropt = reference_optimizer(ref, 1e-3, 0.1)
    for micro in random_batches(2, 2, 2, 12, 96, seed=0):
        n_items = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)
        for ids, lab in micro:
            a = ref(input_ids=ids, labels=lab, num_items_in_batch=torch.tensor(n_items)).loss
            b = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items).loss
            a.backward()
            b.backward()
            assert rel(b.detach(), a.detach()) <= 1e-6
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.wait()
        opt.zero_grad()
    for n, p in ref.named_parameters():
        ours = engine.store.master_tensor(n) if p.requires_grad else engine.frozen_resident[n].detach()
        assert rel(ours, p.detach()) <= 1e-5, n
    assert torch.equal(engine.frozen_resident["model.layers.0.shared_transformer.self_attn.q_proj.weight"],
                       model.model.layers[0].shared_transformer.self_attn.q_proj.weight)


def _keys(folder: str) -> set[str]:
    out: set[str] = set()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as fh:
                out |= set(fh.keys())
    return out


def test_trained_shared_block_saves_the_standard_checkpoint(tmp_path):
    model = tiny_zamba2([HYBRID, MAMBA, HYBRID, MAMBA], 1, True)
    _, engine, ref = run_parity(model, steps=1)
    plain_dir, ours_dir = str(tmp_path / "plain"), str(tmp_path / "ours")
    ref.save_pretrained(plain_dir)
    engine.model.save_pretrained(ours_dir)
    assert _keys(ours_dir) == _keys(plain_dir)  # the shared block once, under layer 0's names
    loaded = transformers.Zamba2ForCausalLM.from_pretrained(ours_dir)
    layer2 = loaded.model.layers[2].shared_transformer.self_attn.q_proj.weight
    assert layer2 is loaded.model.layers[0].shared_transformer.self_attn.q_proj.weight  # tied back
    for n, p in loaded.named_parameters():
        assert rel(p.detach(), engine.store.master_tensor(n)) == 0.0, n
    assert [n for n, _ in engine.model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in engine.model.named_parameters(remove_duplicate=False)] == \
        [n for n, _ in ref.named_parameters(remove_duplicate=False)]
    assert set(engine.model.state_dict()) == set(ref.state_dict())  # each use's name, as torch lists tied ones


def test_streamed_load_of_a_shared_block_listed_first(tmp_path):
    """Zamba (v1) registers the shared block first in each hybrid layer: ``from_pretrained_streamed`` (meta skeleton,
    the shared parameters materialised as resident ones) fills every master from the checkpoint and the loss is plain
    transformers' loss."""
    from hf_megatrain import from_pretrained_streamed

    cfg = transformers.ZambaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, attention_hidden_size=64,
                                   attention_head_dim=16, n_mamba_heads=2, mamba_d_state=4, use_cache=False,
                                   max_position_embeddings=64, layers_block_type=[HYBRID, MAMBA, HYBRID])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.ZambaForCausalLM(cfg).float()
    assert _uses(model) == 2 and next(model.model.layers[0].parameters()) is \
        next(model.model.layers[2].parameters())  # (the shared block first)
    model.save_pretrained(str(tmp_path))
    engine = from_pretrained_streamed(str(tmp_path), MegaTrainConfig(compute_dtype="float32"), device="cpu",
                                      attn_implementation="eager")
    for n, p in model.named_parameters():
        assert torch.equal(engine.store.master_tensor(n), p.detach()), n
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    model.eval()
    engine.model.eval()
    assert rel(engine(input_ids=ids, labels=ids).loss.detach(), model(input_ids=ids, labels=ids).loss.detach()) <= 1e-6
