"""A bounded arena of (pinned) host memory, allocated once; first-fit blocks with coalescing.

Pinning per load is slow (ARCHITECTURE: keep pinned buffers in an arena), so the host tier allocates
one buffer at start and hands out aligned byte ranges of it. A ``shared`` arena is a ``memfd`` that
reader processes map too (``workers.reads.processes``), pinned in place with ``cudaHostRegister``.

Pinning a large shared arena takes seconds (``cudaHostRegister`` faults in and locks every page: 6-9 s for
16 GiB on an H100 host, bench/RESULTS.md issue 30), so with ``background`` it runs on a thread of its own
while the worker starts (its engine warms up, reads fill the arena: pinning keeps the bytes) and the first
host-to-GPU copy waits for it (``when_pinned``): a copy never reads the arena while it is being registered.
On the CPU the same thread populates the mapping's pages (``MADV_POPULATE_WRITE``, no byte changed), the
CPU's share of that cost. Pinning that fails leaves the arena pageable (copies are correct, slower) and says
why in ``pin_error``.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from lora_cache.vocab import AdapterKey
from workers import faults

log = logging.getLogger(__name__)
ALIGN = 128
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a mapping's pages in, writable, without changing a byte
PIN_KEY = AdapterKey("arena", "")  # the fault point "pin_arena" is armed for adapter name "arena"


class Block(NamedTuple):
    offset: int
    nbytes: int


class HostArena:
    """Byte ranges of one host buffer. Not thread-safe: the host tier's lock guards it."""

    def __init__(self, capacity: int, pin: bool, shared: bool = False, background: bool = False) -> None:
        """``background`` (a shared arena): pin on a thread of its own; copies wait for it (``when_pinned``)."""
        self.capacity = capacity
        self.pinned = pin and torch.cuda.is_available()
        self.fd: int | None = None  # the memfd of a shared arena
        self._registered = False
        self.pin_error = ""  # why pinning failed (the arena stays pageable), "" if it did not
        self.pin_s = 0.0  # how long pinning (on the CPU: populating) took
        self._pin_lock = threading.Lock()  # protects _pin_done and _after_pin
        self._pin_done = True
        self._after_pin: list[Callable[[], None]] = []  # run once pinning ends (when_pinned)
        self._pin_thread: threading.Thread | None = None
        if shared:
            self.fd = os.memfd_create("lora-host-arena", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, capacity)
            self._map = mmap.mmap(self.fd, capacity)
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
            if background:
                self._pin_done = False
                device = torch.cuda.current_device() if self.pinned else None
                self._pin_thread = threading.Thread(target=self._pin, args=(device,), name="lora-arena-pin",
                                                    daemon=True)
                self._pin_thread.start()
            elif self.pinned:
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

    def _pin(self, device: int | None) -> None:
        """The pinning thread: register the arena (on the CPU: populate it), then run what waited for it."""
        t0 = time.perf_counter()
        try:
            faults.hit("pin_arena", PIN_KEY)  # a test holds the pinning here
            if device is not None:
                torch.cuda.set_device(device)  # the device the arena was made for (this thread's own is 0)
                code = int(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.capacity, 0))
                if code != 0:
                    self.pin_error = (f"pinning the {self.capacity}-byte shared host arena failed (cudaError {code}): "
                                      "it stays pageable (copies from it are slower); lower host_bytes or raise the "
                                      "locked-memory limit (ulimit -l)")
                    log.error(self.pin_error)
                else:
                    self._registered = True
            else:
                # through ctypes, which lets go of the GIL (mmap.madvise holds it: the worker would stop meanwhile);
                # a kernel before 5.14 refuses the advice: the pages then fault in as they are first touched
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise(ctypes.c_void_p(self.buffer.data_ptr()), ctypes.c_size_t(self.capacity),
                             MADV_POPULATE_WRITE)
        except BaseException as e:  # never leave a copy waiting: it runs on the pageable arena
            self.pin_error = f"pinning the host arena failed ({type(e).__name__}: {e}); it stays pageable"
            log.exception("pinning the host arena failed")
        finally:
            self.pin_s = time.perf_counter() - t0
            with self._pin_lock:
                self._pin_done = True
                waiting, self._after_pin = self._after_pin, []
            for then in waiting:
                try:
                    then()
                except Exception:  # one broken waiter must not keep the others waiting
                    log.exception("a copy waiting for the host arena's pinning failed")

    @property
    def pin_pending(self) -> bool:
        """Whether the arena is still being pinned in the background."""
        with self._pin_lock:
            return not self._pin_done

    @property
    def pin_waiters(self) -> int:
        """Calls waiting for the background pinning (``when_pinned``)."""
        with self._pin_lock:
            return len(self._after_pin)

    def when_pinned(self, then: Callable[[], None]) -> None:
        """Run ``then`` once the arena's pinning has ended: now, on this thread, if it has (or never ran);
        else on the pinning thread when it ends (even if it failed: the arena is then pageable)."""
        with self._pin_lock:
            if not self._pin_done:
                self._after_pin.append(then)
                return
        then()

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until the background pinning has ended (start-up and tests only); False on a timeout."""
        thread = self._pin_thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

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
        """Unpin and let go of a shared arena (its memory goes when the last mapping does); a pinning still
        under way is waited for first (the pages must stay mapped while it registers them)."""
        self.wait_pinned()
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
