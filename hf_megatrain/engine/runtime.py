"""MegaTrainEngine: turns a Hugging Face causal LM into a streamed, host-mastered training model.

``prepare`` moves every trainable weight into the ``HostStore`` (FP32 master), swaps each decoder layer for a
``StreamedLayer`` proxy run by the ``StreamingExecutor``, and keeps the rest of the model (embeddings, final
norm, lm_head, rotary tables) resident on the device in compute dtype. ``forward`` runs the HF model's own
decoder loop (so masks, rotary, per-layer attention types are exactly HF's) and a chunked linear cross-entropy
head; ``loss.backward()`` streams the layers back. ``create_optimizer`` gives the CPU AdamW over the store.

Frozen parameters (``requires_grad=False``) get no FP32 master or optimizer state: in layers they stream from a
compute-dtype host copy (host_store.py), outside layers they stay on the device in compute dtype. That is how a
PEFT model (``peft.get_peft_model`` before conversion) trains: the base is frozen, the adapters are the store's
parameters, named as in ``PeftModel.named_parameters()`` (what PEFT's adapter state dict is built from).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..config import MegaTrainConfig
from ..optim.device_stepper import DeviceStepper
from .executor import StreamedLayer, StreamingExecutor
from ..model.families import ModelHead, check_supported
from ..core.store import HostStore, Unit
from ..model.layers import UnitLayouts, find_layer_stack, group_layers, unit_layouts
from .. import planner
from ..core.memory import available_device_bytes
from ..optim.lean import GA_MESSAGE, LeanAdamW, StepReplay
from ..optim.adamw import CPUAdamW
from ..model.template import LayerTemplate

logger = logging.getLogger(__name__)

# transformers.Trainer.get_decay_parameter_names: no decay for biases and norm weights.
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def default_decay_names(model: nn.Module) -> set[str]:
    """Names Trainer would weight-decay (same rule as ``Trainer.get_decay_parameter_names``)."""
    out = set()
    for mname, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            continue
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if not any(p.search(full.lower()) for p in _NO_DECAY):
                out.add(full)
    return out


def _check_not_converted(model: nn.Module) -> None:
    """A model whose layers are already streamed proxies (converted before ``get_peft_model`` wrapped it) has no
    layer weights left to adapt or train: say what to do instead."""
    if any(isinstance(m, StreamedLayer) for m in model.modules()):
        raise ValueError(
            f"this {type(model).__name__} holds a model already converted by hf_megatrain (its decoder layers are "
            "streamed proxies). Call peft.get_peft_model(model, config) on the plain model *before* handing it to "
            "MegaTrainEngine / MegaTrainTrainer / MegaTrainPlugin; an existing engine is reused by passing "
            "engine.model (or the engine) itself.")


def _check_plain_head(model: nn.Module) -> None:
    """The chunked loss multiplies by ``lm_head.weight`` (+ bias): an adapter wrapped around lm_head (LoRA on it)
    would be silently skipped, so refuse it."""
    head = model.get_output_embeddings()
    extra = [n for n, _ in head.named_parameters() if n not in ("weight", "bias")]
    if extra:
        raise ValueError(
            f"the output embeddings ({type(head).__name__}) carry extra parameters {extra[:3]}: hf_megatrain computes "
            "the loss from lm_head.weight directly, so adapters on lm_head are not supported. Leave lm_head out of "
            "the PEFT target_modules (train it fully with requires_grad_(True) instead, or keep it frozen).")


@dataclass
class MegaTrainOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor | None = None


class MegaTrainEngine:
    def __init__(self, model: nn.Module, config: MegaTrainConfig | None = None,
                 device: torch.device | str | None = None, decay_names: set[str] | None = None) -> None:
        self.config = config = config or MegaTrainConfig()
        self.model = model
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.compute_dtype = config.torch_compute_dtype
        pin = config.pin_memory and self.device.type == "cuda"
        if hasattr(model, "config"):
            model.config.use_cache = False
        _check_not_converted(model)
        self.stack = find_layer_stack(model, config.layers_path)
        check_supported(model, self.stack)
        _check_plain_head(model)
        layers = self.stack.layers
        decay = default_decay_names(model) if decay_names is None else set(decay_names)

        # Layouts (layers.unit_layouts, shared with the planner): one unit per layer, then one resident unit
        # (parameters shared by tying appear once). Frozen layer parameters get a compute-dtype layout of their own
        # (no master, no optimizer state); frozen resident ones stay on the device (``frozen_resident``).
        ul = unit_layouts(model, self.stack, decay)
        layer_param_ids = {id(p) for p in layers.parameters()}
        outside = [(n, p) for n, p in model.named_parameters() if id(p) not in layer_param_ids]
        resident = [(n, p) for n, p in outside if p.requires_grad]
        self._resident_numel = ul.numels[-1]
        self.resident_on_device = self._resident_on_device(ul.numels[-1])
        # Streamed layers' placement (planner.layer_placement): kept whole on the GPU, AdamW on the GPU, or host.
        self.layer_placement = self._place_layers(ul)
        kept, device_stepped = set(self.layer_placement.kept), self.layer_placement.stepped
        self._check_host_fits(ul)  # the planner's numbers, before any large allocation
        gpu = self.device if self.device.type != "cpu" else None
        devices = [gpu if i in kept else None for i in range(len(ul.layouts) - 1)] + [
            self.device if self.resident_on_device else None]
        moment_devices = [self.device if i in device_stepped else None for i in range(len(ul.layouts))]
        self.store = HostStore(ul.layouts, compute_dtype=self.compute_dtype, pin=pin,
                               memory_fraction=config.host_memory_fraction,
                               streamed=[True] * (len(ul.layouts) - 1) + [False], devices=devices,
                               frozen_layouts=ul.frozen[:-1] + [[]], state_dir=config.optimizer_state_dir,
                               moment_devices=moment_devices, lean=config.lean_store,
                               compute_copy=[i not in kept for i in range(len(ul.layouts))])
        self.layer_units = self.store.units[:-1]
        self.resident_unit = self.store.units[-1]
        for i in kept:  # their AdamW runs where their state is: the executor accumulates the gradient there
            self.layer_units[i].grad_device = self.layer_units[i].grad
        self.resident_params: dict[str, nn.Parameter] = dict(resident)
        # Frozen resident parameters (frozen embeddings, a PEFT base's embeddings / lm_head): device, compute dtype.
        self.frozen_resident: dict[str, nn.Parameter] = {n: p for n, p in outside if not p.requires_grad}

        # Layers -> host store + templates + proxies. One layer at a time, so peak memory grows by one layer.
        kinds = group_layers(layers)
        templates: dict[int, LayerTemplate] = {}
        buffers: list[dict[str, torch.Tensor]] = []
        originals = list(layers)
        for i, layer in enumerate(originals):
            unit = self.layer_units[i]
            if kinds[i] not in templates:
                templates[kinds[i]] = LayerTemplate(layer, unit.params, unit.frozen_params,
                                                   compile=config.torch_compile)
            if not next(layer.parameters(), torch.empty(0, device='meta')).is_meta:
                for n, p in layer.named_parameters():
                    self.store.load_(f"{self.stack.path}.{i}.{n}", p.detach())
            buffers.append({n: b.to(self.device) for n, b in layer.named_buffers()})
            layer.to("meta")  # free this layer's weights now that the store holds them: peak = store + one layer
        self.executor = StreamingExecutor(
            self.layer_units, kinds, [templates[k] for k in range(len(templates))], buffers, device=self.device,
            compute_dtype=self.compute_dtype, grad_offload_dtype=config.torch_grad_offload_dtype,
            num_slots=config.num_slots, micro_batch_size=config.micro_batch_size, pin=pin, kept=kept)
        # Family extras of the HF head (soft-capping, logit scaling, MoE router aux loss): families.py.
        self.head_extras = ModelHead(model, self.stack, self.executor)
        for i, layer in enumerate(originals):
            layers[i] = StreamedLayer(self.executor, i, layer)
        del originals

        # Resident parameters: FP32 master (host or device) + a working copy in compute dtype on the device.
        # On the device the working parameters are views into the unit's compute buffer, so the optimizer's
        # master -> compute refresh updates them in place.
        for name, p in self.resident_params.items():
            if not p.is_meta:
                self.store.load_(name, p.detach())
        self.store.sync_all_compute_()
        u = self.resident_unit
        for sl in u.params:
            param = self.resident_params[sl.name]
            if self.resident_on_device:
                param.data = u.view(u.compute, sl)
            else:
                param.data = torch.empty(sl.shape, dtype=self.compute_dtype, device=self.device)
        self._push_resident()
        for p in {id(p): p for p in self.frozen_resident.values()}.values():
            if not p.is_meta:
                p.data = p.data.to(self.device, self.compute_dtype)
        for mod in model.modules():  # rotary tables and other buffers follow to the device, dtype unchanged
            for bname, b in list(mod._buffers.items()):
                if b is not None and not b.is_meta:
                    mod._buffers[bname] = b.to(self.device)
        chosen = [self.layer_units[i] for i in device_stepped]
        self.device_stepper = DeviceStepper(chosen, self.device, self.compute_dtype) if chosen else None
        self.optimizer: CPUAdamW | None = None
        # Lean store: the training forward whose backward the current step's gradients came from (lean_step.py).
        self._replay: StepReplay | None = None
        self._replaying = False
        self._checked_shapes: set[tuple[int, int]] = set()  # (batch, seq) shapes the GPU check passed

    # -- parameters ------------------------------------------------------------------------------------------------------
    def _resident_on_device(self, numel: int) -> bool:
        on = planner.resident_on_device(numel, self.config, self.device.type, available_device_bytes(self.device))
        logger.info("hf_megatrain: resident parts (%.1fM params): FP32 master and AdamW on the %s", numel / 1e6,
                    "device" if on and self.device.type == "cuda" else "host")
        return on

    def _check_host_fits(self, ul: UnitLayouts) -> None:
        """Refuse a model whose host store (+ the executor's host buffers) will not fit the available RAM, with the
        planner's needed-vs-available message, before anything large is allocated or the model is touched."""
        shape = planner.ModelShape.from_layouts(self.model, ul)
        planner.check_fits(shape, self.config, device_type=self.device.type,
                           gpu_available=available_device_bytes(self.device), baseline_paid=True,
                           resident_on_dev=self.resident_on_device, placement=self.layer_placement)

    def _check_step_fits(self, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """CUDA, training: the first time a (batch, seq) shape comes, check the planner's GPU peak for a step of
        it against the GPU memory this process can use, so a step that cannot fit fails with what to change
        instead of an out-of-memory error mid-backward."""
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
                # Advisory until the planner's GPU model is calibrated on real runs (it has not been yet): a
                # step that truly does not fit still fails with CUDA's out-of-memory error.
                logger.warning("hf_megatrain: %s", e)

    def _push_resident(self, unit: Unit | None = None) -> None:
        """Copy the resident masters (via their streaming copy) into the device working parameters."""
        u = self.resident_unit
        if self.resident_on_device:
            return  # the working parameters are views of the unit's compute buffer
        for p in u.params:
            self.resident_params[p.name].data.copy_(u.view(u.compute, p))

    def load_master_(self, name: str, tensor: torch.Tensor) -> None:
        self.store.load_(name, tensor)

    def sync_device_(self) -> None:
        """After masters changed outside the optimizer (loading a checkpoint): refresh copies on both sides."""
        self.store.sync_all_compute_()
        self._push_resident()
        self.executor.invalidate()

    def named_master_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, FP32 master) for every trainable parameter; tied names appear once."""
        for unit in self.store.units:
            for p in unit.params:
                yield p.name, unit.view(unit.master, p)

    def named_frozen_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, compute-dtype value) of every frozen parameter: streamed ones (host), then resident (device)."""
        for name in self.store.frozen_by_name:
            yield name, self.store.frozen_tensor(name)
        yield from ((n, p.detach()) for n, p in self.frozen_resident.items())

    def num_parameters(self, include_frozen: bool = False) -> int:
        """Trainable parameters (tied once); with ``include_frozen`` all of them."""
        return self.store.numel + (sum(p.numel() for _, p in self.named_frozen_tensors()) if include_frozen else 0)

    # -- gradients -------------------------------------------------------------------------------------------------------
    def finish_backward(self) -> None:
        """Land all gradients of the backward(s) so far in the host store (FP32 accumulation)."""
        self.executor.finish()
        u = self.resident_unit
        grads = {p.name: self.resident_params[p.name].grad for p in u.params}
        if all(g is None for g in grads.values()):
            return
        for p in u.params:
            g, dst = grads[p.name], u.view(u.grad, p)
            if g is None:  # no gradient reached this parameter: it contributes zeros
                if not u.grad_valid:
                    dst.zero_()
                continue
            if u.grad_valid:
                dst.add_(g.to(torch.float32))
            else:
                dst.copy_(g)
            self.resident_params[p.name].grad = None
        u.grad_valid = True

    # -- forward -----------------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, num_items_in_batch: torch.Tensor | int | None = None,
                return_logits: bool = False, **kwargs: Any) -> MegaTrainOutput:
        replay = self._record_forward(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                           num_items_in_batch=num_items_in_batch, return_logits=return_logits,
                                           **kwargs))
        if self.optimizer is not None:
            self.optimizer.wait_unit(self.resident_unit.index)
        if self.executor.backward_ran or any(p.grad is not None for p in self.resident_params.values()):
            self.finish_backward()
        self.executor.training = self.model.training
        self._check_step_fits(input_ids, kwargs)
        dev = self.device
        move = lambda t: t.to(dev, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
        kwargs = {k: move(v) for k, v in kwargs.items()}
        base = self._decoder()
        extras = self.head_extras
        attention_mask = move(attention_mask)
        with extras.capture(kwargs) as router_logits:
            out = base(input_ids=move(input_ids), attention_mask=attention_mask, use_cache=False, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # [B, T, H]
        head = self.model.get_output_embeddings()
        loss = None
        if labels is not None:
            loss = extras.loss(hidden, head, move(labels), chunk_tokens=self.config.loss_chunk_tokens,
                               num_items_in_batch=num_items_in_batch, router_logits=router_logits,
                               attention_mask=attention_mask, compiled=self.config.torch_compile)
        logits = extras.logits(hidden, head) if return_logits else None
        if replay is not None:
            replay.watch({"loss": loss, "logits": logits}, self._bind_replay)
        return MegaTrainOutput(loss=loss, logits=logits)

    __call__ = forward

    def _decoder(self) -> nn.Module:
        # The module that owns the layer stack (e.g. LlamaModel) runs embeddings -> layers -> final norm.
        return self.stack.parent

    # -- lean store: replaying a step ---------------------------------------------------------------------------------
    def _record_forward(self, kwargs: dict[str, Any]) -> StepReplay | None:
        """Lean store, training forward: keep what re-running it needs (inputs, RNG, autocast, mode)."""
        if not self.config.lean_store or self._replaying or not torch.is_grad_enabled():
            return None
        if self._replay is not None:
            raise RuntimeError(GA_MESSAGE.format(what="a second training forward came after a backward"))
        return StepReplay(kwargs, self.device, self.model.training)

    def _bind_replay(self, replay: StepReplay) -> None:
        """First gradient into a recorded forward's outputs: this is the forward of the step being computed."""
        if self._replay is not None and self._replay is not replay:
            raise RuntimeError(GA_MESSAGE.format(what="the outputs of two forwards received gradients"))
        self._replay = replay

    def _end_step(self) -> None:
        self._replay = None

    def _regenerate_step(self) -> None:
        """Lean store: run the current step's forward+backward again (same inputs, RNG, autocast, weights), so every
        layer's gradient reaches the optimizer a second time; the resident gradients it produces are dropped (the
        first run's were landed already)."""
        replay = self._replay
        if replay is None:
            raise RuntimeError("hf_megatrain: lean_store must re-run this step's forward+backward, but no training "
                               "forward of it was recorded (was the backward run on the engine's outputs?)")
        self._replaying = True
        try:
            self.executor.invalidate()
            with replay.replaying(self.model):
                out = self.forward(**replay.kwargs)
                replay.backward({"loss": out.loss, "logits": out.logits})
            self.executor.finish()
        finally:
            self._replaying = False
            for p in self.resident_params.values():
                p.grad = None
            self.executor.invalidate()

    # -- optimizer ---------------------------------------------------------------------------------------------------------
    def create_optimizer(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                         weight_decay: float = 0.0, max_grad_norm: float | None = None) -> CPUAdamW:
        order = [self.resident_unit.index] + [u.index for u in self.layer_units]
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                  unit_order=order, skip_nonfinite=self.config.skip_nonfinite, overlap=self.config.overlap_optimizer,
                  before_step=self._before_step, after_unit=self._after_unit, device_stepper=self.device_stepper)
        if self.config.lean_store:
            opt = LeanAdamW(self.store, regenerate=self._regenerate_step, end_step=self._end_step, **kw)
            self.executor.lean_sink = opt.lean_sink
        else:
            opt = CPUAdamW(self.store, **kw)
        self.optimizer = opt
        self.executor.wait_for_unit = lambda i: opt.wait_unit(self.layer_units[i].index)
        return opt

    def _place_layers(self, ul: UnitLayouts) -> planner.LayerPlacement:
        """Which streamed layers stay whole on the GPU and which run AdamW there (planner.layer_placement), chosen
        before the host store is built so their state is allocated on the GPU from the start (never in host RAM)."""
        free = available_device_bytes(self.device)
        if free is not None and self.resident_on_device:  # what the resident parts will take first
            free = max(free - planner.resident_device_bytes(self._resident_numel, self.config), 0)
        place = planner.layer_placement(ul.numels[:-1], ul.frozen_numels[:-1], self.config, self.device.type, free)
        n = sum(1 for x in ul.numels[:-1] if x > 0)
        logger.info("hf_megatrain: of %d streamed layers, %d stay on the GPU, %d run AdamW on the GPU, %d on the "
                    "CPU", n, len(place.kept), len(place.stepped), n - len(place.kept) - len(place.stepped))
        return place

    def _before_step(self) -> None:
        self.finish_backward()
        self.executor.invalidate()

    def _after_unit(self, unit: Unit) -> None:
        if unit is self.resident_unit and not self.resident_on_device:
            self._push_resident()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
