"""The fleet as the planner sees it: catalog, replicas and their workers, capacities, residency, queues.

Plain bookkeeping with no policy in it. Residency is what each worker last reported, plus the commands
the planner has sent since (applied optimistically: a prefetch counts as LOADING, an evict as gone);
the worker's next report replaces it. Names are checked here, with errors that say what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lora_cache.planner.errors import (
    PlannerInputError,
    UnknownAdapterError,
    UnknownReplicaError,
    UnknownWorkerError,
    known_names,
)
from lora_cache.planner.records import AdapterInfo, Capacity, QueueEntry, ReplicaSpec, Residency, SlotState
from lora_cache.vocab import AdapterKey


class FleetState:
    """Catalog, topology, capacities, residency and queues, with an adapter -> holders index."""

    def __init__(self) -> None:
        self.catalog: dict[str, AdapterInfo] = {}
        self.workers: dict[str, list[str]] = {}  # replica -> worker ids in rank order
        self.replica_of: dict[str, str] = {}  # worker -> replica
        self.capacity: dict[str, Capacity] = {}  # worker -> capacity
        self.residency: dict[str, dict[AdapterKey, Residency]] = {}  # worker -> what it holds
        self.holders: dict[str, set[str]] = {}  # adapter name -> workers holding any version of it
        self.queues: dict[str, tuple[QueueEntry, ...]] = {}  # replica -> waiting requests (non-empty)
        self.staged: dict[str, frozenset[AdapterKey]] = {}  # worker -> stages sent and still wanted (non-empty)
        self.hosted: dict[str, frozenset[AdapterKey]] = {}  # worker -> shards its host tier holds, reported (non-empty)
        # device pushes' versions whose node copy has not landed: never prefetched, staged or warmed (nothing to
        # read), never evicted where held (their only copies until they land); ``land`` ends that
        self.device_only: set[AdapterKey] = set()
        self._min_bytes: int | None = None  # smallest bytes_per_rank in the catalog; None: recompute
        self._max_bytes: int | None = None  # largest, likewise
        self.shape = 0  # bumped by every change of the catalog, the replicas, their workers or capacities

    # -- lookups that fail with a fix -------------------------------------------------------------
    def require_replica(self, replica: str, where: str) -> list[str]:
        workers = self.workers.get(replica)
        if workers is None:
            raise UnknownReplicaError(f"unknown replica {replica!r} in {where}; known replicas: "
                                      f"{known_names(self.workers)}; "
                                      "add it first with add_replica(ReplicaSpec(...))")
        return workers

    def require_adapter(self, adapter: str, where: str) -> AdapterInfo:
        info = self.catalog.get(adapter)
        if info is None:
            raise UnknownAdapterError(f"unknown adapter {adapter!r} in {where}; the planner's catalog has "
                                      f"{len(self.catalog)} adapters ({known_names(self.catalog)}); "
                                      "register it first with register_adapter(AdapterInfo(...))")
        return info

    def require_worker(self, worker: str, where: str) -> str:
        replica = self.replica_of.get(worker)
        if replica is None:
            raise UnknownWorkerError(f"unknown worker {worker!r} in {where}; known workers: "
                                     f"{known_names(self.replica_of)}; a lost worker must be added again "
                                     "with add_worker(replica, worker, slots) before it reports")
        return replica

    def bytes_of(self, key: AdapterKey) -> int:
        """Bytes of one rank's shard (every version of an adapter is assumed the catalog's size)."""
        return self.catalog[key.name].bytes_per_rank

    def is_current(self, adapter: str, version: str) -> bool:
        """Whether a request naming ``version`` of ``adapter`` ("": none) wants its current version."""
        return not version or version == self.catalog[adapter].version

    def min_bytes(self) -> int:
        if self._min_bytes is None and self.catalog:  # an empty catalog caches nothing: 1 would go stale
            self._min_bytes = min(a.bytes_per_rank for a in self.catalog.values())
        return self._min_bytes or 1

    def max_bytes(self) -> int:
        if self._max_bytes is None and self.catalog:
            self._max_bytes = max(a.bytes_per_rank for a in self.catalog.values())
        return self._max_bytes or 1

    # -- catalog and topology ---------------------------------------------------------------------
    def register(self, info: AdapterInfo) -> AdapterInfo | None:
        """Add or replace a catalog entry; the previous entry, if any."""
        old = self.catalog.get(info.name)
        self.catalog[info.name] = info
        if info.device_only:
            self.device_only.add(info.key)
        else:
            self.device_only.discard(info.key)
        self.shape += 1
        if old is None and self._min_bytes is not None:
            self._min_bytes = min(self._min_bytes, info.bytes_per_rank)
        elif old is not None:
            self._min_bytes = None
        if old is None and self._max_bytes is not None:
            self._max_bytes = max(self._max_bytes, info.bytes_per_rank)
        elif old is not None:
            self._max_bytes = None
        return old

    def unregister(self, name: str) -> None:
        """Forget an adapter: its catalog entry, every queue entry and every worker's residency of it."""
        self.device_only = {k for k in self.device_only if k.name != name}
        for replica, queue in list(self.queues.items()):
            kept = tuple(e for e in queue if e.adapter != name)
            if kept:
                self.queues[replica] = kept
            else:
                del self.queues[replica]
        for worker in sorted(self.holders.get(name, ())):
            self.set_residency(worker, {k: r for k, r in self.residency[worker].items() if k.name != name})
        for worker, keys in list(self.staged.items()):
            self.set_staged(worker, [k for k in keys if k.name != name])
        for worker, hosted in list(self.hosted.items()):
            self.set_hosted(worker, [k for k in hosted if k.name != name])
        del self.catalog[name]
        self.shape += 1
        self._min_bytes = self._max_bytes = None  # recomputed on demand

    def add_replica(self, spec: ReplicaSpec) -> None:
        if spec.replica_id in self.workers:
            raise PlannerInputError(f"replica {spec.replica_id!r} is already known; remove_replica() it "
                                    "first to change its workers, or use add_worker/set_capacity")
        for worker in spec.worker_ids:
            self._check_new_worker(worker)
        self.workers[spec.replica_id] = []
        for worker in spec.worker_ids:
            self.add_worker(spec.replica_id, worker, spec.capacity)

    def remove_replica(self, replica: str) -> None:
        for worker in list(self.workers[replica]):
            self.remove_worker(worker)
        del self.workers[replica]
        self.shape += 1
        self.queues.pop(replica, None)

    def add_worker(self, replica: str, worker: str, capacity: Capacity) -> None:
        self._check_new_worker(worker)
        self.shape += 1
        self.workers[replica].append(worker)
        self.replica_of[worker] = replica
        self.capacity[worker] = capacity
        self.residency[worker] = {}

    def remove_worker(self, worker: str) -> str:
        """Forget a worker and all it held; its replica."""
        self.set_residency(worker, {})
        self.staged.pop(worker, None)
        self.hosted.pop(worker, None)
        self.shape += 1
        replica = self.replica_of.pop(worker)
        self.workers[replica].remove(worker)
        del self.capacity[worker], self.residency[worker]
        return replica

    def set_capacity(self, worker: str, capacity: Capacity) -> bool:
        """A worker's new capacity; whether it changed."""
        if self.capacity[worker] == capacity:
            return False
        self.capacity[worker] = capacity
        self.shape += 1
        return True

    def replica_capacity(self, replica: str) -> Capacity:
        """What every rank can hold: the smallest slots and byte budget among the replica's workers."""
        caps = [self.capacity[w] for w in self.workers[replica]]
        if not caps:
            return Capacity(0, 0)
        budgets = [c.bytes for c in caps if c.bytes is not None]
        hosts = [c.host_bytes for c in caps if c.host_bytes is not None]
        pages = [c.page_bytes for c in caps if c.page_bytes is not None]
        disks = [c.disk_bytes for c in caps if c.disk_bytes is not None]
        return Capacity(min(c.slots for c in caps), min(budgets) if budgets else None, min(hosts) if hosts else None,
                        max(pages) if pages else None, min(disks) if disks else None)

    # -- residency --------------------------------------------------------------------------------
    def set_residency(self, worker: str, held: dict[AdapterKey, Residency]) -> bool:
        """Replace a worker's residency; whether anything a plan depends on changed.

        A plan depends on which versions are held and which are pinned, not on LOADING vs READY, except where a
        worker holds two versions of one adapter: a new version turning READY ends the old one's bridge
        (``replan._bridges``).
        """
        old = self.residency[worker]
        changed = old.keys() != held.keys() or _pinned(old) != _pinned(held) or _bridging(old, held)
        for name in {k.name for k in old} - {k.name for k in held}:
            self._unhold(name, worker)
        for key in held:
            self.holders.setdefault(key.name, set()).add(worker)
        self.residency[worker] = held
        return changed

    def put_residency(self, worker: str, key: AdapterKey, residency: Residency | None) -> bool:
        """Set (or with None, drop) one entry of a worker's residency; whether a plan input changed."""
        held = dict(self.residency[worker])
        if residency is None:
            held.pop(key, None)
        else:
            held[key] = residency
        return self.set_residency(worker, held)

    def apply(self, worker: str, evicts: list[AdapterKey], prefetches: list[AdapterKey]) -> None:
        """Assume sent commands took effect until the worker reports otherwise."""
        held = dict(self.residency[worker])
        for key in evicts:
            del held[key]
        for key in prefetches:
            held[key] = Residency(SlotState.LOADING)
        self.set_residency(worker, held)

    def set_staged(self, worker: str, keys: Iterable[AdapterKey]) -> None:
        """The stages sent to `worker` that its replica's target still wants (not sent again while it does)."""
        _keep_nonempty(self.staged, worker, keys)

    def set_hosted(self, worker: str, keys: Iterable[AdapterKey]) -> None:
        """What `worker`'s host tier holds (its full report, or its deltas applied), for routing."""
        _keep_nonempty(self.hosted, worker, keys)

    def check_integrity(self) -> None:
        known = self.replica_of.keys()
        assert known == self.capacity.keys() == self.residency.keys(), "worker tables disagree"
        listed = [w for workers in self.workers.values() for w in workers]
        assert len(listed) == len(set(listed)), "a worker belongs to two replicas"
        assert set(listed) == self.replica_of.keys(), "replica worker lists and replica_of disagree"
        for replica, workers in self.workers.items():
            assert all(self.replica_of[w] == replica for w in workers), f"{replica!r} lists a foreign worker"
        index: dict[str, set[str]] = {}
        for worker, held in self.residency.items():
            for key, residency in held.items():
                assert key.name in self.catalog, f"{worker!r} holds {key}, not in the catalog"
                assert residency.refcount >= 0, f"{worker!r} holds {key} with refcount {residency.refcount}"
                index.setdefault(key.name, set()).add(worker)
        assert index == self.holders, "holders index does not match residency"
        for worker, keys in self.staged.items():
            assert worker in known and keys, f"stages kept for {worker!r} (unknown or none)"
            assert all(k.name in self.catalog for k in keys), f"{worker!r} was staged an adapter not in the catalog"
        for worker, hosted in self.hosted.items():
            assert worker in known and hosted, f"host tier kept for {worker!r} (unknown or empty)"
            assert all(k.name in self.catalog for k in hosted), f"{worker!r} hosts an adapter not in the catalog"
        for replica, queue in self.queues.items():
            assert replica in self.workers and queue, f"queue kept for {replica!r} (unknown or empty)"
            assert all(e.adapter in self.catalog for e in queue), f"{replica!r} queues an unknown adapter"
        if self._min_bytes is not None:
            assert self._min_bytes == min(a.bytes_per_rank for a in self.catalog.values()), "stale min_bytes"
        if self._max_bytes is not None:
            assert self._max_bytes == max(a.bytes_per_rank for a in self.catalog.values()), "stale max_bytes"

    def _check_new_worker(self, worker: str) -> None:
        if worker in self.replica_of:
            raise PlannerInputError(f"worker {worker!r} already belongs to replica "
                                    f"{self.replica_of[worker]!r}; remove_worker() it first to move it")

    def _unhold(self, name: str, worker: str) -> None:
        workers = self.holders[name]
        workers.discard(worker)
        if not workers:
            del self.holders[name]


def _pinned(held: Mapping[AdapterKey, Residency]) -> set[AdapterKey]:
    return {k for k, r in held.items() if r.pinned}


def _keep_nonempty(table: dict[str, frozenset[AdapterKey]], worker: str, keys: Iterable[AdapterKey]) -> None:
    """``table[worker]`` = ``keys``, or no entry at all when there are none (the tables hold non-empty sets)."""
    kept = frozenset(keys)
    if kept:
        table[worker] = kept
    else:
        table.pop(worker, None)


def _bridging(old: dict[AdapterKey, Residency], new: dict[AdapterKey, Residency]) -> bool:
    """Whether a version turned READY (or back to LOADING) while its worker holds another version of its adapter."""
    flipped = [k for k, r in new.items() if (o := old.get(k)) is not None
               and (o.state is SlotState.LOADING) != (r.state is SlotState.LOADING)]
    return any(sum(k.name == f.name for k in new) > 1 for f in flipped)
