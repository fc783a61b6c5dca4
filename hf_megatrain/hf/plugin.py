"""MegaTrainPlugin: hf_megatrain for hand-written Accelerate training loops.

In the style of accelerate's ``DeepSpeedPlugin``: a dataclass whose fields fall back to the environment the
launcher sets (``MEGATRAIN_CONFIG`` = yaml written by ``megatrain launch``, ``MEGATRAIN_<KEY>`` = single keys),
and one call that hands back what the loop drives::

    plugin = MegaTrainPlugin()                                  # or MegaTrainPlugin({"compute_dtype": "float32"})
    model, optimizer = plugin.prepare(model, lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    loader, scheduler = accelerator.prepare(loader, scheduler)  # model/optimizer may be passed too: see below
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    model.save_pretrained("out")                                # standard HF checkpoint (FP32 masters)

Why the returned model is *not* an ``nn.Module``: the engine already placed every weight (FP32 masters in host
memory, resident parts on the GPU in compute dtype); ``accelerator.prepare`` moves, casts and wraps modules,
which must not happen here. Accelerate passes objects it does not recognise through untouched, so
``accelerator.prepare(model, ...)`` is harmless. The optimizer is a real ``torch.optim.Optimizer`` (CPU AdamW
over the host masters): LR schedulers drive it, and ``accelerator.prepare`` may wrap it.

Gradient clipping belongs in ``prepare(max_grad_norm=...)``: it is folded into the fused AdamW kernel for free.
``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` also works (``parameters()`` lands the gradients
on the host and yields the FP32 masters with their ``.grad``), at the cost of one extra pass over all gradients.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..export.weights import export_model, model_tensors
from ..config import MegaTrainConfig, parse_dtype, resolve_config
from ..engine.runtime import MegaTrainEngine, MegaTrainOutput
from ..optim.adamw import UnitAdamW
from .training_args import model_param_dtype

logger = logging.getLogger(__name__)


@dataclass
class MegaTrainPlugin:
    """Streamed full-precision training for a custom Accelerate loop.

    Args:
        megatrain_config (`MegaTrainConfig`, `dict`, `str`, *optional*):
            The policy (see ``MegaTrainConfig``): an object, a dict, a JSON string or a yaml path (a combined
            ``megatrain launch`` yaml works too: its ``megatrain:`` section is used). Defaults to the file in env
            ``MEGATRAIN_CONFIG``; env ``MEGATRAIN_<KEY>`` variables override single keys
            (``config.resolve_config``, as for ``MegaTrainTrainingArguments``).
        device (`str` or `torch.device`, *optional*):
            Device the layers stream to. Defaults to the current CUDA device, else CPU.

    Precision: a custom loop has no Trainer flags, so the compute dtype is the config's ``compute_dtype``:
    bfloat16 unless set (also for a float32 model, which ``prepare`` then warns about; Accelerate's
    ``mixed_precision`` is not read: keep it 'no'). Set ``compute_dtype='float32'`` for fp32 compute.
    """

    megatrain_config: Any = field(
        default=None,
        metadata={"help": "MegaTrainConfig, dict, JSON string or yaml path. Defaults to the MEGATRAIN_CONFIG env "
                          "var; MEGATRAIN_<KEY> env vars override keys."})
    device: Any = field(
        default=None, metadata={"help": "Device the layers stream to; default: current CUDA device, else CPU."})
    config: MegaTrainConfig = field(init=False, repr=True)

    def __post_init__(self) -> None:
        self.config = resolve_config(self.megatrain_config)
        self.engine: MegaTrainEngine | None = None

    def prepare(self, model: torch.nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = None,
                decay_names: set[str] | None = None) -> tuple["MegaTrainModel", UnitAdamW]:
        """Convert ``model`` in place and build its CPU AdamW.

        Weight decay follows Trainer's rule (not biases / norm weights) unless ``decay_names`` is given.
        Returns ``(model, optimizer)``: drive them like an HF model and a torch optimizer.
        """
        if self.engine is not None:
            raise RuntimeError("MegaTrainPlugin.prepare was already called; create one plugin per model")
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # (its saves are called by the main process alone, while the others may go on updating the host's
            # shared state: a torn checkpoint)
            raise NotImplementedError(
                f"MegaTrainPlugin runs one process; this launch has {dist.get_world_size()}. For several processes "
                "of one host use MegaTrainTrainer (data parallel), or MegaTrainEngine(model, config, "
                "dp=hf_megatrain.parallel.DataParallel.from_process_group()) in your own loop (hf_megatrain/parallel/)")
        if "compute_dtype" not in self.config.explicit_keys and model_param_dtype(model) == torch.float32 \
                and self.config.torch_compute_dtype != torch.float32:
            logger.warning("hf_megatrain: the model is float32 and no compute_dtype was given: layers compute in %s "
                           "(MegaTrainPlugin's default; masters, gradients and AdamW stay FP32). Set "
                           "compute_dtype='float32' for fp32 compute, or compute_dtype='%s' to silence this.",
                           self.config.compute_dtype, self.config.compute_dtype)
        engine = MegaTrainEngine(model, self.config, device=self.device, decay_names=decay_names)
        optimizer = engine.create_optimizer(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                            max_grad_norm=max_grad_norm)
        self.engine = engine
        return MegaTrainModel(engine), optimizer


class MegaTrainModel:
    """The streamed model as a training loop sees it: ``model(**batch).loss``, ``train()``/``eval()``,
    ``parameters()`` (FP32 masters), ``state_dict()`` and ``save_pretrained()``."""

    def __init__(self, engine: MegaTrainEngine) -> None:
        self.engine = engine
        self.hf_model = engine.model
        self._warned_apart = False
        # The optimizer's master views carry ``.grad`` (views of the host gradient buffers): hand those out.
        opt = engine.optimizer
        by_ptr = {(p.data_ptr(), tuple(p.shape)): p for g in opt.param_groups for p in g["params"]} if opt else {}
        self._masters: dict[str, torch.Tensor] = {}
        for name, master in engine.named_master_tensors():
            self._masters[name] = by_ptr.get((master.data_ptr(), tuple(master.shape)), master)

    # -- calling -------------------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> MegaTrainOutput:
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> MegaTrainOutput:
        return self.engine(input_ids=input_ids, **kwargs)

    def train(self, mode: bool = True) -> "MegaTrainModel":
        self.hf_model.train(mode)
        return self

    def eval(self) -> "MegaTrainModel":
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.hf_model.training

    @property
    def config(self):
        return self.hf_model.config

    @property
    def device(self) -> torch.device:
        return self.engine.device

    # -- parameters / gradients ----------------------------------------------------------------------------------------
    def _land_gradients(self) -> None:
        self.engine.land_gradients()
        apart = [u.index for u in self.engine.store.units if u.plan.grad is not u.plan.master]
        if apart and not self._warned_apart:
            self._warned_apart = True
            logger.warning("hf_megatrain: %d layers keep no gradient beside their FP32 master (lean_store: none at "
                           "all; GPU-stepped layers: on the GPU), so parameters() yields their masters without "
                           ".grad and a norm over model.parameters() would miss them. Clip with "
                           "prepare(max_grad_norm=...) (exact, inside the optimizer step).", len(apart))

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, FP32 master) of every trainable parameter, gradients landed in ``.grad`` (tied names once)."""
        self._land_gradients()
        yield from self._masters.items()

    def parameters(self) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p

    def num_parameters(self) -> int:
        return self.engine.num_parameters()

    # -- export --------------------------------------------------------------------------------------------------------
    def state_dict(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
        """Standalone host copies: trainable masters and frozen parameters cast to ``dtype`` (default FP32),
        persistent buffers. Holds a second copy of the model: prefer ``save_pretrained`` for large models."""
        dt = parse_dtype(dtype, "dtype") if dtype is not None else torch.float32
        return {n: t.detach().to("cpu", dt if t.is_floating_point() else t.dtype, copy=True)
                for n, t in model_tensors(self.engine)}

    def save_pretrained(self, save_directory: str, dtype: torch.dtype | str | None = None,
                        max_shard_size: int | str | None = None, **kwargs: Any) -> list[str]:
        """Write a standard HF checkpoint (safetensors + config) that plain ``from_pretrained`` loads, streamed
        tensor by tensor from the FP32 masters (no second copy of the model in memory); ``dtype`` defaults to
        the config's ``save_dtype``. For a PEFT model: the adapter folder ``PeftModel.from_pretrained(base, dir)``
        loads (``kwargs`` go to PEFT's ``save_pretrained``; see ``save_merged``). Returns the files written."""
        return export_model(self.engine, save_directory, dtype=dtype, max_shard_size=max_shard_size,
                            adapter_kwargs=kwargs)

    def save_merged(self, save_directory: str, dtype: torch.dtype | str | None = None,
                    max_shard_size: int | str | None = None) -> list[str]:
        """PEFT models: base + merged adapters as a standard HF checkpoint (plain ``from_pretrained`` loads it);
        ``dtype`` defaults to the config's ``save_dtype``."""
        return export_model(self.engine, save_directory, dtype=dtype, max_shard_size=max_shard_size, merged=True)
