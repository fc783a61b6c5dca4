"""One benchmark run in its own process: ``<runner> --spec <json> --result <file>``, killed whole on timeout.

Every benchmark here runs each (system, size) in a fresh process (a crash, an out-of-memory kill or a hung
collective costs one record, not the benchmark) and reads back the one JSON line the runner wrote. ``run_child``
does that for ``bench_vs_deepspeed.py``, ``bench_dpo.py`` and ``scale_123b.py``; each caller shapes its own records.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def host_used_bytes() -> int:
    """MemTotal - MemAvailable: what every process of the host holds, shared pages (the data-parallel store, which
    each rank maps) counted once."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


class HostPeak:
    """Peak of ``host_used_bytes`` above its value at the start, sampled every 50 ms while a run lasts."""

    def __init__(self) -> None:
        self.base = self.peak = host_used_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, host_used_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak - self.base


@dataclass
class ChildRun:
    record: dict[str, Any] | None  # the runner's JSON record; None when none came back
    timed_out: bool
    returncode: int | None
    wall_s: float
    log_path: str
    host_added_bytes: int = 0  # peak host memory the run added, every process of it counted once
    host_base_bytes: int = 0  # host_used_bytes() when the run started (what a runner's own samples are against)

    def error_record(self, timeout: float, **keys: Any) -> dict[str, Any]:
        """The record of a run that returned none: ``keys`` (what identifies the run), the status, whether the log
        says out of memory, and the log's tail."""
        tail = log_tail(self.log_path)
        why = (f"timed out after {timeout:.0f}s" if self.timed_out else
               f"runner exited with code {self.returncode} without a result")
        return {**keys, "status": "timeout" if self.timed_out else "error", "oom": "out of memory" in tail.lower(),
                "error": why + "\n" + tail[-3000:]}


def run_child(script: str, spec: dict, log_path: str, env: dict[str, str], timeout: float,
              nproc: int = 1) -> ChildRun:
    """``script`` with ``spec`` in its own process group, output to ``log_path``; SIGTERM then SIGKILL to the whole
    group on timeout (a runner's own children die with it). ``nproc`` > 1: that many processes of one host through
    torchrun (``torch.distributed.run --standalone``), as ``accelerate launch --multi_gpu`` starts them; rank 0
    writes the record."""
    prefix = os.path.splitext(os.path.basename(script))[0] + "_"
    result = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".json", delete=False).name
    launcher = [sys.executable] if nproc <= 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    cmd = launcher + [os.path.abspath(script), "--spec", json.dumps(spec), "--result", result]
    t0, timed_out, peak = time.perf_counter(), False, HostPeak()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                    p.wait(timeout=15)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
    added = peak.stop()
    record = None
    try:
        with open(result) as f:
            record = json.loads(f.read().strip().splitlines()[-1]) or None
    except (OSError, ValueError, IndexError):
        pass
    finally:
        if os.path.exists(result):
            os.remove(result)
    return ChildRun(record, timed_out, p.returncode, time.perf_counter() - t0, log_path, added, peak.base)


def run_attempts(tries: list[dict[str, Any]], run: Callable[[dict[str, Any], float, str], dict[str, Any]], *,
                 log_path: Callable[[int], str], budget: float, started: float, timeout: float, tag: str, what: str,
                 skipped: dict[str, Any], summary: Callable[[dict[str, Any]], str],
                 logs: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One benchmark point (a system at one size): ``tries`` (spec overrides, best first) in turn, each as
    ``run(over, timeout, log)``, the next only after one that ran out of memory. Each gets what is left of
    ``budget`` (seconds since ``started``) less 20 s, at most ``timeout``; none starts with under 60 s left: then the
    point's record is ``skipped`` + a skipped status. Returns the last record and the failed attempts before it."""
    record: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    for i, over in enumerate(tries):
        left = budget - (time.perf_counter() - started)
        if left < 60:
            record = {**skipped, "status": "skipped",
                      "error": f"time budget (--budget {budget:.0f}s) used up before this run"}
            break
        log = log_path(i)
        print(f"{tag} {what} attempt {i + 1}/{len(tries)} {over} (timeout {min(timeout, left - 20):.0f}s)",
              flush=True)
        record = run(over, min(timeout, left - 20), log)
        logs.append(log)
        ok = record.get("status") == "ok"
        print(f"{tag}   -> {record.get('status')} in {record['subprocess_wall_s']:.0f}s: "
              f"{summary(record) if ok else (record.get('error') or '')[:300]}", flush=True)
        if not ok:
            print(log_tail(log, 25), flush=True)
        if ok or not record.get("oom") or i == len(tries) - 1:
            break
        history.append({k: record.get(k) for k in ("spec", "status", "error", "subprocess_wall_s")})
    return record, history
