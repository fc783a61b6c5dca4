"""StreamingExecutor: runs decoder layer i from a GPU slot while layer i±1 streams into another.

Streams (CUDA): H2D prefetch, compute (the current stream), D2H gradient offload; ordered with events:

    h2d:     [load i+1 into slot B] ......... waits slot B's last compute
    compute: [wait ready A][layer i on A] [wait ready B][layer i+1 on B] ...
    d2h:                     [grad i -> host] waits the copy of grad i into an offload buffer

On the CPU the same calls run in program order. Weights in: ``WeightSlots`` (slots.py); the layer runs through its
stateless template (model/template.py); gradients out: ``GradientOffload`` (offload.py); each picks its strategy
per unit plan at construction; the layers' saved inputs: ``ActivationStore`` (activations.py). The proxies and
their autograd Function are in proxy.py.

Frozen parameters (PEFT base, frozen layers) stream in the same slot, after the trainable ones; they get no
gradient, and a layer with nothing trainable only passes the input gradient through. Layers that draw random
numbers (dropout, router jitter) record the RNG state of each forward chunk, and the recompute replays it, so the
backward differentiates exactly the function the forward computed (as ``torch.utils.checkpoint`` does).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils import _pytree as pytree

from ..core.plan import Where
from ..core.step_state import StepState
from ..core.store import Unit
from ..core.streams import StreamSet
from ..model.cross_layer import collect_writes
from ..model.template import LayerTemplate
from .activations import ActivationStore
from .batch_rows import BatchRows
from .layer_io import Call, OutLayout, merge_chunks, slice_call
from .offload import GradientOffload
from .saved_graph import SavedGraph, SavedGraphs
from ..core.grad_reach import GradReach
from .slots import WeightSlots

if TYPE_CHECKING:
    from ..parallel.group import DataParallel
    from .weight_gather import WeightGather


class StreamingExecutor:
    def __init__(self, units: list[Unit], state: StepState, kinds: list[int], templates: list[LayerTemplate],
                 buffers: list[dict[str, torch.Tensor]], *, device: torch.device, compute_dtype: torch.dtype,
                 grad_offload_dtype: torch.dtype, num_slots: int, micro_batch_size: int, pin: bool,
                 activation_prefetch: int = 2, dp: DataParallel | None = None,
                 narrow: torch.dtype | None = None, gather: WeightGather | None = None,
                 exchange: str = "reduce_scatter") -> None:
        self.units, self.kinds, self.templates, self.buffers = units, kinds, templates, buffers
        self.device = device
        self.state = state
        # Which parameters each backward reached (the optimizer skips the others, as torch.optim.AdamW does).
        self.reach = GradReach()
        self.micro_batch_size = micro_batch_size
        self.rows = BatchRows()  # which call inputs hold rows of the batch (sliced per micro-batch)
        self.streams = StreamSet(device)
        self.weights = WeightSlots(units, state, self.streams, device=device, compute_dtype=compute_dtype,
                                   num_slots=num_slots, gather=gather)
        self.grads = GradientOffload(units, state, self.streams, device=device, compute_dtype=compute_dtype,
                                     offload_dtype=grad_offload_dtype, pin=pin, dp=dp, narrow=narrow,
                                     exchange=exchange)
        # The layers' saved inputs, on the device or offloaded to host (the engine sets which per step shape).
        self.activations = ActivationStore(device, prefetch=activation_prefetch, pin=pin)
        self.training = True
        # Any input that requires grad makes autograd call our backward even when the hidden state does not
        # (frozen embeddings, PEFT): the anchor guarantees that.
        self.grad_anchor = torch.zeros((), device=device, requires_grad=True)
        # Visits per layer in the engine's current forward (lean units take one gradient each: runtime.forward).
        self.visits: dict[int, int] = {}
        # Optional side-output tap (families.RouterTap): tensors a layer forward produces besides its hidden state.
        self.tap: Any = None
        # RNG states of the last stochastic forward, per chunk (read by the layer Function into its ctx).
        self.last_rng: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        # Output layout of the last forward (read by the proxy to rebuild the layer's own output structure).
        self.last_layout: OutLayout | None = None
        # Layers whose training forward keeps its graph for the backward (the engine sets them per step shape:
        # planner/saved_graphs.py), and the graphs alive; the other layers are recomputed from their saved input.
        self.saved_graphs = SavedGraphs()

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

    @property
    def gpu_wait_optimizer_s(self) -> float | None:
        return self.weights.gpu_wait_optimizer_s

    def begin_forward(self, training: bool) -> None:
        """A forward of the layer stack starts (engine/runtime.py, its module's pre-hook): in training mode or not;
        a training forward with autograd on is one every data-parallel rank runs alike (weight_gather.py)."""
        self.training = training
        self.weights.begin_pass(training and torch.is_grad_enabled())

    def end_forward(self, completed: bool) -> None:
        """The forward of the layer stack ended; ``completed``: it returned (not raised), so the loads it owes the
        other ranks are made (a raising rank makes none: its failure ends the others, parallel/liveness.py)."""
        if completed:
            self.weights.end_pass()
        else:
            self.weights.begin_pass(False)

    def finish(self) -> None:
        """Land every in-flight gradient and let the host touch weights again."""
        self.grads.finish()
        if self.streams.is_cuda:
            self.streams.h2d.synchronize()

    def land(self) -> None:
        """The step's land phase for the streamed layers (engine/landing.py): ``finish``, and nothing is left
        unlanded."""
        self.grads.land()
        if self.streams.is_cuda:
            self.streams.h2d.synchronize()

    # -- compute ------------------------------------------------------------------------------------------------------
    def _chunks(self, batch: int) -> list[tuple[int, int]]:
        m = self.micro_batch_size
        if m <= 0 or m >= batch:
            return [(0, batch)]
        return [(a, min(a + m, batch)) for a in range(0, batch, m)]

    def forward_layer(self, index: int, hidden: torch.Tensor, call: Call,
                      recompute: bool = False) -> tuple[list[torch.Tensor], OutLayout]:
        """Run layer ``index`` (no grad): its output as (tensors, layout), ``layout.rebuild(tensors)`` being what the
        layer returned. ``recompute``: the backward will recompute this visit (stochastic layers' RNG is kept)."""
        self.visits[index] = self.visits.get(index, 0) + 1
        with torch.profiler.record_function("megatrain.forward"):
            return self._forward_layer(index, hidden, call, recompute)

    @property
    def graph_layers(self) -> frozenset[int]:
        """The layers whose training forward keeps its graph (``saved_graph_layers``)."""
        return self.saved_graphs.layers

    @property
    def live_graphs(self) -> int:
        """Kept forward graphs not yet taken by their backward (or dropped)."""
        return self.saved_graphs.live

    def keeps_graph(self, index: int, hidden: torch.Tensor) -> bool:
        """Whether this training visit of layer ``index`` keeps its forward's graph: a chosen layer, run whole (a
        visit split by ``micro_batch_size`` recomputes chunk by chunk to bound its memory), while fewer graphs are
        alive than one forward keeps (a second forward before the backward recomputes), its input not offloaded,
        and drawing no random numbers."""
        return (self.saved_graphs.wanted(index) and self.training and len(self._chunks(hidden.shape[0])) == 1
                and index not in self.activations.offload
                and not self.templates[self.kinds[index]].stochastic)  # (a second backward recomputes: no RNG kept)

    def forward_layer_saving(self, index: int, hidden: torch.Tensor, call: Call, grad_pos: list[int],
                             needs: tuple[bool, ...]) -> tuple[list[torch.Tensor], OutLayout, SavedGraph]:
        """Run layer ``index`` with grad (``keeps_graph``), on its own copy of the weights: its outputs as
        ``forward_layer`` returns them (detached), and the graph its backward differentiates instead of a
        recompute. ``needs``: which of [hidden, *call leaves at grad_pos] want a gradient."""
        self.visits[index] = self.visits.get(index, 0) + 1
        with torch.profiler.record_function("megatrain.forward_saving"):
            unit = self.units[index]
            s = self.weights.acquire(index, +1)
            own = self.weights.slots[s][:unit.numel + unit.frozen_numel].clone()
            tmpl = self.templates[self.kinds[index]]
            params = tmpl.bind(own, requires_grad=True)
            flat, spec = pytree.tree_flatten(call)
            sources = [hidden, *(flat[p] for p in grad_pos)]
            leaves = [x.detach().requires_grad_() if need else None for x, need in zip(sources, needs)]
            # (the same call as a recompute's, whole: the proxy runs the tap around it)
            out, _ = self._recompute(index, tmpl, params, hidden, flat, spec, (0, hidden.shape[0]), None, grad_pos,
                                     leaves, False, None, False)
            # Released once the compute is queued, as in ``forward_layer``: the next layer's load may wait for its
            # update, and that wait should run beside this layer's compute, not before it is queued.
            self.weights.release(s)
            self.last_rng = None  # (nothing to replay: no recompute)
            tensors, layout = merge_chunks([out], [hidden.shape[0]], self._name(index))
            self.rows.saw_output(index, hidden.shape[0], flat, tensors, layout)
            return tensors, layout, self.saved_graphs.track(SavedGraph(params, leaves, out))

    def backward_layer(self, index: int, hidden: torch.Tensor, call: Call, grad_pos: list[int],
                       extras: list[torch.Tensor], needs: tuple[bool, ...], out_grads: tuple,
                       layout: OutLayout, side_grads: tuple = (), rng: list | None = None,
                       saved: SavedGraph | None = None) -> list[torch.Tensor | None]:
        """Recompute layer ``index`` with grad (or take ``saved``, its forward's graph) and back-propagate
        ``out_grads`` (one per tensor output, None where none came) and ``side_grads``: weight gradient to its
        sink, and the gradients of [hidden, *extras] (the call's leaves at ``grad_pos``) where ``needs`` says so."""
        with torch.profiler.record_function("megatrain.backward"):
            return self._backward_layer(index, hidden, call, grad_pos, extras, needs, out_grads, layout,
                                        side_grads, rng, saved)

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

    def _name(self, index: int) -> str:
        return f"layer {index} ({type(self.templates[self.kinds[index]].module).__name__})"

    def _forward_layer(self, index: int, hidden: torch.Tensor, call: Call,
                       recompute: bool) -> tuple[list[torch.Tensor], OutLayout]:
        s = self.weights.acquire(index, +1)
        tmpl = self.templates[self.kinds[index]]
        params = tmpl.bind(self.weights.slots[s])
        batch = hidden.shape[0]
        chunks = self._chunks(batch)
        flat, spec = pytree.tree_flatten(call)
        rows = self.rows.rows(index, batch, flat, spec, self._name(index)) if len(chunks) > 1 else None
        rng = [] if recompute and self.training and tmpl.stochastic else None
        outs = []
        with torch.no_grad():
            for a, b in chunks:
                if rng is not None:
                    rng.append(self._rng_state())
                args, kwargs = slice_call(flat, spec, a, b, rows)
                h = hidden if len(chunks) == 1 else hidden[a:b]
                outs.append(collect_writes(  # (keys/values it writes for later layers: outputs too)
                    lambda: tmpl(params, self.buffers[index], self.training, (h, *args), kwargs), args, kwargs))
        self.last_rng = rng
        self.weights.release(s)
        tensors, layout = merge_chunks(outs, [b - a for a, b in chunks], self._name(index))
        self.rows.saw_output(index, batch, flat, tensors, layout)
        return tensors, layout

    def _backward_layer(self, index: int, hidden: torch.Tensor, call: Call, grad_pos: list[int],
                        extras: list[torch.Tensor], needs: tuple[bool, ...], out_grads: tuple,
                        layout: OutLayout, side_grads: tuple = (), rng: list | None = None,
                        saved: SavedGraph | None = None) -> list[torch.Tensor | None]:
        unit = self.units[index]
        n = unit.numel
        sources = [hidden, *extras]  # the inputs whose gradients may be asked for
        grads_in: list[torch.Tensor | None] = [None] * len(sources)
        if n == 0 and not any(needs):
            return grads_in  # nothing trainable here and nothing before it: no recompute needed
        if all(g is None for g in out_grads) and all(g is None for g in side_grads):
            return grads_in  # no gradient reached this layer's outputs: none leaves it (as in plain autograd)
        tmpl = self.templates[self.kinds[index]]
        if saved is None:
            s = self.weights.acquire(index, -1)
            params = tmpl.bind(self.weights.slots[s], requires_grad=True)
        else:  # (no slot: the layers after it in the pass may start loading now, under this backward)
            params = saved.params
            if index > 0 and index - 1 not in self.graph_layers:
                self.weights.prefetch(index - 1)
        trainable = [params[p.local] for p in tmpl.layout]
        gp = self.grads.grad_param
        grads = tmpl.bind(gp, frozen=False)
        # Which parameters autograd reaches (torch's AdamW skips the others): a hook on each leaf fires with its grad.
        reached = [False] * len(trainable)
        for j, p in enumerate(tmpl.layout):
            params[p.local].grad = grads[p.local]
            params[p.local].register_hook(lambda g, j=j: reached.__setitem__(j, True))
        flat, spec = pytree.tree_flatten(call)
        batch = hidden.shape[0]
        chunks = self._chunks(batch)
        split = len(chunks) > 1
        k, off = self.grads.buffer(index, n, whole=not split)
        rows = self.rows.rows(index, batch, flat, spec, self._name(index)) if split else None
        per = [1] + [rows[p] if rows else None for p in grad_pos]  # rows per sequence of each source (hidden: 1)
        # Inputs that are not batch-major (broadcast over the batch) are one leaf for all chunks (autograd sums their
        # gradient); batch-major ones get a leaf per chunk, whose gradient fills the chunk's rows.
        whole = saved.leaves if saved is not None else [
            None if not need else (x.detach().requires_grad_() if not (split and r) else None)
            for x, need, r in zip(sources, needs, per)]
        for c, (a, b) in enumerate(chunks):
            gp[:n].zero_()
            leaves = [w if w is not None or not need else x[a * r:b * r].detach().requires_grad_()
                      for x, w, need, r in zip(sources, whole, needs, per)]
            if saved is not None:  # (one chunk: the forward ran whole)
                out, side = saved.out, saved.side
            else:
                out, side = self._recompute(index, tmpl, params, hidden, flat, spec, (a, b), rows, grad_pos,
                                            leaves, split, rng[c] if rng else None,
                                            any(g is not None for g in side_grads))
            outs, gouts = [], []
            for t, g, shared in zip(layout.tensors_of(out), out_grads, layout.shared):
                if g is None or not t.requires_grad or (shared and c > 0):
                    continue  # (a shared output is the first chunk's: only that chunk's recompute made it)
                outs.append(t)
                gouts.append(g if shared or not split else g[a:b])
            for t, g in zip(side, side_grads):  # split: side outputs are batch-major rows, slice this chunk's
                if g is not None:  # (whole: any shape, e.g. Doge's [2, tokens, keys] router logits)
                    r = g.shape[0] // batch
                    outs.append(t)
                    gouts.append(g[a * r:b * r] if split else g)
            inputs = [x for x in dict.fromkeys(leaves) if x is not None] + trainable
            if outs:
                torch.autograd.backward(outs, gouts, inputs=inputs)
            for i, (leaf, w) in enumerate(zip(leaves, whole)):
                if leaf is None or w is not None or leaf.grad is None:
                    continue  # (a whole leaf accumulates over chunks by itself)
                if grads_in[i] is None:
                    grads_in[i] = torch.zeros_like(sources[i])
                grads_in[i][a * per[i]:b * per[i]] = leaf.grad
            if n == 0:
                continue
            if c == 0:
                off.copy_(gp[:n])
            else:
                off.add_(gp[:n])
        if saved is None:
            self.weights.release(s)
        for i, w in enumerate(whole):
            if w is not None:
                grads_in[i] = w.grad
        if n > 0:  # (a frozen layer: only the input gradients leave)
            self._record_reach(unit, tmpl, reached)
            self.grads.send(index, k)
            if index == 0 and self.grads.final_backward and unit.plan.grad is Where.HOST:
                # The step's last layer gradient: land it now (a ~10 ms wait for its D2H), so its update starts at
                # the end of the backward rather than when step() lands it, after whatever the training loop does
                # in between (~40 ms of Trainer per step, measured) -- the next forward waits for this unit first.
                # (Not lean: there a drain waits for the layer's whole update, which step() waits for anyway.)
                self.grads.finish()
        return grads_in

    def _recompute(self, index: int, tmpl: LayerTemplate, params: dict[str, torch.Tensor], hidden: torch.Tensor,
                   flat: list, spec: Any, span: tuple[int, int], rows: Any, grad_pos: list[int],
                   leaves: list[torch.Tensor | None], split: bool, rng: Any, tapped: bool) -> tuple[Any, list]:
        """One chunk of layer ``index``'s forward with grad -- again from its saved input (the forward's RNG
        replayed), or the first time for a kept graph: (its raw output, the side outputs a tap collects when
        ``tapped``)."""
        a, b = span
        h = leaves[0] if leaves[0] is not None else (hidden[a:b] if split else hidden).detach()
        with self._replay(rng), torch.enable_grad():
            replace = {pos: leaf for pos, leaf in zip(grad_pos, leaves[1:]) if leaf is not None}
            args, kwargs = slice_call(flat, spec, a, b, rows, replace)
            tap = self.tap if tapped else None
            if tap is not None:
                tap.start()
            out = collect_writes(lambda: tmpl(params, self.buffers[index], self.training, (h, *args), kwargs),
                                 args, kwargs)
            side = tap.stop() if tap is not None else []
        return out, side

    def _record_reach(self, unit: Unit, tmpl: LayerTemplate, reached: list[bool]) -> None:
        if unit.grad is None:  # (no buffer to give a parameter no backward reached its zeros: a lean unit)
            if not all(reached):
                missing = [p.local for p, r in zip(tmpl.layout, reached) if not r]
                raise RuntimeError(
                    f"hf_megatrain: lean_store: parameters {missing[:4]} of layer {unit.index} received no gradient "
                    "in this backward (unused in the forward). torch.optim.AdamW skips such parameters, the lean "
                    "store cannot (it updates each layer whole as its gradient lands). Freeze them "
                    "(requires_grad_(False)) or use lean_store=False.")
            return
        self.reach.record(unit.index, reached, first=not self.state.has_grad(unit.index))
