"""Checkpoint save / verify / load rates beside raw writes and reads of the same bytes (issue 29).

    python integration/bench_checkpoint_io.py [--size 0.5] [--dir /path/on/the/disk] [--out results.json]

(filed as ``integration/results/checkpoint_io/<date>_<commit>_checkpoint_io_<machine>.json``, see its README)

Builds a Llama-shaped MegaTrainEngine of ``--size`` billion parameters on the CPU (random init, AdamW state
allocated), then times, each against the same folder's filesystem (``--dir`` is created if missing):

- raw write, one stream: the checkpoint's byte count written from one buffer in 64 MiB chunks, then fsync
  (``dd conv=fsync``), twice (shared disks vary);
- raw write, parallel: the same bytes as ``--threads`` threads each ``pwrite``-ing its own range of one file (as
  the checkpoint writer does), then fsync;
- raw read, one stream and parallel (``--threads`` readers, each its range): after the file's pages were dropped
  from the page cache with ``posix_fadvise(DONTNEED)`` (no root needed; ``cache_drop`` in the JSON says so), and
  the parallel read once more with ``O_DIRECT`` (no page cache at all; recorded as unsupported where the
  filesystem refuses it, e.g. tmpfs);
- a plain read of the same bytes the load reads (the checkpoint's master and optimizer files, each split into as
  many ranges as the loads have readers, 64 MiB ``preadv`` calls, no CRC; cold): the disk's rate for those very
  files, where they lie on it;
- the Trainer checkpoint: bf16 export (``save_pretrained_streamed``) + FP32 master + AdamW moments
  (``save_training_state``) + manifest (``write_manifest``), each timed and in total;
- verify (``verify_checkpoint``: every byte against its recorded CRC-32), load (master + moments into the engine,
  CRC-32 checked while reading) and the bf16 export's load into the FP32 masters (what ``from_pretrained_streamed``
  does; ``from_pretrained_cold``: all of ``from_pretrained_streamed`` on the folder, skeleton and store allocation
  included), each after the checkpoint's pages were dropped, so they read from the disk where it can; and the resume
  of a checkpoint too large for the page cache (``resume_once_cold``: verify skipping the files the loads check
  while reading, then the loads: every byte read once, ``bytes_read`` says so).

Each read phase records where its time went (``phases``, from ``checkpoint.read_stats()``): ``wall_s`` in the
parallel reader, ``other_s`` outside it (headers, planning), and thread-seconds summed over the ``readers`` threads
in ``read_s`` (``preadv``: page-cache copy or disk wait), ``crc_s``, ``convert_s`` (bf16 -> FP32), ``copy_s`` and
``stall_s`` (readers waiting for the CRC / conversion side). Disk-bound: ``read_s`` ~ ``readers * wall_s``, the
others small. ``--readers`` / ``--read-chunk`` set the readers' count and read size (``fast_io.READERS`` /
``READ_CHUNK``); ``--readers 8,4,16`` times every read phase with each count (``phases_by_readers``; the first
gives the main figures, and the raw parallel read is measured with as many threads too); ``--warm`` also times each
read phase from the page cache (the CPU's cost per byte).

GB/s are 1e9 bytes per second. ``vs_raw``: the rate over the one-stream raw write (saves) or read (verify, loads);
``vs_ceiling``: over the device's best measured rate, the fastest of the raw reads above (one stream, parallel,
O_DIRECT, the load's own files), the
figure the "at least 90 % of the disk" goal is checked against. The JSON records the command that produced it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from bench import record as schema  # noqa: E402
from hf_megatrain import MegaTrainConfig, MegaTrainEngine, from_pretrained_streamed  # noqa: E402
from hf_megatrain import checkpoint as ckpt  # noqa: E402

_CHUNK = 64 << 20


def build(size_b: float) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 2048 if size_b >= 0.4 else 1024 if size_b >= 0.05 else 64  # (the last: smoke tests)
    vocab = 32000 if size_b >= 0.05 else 1000
    layers = max(1, round((size_b * 1e9 - 2 * vocab * hidden) / (12 * hidden * hidden)))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=16 if hidden >= 1024 else 4, num_key_value_heads=16 if hidden >= 1024 else 4,
                      tie_word_embeddings=False)
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


def _ranges(nbytes: int, threads: int) -> list[tuple[int, int]]:
    """``threads`` consecutive ranges of ``nbytes``, split at 1 MiB (O_DIRECT needs aligned offsets)."""
    bounds = [min(nbytes, (nbytes * i // threads) >> 20 << 20) for i in range(threads)] + [nbytes]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def raw_write_parallel(path: str, nbytes: int, threads: int) -> float:
    """``threads`` threads each pwrite its range of one file in 64 MiB chunks, then one fsync (the writer's way)."""
    buf = memoryview(torch.randint(0, 255, (_CHUNK,), dtype=torch.uint8).numpy())

    def write(r: tuple[int, int]) -> None:
        off = r[0]
        while off < r[1]:
            off += os.pwrite(fd, buf[:min(_CHUNK, r[1] - off)], off)

    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, _ranges(nbytes, threads)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def raw_read_parallel(path: str, threads: int, direct: bool = False) -> float | None:
    """``threads`` readers, each its range in 64 MiB preadv calls, after the pages were dropped; ``direct``: with
    O_DIRECT into page-aligned buffers (None where the filesystem refuses O_DIRECT)."""
    return raw_read_files([path], threads, direct)


def raw_read_files(paths: list[str], threads: int, direct: bool = False) -> float | None:
    """A plain read of ``paths`` (for the loads: the very bytes they read): each file split into ``threads`` ranges,
    read by ``threads`` threads in 64 MiB preadv calls after their pages were dropped, no CRC, no destination;
    ``direct``: with O_DIRECT into page-aligned buffers (None where the filesystem refuses O_DIRECT)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    for path in paths:
        drop_pages(path)
        try:
            os.close(os.open(path, flags))
        except OSError:
            return None
    work = [(path, a, b) for path in paths for a, b in _ranges(os.path.getsize(path), threads)]

    def read(item: tuple[str, int, int]) -> None:
        path, off, end = item
        buf = mmap.mmap(-1, _CHUNK)  # (page-aligned: what O_DIRECT needs)
        fd = os.open(path, flags)
        try:
            while off < end:
                want = min(_CHUNK, end - off)
                if direct:
                    want = -(-want // 4096) * 4096  # (whole blocks; the file's end returns fewer bytes)
                n = os.preadv(fd, [memoryview(buf)[:want]], off)
                if n <= 0:
                    break
                off += n
        finally:
            os.close(fd)
            buf.close()

    t = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, work))
    except OSError:  # (O_DIRECT accepted at open, refused at read: some filesystems)
        if direct:
            return None
        raise
    return time.perf_counter() - t


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed_phases(fn) -> dict:
    """``fn``'s seconds, and where its reads spent them (``checkpoint.read_stats``): see the module doc."""
    with ckpt.read_stats() as st:
        total = timed(fn)
    return {"total_s": total, **st.as_dict(), "other_s": total - st.wall_s}


def export_load(size_b: float, root: str, readers: int) -> dict:
    """``from_pretrained_streamed`` of a bf16 Hub-style export of ``size_b`` billion parameters (Llama shape, hidden
    4096; written directly from the meta model's shapes, no engine built first, so sizes beyond the checkpoint
    bench's fit the disk) beside a plain cold read of the same shard files: the streamed load's rate where its fixed
    costs (skeleton, store allocation) no longer dominate as they do at 1B."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, vocab, heads = (4096, 32000, 32) if size_b >= 1 else (64, 1000, 4)  # (the last: smoke tests)
    layers = max(1, round((size_b * 1e9 - 2 * vocab * hidden) / (16 * hidden * hidden)))  # (4h^2 attn, 12h^2 MLP)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).state_dict().items()}
    folder = os.path.join(root, "export")
    os.makedirs(folder)
    cfg.save_pretrained(folder)
    shard, shards, size, index = {}, [], 0, {}

    def flush() -> None:
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shards.append(os.path.join(folder, name))

    for n, shape in shapes.items():
        shard[n] = torch.zeros(shape, dtype=torch.bfloat16)
        size += shard[n].numel() * 2
        if size >= 4 << 30:
            flush()
            shard, size = {}, 0
    if shard:
        flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    nbytes = sum(os.path.getsize(f) for f in shards)
    plain = raw_read_files(shards, readers)
    drop_pages(folder)
    fpt = timed_phases(lambda: from_pretrained_streamed(folder, MegaTrainConfig(
        compute_dtype="float32", overlap_optimizer=False), device="cpu", dp=None))
    gc.collect()
    shutil.rmtree(folder)
    return {"params": sum(math.prod(s) for s in shapes.values()), "bytes": nbytes, "shards": len(shards),
            "plain_read_s": plain, "plain_read_GBps": nbytes / 1e9 / plain,
            "from_pretrained": fpt, "from_pretrained_GBps": nbytes / 1e9 / fpt["total_s"],
            "vs_plain_read": plain / fpt["total_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=0.5, help="billions of parameters (default 0.5)")
    p.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeat", type=int, default=1, help="checkpoint writes to time (the best is reported)")
    p.add_argument("--threads", type=int, default=None,
                   help="parallel raw writers / readers (default: the checkpoint writer's thread count)")
    p.add_argument("--readers", default=None,
                   help="reader threads of verify and the loads (default: fast_io.READERS, from the core count); "
                        "a comma list (4,8,16) times every read phase with each, the first giving the main figures")
    p.add_argument("--read-chunk", type=int, default=None, help="MiB a read (default: fast_io.READ_CHUNK)")
    p.add_argument("--no-read-advise", action="store_true",
                   help="A/B: no POSIX_FADV_SEQUENTIAL on the readers' files (fast_io.READ_SEQUENTIAL)")
    p.add_argument("--export-load", type=float, default=None, metavar="B",
                   help="only time from_pretrained_streamed of a bf16 export of B billion parameters (hidden 4096) "
                        "beside a plain read of its shards (``export_load`` in the JSON)")
    p.add_argument("--warm", action="store_true", help="also time verify and the loads from the page cache")
    p.add_argument("--no-advise", action="store_true",
                   help="A/B: leave written pages to the kernel (no early writeback: safetensors_io._ADVISE)")
    a = p.parse_args(argv)
    if a.no_advise:
        from hf_megatrain.checkpoint import safetensors_io
        safetensors_io._ADVISE = False
    from hf_megatrain.checkpoint import fast_io

    threads = a.threads or fast_io.DEFAULT_WORKERS
    readers = [int(n) for n in a.readers.split(",")] if a.readers else [fast_io.READERS]
    saved = fast_io.READERS, fast_io.READ_CHUNK, fast_io.READ_SEQUENTIAL  # (restored at the end: tests run main())
    fast_io.READ_SEQUENTIAL = not a.no_read_advise
    fast_io.READERS = readers[0]
    if a.read_chunk:
        fast_io.READ_CHUNK = a.read_chunk << 20
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench_ckpt_io-", dir=a.dir)
    save_dtype = getattr(torch, a.save_dtype)
    if a.export_load:
        try:
            res = {**schema.header(__file__, argv), "readers": readers[0],
                   "export_load": export_load(a.export_load, root, readers[0])}
            e = res["export_load"]
            print(f"export {e['params'] / 1e9:.2f}B params, {e['bytes'] / 1e9:.2f} GB in {e['shards']} shards: plain "
                  f"read {e['plain_read_GBps']:.2f} GB/s, from_pretrained_streamed {e['from_pretrained_GBps']:.2f} "
                  f"GB/s ({100 * e['vs_plain_read']:.1f} % of the plain read; outside the reads "
                  f"{e['from_pretrained']['other_s']:.2f} s)")
            if a.out:
                schema.write(a.out, res)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            fast_io.READERS, fast_io.READ_CHUNK, fast_io.READ_SEQUENTIAL = saved
        return 0
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

        res: dict = {**schema.header(__file__, argv),
                     "dir": os.path.abspath(root), "threads": threads, "cache_drop": "posix_fadvise(DONTNEED)",
                     "readers": readers[0], "read_chunk_MiB": fast_io.READ_CHUNK >> 20,
                     "read_sequential": fast_io.READ_SEQUENTIAL,
                     "params": params, "save_dtype": a.save_dtype, "advise": not a.no_advise,
                     "cpu_count": os.cpu_count(),
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
        raw_pw = raw_write_parallel(raw_path, nbytes, threads)
        raw_r = raw_read(raw_path)
        raw_pr = raw_read_parallel(raw_path, threads)
        raw_rr = raw_read_parallel(raw_path, readers[0]) if readers[0] != threads else raw_pr  # (as many as loads)
        raw_dr = raw_read_parallel(raw_path, threads, direct=True)
        os.remove(raw_path)
        load_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                         if f.startswith(("megatrain_master", "megatrain_optimizer"))
                         or (save_dtype == torch.float32 and f.startswith("model")))
        export_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                           if f.startswith("model") and f.endswith(".safetensors"))
        # the plain read of the checkpoint's own files (the bytes the loads read), as many threads as the readers
        load_files = [os.path.join(path, f) for f in sorted(os.listdir(path))
                      if f.startswith(("megatrain_master", "megatrain_optimizer")) and f.endswith(".safetensors")]
        raw_fr = raw_read_files(load_files, readers[0])
        raw_fr_bytes = sum(os.path.getsize(f) for f in load_files)
        once = ckpt.files_checked_on_load(engine, path, page_cache_bytes=0)  # (as if larger than the page cache)
        reads = {
            "verify": lambda: ckpt.verify_checkpoint(path),
            "load": lambda: (ckpt.load_pretrained_into_engine(engine, path), ckpt.load_training_state(engine, path)),
            "load_export": lambda: ckpt.load_pretrained_into_engine(engine, path, prefix=ckpt.WEIGHTS_PREFIX),
            "resume_once": lambda: (ckpt.verify_checkpoint(path, crc_on_load=once),
                                    ckpt.load_pretrained_into_engine(engine, path),
                                    ckpt.load_training_state(engine, path)),
        }
        by_readers: dict[int, dict[str, dict]] = {}
        for n in readers[1:] + readers[:1]:  # (the main figures' count last: fast_io.READERS stays at it)
            fast_io.READERS = n
            by_readers[n] = {}
            for name, fn in reads.items():
                for cache in ("cold", "warm") if a.warm else ("cold",):
                    if cache == "cold":
                        drop_pages(path)
                    else:
                        fn()  # (the pages it reads are now cached)
                    by_readers[n][f"{name}_{cache}"] = timed_phases(fn)
        phases = by_readers[readers[0]]
        # the whole from_pretrained_streamed (skeleton, engine store allocated, the bf16 export read into it), with
        # the bench's engine gone first (two engines may not fit the host)
        engine = reads = None  # type: ignore[assignment]  (the store's memory freed)
        gc.collect()
        fpt = {}
        for cache in ("cold", "warm") if a.warm else ("cold",):
            drop_pages(path) if cache == "cold" else None
            try:
                fpt[cache] = timed_phases(lambda: from_pretrained_streamed(path, MegaTrainConfig(
                    compute_dtype="float32", overlap_optimizer=False), device="cpu", dp=None))
            except MemoryError as e:  # (a host too small for it: say so, keep the other figures)
                fpt[cache] = {"skipped": str(e)}
                break
        verify_s, load_s = phases["verify_cold"]["total_s"], phases["load_cold"]["total_s"]
        export_load_s = phases["load_export_cold"]["total_s"]
        gb = nbytes / 1e9
        rw, rr, pw, pr = gb / raw_w, gb / raw_r, gb / raw_pw, gb / raw_pr
        dr = gb / raw_dr if raw_dr else None
        rr_ = gb / raw_rr
        fr = raw_fr_bytes / 1e9 / raw_fr
        cw, cr = max(rw, pw), max(rr, pr, rr_, dr or 0.0, fr)  # the device's best measured rates

        def rate(nb: int, s: float, write: bool) -> dict:
            g = nb / 1e9 / s
            return {"bytes": nb, "s": s, "GBps": g, "vs_raw": g / (rw if write else rr),
                    "vs_ceiling": g / (cw if write else cr)}

        res.update({
            "checkpoint_bytes": nbytes, "files": sorted(os.listdir(path)),
            "raw_write_fsync": {"s": raw_w, "GBps": rw, "runs_s": raw_ws},
            "raw_write_parallel_fsync": {"s": raw_pw, "GBps": pw, "threads": threads},
            "raw_read_cold": {"s": raw_r, "GBps": rr},
            "raw_read_parallel_cold": {"s": raw_pr, "GBps": pr, "threads": threads},
            "raw_read_parallel_readers_cold": {"s": raw_rr, "GBps": rr_, "threads": readers[0]},
            "raw_read_parallel_direct": ({"s": raw_dr, "GBps": dr, "threads": threads} if raw_dr else
                                         {"unsupported": "the filesystem refused O_DIRECT"}),
            "raw_read_files_cold": {"s": raw_fr, "GBps": fr, "threads": readers[0], "bytes": raw_fr_bytes,
                                    "files": [os.path.basename(f) for f in load_files]},
            "ceiling": {"write_GBps": cw, "read_GBps": cr},
            "checkpoint_write": {**best, **rate(nbytes, best["total_s"], True)},
            "verify_cold": rate(nbytes, verify_s, False),
            "load_cold": rate(load_bytes, load_s, False),
            "load_export_cold": {**rate(export_bytes, export_load_s, False), "dtype": a.save_dtype},
            "from_pretrained_cold": ({**rate(export_bytes, fpt["cold"]["total_s"], False), "dtype": a.save_dtype,
                                      "phases": fpt} if "total_s" in fpt["cold"] else fpt["cold"]),
            "resume_once_cold": {**rate(phases["resume_once_cold"]["bytes"], phases["resume_once_cold"]["total_s"],
                                        False),
                                 "bytes_read": phases["resume_once_cold"]["bytes"], "checkpoint_bytes": nbytes},
            "phases": phases,
        })
        if len(readers) > 1:
            res["phases_by_readers"] = {str(n): v for n, v in by_readers.items()}
        for cache in ("warm",) if a.warm else ():
            res[f"rates_{cache}"] = {n: (load_bytes if n == "load" else export_bytes if n == "load_export" else
                                         phases[f"{n}_{cache}"]["bytes"]) / 1e9 / phases[f"{n}_{cache}"]["total_s"]
                                     for n in ("verify", "load", "load_export", "resume_once")}
            if "total_s" in fpt.get(cache, {}):
                res[f"rates_{cache}"]["from_pretrained"] = export_bytes / 1e9 / fpt[cache]["total_s"]
        print(f"checkpoint {gb:.2f} GB ({len(res['files'])} files)")
        print(f"  raw write+fsync  {rw:6.2f} GB/s one stream, {pw:6.2f} GB/s {threads} threads")
        print(f"  raw read (cold)  {rr:6.2f} GB/s one stream, {pr:6.2f} GB/s {threads} threads, {rr_:6.2f} GB/s "
              f"{readers[0]} threads, O_DIRECT "
              + (f"{dr:.2f} GB/s" if dr else "unsupported")
              + f"; the load's own files {fr:6.2f} GB/s {readers[0]} threads")
        for k in ("checkpoint_write", "verify_cold", "load_cold", "load_export_cold", "from_pretrained_cold",
                  "resume_once_cold"):
            if "GBps" not in res[k]:
                print(f"  {k:<20} skipped: {res[k]['skipped']}")
                continue
            print(f"  {k:<20} {res[k]['GBps']:6.2f} GB/s   {100 * res[k]['vs_raw']:5.1f} % of one stream, "
                  f"{100 * res[k]['vs_ceiling']:5.1f} % of the ceiling")
        for n, runs in by_readers.items():
            print(f"  phases, {n} readers, {fast_io.READ_CHUNK >> 20} MiB reads (seconds; read .. stall: "
                  "thread-seconds summed over the readers and their lanes):")
            if n == readers[0]:
                runs = runs | {f"from_pretrained_{c}": ph for c, ph in fpt.items() if "total_s" in ph}
            for k, ph in runs.items():
                print(f"    {k:<22} total {ph['total_s']:6.2f}  wall {ph['wall_s']:6.2f}  other {ph['other_s']:5.2f}  "
                      + "  ".join(f"{m[:-2]} {ph[m]:6.2f}" for m in ("read_s", "crc_s", "convert_s", "copy_s",
                                                                       "stall_s"))
                      + f"  {ph['bytes'] / 1e9 / ph['total_s']:6.2f} GB/s")
        if a.warm:
            print("  warm (page cache): " + ", ".join(f"{n} {g:.2f} GB/s" for n, g in res["rates_warm"].items()))
        if a.out:
            schema.write(a.out, res)
            print("wrote", a.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        fast_io.READERS, fast_io.READ_CHUNK, fast_io.READ_SEQUENTIAL = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
