"""``BoundedLRU``: a small map bounded by its number of entries, oldest evicted first, safe across threads.

Why a class and not ``functools.lru_cache``: the caches of the read path are not memoized functions. Their
entries are written by one path and read by another (a revalidated file identity is stored after a check and
read at the next open; a pinned version's CRCs are stored by the read that pinned them or loaded from disk),
some are stored only when a condition holds (a share of a plan only when no chunk has block checks), some keep
their keys' objects alive beside the value (plans keyed by ``id``), and some values are sets that grow in
place. ``lru_cache`` can only cache a function's return for its arguments, and cannot be written to, peeked
at, emptied of one key or asked for its entries. ``cachetools`` could, but it takes no lock of its own and is
not a dependency; this is forty lines.

Order: ``get`` makes a hit the newest; ``peek`` does not; ``put`` inserts a new key as the newest and, for a
key already there, replaces its value in its place unless ``refresh`` (the caches keep the order they had
before they shared this class).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """At most ``limit`` entries; past it, the oldest go. Every call takes the lock, so none sees a half update."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be at least 1")
        self.limit = limit
        self._lock = threading.Lock()  # protects _entries
        self._entries: OrderedDict[K, V] = OrderedDict()  # oldest first

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the newest), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def peek(self, key: K) -> V | None:
        """The value of ``key``, or None; the order is left as it is."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: K, value: V, *, refresh: bool = True) -> None:
        """Store ``value``: a new key as the newest; a key already there keeps its place unless ``refresh``."""
        with self._lock:
            self._entries[key] = value
            if refresh:
                self._entries.move_to_end(key)
            self._trim()

    def get_or_create(self, key: K, make: Callable[[], V], *, refresh: bool = True) -> V:
        """The value of ``key``, made by ``make()`` (under the lock: made once) if absent; then the newest if
        ``refresh``."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                value = self._entries[key] = make()
            if refresh:
                self._entries.move_to_end(key)
            self._trim()
            return value

    def pop(self, key: K) -> V | None:
        with self._lock:
            return self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def items(self) -> list[tuple[K, V]]:
        """A copy of the entries, oldest first."""
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._entries) <= self.limit, f"{len(self._entries)} entries over the limit {self.limit}"
            assert None not in self._entries.values(), "a None value (get could not tell it from a miss)"

    def _trim(self) -> None:
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)
