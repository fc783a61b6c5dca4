"""UnitAdamW: AdamW over every unit's FP32 state, one fused kernel call per unit, wherever its plan keeps it.

A real ``torch.optim.Optimizer``: ``param_groups`` hold the master views (group 0 decayed, group 1 not, as Trainer
splits them), so LR schedulers drive it unchanged. ``step()`` runs in named phases:

    land    the engine lands every gradient in flight (``GradientPath.land``: executor D2H copies, resident
            ``.grad``; engine/landing.py), handed to the optimizer at construction
    norm    global L2 norm from the per-unit squared norms folded into each gradient's departure from the GPU
    decide  clip factor (folded into the kernel as ``grad_scale``) or, on a non-finite norm, skip the step
    launch  each unit goes to the stepper of its plan's kind, chosen once (optim/steppers.py): HOST and DEVICE
            units on one worker (the fused kernel on the CPU or the GPU where the state lives), DEVICE_STREAMED
            units on a second one (device_stepper.py); LEAN units were updated as they landed (optim/lean.py).
            Host layer updates may run split, new weights first (``SplitPolicy``, optim/split_update.py)

With ``overlap=True`` the workers run in background threads in the order the next forward consumes units (resident
first, then layer 0, 1, ...); the executor waits, per layer, until the step state says that unit is ready. Every
unit uses the same norm, hyper-parameters and kernel, so the math does not depend on who steps it.

The optimizer is also the one sink of landed gradients (``GradientSink``, optim/gradient_path.py): the engine's
offload calls ``landed`` / ``consume`` directly. With speculation (``StepModes``, decided once by core/plan.py
``decide_modes``; carried out by optim/speculative_step.py) the CPU's work overlaps the backward: in
the step's last backward (``engine.set_final_backward``), each HOST unit is updated on a worker as soon as its
gradient lands, with no clip factor; ``step()`` then takes back and redoes only the updates the true global norm
proves wrong (exact to rounding: optim/speculation.py), and launches the rest. It does not wait for speculative
updates still running: those judged right finish as ready, so the next forward starts after layer 0's update, not
after all of them.

Data parallel (parallel/group.py; first version; the optimizer's ``ranks``, optim/ranks.py, chosen once by the engine):
each rank steps only its shard of every HOST unit (in its node's shared store; several nodes step identical copies)
and every rank the whole of the replicated DEVICE units, whose gradients it all-reduces after ``land``; the norm sums
the shard squared norms of one node (one all-reduce). The updates overlap the next forward as in one process:
``step()`` does not wait for them, and a rank's load of a unit waits until every shard of its update on its node is
written (StepState.peers,
parallel/peer_cells.py). Speculation works per shard: each rank updates its shard as the reduce-scattered gradient
lands; the global norm judges it at ``step()``, a take-back undoes the shard only, and the other ranks count an
update only once it is judged (a take-back may still be running on this rank when another rank, past the norm's
all-reduce, loads the unit).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core import kernels
from ..core.plan import StepModes, Stepper
from ..core.step_state import StepState
from ..core.store import Unit, UnitStore
from ..parallel.shards import clip_spans
from .device_stepper import DeviceStepper
from .gradient_path import GradientPath
from .adamw_state import AdamWStateIO
from .jobs import Jobs
from .ranks import Alone, Ranks
from .speculative_step import SpeculativeStep
from .split_update import SplitPolicy, SplitUpdates
from .step_counts import StepCounts
from .steppers import KernelStepper, UnitStepper

if TYPE_CHECKING:
    from ..core.grad_reach import GradReach

logger = logging.getLogger(__name__)


class UnitAdamW(SpeculativeStep, AdamWStateIO, torch.optim.Optimizer):
    def __init__(self, store: UnitStore, state: StepState, grads: GradientPath, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = None,
                 unit_order: list[int] | None = None, skip_nonfinite: bool = True, overlap: bool = False,
                 modes: StepModes = StepModes(), grad_reach: GradReach | None = None, ranks: Ranks | None = None,
                 exact_take_back: bool = False, weights_threads: int | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        self.store, self.step_state, self.grads = store, state, grads
        self.ranks = ranks if ranks is not None else Alone()  # or this rank's share of every update (optim/ranks.py)
        decay, no_decay = [], []
        for unit in store.units:
            for p in unit.params:
                view = unit.view(unit.master, p)
                if unit.plan.grad is unit.plan.master:  # (lean: none; GPU-stepped: on another device)
                    view.grad = unit.view(unit.grad, p)
                (decay if p.decay else no_decay).append(view)
        if not decay and not no_decay:
            raise ValueError("UnitAdamW: the store holds no trainable parameters")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        group_of: dict[int, int] = {}  # 0 = decayed, 1 = not decayed -> index into self.param_groups
        for g, group in enumerate(groups):
            if group["params"]:
                group_of[g] = len(group_of)
        # AdamW step counts per unit and, where some parameter skipped steps, per parameter (optim/step_counts.py).
        self.counts = StepCounts(store.units, group_of)
        super().__init__([g for g in groups if g["params"]], defaults)
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        # Host threads of a split update's weights half, which the next forward waits for (core/threads.py
        # ``weights_half_threads``; None: the process's intra-op count, as every other host update).
        self.weights_threads = weights_threads
        self.unit_order = unit_order or list(range(len(store.units)))
        self.overlap = overlap
        streamed = [u for u in store.units if u.plan.stepper is Stepper.DEVICE_STREAMED]
        self.device_stepper = DeviceStepper(streamed, streamed[0].grad.device, store.compute_dtype, state) \
            if streamed else None
        # One stepper per kind, and which worker runs it (optim/steppers.py); LEAN units are never launched.
        kernel = KernelStepper(state, self.grad_of)
        self.steppers: dict[Stepper, UnitStepper] = {Stepper.HOST: kernel, Stepper.DEVICE: kernel}
        self._worker_of = {Stepper.HOST: 0, Stepper.DEVICE: 0}
        if self.device_stepper is not None:
            self.steppers[Stepper.DEVICE_STREAMED] = self.device_stepper
            self._worker_of[Stepper.DEVICE_STREAMED] = 1
        # How host units are updated (core/kernels.py): the native and compiled kernels write the compute copy in
        # the same pass; built here, on the main thread, rather than in the middle of the first step on a worker.
        self.host_kernel = host_kernel = modes.host_kernel  # (decided once: core/plan.py decide_modes)
        if host_kernel is kernels.HostKernel.COMPILED:
            copies = {u.compute.dtype for u in store.units if u.plan.stepper is Stepper.HOST and u.compute is not None}
            for dtype in copies or {None}:
                kernels.warm_up(dtype)
        elif host_kernel is kernels.HostKernel.NATIVE:  # (compute copies are bf16: the config allows no other)
            kernels.warm_up_native()
        # Parameters without a gradient are skipped, as torch.optim.AdamW skips a None .grad (core/grad_reach.py says
        # which were reached: ``take(unit)`` -> a flag per parameter, or None to step them all).
        self.grad_reach = grad_reach
        self._reached: dict[int, list[bool] | None] = {}
        # Reductions over the ranks started before step() (``first_layer_gradient``): (gradient view, work).
        self._early: list[tuple[torch.Tensor, Any]] = []
        self._stepping = False  # inside step()
        self.skipped_steps = 0
        self.last_step_skipped = False  # the last step() was skipped (non-finite norm): Trainer keeps its LR then
        # Wall time of the last *finished* step's unit updates; published by wait(), so reading it right after
        # step() returns gives the previous step, never a partial figure.
        self.last_step_seconds = 0.0
        self._running_seconds = 0.0
        self.last_norm_seconds = 0.0
        # Host AdamW work since construction (speculative updates and take-back re-runs included): the rate the
        # benchmark reports is host_update_params / host_update_seconds.
        self.host_update_seconds = 0.0
        self.host_update_params = 0
        self.host_update_bytes = 0  # host DRAM bytes those updates moved (kernels.host_bytes_per_param)
        self.last_grad_norm: float | None = None
        # The launch's workers: the HOST and DEVICE units on one, the DEVICE_STREAMED ones on another (optim/jobs.py).
        self._workers = [Jobs("megatrain-adamw", overlap) for _ in range(1 + (self.device_stepper is not None))]
        # Host layers whose launched update may run split (new weights first; optim/split_update.py), the policy
        # deciding per step from the measured host rate and step interval.
        self._kernel = kernel
        self.splits = SplitUpdates(SplitPolicy(modes.split if overlap or modes.split == "on" else "off"),
                                   self._split_candidates(modes, Stepper.HOST))
        self._init_speculation(modes, exact_take_back)  # (speculative_step.py: on or off, chosen there once)

    # -- phases ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self._stepping = True  # (a lean store's re-run of the backward inside the step starts no early reduction)
        try:
            return self._step(loss)
        finally:
            self._stepping = False

    def _step(self, loss: float | None) -> float | None:
        self._join_before_step()
        self.splits.begin_step(time.perf_counter(), self.host_update_bytes, self.host_update_seconds)
        self.grads.land()  # (may hand the last units to the speculative worker)
        # Every update but this step's speculative ones is finished; those may still run: the norm needs only their
        # landed gradients, which the updates leave untouched, and step() returns without waiting for them.
        for i in range(len(self.store.units)):
            if i not in self.policy.applied:
                self.step_state.wait_ready(i)
        self._zero_missing()
        early, self._early = self._early, []
        self.ranks.before_norm(self.store.units, self.step_state, self.grad_reach, early)
        t0 = time.perf_counter()
        norm = self.grad_norm()
        self.last_norm_seconds = time.perf_counter() - t0
        self.last_grad_norm = norm
        skip = not math.isfinite(norm) and self.skip_nonfinite
        self.last_step_skipped = skip
        hyper = self._hyper()
        grad_scale = None if skip else self._grad_scale(norm)
        done = self._settle(skip, hyper, grad_scale)
        if skip:
            self._skip(norm)
        else:
            # (data parallel: no barrier; a rank's next load of a unit waits for every rank's shard of this update,
            # StepState.peers, so each rank's AdamW overlaps its next forward as in one process)
            self._launch(hyper, grad_scale, [i for i in self.unit_order if i not in done])
        return loss

    def first_layer_gradient(self) -> None:
        """The step's last backward sent its first layer gradient (engine/offload.py): the loss's backward is
        over. With data parallel, the output head's gradient lands now and its mean over the ranks starts beside
        the layers' backward, instead of after it (``before_norm``)."""
        if self.ranks.world > 1 and not self._stepping:
            if self._early:  # (its head gradient is averaged already: adding more to it now would be wrong)
                raise RuntimeError("hf_megatrain: a second backward of one step was marked as the step's last "
                                   "(engine.set_final_backward(True)) before optimizer.step(); with several "
                                   "processes mark only the last backward before each step (as Trainer does)")
            self._early = self.ranks.reduce_early(self.grads.land_early())

    @property
    def early_reductions(self) -> int:
        """Reductions over the ranks that this step's backward started (``first_layer_gradient``) and ``step()``
        has not finished yet."""
        return len(self._early)

    def _drop_early(self) -> None:
        """Early reductions of a step that ends without ``step()`` (``zero_grad``): finished, not used."""
        for _, work in self._early:
            work.wait()
        self._early = []

    # (The lean store, optim/lean.py, plugs into the same phases through these three.)
    def _join_before_step(self) -> None:
        """Before *land*: the previous step's update threads (this step's speculative updates may still run: the
        norm needs only their landed gradients, which the updates leave untouched)."""
        self._join()

    def _settle(self, skip: bool, hyper: list[kernels.Hyper], grad_scale: float | None) -> set[int]:
        """After *decide*: settle the updates made before the norm was known (speculation); returns the units that
        need no launch."""
        return self._judge_speculation(skip, hyper, grad_scale)

    def own(self, u: Unit) -> tuple[int, int]:
        """The range of ``u``'s flat buffers this process steps: its shard of a HOST unit shared by data-parallel
        ranks, else all of it."""
        return self.ranks.own(u)

    def owned(self, u: Unit, groups: kernels.Groups) -> kernels.Groups:
        """``groups``' spans within the range of ``u`` this process steps (``own``)."""
        lo, hi = self.own(u)
        return groups if (lo, hi) == (0, u.numel) else [(h, clip_spans(spans, lo, hi)) for h, spans in groups]

    def _zero_missing(self) -> None:
        """Units no backward reached since the last step have a zero gradient, and no parameter of them is stepped
        (torch skips parameters whose .grad is None)."""
        for u in self.store.units:
            if not self.step_state.has_grad(u.index) and not self.step_state.updating(u.index) \
                    and u.grad is not None:  # (a lean unit has no gradient buffer)
                lo, hi = self.own(u)
                u.grad[lo:hi].zero_()
                self.step_state.accumulate(u.index, None)
                self.step_state.landed(u.index)
                if self.grads.final_backward:  # (whoever lands a final gradient hands it to the sink: us)
                    self.landed(u.index, None)
                if self.grad_reach is not None:
                    self.grad_reach.record(u.index, [False] * len(u.params), first=True)

    def grad_norm(self) -> float:
        """Global L2 norm of all gradients (per-unit norms, then the norm of norms, like clip_grad_norm_; data
        parallel: over every rank's shards)."""
        return self.ranks.grad_norm(self.store.units, self.step_state, self._unit_norm)

    def _unit_norm(self, u: Unit) -> torch.Tensor:
        sq = self.step_state.grad_sq[u.index]
        return (sq.sqrt() if sq is not None else torch.linalg.vector_norm(self.grad_of(u), dtype=torch.float32)).cpu()

    def _grad_scale(self, norm: float) -> float | None:
        """The kernel's ``grad_scale`` for global-norm clipping at ``norm`` (None: no clipping applies)."""
        scale = 1.0
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            scale = min(self.max_grad_norm / (norm + 1e-6), 1.0)
        return 1.0 / scale if scale < 1.0 else None

    def _skip(self, norm: float) -> None:
        self.skipped_steps += 1
        logger.warning("hf_megatrain: non-finite gradient norm (%s); optimizer step skipped, weights and AdamW state "
                       "untouched (%d skipped so far)", norm, self.skipped_steps)
        self.grads.discard()

    def _hyper(self) -> list[kernels.Hyper]:
        """Snapshot of each param group's hyper-parameters (the LR scheduler may change them mid-step)."""
        return [kernels.Hyper.of(g) for g in self.param_groups]

    def _launch(self, hyper: list[kernels.Hyper], grad_scale: float | None, units: list[int] | None = None) -> None:
        """Step ``units`` (default: every unit with a gradient) on the stepper of each one's kind, each worker's
        units in the order given (the next forward's)."""
        workers: list[list[int]] = [[] for _ in self._workers]
        for i in (self.unit_order if units is None else units):
            w = self._worker_of.get(self.store.units[i].plan.stepper)
            if w is not None:
                workers[w].append(i)
        for i in (i for ids in workers for i in ids):
            self.step_state.begin_update(i)
            taken = self.grad_reach.take(i) if self.grad_reach is not None else None
            self._reached[i] = self.ranks.reached(i, taken)
        self._kernel.split = frozenset(self.splits.choose(workers[0], lambda i: self.split_update_bytes(
            self.store.units[i], self.grad_of(self.store.units[i]).element_size())))
        jobs = [(w, ids) for w, ids in zip(self._workers, workers) if w is self._workers[0] or ids]
        for _, ids in jobs:  # (on the main thread: everything the backward queued comes before the streamed kernels)
            if ids:
                self.steppers[self.store.units[ids[0]].plan.stepper].prepare()

        def update(u: Unit, flats: list[torch.Tensor], refresh: bool,
                   part: kernels.UpdatePart = kernels.UpdatePart.WHOLE) -> None:
            self.update_(u, flats, hyper, grad_scale, refresh=refresh, part=part)

        t0 = time.perf_counter()
        self._running_seconds = 0.0
        for w, ids in jobs:
            w.submit(functools.partial(self._guard, ids, update, t0))
        if not self.overlap:
            self.wait()

    def _guard(self, ids: list[int], update: Callable[[Unit, list[torch.Tensor], bool], None], t0: float) -> None:
        """One worker: its units, each run of consecutive units of one kind through that kind's stepper."""
        try:
            k = 0
            while k < len(ids):
                kind = self.store.units[ids[k]].plan.stepper
                end = k + 1
                while end < len(ids) and self.store.units[ids[end]].plan.stepper is kind:
                    end += 1
                self.steppers[kind].run([self.store.units[i] for i in ids[k:end]], update)
                k = end
            self._running_seconds = max(self._running_seconds, time.perf_counter() - t0)
        except BaseException as e:  # surfaced by the next wait
            self.step_state.fail(e)

    def grad_of(self, u: Unit) -> torch.Tensor:
        """``u``'s host gradient as this step holds it: FP32, or narrow (engine/offload.py)."""
        return u.grad_as(self.step_state.narrow[u.index])

    def update_(self, unit: Unit, flats: list[torch.Tensor], hyper: list[kernels.Hyper], grad_scale: float | None,
                refresh: bool = True, part: kernels.UpdatePart = kernels.UpdatePart.WHOLE,
                local: bool = False) -> None:
        """One AdamW update of ``unit`` on [master, grad, exp_avg, exp_avg_sq] (counted), with its compute copy;
        or one half of a split update (``part``: WEIGHTS counts it, STATE completes it with the same steps).
        ``local``: the flats hold only the range this process steps (``own``), from their element 0 (the lean
        store's shard-sized gradients): the spans are shifted and the compute copy cut to match."""
        compute = unit.compute if refresh else None
        t0 = time.perf_counter()
        lo, hi = self.own(unit)
        if local and compute is not None:
            compute = compute[lo:hi]
        if part is kernels.UpdatePart.STATE:
            by_step = self.splits.take(unit.index)
        else:
            self.counts.add(unit.index)
            by_step = [(step, self.owned(unit, groups)) for step, groups
                       in self.counts.by_step(unit.index, hyper, self._reached.pop(unit.index, None))]
            if local and lo:
                by_step = [(step, shifted(groups, lo)) for step, groups in by_step]
            if part is kernels.UpdatePart.WEIGHTS:
                self.splits.remember(unit.index, by_step)
        for step, groups in by_step:
            kernels.adamw_(*flats, groups, step, grad_scale, compute, self.host_kernel, part,
                           self.weights_threads if part is kernels.UpdatePart.WEIGHTS else None)
        if flats[0].device.type == "cpu":  # (GPU updates are asynchronous launches: not timed here)
            self.host_update_seconds += time.perf_counter() - t0
            self.host_update_params += 0 if part is kernels.UpdatePart.STATE else hi - lo
            self.host_update_bytes += (hi - lo) * kernels.host_bytes_per_param(
                self.host_kernel, grad_scale is not None, compute.element_size() if compute is not None else 0,
                flats[1].element_size(), part)

    def _split_candidates(self, modes: StepModes, stepper: Stepper) -> frozenset[int]:
        """Streamed layers of ``stepper``'s kind whose updates may run split: a host compute copy to write first."""
        return frozenset(u.index for u in self.store.units if modes.split != "off" and u.plan.streamed
                         and u.plan.stepper is stepper and u.compute is not None and u.master.device.type == "cpu")

    def split_update_bytes(self, u: Unit, g: int = 4) -> int:
        """Host DRAM bytes of this process's update of ``u`` run split (both passes; its shard with data parallel:
        counting the whole unit against one rank's host rate made the policy think a split never fits), its
        gradient ``g`` bytes wide."""
        c = u.compute.element_size() if u.compute is not None else 0
        lo, hi = self.own(u)
        return (hi - lo) * sum(kernels.host_bytes_per_param(self.host_kernel, True, c, g, part)
                             for part in (kernels.UpdatePart.WEIGHTS, kernels.UpdatePart.STATE))

    @property
    def last_step_split(self) -> bool:
        """Whether updates launched by the last ``step()`` ran split (optim/split_update.py)."""
        return self.splits.last_step

    def groups_of(self, unit: Unit, hyper: list[kernels.Hyper]) -> kernels.Groups:
        """``unit``'s spans per param group, with that group's hyper-parameters."""
        return self.counts.groups(unit.index, hyper)

    def local_groups(self, unit: Unit, hyper: list[kernels.Hyper]) -> kernels.Groups:
        """``groups_of`` within the range this process steps, counted from its start (for flats cut to it)."""
        lo, _ = self.own(unit)
        return shifted(self.owned(unit, self.groups_of(unit, hyper)), lo)

    # -- the gradient sink (optim/gradient_path.py; ``landed``: speculative_step.py) ---------------------------------
    def consume(self, i: int, slab: torch.Tensor, sq: torch.Tensor, ready: object) -> Callable[[], None]:
        raise RuntimeError("hf_megatrain: a lean unit's gradient reached an optimizer without lean units "
                           "(the engine creates LeanAdamW for a lean plan)")

    # -- waiting -----------------------------------------------------------------------------------------------------
    def _join(self) -> None:
        ran = [w.sync() for w in self._workers]  # (every worker: no short-circuit)
        if any(ran):  # (published once the step's updates are done: never a partial figure)
            self.last_step_seconds = self._running_seconds

    def join(self) -> None:
        """Join this optimizer's background work (update threads, speculative jobs); re-raise their failure."""
        self._join()
        self.speculation.sync()

    def wait(self) -> None:
        """Block until the last (possibly overlapped) step has finished every unit."""
        self.join()
        self.step_state.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        # Gradients are overwritten by the first backward of the next step; only their bookkeeping is dropped
        # (and speculative updates of a step that will not happen are taken back).
        self.grads.land()
        if self.policy.seen:  # (speculative updates of a step that will not happen)
            self.wait()
            for i, key in list(self.policy.applied.items()):
                self._take_back(i, key)
            self._end_speculation(None)
        self._drop_early()
        self.grads.discard()
        if self.grad_reach is not None:
            self.grad_reach.clear()


def shifted(groups: kernels.Groups, by: int) -> kernels.Groups:
    """``groups`` with every span moved down by ``by`` elements (spans of a range starting at ``by``)."""
    return groups if not by else [(h, [(a - by, b - by) for a, b in spans]) for h, spans in groups]


CPUAdamW = UnitAdamW  # the name of the first releases (it steps GPU-placed units too)
