"""MegaTrainTrainingArguments: ``TrainingArguments`` plus the MegaTrain switches, validated up front.

Everything a user can get wrong about combining MegaTrain with Trainer options (DeepSpeed, FSDP, other
optimizers, fp16 loss scaling, a bad config key or dtype) fails here, when the arguments are built, with a
message that says what to change -- not minutes later inside the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..checkpoint.folders import DEFAULT_MAX_SHARD_SIZE
from ..config import MegaTrainConfig, resolve_config

SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")


def check_lean_accumulation(config: MegaTrainConfig, gradient_accumulation_steps: int) -> None:
    """The lean store takes exactly one backward per optimizer step (optim/lean.py)."""
    if config.lean_store and gradient_accumulation_steps > 1:
        raise ValueError(f"lean_store=True does not support gradient_accumulation_steps={gradient_accumulation_steps}: "
                         "each layer's gradient is consumed when its backward ends. Put the sequences in one batch "
                         "(per_device_train_batch_size x gradient_accumulation_steps) and set megatrain_config "
                         "micro_batch_size to the old per-device batch size: the batch is split inside each layer "
                         "visit (same math, same activation memory), with gradient_accumulation_steps=1.")


@dataclass
class MegaTrainTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the MegaTrain switches (see ``MegaTrainConfig`` for the policy keys)."""

    megatrain: bool = field(default=True, metadata={"help": "Train with hf_megatrain's streamed engine."})
    megatrain_config: dict | str | None = field(
        default=None, metadata={"help": "MegaTrainConfig as a dict, a JSON string or a yaml path (export dtype: "
                                        "its save_dtype key). Defaults to the MEGATRAIN_CONFIG env var; "
                                        "MEGATRAIN_<KEY> env vars override keys."})
    megatrain_max_shard_size: str = field(
        default=DEFAULT_MAX_SHARD_SIZE, metadata={"help": "Largest safetensors shard written, e.g. '5GB'."})

    def __post_init__(self) -> None:
        if isinstance(self.megatrain_config, MegaTrainConfig):  # keep the arguments JSON-serialisable
            self.megatrain_config = self.megatrain_config.to_dict()
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
            for flag in ("fp16", "fp16_full_eval", "bf16_full_eval"):
                if getattr(self, flag):
                    raise ValueError(f"{flag}=True is not used with megatrain=True: masters stay FP32 and layers "
                                     "compute in megatrain_config['compute_dtype'] ('bfloat16' or 'float32'). "
                                     f"Remove {flag}.")
            if self.label_smoothing_factor:
                raise ValueError("label_smoothing_factor is not supported with megatrain=True (the loss is a fused "
                                 "chunked cross-entropy); set it to 0.")
            if self.use_liger_kernel:
                raise ValueError("use_liger_kernel=True is not supported with megatrain=True (hf_megatrain already "
                                 "computes the loss with a fused chunked cross-entropy); remove it.")
            if self.torch_compile or self.torch_compile_backend or self.torch_compile_mode:
                # (Trainer would compile the whole model, whose decoder layers are weightless streamed proxies.)
                raise ValueError("TrainingArguments torch_compile / torch_compile_backend / torch_compile_mode are "
                                 "not used with megatrain=True. Set the megatrain_config key instead: "
                                 "megatrain_config={..., 'torch_compile': True} (compiles each layer template and "
                                 "the loss chunk), and remove the TrainingArguments flag.")
        super().__post_init__()
        if self.megatrain:
            # validate now: unknown keys / bad dtypes fail at argument time
            check_lean_accumulation(self.megatrain_resolved_config(), self.gradient_accumulation_steps)

    def megatrain_resolved_config(self) -> MegaTrainConfig:
        """``config.resolve_config(megatrain_config)``: that source (else env MEGATRAIN_CONFIG), then the
        MEGATRAIN_<KEY> env variables."""
        return resolve_config(self.megatrain_config)

    @property
    def place_model_on_device(self) -> bool | None:  # the engine placed what lives on the device already
        return False if self.megatrain else super().place_model_on_device
