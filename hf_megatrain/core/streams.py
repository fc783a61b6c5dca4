"""Stream and event helpers that degrade to synchronous no-ops on the CPU.

The executor is written once against these: on CUDA it gets a host-to-device stream, a device-to-host stream
and the compute (current) stream ordered by events; on a CPU-only machine every call runs in program order, so
the CPU tests exercise the very same executor code.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class StreamSet:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.is_cuda else None
        self.d2h = torch.cuda.Stream(device) if self.is_cuda else None

    @property
    def compute(self) -> "torch.cuda.Stream | None":
        # The compute stream is whatever stream autograd runs this op on (forward and backward share it).
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def record(self, stream: "torch.cuda.Stream | None", timing: bool = False) -> "torch.cuda.Event | None":
        if stream is None:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    @staticmethod
    def wait(stream: "torch.cuda.Stream | None", event: "torch.cuda.Event | None") -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def synchronize(event: "torch.cuda.Event | None") -> None:
        if event is not None:
            event.synchronize()

    @contextlib.contextmanager
    def on(self, stream: "torch.cuda.Stream | None") -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield
