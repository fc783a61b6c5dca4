"""The native kernel is built once per source, flags, compiler and CPU into a private per-user cache, and no build
leaves a directory behind in the temporary folder."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from hf_megatrain.core import build_cache, native_adamw


@pytest.fixture
def cache(tmp_path, monkeypatch):
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler")
    monkeypatch.setenv(build_cache.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    return tmp_path


def test_built_once_into_a_private_cache(cache, monkeypatch):
    native_adamw.build()
    root = build_cache.cache_root()
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    libs = os.listdir(root)
    assert len(libs) == 1 and libs[0].startswith("adamw-") and libs[0].endswith(".so")  # (no build folder left)
    assert not os.listdir(cache / "tmp")

    def no_compiler(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native_adamw.build().adamw_span is not None
    src, flags = "void f(void) {}\n", ["-O3", "-shared", "-fPIC"]  # (any source: the key's contract, not the kernel's)
    assert build_cache.build_key(src + "/* a variant */\n", "cc", flags) != build_cache.build_key(src, "cc", flags)
    assert build_cache.build_key(src, "cc", flags + ["-g"]) != build_cache.build_key(src, "cc", flags)


def test_a_cache_others_may_write_is_not_used(cache):
    root = build_cache.cache_root()
    os.makedirs(root)
    os.chmod(root, 0o777)
    assert isinstance(native_adamw.build(), ctypes.CDLL)
    assert not os.listdir(root) and not os.listdir(cache / "tmp")  # built in a temporary folder, removed
