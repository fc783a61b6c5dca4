"""The 32B run as a user runs it (issue 46 parts 1 and 5): a Hub-layout checkpoint in, ``from_pretrained_streamed``,
``MegaTrainTrainer`` on packed fine-tune rows, ``save_model`` out, plain transformers loads it back.

The child phases of ``full_32b_hub.py --hub-checkpoint DIR`` (each in its own process, ``bench.common.runner_main``):

* ``write``: a Qwen2.5-32B-shaped random-init model written to DIR as ``save_pretrained`` lays it out (config.json,
  ``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json``), bf16, tensor by tensor: each value is
  drawn on the GPU when there is one (else the CPU) from its own seed (``seed * 100003 + tensor index``: the same
  values whatever the shard size), Qwen2 init as in scale_123b (norms 1, biases 0, weights N(0, 0.02)), copied to
  the host and appended to its shard's file (header first, from the shapes), fsync per shard: one tensor in RAM.
* ``train``: ``hf_megatrain.from_pretrained_streamed(DIR, config, device=args.device)`` (the README's way to load a
  model larger than host RAM twice; ``num_hidden_layers`` overridden for a shallower run: the first layers of the
  checkpoint), timed against the raw read of the same shards the parent measured; ``MegaTrainTrainer`` (one process,
  or N through torchrun as ``accelerate launch --multi_gpu`` starts them) on the bench's fine-tune rows
  (``bench/finetune_data.py``: variable lengths, packed, ``tokens`` real tokens per step and process); the trained
  model's logits on a held-out batch (saved); ``trainer.save_model(EXPORT)`` in bf16 (``save_dtype``), timed.
* ``reload``: plain ``AutoModelForCausalLM.from_pretrained(EXPORT, dtype=bfloat16, device_map="auto")`` (meta init,
  tensors straight to the GPUs: the host never holds the model), its logits on the same batch against the trained
  model's: max |diff| within ``LOGIT_TOL`` x max |logit| (a few bf16 ulps at the logits' scale).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from bench.common import GIB, _vm_hwm_bytes, runner_main, throughput, trainer_data  # noqa: E402

HELDOUT_SEED = 4242
LOGIT_TOL = 0.03  # max |diff| / max |logit|: ~8 bf16 ulps (2^-8 each) at the logits' scale
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32"}


# -- write ------------------------------------------------------------------------------------------------------------
def hf_config(spec: dict) -> Any:
    from full_32b import model_config

    cfg = model_config({**spec, "layers": spec["full_layers"], "seq": 131072})  # (Qwen2.5-32B's context)
    cfg.dtype = torch.bfloat16  # (what a Hub bf16 checkpoint's config.json says)
    if not spec.get("tiny"):
        cfg.rms_norm_eps = 1e-5  # (Qwen2.5-32B's; integration/hub_configs/qwen2.5-32b.json)
    return cfg


def tensor_specs(spec: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor ``save_pretrained`` writes, in its order (the meta skeleton's state dict)."""
    from full_32b import skeleton

    model = skeleton({**spec, "layers": spec["full_layers"], "seq": 131072})
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items() if not n.endswith("rotary_emb.inv_freq")]


def shard_plan(tensors: list[tuple[str, tuple[int, ...]]], max_bytes: int) -> list[list[tuple[str, tuple]]]:
    """Greedy in order, as transformers' ``split_torch_state_dict_into_shards``: a new shard when the next tensor
    would pass ``max_bytes``."""
    shards: list[list] = [[]]
    size = 0
    for name, shape in tensors:
        n = math.prod(shape) * 2
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def header_bytes(entries: list[tuple[str, tuple]], dtype: torch.dtype) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in entries:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        meta[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def random_value(name: str, shape: tuple, device: torch.device, seed: int) -> torch.Tensor:
    from scale_123b import random_value as draw

    gen = torch.Generator(device=device).manual_seed(seed)
    return draw(name, shape, device, gen)


def run_write(spec: dict) -> dict[str, Any]:
    """The random bf16 checkpoint, shard by shard (module docstring); its size and write rate (fsync included)."""
    out = spec["hub_dir"]
    os.makedirs(out, exist_ok=True)
    gen_device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tensors = tensor_specs(spec)
    index = {n: i for i, (n, _) in enumerate(tensors)}
    shards = shard_plan(tensors, int(float(spec["shard_gb"]) * 1e9))
    t0 = time.perf_counter()
    hf_config(spec).save_pretrained(out)
    weight_map, total, draw_s = {}, 0, 0.0
    for k, entries in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        with open(os.path.join(out, fname + ".tmp"), "wb") as f:
            f.write(header_bytes(entries, torch.bfloat16))
            for name, shape in entries:
                t = time.perf_counter()
                value = random_value(name, shape, gen_device, int(spec["seed"]) * 100003 + index[name]).cpu()
                draw_s += time.perf_counter() - t
                f.write(value.reshape(-1).view(torch.uint8).numpy().data)
                weight_map[name] = fname
                total += value.numel() * 2
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(out, fname + ".tmp"), os.path.join(out, fname))
        print(f"[write] {fname}: {len(entries)} tensors, {total / 1e9:.1f} GB so far, "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    wall = time.perf_counter() - t0
    return {"write_s": wall, "bytes": total, "write_gb_per_s": total / wall / 1e9, "shards": len(shards),
            "tensors": len(tensors), "draw_and_copy_s": draw_s, "draw_device": gen_device.type,
            "vm_hwm_gib": (_vm_hwm_bytes() or 0) / GIB}


def has_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json")) and any(
        os.path.isfile(os.path.join(folder, f)) for f in ("model.safetensors.index.json", "model.safetensors"))


def depth_overrides(folder: str, layers: int) -> dict[str, Any]:
    """Config keys that load the checkpoint's first ``layers`` layers (``from_pretrained_streamed``'s kwargs, as
    ``from_pretrained``'s): ``num_hidden_layers`` and, where the config lists them, ``layer_types`` cut to match
    (transformers 5 validates the two together; a saved config with 64 types and 52 layers would not load)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    if int(cfg["num_hidden_layers"]) == layers:
        return {}
    return {"num_hidden_layers": layers, **({"layer_types": cfg["layer_types"][:layers]} if cfg.get("layer_types")
                                            else {})}


def shard_paths(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


# -- train ------------------------------------------------------------------------------------------------------------
def heldout_ids(spec: dict) -> torch.Tensor:
    gen = torch.Generator().manual_seed(HELDOUT_SEED)
    return torch.randint(0, int(spec["vocab"]), (1, int(spec["heldout_tokens"])), generator=gen)


def run_train(spec: dict) -> dict[str, Any]:
    from full_32b import StepLog
    from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments, from_pretrained_streamed

    cuda = torch.cuda.is_available()
    total = int(spec["warmup"]) + int(spec["steps"])
    data, data_args = trainer_data(spec, total, 1, 1)
    args = MegaTrainTrainingArguments(
        output_dir=os.path.join(spec["out"], "logs", "trainer"), gradient_accumulation_steps=1, max_steps=total,
        learning_rate=float(spec.get("lr", 1e-5)), lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=float(spec["max_grad_norm"]),
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, seed=int(spec["seed"]), use_cpu=not cuda, megatrain_config=spec["config"],
        **data_args)
    device = args.device  # (initialises torch.distributed under torchrun / accelerate launch)
    rank0 = args.process_index == 0
    over = depth_overrides(spec["hub_dir"], int(spec["layers"]))
    from hf_megatrain.hf import pretrained

    reads: list[float] = []
    read_weights = pretrained.load_weights  # (timed inside the user's call: the reads apart from the store's build)

    def timed_read(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return read_weights(*args, **kwargs)
        finally:
            reads.append(time.perf_counter() - t)

    pretrained.load_weights = timed_read
    t = time.perf_counter()
    try:
        engine = from_pretrained_streamed(spec["hub_dir"], spec["config"], device=device, show_progress=False,
                                          attn_implementation="sdpa", **over)
    finally:
        pretrained.load_weights = read_weights
    load_s = time.perf_counter() - t
    n_params = engine.num_parameters()
    loaded = sum(os.path.getsize(p) for p in shard_paths(spec["hub_dir"])) * int(spec["layers"]) // int(
        spec["full_layers"]) if over else sum(os.path.getsize(p) for p in shard_paths(spec["hub_dir"]))
    read_s = sum(reads) or load_s
    out: dict[str, Any] = {"load_s": load_s, "load_bytes_approx": loaded, "load_gb_per_s": loaded / load_s / 1e9,
                           "load_read_s": read_s, "load_build_s": load_s - read_s,
                           "load_read_gb_per_s": loaded / read_s / 1e9,
                           "load_vm_hwm_gib": (_vm_hwm_bytes() or 0) / GIB, "n_params": n_params,
                           "device_layers": len(engine.plans.kept), "processes": args.world_size,
                           "device_step_layers": len(engine.plans.device_stepped),
                           "megatrain_config": engine.config.to_dict()}
    print(f"[train] rank {args.process_index}: loaded {n_params / 1e9:.2f}B params in {load_s:.1f}s: engine and "
          f"store {load_s - read_s:.1f}s, reads {read_s:.1f}s ({out['load_read_gb_per_s']:.2f} GB/s of the bf16 "
          "shards)", flush=True)
    if cuda:
        out["load_peak_gpu_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
    log = StepLog(int(spec["layers"]))
    trainer = MegaTrainTrainer(model=engine, args=args, **data, callbacks=[log.callback])
    t = time.perf_counter()
    metrics = trainer.train().metrics
    out.update(throughput(spec, n_params, log.clock.periods), train_wall_s=time.perf_counter() - t,
               trainer_metrics=metrics, losses=log.losses, grad_norms=log.grad_norms,
               loss_finite=all(map(math.isfinite, log.losses)), train_vm_hwm_gib=(_vm_hwm_bytes() or 0) / GIB)
    if cuda:
        out.update(train_peak_gpu_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                   train_peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    print(f"[train] {out['tokens_per_s']:,.0f} real tokens/s, MFU {out['mfu']:.1%}, step {out['step_time_s']:.2f}s",
          flush=True)
    if not spec.get("export", True):
        return out
    model = trainer.model
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=heldout_ids(spec).to(device)).logits.float().cpu()
    if rank0:
        torch.save(logits, spec["logits_path"])
    t = time.perf_counter()
    trainer.save_model(spec["export_dir"])
    out["save_s"] = time.perf_counter() - t
    if rank0:
        files = [f for f in os.listdir(spec["export_dir"]) if not f.startswith(".")]
        out["export_gb"] = sum(os.path.getsize(os.path.join(spec["export_dir"], f)) for f in files) / 1e9
        out["export_files"] = sorted(files)
        out["save_gb_per_s"] = out["export_gb"] / out["save_s"]
        print(f"[train] saved {out['export_gb']:.1f} GB in {out['save_s']:.1f}s", flush=True)
    return out


# -- reload -----------------------------------------------------------------------------------------------------------
def run_reload(spec: dict) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["export_dir"], dtype=torch.bfloat16,
                                                 device_map="auto" if cuda else None, attn_implementation="sdpa")
    load_s = time.perf_counter() - t
    hwm = (_vm_hwm_bytes() or 0) / GIB
    ids = heldout_ids(spec).to(model.device)
    with torch.no_grad():
        got = model(input_ids=ids).logits.float().cpu()
    ref = torch.load(spec["logits_path"])
    diff = (got - ref).abs()
    scale = float(ref.abs().max())
    out = {"load_s": load_s, "reload_vm_hwm_gib": hwm, "model_gib": sum(p.numel() * p.element_size()
                                                                          for p in model.parameters()) / GIB,
           "devices": sorted({str(p.device) for p in model.parameters()}), "logits_shape": list(ref.shape),
           "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "ref_abs_max": scale,
           "rel_max_diff": float(diff.max()) / max(scale, 1e-30),
           "rel_mean_diff": float(diff.mean()) / max(float(ref.abs().mean()), 1e-30),
           "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()), "tolerance_rel": LOGIT_TOL}
    out["logits_match"] = bool(torch.isfinite(got).all()) and out["rel_max_diff"] <= LOGIT_TOL
    print(f"[reload] {load_s:.1f}s, host HWM {hwm:.1f} GiB for a {out['model_gib']:.1f} GiB model; logits max |diff| "
          f"{out['max_abs_diff']:.4g} of {scale:.4g} ({out['rel_max_diff']:.2%}), top-1 {out['top1_agree']:.1%}: "
          f"{'match' if out['logits_match'] else 'DO NOT MATCH'}", flush=True)
    return out


def run_phase(spec: dict) -> dict[str, Any]:
    return {"write": run_write, "train": run_train, "reload": run_reload}[spec["phase"]](spec)


if __name__ == "__main__":
    runner_main("full_32b_hub", run_phase)
