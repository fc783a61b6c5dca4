"""One result schema for every benchmark here: the header each result file carries, and one writer.

A figure is only worth what is known of where it came from, so every result file under integration/results/ starts
with the same fields, whichever script wrote it:

- ``command``: how it ran (``python integration/<script>.py <args>``), to run it again;
- ``commit``: the tree measured (``--commit`` where a script takes it, else ``BENCH_COMMIT``, else ``git rev-parse
  --short HEAD``; None when none of them answers, e.g. a tree copied without its .git);
- ``date``: local time of the run's start;
- ``machine``: the GPU (name, count, memory, driver: from nvidia-smi, so no CUDA context is made in a parent whose
  children need the whole GPU) and the host (cores, RAM);
- ``versions``: python, torch, CUDA and the libraries the figures depend on.

The figures follow in each benchmark's own fields. A benchmark that merges several calls into one file
(bench_vs_deepspeed.py, bench_dpo.py) keeps the command and commit of each call in its ``runs`` list.

``write`` puts the JSON (and the Markdown rendering beside it) in place atomically: a run cut off mid-write leaves
the previous file, never half of one. ``filed_name`` is the name a result is filed under in integration/results/
(``<date>_<commit>_<run>.<ext>``, that folder's README); ``python integration/bench/record.py file RESULT.json RUN
DIR`` files a result (and its .md) under it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2 ** 30
PACKAGES = ("transformers", "accelerate", "deepspeed", "hf_megatrain", "pydantic")


def versions(*extra: str) -> dict[str, Any]:
    """python, torch, CUDA and ``PACKAGES`` (+ ``extra``) as installed; None for a package that is not."""
    from importlib import metadata

    import torch

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in PACKAGES + extra:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _nvidia_smi(query: str) -> list[list[str]]:
    """One row per GPU of ``nvidia-smi --query-gpu=<query>``; [] where there is no driver."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [[x.strip() for x in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    """The host (cores, this process's CPU affinity, RAM total and available) and its GPUs (name, count, the first
    one's total and free memory, driver); ``gpu`` None without one."""
    from hf_megatrain.core.memory import available_host_bytes

    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
                            "mem_available_gib": available_host_bytes() / GIB}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = int(next(x for x in f if x.startswith("MemTotal:")).split()[1]) * 1024 / GIB
    except (OSError, StopIteration):
        pass
    try:
        rows = _nvidia_smi("name,memory.total,memory.free,driver_version")
        name, total, free, driver = rows[0]
        info.update(gpu=name, gpu_total_gib=float(total) / 1024, gpu_free_gib=float(free) / 1024, driver=driver,
                    gpu_count=len(rows))
    except (ValueError, IndexError):
        info.update(gpu=None, gpu_count=0)
    return info


def gpu_slug(tiny: bool = False) -> tuple[str, str]:
    """(GPU name, its file-name form): "NVIDIA H100 80GB HBM3" -> "h100_80gb_hbm3"; "cpu" without a GPU; a
    ``_tiny`` suffix for smoke runs, so they never merge into a real run's file."""
    rows = _nvidia_smi("name")
    name = rows[0][0] if rows and rows[0][0] else "cpu"
    slug = "".join(c if c.isalnum() else "_" for c in name.lower().replace("nvidia", "")).strip("_")
    while "__" in slug:
        slug = slug.replace("__", "_")
    return name, (slug or "gpu") + ("_tiny" if tiny else "")


def commit(given: str | None = None) -> str | None:
    """The commit measured: ``given`` (a script's ``--commit``), else ``BENCH_COMMIT``, else the checkout's HEAD."""
    if given or os.environ.get("BENCH_COMMIT"):
        return given or os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def command(script: str, argv: Sequence[str] | None = None, called: str | None = None) -> str:
    """``python <script relative to the repo> <args>``: ``argv`` when a caller passed them (a test calling
    ``main(argv)``), else this process's own; with ``called``, a call of ``main(argv)`` from Python is written
    ``<called>.main(<args>)``, so a merged file tells such runs from the commands."""
    if argv is not None and called:
        return f"{called}.main({shlex.join(argv)})"
    args = list(sys.argv[1:] if argv is None else argv)
    return "python " + shlex.join([os.path.relpath(os.path.abspath(script), ROOT)] + args)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def header(script: str, argv: Sequence[str] | None = None, *, given_commit: str | None = None,
           host: dict[str, Any] | None = None, extra_versions: Sequence[str] = ()) -> dict[str, Any]:
    """The fields every result file starts with (see the module's docstring); ``host``: a ``machine()`` the caller
    already took."""
    return {"command": command(script, argv), "commit": commit(given_commit), "date": now(),
            "machine": host if host is not None else machine(), "versions": versions(*extra_versions)}


def write(path: str, doc: dict[str, Any], md: str | None = None) -> None:
    """``doc`` as JSON at ``path`` and ``md`` (if given) beside it as ``<path without .json>.md``, each written to a
    temporary file first and renamed over the old one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    outputs = [(path, json.dumps(doc, indent=1, default=str) + "\n")]
    if md is not None:
        outputs.append((os.path.splitext(path)[0] + ".md", md))
    for target, text in outputs:
        with open(target + ".tmp", "w") as f:
            f.write(text)
        os.replace(target + ".tmp", target)


def mirror(dest: str, files: list[str], logs: list[str]) -> None:
    """Copy results (flat) and logs (``dest/logs/``) to ``dest`` (``--mirror $OUT`` on the device: what was written
    survives a command cut off at its limit); never fails the benchmark."""
    try:
        os.makedirs(os.path.join(dest, "logs"), exist_ok=True)
        for f in files:
            shutil.copy2(f, dest)
        for f in logs:
            if os.path.exists(f):
                shutil.copy2(f, os.path.join(dest, "logs"))
    except OSError as e:
        print(f"[bench] could not mirror results to {dest}: {e}", flush=True)


def filed_name(doc: dict[str, Any], run: str, ext: str = "json") -> str:
    """``<date>_<commit>_<run>.<ext>`` from the record's own date and commit (integration/results/README.md). The
    run names the machine (``h100``, ``h200``, ``cpu2``) and what was run."""
    date = str(doc.get("date") or now())[:10]
    if not doc.get("commit"):
        raise ValueError("the record has no commit: pass --commit / BENCH_COMMIT when it runs, or set its 'commit'")
    return f"{date}_{doc['commit']}_{run}.{ext}"


def file_result(path: str, run: str, folder: str) -> list[str]:
    """Copy a result (and its .md, if there) into ``folder`` under its filed name; the paths written."""
    with open(path) as f:
        doc = json.load(f)
    os.makedirs(folder, exist_ok=True)
    done = []
    for src, ext in ((path, "json"), (os.path.splitext(path)[0] + ".md", "md")):
        if os.path.exists(src):
            dst = os.path.join(folder, filed_name(doc, run, ext))
            shutil.copyfile(src, dst)
            done.append(dst)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="file a benchmark result under integration/results/<benchmark>/")
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("file", help="copy RESULT.json (and its .md) to DIR/<date>_<commit>_<run>.{json,md}")
    f.add_argument("result")
    f.add_argument("run", help="what ran and where, e.g. streamed_clip1_h100")
    f.add_argument("dir", help="e.g. integration/results/bench_vs_deepspeed")
    a = ap.parse_args(argv)
    for p in file_result(a.result, a.run, a.dir):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
