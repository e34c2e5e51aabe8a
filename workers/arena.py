"""A bounded arena of (pinned) host memory, allocated once; first-fit blocks with coalescing.

Pinning per load is slow (ARCHITECTURE: keep pinned buffers in an arena), so the host tier allocates
one buffer at start and hands out aligned byte ranges of it. A ``shared`` arena is a ``memfd`` that
reader processes map too (``workers.reader_proc``), pinned in place with ``cudaHostRegister``.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
from typing import NamedTuple

import torch

ALIGN = 128


class Block(NamedTuple):
    offset: int
    nbytes: int


class HostArena:
    """Byte ranges of one host buffer. Not thread-safe: the host tier's lock guards it."""

    def __init__(self, capacity: int, pin: bool, shared: bool = False) -> None:
        self.capacity = capacity
        self.pinned = pin and torch.cuda.is_available()
        self.fd: int | None = None  # the memfd of a shared arena
        self._registered = False
        if shared:
            self.fd = os.memfd_create("lora-host-arena", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, capacity)
            self.buffer = torch.frombuffer(mmap.mmap(self.fd, capacity), dtype=torch.uint8)
            if self.pinned:
                code = int(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), capacity, 0))
                if code != 0:
                    self.close()
                    raise RuntimeError(f"pinning the {capacity}-byte shared host arena failed (cudaError {code}); "
                                       "lower host_bytes or the locked-memory limit (ulimit -l), or use thread reads")
                self._registered = True
        else:
            self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pinned)
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (offset, size) of free ranges
        self._used: dict[int, int] = {}  # offset -> size of handed-out blocks

    def alloc(self, nbytes: int) -> Block | None:
        """First fit, or None if no free range is large enough."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                self._used[off] = size
                return Block(off, size)
        return None

    def free(self, block: Block) -> None:
        size = self._used.pop(block.offset)
        i = bisect.bisect(self._free, (block.offset, 0))
        self._free.insert(i, (block.offset, size))
        if i + 1 < len(self._free) and block.offset + size == self._free[i + 1][0]:  # merge the next range
            self._free[i : i + 2] = [(block.offset, size + self._free[i + 1][1])]
        if i > 0 and sum(self._free[i - 1]) == self._free[i][0]:  # merge into the previous range
            (a, sa), (_, sb) = self._free[i - 1], self._free[i]
            self._free[i - 1 : i + 1] = [(a, sa + sb)]

    def view(self, block: Block, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.buffer[block.offset : block.offset + numel * dtype.itemsize].view(dtype)

    def close(self) -> None:
        """Unpin and let go of a shared arena (its memory goes when the last mapping does)."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def check_integrity(self) -> None:
        spans = sorted([*self._free, *self._used.items()])
        assert sum(s for _, s in spans) == self.capacity, "free + used bytes != capacity"
        for (a, sa), (b, _) in itertools.pairwise(spans):
            assert a + sa == b, f"gap or overlap at {a + sa} vs {b}"
        for (a, sa), (b, _) in zip(self._free, self._free[1:]):
            assert a + sa < b, f"free ranges at {a} and {b} were not coalesced"
