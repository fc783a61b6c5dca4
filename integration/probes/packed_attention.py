"""Attention of packed rows (issue 31's fine-tune regime) at the bench's width, forward + backward, per kernel:

- ``sdpa_mask``: SDPA with the dense block-causal boolean mask transformers builds from restarting ``position_ids``
  (``attn_implementation="sdpa"``: the kernel cannot skip the blocks the mask removes)
- ``flex``: FlexAttention with a document-causal ``BlockMask`` (``attn_implementation="flex_attention"``): fully
  masked blocks are skipped
- ``sdpa_causal_row``: SDPA ``is_causal`` over the whole row (ignores the boundaries: the cost of one 4,096 sequence)
- ``sdpa_causal_2048``: SDPA ``is_causal`` at the fixed-length bench's 2,048-token sequences (same tokens)

    python integration/probes/packed_attention.py [out.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.finetune_data import step_lengths  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ROW, TOKENS = 40, 8, 128, 4096, 32768


def timed(fn, reps: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows = TOKENS // ROW
    lengths = step_lengths({"tokens": TOKENS, "layout": "packed"}, 1)[0]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).view(rows, ROW).cuda()
    pos = torch.cat([torch.arange(n) for n in lengths]).view(rows, ROW).cuda()
    dev = torch.device("cuda")

    def qkv(b: int, s: int):
        mk = lambda h: torch.randn(b, h, s, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)  # noqa
        return mk(HEADS), mk(KV_HEADS), mk(KV_HEADS)

    def fwd_bwd(attn):
        def run():
            out = attn()
            out.backward(torch.ones_like(out))
        return run

    q, k, v = qkv(rows, ROW)
    idx = torch.arange(ROW, device=dev)
    dense = (doc[:, :, None] == doc[:, None, :]) & (idx[:, None] >= idx[None, :])  # block-causal, per row
    res: dict[str, float] = {}
    res["sdpa_mask"] = timed(fwd_bwd(lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense[:, None], enable_gqa=True)))
    res["sdpa_causal_row"] = timed(fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                   enable_gqa=True)))

    def doc_causal(b, h, qi, ki):
        return (doc[b, qi] == doc[b, ki]) & (qi >= ki)

    block = create_block_mask(doc_causal, rows, None, ROW, ROW, device=dev)
    flex = torch.compile(flex_attention)
    res["flex"] = timed(fwd_bwd(lambda: flex(q, k, v, block_mask=block, enable_gqa=True)))
    q2, k2, v2 = qkv(TOKENS // 2048, 2048)
    res["sdpa_causal_2048"] = timed(fwd_bwd(lambda: F.scaled_dot_product_attention(q2, k2, v2, is_causal=True,
                                                                                    enable_gqa=True)))
    res["doc_tokens_sq_over_row_sq"] = float(sum(n * n for n in lengths) / (rows * ROW * ROW))
    res["sequences"] = len(lengths)
    for key, val in res.items():
        print(f"{key:28s} {val * 1e3 if isinstance(val, float) and val < 10 else val:10.3f}"
              f"{' ms (fwd+bwd, one layer)' if key.startswith(('sdpa', 'flex')) else ''}", flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
