"""TakeBackCopies: exact copies of the state a speculative AdamW update overwrites, so taking it back is a restore.

Why: a speculative update (optim/speculative_step.py, optim/lean.py) is applied before the global norm is known. When
the norm proves it wrong (the step clips after one that did not, is skipped as non-finite, or is dropped by
``zero_grad``), the update must be taken back. An arithmetic inverse (core/kernels.py ``undo_*``) cannot be exact:
a float update such as ``m' = fl(b1 m + (1 - b1) g)`` maps two neighbouring old values to one new value now and
then, so the old value is lost (measured: ~2 % of the weights of a tiny model moved by an ulp, moments by up to
8e-4 relative). A skipped step must leave the state untouched, and a redo must equal a step that never speculated,
so the unit's (master, exp_avg, exp_avg_sq) over the range this process steps are copied before the update and
copied back on take-back: bit-exact by construction.

Cost: 12 host bytes per speculated parameter, held from the update until ``step()`` judges it. The buffers are kept
and reused every step (no page faults per step), and their total is bounded by a budget: by default what the host
has available when speculation first needs it (``MemAvailable``, less a reserve of 10 % of RAM and at least
2 GiB, split over the data-parallel ranks on this host), or the ``budget`` given (bytes; 0 turns the copies off: the
optimizers pass 0 unless the config's ``exact_take_back`` is on). A unit that does not fit is handled by the caller: ``UnitAdamW`` does not speculate on it (it is
stepped after the backward, exactly); the lean store, which has no gradient left for a later update, speculates
and takes it back arithmetically (within an ulp), and says so once.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

_MIN_RESERVE = 2 << 30


def available_host_bytes() -> int | None:
    """Host memory available to new allocations without swapping (Linux ``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info["MemAvailable"] - max(_MIN_RESERVE, info.get("MemTotal", 0) // 10)
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return free - max(_MIN_RESERVE, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 10)
    except (OSError, ValueError, AttributeError):
        return None


class TakeBackCopies:
    """Per unit, a copy of [master | exp_avg | exp_avg_sq] over one range of its flat buffers (this step's
    speculative update only). ``reserve`` on any thread; ``save`` before the update, ``restore_*`` on take-back,
    ``forget`` once the update is judged right or restored."""

    def __init__(self, budget: int | None = None, ranks_on_host: int = 1) -> None:
        self.budget = budget  # None: fixed from the available host memory on first use
        self.ranks_on_host = max(ranks_on_host, 1)
        self.used = 0
        self._buffers: dict[int, torch.Tensor] = {}  # unit -> 3 x numel FP32, kept across steps
        self._saved: dict[int, tuple[int, int]] = {}  # unit -> (lo, hi) saved for the step in progress
        self._lock = threading.Lock()
        self.refused: set[int] = set()  # units that did not fit the budget

    def reserve(self, i: int, numel: int) -> bool:
        """Whether unit ``i`` (``numel`` elements stepped here) has, or now gets, a copy buffer within budget."""
        with self._lock:
            if i in self._buffers:
                return self._buffers[i].numel() >= 3 * numel
            if self.budget is None:
                avail = available_host_bytes()
                self.budget = 0 if avail is None else max(avail, 0) // self.ranks_on_host
            need = 12 * numel
            if self.used + need > self.budget:
                if i not in self.refused:
                    self.refused.add(i)
                    logger.info("hf_megatrain: exact take-back copies: unit %d (%d bytes) does not fit the "
                                "budget (%d of %d bytes used)", i, need, self.used, self.budget)
                return False
            self._buffers[i] = torch.empty(3 * numel, dtype=torch.float32)
            self.used += need
            return True

    def save(self, i: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             lo: int, hi: int) -> None:
        """Copy the range [lo, hi) of the unit's state (call right before its speculative update)."""
        n = hi - lo
        buf = self._buffers[i]
        for k, src in enumerate((master, exp_avg, exp_avg_sq)):
            buf[k * n:(k + 1) * n].copy_(src[lo:hi])
        with self._lock:
            self._saved[i] = (lo, hi)

    def reserved(self, i: int) -> bool:
        """Whether unit ``i`` has a copy buffer (``reserve`` succeeded for it)."""
        with self._lock:
            return i in self._buffers

    def has(self, i: int) -> bool:
        with self._lock:
            return i in self._saved

    def restore_master(self, i: int, master: torch.Tensor) -> None:
        lo, hi = self._saved[i]
        master[lo:hi].copy_(self._buffers[i][:hi - lo])

    def restore_moments(self, i: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        lo, hi = self._saved[i]
        n = hi - lo
        exp_avg[lo:hi].copy_(self._buffers[i][n:2 * n])
        exp_avg_sq[lo:hi].copy_(self._buffers[i][2 * n:3 * n])

    def forget(self, i: int) -> None:
        with self._lock:
            self._saved.pop(i, None)

    def clear(self) -> None:
        with self._lock:
            self._saved.clear()
