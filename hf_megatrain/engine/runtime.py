"""MegaTrainEngine: runs a converted HF causal LM -- forward, the streamed backward, the optimizer's step state.

The builder (engine/builder.py) decides and allocates everything; this module only runs it. ``forward`` runs the
HF model's own decoder loop (so masks, rotary, per-layer attention types are exactly HF's), whose layers are
``StreamedLayer`` proxies driven by the ``StreamingExecutor``, and a chunked linear cross-entropy head;
``loss.backward()`` streams the layers back. One ``StepState`` (the unit lifecycle) is shared by the executor
and the optimizer; the optimizer owns the step and lands its gradients through the engine's ``GradientLanding``
(engine/landing.py), which it is handed at construction; the engine attaches the optimizer to the offload as the
one sink of landed gradients, says which backward is the step's last (``set_final_backward``) and publishes the
resident masters to their device copies when their version changed.

One training step, start to end:

    forward   wait until the resident unit is ready, publish it; HF loop -> proxies -> executor (layer i's
              weights in while i-1 computes); loss in chunks
    backward  proxies in reverse; each layer recomputed, its gradient to where its plan keeps it (+ squared norm);
              in the step's last backward each landed gradient goes on to the optimizer (speculation, lean)
    step      land -> norm -> decide -> launch (optim/adamw.py); the next forward waits per unit, not per step
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from .. import planner
from ..config import MegaTrainConfig, resolve_config
from ..core.plan import Where
from ..core.threads import place_host_for
from ..parallel.group import DataParallel
from ..parallel.setup import data_parallel_config
from ..model.loss import TokenStats
from ..optim.adamw import UnitAdamW
from ..optim.lean import optimizer_for
from ..optim.ranks import ranks_of
from ..optim.speculation import GA_MESSAGE
from . import unpad
from .adapter_switch import follow_adapter_switches
from .builder import build_engine
from .conversion_plan import host_layout_for
from .model_view import present_weights
from .replay import StepReplay

logger = logging.getLogger(__name__)

ENGINE_ATTR = "megatrain_engine"  # set on the converted HF model so integrations (Trainer, TRL...) find its engine


@dataclass
class MegaTrainOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor | None = None
    token_stats: TokenStats | None = None  # per-token sums for TRL's SFT metrics, when asked for


def _record_nothing(kwargs: dict[str, Any]) -> None:
    """No lean units: nothing re-runs a forward, so none is recorded."""
    return None


class MegaTrainEngine:
    def __init__(self, model: nn.Module, config: MegaTrainConfig | Mapping[str, Any] | str | None = None,
                 device: torch.device | str | None = None, decay_names: set[str] | None = None,
                 dp: DataParallel | None = None, show_progress: bool = True, grad_accum: int = 1) -> None:
        """``config``: what every entry point takes (a ``MegaTrainConfig``, a dict, a JSON string or a yaml path),
        read by the one resolution, ``config.resolve_config``; ``None`` is the defaults. The engine reads no
        environment variables (the Trainer, the plugin and ``from_pretrained_streamed`` apply ``MEGATRAIN_*``
        before they build it). ``dp``: the data-parallel ranks of this host training together (parallel/; None or
        one rank: alone). ``show_progress``: a bar of the bytes converted (a terminal's only; the Trainer passes
        ``not disable_tqdm``). ``grad_accum``: backward passes per optimizer step the caller will run (Trainer's
        ``gradient_accumulation_steps``): ``host_layout="auto"`` takes no lean layout when it is above 1."""
        config = config if isinstance(config, MegaTrainConfig) else resolve_config(config, environ={})
        # Data parallel is decided here, once: ``dp`` for construction, ``ranks`` (optim/ranks.py) for the rest.
        self.dp = dp if dp is not None and dp.world > 1 else None
        self.ranks = ranks_of(self.dp)
        if self.dp is not None:
            config = data_parallel_config(config, self.dp)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        # The host layout, decided once before anything is planned: the full store, or a lean one where only that
        # fits this host's RAM (host_layout="auto"; data parallel: rank 0's decision for every rank).
        config, self.host_layout_note = host_layout_for(model, config, self.device, grad_accum, self.dp)
        self.config = config
        self.model = model
        # Before anything large is allocated: the pages the bound threads touch first land on their node.
        self.host_placement = place_host_for(config, self.device, self.ranks)
        logger.info("hf_megatrain: host threads: %s (host_affinity=%s, host_threads=%d)",
                    self.host_placement.describe(), config.host_affinity, config.host_threads)
        self.compute_dtype = config.torch_compute_dtype
        # Everything built once, in one place (engine/builder.py): plan, store, templates, executor, head, landing.
        parts = build_engine(model, config, self.device, decay_names, self.dp, show_progress=show_progress)
        self.stack, self.plans, self.store = parts.stack, parts.plans, parts.store
        self.layer_units = self.store.units[:-1]
        self.resident_unit = self.store.units[-1]
        self.resident_params = parts.resident_params
        self.frozen_resident = parts.frozen_resident
        self.layer_buffer_names = parts.layer_buffer_names
        self.attention = parts.attention  # masked batches' attention kernel, decided once (model/attention.py)
        self.modes = parts.modes  # how the step runs (host kernel, narrow gradients, speculation, lean units)
        self.state, self.executor, self.landing = parts.state, parts.executor, parts.landing
        # Family extras of the HF head (soft-capping, logit scaling, MoE router aux loss): model/families.py.
        self.head_extras = parts.head
        # Padded training batches as one packed row (engine/unpad.py), decided once; the reasons a batch ran
        # padded anyway, each logged once.
        self.unpadding = parts.unpadding
        self._padded_reasons: set[str] = set()
        # Lean units consume their gradients as they land: each training forward is recorded for a re-run.
        self._record: Callable[[dict[str, Any]], StepReplay | None] = \
            self._record_forward if self.modes.consume else _record_nothing
        self._published = -1  # version of the resident unit last copied into its device working parameters
        self.publish_resident()
        self.optimizer: UnitAdamW | None = None
        self._replaying = False
        self._checked_shapes: set[tuple[int, int]] = set()  # (batch, seq) shapes the GPU check passed
        self._activation_shape: tuple[int, int] | None = None  # (batch, seq) the activation placement is for
        # The HF model's own forward (generate(), a direct call) bypasses ``forward`` below: the decoder module
        # still gets final resident weights, the model's train/eval mode and (MoE) its router logits.
        self._hf_router_capture: tuple[Any, list[torch.Tensor]] | None = None
        self.stack.parent.register_forward_pre_hook(self._before_decoder, with_kwargs=True)
        self.stack.parent.register_forward_hook(self._after_decoder, always_call=True)
        self.head_extras.hook_model_forward(self.publish_resident)  # (multimodal: towers run before the decoder)
        setattr(model, ENGINE_ATTR, self)
        follow_adapter_switches(self)  # PEFT: disable_adapter() reaches the streamed layers (adapter_switch.py)
        present_weights(self)  # save_pretrained, state_dict, named_parameters see the real weights (model_view.py)

    # -- masters -----------------------------------------------------------------------------------------------------
    def publish_resident(self) -> None:
        """Wait for the resident unit's update in flight, then copy its masters into their device working
        parameters when they changed (a host-placed resident unit; on the device the parameters are views of the
        unit's own buffers)."""
        u = self.resident_unit
        self.state.wait_ready(u.index)
        if u.plan.master is Where.DEVICE:
            self._check_resident_views()
            return
        if self._published == self.state.version[u.index]:
            return
        for p in u.params:
            self.resident_params[p.name].data.copy_(u.view(u.source, p))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._published = self.state.version[u.index]

    def _check_resident_views(self) -> None:
        """Resident parameters on the device are views of the unit's buffers (the optimizer updates them there):
        refuse to run with parameters something replaced (``model.to(...)`` onto another device name copies them),
        which would train on stale weights."""
        u = self.resident_unit
        for p in u.params:
            if self.resident_params[p.name].data_ptr() != u.view(u.source, p).data_ptr():
                raise RuntimeError(f"hf_megatrain: the parameter {p.name} no longer shares the engine's memory (was "
                                   "the converted model moved with .to(...)?); the engine places the model itself: "
                                   "do not move it after conversion")

    def _before_decoder(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the module that owns the layer stack (runs for every forward, ours or HF's)."""
        self.publish_resident()
        self.executor.begin_forward(module.training)
        self.executor.rows.begin_forward(module, args, kwargs)  # (micro-batches: which inputs are batch rows)
        router = self.head_extras.router
        if router is not None and not router.tap.active and router.wanted(kwargs):
            # An HF forward asking for router logits (its aux loss): HF records them with hooks on router
            # modules, which live in our templates, not in the model; our tap records them instead.
            capture = router.tap.capturing()
            self._hf_router_capture = (capture, capture.__enter__())  # (context, the list it fills)

    def _after_decoder(self, module: nn.Module, args: Any, output: Any) -> None:
        # (``always_call``: also when the forward raised, with no output then)
        self.executor.end_forward(completed=output is not None)
        self.executor.rows.end_forward()
        held, self._hf_router_capture = self._hf_router_capture, None
        if held is None:
            return
        capture, logits = held
        capture.__exit__(None, None, None)
        if hasattr(output, "router_logits"):
            output.router_logits = tuple(logits)

    def sync_device_(self) -> None:
        """After masters changed outside the optimizer (loading a checkpoint): every copy is stale."""
        self.wait_updates()
        # (data parallel: the shared masters are written by local rank 0; each rank refreshes the compute copy it
        # owns, and every rank's part is done before any rank reads the weights)
        self.ranks.barrier()
        for u in self.store.units:
            u.refresh_compute_(self.ranks.own(u))
        self.state.touch()
        self.publish_resident()
        self.ranks.barrier()

    def writes_master(self, name: str) -> bool:
        """Whether this process fills parameter ``name``'s FP32 master on a load (checkpoint/folders.py): the
        data-parallel ranks of a host share the host units' masters, which local rank 0 alone writes
        (``sync_device_`` then waits for it); every process fills its own device units."""
        return self.ranks.writes_shared(self.store.by_name[name][0])

    def named_master_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, FP32 master) for every trainable parameter, tied names once; waits for updates in
        flight first, so every reader (checkpoints, exports, PEFT saves) sees finished weights."""
        self.wait_updates()
        for unit in self.store.units:
            for p in unit.params:
                yield p.name, unit.view(unit.master, p)

    def named_frozen_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, compute-dtype value) of every frozen parameter: streamed ones (host), then resident (device)."""
        for name in self.store.frozen_by_name:
            yield name, self.store.frozen_tensor(name)
        yield from ((n, p.detach()) for n, p in self.frozen_resident.items())

    def layer_templates(self) -> list[nn.Module]:
        """Each streamed layer's weightless template module, in layer order (layers of one kind share one): what
        PEFT's key walk, merged exports and the planner's MoE count see of a layer's structure."""
        ex = self.executor
        return [ex.templates[k].module for k in ex.kinds]

    def named_layer_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(full model name, device tensor) of every persistent buffer inside the streamed layers (router
        score-correction biases, learned constants): conversion moved them out of the model, so exports and
        checkpoint loads reach them here (export/weights.py, hf/pretrained.py)."""
        for i, names in enumerate(self.layer_buffer_names):
            bufs = self.executor.buffers[i]
            for n in names:
                yield f"{self.stack.path}.{i}.{n}", bufs[n]

    def num_parameters(self, include_frozen: bool = False) -> int:
        """Trainable parameters (tied once); with ``include_frozen`` all of them."""
        return self.store.numel + (sum(p.numel() for _, p in self.named_frozen_tensors()) if include_frozen else 0)

    # -- gradients ---------------------------------------------------------------------------------------------------
    def set_final_backward(self, final: bool = True) -> None:
        """Say whether the backward about to run is the step's last (the Trainer: ``sync_gradients``; a custom loop:
        True before its last backward of a step): its gradients are final as they land, so the optimizer may
        update units during it (``speculative_step``) and a host unit's only visit may land narrow. The only
        writer of that mark; it holds until the step's gradients are discarded or the next call."""
        self.landing.set_final_backward(final)

    @property
    def final_backward(self) -> bool:
        """Whether the backward in progress (or just run) is the step's last (``set_final_backward``)."""
        return self.landing.final_backward

    def wait_updates(self) -> None:
        """Block until no update is in flight (joins the optimizer's workers); re-raise a worker's failure."""
        if self.optimizer is not None:
            self.optimizer.wait()
        else:
            self.state.wait_all()

    def finish_backward(self) -> None:
        """Land every gradient of the backward(s) so far where the plans keep them."""
        self.landing.land()

    def land_gradients(self) -> None:
        """Land every gradient and give units no backward reached a zero gradient (what ``parameters()`` shows)."""
        self.wait_updates()
        self.landing.land()
        self.widen_gradients()
        self.landing.zero_unreached()

    def widen_gradients(self) -> None:
        """Every narrow host gradient (engine/offload.py) made FP32 in place, for readers of ``.grad``: once its
        copy has landed (the executor's copies only: the resident parameters keep their ``.grad`` until ``land()``)
        and the updates that may read it (a speculative one, started by a landing) are done."""
        if any(dt is not None for dt in self.state.narrow):
            self.executor.finish()
            self.wait_updates()
            for u in self.store.units:
                dt = self.state.narrow[u.index]
                if dt is not None:
                    u.widen_grad_(dt)
                    self.state.widened(u.index)

    # -- forward -----------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, num_items_in_batch: torch.Tensor | int | None = None,
                return_logits: bool = False, token_stats: bool = False, **kwargs: Any) -> MegaTrainOutput:
        replay = self._record(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                           num_items_in_batch=num_items_in_batch, return_logits=return_logits,
                                           **kwargs))
        if self.unpadding.on and not return_logits and torch.is_grad_enabled():
            why: list[str] = []
            packed = unpad.packed_from_padded(input_ids, attention_mask, labels, kwargs, why)
            if packed is not None:  # (the same targets and loss; the layers skip the padding)
                input_ids, labels, attention_mask = packed.pop("input_ids"), packed.pop("labels", None), None
                kwargs = packed
            elif why and why[0] not in self._padded_reasons:  # (said once per reason: the batch runs padded)
                self._padded_reasons.add(why[0])
                logger.warning("hf_megatrain: padding_free: a padded batch runs padded (the layers compute its "
                               "padding): %s", why[0])
        self.publish_resident()
        if self.landing.unlanded:
            self.landing.land()  # an accumulation step: FP32-accumulate before the next backward adds more
        self.executor.training = self.model.training
        self._check_step_fits(input_ids, kwargs)
        self._place_activations(input_ids, kwargs)
        dev = self.device
        move = lambda t: t.to(dev, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
        kwargs = {k: move(v) for k, v in kwargs.items()}
        extras = self.head_extras
        attention_mask = move(attention_mask)
        self.executor.visits.clear()
        with extras.capture(kwargs) as router_logits:
            # Embeddings -> layers -> final norm: the module that owns the layer stack (e.g. LlamaModel), or a
            # multimodal model's own forward, towers included (model/multimodal.py). hidden: lm_head's input.
            hidden, added = extras.run(move(input_ids), attention_mask, move(labels), **kwargs)
        again = sorted(i for i, n in self.executor.visits.items() if n > 1)
        if replay is not None and again:  # (before any backward: nothing updated yet)
            raise ValueError(
                f"hf_megatrain: lean_store=True cannot train layers {again[:4]}: each runs several times in one "
                "forward (a layer looped, e.g. Dory's n_recurrent_loops > 1) and the lean store updates a layer "
                "from its gradient as soon as one backward visit ends, so it cannot sum its visits. Use "
                "lean_store=False (the full store sums them exactly).")
        head = self.model.get_output_embeddings()
        loss = None
        stats = TokenStats() if token_stats and labels is not None else None
        if labels is not None:
            loss = extras.loss(hidden, head, move(labels), chunk_tokens=self.config.loss_chunk_tokens,
                               num_items_in_batch=num_items_in_batch, router_logits=router_logits,
                               attention_mask=attention_mask, compiled=self.config.compiles(self.device.type), stats=stats)
            if added is not None:  # what a multimodal forward adds to its loss (its MoE aux loss), else 0
                loss = loss + added.to(loss.device)
        logits = extras.logits(hidden, head) if return_logits else None
        if replay is not None:
            replay.watch({"loss": loss, "logits": logits}, self._bind_replay)
        return MegaTrainOutput(loss=loss, logits=logits, token_stats=stats)

    __call__ = forward

    def begin_direct_forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> None:
        """What ``forward`` does before the model runs, for a caller about to run the HF model's own forward with
        gradients (TRL's fused LM head: hf/dpo_support.py): land an accumulation step's gradients (FP32) before the
        next backward adds more, check the step fits and place the activations for this batch shape."""
        if self.landing.unlanded:
            self.landing.land()
        self._check_step_fits(input_ids, kwargs)
        self._place_activations(input_ids, kwargs)

    def _check_step_fits(self, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """CUDA, training: the first time a (batch, seq) shape comes, check the planner's GPU peak for a step of
        it, so a step that cannot fit says what to change instead of failing with out-of-memory mid-backward.
        Advisory (logged) until the planner's GPU model is calibrated on real runs."""
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if self.device.type != "cuda" or not self.model.training or not isinstance(ref, torch.Tensor) \
                or ref.dim() < 2:
            return
        key = (int(ref.shape[0]), int(ref.shape[1]))
        if key not in self._checked_shapes:
            self._checked_shapes.add(key)
            try:
                planner.check_fits(self, seq_len=key[1], batch_size=key[0])
            except MemoryError as e:
                logger.warning("hf_megatrain: %s", e)

    def _place_activations(self, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """Per (batch, seq) shape: which layers' saved inputs the executor offloads to host memory (the planner's
        ``activation_offload`` rule; the first layers, whose backward comes last), and which keep their forward's
        graph instead of being recomputed (``saved_graph_layers``: the last ones)."""
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if not isinstance(ref, torch.Tensor) or ref.dim() < 2 or not torch.is_grad_enabled():
            return
        key = (int(ref.shape[0]), int(ref.shape[1]))
        if key == self._activation_shape:
            return
        acts = self.executor.activations  # (its pooled host buffers serve any shape that fits them)
        n = planner.offloaded_layers_for(self, seq_len=key[1], batch_size=key[0], pooled_host_bytes=acts.host_bytes)
        acts.offload = frozenset(range(n))
        L = len(self.layer_units)
        kept = planner.saved_graph_layers_for(self, seq_len=key[1], batch_size=key[0], offloaded=n)
        if frozenset(range(L - kept, L)) != self.executor.graph_layers:  # (said once per change, not per shape)
            logger.info("hf_megatrain: batch %d x seq %d: the last %d of %d layers keep their forward's graph (their "
                        "backward skips the recompute: saved_graph_layers)", key[0], key[1], kept, L)
        self.executor.saved_graphs.layers = frozenset(range(L - kept, L))
        self._activation_shape = key
        if n:
            logger.info("hf_megatrain: batch %d x seq %d: layers 0..%d offload their saved input to host memory, "
                        "%d keep it on the device", key[0], key[1], n - 1, len(self.layer_units) - n)

    # -- lean units: the step's forward, kept for a re-run -----------------------------------------------------------
    def _record_forward(self, kwargs: dict[str, Any]) -> StepReplay | None:
        """Lean units (``_record``), training forward: keep what re-running it needs (inputs, RNG, autocast, mode)."""
        if self._replaying or not torch.is_grad_enabled():
            return None
        if self.landing.replay is not None:
            raise RuntimeError(GA_MESSAGE.format(what="a second training forward came after a backward"))
        return StepReplay(kwargs, self.device, self.model.training, self._rerun)

    def _bind_replay(self, replay: StepReplay) -> None:
        """First gradient into a recorded forward's outputs: this is the forward of the step being computed."""
        if self.landing.replay is not None and self.landing.replay is not replay:
            raise RuntimeError(GA_MESSAGE.format(what="the outputs of two forwards received gradients"))
        self.landing.replay = replay

    def _rerun(self, replay: StepReplay) -> None:
        """Run the step's forward+backward again (same inputs, RNG, autocast, weights), so every layer's gradient
        reaches the optimizer a second time; the resident gradients it produces are dropped (landed already)."""
        self._replaying = True
        try:
            with replay.replaying(self.model):
                out = self.forward(**replay.kwargs)
                replay.backward({"loss": out.loss, "logits": out.logits})
            self.executor.finish()
        finally:
            self._replaying = False
            for p in self.resident_params.values():
                p.grad = None

    # -- optimizer ---------------------------------------------------------------------------------------------------
    def create_optimizer(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                         weight_decay: float = 0.0, max_grad_norm: float | None = None) -> UnitAdamW:
        if self.optimizer is not None:  # replaced (a second Trainer on the same engine): its work ends first
            self.optimizer.wait()
        order = [self.resident_unit.index] + [u.index for u in self.layer_units]
        self.widen_gradients()  # (a replaced optimizer's step may have left some)
        cls = optimizer_for(self.modes)  # (UnitAdamW, or LeanAdamW for lean units: optim/lean.py)
        self.optimizer = cls(self.store, self.state, self.landing, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             max_grad_norm=max_grad_norm, unit_order=order, skip_nonfinite=self.config.skip_nonfinite,
                             overlap=self.config.overlap_optimizer, grad_reach=self.executor.reach,
                             modes=self.modes, ranks=ranks_of(self.dp), exact_take_back=self.config.exact_take_back,
                             weights_threads=self.host_placement.weights_threads)
        self.executor.grads.attach(self.optimizer)  # the one sink of landed gradients (speculation, lean)
        return self.optimizer
