"""The one export path: every model save (Trainer ``save_model``/checkpoints, ``MegaTrainModel.save_pretrained``, the
converted HF model's own ``save_pretrained`` (model_view.py), merged PEFT exports) goes through ``export_model``.

What gets written depends only on the model and on ``merged``:

- a PEFT model: the standard adapter folder ``PeftModel.from_pretrained(base, dir)`` loads
  (``peft_support.save_adapter``);
- a PEFT model with ``merged=True``: base + merged adapters as a plain HF checkpoint (``peft_support.save_merged``);
- any other model: the full standard HF checkpoint, streamed tensor by tensor from the FP32 masters
  (``checkpoint.save_pretrained_streamed``) plus ``extra_tensors``.

The dtype defaults to the engine config's ``save_dtype`` (the one export-dtype knob).

Every export is crash-safe in a folder that already holds a model: written into a staging folder inside it and
committed so that ``from_pretrained`` finds the complete old or the complete new model after a kill at any instant
(``checkpoint/staged.py``), with the folder locked against a second process exporting into it.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import torch

from . import peft_support
from .. import checkpoint as ckpt
from ..config import parse_dtype
from ..core.engine_view import EngineView


def extra_tensors(engine: EngineView) -> list[tuple[str, torch.Tensor]]:
    """What a standard checkpoint holds besides the trainable FP32 masters: frozen parameters (compute dtype;
    streamed layers' from the host store, resident ones from the device) and persistent buffers (the model's and
    those inside the streamed layers). Names in the model's ``_keys_to_ignore_on_save`` are left out; a tied name
    appears once (as HF saves)."""
    model = engine.model
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    taken = set(engine.store.names()) | skip  # (the masters' names: no wait for updates in flight)
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in engine.named_frozen_tensors():
        if name not in taken:
            out.append((name, t))
            taken.add(name)
    buffers = {n for n, _ in model.named_buffers()}
    # The class's state_dict (the converted model's own one comes back here: model_view.py): persistent buffers only;
    # the layers' persistent buffers live in the executor.
    persistent = [(n, t) for n, t in type(model).state_dict(model).items() if n in buffers]
    for name, t in persistent + list(engine.named_layer_buffers()):
        if name not in taken and not t.is_meta:
            out.append((name, t))
            taken.add(name)
    return out


def checkpoint_bytes(engine: EngineView, dtype: torch.dtype | str | None = None) -> ckpt.CheckpointBytes:
    """Tensor bytes of one Trainer checkpoint of ``engine`` (checkpoint/space.py, the formula ``megatrain estimate``
    uses), from its store's exact element counts: the export in ``dtype`` (default: the config's ``save_dtype``;
    a PEFT model's is its adapters), the FP32 master where the checkpoint keeps one, the AdamW moments."""
    dt = parse_dtype(dtype if dtype is not None else engine.config.save_dtype, "dtype")
    if peft_support.is_peft_model(engine.model):  # (adapters only; their FP32 master always: hf/trainer.py)
        return ckpt.trainer_checkpoint_bytes(engine.store.numel, 0, dt, master=True)
    extra = ckpt.safetensors_io.data_bytes(extra_tensors(engine), dt)  # (floating ones cast to dt, as written)
    return ckpt.trainer_checkpoint_bytes(engine.store.numel, extra, dt)


def model_tensors(engine: EngineView) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of everything a full export writes: trainable FP32 masters (waits for updates in flight),
    then ``extra_tensors``; values are the live tensors, not copies."""
    yield from engine.named_master_tensors()
    yield from extra_tensors(engine)


def export_model(engine: EngineView, save_dir: str, *, dtype: torch.dtype | str | None = None,
                 max_shard_size: int | str | None = None, merged: bool = False,
                 adapter_kwargs: dict[str, Any] | None = None, show_progress: bool = True) -> list[str]:
    """Write ``engine.model`` to ``save_dir`` (see the module docstring) and return the files written.

    ``dtype``: ``float32`` or ``bfloat16`` (default: ``engine.config.save_dtype``). ``max_shard_size``: largest
    safetensors shard (default ``checkpoint.DEFAULT_MAX_SHARD_SIZE``; unused by the small adapter file).
    ``adapter_kwargs`` go to PEFT's ``save_pretrained`` for an adapter folder. ``show_progress``: a bar of the bytes
    of a full export (``checkpoint.save_pretrained_streamed``; adapters are small)."""
    dt = parse_dtype(dtype if dtype is not None else engine.config.save_dtype, "dtype")
    shard = max_shard_size if max_shard_size is not None else ckpt.DEFAULT_MAX_SHARD_SIZE
    peft = peft_support.is_peft_model(engine.model)
    if merged:
        if not peft:
            raise ValueError("a merged export needs a PEFT model (peft.get_peft_model before handing the model to "
                             "hf_megatrain); a fully trained model is exported by save_model / save_pretrained")
        with ckpt.staged_export(save_dir) as stage:
            return peft_support.save_merged(engine, stage, dtype=dt, max_shard_size=shard)
    if peft:
        with ckpt.staged_export(save_dir) as stage:
            readme = os.path.join(save_dir, "README.md")
            if os.path.isfile(readme):  # PEFT updates an existing model card in place: give it the user's one
                shutil.copy2(readme, os.path.join(stage, "README.md"))
            return peft_support.save_adapter(engine, stage, dtype=dt, **(adapter_kwargs or {}))
    return ckpt.save_pretrained_streamed(engine, save_dir, dtype=dt, max_shard_size=shard,
                                         extra=extra_tensors(engine), show_progress=show_progress)
