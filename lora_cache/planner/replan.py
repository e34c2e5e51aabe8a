"""Re-planning (lifecycle steps 3-4): which replicas need a new plan, and making it.

A replica is *dirty* when one of its plan inputs changed since it was last planned: its topology or
capacities, a worker's residency, its queue, a catalog version it holds, queues or is hinted, or (with a
policy that reads hints) its active hints, including a far hint coming within the horizon. The planner
(`planner.py`) says what changed; this module decides which replicas that dirties and why. Popularity
alone dirties nothing: a full re-plan (`plan_all`, on the controller's timer) picks up its drift.

Planning a replica: its `ReplicaView` (residency merged over its ranks, its queue, near and far hints,
the homes of the fleet placement, refreshed first when the policy places them: `homes.py`) and its
`ReplicaScorer` go to the policy (`policies.py`); the `Target` it returns is diffed against every
worker's residency into that worker's commands (evicts, prefetches by priority, stages), which are
assumed to take effect until the worker reports otherwise. Ties sort by name: the same inputs always
give the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lora_cache.planner.commands import Plan, WorkerCommands
from lora_cache.planner.config import PlannerConfig
from lora_cache.planner.hints import HintBook
from lora_cache.planner.homes import HomeBook
from lora_cache.planner.horizon import Horizon
from lora_cache.planner.policies import POLICIES, Room
from lora_cache.planner.popularity import Popularity
from lora_cache.planner.records import Capacity, SlotState
from lora_cache.planner.staging import fitting
from lora_cache.planner.state import FleetState
from lora_cache.planner.view import ReplicaView, Target
from lora_cache.planner.warming import RANKING_MAX, WarmBook, ranking
from lora_cache.vocab import AdapterKey, Evict, Prefetch, Ranking, Stage


@dataclass
class PlannerStats:
    """Running totals for metrics."""

    plans: int = 0
    replicas_planned: int = 0
    prefetches: int = 0
    evicts: int = 0
    stages: int = 0
    warm_stages: int = 0  # speculative stages sent (warming.py), resends at each warm assignment included
    disk_stages: int = 0  # disk warm stages sent (warming.py, point 4), likewise
    hints_ignored: int = 0  # duplicates, stale, cancelled before arrival, or over the per-replica limit


class Replanner:
    """The dirty replicas, and the plans that clean them: the policy's targets diffed into commands.

    Reads the fleet, hints, horizon and counts the planner keeps; writes only the commands it sends into
    the fleet (optimistic residency and the stages still wanted), the home book and `stats`.
    """

    def __init__(self, config: PlannerConfig, epoch: int, fleet: FleetState, hints: HintBook, horizon: Horizon,
                 popularity: Popularity, stats: PlannerStats) -> None:
        self.config = config
        self.epoch = epoch
        self.stats = stats
        self.policy = POLICIES[config.policy]()
        self.homes = HomeBook(config.home_min_rate, config.home_refresh_s, config.home_spread,
                              config.home_min_window_s)  # fleet placement (homes.py)
        self.warming = WarmBook(config.warm_host_share, config.warm_refresh_s,  # host and disk tiers ahead
                                config.warm_disk_share)  # (warming.py)
        self.warm_enabled = config.warm_min_miss_s == 0  # until the controller has measured that a miss hurts
        # worker -> (assignment, warm keys sent, disk warm keys sent)
        self._warm_sent: dict[str, tuple[int, frozenset[AdapterKey], frozenset[AdapterKey]]] = {}
        self._ranked: dict[str, tuple[str, ...]] = {}  # worker -> the last ranking sent it (warming.py, point 5)
        self._ranked_at: dict[str, float] = {}  # replica -> when its ranking was last computed
        self._hottest: tuple[float, list[str]] = (-math.inf, [])  # the fleet's order (when, names), for every replica
        self.dirty: set[str] = set()  # replicas whose plan inputs changed since they were last planned
        self._fleet, self._hints, self._horizon, self._popularity = fleet, hints, horizon, popularity

    # -- what dirties a replica ---------------------------------------------------------------------
    def mark(self, replica: str) -> None:
        """`replica`'s topology, capacities, residency or queue changed."""
        self.dirty.add(replica)

    def adapter_changed(self, adapter: str) -> None:
        """A new version of `adapter`, or its removal (call before it leaves the fleet and the hints):
        the replicas that hold, queue or are hinted it."""
        fleet = self._fleet
        touched = {fleet.replica_of[w] for w in fleet.holders.get(adapter, ())}
        touched |= {r for r, q in fleet.queues.items() if any(e.adapter == adapter for e in q)}
        touched |= {h.replica for h in self._hints.active.values() if h.adapter == adapter}
        self.dirty |= touched

    def hints_changed(self, replicas: set[str]) -> None:
        """Active hints of `replicas` changed (added, cancelled, expired, turned near): replanned if the
        policy reads hints."""
        if self.policy.uses_hints:
            self.dirty |= replicas & self._fleet.workers.keys()

    def restored(self, replicas: frozenset[str]) -> None:
        """`durable.restore_state` gave `replicas` hints or queues: those whose plan reads them."""
        if self.policy.uses_hints:
            self.dirty |= replicas
        else:
            self.dirty |= {r for r in replicas if r in self._fleet.queues}

    def forget_replica(self, replica: str) -> None:
        self.dirty.discard(replica)
        self._ranked_at.pop(replica, None)

    def forget_workers(self) -> None:
        """Drop what was sent to workers no longer in the fleet (a replacement starts with an empty host tier)."""
        for worker in [w for w in self._warm_sent if w not in self._fleet.replica_of]:
            del self._warm_sent[worker]
        for worker in [w for w in self._ranked if w not in self._fleet.replica_of]:
            del self._ranked[worker]

    def forget_adapter(self, adapter: str) -> None:
        self.homes.forget(adapter)
        self.warming.forget(adapter)

    # -- planning -----------------------------------------------------------------------------------
    def plan(self, now: float) -> Plan:
        """Plan the dirty replicas."""
        return self._plan(sorted(self.dirty), now)

    def plan_all(self, now: float) -> Plan:
        """Plan every replica."""
        return self._plan(sorted(self._fleet.workers), now)

    def view(self, replica: str, now: float | None) -> ReplicaView:
        """`replica`'s planning inputs at `now` (None: no time given yet), without its homes."""
        fleet = self._fleet
        resident: set[AdapterKey] = set()
        pinned: set[AdapterKey] = set()
        for worker in fleet.workers[replica]:
            for key, residency in fleet.residency[worker].items():
                resident.add(key)
                if residency.pinned:
                    pinned.add(key)
        current = fleet.is_current  # a request naming another version wants that one (``_named``), not this one
        queued = _unique(e.adapter for e in fleet.queues.get(replica, ()) if current(e.adapter, e.version))
        hinted: tuple[str, ...] = ()
        far: tuple[str, ...] = ()
        if self.policy.uses_hints:
            near_hints, far_hints = self._horizon.split(
                [h for h in self._hints.for_replica(replica) if current(h.adapter, h.version)], now or 0.0)
            hinted = _unique(h.adapter for h in near_hints if h.adapter not in set(queued))
            far = _unique(h.adapter for h in far_hints if h.adapter not in set(queued) | set(hinted))
        return ReplicaView(replica, fleet.replica_capacity(replica), frozenset(resident),
                           frozenset(pinned), queued, hinted, fleet.catalog, fleet.min_bytes(), far,
                           max_bytes=fleet.max_bytes())

    def check_integrity(self) -> None:
        replicas = self._fleet.workers.keys()
        assert self.dirty <= replicas, f"dirty flags for unknown replicas {self.dirty - replicas}"
        assert self._warm_sent.keys() <= self._fleet.replica_of.keys(), "warm stages kept for unknown workers"
        assert self._ranked.keys() <= self._fleet.replica_of.keys(), "rankings kept for unknown workers"
        assert self._ranked_at.keys() <= replicas, "ranking times kept for unknown replicas"
        self.warming.check_integrity(self._fleet)

    def _plan(self, replicas: list[str], now: float) -> Plan:
        out: list[WorkerCommands] = []
        homes = self._home_book(now) if replicas else None
        warm = self._warm_book(now) if replicas else None
        for replica in replicas:
            out += self._plan_replica(replica, homes, warm, now)
            self.dirty.discard(replica)
        self.stats.plans += 1
        self.stats.replicas_planned += len(replicas)
        return Plan(self.epoch, tuple(replicas), tuple(out))

    def _home_book(self, now: float) -> HomeBook | None:
        """The homes (homes.py), brought up to date, if the config places them and the policy uses them."""
        if not (self.config.place_homes and self.policy.uses_homes):
            return None
        self.homes.refresh(self._fleet, self._popularity, now)
        return self.homes

    def _warm_book(self, now: float) -> WarmBook | None:
        """The warm placement (warming.py), brought up to date, if the config warms and the policy plans fleet-wide."""
        if not (self.warm_enabled and self.config.warm_host_share > 0 and self.policy.uses_homes):
            return None
        self.warming.refresh(self._fleet, self._popularity.fleet, now)
        return self.warming

    def _plan_replica(self, replica: str, homes: HomeBook | None, warm: WarmBook | None,
                      now: float) -> list[WorkerCommands]:
        fleet = self._fleet
        scorer = self._popularity.scorer(replica, len(fleet.workers), self.config.local_weight,
                                         fleet.catalog, fleet.min_bytes(), now,
                                         fleet.replica_capacity(replica).gpu_bytes)  # per page-rounded byte
        view = self.view(replica, now)
        if self.config.linger_s > 0 and now is not None:
            recent = self._popularity.recent(replica, now, self.config.linger_s)
            view = view._replace(lingering=frozenset(k for k in view.resident if k.name in recent))
        if homes is not None:
            view = view._replace(homes=homes.homes(replica), last_copies=self._last_copies(replica, view, homes))
        target = self.policy.target(view, scorer, self.config)
        if target is None:
            return []
        warm_keys: tuple[AdapterKey, ...] = ()
        disk_keys: tuple[AdapterKey, ...] = ()
        if warm is not None:
            taken = set(target.keys) | set(target.staged) | view.resident  # a rank holds it: its host tier too
            warm_keys = self._warm_fitting(view, target, tuple(k for k in warm.warm(replica) if k not in taken))
            taken |= set(warm_keys)
            disk_keys = tuple(k for k in warm.warm_disk(replica) if k not in taken)
        bridges = self._bridges(replica, target)
        named = self._named(replica, target, now)
        ranked = self._ranking(replica, view, now) if warm is not None else None
        diffs = (self._diff(worker, replica, target, warm_keys, bridges, named, disk_keys, ranked)
                 for worker in fleet.workers[replica])
        return [commands for commands in diffs if commands is not None]

    def _ranking(self, replica: str, view: ReplicaView, now: float) -> tuple[str, ...] | None:
        """The fleet's ranking for ``replica``'s workers (warming.py, point 5), at most every ``rank_refresh_s``
        (None between: nothing new to send)."""
        if now - self._ranked_at.get(replica, -math.inf) < self.config.rank_refresh_s:
            return None
        self._ranked_at[replica] = now
        at, names = self._hottest
        if now - at >= self.config.rank_refresh_s:  # once per refresh for the whole fleet: each replica truncates it
            names = self._popularity.hottest(now, RANKING_MAX)
            self._hottest = (now, names)
        return ranking(self._fleet, names, view.capacity.host_bytes, self.warming.warm(replica))

    def _named(self, replica: str, target: Target, now: float) -> tuple[AdapterKey, ...]:
        """The versions other than the current one that ``replica``'s waiting requests name (``A@VERSION``, issue
        44 item 3), then its near hints', in queue (then expected) order: wanted there beside the target, after
        its keys (prefetched where room is left, and not evicted while a request waits for them)."""
        fleet = self._fleet
        named = [AdapterKey(e.adapter, e.version) for e in fleet.queues.get(replica, ()) if e.version]
        if self.policy.uses_hints:
            near, _ = self._horizon.split(self._hints.for_replica(replica), now)
            named += [AdapterKey(h.adapter, h.version) for h in near if h.version]
        keys = set(target.keys)
        return tuple(k for k in dict.fromkeys(named) if k not in keys and not fleet.is_current(k.name, k.version))

    def _warm_fitting(self, view: ReplicaView, target: Target, keys: tuple[AdapterKey, ...]) -> tuple[AdapterKey, ...]:
        """The prefix of the warm ``keys`` whose bytes fit the host tier beside the target's own stages: what a
        worker is told to keep staged never exceeds its host tier (the warm book's share is of the whole tier)."""
        host = view.capacity.host_bytes
        if host is None:
            return ()
        return fitting(view, keys, host - sum(self._fleet.bytes_of(k) for k in target.staged))

    def _last_copies(self, replica: str, view: ReplicaView, homes: HomeBook) -> frozenset[AdapterKey]:
        """``replica``'s residents that no other replica holds, of adapters with requests, while the fleet's slots
        hold the catalog (every adapter has a place): homes may not displace them (``policies._homes``)."""
        if not homes.holds_catalog:
            return frozenset()
        fleet, counts = self._fleet, self._popularity.fleet
        return frozenset(key for key in view.resident if counts.get(key.name) > 0
                         and all(fleet.replica_of[w] == replica for w in fleet.holders.get(key.name, ())))

    def _bridges(self, replica: str, target: Target) -> frozenset[AdapterKey]:
        """The older versions ``replica`` serves its target's adapters at until their current versions are READY on
        every rank: for each target key not READY (or in use) on all its workers, the other versions of that adapter
        that are. A new version becomes the replica's default only when every rank holds it READY (the engine
        admits a request at the version READY everywhere: ``workers.attach.versions``), so the one it replaces stays
        until then (issue 44 item 3), unless the new one needs its room (``_diff``)."""
        residencies = [self._fleet.residency[w] for w in self._fleet.workers[replica]]
        if not residencies:
            return frozenset()
        names = {k.name: k for k in target.keys}
        older = {k for k in residencies[0] if k.name in names and k != names[k.name]}
        if not older:
            return frozenset()

        def everywhere(key: AdapterKey) -> bool:
            return all((r := held.get(key)) is not None and r.state is not SlotState.LOADING for held in residencies)

        return frozenset(k for k in older if everywhere(k) and not everywhere(names[k.name]))

    def _diff(self, worker: str, replica: str, target: Target, warm: tuple[AdapterKey, ...] = (),
              bridges: frozenset[AdapterKey] = frozenset(),
              named: tuple[AdapterKey, ...] = (), disk: tuple[AdapterKey, ...] = (),
              ranked: tuple[str, ...] | None = None) -> WorkerCommands | None:
        """One worker's commands to move from what it holds to `target`, within its own capacity.

        Stages go once per stretch of time that the target wants them: a key is staged again only after
        it has left the target's stages (loaded, or no longer needed) and come back. Warm stages (``warm``,
        speculative, after the target's) go once per warm assignment: sent again at each, a stage of a shard
        still on the host refreshes its place in the LRU, and one the LRU dropped is read again. Disk warm stages
        (``disk``: store adapters fetched into the node's disk tier only) go last, once per warm assignment too."""
        fleet = self._fleet
        held = fleet.residency[worker]
        keys = _with_named(target, named, fleet.capacity[worker], fleet.bytes_of)
        wanted = set(keys)
        pushed = fleet.device_only  # device pushes not landed: kept where held, never loaded by a command
        evicts = sorted(k for k, r in held.items()
                        if k not in wanted and not r.pinned and k not in bridges and k not in pushed)
        room = Room(fleet.capacity[worker])
        for key in held.keys() - set(evicts):
            room.take(fleet.bytes_of(key))
        # bridges may make room for new versions (a device push's not: it is kept where held until it lands)
        kept = sorted(k for k in bridges if k in held and not held[k].pinned and k not in pushed)
        while room.over() and (spare := [k for k in kept if k not in named]):  # a worker over its capacity (it
            bridge = spare.pop()  # reported more than it holds room for): a bridge is not needed, so it goes first
            kept.remove(bridge)
            evicts.append(bridge)
            room.give(fleet.bytes_of(bridge))
        prefetches: list[tuple[int, AdapterKey]] = []
        for priority, key in enumerate(keys):
            # a bridge gives way to its own new version, unless a waiting request or a hint names it
            mine = [k for k in kept if k.name == key.name and key not in named and k not in named]
            while key not in held and not room.fits(fleet.bytes_of(key)) and mine:
                bridge = mine.pop()  # its own new version needs the room: requests wait for it, as without one
                kept.remove(bridge)
                evicts.append(bridge)
                room.give(fleet.bytes_of(bridge))
            if key not in held and key not in pushed and room.fits(fleet.bytes_of(key)):
                room.take(fleet.bytes_of(key))
                prefetches.append((priority, key))
        evicts.sort()
        sent = fleet.staged.get(worker, frozenset())
        staging = [key for key in target.staged if key not in held and key not in pushed]
        stages = [(len(keys) + i, key) for i, key in enumerate(staging) if key not in sent]
        warming = [key for key in warm if key not in held and key not in pushed]
        assignment, warm_sent, disk_sent = self._warm_sent.get(worker, (-1, frozenset(), frozenset()))
        if assignment != self.warming.assignments:
            warm_sent = disk_sent = frozenset()
        rank = None
        if ranked is not None and ranked != self._ranked.get(worker, ()):  # sent where it changed (warming.py, 5)
            self._ranked[worker] = ranked
            rank = Ranking(ranked, self.epoch)
        first = len(keys) + len(staging)
        speculative = [(first + i, key) for i, key in enumerate(warming) if key not in warm_sent]
        first += len(warming)
        to_disk = [(first + i, key) for i, key in enumerate(k for k in disk if k not in held and k not in pushed)
                   if key not in disk_sent]
        self._warm_sent[worker] = (self.warming.assignments, warm_sent | {k for _, k in speculative},
                                   disk_sent | {k for _, k in to_disk})
        fleet.set_staged(worker, staging)  # warm stages: routing counts them once the worker reports them read
        if not evicts and not prefetches and not stages and not speculative and not to_disk and rank is None:
            return None
        fleet.apply(worker, evicts, [key for _, key in prefetches])
        self.stats.evicts += len(evicts)
        self.stats.prefetches += len(prefetches)
        self.stats.stages += len(stages)
        self.stats.warm_stages += len(speculative)
        self.stats.disk_stages += len(to_disk)
        return WorkerCommands(
            worker, replica,
            tuple(Evict(k.name, k.version, self.epoch) for k in evicts),
            tuple(Prefetch(k.name, k.version, p, self.epoch) for p, k in prefetches),
            tuple(Stage(k.name, k.version, p, self.epoch) for p, k in stages)
            + tuple(Stage(k.name, k.version, p, self.epoch, speculative=True) for p, k in speculative)
            + tuple(Stage(k.name, k.version, p, self.epoch, speculative=True, disk=True) for p, k in to_disk),
            rank)


def _with_named(target: Target, named: tuple[AdapterKey, ...], capacity: Capacity,
                bytes_of: Callable[[AdapterKey], int]) -> tuple[AdapterKey, ...]:
    """The keys a worker is to hold, most urgent first: the target's demanded keys (pinned, queued, hinted), then the
    versions waiting requests and hints name (``named``), then the target's other keys (incumbents kept, speculation,
    homes) that still fit beside them: a version a request waits for outranks what is kept for its value alone."""
    if not named:
        return target.keys
    demanded = len(target.keys) if target.demanded < 0 else target.demanded
    room = Room(capacity)
    keys = []
    for key in (*target.keys[:demanded], *named):
        room.take(bytes_of(key))
        keys.append(key)
    for key in target.keys[demanded:]:
        if room.fits(bytes_of(key)):
            room.take(bytes_of(key))
            keys.append(key)
    return tuple(keys)


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))
