"""Which inputs of a decoder-layer call hold one row per sequence: decided by asking the decoder, not by shape.

A visit split into micro-batches (``micro_batch_size``) runs the layer on rows ``a:b`` of the batch, so every
input tensor holding rows of the batch must be cut to them and every other one (broadcast masks, rotary tables,
an ALiBi bias) passed whole. A leading dim equal to the batch size does not tell them apart: MPT's ALiBi bias is
``[heads, 1, T]``, cut into rows when ``heads == batch`` (silently wrong attention), and BLOOM's is
``[batch * heads, 1, T]``, a batch-major tensor with ``heads`` rows per sequence.

``BatchRows`` asks the model instead. The first time a layer call of a given signature comes (shapes, dtypes,
structure), it re-runs the module that owns the layer stack (embeddings, masks, position tables: everything before
the layers) on the same inputs with the last sequence repeated once (batch ``B + 1``), with every streamed layer
passing its hidden state through (``visit``), and records the calls the layers get. An input whose leading dim is
``r * B`` in the real call is rows of the batch (``r`` per sequence) exactly when it is ``r * (B + 1)`` in the
probe and its last ``r`` rows (the repeated sequence's) equal the ``r`` before them; one whose leading dim did not
change is passed whole; anything else (rows interleaved across sequences, a probe that failed) is refused with the
way out. (The check compares the probe with itself: layers pass the hidden state through and other outputs come
back as zeros, so the values of later layers' inputs are not the real ones, but they are the same for the two
copies of a sequence.) The decision is cached per (layer, call signature), so a probe
runs once per new shape, not per step; it runs under ``no_grad`` with the RNG state restored, so it changes
neither the gradients nor the random numbers the real forward draws.

Inputs of the owning module are extended when they are at least 2-D with the batch leading (``input_ids``,
``attention_mask``, ``position_ids``, ``inputs_embeds``: HF's batch-major inputs); 1-D ones (``cache_position``,
whose length is the sequence, possibly equal to the batch) are not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .layer_io import Call, OutLayout

Rows = list[int | None]  # per flattened call leaf: rows per sequence (sliced a*r:b*r), or None (passed whole)
_MAX_CACHED = 4096


class _StopProbe(Exception):
    """Raised inside the probe at the first layer whose output structure is not known yet."""


def _signature(index: int, batch: int, flat: list[Any], spec: pytree.TreeSpec) -> tuple:
    return (index, batch, spec, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
                                      for x in flat))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


class BatchRows:
    """Per layer call: the rows per sequence of each input leaf (see the module docstring)."""

    def __init__(self) -> None:
        self.decoder: tuple[nn.Module, tuple, dict] | None = None  # the owning module's current call
        self.probing = False  # the streamed layers pass through and report their calls (``visit``)
        self._probe_calls: dict[int, tuple[list[Any], pytree.TreeSpec]] = {}  # of this forward's last probe
        self._probe_error: str | None = None
        # Per layer: its output structure, (shape, dtype, rows?, the call leaf it passes through) per tensor output,
        # and the batch size it was seen with.
        self._outputs: dict[int, tuple[OutLayout, list[tuple[torch.Size, torch.dtype, bool, int | None]], int]] = {}
        self._cache: dict[tuple, Rows] = {}

    # -- the owning module's forward --------------------------------------------------------------------------------
    def begin_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.decoder = (module, args, kwargs)

    def end_forward(self) -> None:
        self.decoder = None
        self._probe_calls = {}  # (device tensors: nothing of a probe outlives the forward)
        self._probe_error = None

    def saw_output(self, index: int, batch: int, flat: list[Any], tensors: list[torch.Tensor],
                   layout: OutLayout) -> None:
        """Remember layer ``index``'s output structure: a probe passes its hidden state through in that shape, and
        an output that is one of its inputs (a constant handed on to the next layer) as that input."""
        def source(t: torch.Tensor) -> int | None:
            return next((k for k, x in enumerate(flat) if x is t), None)

        self._outputs[index] = (layout, [(t.shape, t.dtype, not s, source(t) if s else None)
                                         for t, s in zip(tensors, layout.shared)], batch)

    # -- the decision -----------------------------------------------------------------------------------------------
    def rows(self, index: int, batch: int, flat: list[Any], spec: pytree.TreeSpec, name: str) -> Rows:
        key = _signature(index, batch, flat, spec)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        candidates = [isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] > 0 and x.shape[0] % batch == 0
                      for x in flat]
        rows: Rows = [None] * len(flat)
        if any(candidates):
            if index not in self._probe_calls:
                self._probe(batch)
            probe = self._probe_calls.pop(index, None)
            for i, x in enumerate(flat):
                if candidates[i]:
                    rows[i] = self._decide(x, i, batch, probe, spec, name)
        if len(self._cache) >= _MAX_CACHED:
            self._cache.clear()
        self._cache[key] = rows
        return rows

    def _decide(self, x: torch.Tensor, i: int, batch: int, probe: tuple[list[Any], pytree.TreeSpec] | None,
                spec: pytree.TreeSpec, name: str) -> int | None:
        r = x.shape[0] // batch
        why = None
        if probe is None:
            why = self._probe_error or "the probe did not reach this layer"
        elif probe[1] != spec:
            why = "the layer's call had another structure in the probe"
        else:
            p = probe[0][i]
            if not isinstance(p, torch.Tensor) or p.shape[1:] != x.shape[1:]:
                why = f"it came back as {type(p).__name__} {tuple(getattr(p, 'shape', ()))} in the probe"
            elif p.shape[0] == x.shape[0]:
                return None  # independent of the batch: passed whole
            elif p.shape[0] != r * (batch + 1):
                why = f"its leading dim became {p.shape[0]} in the probe"
            elif not _same(p[r * batch:], p[r * (batch - 1):r * batch]):
                why = "the repeated sequence's rows are not one block equal to the sequence's own"
            else:
                return r
        raise RuntimeError(
            f"hf_megatrain: micro_batch_size: cannot tell whether input {i} of {name} (shape {tuple(x.shape)}, "
            f"leading dim a multiple of the batch size {batch}) holds rows of the batch or is shared by all of "
            f"them: {why}. Set micro_batch_size=0 (no in-layer split), or a batch size that is not a divisor of "
            f"{x.shape[0]}.")

    # -- the probe --------------------------------------------------------------------------------------------------
    def _probe(self, batch: int) -> None:
        """Re-run the owning module on the batch with its last sequence repeated; the layers' calls land in
        ``_probe_calls``."""
        self._probe_calls, self._probe_error = {}, None
        if self.decoder is None:
            self._probe_error = "the layer was called outside the forward of the module that owns the stack"
            return
        module, args, kwargs = self.decoder

        def grow(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch:
                return torch.cat([x, x[-1:]])
            return x

        devices = sorted({x.device.index for x in pytree.tree_leaves((args, kwargs))
                          if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
        self.probing = True
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
                # (nested too: a multimodal model hands its language model per-layer-type masks in a dict; its
                # M-RoPE position ids are [sections, batch, seq]: Qwen-VL)
                grown_args, grown_kwargs = pytree.tree_map(grow, (list(args), kwargs))
                pos = kwargs.get("position_ids")
                if isinstance(pos, torch.Tensor) and pos.dim() == 3 and pos.shape[1] == batch:
                    grown_kwargs["position_ids"] = torch.cat([pos, pos[:, -1:]], dim=1)
                module.forward(*grown_args, **grown_kwargs)
        except _StopProbe:
            pass
        except Exception as e:  # noqa: BLE001 - reported where a decision needed the probe
            self._probe_error = f"re-running {type(module).__name__} on {batch + 1} sequences failed " \
                                f"({type(e).__name__}: {e})"
        finally:
            self.probing = False

    def visit(self, index: int, hidden: torch.Tensor, call: Call) -> Any:
        """A streamed layer's call during a probe: recorded; the hidden state passed through in the layer's own
        output structure (other outputs zeros of their shape), or the probe ends where that structure is unknown."""
        self._probe_calls[index] = pytree.tree_flatten(call)
        known = self._outputs.get(index)
        if known is None:
            raise _StopProbe
        layout, metas, batch = known
        grown, flat = hidden.shape[0], self._probe_calls[index][0]
        tensors = [hidden] + [flat[k] if k is not None else torch.zeros(
            (s[0] // batch * grown if row else s[0], *s[1:]), dtype=dt, device=hidden.device)
            for s, dt, row, k in metas[1:]]
        return layout.rebuild(tensors)
