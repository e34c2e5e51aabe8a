"""The incremental fleet-wide planner (lifecycle steps 1-4): inputs in, per-worker commands out.

Every input names its replica, and a replica whose plan inputs changed is marked dirty; `plan(now)`
replans only dirty replicas, so one queue report costs one replica's plan. Popularity changes alone
do not dirty anything: `plan_all(now)` replans every replica against current popularity (the
controller calls it on a timer). The same inputs always give the same plan: ties sort by name, and
nothing depends on set or hash order. Time is passed in (`now`, seconds of a monotonic clock).

The planner checks its inputs and keeps the books (`state.py`, `hints.py`, `horizon.py`, `popularity.py`);
re-planning, from what dirties a replica to the commands of its plan, is `replan.py`, which it composes;
what the fleet looks like now, read-only, is its `view` (`fleet_view.py`).

Not thread-safe: the controller actor serialises calls.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

from lora_cache.planner.commands import Plan
from lora_cache.planner.config import PlannerConfig
from lora_cache.planner.durable import Restored, export_state, restore_state
from lora_cache.planner.errors import PlannerInputError
from lora_cache.planner.fleet_view import FleetView
from lora_cache.planner.hints import HintBook
from lora_cache.planner.horizon import Horizon
from lora_cache.planner.popularity import Popularity
from lora_cache.planner.records import (
    AdapterInfo,
    Capacity,
    Hint,
    QueueEntry,
    ReplicaSpec,
    Residency,
    ResidencyEntry,
    SlotState,
    check_capacity,
    check_id,
    check_time,
)
from lora_cache.planner.replan import PlannerStats, Replanner
from lora_cache.planner.state import FleetState
from lora_cache.vocab import AdapterKey


class Planner:
    """Decides what every TP worker of the fleet should prefetch and evict."""

    def __init__(self, config: PlannerConfig, epoch: int, adapters: Iterable[AdapterInfo] = (),
                 replicas: Iterable[ReplicaSpec] = ()) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise PlannerInputError(f"epoch is {epoch!r}; give the controller's epoch, an int >= 0 that "
                                    "grows at every restart (workers reject commands from older epochs)")
        self.config = config
        self.epoch = epoch
        self.stats = PlannerStats()
        self._fleet = FleetState()
        self._hints = HintBook(config.hint_ttl_s, config.max_hints_per_replica, config.max_tombstones)
        self._horizon = Horizon(config.hint_horizon_s)  # far hints only fill free room
        self._popularity = Popularity(config.half_life_s, config.max_tracked_per_replica, config.rank_half_life_s,
                                      config.rank_idle_k)
        self._replan = Replanner(config, epoch, self._fleet, self._hints, self._horizon, self._popularity,
                                 self.stats)  # dirty replicas, the policy, the homes, the diff (replan.py)
        self._now: float | None = None  # the latest time given
        self.view = FleetView(self._fleet, self._hints)  # the read side: routing advice, the controller's queries
        for info in adapters:
            self.register_adapter(info)
        for spec in replicas:
            self.add_replica(spec)

    # -- catalog and topology ---------------------------------------------------------------------
    def register_adapter(self, info: AdapterInfo, ahead: bool = False) -> None:
        """Add an adapter, or make `info` its current version (older versions get evicted). An older version
        that is a device push's (``AdapterInfo.device_only``) stays where it is: given again with
        ``device_only=False`` (it landed, or was given up), it is commanded, evicted and retired as any version.
        ``ahead``: `info` is a device push's version registered ahead of its push, of an adapter registered here: not
        current, held as such an older version (where a rank loads it, commanded nowhere) until given again."""
        if not isinstance(info, AdapterInfo):
            raise PlannerInputError(f"register_adapter got {info!r}; "
                                    "pass an AdapterInfo(name, version, bytes_per_rank)")
        current = self._fleet.catalog.get(info.name)
        if ahead:
            self._fleet.require_adapter(info.name, "register_adapter(ahead=True)")
            self._fleet.device_only.add(info.key)
            return
        if (current is not None and current.version != info.version and not info.device_only
                and info.key in self._fleet.device_only):  # an older device version landed (or was given up)
            self._fleet.device_only.discard(info.key)
            self._replan.adapter_changed(info.name)
            return
        old = self._fleet.register(info)
        if old is not None and old != info:
            self._replan.adapter_changed(info.name)

    def remove_adapter(self, name: str, now: float) -> None:
        """Forget an unregistered adapter: its hints are cancelled, its queue entries, counts and
        residency dropped, and the replicas that held, queued or were hinted it replanned. The planner
        sends no command for it any more: the caller evicts it from the workers.
        """
        self.advance(now)
        self._fleet.require_adapter(name, "remove_adapter")
        self._replan.adapter_changed(name)
        for hint_id in [i for i, h in self._hints.active.items() if h.adapter == name]:
            self._hints.cancel(hint_id, now)
        self._fleet.unregister(name)
        self._popularity.forget(name)
        self._replan.forget_adapter(name)

    def add_replica(self, spec: ReplicaSpec) -> None:
        if not isinstance(spec, ReplicaSpec):
            raise PlannerInputError(f"add_replica got {spec!r}; "
                                    "pass a ReplicaSpec(replica_id, worker_ids, slots_per_worker)")
        self._fleet.add_replica(spec)
        self._replan.mark(spec.replica_id)

    def remove_replica(self, replica: str) -> None:
        self._fleet.require_replica(replica, "remove_replica")
        self._fleet.remove_replica(replica)
        self._hints.drop_replica(replica)
        self._popularity.drop_replica(replica)
        self._replan.forget_replica(replica)
        self._replan.forget_workers()

    def add_worker(self, replica: str, worker: str, slots: int, bytes_per_worker: int | None = None,
                   host_bytes: int | None = None, page_bytes: int | None = None,
                   disk_bytes: int | None = None) -> None:
        """A new (or replacement) TP rank of `replica`, holding nothing yet."""
        check_id("worker id", worker)
        capacity = Capacity(slots, bytes_per_worker, host_bytes, page_bytes, disk_bytes)
        check_capacity(f"worker {worker!r}", capacity)
        self._fleet.require_replica(replica, "add_worker")
        self._fleet.add_worker(replica, worker, capacity)
        self._replan.mark(replica)

    def set_warming(self, on: bool, read_s: Callable[[int], float | None] | None = None) -> None:
        """Whether the host tiers are warmed ahead of demand (``warming.py``): the controller turns it on once it
        has measured that a miss costs at least ``warm_min_miss_s`` more than a host hit (0: always on).
        ``read_s``: what a store read of a shard of n bytes takes as the workers timed it (None: not timed yet),
        which weighs the warm set's choice."""
        self._replan.warm_enabled = on or self.config.warm_min_miss_s == 0
        if read_s is not None:
            self._replan.warming.read_s = read_s

    @property
    def warming(self) -> bool:
        """Whether warm stages are planned now (``set_warming``)."""
        return self._replan.warm_enabled

    def remove_worker(self, worker: str) -> None:
        """A lost worker: its residency is dropped and its replica replanned."""
        self._fleet.require_worker(worker, "remove_worker")
        self._replan.mark(self._fleet.remove_worker(worker))
        self._replan.forget_workers()

    def set_capacity(self, worker: str, slots: int, bytes_per_worker: int | None = None,
                     host_bytes: int | None = None, page_bytes: int | None = None,
                     disk_bytes: int | None = None) -> None:
        """What ``worker`` may hold, as it reports it (a paged GPU pool: its bytes and page, issue 43; its part of
        its node's disk tier)."""
        capacity = Capacity(slots, bytes_per_worker, host_bytes, page_bytes, disk_bytes)
        check_capacity(f"worker {worker!r}", capacity)
        replica = self._fleet.require_worker(worker, "set_capacity")
        if self._fleet.set_capacity(worker, capacity):
            self._replan.mark(replica)

    # -- inputs -----------------------------------------------------------------------------------
    def report_queue(self, replica: str, entries: Iterable[QueueEntry], now: float) -> None:
        """A replica's waiting requests in queue order; new arrivals count towards popularity."""
        self.advance(now)
        self._fleet.require_replica(replica, "report_queue")
        queue = tuple(_queue_entry(self._fleet, replica, entry) for entry in entries)
        old = self._fleet.queues.get(replica, ())
        if queue == old:
            return
        for entry in [e for e in old if e not in set(queue)]:  # left the queue to run: its copy lingers; a waiting
            self._popularity.touch(entry.adapter, replica, now)  # one is needed, and its arrival was observed
        if queue:
            self._fleet.queues[replica] = queue
        else:
            del self._fleet.queues[replica]
        self._replan.mark(replica)
        for entry in _arrivals(old, queue):
            if self._hints.fulfil(replica, entry.adapter, now) is None:  # a hinted request counted already
                self._popularity.observe(entry.adapter, replica, now)

    def add_hint(self, hint: Hint, now: float) -> bool:
        """A router's hint; False if ignored (a known id, stale, or the replica's hint table is full)."""
        self.advance(now)
        if not isinstance(hint, Hint):
            raise PlannerInputError(f"add_hint got {hint!r}; "
                                    "pass a Hint(hint_id, adapter, replica, expected_s)")
        self._fleet.require_replica(hint.replica, f"hint {hint.hint_id!r}")
        self._fleet.require_adapter(hint.adapter, f"hint {hint.hint_id!r}")
        if not self._hints.add(hint, now):
            self.stats.hints_ignored += 1
            return False
        self._popularity.observe(hint.adapter, hint.replica, now)
        self._horizon.watch(hint, now, self._hints.active)
        self._replan.hints_changed({hint.replica})
        return True

    def cancel_hint(self, hint_id: str, now: float) -> bool:
        """Withdraw a hint (its request went elsewhere or was dropped); False if it was not active."""
        self.advance(now)
        check_id("hint id", hint_id)
        hint = self._hints.cancel(hint_id, now)
        if hint is not None:
            self._popularity.touch(hint.adapter, hint.replica, now)  # its request ran there, or is about to
            self._replan.hints_changed({hint.replica})
        return hint is not None

    def record_request(self, adapter: str, replica: str, now: float, weight: float = 1.0) -> None:
        """Count requests seen elsewhere (e.g. served without queueing); replanned lazily."""
        self.advance(now)
        self._fleet.require_replica(replica, "record_request")
        self._fleet.require_adapter(adapter, "record_request")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise PlannerInputError(f"weight of a request for {adapter!r} is {weight!r}; "
                                    "give a positive number")
        self._popularity.observe(adapter, replica, now, weight)

    def report_residency(self, worker: str, entries: Iterable[ResidencyEntry]) -> None:
        """Everything a worker holds now (replaces its previous report and the commands assumed since)."""
        replica = self._fleet.require_worker(worker, "report_residency")
        held: dict[AdapterKey, Residency] = {}
        for entry in entries:
            key, residency = _residency_entry(self._fleet, worker, entry)
            if key in held:
                raise PlannerInputError(f"worker {worker!r} reported {key} twice in one residency report; "
                                        "send one entry per adapter version")
            held[key] = residency
        self._fleet.set_staged(worker, ())  # a restarted worker's host tier is empty: stage again if needed
        if self._fleet.set_residency(worker, held):
            self._replan.mark(replica)

    def report_host(self, worker: str, staged: Iterable[AdapterKey] = (), dropped: Iterable[AdapterKey] = (),
                    full: bool = False) -> None:
        """What `worker`'s host tier holds, for routing: shards it read in (``staged``) and dropped (``dropped``),
        in that order; ``full``: ``staged`` is all of it (a full report). Adapters not registered are left out."""
        self._fleet.require_worker(worker, "report_host")
        held = set() if full else set(self._fleet.hosted.get(worker, ()))
        held |= {k for k in staged if k.name in self._fleet.catalog}
        held -= set(dropped)
        self._fleet.set_hosted(worker, held)

    def update_residency(self, worker: str, entry: ResidencyEntry) -> None:
        """One adapter version changed state on a worker (loaded, ready, acquired, released)."""
        replica = self._fleet.require_worker(worker, "update_residency")
        key, residency = _residency_entry(self._fleet, worker, entry)
        if self._fleet.put_residency(worker, key, residency):
            self._replan.mark(replica)

    def drop_residency(self, worker: str, adapter: str, version: str) -> None:
        """A worker no longer holds `adapter@version` (evicted); a no-op if it did not."""
        replica = self._fleet.require_worker(worker, "drop_residency")
        if self._fleet.put_residency(worker, AdapterKey(adapter, version), None):
            self._replan.mark(replica)

    def advance(self, now: float) -> None:
        """Move the planner's clock: expire hints (dirtying their replicas) and rescale counts."""
        check_time("now", now)
        if self._now is not None and now < self._now:
            raise PlannerInputError(f"now ({now}) is earlier than a time already given ({self._now}); pass "
                                    "one monotonic clock (e.g. time.monotonic()) to every planner call")
        self._now = now
        self._popularity.advance(now)
        self._replan.hints_changed(self._hints.expire(now) | self._horizon.due(now, self._hints.active))

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, now: float) -> Plan:
        """Replan the replicas whose inputs changed since their last plan."""
        self.advance(now)
        return self._replan.plan(now)

    def plan_all(self, now: float) -> Plan:
        """Replan every replica (picks up popularity changes)."""
        self.advance(now)
        return self._replan.plan_all(now)

    # -- surviving a controller restart (durable.py) -------------------------------------------------
    def export_state(self, max_counts: int = 4096) -> dict[str, object]:
        """Active hints, queues and popularity as plain data (residency comes from the workers)."""
        return export_state(self._hints, self._fleet.queues, self._popularity, max_counts)

    def restore_state(self, state: dict[str, object], now: float) -> Restored:
        """Merge what `export_state` gave (before a restart); the replicas it touched are replanned."""
        self.advance(now)
        restored = restore_state(state, now, self._hints, self._horizon, self._fleet.queues, self._popularity,
                                 self._fleet.catalog, self._fleet.workers)
        self._replan.restored(restored.replicas)
        return restored

    def check_integrity(self) -> None:
        self._fleet.check_integrity()
        self._hints.check_integrity()
        self._popularity.check_integrity()
        self._horizon.check_integrity(self._hints.active, self._now)
        self._replan.check_integrity()
        replicas = self._fleet.workers.keys()
        assert self._hints.by_replica.keys() <= replicas, "hints kept for an unknown replica"
        assert self._popularity.local.keys() <= replicas, "counts kept for an unknown replica"
        catalog = self._fleet.catalog
        assert all(h.adapter in catalog for h in self._hints.active.values()), "hint for an unknown adapter"
        assert self._popularity.fleet.values.keys() <= catalog.keys(), "counts for unknown adapters"


def _queue_entry(fleet: FleetState, replica: str, entry: QueueEntry | tuple[str, float]) -> QueueEntry:
    adapter, arrival_s, *named = entry
    fleet.require_adapter(adapter, f"the queue of replica {replica!r}")
    check_time(f"arrival_s of a queued request for {adapter!r} at {replica!r}", arrival_s)
    version = named[0] if named else ""
    if version:
        check_id(f"version of a queued request for {adapter!r} at {replica!r}", version)
    return QueueEntry(adapter, arrival_s, version)


def _residency_entry(fleet: FleetState, worker: str, entry: ResidencyEntry) -> tuple[AdapterKey, Residency]:
    adapter, version, state, refcount = entry
    where = f"the residency report of worker {worker!r}"
    fleet.require_adapter(adapter, where)
    check_id(f"version of {adapter!r} in {where}", version)
    if not isinstance(state, SlotState):
        raise PlannerInputError(f"state of {adapter}@{version} in {where} is {state!r}; give a SlotState "
                                f"({', '.join(s.name for s in SlotState)})")
    if isinstance(refcount, bool) or not isinstance(refcount, int) or refcount < 0:
        raise PlannerInputError(f"refcount of {adapter}@{version} in {where} is {refcount!r}; "
                                "give the number of running batches using it (an int >= 0)")
    return AdapterKey(adapter, version), Residency(state, refcount)


def _arrivals(old: tuple[QueueEntry, ...], new: tuple[QueueEntry, ...]) -> list[QueueEntry]:
    """Entries of `new` that were not in `old` (as a multiset), in queue order."""
    before = Counter(old)
    arrived = []
    for entry in new:
        if before[entry] > 0:
            before[entry] -= 1
        else:
            arrived.append(entry)
    return arrived
