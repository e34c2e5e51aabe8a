"""GPU slot bookkeeping, plain Python: per-slot state, reference counts, LRU of idle ready slots.

A slot is FREE, LOADING (reserved, copy not yet complete) or READY. Eviction takes only READY slots
with no references (invariants 2 and 3); LOADING slots are never handed to another adapter.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import Enum

from lora_cache.errors import SlotsBusyError
from lora_cache.vocab import AdapterKey


class SlotPhase(Enum):
    """Where one GPU slot is in its load (the planner's ``SlotState`` is a rank's view of an adapter, IN_USE too)."""

    FREE = "free"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    index: int
    state: SlotPhase = SlotPhase.FREE
    key: AdapterKey | None = None
    refs: int = 0


class SlotTable:
    """Which adapter each slot holds. Not thread-safe: the worker cache's lock guards it."""

    def __init__(self, num_slots: int) -> None:
        self.slots = [Slot(i) for i in range(num_slots)]
        self._by_key: dict[AdapterKey, int] = {}
        self._free: deque[int] = deque(range(num_slots))
        self._idle: OrderedDict[int, None] = OrderedDict()  # READY and unreferenced, LRU first

    def lookup(self, key: AdapterKey) -> Slot | None:
        index = self._by_key.get(key)
        return None if index is None else self.slots[index]

    def reserve(self, key: AdapterKey) -> tuple[int, AdapterKey | None]:
        """A slot for ``key`` in LOADING state, and the adapter evicted to make room (if any)."""
        assert key not in self._by_key, f"{key} already has slot {self._by_key[key]}"
        evicted = None
        if self._free:
            index = self._free.popleft()
        elif self._idle:
            index, _ = self._idle.popitem(last=False)
            evicted = self._drop(index)
        else:
            raise SlotsBusyError(f"no GPU slot for {key}: all {len(self.slots)} slots are loading or in use; "
                                "release finished batches or configure more slots")
        slot = self.slots[index]
        slot.state, slot.key = SlotPhase.LOADING, key
        self._by_key[key] = index
        return index, evicted

    def mark_ready(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.state is SlotPhase.LOADING, f"slot {index} is {slot.state.value}, not loading"
        slot.state = SlotPhase.READY
        if slot.refs == 0:
            self._idle[index] = None

    def fail(self, index: int) -> None:
        """A load that never reached the GPU: the slot becomes free again."""
        slot = self.slots[index]
        assert slot.state is SlotPhase.LOADING and slot.refs == 0, f"cannot fail slot {index}: {slot}"
        self._drop(index)
        self._free.append(index)

    def incref(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.state is not SlotPhase.FREE, f"slot {index} is free"
        slot.refs += 1
        self._idle.pop(index, None)

    def decref(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.refs > 0, f"slot {index} released more often than acquired"
        slot.refs -= 1
        if slot.refs == 0 and slot.state is SlotPhase.READY:
            self._idle[index] = None

    def evict(self, key: AdapterKey) -> bool:
        """Free ``key``'s slot if it is READY and unreferenced; False if it is absent or busy."""
        index = self._by_key.get(key)
        if index is None or index not in self._idle:
            return False
        del self._idle[index]
        self._drop(index)
        self._free.append(index)
        return True

    def _drop(self, index: int) -> AdapterKey | None:
        slot = self.slots[index]
        key, slot.key, slot.state = slot.key, None, SlotPhase.FREE
        if key is not None:
            del self._by_key[key]
        return key

    def count(self, state: SlotPhase) -> int:
        return sum(s.state is state for s in self.slots)

    def check_integrity(self) -> None:
        for s in self.slots:
            assert s.refs >= 0, f"slot {s.index} has negative refs"
            assert (s.state is SlotPhase.FREE) == (s.key is None), f"slot {s.index}: state/key mismatch {s}"
            assert s.state is not SlotPhase.FREE or s.refs == 0, f"free slot {s.index} has references"
            assert (s.index in self._idle) == (s.state is SlotPhase.READY and s.refs == 0), f"idle list wrong: {s}"
            assert (s.index in self._free) == (s.state is SlotPhase.FREE), f"free list wrong: {s}"
            if s.key is not None:
                assert self._by_key[s.key] == s.index, f"index of {s.key} is wrong"
        assert len(self._by_key) == sum(s.key is not None for s in self.slots), "key index has stale entries"
        assert len(set(self._free)) == len(self._free), "free list has duplicates"
