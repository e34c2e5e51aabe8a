"""Fleet placement (lifecycle step 3 across replicas): which replicas an adapter calls home.

A router that follows residency (the controller's routing advice, ``lora_cache.routing.ranking``, or any affinity
router) sends an adapter's requests where it is resident; where it is resident nowhere, the advice sends
it to the first replica with room in a per-(adapter, replica) hash order (rendezvous hashing), and a
replica over its load bound overflows to the next in that order. So the fleet can be planned as one
cache: an adapter's *homes* are the first ``copies`` replicas of its rendezvous order that have a slot
left (adapters are assigned most requested first; no replica gets more homes than it has slots), where

    copies = clamp(ceil(home_spread * share * replicas), 1, replicas)

and ``share`` is its part of the fleet's decayed request count: distinct adapters spread over the fleet's
slots (one home each), and an adapter with a 10% share of a 32-replica fleet's traffic gets 4 homes at
``home_spread`` 1 (8 at the default 2), the replicas its overflow goes to, instead of one hot replica (affinity
routing) or every replica holding the same top-k (per-replica popularity). At 2 a copy takes at most half a
replica's worth of its traffic, so the advice, which ranks READY replicas by load, can send each request to the
less loaded of its homes (issue 31: on 4 replicas x TP 1 with a 44% adapter on 2 of them, its requests queued
behind prefills there while another replica idled; bench/RESULTS.md, 2026-11-26).

An adapter gets homes only if expected at ``home_min_rate`` requests per second or more, and no more
homes than keep each one at that rate. Its rate is its count over the time the counts were kept
(``Popularity.observed_per_second``, at least ``home_min_window_s``), not over the decayed count's limit
window: 5 s into a run that read a 7 req/s adapter as 0.4 req/s and placed no copy of it. An adapter new to
an old fleet is still read low for its first half-lives: it gets fewer homes, not none.

The planner's ``global`` policy gives a replica's free GPU room (what queue, hints, incumbents and
speculation left) to the adapters that call it home, most requested first. On a full replica, a home
with traffic of its own may displace incumbents worth clearly less per byte (the speculation rule's
``hysteresis``) than its *home score*: its value once a router that follows residency sends this
replica its share, ``count / copies`` (``ReplicaScorer.home_score``); and a resident home keeps that
score, so speculation does not evict a new copy before traffic reaches it. That value holds only if the
router does follow residency, which the counts show: a replica that holds the adapter was sent at least
``FOLLOWED`` (2) times a replica's share of its requests (``_followed``). So a hot adapter's copies land
on a full fleet behind an affinity router or the advice, and a round-robin fleet pays nothing for them.
And when the fleet's slots can hold the whole catalog, adapters with no history yet (a new deployment,
a scaled-out fleet) get one home too (free room only, never displacing), so an adapter's first request
finds it loaded where the advice sends it. There every adapter with requests gets its first home before any
adapter gets a second, and no home displaces the fleet's last copy of an adapter with requests
(``ReplicaView.last_copies``): extra copies take free room or the place of adapters without history. Before,
copies of three slightly hotter adapters took all 9 slots of 3 Serve replicas, evicting the only copy of an
adapter loaded for a request right after it (tests/test_ray_serve.py failed 1 run in 3-4; docs/known-issues.md).

Plain Python; ``preference`` is the routing advice's own order (``lora_cache.planner.rendezvous``).
Simulated (32 replicas, Zipf 0.9 over 200 adapters, bench/RESULTS.md 2026-11-25): the share of requests
whose adapter was ready on arrival rose from 0.959 to 0.995, and with affinity routing at lead 0 the hot
spot (p99 750 ms: few replicas held the hot adapters) is gone. With the rate-bounded copies and
displacement (bench/RESULTS.md, 2026-11-25, "copies of a hot adapter"), affinity routing over Zipf 1.5
(1,000 adapters) at lead 0.05: mean TTFT 818 -> 41 ms; with the hot adapter changing 3 times, p99
4,994 -> 82 ms (5,389 with the rate bound alone: displacement is what moves copies onto a full fleet).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from lora_cache.planner.popularity import Popularity, RankedCounts
from lora_cache.planner.rendezvous import preference, preference_prefix
from lora_cache.planner.state import FleetState
from lora_cache.planner.view import Home
from lora_cache.vocab import AdapterKey


def copies(share: float, replicas: int, spread: float = 1.0) -> int:
    """Homes for an adapter with ``share`` (0-1) of the fleet's requests: ``spread`` per replica's worth of
    traffic, at least one, at most every replica."""
    if replicas < 1:
        return 0
    return max(1, min(replicas, math.ceil(spread * share * replicas - 1e-9)))


class Preferences:
    """Each adapter's rendezvous order over the replicas, as far as placements read it: a prefix of
    ``PREFIX`` replicas is cached (until the replicas change), the whole order is built only for an adapter
    whose prefix is all full. Caching whole orders held 10 million names on 1,000 replicas x 10,000
    adapters."""

    PREFIX = 8

    def __init__(self) -> None:
        self._replicas: tuple[str, ...] = ()
        self._orders: dict[str, list[str]] = {}

    def use(self, replicas: tuple[str, ...]) -> None:
        """The replicas orders are over (once per assignment, not per adapter: comparing a 1,000-name tuple
        for each of 10,000 adapters is work of its own); the cache is kept while they are the same."""
        if replicas != self._replicas:
            self._replicas, self._orders = replicas, {}

    def order(self, adapter: str) -> Iterator[str]:
        """``adapter``'s replicas, first home first (``lora_cache.planner.rendezvous``), built lazily."""
        prefix = self._orders.get(adapter)
        if prefix is None:
            prefix = self._orders[adapter] = preference_prefix(adapter, self._replicas, self.PREFIX)
        yield from prefix
        if len(prefix) < len(self._replicas):
            yield from preference(adapter, self._replicas)[len(prefix):]

    def forget(self, adapter: str) -> None:
        self._orders.pop(adapter, None)


class HomeBook:
    """The fleet's homes, kept across plans: assigned afresh only when what they rest on changed.

    Adapters are assigned most requested first, each to the first replicas of its rendezvous order that
    have a slot left in the assignment (a replica's slots), as many as its copies: so a replica never gets
    more homes than it has slots, and an adapter whose first home is full goes to its next (the advice
    routes to where it is resident, so it follows). When the fleet's slots hold the whole catalog,
    adapters below ``min_rate`` get one home each too, and the first homes come first: every adapter at
    ``min_rate`` (most requested first), every other adapter with requests, then the extra copies, then adapters
    without history.

    An assignment reads every replica's capacity and, with the catalog placed, every adapter: on 1,000
    replicas and 10,000 adapters a plan took 45 ms instead of 0.7 (bench/RESULTS.md). So it is kept until
    the fleet's shape changes (``FleetState.shape``: catalog, replicas, capacities), an adapter newly
    reaches ``min_rate`` or wants a quarter more homes than it has (a hot adapter's copies grow at once
    while its counts are young), or ``refresh_s`` passes (copies follow the counts' drift); in between,
    each home's count per copy is read from the live counts.
    """

    def __init__(self, min_rate: float, refresh_s: float, spread: float = 1.0, min_window_s: float = 1.0) -> None:
        self._preferences = Preferences()
        self._min_rate = min_rate
        self._refresh_s = refresh_s
        self._spread = spread
        self._min_window_s = min_window_s
        self._shape = -1
        self._assigned_at = -math.inf
        self._homes: dict[str, list[tuple[AdapterKey, int]]] = {}  # replica -> (key, copies; 0: catalog fill)
        self._wanted: dict[str, int] = {}  # adapter at min_rate or more when last assigned -> its copies
        self._counts = RankedCounts()
        self._followed: set[str] = set()  # adapters whose traffic goes where they are resident (_followed)
        self.holds_catalog = False  # the fleet's slots hold the catalog (last assignment): every adapter has a place
        self.assignments = 0

    def refresh(self, fleet: FleetState, popularity: Popularity, now: float) -> None:
        """Before a plan: reassign the homes if they are out of date (the class's docstring)."""
        counts = self._counts = popularity.fleet
        n = len(fleet.workers)
        wanted = {name: self._copies_of(count, rate, counts.total, n)
                  for name, count, rate in self._rated(counts, popularity.observed_per_second(now, self._min_window_s))}
        if fleet.shape == self._shape and now - self._assigned_at < self._refresh_s \
                and not any(self._grows(name, k) for name, k in wanted.items()):
            return
        self._shape, self._assigned_at, self._wanted = fleet.shape, now, wanted
        self._homes = self._assign(fleet, counts, wanted)
        self._followed = {name for name in wanted if _followed(name, fleet, popularity)}
        self.assignments += 1

    def homes(self, replica: str) -> tuple[Home, ...]:
        """The adapters assigned to ``replica`` in the assignment's order (``_assign``: most requested first; if
        the fleet holds the catalog, first homes, then extra copies, then adapters with no history yet). A count
        per copy is given only for an adapter whose traffic follows its residency (``_followed``): where the
        router spreads it regardless (round-robin), a copy would get a replica's share, not its copies' share."""
        return tuple(Home(key, self._counts.get(key.name) / n if n and key.name in self._followed else 0.0)
                     for key, n in self._homes.get(replica, ()))

    def forget(self, adapter: str) -> None:
        self._preferences.forget(adapter)

    def _rated(self, counts: RankedCounts, per_second: float) -> Iterator[tuple[str, float, float]]:
        """(adapter, scaled count, requests/s) of those expected at ``min_rate`` or more, most requested first."""
        for neg, name in counts.order:
            rate = -neg * per_second
            if rate < self._min_rate:
                return  # counts only fall from here
            yield name, -neg, rate

    def _copies_of(self, count: float, rate: float, total: float, replicas: int) -> int:
        """One home per replica's worth of traffic, but none expected below ``min_rate``: while the counts are
        young (they underestimate a rate), a hot adapter gets fewer homes, not none."""
        share = count / total if total > 0 else 1.0
        return max(1, min(copies(share, replicas, self._spread), math.floor(rate / self._min_rate)))

    def _grows(self, name: str, wanted: int) -> bool:
        """A new adapter at ``min_rate``, or one that wants clearly more homes (a quarter more, at least one)
        than it was assigned: reassign now rather than at the next refresh."""
        had = self._wanted.get(name)
        return had is None or wanted - had >= max(1, had // 4)

    def _assign(self, fleet: FleetState, counts: RankedCounts, wanted: dict[str, int]
                ) -> dict[str, list[tuple[AdapterKey, int]]]:
        replicas = tuple(sorted(fleet.workers))  # Planner.replicas(): one cached order per replica set
        left = {r: fleet.replica_capacity(r).slots for r in replicas}
        fill_catalog = 0 < len(fleet.catalog) <= sum(left.values())  # adapters without history too
        self.holds_catalog = fill_catalog and bool(replicas)
        out: dict[str, list[tuple[AdapterKey, int]]] = {r: [] for r in replicas}
        if not replicas:
            return out
        self._preferences.use(replicas)
        if not fill_catalog:
            for name, k in wanted.items():  # most requested first
                self._place(fleet.catalog[name].key, k, k, left, out)
            return out
        # The fleet holds the catalog: every adapter with requests gets its first home before any adapter gets a
        # second, so extra copies never leave a requested adapter without a place (test_ray_serve: copies of
        # three adapters took the slots of the only copy of a fourth one, just loaded for its request).
        rest = sorted(fleet.catalog.keys() - wanted.keys(), key=lambda a: (-counts.get(a), a))
        requested = [name for name in rest if counts.get(name) > 0]
        for name, k in wanted.items():  # most requested first
            self._place(fleet.catalog[name].key, 1, k, left, out)
        for name in requested:
            self._place(fleet.catalog[name].key, 1, 0, left, out)
        for name, k in wanted.items():
            self._place(fleet.catalog[name].key, k - 1, k, left, out)
        for name in rest[len(requested):]:  # no history: free room only
            self._place(fleet.catalog[name].key, 1, 0, left, out)
        return out

    def _place(self, key: AdapterKey, wanted: int, mark: int, left: dict[str, int],
               out: dict[str, list[tuple[AdapterKey, int]]]) -> None:
        """``wanted`` more homes for ``key`` in its order (past replicas that are already its homes), each recorded
        with ``mark`` (its copies; 0: a fill). Returns as soon as they are placed: reading one replica more could
        build its whole order."""
        if wanted <= 0:
            return
        for replica in self._preferences.order(key.name):
            if left[replica] > 0 and not any(k == key for k, _ in out[replica]):
                left[replica] -= 1
                out[replica].append((key, mark))
                wanted -= 1
                if wanted == 0:
                    return


FOLLOWED = 2.0  # a holder's count over a replica's share (count / replicas) that shows routing by residency


def _followed(name: str, fleet: FleetState, popularity: Popularity) -> bool:
    """Whether ``name``'s requests go where it is resident: a replica that holds it was sent ``FOLLOWED``
    times a replica's share of them or more. A router that ignores residency (round-robin, least-loaded)
    sends every replica its share, holder or not; one that follows it (the advice, affinity) sends its
    holders all of it. A hot adapter's extra copies are worth a displacement only in the second case
    (on 8 round-robin replicas they cost 10% more bytes to the GPU for the same TTFT: bench/RESULTS.md)."""
    share = popularity.fleet.get(name) / max(1, len(fleet.workers))
    for replica in {fleet.replica_of[w] for w in fleet.holders.get(name, ())}:
        local = popularity.local.get(replica)
        if local is not None and local.get(name) >= FOLLOWED * share:
            return True
    return False
