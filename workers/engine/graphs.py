"""CUDA graphs of the decode step: one per (batch bucket, KV-length bucket), replayed with refilled inputs.

An eager decode step launches every op of every layer from Python: ~1,000 launches for Llama-3.1-8B,
~20 ms of host time for ~9 ms of GPU work, so the host, not the GPU, bounds a replica's throughput.
A graph replays the same launches in one call. What varies between steps lives in static device
buffers that the graph reads and that each step refills before the replay:

- ``rows`` / ``positions``: each item's KV row and position (one pinned host buffer, copied each step);
- the LoRA op's ``BatchMeta`` (slot of each token, grouped tiles), refilled by ``LoraOp.begin``;
- the slot pool and ``SlotMeta`` the kernels read, written by the cache's loads as they always are.

Shapes are bucketed: the batch is padded to the next of ``decode_buckets`` with items on a scratch KV
row (``pad_row``, one row past the engine's own) at position 0 with no adapter; attention reads
``kv_len`` keys rounded up to a multiple of ``kv_block`` (keys past an item's position are masked, as
in the eager step). The LoRA kernels' grids depend on the padded size only (``BatchMeta.chunk_grid``),
so one graph serves every adapter mix. Each graph is captured after one eager run of its shape (Triton
compiles, cuBLAS and NCCL set up outside the capture), on the compute stream, into one memory pool
shared by all graphs (one replays at a time); ``capture_error_mode="thread_local"`` lets the cache's
loader threads keep copying on their own streams meanwhile. Prefill steps stay eager: their token
counts vary too widely to bucket and their GPU time dwarfs their launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workers.engine.lora import LoraOp
from workers.engine.model import ShardedModel, StepInputs


def decode_buckets(max_running: int) -> tuple[int, ...]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8, and ``max_running`` itself."""
    sizes = {b for b in (1, 2, 4) if b < max_running} | set(range(8, max_running, 8)) | {max_running}
    return tuple(sorted(sizes))


def kv_buckets(max_seq_len: int, kv_block: int) -> tuple[int, ...]:
    """Key counts attention reads: multiples of ``kv_block``, the last one ``max_seq_len``."""
    return tuple(sorted({min(k, max_seq_len) for k in range(kv_block, max_seq_len + kv_block, kv_block)}))


def bucket(sizes: Sequence[int], n: int, what: str) -> int:
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} {n} exceeds the largest decode graph ({sizes[-1]}); raise the engine's bound")


class DecodeGraphs:
    """Captured decode steps of one rank; ``run`` replays the one that fits the batch."""

    def __init__(self, model: ShardedModel, lora: LoraOp, last: torch.Tensor, stream: Any, *, max_running: int,
                 max_seq_len: int, kv_block: int, pad_row: int) -> None:
        """``last``: each KV row's last output, the next decode input (``pad_row`` included);
        ``stream``: the compute stream every capture and replay runs on."""
        self.model, self.lora, self.last, self.stream = model, lora, last, stream
        self.device = last.device
        self.batch_sizes = decode_buckets(max_running)
        self.kv_lens = kv_buckets(max_seq_len, kv_block)
        self.pad_row = pad_row
        top = self.batch_sizes[-1]
        self.rows = torch.full((top,), pad_row, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.index = torch.arange(top, dtype=torch.int64, device=self.device)  # decode: item i's token is row i
        self._host = torch.empty((2, top), dtype=torch.int64, pin_memory=True)
        self._copied: torch.cuda.Event | None = None  # after the last copy out of _host
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def shape_of(self, items: int, kv_len: int) -> tuple[int, int]:
        return bucket(self.batch_sizes, items, "decode batch"), bucket(self.kv_lens, kv_len, "KV length")

    def run(self, rows: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """One decode step of ``len(rows)`` items (KV row, position of the new token, LoRA slot or -1
        each) on the compute stream: the items' final hidden states [items, hidden], a view of the
        graph's output (valid until the next step); ``last`` holds them too, as after an eager step."""
        n = len(rows)
        b, kv = self.shape_of(n, max(positions) + 1)
        self._prepare(rows, positions, slots, b)
        graph, out = self.graphs.get((b, kv)) or self._capture(b, kv)
        graph.replay()
        return out[:n]

    def capture_all(self) -> None:
        """Capture every bucket now (warm-up, before the clock) rather than at first use."""
        for b in self.batch_sizes:
            for kv in self.kv_lens:
                if (b, kv) not in self.graphs:
                    self._prepare([], [], [], b)
                    self._capture(b, kv)

    def _prepare(self, rows: Sequence[int], positions: Sequence[int], slots: Sequence[int], b: int) -> None:
        """A ``b``-bucket's inputs: the items' rows and positions (pads: scratch row, position 0) from one
        pinned buffer, and their LoRA slots (pads: no adapter)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer (it has by now)
        n = len(rows)
        host = self._host.numpy()
        host[0, :n], host[0, n:b] = rows, self.pad_row
        host[1, :n], host[1, n:b] = positions, 0
        with torch.cuda.stream(self.stream):
            self.rows[:b].copy_(self._host[0, :b], non_blocking=True)
            self.positions[:b].copy_(self._host[1, :b], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self.stream)
        self.lora.begin(list(slots) + [-1] * (b - n), [1] * b, prefill=False, stream=self.stream, always=True)

    def _capture(self, b: int, kv: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        with torch.cuda.stream(self.stream):
            self._body(b, kv)  # eager first: kernels compiled, libraries set up, outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = self._body(b, kv)
        self.graphs[b, kv] = graph, out
        return graph, out

    def _body(self, b: int, kv: int) -> torch.Tensor:
        rows, positions = self.rows[:b], self.positions[:b]
        step = StepInputs(False, (), positions, rows, self.index[:b], kv)
        out = self.model.forward(self.last.index_select(0, rows), step)
        self.last.index_copy_(0, rows, out)
        return out
