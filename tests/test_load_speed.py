"""Checkpoint loads as a read pipeline (issue 29): readers hand each chunk to a lane thread for the CRC-32 and the
conversion, any reader count and read size give the same bytes, corruption is still refused, and a resume too large
for the page cache reads every byte of the checkpoint once (counted with ``read_stats``), not twice."""

from __future__ import annotations

import json
import os
import random
import weakref
import zlib

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain import checkpoint as ckpt
from hf_megatrain.checkpoint import fast_io
from hf_megatrain.checkpoint.read_into import HeaderError, Target, crc32_files, read_into

from .models import tiny


def _crc(path) -> str:
    with open(path, "rb") as f:
        return f"{zlib.crc32(f.read()):08x}"


def engine_with_moments() -> MegaTrainEngine:
    """A tiny Llama engine whose AdamW moments hold random values (a load that skipped them would show)."""
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    engine.create_optimizer(lr=1e-2)
    with torch.no_grad():
        for u in engine.store.units:
            u.exp_avg.normal_()
            u.exp_avg_sq.uniform_()
    return engine


def _trained_checkpoint(tmp_path) -> tuple[MegaTrainEngine, str, dict, dict]:
    """An engine with non-trivial masters and moments, its checkpoint (bf16 export + FP32 master + moments +
    manifest), and copies of what was saved."""
    engine = engine_with_moments()
    opt = engine.optimizer
    path = str(tmp_path / "checkpoint-1")
    with ckpt.atomic_directory(path) as tmp:
        ckpt.save_pretrained_streamed(engine, tmp, dtype=torch.bfloat16)
        ckpt.save_training_state(engine, tmp, master=True)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"global_step": 1}, f)
        ckpt.write_manifest(tmp)
    masters = {n: t.clone() for n, t in engine.named_master_tensors()}
    moments = {k: v.clone() for k, v in opt.state_tensors().items()}
    return engine, path, masters, moments


def scramble(engine: MegaTrainEngine) -> None:
    """Every master moved by 1, every moment zeroed: a load that missed any of them shows."""
    with torch.no_grad():
        for _, t in engine.named_master_tensors():
            t.add_(1.0)
        for u in engine.store.units:
            u.exp_avg.zero_()
            u.exp_avg_sq.zero_()


def _exact(engine: MegaTrainEngine, masters: dict, moments: dict) -> bool:
    return (all(torch.equal(t, masters[n]) for n, t in engine.named_master_tensors())
            and all(torch.equal(v, moments[k]) for k, v in engine.optimizer.state_tensors().items()))


@pytest.mark.parametrize("readers,chunk", [(1, 1 << 20), (3, 1000), (8, 4096)])
def test_loads_bitwise_exact_for_any_readers_and_read_size(tmp_path, monkeypatch, readers, chunk):
    engine, path, masters, moments = _trained_checkpoint(tmp_path)
    monkeypatch.setattr(fast_io, "READERS", readers)
    monkeypatch.setattr(fast_io, "READ_CHUNK", chunk)
    scramble(engine)
    ckpt.verify_checkpoint(path)
    ckpt.load_pretrained_into_engine(engine, path)
    assert ckpt.load_training_state(engine, path)
    assert _exact(engine, masters, moments)
    with ckpt.read_stats() as st:  # the bf16 export: converted once into the FP32 masters, on the lanes
        ckpt.load_pretrained_into_engine(engine, path, prefix=ckpt.WEIGHTS_PREFIX)
    assert all(torch.equal(t, masters[n].bfloat16().float()) for n, t in engine.named_master_tensors())
    assert st.convert_s > 0 and st.crc_s > 0 and st.read_s > 0 and 1 <= st.readers <= readers
    files = sorted(f for f in os.listdir(path))
    assert crc32_files([os.path.join(path, f) for f in files]) == [_crc(os.path.join(path, f))
                                                                           for f in files]


def test_resume_larger_than_the_page_cache_reads_each_byte_once(tmp_path):
    engine, path, masters, moments = _trained_checkpoint(tmp_path)
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f != ckpt.MANIFEST)
    loaded = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("megatrain_")
                 and f.endswith(".safetensors"))

    def resume(once: list[str]) -> int:
        scramble(engine)
        with ckpt.read_stats() as st:
            ckpt.verify_checkpoint(path, crc_on_load=once)
            ckpt.load_pretrained_into_engine(engine, path)
            assert ckpt.load_training_state(engine, path)
        assert _exact(engine, masters, moments)
        return st.bytes

    # Fits in the page cache: verify reads everything first (a corrupt file refused before any state is touched),
    # the loads read master and moments again (from the cache).
    assert ckpt.files_checked_on_load(engine, path, page_cache_bytes=1 << 40) == []
    assert resume([]) == total + loaded
    once = ckpt.files_checked_on_load(engine, path, page_cache_bytes=0)  # larger than the page cache
    assert sorted(once) == ["megatrain_master.safetensors", ckpt.OPTIMIZER_TENSORS]
    assert resume(once) == total  # every byte read once, by the verify or by a load (that checks its CRC)

    for fname in once:  # a corrupt file the verify no longer reads is refused by the load, naming it
        p = os.path.join(path, fname)
        data = bytearray(open(p, "rb").read())
        data[-7] ^= 0x10
        open(p, "wb").write(bytes(data))
        ckpt.verify_checkpoint(path, crc_on_load=once)  # (sizes and headers: fine)
        with pytest.raises(ckpt.CheckpointError, match=f"{fname} is corrupt.*CRC-32"):
            ckpt.load_pretrained_into_engine(engine, path)
            ckpt.load_training_state(engine, path)
        with pytest.raises(ckpt.CheckpointError, match=f"{fname} does not hold the bytes"):
            ckpt.verify_checkpoint(path)  # (without crc_on_load: refused before anything is read)
        data[-7] ^= 0x10
        open(p, "wb").write(bytes(data))


def test_a_failing_reader_stops_the_others_and_raises(tmp_path, monkeypatch):
    """A read error in one reader thread surfaces as the load's error (no hang, no partial success)."""
    path = str(tmp_path / "x.safetensors")
    g = torch.Generator().manual_seed(0)
    ckpt.write_safetensors(path, [(f"t{i}", torch.randn(1000, generator=g)) for i in range(20)])
    real, calls = os.preadv, []

    def flaky(fd, bufs, off):
        calls.append(off)
        return 0 if len(calls) == 7 else real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", flaky)
    targets = {f"t{i}": Target(torch.empty(1000)) for i in range(20)}
    with pytest.raises(HeaderError, match="unexpected end of file"):
        read_into([(path, targets, True)], workers=4, chunk=1024)
    monkeypatch.setattr(os, "preadv", real)
    assert read_into([(path, targets, True)], workers=4, chunk=1024) == [_crc(path)]


def test_crc32_files_any_size_any_readers(tmp_path):
    rng = random.Random(3)
    paths = []
    for i, n in enumerate((0, 1, 4095, 4096, 4097, 50001)):
        p = tmp_path / f"f{i}"
        p.write_bytes(rng.randbytes(n))
        paths.append(str(p))
    for readers in (1, 2, 5):
        assert crc32_files(paths, workers=readers, chunk=4096) == [_crc(p) for p in paths]


def test_host_zeros_without_a_pass_are_zeros_and_writable():
    from hf_megatrain.core.memory import alloc_host_zeros

    for numel in (7, 3 << 20):  # (below and above the size that takes an anonymous mapping)
        t = alloc_host_zeros(numel, torch.float32)
        assert t.numel() == numel and t.dtype == torch.float32 and t.is_contiguous()
        assert int(t.count_nonzero()) == 0
        t[-1] = 5.0  # (writable, and the mapping outlives the call that made it)
        assert float(t.sum()) == 5.0


def test_moments_of_a_wide_build_start_at_zero_and_resume_into_them(tmp_path):
    """Layers wide enough for the mapped zeros: a fresh engine's moments are exactly zero, its first step equals a
    reference engine's whose moments were zeroed by hand, and a resume's reads fill them bitwise."""
    def build() -> MegaTrainEngine:
        model = tiny("llama", hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4)
        engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
        engine.create_optimizer(lr=1e-2)
        return engine

    engine = build()
    assert max(u.exp_avg.numel() for u in engine.store.units) * 4 >= 1 << 20
    assert all(int(u.exp_avg.count_nonzero()) == 0 and int(u.exp_avg_sq.count_nonzero()) == 0
               for u in engine.store.units)
    ref = build()
    for u in ref.store.units:
        u.exp_avg.copy_(torch.zeros_like(u.exp_avg))
        u.exp_avg_sq.copy_(torch.zeros_like(u.exp_avg_sq))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    for e in (engine, ref):
        e(input_ids=ids, labels=ids).loss.backward()
        e.optimizer.step()
        e.optimizer.wait()
    for u, r in zip(engine.store.units, ref.store.units):
        assert torch.equal(u.master, r.master) and torch.equal(u.exp_avg_sq, r.exp_avg_sq)
    for thread in engine.store.prefault:  # (the pages faulted in beside the build and the step: no value changed)
        thread.join(timeout=60)
        assert not thread.is_alive()

    ckpt.save_training_state(engine, str(tmp_path), master=True)
    assert any(int(u.exp_avg.count_nonzero()) for u in engine.store.units)
    fresh = build()
    ckpt.load_training_state(fresh, str(tmp_path))
    for u, f in zip(engine.store.units, fresh.store.units):
        assert torch.equal(u.exp_avg, f.exp_avg) and torch.equal(u.exp_avg_sq, f.exp_avg_sq)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_prefault_faults_pages_in_without_changing_a_byte():
    """The moments' lazily zeroed pages are faulted in ahead of the first update (core/prefault.py): resident after,
    and values written before or meanwhile are kept."""
    from hf_megatrain.core import prefault
    from hf_megatrain.core.memory import alloc_host_zeros

    if not prefault.supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    t = alloc_host_zeros(64 << 18, torch.float32)  # 64 MiB
    t[::16 << 18] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # (a writer came first on a few pages, one per 16 MiB)
    before = _resident_bytes()
    for thread in prefault.prefault_in_background([t], threads=3, min_bytes=0):
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert _resident_bytes() - before > 48 << 20  # (the pages not written yet: at least 56 MiB with 2 MiB pages)
    expect = torch.zeros_like(t)
    expect[::16 << 18] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(t, expect)
    assert prefault.prefault_in_background([torch.zeros(16)], min_bytes=0) == []  # (small buffers: nothing to do)
    assert prefault.prefault_in_background([t]) == []  # (64 MiB in all: the first writer's faults cost ms)


def test_a_dropped_buffer_is_let_go_by_the_prefault_thread():
    from hf_megatrain.core import prefault
    from hf_megatrain.core.memory import alloc_host_zeros

    if not prefault.supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    t = alloc_host_zeros(8 << 18, torch.float32)
    ref = weakref.ref(t)
    threads = prefault.prefault_in_background([t], min_bytes=0)
    del t
    for thread in threads:
        thread.join(timeout=60)
    assert ref() is None
