"""StreamingExecutor: runs decoder layer i from a GPU slot while layer i±1 streams into another.

The HF model's own forward loop still calls ``model.layers[i](hidden, **kwargs)``; each entry is a
``StreamedLayer`` proxy whose call is one autograd Function. Its forward binds the slot's weights into the
layer's stateless template and runs under ``no_grad`` (keeping only the boundary activation); its backward
recomputes the layer with grad, sends the weight gradient to the host and returns the input gradient. Autograd
calls the backwards in reverse layer order, so prefetching i-1 in the backward of i double-buffers both passes.

Streams (CUDA): H2D prefetch, compute (the current stream), D2H gradient offload; ordered with events:

    h2d:     [load i+1 into slot B] ......... waits slot B's last compute
    compute: [wait ready A][layer i on A] [wait ready B][layer i+1 on B] ...
    d2h:                     [grad i -> host] waits the copy of grad i into an offload buffer

On the CPU the same calls run in program order.

Lean store (host_store.py): a lean unit's weights stream as the FP32 master and are cast to compute dtype on the
GPU in chunks through a small FP32 staging buffer (``_copy_in``), and its gradient has no host buffer: it goes
D2H into one of two staging slabs and is handed to ``lean_sink`` (the optimizer, lean_step.py), which must
release the slab before the executor reuses it.

Frozen parameters (PEFT base, frozen layers) stream in the same slot, after the trainable ones; they get no
gradient, and a layer with nothing trainable only passes the input gradient through. Layers that draw random
numbers (dropout, router jitter) record the RNG state of each forward chunk, and the recompute replays it, so the
backward differentiates exactly the function the forward computed (as ``torch.utils.checkpoint`` does).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..core.store import Unit
from ..model.layers import copy_plain_attributes
from ..core.memory import alloc_host
from ..core.streams import StreamSet
from ..model.template import LayerTemplate

# Lean store: FP32 master chunks cast to compute dtype on the GPU go through a staging buffer of at most this size,
# so no full FP32 copy of a layer ever sits in GPU memory.
LEAN_H2D_CHUNK_BYTES = 128 * 1024 ** 2


def _batch_slice(obj: Any, a: int, b: int, batch: int) -> Any:
    """Slice every tensor whose leading dim is the batch; broadcastable (dim 0 == 1) tensors pass unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj[a:b] if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, tuple):
        return tuple(_batch_slice(x, a, b, batch) for x in obj)
    if isinstance(obj, list):
        return [_batch_slice(x, a, b, batch) for x in obj]
    if isinstance(obj, dict):
        return {k: _batch_slice(v, a, b, batch) for k, v in obj.items()}
    return obj


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class StreamingExecutor:
    def __init__(self, units: list[Unit], kinds: list[int], templates: list[LayerTemplate],
                 buffers: list[dict[str, torch.Tensor]], *, device: torch.device, compute_dtype: torch.dtype,
                 grad_offload_dtype: torch.dtype, num_slots: int, micro_batch_size: int, pin: bool,
                 kept: set[int] | frozenset[int] = frozenset()) -> None:
        self.units, self.kinds, self.templates, self.buffers = units, kinds, templates, buffers
        # Layers kept whole on the device: their FP32 master is cast into a slot on the compute stream (ordered
        # after their AdamW, which runs there too) and their gradient accumulates in ``unit.grad_device``.
        self.kept = set(kept)
        self.device, self.compute_dtype = device, compute_dtype
        self.micro_batch_size = micro_batch_size
        self.streams = StreamSet(device)
        n = max(u.numel for u in units)
        slot_numel = max(u.numel + u.frozen_numel for u in units)
        self.slots = [torch.empty(slot_numel, dtype=compute_dtype, device=device) for _ in range(num_slots)]
        self.slot_layer = [-1] * num_slots
        self.slot_ready: list[Any] = [None] * num_slots
        self.slot_free: list[Any] = [None] * num_slots
        self.slot_tick = [0] * num_slots
        self._tick = 0
        # Weight gradients of one layer visit (compute dtype; autograd accumulates into these views in place),
        # then cast into one of two offload buffers that the D2H stream drains into host memory.
        self.grad_param = torch.zeros(n, dtype=compute_dtype, device=device)
        self.offload = [torch.empty(n, dtype=grad_offload_dtype, device=device) for _ in range(2)]
        self.staging = [alloc_host(n, grad_offload_dtype, pin) for _ in range(2)]
        self.offload_done: list[Any] = [None, None]
        self.pending: list[tuple[Unit, bool] | None] = [None, None]  # (unit, host must add staging)
        # Lean store: units streamed as FP32 masters need an FP32 staging buffer on the GPU for the cast.
        cast_numel = max((u.numel for u in units if u.compute.dtype != compute_dtype), default=0)
        self.h2d_stage = (torch.empty(min(cast_numel, LEAN_H2D_CHUNK_BYTES // 4), dtype=torch.float32, device=device)
                          if cast_numel and device.type == "cuda" else None)
        # Lean store: the optimizer's sink for a finished layer gradient: (unit, host slab, host squared norm, D2H
        # event) -> a wait() callable that returns once the slab (and squared-norm cell) may be overwritten.
        self.lean_sink: Callable[[Unit, torch.Tensor, torch.Tensor, Any], Callable[[], None]] | None = None
        self.lean_wait: list[Callable[[], None] | None] = [None, None]
        self.sq_host = [alloc_host(1, torch.float32, pin) for _ in range(2)] if any(u.grad is None for u in units) \
            else []
        self._next_offload = 0
        self.training = True
        self.backward_ran = False
        # Set by an overlapped optimizer: block until unit i's step (and streaming copy) is done.
        self.wait_for_unit: Callable[[int], None] | None = None
        self.wait_optimizer_s = 0.0  # host time the streamed passes spent waiting for the CPU optimizer
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        # Any input that requires grad makes autograd call our backward even when the hidden state does not
        # (frozen embeddings, PEFT): the anchor guarantees that.
        self.grad_anchor = torch.zeros((), device=device, requires_grad=True)
        # Optional side-output tap (families.RouterTap): collects tensors a layer forward produces besides its
        # hidden state (MoE router logits); they become extra outputs of the layer's autograd Function, so a
        # loss term on them (the router aux loss) sends its gradient into that layer's recompute.
        self.tap: Any = None
        # RNG states of the last stochastic forward, per chunk (read by the layer Function into its ctx).
        self.last_rng: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    # -- weights in ---------------------------------------------------------------------------------------------------
    def _load(self, index: int, protect: set[int]) -> int:
        if index in self.slot_layer:
            return self.slot_layer.index(index)
        free = [s for s in range(len(self.slots)) if s not in protect]
        s = min(free, key=lambda k: self.slot_tick[k])
        if self.wait_for_unit is not None:
            t0 = time.perf_counter()
            with torch.profiler.record_function("megatrain.wait_optimizer"):
                self.wait_for_unit(index)
            self.wait_optimizer_s += time.perf_counter() - t0
        unit = self.units[index]
        st = self.streams
        self.slot_layer[s] = index
        if index in self.kept:
            st.wait(st.compute, self.slot_free[s])
            self.slots[s][:unit.numel].copy_(unit.master)  # device cast, no PCIe
            self.slot_ready[s] = None
            return s
        with st.on(st.h2d):
            st.wait(st.h2d, self.slot_free[s])
            self._copy_in(self.slots[s][:unit.numel], unit.compute)
            if unit.frozen is not None:
                self.slots[s][unit.numel:unit.numel + unit.frozen.numel()].copy_(unit.frozen, non_blocking=True)
            self.slot_ready[s] = st.record(st.h2d)
        self.h2d_bytes += unit.numel * unit.compute.element_size() + unit.frozen_numel * self.slots[s].element_size()
        return s

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host -> slot copy on the current (H2D) stream. A lean unit's FP32 master goes through the FP32 staging
        buffer chunk by chunk and is cast on the GPU (a direct non-blocking copy with a dtype change would allocate
        a full FP32 temporary of the layer on the GPU); chunks reuse the buffer in stream order."""
        if src.dtype == dst.dtype or self.h2d_stage is None:
            dst.copy_(src, non_blocking=True)  # (on the CPU a cast copy: same rounding as the GPU cast)
            return
        c = self.h2d_stage.numel()
        for a in range(0, src.numel(), c):
            b = min(a + c, src.numel())
            stage = self.h2d_stage[:b - a]
            stage.copy_(src[a:b], non_blocking=True)
            dst[a:b].copy_(stage)

    def _acquire(self, index: int, step: int) -> int:
        """Make layer ``index`` resident, prefetch the next layers in pass direction ``step`` (+1 / -1)."""
        s = self._load(index, protect=set())
        self._tick += 1
        self.slot_tick[s] = self._tick
        protect = {s}
        for k in range(1, len(self.slots)):
            j = index + k * step
            if not 0 <= j < len(self.units):
                break
            protect.add(self._load(j, protect))
        self.streams.wait(self.streams.compute, self.slot_ready[s])
        return s

    def invalidate(self) -> None:
        """Forget slot contents (the optimizer changed the weights)."""
        self.slot_layer = [-1] * len(self.slots)

    # -- compute ------------------------------------------------------------------------------------------------------
    def _chunks(self, batch: int) -> list[tuple[int, int]]:
        m = self.micro_batch_size
        if m <= 0 or m >= batch:
            return [(0, batch)]
        return [(a, min(a + m, batch)) for a in range(0, batch, m)]

    def forward_layer(self, index: int, hidden: torch.Tensor, call: tuple[tuple, dict],
                      recompute: bool = False) -> torch.Tensor:
        """``recompute``: the backward will recompute this visit (the RNG state of stochastic layers is kept)."""
        with torch.profiler.record_function("megatrain.forward"):
            return self._forward_layer(index, hidden, call, recompute)

    def backward_layer(self, index: int, hidden: torch.Tensor, call: tuple[tuple, dict],
                       grad_out: torch.Tensor, side_grads: tuple = (), rng: list | None = None) -> torch.Tensor | None:
        with torch.profiler.record_function("megatrain.backward"):
            return self._backward_layer(index, hidden, call, grad_out, side_grads, rng)

    # -- random numbers -------------------------------------------------------------------------------------------------
    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        dev = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), dev

    @contextmanager
    def _replay(self, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> Iterator[None]:
        """Run a recompute with the forward's RNG state; the caller's state is restored afterwards."""
        if state is None:
            yield
            return
        cuda = state[1] is not None
        with torch.random.fork_rng(devices=[self.device] if cuda else [], device_type="cuda" if cuda else "cpu"):
            torch.set_rng_state(state[0])
            if cuda:
                torch.cuda.set_rng_state(state[1], self.device)
            yield

    def _forward_layer(self, index: int, hidden: torch.Tensor, call: tuple[tuple, dict],
                       recompute: bool) -> torch.Tensor:
        s = self._acquire(index, +1)
        tmpl = self.templates[self.kinds[index]]
        params = tmpl.bind(self.slots[s])
        args, kwargs = call
        batch = hidden.shape[0]
        chunks = self._chunks(batch)
        rng = [] if recompute and self.training and tmpl.stochastic else None
        with torch.no_grad():
            if len(chunks) == 1:
                if rng is not None:
                    rng.append(self._rng_state())
                out = _first(tmpl(params, self.buffers[index], self.training, (hidden, *args), kwargs))
            else:
                outs = []
                for a, b in chunks:
                    if rng is not None:
                        rng.append(self._rng_state())
                    outs.append(_first(tmpl(params, self.buffers[index], self.training,
                                            (hidden[a:b], *_batch_slice(args, a, b, batch)),
                                            _batch_slice(kwargs, a, b, batch))))
                out = torch.cat(outs)
        self.last_rng = rng
        self.slot_free[s] = self.streams.record(self.streams.compute)
        return out

    def _backward_layer(self, index: int, hidden: torch.Tensor, call: tuple[tuple, dict],
                        grad_out: torch.Tensor, side_grads: tuple = (), rng: list | None = None) -> torch.Tensor | None:
        self.backward_ran = True
        unit = self.units[index]
        n = unit.numel
        want_input_grad = hidden.requires_grad
        if n == 0 and not want_input_grad:
            return None  # nothing trainable here and nothing before it: no recompute needed
        s = self._acquire(index, -1)
        tmpl = self.templates[self.kinds[index]]
        params = tmpl.bind(self.slots[s], requires_grad=True)
        trainable = [params[p.local] for p in tmpl.layout]
        grads = tmpl.bind(self.grad_param, frozen=False)
        for p in tmpl.layout:
            params[p.local].grad = grads[p.local]
        k = self._next_offload
        self._next_offload ^= 1
        st = self.streams
        st.wait(st.compute, self.offload_done[k])  # offload buffer k drained by its previous D2H
        off = self.offload[k][:n]
        args, kwargs = call
        batch = hidden.shape[0]
        chunks = self._chunks(batch)
        grad_in = torch.empty_like(hidden) if want_input_grad and len(chunks) > 1 else None
        for c, (a, b) in enumerate(chunks):
            self.grad_param[:n].zero_()
            h = hidden[a:b].detach().requires_grad_(want_input_grad)
            sub_args = _batch_slice(args, a, b, batch) if len(chunks) > 1 else args
            sub_kwargs = _batch_slice(kwargs, a, b, batch) if len(chunks) > 1 else kwargs
            tap = self.tap if any(g is not None for g in side_grads) else None
            with self._replay(rng[c] if rng else None), torch.enable_grad():
                if tap is not None:
                    tap.start()
                out = _first(tmpl(params, self.buffers[index], self.training, (h, *sub_args), sub_kwargs))
                side = tap.stop() if tap is not None else []
            inputs = ([h] if want_input_grad else []) + trainable
            outs, gouts = [out], [grad_out[a:b]]
            for t, g in zip(side, side_grads):  # side outputs are batch-major rows: slice this chunk's rows
                if g is not None:
                    r = g.shape[0] // batch
                    outs.append(t)
                    gouts.append(g[a * r:b * r])
            torch.autograd.backward(outs, gouts, inputs=inputs)
            if want_input_grad:
                if grad_in is None:
                    grad_in = h.grad
                else:
                    grad_in[a:b] = h.grad
            if n == 0:
                continue
            if c == 0:
                off.copy_(self.grad_param[:n])
            else:
                off.add_(self.grad_param[:n])
        self.slot_free[s] = st.record(st.compute)
        if n == 0:  # frozen layer: only the input gradient leaves
            return grad_in
        # Fold the gradient-norm reduction into the gradient's departure (first visit of this step only).
        first = unit.grad is None or not unit.grad_valid and all(
            self.pending[j] is None or self.pending[j][0] is not unit for j in (0, 1))
        sq = torch.linalg.vector_norm(off, dtype=torch.float32).square() if first else None
        if unit.grad is None:  # lean store: the optimizer consumes the gradient from a staging slab
            self._offload_lean(k, unit, st.record(st.compute), sq)
        elif unit.grad_device is not None:
            # AdamW of this unit runs on the GPU (DeviceStepper): its gradient stays here, FP32-accumulated.
            if unit.grad_valid:
                unit.grad_device.add_(off)
            else:
                unit.grad_device.copy_(off)
            unit.grad_sq = sq
            unit.grad_valid = True
            self.offload_done[k] = st.record(st.compute)
        else:
            self._offload(k, unit, st.record(st.compute), sq)
        return grad_in

    # -- gradients out --------------------------------------------------------------------------------------------------
    def _offload(self, k: int, unit: Unit, ready: Any, sq: torch.Tensor | None) -> None:
        self._drain(k)
        first = not unit.grad_valid and sq is not None
        unit.grad_sq = sq if first else None
        off = self.offload[k][:unit.numel]
        direct = not unit.grad_valid and off.dtype == unit.grad.dtype
        dst = unit.grad if direct else self.staging[k][:unit.numel]
        st = self.streams
        with st.on(st.d2h):
            st.wait(st.d2h, ready)
            dst.copy_(off, non_blocking=True)
            self.offload_done[k] = st.record(st.d2h)
        self.d2h_bytes += off.numel() * off.element_size()
        self.pending[k] = (unit, not direct)

    def _offload_lean(self, k: int, unit: Unit, ready: Any, sq: torch.Tensor) -> None:
        if self.lean_sink is None:
            raise RuntimeError("hf_megatrain: lean_store needs the optimizer before the first backward "
                               "(engine.create_optimizer)")
        self._drain(k)  # slab k released by the optimizer (it may still be reading the gradient of two layers up)
        n = unit.numel
        slab, sq_host = self.staging[k][:n], self.sq_host[k][0]
        st = self.streams
        with st.on(st.d2h):
            st.wait(st.d2h, ready)
            slab.copy_(self.offload[k][:n], non_blocking=True)
            sq_host.copy_(sq, non_blocking=True)
            self.offload_done[k] = st.record(st.d2h)
        self.d2h_bytes += n * slab.element_size()
        self.pending[k] = (unit, False)
        unit.grad_sq = sq  # keeps the device scalar alive until its copy is done
        self.lean_wait[k] = self.lean_sink(unit, slab, sq_host, self.offload_done[k])

    def _drain(self, k: int) -> None:
        wait = self.lean_wait[k]
        if wait is not None:
            self.lean_wait[k] = None
            self.pending[k] = None
            wait()
            return
        item = self.pending[k]
        if item is None:
            return
        self.streams.synchronize(self.offload_done[k])
        unit, via_staging = item
        if via_staging:
            src = self.staging[k][:unit.numel]
            if unit.grad_valid:
                unit.grad.add_(src)
            else:
                unit.grad.copy_(src)
        unit.grad_valid = True
        self.pending[k] = None

    def finish(self) -> None:
        """Land every in-flight gradient in host memory and let the host touch weights again."""
        for k in (0, 1):
            self._drain(k)
        if self.streams.is_cuda:
            self.streams.h2d.synchronize()
        self.backward_ran = False


class _StreamedLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, executor: StreamingExecutor, index: int, call: tuple, anchor: torch.Tensor,  # type: ignore[override]
                hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        ctx.executor, ctx.index, ctx.call = executor, index, call
        ctx.save_for_backward(hidden)
        tap = executor.tap if executor.tap is not None and executor.tap.active else None
        if tap is None:
            out = executor.forward_layer(index, hidden, call, recompute=True)
            ctx.rng = executor.last_rng
            return out
        tap.start()
        out = executor.forward_layer(index, hidden, call, recompute=True)
        ctx.rng = executor.last_rng
        side = tap.stop()
        ctx.set_materialize_grads(False)  # an unused side output (no aux loss) costs no gradient
        return (out, *side)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, *side_grads: torch.Tensor | None):  # type: ignore[override]
        (hidden,) = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(hidden)
        grad_in = ctx.executor.backward_layer(ctx.index, hidden, ctx.call, grad_out, side_grads, ctx.rng)
        return None, None, None, None, grad_in


class StreamedLayer(nn.Module):
    """Stands in for decoder layer ``index`` inside the HF model; owns no weights."""

    def __init__(self, executor: StreamingExecutor, index: int, original: nn.Module) -> None:
        super().__init__()
        copy_plain_attributes(original, self)
        self.index = index
        self._executor = [executor]  # a list keeps it out of the module tree

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ex = self._executor[0]
        call = (args, kwargs)
        tap = ex.tap if ex.tap is not None and ex.tap.active else None
        if torch.is_grad_enabled():
            out = _StreamedLayerFunction.apply(ex, self.index, call, ex.grad_anchor, hidden_states)
            if tap is None:
                return out
            tap.record(out[1:])
            return out[0]
        if tap is not None:
            tap.start()
        out = ex.forward_layer(self.index, hidden_states, call)
        if tap is not None:
            tap.record(tap.stop())
        return out
