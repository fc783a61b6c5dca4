"""Jobs: the one way the optimizer runs work in the background -- one thread per queue, jobs in submission order.

The launch's workers (optim/adamw.py: one per worker of the step's units), the speculative updates
(optim/speculative_step.py) and the lean store's layer updates (optim/lean.py) each own a ``Jobs``. Without
``overlap`` a job runs at once in the caller's thread. The threads are not daemons: the interpreter joins them at
exit, so no update is cut off mid-kernel.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


def _done() -> None:
    pass


class Jobs:
    def __init__(self, name: str, overlap: bool) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name) if overlap else None
        self._pending: list[Future] = []

    @property
    def overlapped(self) -> bool:
        """Whether jobs run on a background thread."""
        return self._pool is not None

    def submit(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn`` after the jobs before it; returns a wait() for it (which, like ``sync``, re-raises its
        failure)."""
        if self._pool is None:
            fn()
            return _done
        fut = self._pool.submit(fn)
        self._pending.append(fut)
        return fut.result

    def sync(self) -> bool:
        """Wait for every job submitted so far; re-raise the first failure. Returns whether any was pending."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        return bool(pending)

    def hold(self) -> Callable[[], None]:
        """Keep the thread busy (what is submitted queues) until the returned release() is called; for tests and
        diagnostics. Without overlap: a no-op."""
        gate = threading.Event()
        if self._pool is not None:
            self._pool.submit(gate.wait)
        return gate.set
