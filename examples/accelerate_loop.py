#!/usr/bin/env python
"""A hand-written Accelerate training loop with hf_megatrain (``MegaTrainPlugin``) on the embedded default job.

    python examples/accelerate_loop.py [--steps 100] [--output_dir outputs/accelerate_loop]
    accelerate launch --config_file examples/megatrain.yaml examples/accelerate_loop.py
    megatrain launch --config examples/megatrain_combined.yaml examples/accelerate_loop.py

What changes against a plain Accelerate loop:
  * ``plugin.prepare(model, lr=..., weight_decay=..., max_grad_norm=...)`` builds the streamed model and its CPU
    AdamW (instead of ``torch.optim.AdamW(model.parameters())``); clipping is the optimizer's ``max_grad_norm``.
  * ``accelerator.prepare`` gets the optimizer (so ``accelerator.accumulate`` skips its step between
    accumulation boundaries), the dataloader and the scheduler. Passing the model too is harmless: it is not an
    ``nn.Module`` on purpose (the engine placed its weights already), so Accelerate hands it back untouched.
  * Save with ``model.save_pretrained`` (a standard HF checkpoint from the FP32 masters).
"""

from __future__ import annotations

import argparse
import os

import datasets
import torch
from accelerate import Accelerator
from transformers import default_data_collator, get_cosine_schedule_with_warmup

from hf_megatrain import MegaTrainPlugin
from hf_megatrain.hf import default_job


def packed_blocks(tokenizer, block_size: int) -> datasets.Dataset:
    raw = datasets.load_dataset("text", data_files=default_job.data_files(), split="train")
    ids = [t + [tokenizer.eos_token_id] for t in tokenizer(list(raw["text"]))["input_ids"]]
    flat = [i for t in ids for i in t]
    blocks = [flat[i:i + block_size] for i in range(0, len(flat) - block_size + 1, block_size)]
    return datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--output_dir", default="outputs/accelerate_loop")
    args = p.parse_args(argv)

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(0)
    tokenizer = default_job.load_tokenizer()
    model = default_job.build_model(tokenizer)
    loader = torch.utils.data.DataLoader(packed_blocks(tokenizer, args.block_size), batch_size=args.batch_size,
                                         shuffle=True, collate_fn=default_data_collator)

    # Config from MEGATRAIN_CONFIG / MEGATRAIN_* (set by `megatrain launch`), else defaults.
    plugin = MegaTrainPlugin(device=accelerator.device)
    accelerator.print(f"MegaTrainConfig: {plugin.config}")
    model, optimizer = plugin.prepare(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=10, num_training_steps=args.steps)
    adamw = optimizer  # the UnitAdamW itself (last_grad_norm...); Accelerate wraps it in an AcceleratedOptimizer
    optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)

    model.train()
    losses, step = [], 0
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                losses.append(float(loss.detach()))
                if step == 1 or step % args.log_every == 0:
                    accelerator.print(f"step {step:4d}  loss {losses[-1]:.4f}  grad_norm "
                                      f"{adamw.last_grad_norm:.3f}  lr {scheduler.get_last_lr()[0]:.2e}")
            if step >= args.steps:
                break

    out = os.path.abspath(args.output_dir)
    if accelerator.is_main_process:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    accelerator.print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}; checkpoint: {out}")
    return {"losses": losses, "checkpoint": out}


if __name__ == "__main__":
    main()
