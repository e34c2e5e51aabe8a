"""Rank 0 of a streaming run: an arriving request's adapter pinned if READY here, else its load started at once
(``Feed.watch`` calls ``arrived`` from the submitting thread), not at the next round, which may be a whole step
later; the pins are let go once the round that takes the requests holds what it wants."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.errors import LoraCacheError
from lora_cache.vocab import AdapterKey
from workers.attach.seam import EngineCache
from workers.gpu.acquire import AdapterRef, Batch


class Arrivals:
    """What ``RankEngine`` pins or loads at arrival. ``index()``: the version exchange's names now; ``prefetching``:
    whether the admission rule prefetches (else arrivals do nothing)."""

    def __init__(self, cache: EngineCache, catalog: AdapterCatalog, index: Callable[[], dict[str, int]],
                 num_slots: int, prefetching: bool) -> None:
        self.cache, self.catalog, self.index, self.num_slots, self.prefetching = (cache, catalog, index, num_slots,
                                                                                  prefetching)
        self._lock = threading.Lock()  # protects everything below (``arrived`` runs on the feed's thread)
        self._wanted: tuple[AdapterRef, ...] = ()  # the last plan's wanted (pinned or loading by the rounds)
        self._arrivals: dict[str, None] = {}  # adapters pinned or loaded at arrival, not yet taken over
        self._pins: list[Batch] = []  # their pins (READY at arrival)
        self._taken_pins: list[Batch] = []  # pins of arrivals the scheduler has taken: released next execute
        self._closed = False

    def arrived(self, requests: Iterable[Any]) -> None:
        """Requests were just submitted (``Feed.watch``): for each one's adapter, pin it if it is READY here (no
        load placed before the round that takes the request may evict it), else start its load now, not at
        the next round (up to a whole step later). Only for rules that prefetch; the load only while the
        adapters the last plan wants plus those taken at arrival are fewer than the slots (``Scheduler._wanted``'s cap).
        A load started here that fails is started (and reported) again by the round that wants it; the
        version loaded is the catalog's current one, the one a round's prefetch of a new request loads."""
        if not self.prefetching:
            return
        with self._lock:
            if self._closed:
                return
            wanted = {r.name if isinstance(r, AdapterKey) else r for r in self._wanted}
            for request in requests:
                name = request.adapter
                if (name is None or name in wanted or name in self._arrivals
                        or (name not in self.index() and name not in self.catalog)):  # unregistered: fails at the take
                    continue
                room = len(wanted) + len(self._arrivals) < self.num_slots
                self._arrivals[name] = None
                pin = self.cache.acquire_ready((name,))
                if pin is not None:
                    self._pins.append(pin)
                    continue
                if not room:
                    continue
                with contextlib.suppress(LoraCacheError):  # e.g. the host tier full right now: the round retries
                    self.cache.prefetch(name)

    def taken(self) -> None:
        """Rank 0 is about to take the requests submitted so far: their arrival pins go at the next
        ``execute``, once that round's own pins hold what it wants (later arrivals keep theirs a round more)."""
        with self._lock:
            self._taken_pins += self._pins
            self._pins = []
            self._arrivals.clear()

    def release_taken(self, wanted: tuple[AdapterRef, ...]) -> None:
        with self._lock:
            self._wanted = wanted
            pins, self._taken_pins = self._taken_pins, []
        for pin in pins:
            self.cache.release(pin)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pins, self._taken_pins, self._pins = self._taken_pins + self._pins, [], []
        for pin in pins:
            self.cache.release(pin)
