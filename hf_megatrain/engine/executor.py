"""StreamingExecutor: runs decoder layer i from a GPU slot while layer i±1 streams into another.

Streams (CUDA): H2D prefetch, compute (the current stream), D2H gradient offload; ordered with events:

    h2d:     [load i+1 into slot B] ......... waits slot B's last compute
    compute: [wait ready A][layer i on A] [wait ready B][layer i+1 on B] ...
    d2h:                     [grad i -> host] waits the copy of grad i into an offload buffer

On the CPU the same calls run in program order. Weights in: ``WeightSlots`` (slots.py); the layer runs through its
stateless template (model/template.py); gradients out: ``GradientOffload`` (offload.py); each picks its strategy
per unit plan at construction. The proxies and their autograd Function are in proxy.py.

Frozen parameters (PEFT base, frozen layers) stream in the same slot, after the trainable ones; they get no
gradient, and a layer with nothing trainable only passes the input gradient through. Layers that draw random
numbers (dropout, router jitter) record the RNG state of each forward chunk, and the recompute replays it, so the
backward differentiates exactly the function the forward computed (as ``torch.utils.checkpoint`` does).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..core.step_state import StepState
from ..core.store import Unit
from ..core.streams import StreamSet
from ..model.template import LayerTemplate
from .offload import GradientOffload
from .slots import WeightSlots


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
    def __init__(self, units: list[Unit], state: StepState, kinds: list[int], templates: list[LayerTemplate],
                 buffers: list[dict[str, torch.Tensor]], *, device: torch.device, compute_dtype: torch.dtype,
                 grad_offload_dtype: torch.dtype, num_slots: int, micro_batch_size: int, pin: bool) -> None:
        self.units, self.kinds, self.templates, self.buffers = units, kinds, templates, buffers
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.streams = StreamSet(device)
        self.weights = WeightSlots(units, state, self.streams, device=device, compute_dtype=compute_dtype,
                                   num_slots=num_slots)
        self.grads = GradientOffload(units, state, self.streams, device=device, compute_dtype=compute_dtype,
                                     offload_dtype=grad_offload_dtype, pin=pin)
        self.training = True
        # Any input that requires grad makes autograd call our backward even when the hidden state does not
        # (frozen embeddings, PEFT): the anchor guarantees that.
        self.grad_anchor = torch.zeros((), device=device, requires_grad=True)
        # Optional side-output tap (families.RouterTap): tensors a layer forward produces besides its hidden state.
        self.tap: Any = None
        # RNG states of the last stochastic forward, per chunk (read by the layer Function into its ctx).
        self.last_rng: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    # -- counters (benchmarks, logs) ---------------------------------------------------------------------------------
    @property
    def h2d_bytes(self) -> int:
        return self.weights.h2d_bytes

    @property
    def d2h_bytes(self) -> int:
        return self.grads.d2h_bytes

    @property
    def wait_optimizer_s(self) -> float:
        return self.weights.wait_optimizer_s

    def finish(self) -> None:
        """Land every in-flight gradient and let the host touch weights again (a lander of the step state)."""
        self.grads.finish()
        if self.streams.is_cuda:
            self.streams.h2d.synchronize()

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
        s = self.weights.acquire(index, +1)
        tmpl = self.templates[self.kinds[index]]
        params = tmpl.bind(self.weights.slots[s])
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
        self.weights.release(s)
        return out

    def _backward_layer(self, index: int, hidden: torch.Tensor, call: tuple[tuple, dict],
                        grad_out: torch.Tensor, side_grads: tuple = (), rng: list | None = None) -> torch.Tensor | None:
        unit = self.units[index]
        n = unit.numel
        want_input_grad = hidden.requires_grad
        if n == 0 and not want_input_grad:
            return None  # nothing trainable here and nothing before it: no recompute needed
        s = self.weights.acquire(index, -1)
        tmpl = self.templates[self.kinds[index]]
        params = tmpl.bind(self.weights.slots[s], requires_grad=True)
        trainable = [params[p.local] for p in tmpl.layout]
        gp = self.grads.grad_param
        grads = tmpl.bind(gp, frozen=False)
        for p in tmpl.layout:
            params[p.local].grad = grads[p.local]
        k, off = self.grads.buffer(n)
        args, kwargs = call
        batch = hidden.shape[0]
        chunks = self._chunks(batch)
        grad_in = torch.empty_like(hidden) if want_input_grad and len(chunks) > 1 else None
        for c, (a, b) in enumerate(chunks):
            gp[:n].zero_()
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
                off.copy_(gp[:n])
            else:
                off.add_(gp[:n])
        self.weights.release(s)
        if n == 0:  # frozen layer: only the input gradient leaves
            return grad_in
        self.grads.send(index, k)
        return grad_in
