"""Fault points: named places on the load path where a test stops a worker mid-operation (like etcd's
gofail failpoints), so that a fault (a killed process) lands at an exact moment, never after a sleep.

Nothing is armed in normal operation: ``hit`` is one dict lookup. A test arms a point in a worker's
process (``WorkerActor.arm_fault``) with a ``Gate``: the load that reaches the point tells the gate it
arrived, then waits until the gate is released (or the process is killed there).

Points (lifecycle steps 5-6):
  ``mid_read``: a read in this process (reader threads; not a reader process) has the file open, its identity
  and header checked, and has read nothing yet: a change to the file now lands mid-read.
  ``before_copy``: the shard is staged in the host tier; no slot is taken, the copy is not issued.
  ``pin_arena``: (adapter name ``arena``) the host arena's background pinning is about to start
  (``workers.staging.arena``): nothing may copy from it until it ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from lora_cache.errors import ConfigError
from lora_cache.vocab import AdapterKey

POINTS = ("mid_read", "before_copy", "pin_arena")

_lock = threading.Lock()  # protects _armed
_armed: dict[tuple[str, str], Callable[[AdapterKey], None]] = {}  # (point, adapter name) -> hook


def arm(point: str, adapter: str, hook: Callable[[AdapterKey], None]) -> None:
    """Run ``hook(key)`` (on the loading thread) when a load of ``adapter`` reaches ``point``, once."""
    if point not in POINTS:
        raise ConfigError(f"fault point {point!r} is not one of {POINTS}")
    with _lock:
        _armed[(point, adapter)] = hook


def hit(point: str, key: AdapterKey) -> None:
    if not _armed:
        return
    with _lock:
        hook = _armed.pop((point, key.name), None)
    if hook is not None:
        hook(key)


class Gate:
    """A barrier between a test and a worker's fault point (a Ray actor: ``ray.remote(Gate)``)."""

    def __init__(self) -> None:
        self._arrived = asyncio.Event()
        self._released = asyncio.Event()
        self.key: str = ""

    async def arrive(self, key: str) -> None:
        self.key = key
        self._arrived.set()

    async def wait_arrived(self, timeout_s: float) -> str:
        """The key that arrived; TimeoutError if none did within ``timeout_s``."""
        await asyncio.wait_for(self._arrived.wait(), timeout_s)
        return self.key

    async def release(self) -> None:
        self._released.set()

    async def wait_released(self) -> None:
        await self._released.wait()
