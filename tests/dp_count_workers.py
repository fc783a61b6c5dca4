"""MegaTrainTrainer runs for tests/test_data_parallel_counts.py: any family, any process count, resumed from a
checkpoint of any process count; in this process (one process) or in every process of an ``accelerate launch``
(``python -m tests.dp_count_workers``, below).

One global batch is ``ROWS`` rows x ``GA`` accumulation steps whatever the process count: each process reads
``per_device`` rows per micro-batch. A reference for N processes runs one process with the same micro-batches
(``per_device`` rows, ``GA * N`` accumulation steps), because a MoE router's load-balancing loss is computed per
micro-batch (not linear in the rows, as the cross-entropy is): accelerate gives the micro-batch ``g`` of rank ``r``
the sampler's batch ``g * N + r``, so the optimizer step of N processes sees exactly the micro-batches one process
accumulating ``GA * N`` of them sees, and Trainer's ``average_tokens_across_devices`` scaling makes the sums equal.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from tests.dp_workers import mapped_run_files, weights
from tests.models import tiny

ROWS, GA, STEPS = 4, 2, 3  # rows of one global micro-batch, accumulation steps (of the N processes), steps


def build_model(family: str = "llama", tie: bool = False, lora: bool = False) -> torch.nn.Module:
    model = tiny(family, tie=tie)
    if lora:
        from tests.test_peft import lora as with_lora
        model = with_lora(model)
    return model


def trainer_run(out: str, family: str = "llama", tie: bool = False, processes: int = 1, reference_for: int = 1,
                resume: str | None = None, lora: bool = False) -> dict:
    """``STEPS`` steps of MegaTrainTrainer (fp32, clipped, weight decay, warm-up, in-order samples) on the tiny
    ``family`` model (``lora``: its LoRA adapters, the frozen base in the shared store), a checkpoint at step 2 in
    ``out``. ``processes``: how many run this (the launch's); ``reference_for``: one process stepping the
    micro-batches of that many (see the module docstring). Returns the final FP32 masters, the logged (loss,
    grad_norm) of every step, how many steps this run made, this process's run summary and the bytes of the shared
    store's files it maps."""
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback

    from hf_megatrain import MegaTrainTrainer
    from hf_megatrain.engine.summary import run_summary
    from tests.test_trainer import dataset, mt_args

    class InOrder(MegaTrainTrainer):  # (the same rows make each global batch, whatever the process count)
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    n = max(processes, reference_for)
    if ROWS % n:
        raise ValueError(f"{ROWS} rows per global micro-batch do not split over {n} processes")
    args = mt_args(out, config=dict(compute_dtype="float32", shared_memory_dir=os.path.dirname(out)),
                   per_device_train_batch_size=ROWS // n, gradient_accumulation_steps=GA * reference_for,
                   ddp_backend="gloo" if processes > 1 else None, max_steps=STEPS, save_strategy="steps",
                   save_steps=2, max_grad_norm=0.5, learning_rate=1e-2)
    earlier = mapped_run_files()  # (stores of earlier runs in this process, not yet collected)
    steps = []  # (the optimizer steps this run made: a resumed run makes only those after its checkpoint)
    count = type("CountSteps", (TrainerCallback,), {"on_step_end": lambda self, *a, **k: steps.append(1)})
    trainer = InOrder(model=build_model(family, tie, lora), args=args, train_dataset=dataset(), callbacks=[count()])
    assert trainer.args.world_size == processes, (trainer.args.world_size, processes)
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.model is trainer.engine.model  # (never DDP-wrapped)
    logs = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return {"weights": weights(trainer.engine), "logs": logs, "steps_run": len(steps),
            "summary": run_summary(trainer.engine), "mapped_store_bytes": _store_bytes(mapped_run_files() - earlier)}


def _store_bytes(files: set[tuple[str, str]]) -> int:
    """Bytes of the shared store's buffers among ``files`` (named ``<n>-<numel>-<dtype>.bin``), the int64 per-unit
    update counters left out."""
    total = 0
    for _, name in files:
        _, numel, dtype = name[:-len(".bin")].split("-")
        if dtype != "int64":
            total += int(numel) * getattr(torch, dtype).itemsize
    return total


def main() -> None:
    """Every process of ``accelerate launch ... -m tests.dp_count_workers --runs JSON``: each run in turn
    (``trainer_run``'s keyword arguments plus "out"); the main process saves each result as ``<out>/result.pt``,
    every process its run summary and mapped store bytes as ``<out>/rank<r>.pt``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="JSON list of trainer_run keyword arguments")
    runs = json.loads(parser.parse_args().runs)
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        for kw in runs:
            result = trainer_run(processes=int(os.environ["WORLD_SIZE"]), **kw)
            rank = int(os.environ["RANK"])
            if rank == 0:
                torch.save(result, os.path.join(kw["out"], "result.pt"))
            torch.save({k: result[k] for k in ("summary", "mapped_store_bytes")},
                       os.path.join(kw["out"], f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
