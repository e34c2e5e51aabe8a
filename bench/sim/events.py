"""Simulated time: an event heap and one-shot signals. No wall clock anywhere.

Events at the same time run in the order they were scheduled (a sequence number breaks ties), and
nothing iterates a set or a hash, so a run is a function of its inputs: same seed, same records.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Loop:
    """The event heap and the simulated clock ``now`` (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # events run so far
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``t`` (never in the past)."""
        assert t >= self.now, f"event at {t} is before now ({self.now})"
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, done: Callable[[], bool]) -> None:
        """Run events in time order until ``done()`` or none are left."""
        heap = self._heap
        while heap and not done():
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)


class Signal:
    """Fires once, at a simulated time, ok or failed; callbacks run when it fires (at once if it has)."""

    __slots__ = ("_callbacks", "done", "ok", "time")

    def __init__(self) -> None:
        self.done = False
        self.time = 0.0  # when it fired (valid once done)
        self.ok = True
        self._callbacks: list[Callable[[Signal], None]] = []

    def fire(self, time: float, ok: bool = True) -> None:
        assert not self.done, "a signal fires once"
        self.done, self.time, self.ok = True, time, ok
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def then(self, callback: Callable[[Signal], None]) -> None:
        if self.done:
            callback(self)
        else:
            self._callbacks.append(callback)
