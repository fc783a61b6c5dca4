"""Checkpoint save / verify / load rates beside a raw write and read of the same bytes (issue 29).

    python integration/bench_checkpoint_io.py [--size 0.5] [--dir /path/on/the/disk] [--out results.json]

Builds a Llama-shaped MegaTrainEngine of ``--size`` billion parameters on the CPU (random init, AdamW state
allocated), then times, each against the same folder's filesystem:

- raw write: the checkpoint's byte count written from one buffer in 64 MiB chunks, then fsync (``dd conv=fsync``);
- raw read: that file read back in 64 MiB chunks after its pages were dropped (``posix_fadvise DONTNEED``);
- the Trainer checkpoint: bf16 export (``save_pretrained_streamed``) + FP32 master + AdamW moments
  (``save_training_state``) + manifest (``write_manifest``), each timed and in total;
- verify (``verify_checkpoint``: every byte against its recorded CRC-32) and load (master + moments into the
  engine), both after the checkpoint's pages were dropped, so they read from the disk where it can.

GB/s are 1e9 bytes per second; ``vs_raw`` is the rate over the raw write (saves) or raw read (verify, load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_megatrain import MegaTrainConfig, MegaTrainEngine  # noqa: E402
from hf_megatrain import checkpoint as ckpt  # noqa: E402

_CHUNK = 64 << 20


def build(size_b: float) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 2048 if size_b >= 0.4 else 1024
    vocab = 32000
    layers = max(1, round((size_b * 1e9 - 2 * vocab * hidden) / (12 * hidden * hidden)))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # (fast init: the bytes, not their distribution, matter here)
    return model


def drop_pages(folder_or_file: str) -> None:
    """Evict the files' clean pages from the page cache (no root needed), so the next read goes to the disk."""
    paths = [folder_or_file] if os.path.isfile(folder_or_file) else [
        os.path.join(r, f) for r, _, fs in os.walk(folder_or_file) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def raw_write(path: str, nbytes: int) -> float:
    buf = torch.randint(0, 255, (_CHUNK,), dtype=torch.uint8).numpy()
    view = memoryview(buf)
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(view[:min(left, _CHUNK)])
        os.fsync(f.fileno())
    return time.perf_counter() - t


def raw_read(path: str) -> float:
    drop_pages(path)
    buf = bytearray(_CHUNK)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=0.5, help="billions of parameters (default 0.5)")
    p.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeat", type=int, default=1, help="checkpoint writes to time (the best is reported)")
    p.add_argument("--no-advise", action="store_true",
                   help="A/B: leave written pages to the kernel (no early writeback: safetensors_io._ADVISE)")
    a = p.parse_args(argv)
    if a.no_advise:
        from hf_megatrain.checkpoint import safetensors_io
        safetensors_io._ADVISE = False
    root = tempfile.mkdtemp(prefix="bench_ckpt_io-", dir=a.dir)
    save_dtype = getattr(torch, a.save_dtype)
    try:
        t = time.perf_counter()
        model = build(a.size)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32", overlap_optimizer=False),
                                 device="cpu")
        engine_s = time.perf_counter() - t
        engine.create_optimizer(lr=1e-4)
        params = sum(t.numel() for _, t in engine.named_master_tensors())
        print(f"model: {params / 1e9:.3f}B parameters (built in {build_s:.1f} s, engine {engine_s:.1f} s = "
              f"{params / 1e9 / engine_s:.2f} B params/s)", flush=True)

        res: dict = {"params": params, "save_dtype": a.save_dtype, "advise": not a.no_advise, "cpu_count": os.cpu_count(),
                     "engine_build_s": engine_s, "engine_build_Bparams_per_s": params / 1e9 / engine_s}
        best: dict | None = None
        for r in range(a.repeat):
            path = os.path.join(root, f"checkpoint-{r}")
            steps: dict[str, float] = {}
            t0 = time.perf_counter()
            with ckpt.atomic_directory(path) as tmp:
                steps["export_s"] = timed(lambda: ckpt.save_pretrained_streamed(engine, tmp, dtype=save_dtype))
                steps["training_state_s"] = timed(lambda: ckpt.save_training_state(
                    engine, tmp, master=save_dtype != torch.float32))
                with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                    json.dump({"global_step": r}, f)
                steps["manifest_s"] = timed(lambda: ckpt.write_manifest(tmp))
            steps["total_s"] = time.perf_counter() - t0
            if best is None or steps["total_s"] < best["total_s"]:
                best = steps | {"path": path}
            print(f"checkpoint write {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()), flush=True)
        assert best is not None
        path = best.pop("path")
        nbytes = folder_bytes(path)
        for r in range(a.repeat):
            if os.path.join(root, f"checkpoint-{r}") != path:
                shutil.rmtree(os.path.join(root, f"checkpoint-{r}"))
        raw_path = os.path.join(root, "raw.bin")
        raw_ws = [raw_write(raw_path, nbytes), raw_write(raw_path, nbytes)]  # (a shared disk varies: two runs)
        raw_w = sum(raw_ws) / 2
        raw_r = raw_read(raw_path)
        os.remove(raw_path)
        drop_pages(path)
        verify_s = timed(lambda: ckpt.verify_checkpoint(path))
        drop_pages(path)
        load_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                         if f.startswith(("megatrain_master", "megatrain_optimizer"))
                         or (save_dtype == torch.float32 and f.startswith("model")))
        load_s = timed(lambda: (ckpt.load_pretrained_into_engine(engine, path),
                                ckpt.load_training_state(engine, path)))
        gb = nbytes / 1e9
        rw, rr = gb / raw_w, gb / raw_r
        res.update({
            "checkpoint_bytes": nbytes, "files": sorted(os.listdir(path)),
            "raw_write_fsync": {"s": raw_w, "GBps": rw, "runs_s": raw_ws},
            "raw_read_cold": {"s": raw_r, "GBps": rr},
            "checkpoint_write": {**best, "GBps": gb / best["total_s"], "vs_raw": gb / best["total_s"] / rw},
            "verify_cold": {"s": verify_s, "GBps": gb / verify_s, "vs_raw": gb / verify_s / rr},
            "load_cold": {"bytes": load_bytes, "s": load_s, "GBps": load_bytes / 1e9 / load_s,
                          "vs_raw": load_bytes / 1e9 / load_s / rr},
        })
        print(f"checkpoint {gb:.2f} GB ({len(res['files'])} files)")
        print(f"  raw write+fsync  {rw:6.2f} GB/s   raw read (cold) {rr:6.2f} GB/s")
        for k in ("checkpoint_write", "verify_cold", "load_cold"):
            print(f"  {k:<16} {res[k]['GBps']:6.2f} GB/s   {100 * res[k]['vs_raw']:5.1f} % of raw")
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
            print("wrote", a.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
