"""Shards: which contiguous range of a unit's flat buffers each data-parallel rank owns.

A unit of ``n`` elements is cut into ``world`` shards of equal size ``shard_size(n, world)`` (a multiple of
``ALIGN`` elements, so every shard starts cache-line and SIMD aligned); rank r owns ``[r s, (r+1) s)`` clipped to
``n`` (the last shards may be short or empty). Equal sizes are what ``reduce_scatter_tensor`` needs: the gradient
is padded to ``world * s`` and rank r receives the sum of its shard. The optimizer steps a shard by intersecting
each hyper-parameter group's spans with it (``clip_spans``). Pure arithmetic, no torch.
"""

from __future__ import annotations

from typing import Sequence

ALIGN = 64  # elements (256 bytes of fp32)


def shard_size(n: int, world: int) -> int:
    """Elements per shard of a unit of ``n`` elements over ``world`` ranks (all shards padded to this size)."""
    per = -(-n // world)
    return -(-per // ALIGN) * ALIGN


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s shard of a unit of ``n`` elements (end <= n; may be empty)."""
    s = shard_size(n, world)
    return min(rank * s, n), min((rank + 1) * s, n)


def clip_spans(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``spans`` inside [lo, hi) (empty ones dropped)."""
    out = []
    for a, b in spans:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((a, b))
    return out
