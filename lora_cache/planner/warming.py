"""The fleet's host tiers as one cache (lifecycle step 5 ahead of demand): what each replica keeps warm.

Where the store is slow (an object store, a device read at ~1 GB/s: ~200 ms for an 8B adapter), a first touch
costs a store read that no router lead hides; a host-tier hit costs one PCIe copy (a few ms). The controller
sees the whole catalog and every replica's host tier, so it fills them ahead of demand, with idle store
bandwidth (the workers read warm stages one at a time, only while no load is in flight:
``workers.warming.WarmQueue``), as one cache:

1. Adapters are taken by the store time a host copy saves per byte: the fleet-wide decayed count times what a
   miss of that shard costs (the workers' own store reads, fitted as fixed + per byte: ``read_s``) over its bytes,
   most first. Where a read's time is mostly bytes (a device, a fast object store) that is the count itself: a
   rank-64 shard costs four times a rank-16 one to hold and four times as much to miss (ranking by count per byte,
   as before 2026-11-29, left the busiest rank-64 adapters to the store: 5 of 7 requests of one missed in the
   fitted simulator); a fixed cost per read (an object store's latency) favours the small. Then every adapter
   never requested, smallest shard first (with nothing known, each is as likely as the next, so the smallest cover
   the most first touches per byte), ties by a hash of the name (no catalog order bias). The busiest adapters,
   which GPU slots hold, take warm budget too: their host copies are what a slot evicted under churn loads from
   (a warm set that skipped them helped one replica and lost on two sharing one device: bench/reports/issue-42.md,
   "the warm set's value").
2. One copy of each before any second: an adapter goes to the first replica of its rendezvous order (the order
   the routing advice's sticky cold picks and the planner's homes follow, ``rendezvous.py``) whose warm budget
   still fits its shard: so the fleet's host memory holds as much of the catalog as fits, and a request for an
   adapter resident nowhere is routed where its host copy is.
3. With room left once every adapter has its copy, requested adapters get a second copy on their next replica
   (the router overflows a hot adapter there), most requested first, until the budgets are spent.

A replica's warm budget is ``warm_host_share`` of the host tier its workers report (the smallest rank's); the
rest stays with the host tier's LRU (shards of GPU-resident and recently evicted adapters, needed stages). Where
one copy of the whole catalog does not fit the fleet's warm budgets but fits its whole host tiers, the first copies
take the whole tiers (nothing is left to pass through them; second copies stay within the share): at 0.5 a tier
that held the catalog was left half empty: one replica on one H200 with a 24 GiB tier for 19.5 GiB of shards
(device store, 250 requests of warm-up) read 4 of 150 measured requests' adapters from the device, its p99 one
such read (347 ms); with the whole tier, none (p99 75 ms; bench/reports/issue-42.md). An
assignment is kept until the fleet's shape changes or ``refresh_s`` passes (counts drift slowly); the re-planner
sends each warm key once per assignment, as a speculative ``Stage``; routing counts a warm copy once the worker
reports it read (``FleetState.hosted``), not when it is sent.
Plain Python: no clock of its own, the same inputs give the same assignment.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lora_cache.planner.popularity import RankedCounts
from lora_cache.planner.rendezvous import preference, rendezvous_hash
from lora_cache.planner.state import FleetState
from lora_cache.vocab import AdapterKey


class WarmBook:
    """Each replica's warm set (the class's module docstring), kept across plans."""

    def __init__(self, share: float, refresh_s: float) -> None:
        self.share, self.refresh_s = share, refresh_s
        self.read_s: Callable[[int], float | None] = _no_fit  # a store read of a shard of n bytes, seconds
        self._shape = -1
        self._assigned_at = -math.inf
        self._warm: dict[str, tuple[AdapterKey, ...]] = {}  # replica -> its warm keys, most valuable first
        self.copies: dict[str, int] = {}  # adapter -> warm copies in the fleet (last assignment)
        self._limits: dict[str, int] = {}  # replica -> the bytes its warm set may take (last assignment)
        self.assignments = 0

    def refresh(self, fleet: FleetState, counts: RankedCounts, now: float) -> None:
        """Before a plan: assign afresh if the fleet's shape changed or ``refresh_s`` passed."""
        if fleet.shape == self._shape and now - self._assigned_at < self.refresh_s:
            return
        self._shape, self._assigned_at = fleet.shape, now
        self._warm = self._assign(fleet, counts)
        self.assignments += 1

    def warm(self, replica: str) -> tuple[AdapterKey, ...]:
        """``replica``'s warm keys, most valuable first (empty for a replica not in the last assignment)."""
        return self._warm.get(replica, ())

    def forget(self, adapter: str) -> None:
        """An unregistered adapter: drop it from the assignment at once (the next refresh would too)."""
        self._warm = {r: tuple(k for k in keys if k.name != adapter) for r, keys in self._warm.items()}
        self.copies.pop(adapter, None)

    def check_integrity(self, fleet: FleetState) -> None:
        if fleet.shape != self._shape:
            return  # the catalog or the capacities changed since: the next plan assigns afresh
        for replica, keys in self._warm.items():
            assert len(set(keys)) == len(keys), f"a warm key repeats on {replica}"
            used = sum(fleet.catalog[k.name].bytes_per_rank for k in keys if k.name in fleet.catalog)
            assert used <= self._limits.get(replica, 0), f"{replica}'s warm set ({used} B) exceeds its budget"

    def _assign(self, fleet: FleetState, counts: RankedCounts) -> dict[str, tuple[AdapterKey, ...]]:
        shared = _budgets(fleet, self.share)
        first = self._limits = _first_copy_budgets(fleet, shared)
        left = dict(first)
        out: dict[str, list[AdapterKey]] = {r: [] for r in left}
        self.copies = {}
        if not left:
            return {}
        order = _by_value(fleet, counts, self.read_s)
        for name in order:  # one copy each, in rendezvous order
            self._place(fleet, name, left, out, skip=())
            if not any(left.values()):
                break
        left = {r: max(0, shared[r] - (first[r] - room)) for r, room in left.items()}  # second copies: the share's
        requested = [name for name in order if counts.get(name) > 0 and self.copies.get(name) == 1]
        for name in requested:  # then second copies of requested adapters, where room is left
            holder = tuple(r for r, keys in out.items() if fleet.catalog[name].key in keys)
            self._place(fleet, name, left, out, skip=holder)
        return {r: tuple(keys) for r, keys in out.items() if keys}

    def _place(self, fleet: FleetState, name: str, left: dict[str, int], out: dict[str, list[AdapterKey]],
               skip: tuple[str, ...]) -> None:
        info = fleet.catalog[name]
        fits = [r for r, room in left.items() if room >= info.bytes_per_rank and r not in skip]
        if not fits:
            return
        replica = preference(name, fits)[0]
        left[replica] -= info.bytes_per_rank
        out[replica].append(info.key)
        self.copies[name] = self.copies.get(name, 0) + 1


def _budgets(fleet: FleetState, share: float) -> dict[str, int]:
    """Each replica's warm budget in bytes per rank (replicas whose host tier is unknown or slotless: none)."""
    out: dict[str, int] = {}
    for replica in sorted(fleet.workers):
        if not fleet.workers[replica]:
            continue
        capacity = fleet.replica_capacity(replica)
        if capacity.host_bytes is not None and capacity.slots >= 1 and share > 0:
            out[replica] = int(capacity.host_bytes * share)
    return out


def _first_copy_budgets(fleet: FleetState, shared: dict[str, int]) -> dict[str, int]:
    """The budgets the first copies are placed within (point 2 of the module docstring): the share's, unless one copy
    of every registered adapter does not fit them but fits the replicas' whole host tiers; then the whole tiers (the
    share keeps room for what passes through a tier that cannot hold the catalog; a tier that can has nothing to
    keep it for: left half empty, it sent to the store first touches it had the room to hold)."""
    whole = {r: int(fleet.replica_capacity(r).host_bytes or 0) for r in shared}
    catalog = sum(info.bytes_per_rank for info in fleet.catalog.values())
    if catalog <= sum(shared.values()) or catalog > sum(whole.values()):
        return shared
    return whole


def _no_fit(nbytes: int) -> float | None:
    return None


def _by_value(fleet: FleetState, counts: RankedCounts, read_s: Callable[[int], float | None]) -> list[str]:
    """Requested adapters by the store time a copy saves per byte (count x a read's seconds / bytes; with no reads
    timed yet, a read's time in proportion to its bytes: the count), then the never-requested, smallest first,
    ties by hash."""
    catalog = fleet.catalog

    def saved(name: str) -> float:
        nbytes = catalog[name].bytes_per_rank
        cost = read_s(nbytes) if nbytes > 0 else None
        return counts.get(name) * (cost / nbytes if cost else 1.0)

    requested = sorted((name for name in catalog if counts.get(name) > 0), key=lambda a: (-saved(a), a))
    unseen = sorted((name for name in catalog if counts.get(name) <= 0),
                    key=lambda a: (catalog[a].bytes_per_rank, rendezvous_hash(a, ""), a))
    return requested + unseen
