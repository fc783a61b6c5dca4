"""Progress of long work, shown as transformers shows its own (loading shards): a tqdm bar of bytes and their rate.

Converting a model, ``from_pretrained_streamed``, checkpoint saves, verification and loads move tens to thousands of
GB (a 70B checkpoint: about 14 minutes) and print nothing otherwise. ``byte_progress`` opens one bar for one such
piece of work, in bytes (binary units) with the rate, on stderr, made by ``transformers.utils.logging.tqdm``: the
switch that silences transformers' own bars (``transformers.utils.logging.disable_progress_bar()``, or huggingface
hub's HF_HUB_DISABLE_PROGRESS_BARS read by those libraries) and a hook a user set there apply to these bars too.

Quiet when
- the caller says so (``enabled=False``: ``TrainingArguments.disable_tqdm``, a process other than the one that
  does the work): the policy is the caller's, this module reads no environment;
- transformers' progress bars are off;
- stderr is not a terminal (tqdm's ``disable=None``): a batch job's log gets no carriage-return lines;
- there is nothing to move (a total of 0 bytes: converting a model whose weights are still on the meta device).

The bytes of one piece of work are announced with ``expect`` (at once, or by a step that learns them only when it
has planned its reads: ``checkpoint.read_into``) and counted with ``add`` from any reader or writer thread; the
bar appears with the first bytes announced.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch
from transformers.utils import logging as hf_logging

__all__ = ["Progress", "byte_progress", "progress_over", "tensor_bytes"]

T = TypeVar("T")


class Progress:
    """One bar of bytes. ``expect(n)`` announces ``n`` more bytes of work, ``add(n)`` counts ``n`` done; both are
    safe to call from several threads, and free (no lock, no bar) when the bar is off."""

    def __init__(self, desc: str, *, enabled: bool = True) -> None:
        self.desc = desc
        self.enabled = enabled
        self.total = 0
        self._bar = None
        self._lock = threading.Lock()  # (tqdm's counter is not atomic: several reader / writer threads add)

    def expect(self, nbytes: int) -> None:
        if not self.enabled or nbytes <= 0:
            return
        with self._lock:
            self.total += nbytes
            if self._bar is None:
                # disable=None: tqdm stays silent where stderr is not a terminal.
                self._bar = hf_logging.tqdm(total=self.total, desc=self.desc, unit="B", unit_scale=True,
                                            unit_divisor=1024, disable=None, dynamic_ncols=True)
            else:
                self._bar.total = self.total
                self._bar.refresh()

    def add(self, nbytes: int) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bar.update(nbytes)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


@contextlib.contextmanager
def byte_progress(desc: str, total: int = 0, *, enabled: bool = True) -> Iterator[Progress]:
    """A ``Progress`` bar for the ``with`` block, ``total`` bytes announced (more may follow: ``expect``); closed
    at the end (on an error too: the bar stops where the work stopped)."""
    progress = Progress(desc, enabled=enabled)
    try:
        progress.expect(total)
        yield progress
    finally:
        progress.close()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as stored (those on the meta device hold none)."""
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def progress_over(items: Sequence[T], desc: str, nbytes: Callable[[T], int], *, enabled: bool = True) -> Iterator[T]:
    """``items`` one by one, with a bar of their bytes: ``nbytes(item)`` is measured for all of them first (the
    loop may free what it measured: a converted layer goes to the meta device) and counted once the loop's body
    for that item has run."""
    sizes = [nbytes(item) for item in items]
    with byte_progress(desc, sum(sizes), enabled=enabled) as progress:
        for item, n in zip(items, sizes):
            yield item
            progress.add(n)
