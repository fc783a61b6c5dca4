"""Attention of padded fine-tune batches, one new shape per step (issue 31's padded outlier step), per SDPA backend:
the first call at each new ``[rows, width]`` (a new width every step: rows are padded to the step's longest) against
a repeat of the same shape, forward + backward, eager, at the bench's width (40 heads, 8 KV heads, head dim 128) with
the boolean ``[rows, 1, width, width]`` causal + key-padding mask transformers gives SDPA.

Also FlexAttention against SDPA ``is_causal`` on the fixed-length bench's 16 x 2,048 (is flex a loss where there is
nothing to skip?).

    python integration/probes/attention_shapes.py [out.json] [steps]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.finetune_data import step_lengths  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, TOKENS = 40, 8, 128, 32768


def call_s(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def qkv(b: int, s: int):
    mk = lambda h: torch.randn(b, h, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa
    return mk(HEADS), mk(KV_HEADS), mk(KV_HEADS)


def padded_case(lengths: list[int], backend) -> dict[str, float]:
    from torch.nn.attention import sdpa_kernel

    rows, width = len(lengths), max(lengths)
    q, k, v = qkv(rows, width)
    n = torch.tensor(lengths, device="cuda")
    idx = torch.arange(width, device="cuda")
    mask = (idx[None, :, None] >= idx[None, None, :]) & (idx[None, None, :] < n[:, None, None])

    def run():
        with sdpa_kernel(backend) if backend is not None else _null():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        out.backward(torch.ones_like(out))
    first = call_s(run)
    again = min(call_s(run) for _ in range(2))
    return {"rows": rows, "width": width, "first_s": first, "again_s": again}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> None:
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    n_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    steps = step_lengths({"tokens": TOKENS, "layout": "padded"}, n_steps)
    res: dict = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    for name, backend in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            res[name] = [padded_case(lengths, backend) for lengths in steps]
        except RuntimeError as e:  # a backend that refuses the shape / mask
            res[name] = f"{type(e).__name__}: {str(e)[:200]}"
        print(name, json.dumps(res[name])[:2000], flush=True)

    q, k, v = qkv(TOKENS // 2048, 2048)

    def timed(fn, reps=5):
        fn()
        fn()
        return min(call_s(fn) for _ in range(reps))

    def fb(attn):
        def run():
            o = attn()
            o.backward(torch.ones_like(o))
        return run
    res["sdpa_causal_2048_s"] = timed(fb(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                enable_gqa=True)))
    block = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 2048, 2048, device="cuda")
    flex = torch.compile(flex_attention)
    res["flex_causal_2048_s"] = timed(fb(lambda: flex(q, k, v, block_mask=block, enable_gqa=True)))
    print({k: v for k, v in res.items() if k.endswith("_s")}, flush=True)
    if out_path:
        Path(out_path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
