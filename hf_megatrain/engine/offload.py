"""GradientOffload: where each layer visit's weight gradient goes once the recompute has produced it.

The backward accumulates a visit's weight gradient (compute dtype) into ``grad_param``, then casts it into one of
two offload buffers (``buffer()``); ``send`` hands it to the sink the unit's plan picked at construction:

    gradient on the device (kept, GPU-stepped)   accumulated there in FP32, on the compute stream
    gradient on the host                         D2H on the D2H stream: the step's first visit straight into the
                                                 host buffer, later ones (accumulation) through a staging buffer,
                                                 added when they land
    no gradient (lean)                           D2H into one of two FP32 staging slabs (or the sink's bf16
                                                 gradient plane: ``plane_slab``), with its squared norm, and
                                                 handed to the sink's ``consume`` (the lean optimizer), which
                                                 releases the slab before it is reused (data parallel: this
                                                 rank's shard of the reduce-scattered gradient, as below)

The sink (optim/gradient_path.py) is the optimizer, attached by the engine where it creates it: the one object
this module calls besides the step state. In the step's last backward (``final_backward``, which only the engine
sets: ``MegaTrainEngine.set_final_backward``) each host gradient that lands goes to the sink's ``landed`` right
here, so its speculative update starts while the backward runs.

A *narrow* gradient (``narrow``: core/plan.py ``decide_modes`` turns it on for a host kernel that reads one; given
at construction): a host unit's gradient that is the step's only visit (the step's last backward, first visit) and
computed whole (not split into micro-batches, whose sum is FP32) holds exactly the compute-dtype values autograd
produced, so it crosses PCIe and sits in the first half of the unit's FP32 host buffer in that dtype
(``StepState.narrow`` says so; ``Unit.grad_as``): half the D2H bytes and half the optimizer's gradient reads, the
same values. Readers outside the optimizer widen it first
(``Unit.widen_grad_``). A lean unit's visit is its step's only one: whole, it lands narrow in its slab.

The two offload buffers alternate, so layer i's D2H overlaps layer i-1's recompute. ``finish`` lands whatever is in
flight (``land``: the step's land phase, engine/landing.py).

Data parallel (``dp``, parallel/group.py): a host gradient is first ``reduce_scatter``ed over the node's ranks (on the
D2H stream, beside the next layer's backward; the buffer padded to ``local_world`` equal shards; with several nodes,
each shard then all-reduced across the nodes), and only this rank's shard -- the mean over all ranks of that range,
with its squared norm -- goes the host way above, into the node's shared host gradient at the shard's range. Every
rank of a node writes a disjoint range, so accumulation needs no coordination beyond each visit's collective.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core.memory import alloc_host
from ..core.plan import Where
from ..core.step_state import StepState
from ..core.store import Unit
from ..core.streams import StreamSet

if TYPE_CHECKING:
    from ..optim.gradient_path import GradientSink
    from ..parallel.group import DataParallel


logger = logging.getLogger(__name__)

_NEVER, _ALWAYS, _FIRST_FINAL = "never", "always", "first final visit"  # when a unit's visit may land narrow


class GradientOffload:
    def __init__(self, units: list[Unit], state: StepState, streams: StreamSet, *, device: torch.device,
                 compute_dtype: torch.dtype, offload_dtype: torch.dtype, pin: bool,
                 dp: DataParallel | None = None, narrow: torch.dtype | None = None,
                 exchange: str = "reduce_scatter") -> None:
        self.units, self.state, self.streams = units, state, streams
        self.dp = dp
        n = max(u.numel for u in units)
        # Weight gradients of one layer visit (autograd accumulates into views of it in place).
        self.grad_param = torch.zeros(n, dtype=compute_dtype, device=device)
        # (data parallel: padded to the node's equal shards, one per rank of the node)
        padded = n if dp is None else max(dp.shard_size(u.numel) * dp.local_world for u in units)
        self.offload = [torch.empty(padded, dtype=offload_dtype, device=device) for _ in range(2)]
        # This rank's reduced shard, per offload buffer (its D2H may still read it when the other one is filled).
        self.reduced = [] if dp is None else [torch.empty(padded // dp.local_world, dtype=offload_dtype,
                                                          device=device) for _ in range(2)]
        # Host staging (accumulating visits, narrow or lean gradients). Data parallel: a rank lands only its shard of
        # each host or lean gradient, so its staging holds the largest such shard, not a layer (N ranks would hold N
        # layers); device-landed (resident) gradients never pass through it.
        # Allocated at first use (``_slab``): a step's only visit of a host gradient lands straight in the store
        # (every step without gradient accumulation), and a pinned slab is resident whether used or not -- two of
        # the largest layer in the offload dtype, 11 GB at 123B width (FP32).
        staged = [u.numel if dp is None else dp.shard_size(u.numel) for u in units if u.plan.grad is not Where.DEVICE]
        self.staging_numel = max(staged, default=1)
        self.staging: list[torch.Tensor | None] = [None, None]
        self.staging_dtype, self._pin = offload_dtype, pin
        self.done: list[Any] = [None, None]  # event: offload buffer k drained
        # In flight per buffer: (unit, what landing does with the staging buffer: "", "copy", "add", at which
        # element of the unit's gradient, how many).
        self.pending: list[tuple[Unit, str, int, int] | None] = [None, None]
        self.lean_wait: list[Callable[[], None] | None] = [None, None]  # the consumer's wait() per slab
        # The route of each layer's gradients, decided here once from its plan (and data parallel for host ones).
        routes = {Where.DEVICE: self._to_device, Where.HOST: self._to_host if dp is None else self._to_shard,
                  Where.NONE: self._to_consumer if dp is None else self._shard_to_consumer}
        self.route: list[Callable[[int, Unit, torch.Tensor, bool], None]] = [routes[u.plan.grad] for u in units]
        # (the squared-norm cells of the consumer's two slabs)
        self.sq_host = [alloc_host(1, torch.float32, pin) for _ in range(2)]
        # Host units: each first visit's squared norm lands beside its gradient (read by a speculative step).
        self.sq_cells = alloc_host(len(units), torch.float32, pin)
        self._next = 0
        self.d2h_bytes = 0
        # The compute dtype when narrow gradients are on, else None; per unit, when its visit may land narrow
        # (decided here once: ALWAYS a consumed gradient, one per step; FIRST_FINAL a host gradient's only visit;
        # NEVER); per offload buffer, the dtype its current gradient is in when narrow.
        self.narrow = narrow
        when = {Where.NONE: _ALWAYS, Where.HOST: _FIRST_FINAL, Where.DEVICE: _NEVER}
        self._narrow_when = [when[u.plan.grad] if narrow is not None else _NEVER for u in units]
        self._narrow_k: list[torch.dtype | None] = [None, None]
        # Data parallel, ``exchange='all_to_all'``: the dtype a whole visit's gradient crosses to the shards' ranks in
        # (the compute dtype, half of FP32: the offload buffer's first half sends, its second half receives); per
        # offload buffer, whether its current gradient does.
        self.wire = compute_dtype if (dp is not None and exchange == "all_to_all" and compute_dtype.itemsize == 2
                                      and offload_dtype == torch.float32) else None
        if dp is not None and exchange == "all_to_all" and self.wire is None:
            logger.warning("hf_megatrain: gradient_exchange='all_to_all' needs 16-bit compute (here %s): the layer "
                           "gradients are reduce-scattered in FP32 instead", compute_dtype)
        self._wire_k: list[torch.dtype | None] = [None, None]
        # Where landed gradients go besides the step state (the optimizer; ``attach``), and whether the backward in
        # progress is the step's last (written only by engine/landing.py: ``MegaTrainEngine.set_final_backward``,
        # reset when the step's gradients are discarded).
        self.sink: GradientSink | None = None
        self._final_backward = False
        self._first_pending = False  # the step's last backward has sent no layer gradient yet
        self.unlanded = False  # a visit sent a gradient that the step's ``land`` has not landed yet

    @property
    def final_backward(self) -> bool:
        return self._final_backward

    @final_backward.setter
    def final_backward(self, final: bool) -> None:
        self._final_backward = final
        self._first_pending = final

    def attach(self, sink: GradientSink) -> None:
        """The optimizer the engine created (a replaced one's successor): the one sink of every gradient."""
        self.sink = sink

    def buffer(self, index: int, n: int, whole: bool) -> tuple[int, torch.Tensor]:
        """The next offload buffer (its previous D2H drained on the device), first ``n`` elements, for layer
        ``index``'s visit (``whole``: not split into micro-batches); narrow when that visit's gradient may be."""
        k = self._next
        self._next ^= 1
        self.streams.wait(self.streams.compute, self.done[k])
        self._narrow_k[k] = self.narrow if whole and self._may_narrow(index) else None
        # (a gradient summed over micro-batch chunks is FP32 already: it crosses as is)
        self._wire_k[k] = self.wire if whole and self.units[index].plan.grad is not Where.DEVICE else None
        return k, self._off(k, n)

    def _may_narrow(self, index: int) -> bool:
        when = self._narrow_when[index]
        return when is _ALWAYS or (when is _FIRST_FINAL and self.final_backward
                                          and not self.state.has_grad(self.units[index].index))

    def _off(self, k: int, n: int) -> torch.Tensor:
        dt = self._narrow_k[k] if self._narrow_k[k] is not None else self._wire_k[k]
        return self.offload[k][:n] if dt is None else self.offload[k].view(dt)[:n]

    def send(self, index: int, k: int) -> None:
        """Offload buffer ``k`` holds layer ``index``'s gradient for this visit: send it where its plan says."""
        unit = self.units[index]
        off = self._off(k, unit.numel)
        # The gradient-norm reduction rides along with the gradient's departure (first visit of the step only).
        first = not self.state.has_grad(unit.index)
        self.unlanded = True
        self.route[index](k, unit, off, first)
        if self._first_pending:  # (the loss's backward is over: the resident gradients it made are final)
            self._first_pending = False
            # After the layer's own collective: the ranks' collectives run one after another on one communicator,
            # so the head's mean (GBs) issued first would hold this first gradient's reduce-scatter, and its landing,
            # behind it; issued after, it runs beside the next layer's backward.
            if self.sink is not None:
                self.sink.first_layer_gradient()

    @staticmethod
    def _sq(off: torch.Tensor, first: bool) -> torch.Tensor | None:
        return torch.linalg.vector_norm(off, dtype=torch.float32).square() if first else None

    def _to_shard(self, k: int, unit: Unit, off: torch.Tensor, first: bool) -> None:
        """Data parallel, a host gradient: reduce-scattered over the ranks, this rank's shard goes to the host."""
        part, lo, sq = self._reduce(k, unit, first)
        self._copy_to_host(k, unit, part, sq, lo)

    def _reduce(self, k: int, unit: Unit, first: bool) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """Data parallel: offload buffer ``k``'s gradient of ``unit`` reduce-scattered over the ranks (a mean); this
        rank's shard of it (on the device), where the shard starts in the unit, and (``first``) its squared norm.

        On the D2H stream, which copies the shard out next: the collective then runs beside the backward's next
        layer instead of holding the compute stream until every rank has joined it and it has finished (a blocking
        collective makes the stream it is called on wait for it). The offload buffer is reused only once
        ``done[k]``, recorded on this stream after the copy, has passed."""
        dp = self.dp
        size = dp.shard_size(unit.numel)
        wire = self._wire_k[k]
        buf = self.offload[k] if wire is None else self.offload[k].view(wire)
        full = buf[:size * dp.local_world]
        full[unit.numel:].zero_()  # (padding: left over from a larger unit)
        out = self.reduced[k][:size]
        lo, hi = dp.shard(unit.numel)
        st = self.streams
        ready = st.record(st.compute)
        with st.on(st.d2h):
            st.wait(st.d2h, ready)
            if wire is None:
                dp.reduce_scatter_mean_(out, full)
            else:  # (the offload buffer's second half receives the ranks' parts of this rank's shard)
                dp.exchange_mean_(out, full, buf[size * dp.local_world:2 * size * dp.local_world])
            part = out[:hi - lo]
            return part, lo, self._sq(part, first)

    def _to_device(self, k: int, unit: Unit, off: torch.Tensor, first: bool) -> None:
        if self.state.accumulate(unit.index, self._sq(off, first)):
            unit.grad.copy_(off)
        else:
            unit.grad.add_(off)
        self.landed(unit.index, None)
        self.done[k] = self.streams.record(self.streams.compute)

    def _to_host(self, k: int, unit: Unit, off: torch.Tensor, first: bool) -> None:
        self._copy_to_host(k, unit, off, self._sq(off, first))

    def _copy_to_host(self, k: int, unit: Unit, off: torch.Tensor, sq: torch.Tensor | None, at: int = 0) -> None:
        """``off`` -> the unit's host gradient from element ``at`` (a data-parallel shard; else all of it)."""
        ready = self.streams.record(self.streams.compute)
        self._drain(k)
        # The last step's update may still own this unit's state and read its gradient buffer (the second pass of
        # a split update, optim/split_update.py): it ends before the next gradient lands there.
        self.state.wait_state(unit.index)
        first = self.state.accumulate(unit.index, sq)
        narrow = self._narrow_k[k]
        if narrow is not None:
            assert first and at == 0  # (buffer() chose narrow for a first, unsharded visit)
            self.state.narrowed(unit.index, narrow)
        elif not first and self.state.narrow[unit.index] is not None:
            self._widen(unit)  # (another visit after a narrow one: only a backward past the step's last does that)
        direct = first and (narrow is not None or off.dtype == unit.grad.dtype)
        n = off.numel()
        dst = unit.grad_as(narrow)[at:at + n] if direct else self._slab(k)[:n]
        st = self.streams
        with st.on(st.d2h):
            st.wait(st.d2h, ready)
            dst.copy_(off, non_blocking=True)
            if sq is not None and first:
                self.sq_cells[unit.index:unit.index + 1].copy_(sq.reshape(1), non_blocking=True)
            self.done[k] = st.record(st.d2h)
        self.d2h_bytes += off.numel() * off.element_size()
        self.pending[k] = (unit, "" if direct else "copy" if first else "add", at, n)

    def _shard_to_consumer(self, k: int, unit: Unit, off: torch.Tensor, first: bool) -> None:
        """Data parallel, a lean gradient: reduce-scattered over the ranks; the consumer steps this rank's shard."""
        part, _, sq = self._reduce(k, unit, True)
        self._to_consumer(k, unit, part, first, sq)

    def _to_consumer(self, k: int, unit: Unit, off: torch.Tensor, first: bool,
                     sq: torch.Tensor | None = None) -> None:
        """A lean gradient (``sq``: its squared norm when ``_reduce`` took it on the D2H stream) -> a slab on the
        host, handed to the consumer."""
        if sq is None:
            sq = self._sq(off, True)  # (a lean unit's every gradient is a whole step's, a re-run's included)
        ready = self.streams.record(self.streams.compute)
        self._drain(k)  # slab k released by the consumer (it may still be reading the gradient of two layers up)
        self.state.wait_state(unit.index)  # (the last step's split update may still read its plane slice)
        narrow = self._narrow_k[k]
        if self.sink is None:
            raise RuntimeError("hf_megatrain: lean_store needs the optimizer before the first backward "
                               "(engine.create_optimizer)")
        slab = self.sink.plane_slab(unit.index, narrow)  # (lean_grad_plane: the gradient stays on the host there)
        n = off.numel()
        if slab is None:
            slab = self._slab(k)[:n] if narrow is None else self._slab(k).view(narrow)[:n]
        sq_host = self.sq_host[k][0]
        st = self.streams
        with st.on(st.d2h):
            st.wait(st.d2h, ready)
            slab.copy_(off, non_blocking=True)
            sq_host.copy_(sq, non_blocking=True)
            self.done[k] = st.record(st.d2h)
        self.d2h_bytes += n * slab.element_size()
        self.pending[k] = (unit, "", 0, n)
        self.state.accumulate(unit.index, sq)  # (keeps the device scalar alive until its copy is done)
        self.lean_wait[k] = self.sink.consume(unit.index, slab, sq_host, self.done[k])

    def _slab(self, k: int) -> torch.Tensor:
        """Staging slab ``k``, allocated (and pinned) the first time a gradient needs it."""
        slab = self.staging[k]
        if slab is None:
            slab = self.staging[k] = alloc_host(self.staging_numel, self.staging_dtype, self._pin)
        return slab

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
        self.streams.synchronize(self.done[k])
        unit, action, at, n = item
        if action == "add":
            unit.grad[at:at + n].add_(self._slab(k)[:n])
        elif action == "copy":
            unit.grad[at:at + n].copy_(self._slab(k)[:n])
        self.pending[k] = None
        sq = self.state.grad_sq[unit.index]
        self.landed(unit.index, None if sq is None else float(self.sq_cells[unit.index]))

    def landed(self, index: int, sq: float | None) -> None:
        """Unit ``index``'s gradient is complete where its plan keeps it (``sq``: its squared norm, read on the host,
        first visit only); in the step's last backward it is final, and the sink hears of it now."""
        self.state.landed(index)
        if self.final_backward and self.sink is not None:
            self.sink.landed(index, sq)

    def _widen(self, unit: Unit) -> None:
        """Make a narrow host gradient FP32 in place, once no update reads it (its D2H landed with the step's
        ``land()``, before the forward that preceded this visit)."""
        self.state.wait_ready(unit.index)
        unit.widen_grad_(self.state.narrow[unit.index])
        self.state.widened(unit.index)

    def finish(self) -> None:
        """Land every gradient in flight."""
        for k in (0, 1):
            self._drain(k)

    def land(self) -> None:
        """The step's land phase (engine/landing.py): every gradient sent so far has landed."""
        self.finish()
        self.unlanded = False
