"""What one micro-step's rows hold, and what their attention costs: the step-time model's view of a fine-tune batch.

A fixed-length batch is ``rows`` sequences of ``width`` tokens. A fine-tune's batch is not:

- **padded** (``DataCollatorWithPadding`` / ``DataCollatorForSeq2Seq``, SFTTrainer without packing): one sequence
  per row, every row padded to the batch's longest. The layers' matmuls and element-wise work run over every
  position, padding included; only the attention can skip what the mask removes.
- **packed** (``DataCollatorWithFlattening``, SFTTrainer ``packing`` / ``padding_free``): several sequences per
  row, ``position_ids`` restarting at each; no padding, but attention must not cross a boundary.

Attention is priced by the kernel that runs it (model/attention.py decides which in the engine):

- ``FLASH``: SDPA ``is_causal`` on unmasked rows (the flash kernel): the causal half of each row's square, at
  ``MachineProfile.attention_tflops``.
- ``FLEX``: FlexAttention with a ``BlockMask``: only the 128 x 128 blocks the mask leaves any pair in, each computed
  whole, at ``flex_tflops`` (calibrated on those block FLOPs: packed rows and causal 2,048-token rows, H200,
  integration/results/packed_attention and attention_shapes: 234 and 273 TFLOP/s).
- ``DENSE_MASK``: SDPA with a dense boolean mask (transformers' ``sdpa`` for padded or packed rows): nothing is
  skipped, the full square of every row, at ``dense_mask_tflops`` (packed 8 x 4,096: 30.7 ms forward + backward,
  269 TFLOP/s on the full square).

One forward's FLOPs are returned; the model charges a backward visit three of them (recompute + backward).
"""

from __future__ import annotations

import enum
import json
import random
from dataclasses import dataclass

from ..config import MegaTrainConfig

FLEX_BLOCK = 128  # FlexAttention's default BLOCK_SIZE (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)


class AttentionKernel(enum.Enum):
    FLASH = "flash"
    FLEX = "flex"
    DENSE_MASK = "dense_mask"


class Layout(enum.Enum):
    FIXED = "fixed"
    PADDED = "padded"
    PACKED = "packed"


@dataclass(frozen=True)
class BatchRows:
    """One micro-step's rows: the sequence lengths in each row, every row ``width`` tokens long (padding included)."""

    rows: tuple[tuple[int, ...], ...]
    width: int
    layout: Layout

    def __post_init__(self) -> None:
        if not self.rows or self.width < 1:
            raise ValueError("a batch needs at least one row of at least one token")
        for row in self.rows:
            if not row or min(row) < 1 or sum(row) > self.width:
                raise ValueError(f"a row's sequences {row} must be >= 1 token each and fit width {self.width}")

    @classmethod
    def fixed(cls, seq_len: int, batch_size: int) -> "BatchRows":
        return cls(((seq_len,),) * batch_size, seq_len, Layout.FIXED)

    @classmethod
    def padded(cls, lengths: list[int]) -> "BatchRows":
        """One row per sequence, padded to the longest (what a padding collator gives)."""
        return cls(tuple((n,) for n in lengths), max(lengths), Layout.PADDED)

    @classmethod
    def packed(cls, lengths: list[int], row_tokens: int) -> "BatchRows":
        """The sequences laid end to end in rows of ``row_tokens`` (the last row as long as what is left); a
        sequence cut at a row's end goes on at the start of the next, as the benchmark's packed rows do."""
        rows: list[list[int]] = [[]]
        room = row_tokens
        for n in lengths:
            while n:
                if not room:
                    rows.append([])
                    room = row_tokens
                take = min(n, room)
                rows[-1].append(take)
                n, room = n - take, room - take
        width = row_tokens if len(rows) > 1 else sum(rows[0])
        return cls(tuple(tuple(r) for r in rows), width, Layout.PACKED)

    @property
    def real_tokens(self) -> int:
        return sum(sum(r) for r in self.rows)

    @property
    def total_tokens(self) -> int:
        """Positions the layers compute: every row at its full width."""
        return len(self.rows) * self.width


def padding_summary(batches: list[BatchRows]) -> dict[str, float]:
    """Real tokens per step and the padding's share of the positions, over ``batches``."""
    real, total = sum(b.real_tokens for b in batches), sum(b.total_tokens for b in batches)
    return {"real_tokens_per_step": real / len(batches), "padding_share": 1 - real / total}


def default_kernel(config: MegaTrainConfig, layout: Layout, device_type: str = "cuda") -> AttentionKernel:
    """The kernel the engine runs for this layout (model/attention.py ``choose``, for an sdpa model whose family
    supports FlexAttention with a power-of-two head size up to 128): unmasked rows SDPA's flash kernel; padded rows
    and packed rows FlexAttention where the layers compile and ``masked_attention`` allows it, else SDPA's dense
    (padding or block-causal) mask."""
    if layout is Layout.FIXED:
        return AttentionKernel.FLASH
    flex = config.masked_attention != "model" and config.compiles(device_type) and not config.micro_batch_size
    return AttentionKernel.FLEX if flex else AttentionKernel.DENSE_MASK


def as_the_engine_runs(config: MegaTrainConfig, batch: BatchRows, device_type: str = "cuda") -> BatchRows:
    """``batch`` as the engine's layers see it: a padded batch runs as one packed row of its sequences where
    ``padding_free`` applies (engine/unpad.py: "on", or "auto" where packed rows run FlexAttention)."""
    if batch.layout is not Layout.PADDED or config.padding_free == "off":
        return batch
    if config.padding_free == "auto" and default_kernel(config, Layout.PACKED, device_type) is not AttentionKernel.FLEX:
        return batch
    lengths = [row[0] for row in batch.rows]
    return BatchRows.packed(lengths, sum(lengths))


def _flex_blocks(row: tuple[int, ...], width: int, layout: Layout) -> int:
    """(query block, key block) pairs the BlockMask keeps for one row: at or below the diagonal, holding a causal
    pair of one sequence; in a padded row also the padding's query blocks against the sequence's key blocks
    (transformers' padding mask removes padded *keys*: a padded query still attends the row's tokens)."""
    if layout is Layout.PADDED:
        n, w = -(-row[0] // FLEX_BLOCK), -(-width // FLEX_BLOCK)
        return n * (n + 1) // 2 + (w - n) * n
    blocks, start = 0, 0
    for n in row:  # a sequence [start, start + n) spans blocks a..b: pairs a <= kb <= qb <= b
        a, b = start // FLEX_BLOCK, (start + n - 1) // FLEX_BLOCK
        blocks += (b - a + 1) * (b - a + 2) // 2
        if start % FLEX_BLOCK:
            blocks -= 1  # (the diagonal block it shares with the sequence before it, counted there)
        start += n
    return blocks


def attention_flops(q_dim: int, batch: BatchRows, kernel: AttentionKernel) -> float:
    """FLOPs one forward of one layer's attention executes (QK^T and AV, 2 per multiply-add)."""
    if kernel is AttentionKernel.FLASH:  # causal half of each sequence's square (SDPA is_causal per row)
        return sum(2.0 * q_dim * n * n for row in batch.rows for n in row)
    if kernel is AttentionKernel.FLEX:
        return sum(_flex_blocks(row, batch.width, batch.layout) for row in batch.rows) * 4.0 * q_dim * FLEX_BLOCK * FLEX_BLOCK
    return len(batch.rows) * 4.0 * q_dim * batch.width * batch.width


GROUP_BATCHES = 50  # transformers' LengthGroupedSampler sorts megabatches of 50 batches by length


def sample_steps(lengths: list[int], layout: Layout, batch_size: int, max_len: int, *, group_by_length: bool = False,
                 steps: int = 16, seed: int = 0) -> list[BatchRows]:
    """``steps`` micro-steps drawn from a dataset's sequence ``lengths`` (each cut to ``max_len``), as Trainer lays
    them out: padded, ``batch_size`` random sequences per step padded to their longest (with ``group_by_length``,
    megabatches of ``GROUP_BATCHES`` steps sorted longest first, as ``LengthGroupedSampler``); packed,
    ``batch_size`` rows of ``max_len`` tokens filled end to end."""
    if layout is Layout.FIXED or not lengths or batch_size < 1 or max_len < 1 or min(lengths) < 1:
        raise ValueError("sample_steps: a padded or packed layout, positive lengths, batch_size and max_len")
    rng = random.Random(seed)
    stream: list[int] = []

    def draw(n: int) -> list[int]:
        while len(stream) < n:
            more = list(lengths)
            rng.shuffle(more)
            stream.extend(min(x, max_len) for x in more)
        taken = stream[:n]
        del stream[:n]
        return taken

    if layout is Layout.PACKED:
        out = []
        for _ in range(steps):
            seqs, total = [], 0
            while total < batch_size * max_len:
                n = min(draw(1)[0], batch_size * max_len - total)
                seqs.append(n)
                total += n
            out.append(BatchRows.packed(seqs, max_len))
        return out
    pool = draw(batch_size * (GROUP_BATCHES if group_by_length else 1) * steps)
    batches = [pool[i:i + batch_size] for i in range(0, len(pool), batch_size)]
    if group_by_length:
        mega = batch_size * GROUP_BATCHES
        batches = []
        for i in range(0, len(pool), mega):
            part = sorted(pool[i:i + mega], reverse=True)
            batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
        rng.shuffle(batches)
    return [BatchRows.padded(b) for b in batches[:steps]]


def load_lengths(path: str, samples: int = 4096) -> list[int]:
    """A dataset's sequence lengths (in tokens) from ``path``: a JSON list of lengths, a JSON histogram
    ``{"bin_edges": [...], "counts": [...]}`` (``samples`` lengths drawn from it, uniform within a bin, fixed seed),
    or a text file with one length per line."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = [line for line in text.split() if line]
    if isinstance(doc, dict):
        edges, counts = doc.get("bin_edges"), doc.get("counts")
        if not (isinstance(edges, list) and isinstance(counts, list) and len(edges) == len(counts) + 1
                and sum(counts) > 0):
            raise ValueError(f"{path}: a histogram needs 'bin_edges' one longer than 'counts' (and some counts)")
        rng = random.Random(0)
        bins = rng.choices(range(len(counts)), weights=counts, k=samples)
        doc = [max(1, int(edges[b] + rng.random() * (edges[b + 1] - edges[b]))) for b in bins]
    try:
        lengths = [int(x) for x in doc]
    except (TypeError, ValueError):
        raise ValueError(f"{path}: expected a JSON list of lengths, a histogram or one length per line") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{path}: no lengths, or a length below 1")
    return lengths
