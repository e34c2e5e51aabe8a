"""Layer-pipelined LoRA: the compute stream waits, layer by layer, only on the chunk that holds the layer.

Under an admission rule that says so (``pipelined``), ``WorkerCache.acquire(..., pipelined=True)`` does
not wait for whole adapters: a batch's loads still in flight come back as ``ChunkWaits``, and the LoRA
op of layer l calls ``before(l)``, which makes the compute stream wait (a stream wait, never a host sync)
on the event of the chunk holding layer l of each such load (``lora_cache.adapters.chunks``; lifecycle steps 6
and 9). The host waits only where a chunk's copy is not issued yet, i.e. for its disk read. ``finish``
waits on every load's last chunk: the step ends with its adapters whole, so a decode step (a CUDA graph)
never meets a partial one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.gpu.copies import SlotLoad


class ChunkWaits:
    """The per-layer waits of one batch's loads in flight; use it for one step, on the compute stream."""

    def __init__(self, streams: Any, loads: Sequence[SlotLoad]) -> None:
        self.streams = streams
        self.loads = tuple(loads)
        self._waited = [-1] * len(self.loads)  # highest chunk of each load the compute stream waits on

    def before(self, layer: int) -> None:
        """Before layer ``layer``'s LoRA op: wait on each load's chunk that holds it (and so on all before)."""
        for i, load in enumerate(self.loads):
            self._wait(i, load.plan.chunk_of(layer))

    def finish(self) -> None:
        """Wait on every load's last chunk (after the step's last layer, before release or a decode graph)."""
        for i, load in enumerate(self.loads):
            self._wait(i, len(load.plan.chunks) - 1)

    def _wait(self, i: int, chunk: int) -> None:
        if chunk > self._waited[i]:
            self.streams.compute_wait(self.loads[i].chunk_event(chunk))  # raises LoadFailed if it never comes
            self._waited[i] = chunk
