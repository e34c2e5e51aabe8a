"""A rank's warm stages (lifecycle step 5 ahead of demand): speculative reads that never delay a needed one.

The controller's warm placement (``lora_cache/planner/warming.py``) sends each rank speculative ``Stage``
commands: adapters to read into its host tier with idle store bandwidth. ``WarmQueue`` holds them in the
order sent and reads them one at a time, starting the next only while the host tier has no other read in
flight or waiting (a load's, or a needed stage's): a read for a waiting request never queues behind a
speculative one, and a demand read that arrives meanwhile shares the store with at most one warm shard read
(the shard boundary is where a warm read yields). An operator's read rate limit (``rate_bytes_per_s``: object
stores bill and throttle) paces the warm reads alone (a token bucket of one second's bytes); demand reads are
never held back by it. The queue is bounded (``max_queued``, oldest dropped: the controller sends them again
at its next warm assignment) and a key already queued is not queued twice.

Plain Python with a driver thread: ``start`` begins one stage (``WorkerCache.stage``: a future, or None when
nothing was read) and ``busy`` says whether other reads are in flight; the thread wakes on ``offer``, on a
warm read's end, and every ``poll_s`` while others are busy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from lora_cache.vocab import AdapterKey

log = logging.getLogger(__name__)

Start = Callable[[str, str], "Future[Any] | None"]


class WarmQueue:
    """Speculative stages, read one at a time while the host tier is otherwise idle (the module's docstring)."""

    def __init__(self, start: Start, busy: Callable[[], bool], nbytes: Callable[[str, str], int],
                 rate_bytes_per_s: float = 0.0, max_queued: int = 4096, poll_s: float = 0.01,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._start, self._busy, self._nbytes, self._clock = start, busy, nbytes, clock
        self.rate, self.max_queued, self.poll_s = rate_bytes_per_s, max_queued, poll_s
        self._lock = threading.Condition()  # protects _queued, _reading, _tokens, _stamp, _closed, the counters
        self._queued: OrderedDict[AdapterKey, None] = OrderedDict()  # in the order sent, oldest first
        self._reading: AdapterKey | None = None  # the warm read in flight (one at a time)
        self._tokens = rate_bytes_per_s  # the rate limit's bucket (one second's bytes at most)
        self._stamp = clock()
        self._closed = False
        self.started = self.dropped = self.failed = 0
        self.held = 0  # looks at the queue that found another read in flight (or the rate limit spent)
        self._thread = threading.Thread(target=self._run, name="lora-warm", daemon=True)
        self._thread.start()

    def offer(self, name: str, version: str) -> None:
        """Queue a warm stage (idempotent while queued or in flight)."""
        key = AdapterKey(name, version)
        with self._lock:
            if key == self._reading or key in self._queued:
                return
            self._queued[key] = None
            while len(self._queued) > self.max_queued:
                self._queued.popitem(last=False)
                self.dropped += 1
            self._lock.notify()

    def holds(self, key: AdapterKey) -> bool:
        """Whether ``key``'s stage is queued or in flight."""
        with self._lock:
            return key == self._reading or key in self._queued

    def pending(self) -> int:
        with self._lock:
            return len(self._queued) + (self._reading is not None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queued.clear()
            self._lock.notify()
        self._thread.join(timeout=5.0)

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._queued) <= self.max_queued, "more warm stages queued than the bound"
            assert self._reading not in self._queued, "a warm stage both queued and in flight"

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (self._reading is not None or not self._queued):
                    self._lock.wait()
                if self._closed:
                    return
                key = next(iter(self._queued))
            if self._busy() or not self._take_tokens(key):
                with self._lock:
                    self.held += 1
                    self._lock.wait(self.poll_s)  # another read is in flight, or the rate limit: look again soon
                continue
            self._begin(key)

    def _begin(self, key: AdapterKey) -> None:
        with self._lock:
            if self._closed or key not in self._queued:
                return
            del self._queued[key]
            self._reading = key
            self.started += 1
        try:
            future = self._start(key.name, key.version)
        except Exception as e:  # an adapter unregistered since, a version gone: this stage only
            log.info("warm stage of %s@%s not started: %s", key.name, key.version, e)
            future = None
            with self._lock:
                self.failed += 1
        if future is None:
            self._done(key)
        else:
            future.add_done_callback(lambda _: self._done(key))

    def _done(self, key: AdapterKey) -> None:
        with self._lock:
            if self._reading == key:
                self._reading = None
            self._lock.notify()

    def _take_tokens(self, key: AdapterKey) -> bool:
        """Whether the rate limit lets ``key``'s shard be read now (always, without a limit). The bucket may go
        into debt by one shard (a shard larger than a second's bytes is read whole), which the next waits out:
        over time warm reads move at most ``rate`` bytes per second."""
        if self.rate <= 0:
            return True
        with self._lock:
            now = self._clock()
            self._tokens = min(self.rate, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if self._tokens < 0:
                return False
        try:
            need = self._nbytes(key.name, key.version)
        except Exception:  # unknown now: _begin reports it
            need = 0
        with self._lock:
            self._tokens -= need
        return True
