"""The lean store with data parallel on the CPU (gloo), shared by tests/test_data_parallel_lean.py and its spawned
processes: every case runs in one process over the whole global batch (the reference) and in 2 processes over
their rows of it (each loss scaled as Trainer does: the ranks' gradients are averaged).

Top-level functions only (``torch.multiprocessing.spawn`` pickles them by name). A *schedule* gives each step its
``max_grad_norm`` and whether a non-finite gradient norm is injected into the first layer gradient that lands on
the last rank (``POISON``): that rank stops speculating at once while the others speculate on every layer, so the
skipped step is settled differently per rank (the ranks must still agree on what runs collectively).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain import checkpoint as ckpt
from tests.dp_workers import as_launched, ranks, weights
from tests.models import tiny
from tests.parity import random_batches

BATCH, SEQ, LR, WD = 4, 12, 1e-2, 0.1
NO_CLIP, CLIP = 1e6, 0.3  # (the tiny models' norms are ~1-5: 0.3 clips every step)
POISON = "poison"
EVERY = [(CLIP, None)] * 4  # clipping on every step: norm first (first step), then from the plane / a re-run
# Steps 1-2 do not clip (step 2 speculates), step 3 clips after speculating (taken back, redone), step 4 clips
# (norm first).
MIX = [(NO_CLIP, None), (NO_CLIP, None), (CLIP, None), (CLIP, None)]
# Step 3 speculates and is skipped: a non-finite norm on the last rank's first landed shard, so that rank
# speculated on nothing while the others speculated on every layer (and take it back); step 4 speculates again,
# step 5 clips after speculating.
SPEC_SKIP = [(NO_CLIP, None), (NO_CLIP, None), (NO_CLIP, POISON), (NO_CLIP, None), (CLIP, None)]

# name -> (model family, config keys, schedule)
CASES: dict[str, tuple[str, dict, list]] = {
    "plane_every": ("llama", dict(lean_grad_plane="on"), EVERY),
    "plane_mix": ("qwen2", dict(lean_grad_plane="on"), MIX),
    "rerun_every": ("llama", dict(lean_grad_plane="off"), EVERY),
    "rerun_mix": ("qwen2", dict(lean_grad_plane="off"), MIX),
    "rerun_spec_skip": ("llama", dict(lean_grad_plane="off"), SPEC_SKIP),
    "plane_spec_skip": ("llama", dict(lean_grad_plane="on"), SPEC_SKIP),
    "exact_mix": ("llama", dict(lean_grad_plane="off", exact_take_back=True), MIX),
    "exact_spec_skip": ("llama", dict(lean_grad_plane="off", exact_take_back=True), SPEC_SKIP),
}
# bf16 compute (the compute copy exists only there): lean + compute copy + plane, against the full store in the
# same processes (same bf16 rounding per row, so the same results), and against one process (rows regrouped).
BF16_CASES: dict[str, tuple[str, dict, list]] = {
    "copy_bf16": ("llama", dict(lean_compute_copy=True, lean_grad_plane="on"), MIX),
    "copy_rerun_bf16": ("llama", dict(lean_compute_copy=True, lean_grad_plane="off"), MIX),
    "full_bf16": ("llama", dict(lean_store=False), MIX),
    # The native kernel: updates from the plane split per shard (new weights first) or whole, the same bits.
    "split_bf16": ("llama", dict(lean_compute_copy=True, lean_grad_plane="on", host_kernel="native",
                                 split_host_update="on"), MIX),
    "whole_bf16": ("llama", dict(lean_compute_copy=True, lean_grad_plane="on", host_kernel="native",
                                 split_host_update="off"), MIX),
}
RESUME = "plane_mix"  # the case checkpointed after SAVE_AT steps and resumed across process counts
SAVE_AT = 2  # (after a step that did not clip: the resumed run speculates, then takes back)


def batches(n: int) -> list:
    return [m[0] for m in random_batches(n, 1, BATCH, SEQ, vocab=96, seed=11)]


def make(case: str, shm: str, dp=None) -> tuple[MegaTrainEngine, torch.optim.Optimizer, list]:
    family, keys, schedule = {**CASES, **BF16_CASES}[case]
    dtype = "bfloat16" if case in BF16_CASES else "float32"
    config = MegaTrainConfig(**{"compute_dtype": dtype, "lean_store": True, "shared_memory_dir": shm, **keys})
    engine = MegaTrainEngine(tiny(family), config, device="cpu", dp=dp)
    # (clipping on at creation: the plane is allocated and the first step takes its norm first)
    opt = engine.create_optimizer(lr=LR, weight_decay=WD, max_grad_norm=schedule[0][0])
    return engine, opt, schedule


def run(engine: MegaTrainEngine, opt, schedule: list, start: int, stop: int, rank: int = 0,
        world: int = 1) -> tuple[list[float], list[float]]:
    """Steps [start, stop) of ``schedule`` on this rank's rows of each global batch: (global norm, global loss) of
    each step."""
    data = batches(len(schedule))
    target = engine.layer_units[-1].index  # (the first layer gradient to land)
    norms, losses = [], []
    for step in range(start, stop):
        clip, event = schedule[step]
        opt.max_grad_norm = clip
        hooks = []
        if event == POISON and rank == world - 1:
            def poison(i, first, grad, sq):
                if first and i == target:
                    sq.fill_(float("nan"))
            hooks.append(poison)
        if hasattr(opt, "gradient_hooks"):  # (the lean optimizer's)
            opt.gradient_hooks[:] = hooks
        ids, labels = data[step]
        n_items = int((labels != -100).sum())
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        out = engine(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items)
        (out.loss * world).backward()
        opt.step()
        opt.split_steps_seen = getattr(opt, "split_steps_seen", 0) + opt.last_step_split
        loss = out.loss.detach().float().reshape(1).clone()
        if world > 1:
            dist.all_reduce(loss)
        norms.append(opt.last_grad_norm)
        losses.append(float(loss))
        opt.zero_grad()
    if hasattr(opt, "gradient_hooks"):
        opt.gradient_hooks[:] = []
    opt.wait()
    return norms, losses


def counters(opt) -> dict[str, int]:
    plane = getattr(opt, "plane", None)
    return {"regenerated": getattr(opt, "regenerated_steps", 0), "plane": getattr(opt, "plane_steps", 0),
            "skipped": opt.skipped_steps, "plane_bytes": plane.nbytes if plane is not None else 0,
            "split_steps": getattr(opt, "split_steps_seen", 0)}


def reference(case: str, shm: str) -> dict:
    """One process over the whole batch: the final masters, norms, losses and counters."""
    engine, opt, schedule = make(case, shm)
    norms, losses = run(engine, opt, schedule, 0, len(schedule))
    return {"weights": weights(engine), "norms": norms, "losses": losses, **counters(opt)}


def save(engine: MegaTrainEngine, path: str, rank: int = 0) -> None:
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        ckpt.save_training_state(engine, path, master=True)
    engine.ranks.barrier()


def resume(engine: MegaTrainEngine, path: str) -> None:
    ckpt.load_pretrained_into_engine(engine, path, prefix=ckpt.MASTER_PREFIX)
    assert ckpt.load_training_state(engine, path)


def resumed(shm: str, path: str, rank: int = 0, world: int = 1, dp=None) -> dict[str, torch.Tensor]:
    """``RESUME`` from the checkpoint at ``path`` (written after ``SAVE_AT`` steps), to the end."""
    engine, opt, schedule = make(RESUME, shm, dp)
    resume(engine, path)
    run(engine, opt, schedule, SAVE_AT, len(schedule), rank, world)
    return weights(engine)


def lean_worker(rank: int, world: int, tmp: str) -> None:
    """Every case in 2 processes (rank 0 saves what it ends with; each rank its norms and counters); the resume
    case also checkpoints after ``SAVE_AT`` steps, and a 1-process checkpoint is resumed in 2."""
    out: dict[str, dict] = {}
    with ranks(rank, world, tmp) as dp:
        for case in [*CASES, *BF16_CASES]:
            engine, opt, schedule = make(case, tmp, dp)
            if case == RESUME:
                norms, losses = run(engine, opt, schedule, 0, SAVE_AT, rank, world)
                save(engine, os.path.join(tmp, "lean_ckpt_2proc"), rank)
                more = run(engine, opt, schedule, SAVE_AT, len(schedule), rank, world)
                norms, losses = norms + more[0], losses + more[1]
            else:
                norms, losses = run(engine, opt, schedule, 0, len(schedule), rank, world)
            copies_exact = all(torch.equal(u.compute[slice(*opt.own(u))], u.master[slice(*opt.own(u))].to(
                u.compute.dtype)) for u in engine.layer_units if u.compute is not None)
            out[case] = {"weights": weights(engine) if rank == 0 else None, "norms": norms, "losses": losses,
                         "copies_exact": copies_exact, "own": [opt.own(u) for u in engine.layer_units],
                         **counters(opt)}
            del engine, opt
        out["resumed_1to2"] = {"weights": resumed(tmp, os.path.join(tmp, "lean_ckpt_1proc"), rank, world, dp)}
        torch.save(out, os.path.join(tmp, f"lean_rank{rank}.pt"))
        dp.barrier()


# -- through MegaTrainTrainer (accelerate, gloo) -----------------------------------------------------------------------
def trainer_run(tmp: str, world: int, run: str, resume: str | None = None) -> dict[str, torch.Tensor]:
    """4 steps of MegaTrainTrainer with the lean store and its plane, one backward per step over a global batch of 4
    rows (4 // world per process), in-order samples, every step clipped, a checkpoint at step 2 in ``tmp/run``:
    the final FP32 masters."""
    from torch.utils.data import SequentialSampler

    from hf_megatrain import MegaTrainTrainer
    from tests.test_trainer import dataset, mt_args

    class InOrder(MegaTrainTrainer):  # (the same rows make each global batch, whatever the process count)
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    config = dict(compute_dtype="float32", shared_memory_dir=tmp, lean_store=True, lean_grad_plane="on")
    args = mt_args(os.path.join(tmp, run), config=config, per_device_train_batch_size=4 // world,
                   gradient_accumulation_steps=1, max_steps=4, ddp_backend="gloo" if world > 1 else None,
                   save_strategy="steps", save_steps=2, max_grad_norm=0.5)
    trainer = InOrder(model=tiny("llama"), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    return weights(trainer.engine)


def trainer_worker(rank: int, world: int, tmp: str, port: int) -> None:
    as_launched(rank, world, port)
    try:
        final = trainer_run(tmp, world, "lean_trainer_2proc")
        if rank == 0:
            torch.save(final, os.path.join(tmp, "lean_trainer_2proc.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def auto_layout_worker(rank: int, world: int, tmp: str) -> None:
    """``host_layout="auto"`` with 2 processes: only rank 0 sees too little RAM for the full store; both ranks build
    the lean store it chose (one shared store), then train 2 clipped steps; each rank saves its config's layout keys
    and rank 0 the weights."""
    import hf_megatrain.engine.conversion_plan as cp
    from hf_megatrain import planner

    model = tiny("llama")
    cfg = MegaTrainConfig(compute_dtype="float32", shared_memory_dir=tmp)
    if rank == 0:
        shape = planner.ModelShape.from_model(model)
        as_run = cfg.resolved(device_layers=0, device_step_layers=0)
        full = planner.estimate(shape, as_run, 2048, 8, device_type="cpu", gpus=world,
                                plans=planner.unit_plans(shape, as_run, "cpu", None, host_free=1 << 50,
                                                         data_parallel=True)).host_total
        cp.available_host_bytes = lambda: int(full / cfg.host_memory_fraction) - 1
    with ranks(rank, world, tmp) as dp:
        engine = MegaTrainEngine(model, cfg, device="cpu", dp=dp)
        opt = engine.create_optimizer(lr=LR, weight_decay=WD, max_grad_norm=CLIP)
        data = batches(2)
        for ids, labels in data:
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            n_items = int((labels != -100).sum())
            loss = engine(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items).loss
            (loss * world).backward()
            opt.step()
            opt.zero_grad()
        keys = {k: getattr(engine.config, k) for k in ("lean_store", "lean_compute_copy", "lean_grad_plane")}
        torch.save({"keys": keys, "note": engine.host_layout_note,
                    "weights": weights(engine) if rank == 0 else None}, os.path.join(tmp, f"auto_rank{rank}.pt"))
        dp.barrier()
