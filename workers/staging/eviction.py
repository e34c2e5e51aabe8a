"""Which idle shard a host tier lets go of first (lifecycle step 5), a strategy of the tier (``EVICTION``):
``lru``, the least recently used (the default), or ``segmented``, where a one-off read never pushes out a copy that
is used again or that the controller asked to keep warm.

A plain LRU lets every demand read of a rarely asked-for adapter push out the least recently used copy, and with a
Zipf catalog most demand reads are of such adapters: in the fitted simulator (1 replica, device store, 4 GiB host
tier, ``--max-adapters 8``) the 11th most requested adapter was read from the device on 6 of its 7 requests, each
time pushed out by tail reads between them, while the controller's warm stages (``lora_cache/planner/warming.py``)
were pushed out as fast as they came (bench/reports/issue-42.md, "the host tier's eviction order"). So under
``segmented`` a tier's entries are of two kinds, as in segmented LRU / 2Q:

- **protected**: read by a warm stage (the controller's plan for this tier), fetched again once staged (used
  twice), or read again soon after the tier let go of it (its key is still in the ghost history below);
- **probationary**: read once for a demand and not asked for since.

An idle probationary entry goes first, oldest first; a protected one only when no probationary entry is idle,
oldest first too, so a copy nobody asks for any more still ages out. The ghost history remembers the keys the tier
let go of, newest last, up to the tier's own capacity in their bytes: an adapter asked for again within about one
tier's worth of turnover comes back protected (without it, an adapter whose requests are further apart than the
tail's reads take to fill the tier is read from the store every time). Shared by the real tier
(``workers.staging.host_tier``) and the simulator's (``bench.sim.host_tier``), so both evict alike.

Why ``lru`` stays the default: in the fitted simulator ``segmented`` lowers the stall per request on 7 of 8 device,
page-cache and s3 rows and `global`'s mean on most, but it helps the baselines as much or more, and on the quick
routing grid's saturated point (r2-a50-l0.9-uniform-m4-tp1) Route's mean went from 0.96x to 1.004x affinity's at the
grid's seed (Route's own figures unchanged over 6 seeds, affinity's better): a change that helps one scenario and
moves another the wrong way is not made the default until that point is understood (docs/known-issues.md).
Plain Python, no clock, no lock of its own (the tier's lock covers it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from lora_cache.vocab import AdapterKey

E = TypeVar("E", bound="Guarded")


class Guarded(Protocol):
    protected: bool


EVICTION = {
    "lru": "the least recently used idle shard goes first",
    "segmented": "a shard read once for a demand goes before one used again, warmed, or read again soon after it "
                 "left; each kind oldest first (workers/staging/eviction.py)",
}


class EvictionOrder:
    """One host tier's protected flags and ghost history (the module docstring); under ``lru`` nothing is protected
    and nothing remembered, so ``victim`` takes the oldest idle entry."""

    def __init__(self, capacity: int, kind: str = "segmented") -> None:
        if capacity < 0:
            raise ValueError(f"capacity is {capacity}; give the tier's bytes, >= 0")
        if kind not in EVICTION:
            raise ValueError(f"eviction {kind!r} is not one of {', '.join(EVICTION)}")
        self.capacity, self.kind = capacity, kind
        self.segmented = kind == "segmented"  # whether a fetch of a staged entry protects it (used again)
        self._ghosts: OrderedDict[AdapterKey, int] = OrderedDict()  # let go of, oldest first -> bytes
        self._ghost_bytes = 0
        self.returned = 0  # misses that found their key in the ghost history (came back protected)

    def admitted(self, key: AdapterKey, speculative: bool) -> bool:
        """A new entry's read starts: whether it is protected (a warm stage's, or a key the tier let go of lately)."""
        if not self.segmented:
            return False
        nbytes = self._ghosts.pop(key, None)
        if nbytes is not None:
            self._ghost_bytes -= nbytes
            self.returned += 1
        return speculative or nbytes is not None

    def used_again(self, protected: bool) -> bool:
        """A staged entry fetched again: whether it is protected from now on (under ``segmented``, always)."""
        return protected or self.segmented

    def written_back(self, key: AdapterKey) -> bool:
        """A slot's shard written back into the tier (exclusive tiers): whether its entry is protected. It was loaded
        into a slot, so it was used: under ``segmented``, always (and it leaves the ghost history, if it was there)."""
        return self.admitted(key, False) or self.used_again(False)

    def evicted(self, key: AdapterKey, nbytes: int) -> None:
        """The tier let go of ``key``'s idle entry to make room: remembered, newest last, within the capacity."""
        if not self.segmented:
            return
        old = self._ghosts.pop(key, None)
        self._ghost_bytes += nbytes - (old or 0)
        self._ghosts[key] = nbytes
        while self._ghost_bytes > self.capacity:
            _, gone = self._ghosts.popitem(last=False)
            self._ghost_bytes -= gone

    def forget(self, name: str) -> None:
        """Every version of an unregistered adapter leaves the history (a new registration starts afresh)."""
        for key in [k for k in self._ghosts if k.name == name]:
            self._ghost_bytes -= self._ghosts.pop(key)

    def ghosts(self) -> list[AdapterKey]:
        return list(self._ghosts)

    def check_integrity(self) -> None:
        assert self._ghost_bytes == sum(self._ghosts.values()) <= self.capacity, "ghost history bytes disagree"


def victim(entries: Iterable[tuple[AdapterKey, E]], idle: Callable[[E], bool]) -> AdapterKey | None:
    """The entry to let go of first among ``entries`` (oldest first): the oldest idle probationary one, else the
    oldest idle protected one; None if none is idle."""
    first = None
    for key, entry in entries:
        if not idle(entry):
            continue
        if not entry.protected:
            return key
        if first is None:
            first = key
    return first
