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

4. Where adapters come from an object store, each node's disk tier (``workers.staging.disk_tier``: whole objects,
   far more bytes than host memory) is filled the same way beyond the host tiers: the store adapters in the same
   order and placement (one copy each, then second copies of requested ones), within ``warm_disk_share`` of each
   replica's part of its node's disk tier (counting the objects the host warm set fetches through it), are sent as
   ``Stage(disk=True)``: fetched whole, read into no host tier. A first touch then reads the node's disk (~90 ms for an
   8B rank-64 adapter) instead of the store (seconds at 200 MB/s). Those fetches yield the store at once to any demand
   read of the node (``DiskTier.stage``): the catalog fills with the store's idle bandwidth only.

A replica's warm budget is ``warm_host_share`` of the host tier its workers report (the smallest rank's); the
rest stays with the host tier's LRU (shards of GPU-resident and recently evicted adapters, needed stages). Where
one copy of the whole catalog does not fit the fleet's warm budgets but fits its whole host tiers, the first copies
take the whole tiers (nothing is left to pass through them; second copies stay within the share): at 0.5 a tier
that held the catalog was left half empty: one replica on one H200 with a 24 GiB tier for 19.5 GiB of shards
(device store, 250 requests of warm-up) read 4 of 150 measured requests' adapters from the device, its p99 one
such read (347 ms); with the whole tier, none (p99 75 ms; bench/reports/issue-42.md). An
assignment is kept until the fleet's shape changes or ``refresh_s`` passes (counts drift slowly); the re-planner
sends each warm key once per assignment, as a speculative ``Stage`` (the disk's after the host's); routing counts
a warm copy once the worker reports it read (``FleetState.hosted``), not when it is sent.

5. While it warms, every worker is also sent the fleet's ranking (``ranking``, a ``Ranking`` command): the
   requested adapters by their fleet-wide request rate now, most first (``Popularity.hottest``: the larger of the
   decayed counts' rate and a 15 s half-life's, each over the adapter's own age, capped for one no longer asked
   for), as many as twice its host tier holds, then its replica's warm keys. A host tier evicting in the ``popular``
   order (workers/staging/eviction.py) lets go of the lowest ranked idle shard first, so what demand reads and
   write-backs of tail adapters push out is the tail, not the fleet's 8th most popular adapter nor a warm copy
   staged ahead of its first request. Computed at most every ``rank_refresh_s`` and sent to a worker only when it
   changed since its last.
Plain Python: no clock of its own, the same inputs give the same assignment.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lora_cache.planner.popularity import RankedCounts
from lora_cache.planner.records import AdapterInfo
from lora_cache.planner.rendezvous import preference, rendezvous_hash
from lora_cache.planner.state import FleetState
from lora_cache.vocab import AdapterKey


class WarmBook:
    """Each replica's warm set (the class's module docstring), kept across plans."""

    def __init__(self, share: float, refresh_s: float, disk_share: float = 0.0) -> None:
        self.share, self.refresh_s, self.disk_share = share, refresh_s, disk_share
        self.read_s: Callable[[int], float | None] = _no_fit  # a store read of a shard of n bytes, seconds
        self._shape = -1
        self._assigned_at = -math.inf
        self._warm: dict[str, tuple[AdapterKey, ...]] = {}  # replica -> its warm keys, most valuable first
        self.copies: dict[str, int] = {}  # adapter -> warm copies in the fleet (last assignment)
        self._limits: dict[str, int] = {}  # replica -> the bytes its warm set may take (last assignment)
        self._disk: dict[str, tuple[AdapterKey, ...]] = {}  # replica -> store adapters its node's disk keeps
        self._disk_limits: dict[str, int] = {}  # replica -> the object bytes its disk warm set may take
        self.assignments = 0

    def refresh(self, fleet: FleetState, counts: RankedCounts, now: float) -> None:
        """Before a plan: assign afresh if the fleet's shape changed or ``refresh_s`` passed."""
        if fleet.shape == self._shape and now - self._assigned_at < self.refresh_s:
            return
        self._shape, self._assigned_at = fleet.shape, now
        order = _by_value(fleet, counts, self.read_s)
        self._warm = self._assign(fleet, counts, order)
        self._disk = self._assign_disk(fleet, counts, order)
        self.assignments += 1

    def warm(self, replica: str) -> tuple[AdapterKey, ...]:
        """``replica``'s warm keys, most valuable first (empty for a replica not in the last assignment)."""
        return self._warm.get(replica, ())

    def warm_disk(self, replica: str) -> tuple[AdapterKey, ...]:
        """The store adapters ``replica``'s node keeps in its disk tier beyond its warm keys (their host stages fetch
        those), most valuable first: fetched whole from the store, read into no host tier (point 4 of the module
        docstring)."""
        host = set(self._warm.get(replica, ()))
        return tuple(k for k in self._disk.get(replica, ()) if k not in host)

    def forget(self, adapter: str) -> None:
        """An unregistered adapter: drop it from the assignment at once (the next refresh would too)."""
        self._warm = {r: tuple(k for k in keys if k.name != adapter) for r, keys in self._warm.items()}
        self._disk = {r: tuple(k for k in keys if k.name != adapter) for r, keys in self._disk.items()}
        self.copies.pop(adapter, None)

    def check_integrity(self, fleet: FleetState) -> None:
        if fleet.shape != self._shape:
            return  # the catalog or the capacities changed since: the next plan assigns afresh
        for replica, keys in self._warm.items():
            assert len(set(keys)) == len(keys), f"a warm key repeats on {replica}"
            used = sum(fleet.catalog[k.name].bytes_per_rank for k in keys if k.name in fleet.catalog)
            assert used <= self._limits.get(replica, 0), f"{replica}'s warm set ({used} B) exceeds its budget"
        for replica, keys in self._disk.items():
            assert len(set(keys)) == len(keys), f"a disk warm key repeats on {replica}"
            infos = [fleet.catalog[k.name] for k in keys if k.name in fleet.catalog]
            assert all(i.object_bytes > 0 for i in infos), f"{replica}'s disk warm set holds an adapter of local files"
            used = sum(i.object_bytes for i in infos)
            assert used <= self._disk_limits.get(replica, 0), f"{replica}'s disk warm set ({used} B) exceeds its budget"

    def _assign(self, fleet: FleetState, counts: RankedCounts, order: list[str]) -> dict[str, tuple[AdapterKey, ...]]:
        shared = _budgets(fleet, self.share)
        first = self._limits = _first_copy_budgets(fleet, shared)
        self.copies = {}
        return _spread(fleet, counts, order, first, shared, lambda info: info.bytes_per_rank, self.copies)

    def _assign_disk(self, fleet: FleetState, counts: RankedCounts,
                     order: list[str]) -> dict[str, tuple[AdapterKey, ...]]:
        """Point 4: the store adapters, in the warm set's order, placed as it is within the disk tiers' budgets."""
        budgets = self._disk_limits = _disk_budgets(fleet, self.disk_share)
        stored = [name for name in order if fleet.catalog[name].object_bytes > 0]
        return _spread(fleet, counts, stored, budgets, budgets, lambda info: info.object_bytes, {})


def _spread(fleet: FleetState, counts: RankedCounts, order: list[str], first: dict[str, int], shared: dict[str, int],
            size: Callable[[AdapterInfo], int], copies: dict[str, int]) -> dict[str, tuple[AdapterKey, ...]]:
    """``order``'s adapters over the replicas: one copy each in rendezvous order within ``first``'s bytes, then
    second copies of requested adapters within what ``shared``'s leave (points 2 and 3); ``copies`` counts them."""
    left = dict(first)
    out: dict[str, list[AdapterKey]] = {r: [] for r in left}
    if not left:
        return {}
    for name in order:  # one copy each, in rendezvous order
        _place(fleet, name, left, out, (), size, copies)
        if not any(left.values()):
            break
    left = {r: max(0, shared[r] - (first[r] - room)) for r, room in left.items()}  # second copies: the share's
    requested = [name for name in order if counts.get(name) > 0 and copies.get(name) == 1]
    for name in requested:  # then second copies of requested adapters, where room is left
        holder = tuple(r for r, keys in out.items() if fleet.catalog[name].key in keys)
        _place(fleet, name, left, out, holder, size, copies)
    return {r: tuple(keys) for r, keys in out.items() if keys}


def _place(fleet: FleetState, name: str, left: dict[str, int], out: dict[str, list[AdapterKey]],
           skip: tuple[str, ...], size: Callable[[AdapterInfo], int], copies: dict[str, int]) -> None:
    info = fleet.catalog[name]
    nbytes = size(info)
    fits = [r for r, room in left.items() if room >= nbytes and r not in skip]
    if not fits:
        return
    replica = preference(name, fits)[0]
    left[replica] -= nbytes
    out[replica].append(info.key)
    copies[name] = copies.get(name, 0) + 1


def _disk_budgets(fleet: FleetState, share: float) -> dict[str, int]:
    """Each replica's disk warm budget in object bytes: ``share`` of its ranks' part of their node's disk tier
    (replicas with no disk tier reported, or slotless: none)."""
    out: dict[str, int] = {}
    for replica in sorted(fleet.workers):
        if not fleet.workers[replica] or share <= 0:
            continue
        capacity = fleet.replica_capacity(replica)
        if capacity.disk_bytes and capacity.slots >= 1:
            out[replica] = int(capacity.disk_bytes * share)
    return out


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


RANKING_MAX = 4096  # names in one ranking at most (a tier of tiny adapters needs no longer one to order its own)


def ranking(fleet: FleetState, hottest: list[str], host_bytes: int | None,
            warm: tuple[AdapterKey, ...] = ()) -> tuple[str, ...]:
    """Point 5: the requested adapters, most asked for first (``hottest``: ``Popularity.hottest``), as long as their
    shards fill twice ``host_bytes`` (a tier never holds more; the rest rank lowest alike), ``RANKING_MAX`` at most;
    then the replica's ``warm`` keys not yet named, so that a tier keeps what it was told to warm (an adapter never
    requested yet, staged ahead of its first request) before a tail adapter's write-back; () without a host tier."""
    if not host_bytes:
        return ()
    names: dict[str, None] = {}
    left = 2 * host_bytes
    for name in hottest:
        info = fleet.catalog.get(name)
        if info is None:
            continue
        left -= info.bytes_per_rank
        if left < 0 or len(names) == RANKING_MAX:
            break
        names[name] = None
    for key in warm:
        if len(names) == RANKING_MAX:
            break
        names.setdefault(key.name, None)
    return tuple(names)


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
