"""HostTimeline: host-side timestamps of a megatrain step's phases, without the profiler.

The profiled step of the benchmark is not a timed step: the profiler slows the host threads, which changes how the
overlapped optimizer meets the next forward. This records, for ordinary steps, when the forward, the backward and
``optimizer.step()`` run on the main thread, when each unit's AdamW finishes (worker threads), how long the
forward waited for it, and how long the step clock's device synchronisation took. Only method wrappers and
``time.perf_counter``: no device syncs of its own.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class HostTimeline:
    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []  # (t, thread, what)
        self.steps: list[list[tuple[float, str, str]]] = []
        self._undo: list[Callable[[], None]] = []
        self._t0 = time.perf_counter()

    def note(self, what: str) -> None:
        self.events.append((time.perf_counter(), threading.current_thread().name, what))

    @contextmanager
    def span(self, what: str) -> Iterator[None]:
        self.note(what + ">")
        try:
            yield
        finally:
            self.note("<" + what)

    def wrap(self, owner: Any, name: str, label: str | None = None,
             describe: Callable[..., str] | None = None) -> None:
        """Record entry and exit of ``owner.name`` (a class or an instance attribute)."""
        orig = getattr(owner, name)
        label = label or name

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            what = label + (describe(*args, **kwargs) if describe else "")
            with self.span(what):
                return orig(*args, **kwargs)

        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, orig))

    def wrap_slow(self, owner: Any, name: str, label: str | None = None, min_ms: float = 1.0) -> None:
        """Like ``wrap``, for calls made often (syncs, ``.item()``): only calls of at least ``min_ms`` recorded."""
        orig = getattr(owner, name)
        label = label or name

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                if (time.perf_counter() - t) * 1e3 >= min_ms:
                    th = threading.current_thread().name
                    self.events += [(t, th, label + ">"), (time.perf_counter(), th, "<" + label)]

        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, orig))

    def sample_stack(self, owner: Any, name: str, after_ms: tuple[float, ...]) -> None:
        """While ``owner.name`` runs, record the calling thread's Python stack ``after_ms`` into the call (what a
        thread blocked in a C call is inside of)."""
        import sys
        import traceback

        orig = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            ident = threading.get_ident()
            done = threading.Event()

            def sample() -> None:
                t0 = time.perf_counter()
                for ms in after_ms:
                    if done.wait(max(0.0, ms / 1e3 - (time.perf_counter() - t0))):
                        return
                    frame = sys._current_frames().get(ident)
                    if frame is not None:
                        stack = traceback.format_stack(frame)[-8:]
                        self.note("stack@%g ms: " % ms + " | ".join(line.strip().replace("\n", " ")[:300]
                                                                  for line in stack))

            threading.Thread(target=sample, daemon=True).start()
            try:
                return orig(*args, **kwargs)
            finally:
                done.set()

        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, orig))

    def cut(self) -> None:
        """End of a step: keep its events, relative (ms) to the previous cut."""
        t0 = self._t0
        self.steps.append([(round((t - t0) * 1e3, 2), th, w) for t, th, w in self.events])
        self.events = []
        self._t0 = time.perf_counter()

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def summary(self, keep: int = 2) -> dict[str, Any]:
        """Every step's main-thread spans (ms: the first steps show what a compile or a first update costs) and
        the last ``keep`` steps' events."""
        out = []
        for k, ev in enumerate(self.steps):
            spans: dict[str, float] = {}
            open_: dict[tuple[str, str], float] = {}
            for t, th, w in ev:
                if w.endswith(">"):
                    open_[(th, w[:-1])] = t
                elif w.startswith("<") and (th, w[1:]) in open_:
                    key = w[1:].split("[")[0]
                    spans[key] = round(spans.get(key, 0.0) + t - open_.pop((th, w[1:])), 2)
            out.append({"spans_ms": spans, **({"events": ev} if k >= len(self.steps) - keep else {})})
        return {"steps": out}
