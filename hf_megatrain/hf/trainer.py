"""MegaTrainTrainer: ``transformers.Trainer`` running the streamed engine, unchanged for the user.

Trainer keeps its loop (gradient accumulation, loss normalisation, LR schedulers, logging, callbacks, evaluation,
checkpoint rotation, best-model tracking, Hub pushes); this subclass swaps the few places where a model larger
than GPU memory cannot be treated like a module:

- the model is converted by ``MegaTrainEngine`` before Trainer sees it, and never moved by Trainer; its compute
  dtype follows Trainer's precision flags (``MegaTrainTrainingArguments.megatrain_compute_dtype``: an explicit
  ``compute_dtype`` wins, else ``bf16=True`` -> bfloat16, else the model's dtype: float32 stays float32);
- the loss comes from the engine (same ``num_items_in_batch`` semantics as the HF model, so Trainer's scaling
  applies untouched); evaluation asks the engine for logits only when metrics need them;
- the optimizer is the engine's ``UnitAdamW``; gradient clipping happens inside its step (Trainer's own clip would
  only see the resident parameters), and the norm it measured is what gets logged as ``grad_norm``;
- models are exported by ``export.export_model`` (in the config's ``save_dtype``) from the FP32 master without a
  ``state_dict``; checkpoints are committed atomically (``checkpoint``); resuming restores masters, AdamW moments
  and step counts exactly.

Several processes of one host (``accelerate launch --multi_gpu`` / torchrun, ``world_size > 1``): data parallel
(hf_megatrain/parallel/): one FP32 store per host in shared memory, each rank steps its shard; the model is never
wrapped in DDP (the engine reduces gradients itself); checkpoints are written once, by the main process, in the
same format, and resume with any number of processes.

PEFT: pass a ``peft.get_peft_model(...)`` model (wrap it *before* handing it over). The base is frozen (streamed in
compute dtype, no optimizer state), saves write the standard adapter folder (checkpoints add the adapters' FP32
master for exact resume), and ``save_merged_model`` exports base + merged adapters as a plain HF checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState, TrainerCallback
from transformers.trainer_pt_utils import nested_detach
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import checkpoint as ckpt
from ..export import peft_support
from ..engine.runtime import ENGINE_ATTR, MegaTrainEngine
from ..engine.summary import format_summary, run_summary
from ..checkpoint.plain_trainer import has_torch_optimizer, load_torch_adamw, write_resume_note
from ..checkpoint.safetensors_io import write_json
from ..parallel import DataParallel
from ..export.weights import checkpoint_bytes, export_model
from .disk_check import CheckpointSpaceCheck
from .placement_hint import with_placement_tokens
from .pretrained import from_pretrained_streamed, load_weights
from ..config import parse_dtype
from .training_args import MegaTrainTrainingArguments, check_lean_accumulation, model_param_dtype

# What hf_megatrain decided, written into output_dir at the start of training (_mt_report). The leading underscore
# keeps it out of what push_to_hub uploads (Trainer ignores "_*" there), so it never lands beside the exported model.
RUN_SUMMARY = "_megatrain_run.json"

__all__ = ["MegaTrainTrainer", "MegaTrainTrainingArguments", "from_pretrained_streamed"]

logger = logging.getLogger(__name__)


def _shows_progress(args: TrainingArguments) -> bool:
    """Bars of bytes (core/progress.py): off with ``disable_tqdm``, as the Trainer's own bars, and on every process
    but each node's first."""
    return not args.disable_tqdm and args.local_process_index == 0


def _check_launched_alone(args: TrainingArguments) -> None:
    """Refuse processes launched together that Trainer runs each alone: ``accelerate launch --multi_gpu`` on a
    machine without GPUs and no ``use_cpu`` gives every process a process group of N but ``world_size`` 1, and each
    would train the whole model on the whole batch into the same output_dir."""
    dist = torch.distributed
    launched = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if args.world_size == 1 and launched > 1:
        raise ValueError(
            f"{launched} processes were launched together, but TrainingArguments runs each alone (world_size=1: "
            "accelerate found no GPU for them), so each would train the whole model by itself. On a machine "
            "without GPUs pass use_cpu=True (--use_cpu) to train as one group of processes (gloo); or launch one "
            "process.")


class MegaTrainTrainer(Trainer):
    """``transformers.Trainer`` with the model run by ``MegaTrainEngine`` (see the module docstring)."""

    _mt = False  # (until _mt_setup: composed trainers run their base's __init__ code first, see compose.py)
    engine: MegaTrainEngine | None = None
    # Composed trainers that log per-token metrics (TRL's SFT) set this and implement _mt_log_token_stats.
    _mt_token_stats = False
    _mt_model_dtype: torch.dtype | None = None  # the unconverted model's dtype (decides the compute dtype)
    _mt_train_dataset: Any = None  # the dataset Trainer.__init__ is handed (placement_tokens' hint)
    _mt_placement_note: str | None = None  # placement_tokens read off it, in words (the run summary)
    _mt_reference_note: str | None = None  # a TRL port's reference model, in words (the run summary)

    def __init__(self, model: nn.Module | MegaTrainEngine | None = None, args: TrainingArguments | None = None,
                 *pargs: Any, **kwargs: Any) -> None:
        if len(pargs) > 1:  # (Trainer's positional order: data_collator, train_dataset, ...)
            self._mt_train_dataset = pargs[1]
        model = self._mt_setup(model, args, kwargs)
        super().__init__(model, args, *pargs, **kwargs)
        self._mt_after_init()

    def _mt_setup(self, model: nn.Module | MegaTrainEngine | None, args: TrainingArguments | None,
                  kwargs: dict[str, Any]) -> nn.Module | None:
        """Validate ``args`` and convert ``model``, just before ``Trainer.__init__`` receives them."""
        if args is not None and not isinstance(args, MegaTrainTrainingArguments):
            raise TypeError("MegaTrainTrainer needs MegaTrainTrainingArguments (a TrainingArguments subclass with "
                            f"the megatrain switches), got {type(args).__name__}")
        self._mt = args is not None and args.megatrain
        self.engine = None
        if "train_dataset" in kwargs:  # (what auto placement may plan the GPU for: hf/placement_hint.py)
            self._mt_train_dataset = kwargs["train_dataset"]
        if self._mt:
            self._mt_config = args.megatrain_resolved_config()
            check_lean_accumulation(self._mt_config, args.gradient_accumulation_steps)
            optimizers = kwargs.get("optimizers", (None, None))
            if optimizers[0] is not None or kwargs.get("optimizer_cls_and_kwargs") is not None:
                raise ValueError("with megatrain=True the optimizer is hf_megatrain's CPU AdamW over the FP32 master; "
                                 "do not pass `optimizers` / `optimizer_cls_and_kwargs` (set learning_rate, "
                                 "adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm instead)")
            if args.gradient_checkpointing:
                logger.warning("hf_megatrain: gradient_checkpointing ignored; the streamed backward already "
                               "recomputes every layer")
                args.gradient_checkpointing = False
            if model is not None:
                model = self._mt_convert(model, args)
        return model

    def _mt_after_init(self) -> None:
        if self._mt:  # first, so it runs before any callback that reads gradients around the optimizer step
            self.callback_handler.callbacks.insert(0, _LandForGradientReaders(self))
            self.callback_handler.callbacks.insert(0, _SkippedStepKeepsLR(self))
            # (on_train_begin, before any other callback's: a run refused for disk space starts no logger / bar)
            self.callback_handler.callbacks.insert(0, CheckpointSpaceCheck(self))
        if self._mt and self.args.n_gpu > 1:
            # One process drives one GPU; never nn.DataParallel. Trainer sized its batch per_device x n_gpu in
            # __init__ already: without resetting it the one GPU silently computed n_gpu times the per-device batch
            # (measured on a 2-GPU host: the "slow" one-process step was a double batch).
            visible = self.args.n_gpu
            self.args._n_gpu = 1
            self._train_batch_size = self.args.train_batch_size
            logger.warning("hf_megatrain: %d GPUs visible to one process; training on %s only, %d sequences per "
                           "step (per_device_train_batch_size). To train on all %d: accelerate launch --multi_gpu "
                           "--num_processes %d your_script.py (data parallel, one host store).", visible,
                           self.args.device, self._train_batch_size, visible, visible)
        if self._mt and self.args.world_size > 1:
            # Never DDP: the engine reduces the gradients itself (reduce-scatter into the shared store); DDP's hooks
            # would reduce the resident ones a second time. Accelerate's model preparation minus the wrapping.
            prepare_model = self.accelerator.prepare_model

            def prepare_unwrapped(model: nn.Module, device_placement: bool | None = None,
                                  evaluation_mode: bool = False) -> nn.Module:
                ours = self.engine is not None and model is self.engine.model
                # (and no placement: accelerate's multi-process CPU device is "cpu:0", and ``.to`` of it would copy
                # the resident parameters away from the engine's buffers)
                return prepare_model(model, device_placement=False if ours else device_placement,
                                     evaluation_mode=evaluation_mode or ours)

            self.accelerator.prepare_model = prepare_unwrapped

    def _mt_log_token_stats(self, stats: Any, inputs: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} sets _mt_token_stats but does not log them")

    # -- model --------------------------------------------------------------------------------------------------------
    def _mt_convert(self, model: nn.Module | MegaTrainEngine, args: MegaTrainTrainingArguments) -> nn.Module:
        if isinstance(model, MegaTrainEngine):
            engine = model
        elif getattr(getattr(model, ENGINE_ATTR, None), "model", None) is model:
            engine = getattr(model, ENGINE_ATTR)  # (a PeftModel around a converted model is refused by the engine)
        else:
            # Precision as in Trainer: explicit compute_dtype, else bf16=True, else the model's own dtype.
            self._mt_model_dtype = model_param_dtype(model)
            self._mt_config = args.megatrain_resolved_config(model_dtype=self._mt_model_dtype)
            dataset = getattr(self, "train_dataset", None)  # (set once Trainer.__init__ ran: a model_init re-run)
            self._mt_config, self._mt_placement_note = with_placement_tokens(
                self._mt_config, self._mt_train_dataset if dataset is None else dataset,
                args.per_device_train_batch_size)
            decay = set(self.get_decay_parameter_names(model))  # Trainer's rule, on the unconverted model
            device = args.device  # (initialises torch.distributed in a multi-process launch)
            _check_launched_alone(args)
            dp = DataParallel.from_process_group() if args.world_size > 1 else None
            engine = MegaTrainEngine(model, self._mt_config, device=device, decay_names=decay, dp=dp,
                                     show_progress=_shows_progress(args), grad_accum=args.gradient_accumulation_steps)
        # (an engine built before, e.g. by from_pretrained_streamed, may have chosen a lean layout: host_layout)
        check_lean_accumulation(engine.config, args.gradient_accumulation_steps, engine.host_layout_note)
        given = args.megatrain_base_config()  # what the user set (explicit_keys), before the flags
        want = args.megatrain_compute_dtype(given)  # (None: left to the model, i.e. to the engine's builder)
        if want is not None and parse_dtype(want, "compute_dtype") != engine.compute_dtype:
            why = "an explicit compute_dtype" if "compute_dtype" in given.explicit_keys else "bf16=True"
            raise ValueError(f"the model was converted with compute_dtype={engine.config.compute_dtype!r}, but these "
                             f"arguments ask for {want!r} ({why}). Build the engine with the same compute_dtype, "
                             "or pass the unconverted model.")
        cpu = engine.device.type == args.device.type == "cpu"  # ("cpu:0" in a multi-process CPU launch)
        if engine.device != args.device and not cpu:
            raise ValueError(f"the engine runs on {engine.device} but TrainingArguments.device is {args.device}")
        if args.world_size > 1 and engine.ranks.world != args.world_size:
            raise ValueError(f"this run has {args.world_size} processes but the engine was built for "
                             f"{engine.ranks.world}: build it with dp=hf_megatrain."
                             "parallel.DataParallel.from_process_group(), or pass the unconverted model")
        self.engine = engine
        return engine.model

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, returning only once the last optimizer step has updated every unit: the overlapped
        AdamW runs on background threads, and what follows ``train()`` (reading weights, a script's exit) must
        find it done. The main process holds the output folder's lock for the run (a second run there fails at
        once) and first recovers saves a kill interrupted, so that resuming finds them."""
        if not (self._mt and self.args.should_save):
            if self._mt and self.args.world_size > 1:  # the main process recovers first (below): only then may
                self.accelerator.wait_for_everyone()  # resume_from_checkpoint=True list checkpoints on every rank
            return self._mt_train(*args, **kwargs)
        with ckpt.output_dir_lock(self.args.output_dir):
            ckpt.recover_interrupted_saves(self.args.output_dir)
            if self.args.world_size > 1:
                self.accelerator.wait_for_everyone()
            return self._mt_train(*args, **kwargs)

    def _mt_train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._mt and self.engine is not None:
                self.engine.wait_updates()

    def call_model_init(self, trial: Any = None) -> nn.Module:
        model = super().call_model_init(trial)
        return self._mt_convert(model, self.args) if self._mt else model

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not self._mt:
            super()._move_model_to_device(model, device)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        if not self._mt:
            return super().floating_point_ops(inputs)
        main = getattr(self.engine.model, "main_input_name", "input_ids")
        if main not in inputs:
            return 0
        emb = self.engine.model.get_input_embeddings().weight.numel()  # Trainer excludes embeddings
        return 6 * inputs[main].numel() * (self.engine.num_parameters(include_frozen=True) - emb)

    # -- optimizer ----------------------------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if not self._mt:
            return super().create_optimizer(model)
        if self.optimizer is None:
            a = self.args
            self.optimizer = self.engine.create_optimizer(
                lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm if a.max_grad_norm > 0 else None)
            self._mt_report()
        return self.optimizer

    def _mt_report(self) -> None:
        """Say what hf_megatrain decided (precision, placement, host bytes, loss, optimizer, config source) at the
        start of training: in the log (INFO: it is a record, not a warning) and as ``_megatrain_run.json`` in
        ``output_dir`` (not uploaded by push_to_hub), so a run through someone else's script shows it, and a user
        can paste it into an issue."""
        source = self.args.megatrain_config_source(self._mt_model_dtype, self.engine.compute_dtype)
        if self._mt_placement_note:
            source += "; " + self._mt_placement_note
        summary = run_summary(self.engine, config_source=source)
        summary["config_key_sources"] = self.args.megatrain_base_config().key_sources
        if self._mt_reference_note:
            summary["reference"] = self._mt_reference_note
        summary["versions"] = {name: getattr(sys.modules.get(name), "__version__", None)
                               for name in ("hf_megatrain", "torch", "transformers", "accelerate", "peft", "trl")
                               if name in sys.modules}
        if not self.is_world_process_zero():
            return
        logger.info("%s", format_summary(summary))
        if self.args.output_dir:
            os.makedirs(self.args.output_dir, exist_ok=True)
            write_json(os.path.join(self.args.output_dir, RUN_SUMMARY), summary)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        # UnitAdamW.step clips with the exact global norm; Trainer's clip would only see resident parameters.
        return None if self._mt else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return None if self._mt else super()._get_grad_norm(model, grad_norm)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args: Any, **kwargs: Any) -> None:
        if self._mt and self.engine.optimizer is not None and self.engine.optimizer.last_grad_norm is not None:
            grad_norm = self.engine.optimizer.last_grad_norm  # measured inside the step that just ran
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- loss / evaluation --------------------------------------------------------------------------------------------
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        if not self._mt:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.pop("labels") if self.compute_loss_func is not None and "labels" in inputs else None
        kwargs = dict(inputs)
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        want_logits = getattr(self, "_mt_want_logits", None)
        if want_logits is None:
            want_logits = return_outputs or self.compute_loss_func is not None
        out = self.engine(**kwargs, return_logits=want_logits, token_stats=self._mt_token_stats)
        if out.token_stats is not None:
            self._mt_log_token_stats(out.token_stats, inputs)
        # The backward about to run is the step's last when accelerate will sync (step) after it: its gradients are
        # final as they land, so the optimizer may update CPU-stepped layers during it (speculative_step).
        self.engine.set_final_backward(model.training and torch.is_grad_enabled()
                                       and self.accelerator.sync_gradients)
        outputs = CausalLMOutputWithPast(loss=out.loss, logits=out.logits)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif out.loss is None:
            raise ValueError(f"the batch has no `labels` (keys: {sorted(inputs)}); hf_megatrain computes the "
                             "causal-LM loss from `labels` (use DataCollatorForLanguageModeling(mlm=False))")
        else:
            loss = out.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None and (
                self.model_accepts_loss_kwargs or self.compute_loss_func):
            # As Trainer does: each rank's loss is over the global token count, and the ranks' gradients are averaged
            # (parallel/group.py), so the mean of the scaled ones is the global batch's gradient.
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        if not self._mt:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            self._mt_check_prediction_outputs()
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        inputs = self._prepare_inputs(inputs)
        labels = None
        if has_labels:
            labels = nested_detach(tuple(inputs.get(n) for n in self.label_names))
            labels = labels[0] if len(labels) == 1 else labels
        with torch.no_grad():
            if has_labels:
                num_items = self._get_num_items_in_batch([inputs], self.args.device)
                self._mt_want_logits = not prediction_loss_only
                try:
                    loss, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items)
                finally:
                    self._mt_want_logits = None
                loss = loss.detach().mean()
                logits = outputs.logits
            else:
                loss, logits = None, self.engine(**inputs, return_logits=True).logits
        if prediction_loss_only:
            return loss, None, None
        return loss, nested_detach(logits), labels

    def _mt_check_prediction_outputs(self) -> None:
        """Plain Trainer's predictions are every tensor of the model's output besides the loss: a tuple where the
        config asks for more than logits (an MoE's ``output_router_logits``: aux loss, logits, router logits; hidden
        states; attentions). The engine returns the logits alone, so a ``compute_metrics`` written against the plain
        tuple would read other arrays: refuse instead."""
        cfg = getattr(self.engine.model, "config", None)
        configs = [c for c in (cfg, getattr(cfg, "get_text_config", lambda: None)()) if c is not None]
        asked = sorted({k for c in configs for k in ("output_router_logits", "output_hidden_states", "output_attentions")
                        if getattr(c, k, False)})
        if asked:
            raise ValueError(f"hf_megatrain: predictions (compute_metrics / predict) return the logits alone, but this "
                             f"model's config sets {', '.join(asked)}=True, for which plain Trainer returns a tuple of "
                             "every output tensor (e.g. aux loss, logits, router logits), so a compute_metrics written "
                             "for plain Trainer would read other arrays. Evaluate with prediction_loss_only=True, or set "
                             "those flags to False on model.config around evaluate() / predict() (training needs "
                             "output_router_logits=True for the router aux loss).")

    # -- saving -------------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (call it on every process, as with FSDP / DeepSpeed): the main process writes the
        standard checkpoint; with several processes the others wait until it is written, so none updates the
        shared store while it is read."""
        super().save_model(output_dir, _internal_call)
        if self._mt and self.engine is not None:
            self.engine.ranks.barrier()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._mt:
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:  # (Trainer.save_model calls this on every process: the main one writes)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        logger.info("Saving model checkpoint to %s", output_dir)
        with ckpt.output_dir_lock(output_dir):  # (export_model commits the weights crash-safely: staged.py)
            export_model(self.engine, output_dir, dtype=self._mt_config.save_dtype,
                         max_shard_size=self.args.megatrain_max_shard_size, show_progress=self._mt_show_progress)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            elif getattr(self.data_collator, "tokenizer", None) is not None:
                self.data_collator.tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    @property
    def _mt_show_progress(self) -> bool:
        """Bars of the bytes saved, verified and loaded (core/progress.py): off with ``disable_tqdm``, as the
        Trainer's own bars, and on every process but each node's first."""
        return _shows_progress(self.args)

    @property
    def _mt_peft(self) -> bool:
        return self.engine is not None and peft_support.is_peft_model(self.engine.model)

    def save_merged_model(self, output_dir: str | None = None, dtype: torch.dtype | str | None = None) -> list[str]:
        """PEFT runs: write base + merged adapters as a standard HF checkpoint (``from_pretrained`` loads it);
        ``dtype`` defaults to the config's ``save_dtype``."""
        if not self._mt:
            raise ValueError("save_merged_model needs megatrain=True and a PEFT model")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        files: list[str] = []
        if self.args.should_save:  # (like save_model: call it on every process; the main one writes)
            files = export_model(self.engine, output_dir, merged=True, max_shard_size=self.args.megatrain_max_shard_size,
                                 dtype=dtype if dtype is not None else self._mt_config.save_dtype)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        self.engine.ranks.barrier()
        return files

    def _mt_save_barrier(self) -> None:
        """The other ranks wait for the main process's checkpoint save for 30 minutes plus its bytes at 100 MB/s (a
        slow disk), not the process group's fixed 30 minutes: a 120B checkpoint (1.4 TB) takes longer at any rate."""
        nbytes = checkpoint_bytes(self.engine).saved(self.args.save_only_model)  # (checkpoint/space.py)
        wait_s = 1800 + nbytes / 1e8
        try:
            self.engine.ranks.barrier(timeout_s=wait_s)
        except RuntimeError as e:
            raise RuntimeError(f"hf_megatrain: waiting for the main process's checkpoint save failed ({e}). The save "
                               f"barrier waits up to {wait_s:.0f} s (30 minutes + the checkpoint's ~"
                               f"{nbytes / 1e9:.0f} GB at 100 MB/s): the save failed (see the main process's log) or "
                               "is slower than that (a disk slower than 100 MB/s: save less often, or to a faster "
                               "disk)") from e

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if not self._mt:
            return super()._save_checkpoint(model, trial)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.exists(best):
                self.state.best_model_checkpoint = best
        self._mt_rng = self._mt_rng_states()  # (every rank's: a collective)
        if self.args.should_save:
            with ckpt.output_dir_lock(run_dir):  # (held already when train() runs: re-entrant)
                ckpt.recover_interrupted_saves(run_dir)  # never removes the only complete copy; logs each step
                self._mt_write_checkpoint(output_dir)
        self._mt_save_barrier()  # no rank updates the shared state before the main process has written it
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if self.args.should_save:
            with ckpt.output_dir_lock(run_dir):
                ckpt.rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    def _mt_rng_states(self) -> list[dict] | None:
        """Every data-parallel rank's RNG state (dropout masks differ per rank), gathered for the main process to
        write as plain Trainer's ranks do (``rng_state_<rank>.pth``); one process: its own, which Trainer writes."""
        if self.args.save_only_model:
            return None
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.random.get_rng_state_all()
        return self.engine.ranks.all_gather_object(state)

    def _mt_write_checkpoint(self, output_dir: str) -> None:
        """Write checkpoint folder ``output_dir`` atomically (``checkpoint/atomic.py``), its manifest last."""
        with ckpt.atomic_directory(output_dir) as tmp:
            self._save(tmp)
            if not self.args.save_only_model:
                # Adapters are small: always keep their FP32 master (the adapter file has PEFT's key names).
                ckpt.save_training_state(self.engine, tmp, master=self._mt_peft or
                                         self._mt_config.torch_save_dtype != torch.float32,
                                         show_progress=self._mt_show_progress)
                with open(os.path.join(tmp, SCHEDULER_NAME), "wb") as f:
                    torch.save(self.lr_scheduler.state_dict(), f)
                self._save_rng_state(tmp)
                for rank, state in enumerate(self._mt_rng or []):  # (the other ranks': rng_state_<rank>.pth)
                    if rank != self.args.process_index:
                        torch.save(state, os.path.join(tmp, f"rng_state_{rank}.pth"))
            for cb in [c for c in self.callback_handler.callbacks + [self.control]
                       if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
            self.state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
            if not self.args.save_only_model:
                write_resume_note(tmp)  # plain Trainer would silently restart AdamW from this folder: say so
            ckpt.write_manifest(tmp)

    # -- loading ------------------------------------------------------------------------------------------------------
    def _mt_load_weights(self, path: str) -> None:
        if self._mt_peft:
            if ckpt.weight_files(path, ckpt.MASTER_PREFIX) is not None:
                load_weights(self.engine, path, prefix=ckpt.MASTER_PREFIX, show_progress=self._mt_show_progress)
            else:
                peft_support.load_adapter_into_engine(self.engine, path)
            return
        cfg_path = os.path.join(path, "config.json")
        if ckpt.weight_files(path, ckpt.MASTER_PREFIX) is None and os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                saved = json.load(f).get("dtype")
            if saved not in (None, "float32"):
                logger.warning("hf_megatrain: %s holds %s weights and no FP32 master; training continues from "
                               "rounded weights", path, saved)
        # (a checkpoint of plain transformers' Trainer / save_pretrained: per-expert MoE keys converted on load)
        unused = load_weights(self.engine, path, show_progress=self._mt_show_progress)
        if unused:
            logger.warning("hf_megatrain: checkpoint tensors not used by the model: %s", unused[:5])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not self._mt:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # everything checked before any state is touched (but the CRCs the loads check as they read); data parallel:
        # by the main process alone (the ranks share one host's disk: N readers of every byte would make a resume N
        # times longer), its verdict for all
        error = None
        if self.args.should_save:  # (one process: always)
            try:
                # (the files the loads below read whole are CRC-checked while they read them: one read, not two)
                once = [] if self.engine.ranks.world > 1 or self._mt_peft else \
                    ckpt.files_checked_on_load(self.engine, resume_from_checkpoint)
                ckpt.verify_checkpoint(resume_from_checkpoint, crc_on_load=once,
                                       allow_unverified=self.args.megatrain_allow_unverified_checkpoint,
                                       show_progress=self._mt_show_progress)
            except ckpt.CheckpointError as e:
                error = e
        message = self.engine.ranks.broadcast_object(None if error is None else str(error))
        error = error or (ckpt.CheckpointError(message) if message is not None else None)
        if error is not None:
            raise error
        ckpt.check_training_state(self.engine, os.path.join(resume_from_checkpoint, ckpt.OPTIMIZER_TENSORS))
        self._mt_load_weights(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._mt:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        if ckpt.load_training_state(self.engine, checkpoint, show_progress=self._mt_show_progress):
            pass
        elif has_torch_optimizer(checkpoint):  # a plain Trainer checkpoint: its torch AdamW state, exactly
            load_torch_adamw(self.engine, checkpoint)
            logger.info("hf_megatrain: AdamW state loaded from plain Trainer's %s/optimizer.pt", checkpoint)
        else:
            logger.warning("hf_megatrain: %s has no optimizer state (neither hf_megatrain's nor plain Trainer's "
                           "optimizer.pt); AdamW starts fresh", checkpoint)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        if not self._mt:
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint,
                    self.state.best_metric)
        ckpt.verify_checkpoint(self.state.best_model_checkpoint, training_state=False,
                               allow_unverified=self.args.megatrain_allow_unverified_checkpoint,
                               show_progress=self._mt_show_progress)
        self._mt_load_weights(self.state.best_model_checkpoint)


class _LandForGradientReaders(TrainerCallback):
    """The optimizer parameters' ``.grad`` are views of the host gradient buffers, and ``step()`` is what lands the
    last gradients (D2H copies in flight, the resident parameters') and keeps narrow ones (engine/offload.py) as
    bf16 bits until something widens them. ``model.parameters()`` does both; a callback reading
    ``optimizer.param_groups`` around the step would not. So when another callback hooks the step, land and widen
    first (this waits for the updates in flight: the cost falls only on runs with such callbacks)."""

    def __init__(self, trainer: MegaTrainTrainer) -> None:
        self.trainer = trainer

    def _hooked(self, hook: str) -> bool:
        base = getattr(TrainerCallback, hook)
        return self.trainer.engine is not None and any(
            getattr(type(cb), hook, base) is not base for cb in self.trainer.callback_handler.callbacks
            if cb is not self and not isinstance(cb, _SkippedStepKeepsLR))  # (ours: reads no gradient)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hooked("on_pre_optimizer_step"):
            self.trainer.engine.land_gradients()  # (what parameters() shows: landed, FP32, zero where none came)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hooked("on_optimizer_step"):
            self.trainer.engine.widen_gradients()  # (landed by step(); the step's units keep their gradients)


class _SkippedStepKeepsLR(TrainerCallback):
    """Plain Trainer does not advance the LR schedule after a skipped optimizer step (it asks
    ``accelerator.optimizer_step_was_skipped``, which accelerate's fp16 scaler sets on an overflow); a step our
    optimizer skips for a non-finite gradient norm is the same case, so it is reported the same way, right after
    ``step()`` and before Trainer reads it. ``global_step`` still counts the step, as in plain Trainer."""

    def __init__(self, trainer: MegaTrainTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wrapped, ours = self.trainer.optimizer, getattr(self.trainer.engine, "optimizer", None)
        if ours is not None and hasattr(wrapped, "_is_overflow"):  # (accelerate's AcceleratedOptimizer)
            wrapped._is_overflow = bool(getattr(ours, "last_step_skipped", False))
