"""Layer-boundary activations: where each decoder layer's saved input lives between its forward and its backward.

The streamed backward recomputes layer i from its input (engine/proxy.py), so the forward keeps one tensor per
layer: batch x seq x hidden in the compute dtype, 3.5 GiB per layer at 512k tokens and 7B width. The planner
decides per step shape how many fit the GPU (``planner.activation_offload_layers``); the engine hands this store
the layers to offload, always the *first* ones (their backward comes last, so their copies back have the most
time, and the last layers' inputs, needed first, never leave the GPU):

    forward  layer i offloaded: D2H of its input on this store's D2H stream, started when the layer starts (the
             input is only read), into a pinned host buffer from a pool; the GPU copy is freed when the copy is
             done (``record_stream``), not when the Python reference goes
    backward layer i: its input taken from the prefetch (waited on with an event) or copied in now; then the
             inputs of the ``prefetch`` offloaded layers before it are copied in on the H2D stream, overlapping
             layer i's recompute

Streams are this store's own, so activation copies never queue behind weight prefetches. On a CPU the same calls
copy in program order (the tests run this code). A saved input is a ``SavedInput`` held by the layer's autograd
context; its host buffer returns to the pool when the context dies (the graph is freed after its backward), so
gradient accumulation (several forwards before their backwards) and ``retain_graph`` work: each forward has its
own buffers, and a second backward reads the host copy again. Layers in one forward are chained (``prev``), so a
backward prefetches the layers of its own forward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..core.memory import alloc_host
from ..core.streams import StreamSet


class SavedInput:
    """One layer's offloaded input: the host copy, the events ordering its copies, and the prefetched device copy."""

    def __init__(self, store: ActivationStore, index: int, prev: SavedInput | None, offloaded: bool) -> None:
        self.store, self.index, self.prev, self.offloaded = store, index, prev, offloaded
        self.host: torch.Tensor | None = None  # flat pinned buffer, maybe larger (pooled): its first numel(shape)
        self.shape: torch.Size | None = None
        self.d2h_done: Any = None  # event: the host copy is complete
        self.device: torch.Tensor | None = None  # prefetched copy, handed to the backward once
        self.h2d_done: Any = None

    def view(self) -> torch.Tensor:
        """The host copy as the saved input's shape (the front of a pooled buffer that may be larger)."""
        assert self.host is not None and self.shape is not None
        return self.host[:self.shape.numel()].view(self.shape)

    def __del__(self) -> None:
        if self.host is not None:
            self.store._release(self.host)


class ActivationStore:
    def __init__(self, device: torch.device, *, prefetch: int, pin: bool) -> None:
        self.device, self.prefetch, self.pin = device, prefetch, pin
        self.streams = StreamSet(device)
        self.offload: frozenset[int] = frozenset()  # layer indices whose input goes to host (set per step shape)
        # Free flat pinned buffers by dtype, reused for any input that fits: with variable-length data every step
        # has another (batch, seq) shape, and pinning fresh host memory per shape costs seconds per step.
        self._pool: dict[torch.dtype, list[torch.Tensor]] = {}
        self._last: weakref.ref[SavedInput] | None = None  # the latest save (chains a forward's layers)
        self.d2h_bytes = self.h2d_bytes = 0
        self.host_bytes = 0  # pinned host bytes this store holds (in use + pooled)

    @property
    def active(self) -> bool:
        return bool(self.offload)

    # -- forward -----------------------------------------------------------------------------------------------------
    def save(self, index: int, hidden: torch.Tensor) -> SavedInput | None:
        """Called by layer ``index``'s Function forward before it runs. None: nothing is offloaded in this plan (the
        Function saves ``hidden`` itself); otherwise a ``SavedInput`` (offloaded, or only a link of the chain when
        ``index`` stays on the device, where the Function saves ``hidden`` too)."""
        if not self.offload:
            return None
        last = self._last() if self._last is not None else None
        prev = last if last is not None and last.index < index else None  # a lower index: same forward pass
        h = SavedInput(self, index, prev, index in self.offload)
        self._last = weakref.ref(h)
        if h.offloaded:
            h.host, h.shape = self._take(hidden), hidden.shape
            s = self.streams
            s.wait(s.d2h, s.record(s.compute))  # the input is complete on the compute stream
            with s.on(s.d2h):
                h.view().copy_(hidden, non_blocking=s.is_cuda)
                h.d2h_done = s.record(s.d2h)
            if s.is_cuda:
                hidden.record_stream(s.d2h)  # its memory is reused only after the copy has read it
            self.d2h_bytes += hidden.numel() * hidden.element_size()
        return h

    # -- backward ----------------------------------------------------------------------------------------------------
    def load(self, h: SavedInput) -> torch.Tensor:
        """Offloaded layer ``h.index``'s input on the device, for its backward (the prefetched copy, else now)."""
        if h.device is None:
            self._fetch(h)
        s = self.streams
        s.wait(s.compute, h.h2d_done)
        hidden, h.device, h.h2d_done = h.device, None, None
        return hidden

    def prefetch_before(self, h: SavedInput) -> None:
        """Start copying in the inputs of the ``prefetch`` offloaded layers whose backward follows ``h``'s."""
        back, p = 0, h.prev
        while p is not None and back < self.prefetch:
            if p.offloaded:
                back += 1
                if p.device is None:
                    self._fetch(p)
            p = p.prev

    def _fetch(self, h: SavedInput) -> None:
        s = self.streams
        assert h.host is not None and h.shape is not None
        dev = torch.empty(h.shape, dtype=h.host.dtype, device=self.device)  # allocated on the compute stream
        s.wait(s.h2d, s.record(s.compute))  # ... and free there: the copy starts after its previous use
        s.wait(s.h2d, h.d2h_done)
        with s.on(s.h2d):
            dev.copy_(h.view(), non_blocking=s.is_cuda)
            h.h2d_done = s.record(s.h2d)
        if s.is_cuda:
            dev.record_stream(s.h2d)  # freed unused (graph dropped before its backward): reused after the copy
        h.device = dev
        self.h2d_bytes += dev.numel() * dev.element_size()

    # -- host buffers ------------------------------------------------------------------------------------------------
    def _take(self, like: torch.Tensor) -> torch.Tensor:
        """The smallest free buffer that holds ``like``; else a new one, replacing the largest free buffer too small
        for it (so the pool never holds more buffers than a forward used at once)."""
        free = self._pool.setdefault(like.dtype, [])
        n = like.numel()
        fits = [b for b in free if b.numel() >= n]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
            free.remove(buf)
            return buf
        if free:
            small = max(free, key=lambda b: b.numel())
            free.remove(small)
            self.host_bytes -= small.numel() * small.element_size()
        self.host_bytes += n * like.element_size()
        return alloc_host(n, like.dtype, self.pin)

    def _release(self, host: torch.Tensor) -> None:
        self._pool.setdefault(host.dtype, []).append(host)

    def clear_pool(self) -> None:
        """Free the pooled (unused) host buffers, e.g. after the sequence length changed."""
        for bufs in self._pool.values():
            self.host_bytes -= sum(b.numel() * b.element_size() for b in bufs)
        self._pool.clear()
