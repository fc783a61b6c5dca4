"""A private, per-user cache of the small C libraries hf_megatrain compiles (core/native_adamw.py).

Why: a build per process into a fresh temporary directory left one directory in /tmp per run, and paid the
compiler every start. Each library is built once per *key* (its source, the compiler flags, the compiler binary,
and this CPU's model and instruction-set flags: ``-march=native`` code must never run on a CPU it was not built
for, e.g. a home directory shared over NFS by different machines) into ``$HF_MEGATRAIN_CACHE`` or
``$XDG_CACHE_HOME/hf_megatrain`` (``~/.cache/hf_megatrain``), under ``native/``, created 0700. A build goes to a
private temporary directory inside the cache and is renamed into place (atomic), so concurrent processes never
load a half-written file; whichever rename lands last wins, and both are the same bytes.

A cache directory that is not ours or is writable by others is not used (loading a library from it would run
whatever someone put there): the build then goes to a temporary directory that is removed right after loading.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

ENV_CACHE = "HF_MEGATRAIN_CACHE"


def cache_root() -> str:
    base = os.environ.get(ENV_CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_megatrain")
    return os.path.join(base, "native")


def _cpu_identity() -> str:
    """This CPU's model name and instruction-set flags (Linux), else what ``platform`` says."""
    keep = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":")[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in keep:
                    keep.append(line)
                if not line.strip() and keep:  # (the first processor's block is enough)
                    break
    except OSError:
        pass
    return platform.machine() + platform.processor() + "".join(keep)


def _private_dir(path: str) -> bool:
    """Create ``path`` (0700) if needed; True if it is a directory of this user that nobody else may write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return False
    return os.path.isdir(path) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def build_key(source: str, compiler: str, flags: list[str]) -> str:
    exe = shutil.which(compiler) or compiler
    try:
        st = os.stat(os.path.realpath(exe))
        compiler_id = f"{os.path.realpath(exe)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        compiler_id = exe
    h = hashlib.sha256()
    for part in (source, compiler_id, " ".join(flags), _cpu_identity()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _compile(source: str, compiler: str, flags: list[str], out_dir: str, what: str) -> str:
    src, so = os.path.join(out_dir, "src.c"), os.path.join(out_dir, "lib.so")
    with open(src, "w") as f:
        f.write(source)
    r = subprocess.run([compiler, *flags, src, "-o", so], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building {what} failed: {r.stderr.strip()[-400:]}")
    return so


def shared_library(source: str, compiler: str, flags: list[str], name: str, load):  # type: ignore[no-untyped-def]
    """``load(path)`` of the library built from ``source`` (``name``: its file name stem and how errors name it),
    from the cache when there, else built, cached, and loaded. Returns what ``load`` returns."""
    root = cache_root()
    if _private_dir(root):
        final = os.path.join(root, f"{name}-{build_key(source, compiler, flags)}.so")
        if not os.path.exists(final):
            tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
            try:
                os.replace(_compile(source, compiler, flags, tmp, name), final)  # (atomic: whole file or none)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return load(final)
    tmp = tempfile.mkdtemp(prefix=f"hf_megatrain_{name}_")  # (no usable cache: nothing left behind either)
    try:
        return load(_compile(source, compiler, flags, tmp, name))  # (a loaded library outlives its file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
