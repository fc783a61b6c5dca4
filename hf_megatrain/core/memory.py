"""Host-memory helpers: pinned allocation without the caching allocator's power-of-two rounding, and the
up-front "will it fit" check that runs before any large allocation."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import weakref

import torch


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); falls back to total physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# GPU memory outside the caching allocator: CUDA context + cuBLAS workspaces (~0.5 GiB on H100 with lazy loading).
CUDA_CONTEXT_GPU_BYTES = 3 * 1024 ** 3 // 4


def gpu_budget(device: torch.device) -> int | None:
    """The GPU memory budget a plan of this process is measured against (the one definition: placement, the fit
    check and ``megatrain estimate`` all use it): free on the card, plus what the caching allocator holds unused,
    plus the CUDA context (already paid, and counted by every plan). None without CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + CUDA_CONTEXT_GPU_BYTES


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class HostMemoryError(MemoryError):
    pass


def alloc_on_disk(numel: int, dtype: torch.dtype, directory: str) -> torch.Tensor:
    """A zero-filled buffer backed by a memory-mapped file in ``directory`` (the disk tier).

    The file's blocks are reserved now (``reserve_file``) and it is unlinked right after mapping: the kernel pages
    it in and out as the optimizer touches it, nothing is left behind if the process dies, no host RAM is reserved
    for it up front, and a disk that fills later cannot take its blocks away (a write to a mapped page without a
    block behind it is a SIGBUS, with no message, in the middle of training).
    """
    fd, path = tempfile.mkstemp(prefix="megatrain-state-", suffix=".bin", dir=directory)
    try:
        reserve_file(fd, max(numel, 1) * torch.empty((), dtype=dtype).element_size(), directory,
                     "the AdamW state (optimizer_state_dir)", "Point optimizer_state_dir at a larger local disk")
        t = torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)
    return t[:numel]


def check_disk_space(needed: int, directory: str, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise HostMemoryError(f"not enough disk in {directory} for {what}: need {format_bytes(needed)}, free "
                              f"{format_bytes(free)}. Point optimizer_state_dir at a larger local disk.")


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_ZEROS = 1 << 20  # bytes per write of the zero-filling fallback


def reserve_file(fd: int, nbytes: int, directory: str, what: str, fix: str) -> None:
    """Size the open file ``fd`` to ``nbytes`` with every block allocated, so writes through a mapping of it can
    never meet a full file system (a sparse file's missing block is a SIGBUS then). ``posix_fallocate`` where the
    file system has it (ext4, xfs, tmpfs: metadata only on disks; on tmpfs it commits the RAM now), else zeros
    written. Out of space: a ``HostMemoryError`` naming ``directory``, the bytes needed and free, and ``fix``."""
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except AttributeError:  # (no posix_fallocate on this platform)
            pass
        except OSError as e:
            if e.errno in _NO_SPACE:
                raise
            # EOPNOTSUPP / EINVAL / ENOSYS: this file system cannot reserve blocks; write zeros instead
        # From the current end only: what is there is kept, as posix_fallocate keeps it (another rank may have
        # sized and filled a shared file already).
        zeros = bytes(min(_ZEROS, nbytes))
        off = os.fstat(fd).st_size
        while off < nbytes:
            off += os.pwrite(fd, zeros[:min(len(zeros), nbytes - off)], off)
    except OSError as e:
        if e.errno not in _NO_SPACE:
            raise
        # (free counts what the failed attempt holds: the caller drops the file; a shared one may be mapped by
        # another rank already, so it is not truncated here)
        free = shutil.disk_usage(directory).free + os.fstat(fd).st_blocks * 512
        raise HostMemoryError(f"not enough space in {directory} for {what}: a file of {format_bytes(nbytes)} "
                              f"({nbytes} bytes) could not be reserved, {format_bytes(free)} free there "
                              f"({os.strerror(e.errno)}). {fix}.") from e


def alloc_host(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer of exactly ``numel`` elements; page-locked when ``pin`` and CUDA is available.

    ``torch.empty(pin_memory=True)`` goes through the caching host allocator, which rounds sizes up to a power of
    two (up to 2x waste on multi-GB buffers); registering a plain allocation pins exactly what we use.
    """
    t = torch.empty(numel, dtype=dtype)
    if pin and numel > 0 and torch.cuda.is_available() and not pin_in_place(t):
        return torch.empty(numel, dtype=dtype, pin_memory=True)  # the caching allocator rather than failing
    return t


# Below this many bytes alloc_host_zeros zeroes an ordinary allocation (its pages are touched already).
ZEROS_MAPPING_MIN = 1 << 20


def alloc_host_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A private, unpinned host buffer of zeros that costs nothing to allocate: an anonymous mapping, whose pages
    the kernel zero-fills on first touch. A build that zeroed the AdamW moments in one pass spent as long on it as
    reading the weights from the disk (8 bytes a parameter); here that cost is paid where the memory is first
    written, on the threads of the first AdamW step or of a resume's reads (which overwrite the zeros anyway).
    Memory is committed on touch, as for ``torch.empty``: the planner's fit check before building is unchanged.
    core/prefault.py faults the pages in on a background thread before the first step needs them."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < ZEROS_MAPPING_MIN:  # (small buffers: a mapping per buffer is not worth it)
        return torch.zeros(numel, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # (2 MiB pages where the kernel allows: 512x fewer first-touch faults)
    return torch.frombuffer(buf, dtype=dtype, count=numel)  # (the tensor keeps the mapping alive)


def pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory where it is (a plain allocation, a shared mapping) until ``t`` is freed; False
    when CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        return False
    # Unregister before the memory is freed (weakref callbacks run at the start of the tensor's dealloc).
    weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, t.data_ptr())
    return True
