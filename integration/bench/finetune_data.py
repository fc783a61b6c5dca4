"""The fine-tune regime's data (issue 31): variable-length sequences, a fixed number of REAL tokens per step.

Lengths are drawn from the histogram in ``sft_lengths.json`` (its ``provenance`` says what it is: today a synthetic
log-normal fit, median 600 tokens, tail to 4,096), a bin by its count, then a length uniform in the bin. A step takes
sequences until it holds exactly ``tokens`` real tokens (the last one cut to fit, its rest
starting the next step), so every system and layout trains
the same tokens per step however they are laid out. Token ids are random from a fixed seed: the same steps, the same
sequences, in the same order, for every system of a run.

Two layouts, as Hugging Face users get them:

* ``padded``: one row per sequence, padded (id 0, ``attention_mask`` 0, label -100) to the step's longest, as
  ``DataCollatorWithPadding`` / ``DataCollatorForSeq2Seq`` make them. Sequences are grouped by length first, as
  Trainer's ``group_by_length=True`` (``LengthGroupedSampler``) does: a pool of ``GROUP_STEPS`` steps' sequences is
  sorted by length and dealt out in order, then the steps are shuffled. Without it one 4k sequence pads the ~40
  others of a 32k-token step to 4k (5x the compute); with it the padding share is reported (``padding_frac``).
* ``packed``: no padding at all. The step's sequences are concatenated and cut into rows of ``row_tokens`` (the
  longest allowed sequence), ``position_ids`` restarting at every sequence (a sequence cut at a row's end goes on in
  the next row with its positions continuing), no ``attention_mask``, label -100 on each sequence's first token:
  ``DataCollatorWithFlattening`` / TRL ``padding_free`` in fixed-size rows (TRL ``packing`` with the "wrapped"
  strategy). transformers builds a block-causal mask from the positions (no token attends across a boundary);
  rows of a bounded size keep SDPA's materialised mask at rows x row_tokens^2 instead of tokens^2.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

LENGTHS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_lengths.json")
FULL_MAX_LEN, TINY_MAX_LEN = 4096, 64  # longest sequence (and packed row); tiny scales the histogram to it
GROUP_STEPS = 50  # padded: steps per length-sorted pool (LengthGroupedSampler: megabatches of 50 batches)
IGNORE = -100


def load_histogram(path: str = LENGTHS_JSON) -> dict[str, Any]:
    with open(path) as f:
        doc = json.load(f)
    if len(doc["bin_edges"]) != len(doc["counts"]) + 1:
        raise ValueError(f"{path}: bin_edges must be one longer than counts")
    return doc


def max_len(spec: dict) -> int:
    return int(spec.get("max_len") or (TINY_MAX_LEN if spec.get("tiny") else FULL_MAX_LEN))


def draw_lengths(n: int, gen: torch.Generator, hist: dict[str, Any], longest: int) -> list[int]:
    """``n`` lengths from the histogram, scaled so its last edge maps to ``longest`` (1 with the full model)."""
    edges, counts = hist["bin_edges"], torch.tensor(hist["counts"], dtype=torch.float64)
    scale = longest / edges[-1]
    bins = torch.multinomial(counts, n, replacement=True, generator=gen).tolist()
    u = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    return [max(2, min(longest, int((edges[b] + x * (edges[b + 1] - edges[b])) * scale))) for b, x in zip(bins, u)]


def _fill(lengths: list[int], tokens: int) -> tuple[list[int], list[int]]:
    """Take lengths from the front until they hold exactly ``tokens``; a sequence that does not fit whole is cut
    and its rest stays at the front, a sequence of its own. -> (taken, rest)."""
    taken, total = [], 0
    while total < tokens:
        n = lengths.pop(0)
        if total + n > tokens:
            lengths.insert(0, total + n - tokens)
            n = tokens - total
        taken.append(n)
        total += n
    return taken, lengths


def step_lengths(spec: dict, n_steps: int) -> list[list[int]]:
    """The sequence lengths of each step (each summing to ``spec['tokens']``); padded steps length-grouped."""
    tokens, longest = int(spec["tokens"]), max_len(spec)
    gen = torch.Generator().manual_seed(2000 + int(spec.get("seed", 0)))
    hist = load_histogram(spec.get("lengths_json") or LENGTHS_JSON)
    grouped = spec.get("layout", "padded") == "padded"
    steps: list[list[int]] = []
    stream: list[int] = []  # drawn, not yet used (in draw order: a pool takes a prefix, unbiased)
    while len(steps) < n_steps:
        k = min(GROUP_STEPS, n_steps - len(steps)) if grouped else 1
        while sum(stream) < k * tokens:
            stream += draw_lengths(256, gen, hist, longest)
        cum, n = 0, 0
        while cum < k * tokens:
            cum += stream[n]
            n += 1
        pool, stream = stream[:n], stream[n:]
        if grouped:
            pool.sort(reverse=True)
        for _ in range(k):
            taken, pool = _fill(pool, tokens)
            steps.append(taken)
    if grouped:  # long and short steps interleaved, as the sampler's shuffled megabatches
        order = torch.randperm(len(steps), generator=gen).tolist()
        steps = [steps[i] for i in order]
    return steps


def padded_batch(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(seqs: list[torch.Tensor], row_tokens: int) -> dict[str, torch.Tensor]:
    total = sum(len(s) for s in seqs)
    if total % row_tokens:
        raise ValueError(f"packed: {total} tokens per step is not a multiple of the row length {row_tokens}")
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    labels = ids.clone()
    starts = torch.cumsum(torch.tensor([0] + [len(s) for s in seqs[:-1]]), 0)
    labels[starts] = IGNORE  # (DataCollatorWithFlattening's separator: no prediction across a boundary)
    rows = total // row_tokens
    return {"input_ids": ids.view(rows, row_tokens), "position_ids": pos.view(rows, row_tokens),
            "labels": labels.view(rows, row_tokens)}


def step_batches(spec: dict, n_steps: int) -> list[dict[str, torch.Tensor]]:
    """One collated batch per step, the same for every system (fixed seeds)."""
    vocab = int(spec["vocab_size"])
    gen = torch.Generator().manual_seed(3000 + int(spec.get("seed", 0)))
    layout = spec.get("layout", "padded")
    out = []
    for lengths in step_lengths(spec, n_steps):
        seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
        if layout == "padded":
            out.append(padded_batch(seqs))
        elif layout == "packed":
            out.append(packed_batch(seqs, max_len(spec)))
        else:
            raise ValueError(f"layout {layout!r}: use 'padded' or 'packed'")
    return out


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()


def label_items(batch: dict[str, torch.Tensor]) -> int:
    """What Trainer passes as ``num_items_in_batch``: label tokens after the shift."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def micro_batches(batch: dict[str, torch.Tensor], ga: int) -> list[dict[str, torch.Tensor]]:
    """The step's rows in ``ga`` near-equal groups (a peer's gradient accumulation), same padding width."""
    rows = batch["input_ids"].shape[0]
    if ga > rows:
        raise ValueError(f"grad_accum {ga} > {rows} rows in a step")
    bounds = [round(i * rows / ga) for i in range(ga + 1)]
    return [{k: v[a:b] for k, v in batch.items()} for a, b in zip(bounds, bounds[1:])]


class MicroBatchDataset(torch.utils.data.Dataset):
    """Pre-collated micro-batches as Trainer items: ``per_device_train_batch_size=1`` with ``unwrap`` as the
    collator hands Trainer each one whole (rows per step vary, Trainer's batch size cannot)."""

    def __init__(self, steps: list[dict[str, torch.Tensor]], ga: int) -> None:
        self.items = [m for b in steps for m in micro_batches(b, ga)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def unwrap(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return items[0]


def summary(steps: list[dict[str, torch.Tensor]], spec: dict) -> dict[str, Any]:
    real = [real_tokens(b) for b in steps]
    total = [b["input_ids"].numel() for b in steps]
    hist = load_histogram(spec.get("lengths_json") or LENGTHS_JSON)
    return {"layout": spec.get("layout", "padded"), "real_tokens_per_step": real[0],
            "total_tokens_per_step": total, "rows_per_step": [b["input_ids"].shape[0] for b in steps],
            "padding_frac": 1 - sum(real) / sum(total), "max_len": max_len(spec),
            "lengths": {"source": os.path.basename(spec.get("lengths_json") or LENGTHS_JSON),
                        "distribution": hist.get("distribution"), "synthetic": "SYNTHETIC" in hist.get(
                            "provenance", "")}}
