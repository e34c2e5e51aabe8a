"""Which idle shard a host tier lets go of first (lifecycle step 5), a strategy of the tier (``EVICTION``):
``lru``, the least recently used (the default); ``popular``, where the shard of the adapter the fleet asks for least
goes first (the controller's ranking) and one touched lately after every other; or ``segmented``, where a one-off
read never pushes out a copy that is used again or that the controller asked to keep warm.

A plain LRU lets every demand read of a rarely asked-for adapter push out the least recently used copy, and with a
Zipf catalog most demand reads are of such adapters: in the fitted simulator (1 replica, device store, 4 GiB host
tier, ``--max-adapters 8``) the 11th most requested adapter was read from the device on 6 of its 7 requests, each
time pushed out by tail reads between them, while the controller's warm stages (``lora_cache/planner/warming.py``)
were pushed out as fast as they came (bench/reports/issue-42.md, "the host tier's eviction order"). Under exclusive
tiers every entry is a write-back or a warm stage, and the tier let go of the fleet's 8th most popular adapter under
write-backs of tail adapters requested once.

``popular``: only the controller counts every request of the fleet, so it sends each rank the fleet's adapters most
asked for first, then the rank's replica's warm keys (a ``Ranking``, lora_cache/vocab.py, when it changed, at most
every second: planner/warming.py, point 5). By each adapter's request rate now (``Popularity.hottest``): the larger
of its 60 s counts' and a 15 s half-life's, each read over the adapter's own age since its first request, and at most
3/T for one not asked for in the last T seconds, so one that became popular lately ranks by its traffic now and one
that stopped falls behind within seconds. The idle entry of the adapter ranked lowest goes first (one not ranked
before any ranked one, oldest first among equals), and an entry touched (read in, fetched or written back) within the
last ``recent_s`` (5 s) goes after every other, ranked the same way among themselves: a shard just written back is
not let go of before the next ranking. With no ranking received (a tier no controller ranks: a baseline policy's, or
where warming is off because a miss is cheap) every entry ranks alike and the touched times follow the tier's order,
so the order is LRU's exactly. Measured in the fitted simulator (bench/reports/issue-42.md, "The host tier lets go
of the fleet's least asked-for shard first"): ``global``'s median over seeds lower on every fleet tried. It is not
the default: on one H100 (one replica, device store, 250 + 250 requests) it was lower on two seeds of four and
higher on two (median 0.971x LRU's mean), as the simulator predicts for so short a window; a once-seen adapter asked
for again 20-30 s later goes first here where LRU keeps it. The routing grid's sample holds under it as under LRU
(bench/reports/issue-42.md, "The `popular` order on a GPU and on the routing grid"; docs/known-issues.md).

``segmented``: a tier's entries are of two kinds, as in segmented LRU / 2Q:

- **protected**: read by a warm stage (the controller's plan for this tier), fetched again once staged (used
  twice), or read again soon after the tier let go of it (its key is still in the ghost history below);
- **probationary**: read once for a demand and not asked for since.

An idle probationary entry goes first, oldest first; a protected one only when no probationary entry is idle,
oldest first too, so a copy nobody asks for any more still ages out. The ghost history remembers the keys the tier
let go of, newest last, up to the tier's own capacity in their bytes: an adapter asked for again within about one
tier's worth of turnover comes back protected (without it, an adapter whose requests are further apart than the
tail's reads take to fill the tier is read from the store every time). It is not the default: in the fitted
simulator it lowers the stall per request on 7 of 8 device, page-cache and s3 rows, but helps the baselines as much
or more, and on the quick routing grid's saturated point (r2-a50-l0.9-uniform-m4-tp1) Route's mean went from 0.96x
to 1.004x affinity's (docs/known-issues.md).

Shared by the real tier (``workers.staging.host_tier``) and the simulator's (``bench.sim.host_tier``), so both evict
alike. Plain Python, no clock (``victim`` is told the time), no lock of its own (the tier's lock covers it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from lora_cache.vocab import AdapterKey

E = TypeVar("E", bound="Guarded")


class Guarded(Protocol):
    protected: bool
    touched: float  # when the entry was last read in, fetched or written back (the tier's clock, seconds)


EVICTION = {
    "lru": "the least recently used idle shard goes first",
    "popular": "the shard of the adapter the fleet asks for least goes first (the controller's ranking), one touched "
               "in the last recent_s seconds after every other; oldest first among equals; LRU until a ranking comes "
               "(workers/staging/eviction.py)",
    "segmented": "a shard read once for a demand goes before one used again, warmed, or read again soon after it "
                 "left; each kind oldest first (workers/staging/eviction.py)",
}
RECENT_S = 5.0  # ``popular``: an entry touched this lately goes after every other (the module docstring)


class EvictionOrder:
    """One host tier's protected flags and ghost history, or its ranking (the module docstring); under ``lru``
    nothing is protected, remembered or ranked, so ``victim`` takes the oldest idle entry."""

    def __init__(self, capacity: int, kind: str = "segmented", recent_s: float = RECENT_S) -> None:
        if capacity < 0:
            raise ValueError(f"capacity is {capacity}; give the tier's bytes, >= 0")
        if kind not in EVICTION:
            raise ValueError(f"eviction {kind!r} is not one of {', '.join(EVICTION)}")
        if not recent_s >= 0:
            raise ValueError(f"recent_s is {recent_s!r}; give seconds >= 0, e.g. {RECENT_S} (0: no window)")
        self.capacity, self.kind, self.recent_s = capacity, kind, recent_s
        self.segmented = kind == "segmented"  # whether a fetch of a staged entry protects it (used again)
        self._rank: dict[str, int] = {}  # ``popular``: adapter -> its place in the last ranking (0: most asked for)
        self.rankings = 0  # rankings taken
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
        """Every version of an unregistered adapter leaves the history (a new registration starts afresh; the
        controller's next ranking leaves it out, its counts forgotten too)."""
        for key in [k for k in self._ghosts if k.name == name]:
            self._ghost_bytes -= self._ghosts.pop(key)

    def ranked(self, names: Iterable[str]) -> None:
        """The controller's ranking (``Ranking.names``, most asked for first) replaces the last one; ignored unless
        ``popular``. Built aside and put in place by one assignment, so the command's thread needs no tier lock: a
        ``victim`` meanwhile reads the old ranking or the new one whole."""
        if self.kind != "popular":
            return
        rank: dict[str, int] = {}
        for name in names:
            rank.setdefault(name, len(rank))
        self._rank = rank
        self.rankings += 1

    def ranking(self) -> list[str]:
        return list(self._rank)

    def victim(self, entries: Iterable[tuple[AdapterKey, E]], idle: Callable[[E], bool],
               now: float) -> AdapterKey | None:
        """The entry to let go of first among ``entries`` (oldest first), None if none is idle: under ``popular``,
        of the idle entries not touched since ``now - recent_s`` (else of all idle ones) the adapter ranked lowest
        (one not ranked first), the oldest of equals; otherwise ``victim``'s order."""
        if self.kind != "popular":
            return victim(entries, idle)
        rank = self._rank  # one ranking throughout (``ranked`` may replace it meanwhile)
        worst, best = len(rank), None  # a place past every ranked one: not ranked
        since = now - self.recent_s
        for key, entry in entries:
            if not idle(entry):
                continue
            score = (self.recent_s > 0 and entry.touched > since, -rank.get(key.name, worst))
            if best is None or score < best[0]:
                best = (score, key)
        return None if best is None else best[1]

    def ghosts(self) -> list[AdapterKey]:
        return list(self._ghosts)

    def check_integrity(self) -> None:
        assert self._ghost_bytes == sum(self._ghosts.values()) <= self.capacity, "ghost history bytes disagree"
        assert not self._rank or self.kind == "popular", "a ranking kept by an order that does not use it"


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
