"""Keep Python's cyclic garbage collector off the serving path.

A process that has imported torch and Ray holds ~200k tracked objects; a full (generation 2) collection
walks all of them and stops every thread for ~100 ms (99 ms measured on the CPU sandbox; the H200 runs
showed 80-170 ms stalls of an on-demand acquire and of prefills that nothing else explains). Almost all
of those objects live as long as the process. ``freeze`` collects once, then moves every object alive
now to the permanent generation, which later collections skip: a full collection then walks only what
was made since (0.6 ms measured). Call it once a long-lived process is built and before it serves.

Frozen objects are never collected, so what is frozen while alive and later dropped in a reference
cycle (an engine's model, say) would stay allocated: whoever freezes for a bounded part of a process's
life (an engine's run) calls ``thaw`` at its end, and a long-lived owner (the worker actor) then freezes
again, which first collects what the finished part left behind.
"""

from __future__ import annotations

import gc
import time
from typing import Any


def freeze() -> int:
    """Collect, then exempt every object alive now from later collections; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Make every frozen object collectable again (the next full collection walks them once more)."""
    gc.unfreeze()


class Pauses:
    """The cyclic collector's pauses in this process while started: how many, their total and the longest.
    A collection stops every thread (it holds the GIL), so a step's share of ``total_ms`` is how long the
    step stood still for it, whichever thread's allocation set it off."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]  # per generation
        self.total_ms = self.longest_ms = 0.0
        self._began: float | None = None

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float]:
        return {"gc_collections": sum(self.collections), "gc_full": self.collections[2],
                "gc_total_ms": self.total_ms, "gc_longest_ms": self.longest_ms}

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            ms = (time.perf_counter() - self._began) * 1e3
            self._began = None
            self.collections[info["generation"]] += 1
            self.total_ms += ms
            self.longest_ms = max(self.longest_ms, ms)
