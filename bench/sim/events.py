"""Simulated time: an event heap and one-shot signals. No wall clock anywhere.

Events at the same time run in the order they were scheduled (a sequence number breaks ties), and
nothing iterates a set or a hash, so a run is a function of its inputs: same seed, same records.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class SimulationStuck(RuntimeError):
    """Simulated time stopped: events keep running at one instant (a livelock), so the run would never end."""


class Loop:
    """The event heap and the simulated clock ``now`` (seconds). ``max_same_instant``: events that may run
    at one simulated time before the run is declared stuck (``SimulationStuck``) instead of spinning forever."""

    def __init__(self, max_same_instant: int = 1_000_000) -> None:
        self.max_same_instant = max_same_instant
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
        heap, same = self._heap, 0
        while heap and not done():
            t, _, fn, args = heapq.heappop(heap)
            same = same + 1 if t == self.now else 0
            if same > self.max_same_instant:
                raise SimulationStuck(f"{same} events at t={t:.6f} s without time moving on (the last: "
                                      f"{getattr(fn, '__qualname__', fn)}): a livelock in the simulated fleet")
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
