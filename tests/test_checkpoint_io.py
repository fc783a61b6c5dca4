"""Checkpoint bytes at disk speed (issue 29): CRC-32 computed while writing (never a second pass), parallel writers
giving the same files as one, reads in one parallel pass, and ``megatrain estimate``'s checkpoint size and time."""

from __future__ import annotations

import json
import os
import random
import zlib

import pytest
import torch
from safetensors.torch import load_file

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner
from hf_megatrain import checkpoint as ckpt
from hf_megatrain.checkpoint import fast_io, folders, read_into, safetensors_io
from hf_megatrain.checkpoint import manifest as manifest_io

from .models import tiny
from .test_load_speed import engine_with_moments, scramble
from .test_planner import _config_dir


def _items(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3, 1000, generator=g)
    return [("a", torch.randn(37, 11, generator=g)), ("b", big[:, 100:400]),  # (a non-contiguous view)
            ("c", torch.arange(5, dtype=torch.int64)), ("d", torch.randn(4097, generator=g)),
            ("e", torch.tensor(1.5)), ("f", torch.zeros(0, 3))]


def _crc(path) -> str:
    with open(path, "rb") as f:
        return f"{zlib.crc32(f.read()):08x}"


def test_crc32_combine_matches_zlib():
    rng = random.Random(0)
    for _ in range(30):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert fast_io.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_crc_recorded_while_writing_equals_zlib_over_file(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 4096)  # many chunks, ranges split across workers
    path = tmp_path / "x.safetensors"
    got = ckpt.write_safetensors(str(path), _items(), dtype, workers=3)
    assert got == _crc(path) == fast_io.recorded_crc32(str(path))
    back = load_file(str(path))
    for name, t in _items():
        want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        assert torch.equal(back[name], want), name
    os.rename(path, tmp_path / "y.safetensors")  # a rename keeps the inode: still recorded
    assert fast_io.recorded_crc32(str(tmp_path / "y.safetensors")) == got
    with open(tmp_path / "y.safetensors", "r+b") as f:  # changed after the write: not trusted any more
        f.seek(100)
        f.write(b"\x00\x01")
    os.utime(tmp_path / "y.safetensors", ns=(1, 1))
    assert fast_io.recorded_crc32(str(tmp_path / "y.safetensors")) is None


def test_parallel_write_identical_to_serial(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 1000)
    items = _items(1)
    for w in (1, 2, 4, 7):
        ckpt.write_safetensors(str(tmp_path / f"w{w}.safetensors"), items, torch.bfloat16, workers=w)
        d = tmp_path / f"shards{w}"
        d.mkdir()
        ckpt.write_weights(str(d), items, dtype=None, max_shard_size=20000, workers=w)
    ref = (tmp_path / "w1.safetensors").read_bytes()
    ref_shards = {f.name: f.read_bytes() for f in (tmp_path / "shards1").iterdir()}
    assert len(ref_shards) > 2
    for w in (2, 4, 7):
        assert (tmp_path / f"w{w}.safetensors").read_bytes() == ref
        assert {f.name: f.read_bytes() for f in (tmp_path / f"shards{w}").iterdir()} == ref_shards


def test_manifest_reads_back_only_unrecorded_files(tmp_path, monkeypatch):
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    engine.create_optimizer(lr=1e-3)
    out = tmp_path / "checkpoint-1"
    with ckpt.atomic_directory(str(out)) as tmp:
        ckpt.save_pretrained_streamed(engine, tmp, dtype=torch.bfloat16)  # (staged, then renamed into tmp)
        ckpt.save_training_state(engine, tmp, master=True)
        (tmp_path / "unused").write_text("x")
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"global_step": 1}, f)
        read: list[str] = []
        real = manifest_io.crc32_files
        monkeypatch.setattr(manifest_io, "crc32_files", lambda paths, **kw: read.extend(paths) or real(paths, **kw))
        ckpt.write_manifest(tmp)
    assert not [p for p in read if p.endswith(".safetensors")], read  # their CRCs were recorded while writing
    assert any(p.endswith("trainer_state.json") for p in read)
    manifest = json.loads((out / folders.MANIFEST).read_text())
    assert manifest["crc32"] == {f: _crc(out / f) for f in manifest["files"]}
    ckpt.verify_checkpoint(str(out))
    data = bytearray((out / folders.OPTIMIZER_TENSORS).read_bytes())  # same size, one byte changed: refused
    data[-3] ^= 0xFF
    (out / folders.OPTIMIZER_TENSORS).write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="CRC-32"):
        ckpt.verify_checkpoint(str(out))


def test_crc32_files_one_pass_in_ranges(tmp_path):
    rng = random.Random(2)
    paths = []
    for i, n in enumerate((0, 1, 5000, 70001)):
        p = tmp_path / f"f{i}"
        p.write_bytes(rng.randbytes(n))
        paths.append(str(p))
    assert read_into.crc32_files(paths, workers=3, chunk=4096) == [_crc(p) for p in paths]
    assert folders.file_crc32(paths[-1], chunk=1000) == _crc(paths[-1])


def test_estimate_prints_checkpoint_size_and_time(tmp_path, capsys):
    d = _config_dir(tmp_path)
    assert planner.main([d, "--seq-len", "128", "--disk-gbps", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "Checkpoint time at 0.5 GB/s" in out and "Trainer checkpoint" in out and "model export" in out
    assert planner.main([d, "--seq-len", "128", "--disk-gbps", "2", "--json"]) == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint"]
    n = sum(p.numel() for p in tiny("llama").parameters())
    master = 0 if ck["export_bytes"] == 4 * n else 4 * n  # (an FP32 export is the master)
    assert ck["trainer_bytes"] == ck["export_bytes"] + 8 * n + master  # + AdamW m, v
    assert ck["trainer_s"] == pytest.approx(ck["trainer_bytes"] / 2e9)
    assert planner.main([d, "--disk-gbps", "0"]) == 2


# -- loads straight into the engine's tensors (read_into) -----------------------------------------------------------
def test_read_into_places_every_byte_and_crcs_while_reading(tmp_path):
    """Odd sizes, an int tensor, a 0-d and an empty one, a non-contiguous destination, a bf16 tensor converted into
    an FP32 one, a rank's shard of a flat tensor; tiny chunks so that every tensor spans ranges of several
    threads. The CRC computed while reading equals zlib's over the file."""
    from hf_megatrain.checkpoint.read_into import Target, read_into

    items = _items() + [("g", torch.randn(3, 333, generator=torch.Generator().manual_seed(1)).bfloat16())]
    path = str(tmp_path / "x.safetensors")
    safetensors_io.write_safetensors(path, items)
    ref = load_file(path)
    dst = {k: torch.full(v.shape, -7, dtype=v.dtype) for k, v in ref.items()}
    dst["a"] = torch.full((11, 37), -7.0).t()  # (non-contiguous: a transposed buffer)
    dst["g"] = torch.full((3, 333), -7.0)  # bf16 on disk, FP32 here: one conversion
    shard = torch.full((1999,), -7.0)  # elements [1001, 3000) of "d"
    targets = {k: Target(t) for k, t in dst.items() if k != "d"} | {"d": Target(shard, 1001)}
    for crc in (True, False):
        got = read_into([(path, targets, crc)], workers=3, chunk=1000)
        assert got == ([_crc(path)] if crc else [None])
        for k, t in dst.items():
            if k != "d":
                assert torch.equal(t, ref[k].to(t.dtype)), k
        assert torch.equal(shard, ref["d"][1001:3000])
        for t in (*dst.values(), shard):
            t.fill_(-7) if t.dtype != torch.bool else None
    with pytest.raises(ValueError, match="shape"):
        read_into([(path, {"a": Target(torch.empty(11, 37))}, False)])


def test_engine_load_reads_into_the_store_and_refuses_changed_bytes(tmp_path):
    """Masters and AdamW moments read straight into the engine come back bit for bit; a byte changed after the
    manifest was written is refused by the load itself (CRC-32 computed while reading), a truncated file too; a bf16
    export loads as the masters rounded to bf16 (one conversion)."""
    engine = engine_with_moments()
    opt = engine.optimizer
    folder = str(tmp_path / "ck")
    os.makedirs(folder)
    folders.save_training_state(engine, folder, master=True)
    folders.write_manifest(folder)
    want = {n: t.clone() for n, t in engine.named_master_tensors()}
    moments = {k: v.clone() for k, v in opt.state_tensors().items()}
    scramble(engine)
    assert folders.load_pretrained_into_engine(engine, folder) == []
    assert folders.load_training_state(engine, folder)
    assert all(torch.equal(t, want[n]) for n, t in engine.named_master_tensors())
    assert all(torch.equal(v, moments[k]) for k, v in opt.state_tensors().items())

    master = os.path.join(folder, "megatrain_master.safetensors")
    for path, load in ((master, lambda: folders.load_pretrained_into_engine(engine, folder)),
                       (os.path.join(folder, ckpt.OPTIMIZER_TENSORS), lambda: folders.load_training_state(engine,
                                                                                                           folder))):
        data = bytearray(open(path, "rb").read())
        data[-5] ^= 0x40
        open(path, "wb").write(bytes(data))
        with pytest.raises(ckpt.CheckpointError, match="changed while it was loaded or since it was verified"):
            load()
        open(path, "wb").write(bytes(data[:-64]))
        with pytest.raises(ckpt.CheckpointError, match="truncated|corrupt"):
            load()

    export = str(tmp_path / "bf16")
    folders.save_pretrained_streamed(engine, export, dtype=torch.bfloat16)
    want = {n: t.clone() for n, t in engine.named_master_tensors()}
    with torch.no_grad():
        for _, t in engine.named_master_tensors():
            t.zero_()
    folders.load_pretrained_into_engine(engine, export)
    assert all(torch.equal(t, want[n].bfloat16().float()) for n, t in engine.named_master_tensors())


def _bench_module():
    """integration/bench_checkpoint_io.py as a module (a script, not part of the package)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_ckio", os.path.join(root, "integration",
                                                                            "bench_checkpoint_io.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_checkpoint_io_smoke(tmp_path):
    """integration/bench_checkpoint_io.py end to end on a tiny model: it creates --dir, measures the raw ceilings
    (one stream, parallel threads, O_DIRECT or a note that the filesystem refuses it) and records the command."""
    bench = _bench_module()
    out = tmp_path / "res.json"
    assert bench.main(["--size", "0.0001", "--dir", str(tmp_path / "new" / "dir"), "--out", str(out),
                       "--threads", "2"]) == 0
    res = json.loads(out.read_text())
    assert res["command"].endswith("--threads 2") and res["threads"] == 2
    for key in ("raw_write_fsync", "raw_write_parallel_fsync", "raw_read_cold", "raw_read_parallel_cold"):
        assert res[key]["GBps"] > 0, key
    assert "GBps" in res["raw_read_parallel_direct"] or "unsupported" in res["raw_read_parallel_direct"]
    for key in ("checkpoint_write", "verify_cold", "load_cold", "load_export_cold"):
        assert 0 < res[key]["vs_ceiling"] <= res[key]["vs_raw"] + 1e-9, key
    assert not os.listdir(tmp_path / "new" / "dir")  # (its temp folder removed)


def test_bench_export_load_smoke(tmp_path):
    """``--export-load``: a bf16 export written from the meta model's shapes, then ``from_pretrained_streamed`` of it
    beside a plain read of the same shards; the JSON says both rates and the folder is removed."""
    bench = _bench_module()
    out = tmp_path / "res.json"
    assert bench.main(["--export-load", "0.0005", "--dir", str(tmp_path / "d"), "--out", str(out)]) == 0
    e = json.loads(out.read_text())["export_load"]
    assert e["params"] > 0 and e["bytes"] >= 2 * e["params"] and e["plain_read_GBps"] > 0
    assert 2 * e["params"] <= e["from_pretrained"]["bytes"] <= e["bytes"] and 0 < e["vs_plain_read"]  # (headers: not read)
    assert not os.listdir(tmp_path / "d")
