"""Data-parallel training on the CPU (gloo), shared by tests/test_data_parallel.py and its spawned processes.

Top-level functions only (``torch.multiprocessing.spawn`` pickles them by name). A global batch is split across
the ranks by rows; each rank's loss is its tokens' summed loss over the *global* token count, times the number of
processes (Trainer's ``average_tokens_across_devices`` scaling: the ranks' gradients are averaged, as DDP does),
so the ranks together compute the single-process gradient of the global batch.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain import checkpoint as ckpt
from hf_megatrain.parallel import DataParallel
from tests.models import tiny
from tests.parity import random_batches

STEPS, GA, BATCH, SEQ = 3, 2, 4, 12
LR, WD, CLIP = 1e-2, 0.1, 0.5  # (clip small enough that every step clips)


def batches() -> list:
    return random_batches(STEPS, GA, BATCH, SEQ, vocab=96, seed=7)


def meta_tiny(family: str = "llama", **over: object) -> torch.nn.Module:
    """``tiny(family)``'s model built on the meta device (no weights in RAM), as accelerate's
    ``init_empty_weights`` builds one."""
    from accelerate import init_empty_weights

    cfg = tiny(family, **over).config
    with init_empty_weights(include_buffers=False):
        return type(tiny(family, **over))(cfg)


def make_engine(dp: DataParallel | None, shm: str, compute_dtype: str = "float32", micro_batch_size: int = 0,
                peft: bool = False, model_over: dict | None = None, meta: bool = False,
                **config: object) -> tuple[MegaTrainEngine, torch.optim.Optimizer]:
    """The tiny llama (``peft``: with LoRA adapters; its frozen base streams from the shared store; ``model_over``:
    its config's overrides; ``meta``: built on the meta device); ``config``: more MegaTrainConfig keys."""
    config = MegaTrainConfig(compute_dtype=compute_dtype, shared_memory_dir=shm, micro_batch_size=micro_batch_size,
                             **config)
    model = (meta_tiny if meta else tiny)("llama", **(model_over or {}))
    if peft:
        from tests.test_peft import lora
        model = lora(model)
    engine = MegaTrainEngine(model, config, device="cpu", dp=dp)
    if dp is not None:  # (each rank stages its shard of a layer's gradient, not the whole layer)
        from hf_megatrain.core.plan import Where
        shard = max(dp.shard_size(u.numel) for u in engine.executor.grads.units if u.plan.grad is not Where.DEVICE)
        assert engine.executor.grads.staging_numel == shard, shard
    return engine, engine.create_optimizer(lr=LR, weight_decay=WD, max_grad_norm=CLIP)


def run_steps(engine: MegaTrainEngine, opt, start: int, stop: int, rank: int = 0, world: int = 1) -> list[float]:
    """Steps [start, stop) on this rank's rows of each global batch; the global gradient norm of each step."""
    data = batches()
    norms = []
    for step in range(start, stop):
        micro = data[step]
        n_items = sum(int((labels != -100).sum()) for _, labels in micro)  # the global batch's tokens
        for ids, labels in micro:
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            out = engine(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items)
            (out.loss * world).backward()
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return norms


def run_speculative_steps(engine: MegaTrainEngine, opt, rank: int = 0, world: int = 1) -> tuple[int, int]:
    """4 steps of one backward each, marked final (the optimizer speculates once a step has not clipped): steps
    1-2 speculate and stand, step 3's clip threshold drops so its speculative updates are taken back and redone.
    Returns (units speculated, updates taken back)."""
    micro = [mb for step in batches() for mb in step]
    opt.max_grad_norm = 1e4
    for step in range(4):
        ids, labels = micro[step]
        n_items = int((labels != -100).sum())
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        engine.set_final_backward(True)
        out = engine(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items)
        (out.loss * world).backward()
        if step == 3:
            opt.max_grad_norm = 1e-3
        opt.step()
        opt.zero_grad()
    opt.wait()
    return opt.speculated, opt.taken_back


def weights(engine: MegaTrainEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.named_master_tensors()}


def save(engine: MegaTrainEngine, path: str, rank: int = 0) -> None:
    """The main process writes (the standard master safetensors + optimizer state, unsharded); all wait for it."""
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        ckpt.save_training_state(engine, path, master=True)
    engine.ranks.barrier()  # no rank's next update may touch the state while it is written (alone: no-op)


def resume(engine: MegaTrainEngine, path: str) -> None:
    ckpt.load_pretrained_into_engine(engine, path, prefix=ckpt.MASTER_PREFIX)
    assert ckpt.load_training_state(engine, path)


def mapped_run_files() -> set[tuple[str, str]]:
    """(device:inode, name) of this process's mappings of shared-store files (deleted once every rank mapped them)."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "/megatrain-" in parts[5] and parts[5].endswith(".bin"):
                out.add((f"{parts[3]}:{parts[4]}", os.path.basename(parts[5])))
    return out


@contextlib.contextmanager
def ranks(rank: int, world: int, tmp: str) -> Iterator[DataParallel]:
    """This process as rank ``rank`` of a gloo group of ``world`` (torn down however the worker ends)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        yield DataParallel.from_process_group()
    finally:
        dist.destroy_process_group()


def train_worker(rank: int, world: int, tmp: str) -> None:
    """2 processes: (A) 3 steps from scratch, checkpoint after step 2; (B) resume a 1-process checkpoint."""
    with ranks(rank, world, tmp) as dp:
        engine, opt = make_engine(dp, tmp)
        files = dp.all_gather_object(sorted(mapped_run_files()))
        if rank == 0:
            torch.save(files, os.path.join(tmp, "mapped.pt"))
        norms = run_steps(engine, opt, 0, 2, rank, world)
        save(engine, os.path.join(tmp, "ckpt_2proc"), rank)
        norms += run_steps(engine, opt, 2, STEPS, rank, world)
        if rank == 0:
            torch.save(weights(engine), os.path.join(tmp, "final_2proc.pt"))
        torch.save(norms, os.path.join(tmp, f"norms_rank{rank}.pt"))
        engine, opt = make_engine(dp, tmp)
        resume(engine, os.path.join(tmp, "ckpt_1proc"))
        run_steps(engine, opt, 2, STEPS, rank, world)
        if rank == 0:
            torch.save(weights(engine), os.path.join(tmp, "resumed_1to2.pt"))
        # bf16 compute: each rank refreshes the shared compute copy over its shard only.
        engine, opt = make_engine(dp, tmp, "bfloat16")
        run_steps(engine, opt, 0, 2, rank, world)
        if rank == 0:
            torch.save(weights(engine), os.path.join(tmp, "bf16_2proc.pt"))
            for u in engine.layer_units:
                assert torch.equal(u.compute, u.master.to(torch.bfloat16)), f"layer {u.index}: stale compute copy"
        engine, opt = make_engine(dp, tmp, peft=True)
        run_steps(engine, opt, 0, STEPS, rank, world)
        if rank == 0:
            torch.save(weights(engine), os.path.join(tmp, "lora_2proc.pt"))
        dp.barrier()


def speculative_worker(rank: int, world: int, tmp: str) -> None:
    """2 processes, speculative updates of each rank's shards (see ``run_speculative_steps``)."""
    with ranks(rank, world, tmp) as dp:
        engine, opt = make_engine(dp, tmp)
        counts = run_speculative_steps(engine, opt, rank, world)
        torch.save(counts, os.path.join(tmp, f"spec_counts_rank{rank}.pt"))
        if rank == 0:
            torch.save(weights(engine), os.path.join(tmp, "spec_2proc.pt"))
        dp.barrier()


def shared_store_worker(rank: int, world: int, tmp: str) -> None:
    """One buffer of the shared allocator: a write by either rank is seen by the other; files gone after release."""
    from hf_megatrain.parallel.shared_alloc import SharedHostAllocator, new_run_dir

    with ranks(rank, world, tmp) as dp:
        run = dp.broadcast_object(new_run_dir(tmp) if dp.is_leader else None)
        alloc = SharedHostAllocator(run)
        t = alloc(1000, torch.float32, pin=False)
        dp.barrier()
        if rank == 0:
            t.copy_(torch.arange(1000.0))
        dp.barrier()
        assert torch.equal(t, torch.arange(1000.0)), "rank 1 does not see rank 0's write"
        dp.barrier()
        if rank == 1:
            t[7] = -1.0
        dp.barrier()
        if rank == 0:
            alloc.release()
        dp.barrier()
        assert t[7] == -1.0 and not os.path.exists(run)
        t[500] += 0  # (the mapping outlives the file)


# -- through MegaTrainTrainer (accelerate, gloo) -----------------------------------------------------------------------
def meta_follower_worker(rank: int, world: int, tmp: str) -> None:
    """Rank 1 builds its model on the meta device: the run ends where rank 0's real model alone would (written by
    rank 0); then rank 0 holding the meta model is refused on both ranks (rank 0 saying what to do, rank 1 naming
    rank 0)."""
    with ranks(rank, world, tmp) as dp:
        engine, opt = make_engine(dp, tmp, meta=rank > 0)
        run_steps(engine, opt, 0, STEPS, rank, world)
        if rank == 0:
            torch.save(weights(engine), os.path.join(tmp, "meta_follower.pt"))
        del engine, opt
        try:
            make_engine(dp, tmp, meta=rank == 0)
            error = ""
        except (ValueError, RuntimeError) as e:
            error = str(e)
        torch.save(error, os.path.join(tmp, f"meta_leader_rank{rank}.pt"))
        dp.barrier()


def trainer_run(tmp: str, world: int, run: str, resume: str | None = None,
                pretrained: str | None = None, meta: bool = False) -> dict[str, torch.Tensor]:
    """3 steps of MegaTrainTrainer on a global batch of 4 rows x 2 accumulation steps (4 // world rows per
    process), in-order samples, a checkpoint at step 2 in ``tmp/run``; the final FP32 masters and, as "eval_loss",
    ``evaluate()`` on 8 more rows (4 per evaluation batch, split over the processes). ``pretrained``: the
    model comes from ``from_pretrained_streamed`` of that folder (its data-parallel ranks found by itself);
    ``meta``: this process's model built on the meta device."""
    from torch.utils.data import SequentialSampler

    from hf_megatrain import MegaTrainTrainer, from_pretrained_streamed
    from tests.test_trainer import dataset, mt_args

    class InOrder(MegaTrainTrainer):  # (the same rows make each global batch, whatever the process count)
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    config = dict(compute_dtype="float32", shared_memory_dir=tmp)
    args = mt_args(os.path.join(tmp, run), config=config,
                   per_device_train_batch_size=4 // world, ddp_backend="gloo" if world > 1 else None,
                   save_strategy="steps", save_steps=2, max_grad_norm=0.5, per_device_eval_batch_size=4 // world)
    model = (meta_tiny("llama") if meta else tiny("llama")) if pretrained is None else \
        from_pretrained_streamed(pretrained, config, device="cpu").model
    trainer = InOrder(model=model, args=args, train_dataset=dataset())
    assert trainer.model is trainer.engine.model  # (not wrapped)
    trainer.train(resume_from_checkpoint=resume)
    assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    out = weights(trainer.engine)
    out["eval_loss"] = torch.tensor(trainer.evaluate(dataset(8, seed=1))["eval_loss"])
    trainer.save_model(os.path.join(tmp, run, "final"))  # (every process calls it; the main one writes)
    return out


def as_launched(rank: int, world: int, port: int) -> None:
    """This process as torchrun starts rank ``rank`` of ``world`` on one host (the Trainer's process group reads it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)


def trainer_worker(rank: int, world: int, tmp: str, port: int) -> None:
    as_launched(rank, world, port)
    try:
        final = trainer_run(tmp, world, "trainer_2proc")
        if rank == 0:
            torch.save(final, os.path.join(tmp, "trainer_final_2proc.pt"))
        final = trainer_run(tmp, world, "trainer_1to2", resume=os.path.join(tmp, "trainer_1proc", "checkpoint-2"),
                            pretrained=os.path.join(tmp, "init_model"))
        if rank == 0:
            torch.save(final, os.path.join(tmp, "trainer_resumed_1to2.pt"))
        final = trainer_run(tmp, world, "trainer_meta_follower", meta=rank > 0)
        if rank == 0:
            torch.save(final, os.path.join(tmp, "trainer_meta_follower.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def failing_conversion_worker(rank: int, world: int, tmp: str) -> None:
    """A conversion that fails on rank 1 only, its store allocated (filling it: the builder's templates phase): both
    ranks raise (none waits forever), rank 0 naming rank 1."""
    import hf_megatrain.engine.builder as builder

    with ranks(rank, world, tmp) as dp:
        if rank == 1:
            def broken(*args, **kwargs):
                raise MemoryError("rank 1 out of memory")
            builder.convert = broken
        try:
            make_engine(dp, tmp)
        except (MemoryError, RuntimeError) as e:
            torch.save(str(e), os.path.join(tmp, f"error_rank{rank}.pt"))
        dp.barrier()


# -- several hosts, simulated on one machine ------------------------------------------------------------------------
HOSTS, PER_HOST = 2, 2  # 4 processes: ranks 0-1 on "host" 0, ranks 2-3 on "host" 1


def simulated_hosts_worker(rank: int, world: int, tmp: str) -> None:
    """2 simulated hosts x 2 ranks, each host its own ``shared_memory_dir`` (one store per node): 3 steps from
    scratch, a checkpoint (rank 0 writes) after step 2. Host 1's model starts from other weights, its first rank's
    on the meta device: the stores must start from rank 0's."""
    node = rank // PER_HOST
    shm = os.path.join(tmp, f"host{node}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        dp = DataParallel.from_process_group(host=f"simulated-host-{node}")
        assert (dp.nodes, dp.node, dp.local_world, dp.local_rank) == (HOSTS, node, PER_HOST, rank % PER_HOST)
        model = meta_tiny("llama") if rank == PER_HOST else tiny("llama")
        if node == 1 and rank != PER_HOST:  # (another host's copy: DDP's initial broadcast makes rank 0's the start)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
        config = MegaTrainConfig(compute_dtype="float32", shared_memory_dir=shm)
        engine = MegaTrainEngine(model, config, device="cpu", dp=dp)
        opt = engine.create_optimizer(lr=LR, weight_decay=WD, max_grad_norm=CLIP)
        files = dp.all_gather_object(sorted(mapped_run_files()))
        if rank == 0:
            torch.save(files, os.path.join(tmp, "hosts_mapped.pt"))
        if rank % PER_HOST == 0:  # (each host's store, as its leader sees it)
            torch.save(weights(engine), os.path.join(tmp, f"hosts_start_node{node}.pt"))
        norms = run_steps(engine, opt, 0, 2, rank, world)
        save(engine, os.path.join(tmp, "ckpt_2x2"), rank)
        norms += run_steps(engine, opt, 2, STEPS, rank, world)
        torch.save(norms, os.path.join(tmp, f"hosts_norms_rank{rank}.pt"))
        if rank % PER_HOST == 0:
            torch.save(weights(engine), os.path.join(tmp, f"hosts_final_node{node}.pt"))
        dp.barrier()
    finally:
        dist.destroy_process_group()


def split_worker(rank: int, world: int, tmp: str) -> None:
    """2 processes, bf16 compute, the native kernel, clipping on every step, overlapped updates: each rank's updates
    of its shards run split (new weights first: a load waits for every rank's WEIGHTS pass) or whole; saved per run."""
    with ranks(rank, world, tmp) as dp:
        for split in ("off", "on"):
            config = MegaTrainConfig(compute_dtype="bfloat16", shared_memory_dir=tmp, host_kernel="native",
                                     split_host_update=split, overlap_optimizer=True)
            engine = MegaTrainEngine(tiny("llama"), config, device="cpu", dp=dp)
            opt = engine.create_optimizer(lr=LR, weight_decay=WD, max_grad_norm=0.05)
            # The split policy prices this rank's shard, not the whole unit, against this rank's host rate.
            for u in engine.layer_units:
                lo, hi = opt.own(u)
                assert hi - lo < u.numel and opt.split_update_bytes(u) <= (hi - lo) * 64, u.index  # (<= 64 B/param)
            data, split_steps = batches(), 0
            for step in range(STEPS + 1):
                micro = data[step % STEPS]
                n_items = sum(int((labels != -100).sum()) for _, labels in micro)
                for ids, labels in micro:
                    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
                    (engine(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n_items).loss
                     * world).backward()
                opt.step()
                split_steps += opt.last_step_split
                opt.zero_grad()
            state = {k: v.clone() for k, v in opt.state_tensors().items()}  # (waits for every rank's updates)
            dp.barrier()
            if rank == 0:
                torch.save({"weights": weights(engine), "state": state, "split_steps": split_steps,
                            "compute": [u.compute.clone() for u in engine.layer_units]},
                           os.path.join(tmp, f"split_{split}.pt"))
            del engine, opt
            dp.barrier()
