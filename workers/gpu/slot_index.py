"""Per-batch slot indices on the device: filled on the host in one pass, one non-blocking copy.

A small ring of (pinned host, device) buffer pairs lets the host fill batch N+1 while batch N's copy
is still queued; the host waits only if it laps the ring (the GPU is that many steps behind).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workers.gpu.streams import CpuStreams


class IndexUploader:
    def __init__(self, streams: CpuStreams, max_batch: int, device: torch.device, ring: int = 8) -> None:
        pin = device.type == "cuda"
        self.streams = streams
        self.host = [torch.empty(max_batch, dtype=torch.int32, pin_memory=pin) for _ in range(ring)]
        self.dev = [torch.empty(max_batch, dtype=torch.int32, device=device) for _ in range(ring)]
        self.copied: list[Any] = [None] * ring  # compute-stream event after each buffer's last copy
        self._next = 0

    def upload(self, slots: Sequence[int]) -> torch.Tensor:
        i, n = self._next, len(slots)
        self._next = (i + 1) % len(self.host)
        if self.copied[i] is not None and not self.streams.done(self.copied[i]):
            self.copied[i].synchronize()  # lapped the ring: the GPU is len(ring) steps behind
        self.host[i].numpy()[:n] = slots
        self.streams.upload(self.host[i][:n], self.dev[i][:n])
        self.copied[i] = self.streams.record_compute()
        return self.dev[i][:n]
