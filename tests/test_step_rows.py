"""The step-time model's fine-tune rows (planner/finetune_rows.py): what padded and packed batches hold, what each
attention kernel executes over them, and ``megatrain estimate --lengths``."""

from __future__ import annotations

import json
import random

import pytest
import transformers

from hf_megatrain import MegaTrainConfig, planner
from hf_megatrain.planner.finetune_rows import (FLEX_BLOCK, AttentionKernel, BatchRows, Layout, as_the_engine_runs,
                                                attention_flops, default_kernel, sample_steps)


def _kept_blocks_brute(batch: BatchRows) -> int:
    """Blocks holding a pair transformers' masks keep: causal, same sequence (packed), a real key (padded)."""
    kept = 0
    for row in batch.rows:
        doc = [i for i, n in enumerate(row) for _ in range(n)] + [-1] * (batch.width - sum(row))
        blocks = -(-batch.width // FLEX_BLOCK)
        for qb in range(blocks):
            for kb in range(qb + 1):
                kept += any(doc[k] >= 0 and (batch.layout is Layout.PADDED or doc[k] == doc[q])
                            for q in range(qb * FLEX_BLOCK, min((qb + 1) * FLEX_BLOCK, batch.width))
                            for k in range(kb * FLEX_BLOCK, min((kb + 1) * FLEX_BLOCK, q + 1)))
    return kept


def test_flex_prices_the_blocks_its_mask_keeps():
    rng = random.Random(0)
    q_dim = 64
    for _ in range(12):
        packed = BatchRows.packed([rng.randint(1, 300) for _ in range(rng.randint(1, 5))], 512)
        padded = BatchRows.padded([rng.randint(1, 400) for _ in range(3)])
        for b in (packed, padded):
            blocks = attention_flops(q_dim, b, AttentionKernel.FLEX) / (4.0 * q_dim * FLEX_BLOCK ** 2)
            assert blocks == _kept_blocks_brute(b), b


def test_rows_tokens_and_the_other_kernels():
    packed = BatchRows.packed([5000, 3000, 192], 4096)  # 5,000 cut at the row's end, goes on in the next row
    assert packed.rows == ((4096,), (904, 3000, 192)) and packed.width == 4096
    assert packed.real_tokens == packed.total_tokens == 8192
    padded = BatchRows.padded([100, 300, 200])
    assert (padded.width, padded.real_tokens, padded.total_tokens) == (300, 600, 900)
    fixed = BatchRows.fixed(2048, 4)
    # The flash kernel: the causal half of each sequence (the model's 2 * q_dim * S * T); a dense mask: every square.
    assert attention_flops(128, fixed, AttentionKernel.FLASH) == 2.0 * 128 * 2048 * 4 * 2048
    assert attention_flops(128, padded, AttentionKernel.DENSE_MASK) == 3 * 4.0 * 128 * 300 ** 2
    assert attention_flops(128, padded, AttentionKernel.FLEX) < attention_flops(128, padded, AttentionKernel.DENSE_MASK)
    with pytest.raises(ValueError, match="fit width"):
        BatchRows(((10, 10),), 15, Layout.PACKED)


def test_default_kernel_follows_the_engines_choice():
    compiled = MegaTrainConfig(torch_compile=True)
    assert default_kernel(compiled, Layout.FIXED) is AttentionKernel.FLASH
    assert default_kernel(compiled, Layout.PADDED) is AttentionKernel.FLEX
    assert default_kernel(compiled, Layout.PACKED) is AttentionKernel.FLEX
    for other in (MegaTrainConfig(torch_compile=False), MegaTrainConfig(torch_compile=True, masked_attention="model"),
                  MegaTrainConfig(torch_compile=True, micro_batch_size=2)):
        assert default_kernel(other, Layout.PADDED) is AttentionKernel.DENSE_MASK
        assert default_kernel(other, Layout.PACKED) is AttentionKernel.DENSE_MASK


def test_padded_batches_run_as_one_packed_row_where_padding_free_applies():
    padded = BatchRows.padded([100, 300, 200])
    packed = as_the_engine_runs(MegaTrainConfig(torch_compile=True), padded)  # the defaults, layers compiled
    assert packed.layout is Layout.PACKED and packed.rows == ((100, 300, 200),) and packed.total_tokens == 600
    eager = MegaTrainConfig(torch_compile=False)
    assert as_the_engine_runs(eager, padded) == padded  # (packed rows would run the dense mask)
    assert as_the_engine_runs(MegaTrainConfig(torch_compile=False, padding_free="on"), padded).total_tokens == 600
    assert as_the_engine_runs(MegaTrainConfig(torch_compile=True, padding_free="off"), padded) == padded


def test_sampled_steps_lay_out_a_datasets_lengths_as_trainer_does():
    lengths = [random.Random(i).randint(20, 6000) for i in range(2000)]
    packed = sample_steps(lengths, Layout.PACKED, 8, 4096)
    assert all(b.real_tokens == b.total_tokens == 8 * 4096 and b.width == 4096 for b in packed)
    plain = sample_steps(lengths, Layout.PADDED, 8, 4096)
    grouped = sample_steps(lengths, Layout.PADDED, 8, 4096, group_by_length=True)
    assert all(len(b.rows) == 8 and b.width <= 4096 for b in plain + grouped)  # (cut to max_len, as a tokenizer)
    share = [sum(b.real_tokens for b in s) / sum(b.total_tokens for b in s) for s in (plain, grouped)]
    assert share[1] > share[0] + 0.2  # grouping by length removes most of the padding
    assert sample_steps(lengths, Layout.PADDED, 8, 4096) == plain  # (fixed seed: the same estimate every time)
    with pytest.raises(ValueError):
        sample_steps([0, 5], Layout.PADDED, 8, 4096)


def test_estimate_with_a_datasets_lengths(tmp_path, capsys):
    transformers.Qwen2Config(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                             vocab_size=32000, num_hidden_layers=2).save_pretrained(tmp_path)
    rng = random.Random(1)
    as_list = tmp_path / "lengths.json"
    as_list.write_text(json.dumps([rng.randint(50, 3000) for _ in range(500)]))
    as_hist = tmp_path / "hist.json"
    as_hist.write_text(json.dumps({"bin_edges": [16, 512, 2048, 4096], "counts": [60, 30, 10]}))
    as_text = tmp_path / "lengths.txt"
    as_text.write_text("\n".join(str(rng.randint(50, 3000)) for _ in range(100)))
    base = [str(tmp_path), "--seq-len", "4096", "--batch-size", "8", "--device-layers", "0", "--gpu-memory", "80"]
    results = {}
    for path in (as_list, as_hist, as_text):
        for layout in ("padded", "packed"):
            assert planner.main(base + ["--lengths", str(path), "--layout", layout, "--json"]) == 0
            results[path.name, layout] = json.loads(capsys.readouterr().out)
    for (name, layout), r in results.items():
        rows, step = r["fine_tune_rows"], r["step_time"]["clipping on every step"]
        assert rows["layout"] == layout and step["step_s"] > 0
        if layout == "packed":  # 8 rows of 4,096 real tokens, no padding
            assert rows["real_tokens_per_step"] == 8 * 4096 and rows["padding_share"] == 0
        else:
            assert 0 < rows["padding_share"] < 1
        assert step["tokens_per_s"] == pytest.approx(rows["real_tokens_per_step"] / step["step_s"], rel=0.1)
    layouts = {c["layout"].split(" (")[0]: c for c in results["lengths.json", "padded"]["fine_tune_layouts"]}
    assert set(layouts) == {"padded", "padded, group_by_length", "packed"}
    assert layouts["packed"]["padding_share"] == 0
    assert layouts["padded, group_by_length"]["padding_share"] < layouts["padded"]["padding_share"]
    assert planner.main(base + ["--lengths", str(as_list)]) == 0
    out = capsys.readouterr().out
    assert "real tokens per step" in out and "Layouts of these lengths" in out
    for wrong, says in ((["--layout", "packed"], "give --lengths FILE"), (["--group-by-length"], "give --lengths FILE"),
                        (["--lengths", str(as_list), "--layout", "packed", "--group-by-length"],
                         "packed rows have no padding")):
        assert planner.main(base + wrong) == 2
        assert says in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"bin_edges": [1, 2]}))
    assert planner.main(base + ["--lengths", str(bad)]) == 2
    assert "bin_edges" in capsys.readouterr().err
