"""Memory-mapped state files (optimizer_state_dir's AdamW moments, the data-parallel store in /dev/shm) have their
blocks reserved when they are created: a full file system is a clear error at start-up naming the folder, never a
SIGBUS in the middle of training."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.core.memory import HostMemoryError, alloc_on_disk, reserve_file
from hf_megatrain.parallel.shared_alloc import SharedHostAllocator, new_run_dir

from .models import tiny


def no_space(*_args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def not_supported(*_args):
    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))


def test_full_disk_under_optimizer_state_dir_is_an_error_at_start(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(HostMemoryError, match=rf"{tmp_path}.*optimizer_state_dir.*bytes") as err:
        MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", optimizer_state_dir=str(tmp_path)),
                        device="cpu")
    assert "larger local disk" in str(err.value)
    assert not list(tmp_path.iterdir())  # (the state files are unlinked whatever happens)


def test_full_shared_memory_dir_is_an_error_at_start(tmp_path, monkeypatch):
    alloc = SharedHostAllocator(new_run_dir(str(tmp_path)))
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(HostMemoryError, match=rf"{tmp_path}.*shared store.*shared_memory_dir"):
        alloc(1000, torch.float32, False)
    alloc.release()


@pytest.mark.parametrize("fallocate", ["native", "unsupported"])
def test_state_files_have_their_blocks(tmp_path, monkeypatch, fallocate):
    if fallocate == "unsupported":  # a file system without fallocate: zeros are written instead
        monkeypatch.setattr(os, "posix_fallocate", not_supported)
    n = 3 << 20
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve_file(fd, n, str(tmp_path), "a test file", "no fix")
    finally:
        os.close(fd)
    st = os.stat(path)
    assert st.st_size == n and st.st_blocks * 512 >= n
    # the shared store's files, and the disk tier's (through the same call), start as zeros of the right size
    alloc = SharedHostAllocator(new_run_dir(str(tmp_path)))
    t = alloc(n // 4, torch.float32, False)
    (name,) = alloc.signature()
    st = os.stat(os.path.join(alloc.run_dir, name))
    assert st.st_blocks * 512 >= n and not t.any()
    alloc.release()
    assert not alloc_on_disk(1000, torch.float32, str(tmp_path)).any()


def test_zero_fill_keeps_what_is_there(tmp_path, monkeypatch):
    """Another rank may have sized and written a shared file: reserving it again never overwrites data."""
    monkeypatch.setattr(os, "posix_fallocate", not_supported)
    path = tmp_path / "f.bin"
    path.write_bytes(b"\x01" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        reserve_file(fd, 3 * 4096, str(tmp_path), "a test file", "no fix")
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[:4096] == b"\x01" * 4096 and data[4096:] == bytes(2 * 4096)


# -- a failed multi-process conversion leaves nothing in shared_memory_dir -----------------------------------------------
def test_shared_files_removed_when_conversion_fails(tmp_path):
    alloc = SharedHostAllocator(new_run_dir(str(tmp_path)))
    with pytest.raises(RuntimeError, match="boom"):
        with alloc.removed_on_failure():
            alloc(1000, torch.float32, False)
            raise RuntimeError("boom")
    assert not os.path.exists(alloc.run_dir)


@pytest.mark.slow  # (spawns processes)
def test_shared_files_removed_on_sigterm(tmp_path):
    """torchrun ends every rank with SIGTERM when one fails: the run directory goes, and the process still ends by
    that signal."""
    import signal
    import subprocess
    import sys

    code = "\n".join([
        "import time, torch",
        "from hf_megatrain.parallel.shared_alloc import SharedHostAllocator, new_run_dir",
        f"alloc = SharedHostAllocator(new_run_dir({str(tmp_path)!r}))",
        "with alloc.removed_on_failure():",
        "    alloc(1 << 16, torch.float32, False)",
        "    print(alloc.run_dir, flush=True)",
        "    time.sleep(60)"])
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    run_dir = proc.stdout.readline().strip()
    assert os.path.isdir(run_dir)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not os.path.exists(run_dir)
