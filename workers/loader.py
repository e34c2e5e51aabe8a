"""Slot loads in flight and the completion watcher that turns finished copies into readiness records.

Lifecycle step 7: a slot becomes READY only when its copy's ``ready_event`` has completed; the watcher
polls events (``query()``, never a blocking sync) on its own thread and hands each finished load back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lora_cache.planner.records import AdapterKey
from lora_cache.shards import ShardLayout
from workers.streams import CpuStreams

log = logging.getLogger(__name__)


class ReadinessRecord(NamedTuple):
    """What a worker reports to the controller when a shard became READY (lifecycle step 7)."""

    adapter: str
    version: str
    tp_rank: int
    slot: int
    disk_ms: float  # disk -> pinned host staging (0 on a host-tier hit)
    h2d_ms: float  # the one host -> GPU copy, by events
    ready_ms: float  # from the request to load until READY
    nbytes: int
    host_hit: bool


@dataclass(eq=False)
class SlotLoad:
    """One adapter's load: staged on the host, then copied into ``slot``."""

    key: AdapterKey
    layout: ShardLayout
    t0: float = field(default_factory=time.perf_counter)
    future: Future[ReadinessRecord] = field(default_factory=Future)
    issued: threading.Event = field(default_factory=threading.Event)  # set once the copy is issued or failed
    slot: int = -1
    host_hit: bool = False
    disk_ms: float = 0.0
    start_event: Any = None
    ready_event: Any = None
    prefetched: bool = True  # started ahead of need (prefetch), not by an acquire that missed
    used: bool = False  # some batch acquired it (prefetch accuracy: used before eviction)


class CompletionWatcher:
    """Polls the ready events of issued copies; calls ``on_done(load)`` for each that completed."""

    def __init__(self, streams: CpuStreams, on_done: Callable[[SlotLoad], None], poll_s: float = 50e-6,
                 max_poll_s: float = 500e-6) -> None:
        # Polling backs off from poll_s to max_poll_s while nothing completes: each wake-up takes the GIL
        # from the engine's launching thread, and a load lasts 0.5-6 ms anyway.
        self.streams, self.on_done, self.poll_s, self.max_poll_s = streams, on_done, poll_s, max_poll_s
        self._cond = threading.Condition()  # protects _pending and _closed
        self._pending: list[SlotLoad] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lora-ready-watcher", daemon=True)
        self._thread.start()

    def add(self, load: SlotLoad) -> None:
        with self._cond:
            self._pending.append(load)
            self._cond.notify()

    def _run(self) -> None:
        pause = self.poll_s
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
                done = [ld for ld in self._pending if self.streams.done(ld.ready_event)]
                self._pending = [ld for ld in self._pending if ld not in done]
            for load in done:
                self._deliver(load)
            pause = self.poll_s if done else min(pause * 2, self.max_poll_s)
            if not done:
                time.sleep(pause)

    def _deliver(self, load: SlotLoad) -> None:
        try:
            self.on_done(load)
        except Exception:  # a broken readiness consumer must not stop later loads from becoming READY
            log.exception("readiness handler failed for %s", load.key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
