"""Fleet placement (lifecycle step 3 across replicas): which replicas an adapter calls home.

A router that follows residency (the controller's routing advice, ``lora_cache.routing``, or any affinity
router) sends an adapter's requests where it is resident; where it is resident nowhere, the advice sends
it to the first replica with room in a per-(adapter, replica) hash order (rendezvous hashing), and a
replica over its load bound overflows to the next in that order. So the fleet can be planned as one
cache: an adapter's *homes* are the first ``copies`` replicas of its rendezvous order that have a slot
left (adapters are assigned most requested first; no replica gets more homes than it has slots), where

    copies = clamp(ceil(share * replicas), 1, replicas)

and ``share`` is its part of the fleet's decayed request count: distinct adapters spread over the fleet's
slots (one home each), and an adapter with a 10% share of a 32-replica fleet's traffic gets 4 homes, the
replicas its overflow goes to, instead of one hot replica (affinity routing) or every replica holding the
same top-k (per-replica popularity).

An adapter gets homes only if expected at ``home_min_rate`` requests per second or more, and no more
homes than keep each one at that rate: while its counts are young (a decayed count underestimates a
rate for the first half-lives) a hot adapter gets fewer homes, not none.

The planner's ``global`` policy gives a replica's free GPU room (what queue, hints, incumbents and
speculation left) to the adapters that call it home, most requested first. On a full replica, a home
with traffic of its own may displace incumbents worth clearly less per byte (the speculation rule's
``hysteresis``) than its *home score*: its value once a router that follows residency sends this
replica its share, ``count / copies`` (``ReplicaScorer.home_score``); and a resident home keeps that
score, so speculation does not evict a new copy before traffic reaches it. So a hot adapter's copies
land on a full fleet too, and a router that ignores residency (round-robin) loses only the bytes of
the copies it does not use. And when the fleet's slots can hold the whole catalog, adapters with no
history yet (a new deployment, a scaled-out fleet) get one home too (free room only, never
displacing), so an adapter's first request finds it loaded where the advice sends it.

Plain Python; ``preference`` is the routing advice's own order (``lora_cache.routing.preference``).
Simulated (32 replicas, Zipf 0.9 over 200 adapters, bench/RESULTS.md 2026-11-25): the share of requests
whose adapter was ready on arrival rose from 0.959 to 0.995, and with affinity routing at lead 0 the hot
spot (p99 750 ms: few replicas held the hot adapters) is gone. With the rate-bounded copies and
displacement (bench/RESULTS.md, 2026-11-25, "copies of a hot adapter"), affinity routing over Zipf 1.5
(1,000 adapters) at lead 0.05: mean TTFT 818 -> 41 ms; with the hot adapter changing 3 times, p99
5,389 -> 82 ms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from lora_cache.planner.popularity import RankedCounts
from lora_cache.planner.records import AdapterInfo, AdapterKey
from lora_cache.routing import preference


class Home(NamedTuple):
    """An adapter assigned to a replica: its current version, and the scaled request count each of its homes
    can expect (its fleet-wide count over its copies, what a router that follows residency sends each copy);
    0.0 for an adapter placed only because the fleet holds the catalog (free room only, never displacing)."""

    key: AdapterKey
    per_copy: float


def copies(share: float, replicas: int) -> int:
    """Homes for an adapter with ``share`` (0-1) of the fleet's requests: one per replica's worth of
    traffic, at least one, at most every replica."""
    if replicas < 1:
        return 0
    return max(1, min(replicas, math.ceil(share * replicas - 1e-9)))


class Preferences:
    """Each adapter's rendezvous order over the replicas; cached until the replicas change."""

    def __init__(self) -> None:
        self._replicas: tuple[str, ...] = ()
        self._orders: dict[str, list[str]] = {}

    def order(self, adapter: str, replicas: tuple[str, ...]) -> list[str]:
        """``adapter``'s replicas, first home first (``lora_cache.routing.preference``)."""
        if replicas != self._replicas:
            self._replicas, self._orders = replicas, {}
        order = self._orders.get(adapter)
        if order is None:
            order = self._orders[adapter] = preference(adapter, replicas)
        return order

    def forget(self, adapter: str) -> None:
        self._orders.pop(adapter, None)


class HomeBook:
    """One plan's homes for the whole fleet, assigned once (lazily) and read per replica.

    Adapters are assigned most requested first, each to the first replicas of its rendezvous order that
    have a slot left in this assignment (``slots_of``: a replica's slots), as many as its copies: so a
    replica never gets more homes than it has slots, and an adapter whose first home is full goes to its next
    (the advice routes to where it is resident, so it follows). When the fleet's slots hold the whole
    catalog, adapters below ``min_rate`` get one home each too. Assigned homes only take free room
    (policies.py). Nothing is computed until a replica with free room asks (``homes``).
    """

    def __init__(self, preferences: Preferences, replicas: Sequence[str], slots_of: Callable[[str], int],
                 fleet: RankedCounts, per_second: float, catalog: Mapping[str, AdapterInfo], min_rate: float) -> None:
        self._preferences = preferences
        self._replicas = tuple(replicas)
        self._slots_of = slots_of
        self._fleet = fleet
        self._per_second = per_second  # scaled count -> requests per second
        self._catalog = catalog
        self._min_rate = min_rate
        self._homes: dict[str, list[Home]] | None = None

    def homes(self, replica: str) -> tuple[Home, ...]:
        """The adapters assigned to ``replica``, most requested first; then, if the fleet holds the catalog,
        those below ``min_rate`` (none yet: a fresh fleet), by count and name."""
        if self._homes is None:
            self._homes = self._assign()
        return tuple(self._homes.get(replica, ()))

    def _assign(self) -> dict[str, list[Home]]:
        n = len(self._replicas)
        left = {r: self._slots_of(r) for r in self._replicas}
        fill_catalog = 0 < len(self._catalog) <= sum(left.values())  # adapters without history too
        out: dict[str, list[Home]] = {r: [] for r in self._replicas}
        if n == 0:
            return out
        total = self._fleet.total
        rated: set[str] = set()
        for neg, name in self._fleet.order:
            rate = -neg * self._per_second
            if rate < self._min_rate:
                break  # counts only fall from here
            # one home per replica's worth of traffic, but none expected below min_rate (while the counts
            # are young, a hot adapter's rate is underestimated: it gets fewer homes, not none)
            count = max(1, min(copies(-neg / total, n), math.floor(rate / self._min_rate)))
            rated.add(name)
            self._place(name, count, -neg / count, left, out)
        if fill_catalog:
            rest = sorted(self._catalog.keys() - rated, key=lambda a: (-self._fleet.get(a), a))
            for name in rest:
                self._place(name, 1, 0.0, left, out)
        return out

    def _place(self, name: str, count: int, per_copy: float, left: dict[str, int],
               out: dict[str, list[Home]]) -> None:
        home = Home(self._catalog[name].key, per_copy)
        for replica in self._preferences.order(name, self._replicas):
            if count == 0:
                return
            if left[replica] > 0:
                left[replica] -= 1
                out[replica].append(home)
                count -= 1
