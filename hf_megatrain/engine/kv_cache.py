"""Generation through the streamed layers: the HF KV cache, per layer.

``model.generate()`` (and any no-grad forward with ``use_cache=True``) hands the decoder loop a transformers
``Cache``; each HF attention then calls ``past_key_values.update(k, v, self.layer_idx)``. Two things break that
when a weightless proxy runs the layer through a *shared* template:

- the template is a copy of the first layer of its kind, so its attention's ``layer_idx`` is that layer's: every
  layer of a kind would write into one cache slot (wrong keys from the prefill on, wrong text, no error);
- the executor may split a batch into micro-batches inside a layer visit; the cache is one object, not a tensor,
  so each chunk would append its rows to the whole batch's cache.

``CachingStreamedLayer`` (the proxy the engine installs) fixes both where the call enters the layer: it hands the
layer a ``LayerCache``, a view of the cache that writes to this proxy's own layer index, and runs a cached call
unsplit. A cached call with gradients enabled is refused: the backward recomputes every layer from its input, which
would update the cache a second time (and differentiate a different function than the forward ran).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .proxy import StreamedLayer


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache. Found by what it is, not by the keyword it travels under:
    the argument was ``past_key_value`` (4.x), ``past_key_values`` (5.0-5.23) and is ``cache`` from 5.24 on; the
    next rename must not turn generation into a silent uncached-per-layer mix."""
    from transformers.cache_utils import Cache  # (only a cached call reaches here with a non-tensor value)

    return isinstance(value, (Cache, LayerCache))


# Names a cache has travelled under; a value under one of them that is not a ``Cache`` (a family's own cache class)
# is treated as one too, so it is refused under gradients and sent to this layer's slot rather than ignored.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


class LayerCache:
    """A transformers ``Cache`` as seen by decoder layer ``index``: ``update`` writes that layer's slot whatever
    ``layer_idx`` the (shared) template passes; everything else is the cache's own."""

    def __init__(self, cache: Any, index: int) -> None:
        self._cache = cache
        self._index = index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> Any:
        return self._cache.update(key_states, value_states, self._index, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only reached for names LayerCache itself does not define
        return getattr(self._cache, name)


@contextmanager
def _whole_batch(executor: Any) -> Iterator[None]:
    """Run the layer visit without the in-layer micro-batch split (the cache must see the whole batch at once)."""
    saved = executor.micro_batch_size
    executor.micro_batch_size = 0
    try:
        yield
    finally:
        executor.micro_batch_size = saved


class CachingStreamedLayer(StreamedLayer):
    """``StreamedLayer`` that also runs with a KV cache (generation); without one it is exactly the plain proxy."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        key = next((k for k, v in kwargs.items() if _maybe_cache(v) and (k in _CACHE_KWARGS or is_kv_cache(v))),
                   None)
        pos = next((i for i, v in enumerate(args) if _maybe_cache(v) and is_kv_cache(v)), None)
        if key is None and pos is None:
            return super().forward(hidden_states, *args, **kwargs)
        if torch.is_grad_enabled():
            raise RuntimeError(
                "hf_megatrain: a forward with a KV cache (use_cache=True / past_key_values) and gradients enabled is "
                "not supported: the streamed backward recomputes each layer from its input, which would update the "
                "cache twice. Pass use_cache=False for a training forward, or run inference under torch.no_grad() "
                "(model.generate() does).")
        if key is not None:
            kwargs[key] = LayerCache(kwargs[key], self.index)
        else:
            args = args[:pos] + (LayerCache(args[pos], self.index),) + args[pos + 1:]
        with _whole_batch(self._executor[0]):
            return super().forward(hidden_states, *args, **kwargs)


def _maybe_cache(value: Any) -> bool:
    """Cheap pre-filter: tensors, numbers, strings and None (most layer arguments) are never a cache."""
    return value is not None and not isinstance(value, (torch.Tensor, bool, int, float, str, tuple, dict))
