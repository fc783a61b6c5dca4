"""MegaTrainTrainingArguments: ``TrainingArguments`` plus the MegaTrain switches, validated up front.

Everything a user can get wrong about combining MegaTrain with Trainer options (DeepSpeed, FSDP, other
optimizers, fp16 loss scaling, a bad config key or dtype) fails here, when the arguments are built, with a
message that says what to change -- not minutes later inside the training loop.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from ..checkpoint.folders import DEFAULT_MAX_SHARD_SIZE
from ..config import MegaTrainConfig, describe_sources, resolve_config

logger = logging.getLogger(__name__)

SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")


def model_param_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype most of ``model``'s floating-point parameters have (by element count; ``None`` without any):
    what plain Trainer computes in when no precision flag is set."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else None


def check_lean_accumulation(config: MegaTrainConfig, gradient_accumulation_steps: int,
                            chosen: str | None = None) -> None:
    """The lean store takes exactly one backward per optimizer step (optim/lean.py). ``chosen``: the engine's
    ``host_layout_note`` when ``host_layout="auto"`` picked the lean store (said in the message)."""
    if config.lean_store and gradient_accumulation_steps > 1:
        why = f" (The lean store was chosen for this model because the full store does not fit: {chosen})" \
            if chosen else ""
        raise ValueError(f"lean_store=True does not support gradient_accumulation_steps={gradient_accumulation_steps}: "
                         "each layer's gradient is consumed when its backward ends. Put the sequences in one batch "
                         "(per_device_train_batch_size x gradient_accumulation_steps) and set megatrain_config "
                         "micro_batch_size to the old per-device batch size: the batch is split inside each layer "
                         "visit (same math, same activation memory), with gradient_accumulation_steps=1." + why)


@dataclass
class MegaTrainTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the MegaTrain switches (see ``MegaTrainConfig`` for the policy keys).

    Precision flags mean what they mean in Trainer (``megatrain_compute_dtype``): an explicit ``compute_dtype``
    in the megatrain config wins; else ``bf16=True`` computes in bfloat16; else the model's dtype decides (a
    float32 model trains in float32, as plain Trainer without autocast; a bfloat16 model in bfloat16).
    ``fp16`` / ``fp16_full_eval`` / ``bf16_full_eval`` are refused. Masters, gradients and AdamW state are FP32
    whatever the compute dtype."""

    megatrain: bool = field(default=True, metadata={"help": "Train with hf_megatrain's streamed engine."})
    megatrain_config: dict | str | None = field(
        default=None, metadata={"help": "MegaTrainConfig as a dict, a JSON string or a yaml path (export dtype: "
                                        "its save_dtype key). Its keys override those of the yaml named by the "
                                        "MEGATRAIN_CONFIG env var (what `megatrain launch --config` sets); "
                                        "MEGATRAIN_<KEY> env vars override both."})
    megatrain_max_shard_size: str = field(
        default=DEFAULT_MAX_SHARD_SIZE, metadata={"help": "Largest safetensors shard written, e.g. '5GB'."})
    megatrain_allow_unverified_checkpoint: bool = field(
        default=False, metadata={"help": "Resume from (or load the best model of) a checkpoint that cannot be "
                                         "verified: no megatrain_manifest.json, or files the manifest does not "
                                         "list. Off: such a checkpoint is refused with an error naming the file."})
    megatrain_skip_disk_check: bool = field(
        default=False, metadata={"help": "Start training even when the checkpoints this run keeps at once (one "
                                         "checkpoint's bytes x save_total_limit + 1, or every planned save without "
                                         "a limit) exceed the free space of output_dir's disk. Off: such a run is "
                                         "refused before the first step, naming both numbers."})

    def __post_init__(self) -> None:
        if isinstance(self.megatrain_config, MegaTrainConfig):  # keep the arguments JSON-serialisable
            # (only the keys it was given: an unset compute_dtype stays for the flags and the model to decide)
            self.megatrain_config = self.megatrain_config.explicit_dict()
        if self.megatrain:
            # Checked before TrainingArguments builds a DeepSpeed/FSDP setup from these arguments.
            if self.deepspeed:
                raise ValueError("megatrain=True cannot be combined with deepspeed: hf_megatrain already keeps "
                                 "weights, gradients and optimizer state in host memory. Remove `deepspeed=` "
                                 "(or set megatrain=False to train with DeepSpeed).")
            if self.fsdp not in (None, "", False, []):
                raise ValueError("megatrain=True cannot be combined with fsdp: hf_megatrain trains on one GPU with "
                                 "host-resident state. Remove `fsdp=` (or set megatrain=False to use FSDP).")
            optim = str(getattr(self.optim, "value", self.optim))
            if optim not in SUPPORTED_OPTIM:
                raise ValueError(f"optim={optim!r} is not supported with megatrain=True; hf_megatrain runs AdamW "
                                 f"on the FP32 host master. Use one of {list(SUPPORTED_OPTIM[:3])}.")
            for flag in ("fp16", "fp16_full_eval"):
                if getattr(self, flag):
                    raise ValueError(f"{flag}=True is not supported with megatrain=True: hf_megatrain computes in "
                                     "bfloat16 or float32 (FP32 masters, no loss scaling). Use bf16=True for "
                                     "bfloat16 compute, or set megatrain_config['compute_dtype'] ('bfloat16' or "
                                     f"'float32'), and remove {flag}.")
            if self.bf16_full_eval:
                raise ValueError("bf16_full_eval=True is not used with megatrain=True: evaluation computes in the "
                                 "training compute dtype (bf16=True, or megatrain_config['compute_dtype']) from the "
                                 "FP32 masters. Remove bf16_full_eval.")
            if self.label_smoothing_factor:
                raise ValueError("label_smoothing_factor is not supported with megatrain=True (the loss is a fused "
                                 "chunked cross-entropy); set it to 0.")
            if self.use_liger_kernel:
                raise ValueError("use_liger_kernel=True is not supported with megatrain=True (it patches the model's "
                                 "modules and forward, which hf_megatrain streams and replaces). For Liger's fused "
                                 "linear cross-entropy set megatrain_config={..., 'loss_impl': 'liger'} ('auto', the "
                                 "default, picks it when installed on CUDA), and remove use_liger_kernel.")
            if self.torch_compile or self.torch_compile_backend or self.torch_compile_mode:
                # (Trainer would compile the whole model, whose decoder layers are weightless streamed proxies.)
                raise ValueError("TrainingArguments torch_compile / torch_compile_backend / torch_compile_mode are "
                                 "not used with megatrain=True. Set the megatrain_config key instead: "
                                 "megatrain_config={..., 'torch_compile': True} (compiles each layer template and "
                                 "the loss chunk; the default 'auto' already does on a GPU), and remove the "
                                 "TrainingArguments flag.")
        super().__post_init__()
        if self.megatrain:
            # validate now: unknown keys / bad dtypes fail at argument time
            config = self.megatrain_resolved_config()
            check_lean_accumulation(config, self.gradient_accumulation_steps)
            if self.bf16 and "compute_dtype" in config.explicit_keys and config.torch_compute_dtype != torch.bfloat16:
                logger.warning("hf_megatrain: bf16=True but the megatrain config sets compute_dtype=%r explicitly: "
                               "layers compute in %s (the explicit key wins). Remove one of the two.",
                               config.compute_dtype, config.compute_dtype)

    def megatrain_compute_dtype(self, config: MegaTrainConfig | None = None,
                                model_dtype: torch.dtype | None = None) -> str | None:
        """The compute dtype this run trains in, decided the way plain Trainer decides its precision:

        1. ``compute_dtype`` set explicitly in the megatrain config (``megatrain_config``, the
           ``MEGATRAIN_CONFIG`` yaml or env ``MEGATRAIN_COMPUTE_DTYPE``) wins (a warning when it contradicts
           ``bf16=True``);
        2. else ``bf16=True`` -> ``"bfloat16"`` (``fp16=True`` is refused when the arguments are built:
           hf_megatrain computes in bfloat16 or float32);
        3. else, with neither flag, the model's own dtype, as plain Trainer runs it without autocast: a float32
           model -> ``"float32"``, a bfloat16 (or float16) model -> ``"bfloat16"``.

        ``model_dtype`` is the dtype of the model's parameters (``model_param_dtype``); ``None`` when not known
        yet, and then rule 3 cannot apply: the result is ``None`` (undecided)."""
        config = self.megatrain_base_config() if config is None else config
        if "compute_dtype" in config.explicit_keys:  # (a contradicting bf16=True is warned about at __post_init__)
            return str(config.torch_compute_dtype).replace("torch.", "")
        if self.bf16:
            return "bfloat16"
        if model_dtype is None:
            return None
        if model_dtype == torch.float32:
            return "float32"
        if model_dtype == torch.float16:
            logger.warning("hf_megatrain: the model is float16 and neither bf16=True nor compute_dtype is set: "
                           "layers compute in bfloat16 (hf_megatrain computes in bfloat16 or float32; masters "
                           "are FP32). Set megatrain_config['compute_dtype'] to choose.")
        return "bfloat16"

    def megatrain_base_config(self) -> MegaTrainConfig:
        """``config.resolve_config(megatrain_config)``: the yaml of env MEGATRAIN_CONFIG, this source's keys over it,
        then the MEGATRAIN_<KEY> env variables; ``explicit_keys`` are what the user set, before the precision flags.

        Resolved once, when the arguments are built (that is when a bad key fails), and kept: the Trainer, its
        engine and the run summary read this one resolution. Assigning another ``megatrain_config`` (or changing
        the dict in place) resolves again; env variables set after the arguments were built are not read (set them
        first, as ``megatrain launch`` does)."""
        source = self.megatrain_config
        held = self.__dict__.get("_mt_resolution")  # (source as resolved, its config); not a dataclass field
        if held is None or held[0] != source:
            held = (copy.deepcopy(source), resolve_config(source, name="megatrain_config"))
            self.__dict__["_mt_resolution"] = held
        return held[1]

    def megatrain_resolved_config(self, model_dtype: torch.dtype | None = None) -> MegaTrainConfig:
        """``megatrain_base_config()`` with ``compute_dtype`` decided by ``megatrain_compute_dtype``: an explicit
        key, else ``bf16=True``, else the model's dtype (``model_dtype``; ``MegaTrainTrainer`` passes it). Without
        an explicit key, a flag or a model dtype the config's default (``bfloat16``) is left in place. No second
        resolution: the result is derived from the one kept."""
        config = self.megatrain_base_config()
        dtype = self.megatrain_compute_dtype(config, model_dtype)
        if dtype is None or "compute_dtype" in config.explicit_keys:
            return config
        return MegaTrainConfig.from_dict({**config.explicit_dict(), "compute_dtype": dtype})

    def megatrain_config_source(self, model_dtype: torch.dtype | None = None,
                                compute_dtype: torch.dtype | None = None) -> str:
        """Where this run's config came from (each key's layer, see ``config.resolve_config``) and how its compute
        dtype was decided, in words (the run summary). ``model_dtype``: the unconverted model's; ``compute_dtype``:
        the engine's, for a model converted before the Trainer saw it."""
        config = self.megatrain_base_config()
        where = describe_sources(config)
        for line in config.key_overrides:
            where += f" ({line})"
        if "compute_dtype" in config.explicit_keys:
            why = "compute_dtype set explicitly"
        elif self.bf16:
            why = "compute dtype from bf16=True"
        elif model_dtype is not None:
            why = f"compute dtype from the model's dtype ({str(model_dtype).replace('torch.', '')}; bf16 not set)"
        elif compute_dtype is not None:  # (a model converted before the Trainer saw it: from_pretrained_streamed)
            why = f"compute dtype {str(compute_dtype).replace('torch.', '')}, as the model was converted (bf16 not set)"
        else:
            why = "compute dtype from the model's dtype (bf16 not set)"
        return f"{where}; {why}"

    @property
    def place_model_on_device(self) -> bool | None:  # the engine placed what lives on the device already
        return False if self.megatrain else super().place_model_on_device
