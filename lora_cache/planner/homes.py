"""Fleet placement (lifecycle step 3 across replicas): which replicas an adapter calls home.

A router that follows residency (the controller's routing advice, ``lora_cache.routing``, or any affinity
router) sends an adapter's requests where it is resident; where it is resident nowhere, the advice sends
it to the first replica with room in a per-(adapter, replica) hash order (rendezvous hashing), and a
replica over its load bound overflows to the next in that order. So the fleet can be planned as one
cache: an adapter's *homes* are the first ``copies`` replicas of its rendezvous order, where

    copies = clamp(ceil(share * replicas), 1, replicas)

and ``share`` is its part of the fleet's decayed request count: distinct adapters spread over the fleet's
slots (one home each), and an adapter with a 10% share of a 32-replica fleet's traffic gets 4 homes, the
replicas its overflow goes to, instead of one hot replica (affinity routing) or every replica holding the
same top-k (per-replica popularity).

The planner's ``global`` policy gives a replica's *free* GPU room (what queue, hints, incumbents and
speculation left) to the adapters that call it home, most requested first, each expected at
``home_min_rate`` requests per second or more per copy: never evicting, so a router that ignores
residency (round-robin) loses nothing but the room's idle bytes. And when the fleet's slots can hold
the whole catalog, adapters with no history yet (a new deployment, a scaled-out fleet) go to their first
home too, so an adapter's first request finds it loaded where the advice sends it.

Plain Python; ``preference`` is the routing advice's own order (``lora_cache.routing.preference``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from lora_cache.planner.popularity import RankedCounts
from lora_cache.planner.records import AdapterInfo, AdapterKey
from lora_cache.routing import preference


def copies(share: float, replicas: int) -> int:
    """Homes for an adapter with ``share`` (0-1) of the fleet's requests: one per replica's worth of
    traffic, at least one, at most every replica."""
    if replicas < 1:
        return 0
    return max(1, min(replicas, math.ceil(share * replicas - 1e-9)))


class Preferences:
    """Each adapter's rendezvous order over the replicas, as positions; cached until the replicas change."""

    def __init__(self) -> None:
        self._replicas: tuple[str, ...] = ()
        self._positions: dict[str, dict[str, int]] = {}

    def position(self, adapter: str, replica: str, replicas: tuple[str, ...]) -> int:
        """Where ``replica`` comes in ``adapter``'s order over ``replicas`` (0: its first home)."""
        if replicas != self._replicas:
            self._replicas, self._positions = replicas, {}
        positions = self._positions.get(adapter)
        if positions is None:
            positions = self._positions[adapter] = {r: i for i, r in enumerate(preference(adapter, replicas))}
        return positions[replica]

    def forget(self, adapter: str) -> None:
        self._positions.pop(adapter, None)


class HomeBook:
    """One plan's view of the fleet's homes: built per plan (popularity moves), read per replica."""

    def __init__(self, preferences: Preferences, replicas: Sequence[str], fleet: RankedCounts, per_second: float,
                 catalog: Mapping[str, AdapterInfo], min_rate: float, fill_catalog: bool) -> None:
        self._preferences = preferences
        self._replicas = tuple(replicas)
        self._fleet = fleet
        self._per_second = per_second  # scaled count -> requests per second
        self._catalog = catalog
        self._min_rate = min_rate
        self._fill_catalog = fill_catalog  # the fleet's slots hold the catalog: adapters without history too

    def homes(self, replica: str) -> Iterator[AdapterKey]:
        """The current versions of the adapters that call ``replica`` home, most requested first; then, if
        the fleet holds the catalog, those below ``min_rate`` (none yet: a fresh fleet) homed here, by name."""
        n = len(self._replicas)
        if n == 0 or replica not in self._replicas:
            return
        total = self._fleet.total
        rated: set[str] = set()
        for neg, name in self._fleet.order:
            rate = -neg * self._per_second
            count = copies(-neg / total, n) if total > 0 else 1
            if rate / count < self._min_rate:
                break  # counts only fall from here, and copies with them
            rated.add(name)
            if self._position(name, replica) < count:
                yield self._catalog[name].key
        if self._fill_catalog:
            for name in sorted(self._catalog.keys() - rated):
                if self._position(name, replica) == 0:
                    yield self._catalog[name].key

    def _position(self, adapter: str, replica: str) -> int:
        return self._preferences.position(adapter, replica, self._replicas)
