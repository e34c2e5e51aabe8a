"""The controller's core, plain Python: catalog + planner + readiness index (lifecycle steps 2-4, 7-8).

The Ray actor in ``actor.py`` forwards to this class and sends what it returns (``links.py``). Every input
is checked here first, so a bad report or hint is a clear error and changes nothing.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import AdapterSpec, KnownVersion
from lora_cache.adapters.refs import split_unchecked, version_of
from lora_cache.adapters.shards import shard_layout
from lora_cache.controller.admission import ReportAdmission, ResidencyRow
from lora_cache.controller.lost_ranks import LostRanks
from lora_cache.controller.readiness import RankState, ReadinessEvent, ReadinessIndex
from lora_cache.errors import ConfigError, LoraCacheError, NotFoundError
from lora_cache.planner import (
    AdapterInfo,
    FleetView,
    Hint,
    Planner,
    PlannerConfig,
    QueueEntry,
    ReplicaSpec,
    ResidencyEntry,
    SlotState,
)
from lora_cache.routing.advice import RouteAdvice, RouteRequest, advise
from lora_cache.routing.clock import LoadClock
from lora_cache.routing.limits import RoutingLimits
from lora_cache.routing.ranking import RouterConfig
from lora_cache.vocab import AdapterKey, Command, Prefetch, WorkerId, capacity_of

MAX_TP = 64  # ranks per replica: a replica's shape is checked against these before anything is kept
MAX_SLOTS = 65_536  # slots per rank


def check_shape(replica: str, tp: object, slots: object) -> None:
    """A replica's shape as a worker or an attached rank declares it: bounded integers (ConfigError naming the
    field, the value and the bound: a forged ``tp=100000`` cost the controller 100 MB)."""
    for what, value, bound in (("tp", tp, MAX_TP), ("slots", slots, MAX_SLOTS)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
            raise ConfigError(f"replica {replica!r}: {what} is {str(value)[:40]}; give an integer from 1 to {bound}")


NO_ROOM_RETRY_S = 0.5  # a prefetch that found no room is planned again after this (a batch's end frees a slot)


class Failure(NamedTuple):
    """A load that failed on a worker: how often in a row, when to try again, and why."""

    times: int  # failures in a row
    retry_at: float
    error: str
    released: bool = False  # retry_failed let the planner plan it again


@dataclass(frozen=True)
class HintRejection:
    """One hint of a batch that was not taken because it is wrong (an unknown adapter or replica).
    A dataclass: a NamedTuple field may not be called ``index``."""

    index: int  # its position in the batch
    hint_id: str
    error: LoraCacheError  # what was wrong and the fix


class HintOutcome(NamedTuple):
    """What became of one caller's hint batch, hint by hint: a wrong hint is rejected alone, the rest are
    taken or ignored (a bad item never costs the good ones beside it)."""

    accepted: int
    ignored: int  # known ids, stale, or the replica's hint table full
    rejections: tuple[HintRejection, ...] = ()


def named_versions(view: FleetView, adapter: str) -> set[str]:
    """The versions of ``adapter`` that waiting requests or active hints name (issue 44 item 3): kept loadable while
    they do, whatever their age (``AdapterCatalog.use``)."""
    named = {e.version for r in view.replicas() for e in view.queue(r) if e.adapter == adapter and e.version}
    return named | {h.version for r in view.replicas() for h in view.hints(r) if h.adapter == adapter and h.version}


def _checked(memo: dict[str, LoraCacheError | None], check: Callable[[str], None], name: str) -> LoraCacheError | None:
    """Why ``check(name)`` refuses ``name`` (None: it passes), asked once per name (a batch names few, often)."""
    if name not in memo:
        try:
            check(name)
            memo[name] = None
        except LoraCacheError as e:
            memo[name] = e
    return memo[name]


@dataclass(frozen=True)
class ControllerConfig:
    """The controller: its catalog, its planner and how it batches."""

    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


log = logging.getLogger(__name__)
HOST_STATES = ("staged", "unstaged")  # a worker's host tier gained or dropped a shard (its slots did not change)

# one change a worker reported: (adapter, version, state, error[, read_s[, acquired]]) (``vocab.DeltaRow`` less its seq)
ReportRow = tuple[str, str, str, str] | tuple[str, str, str, str, float] | tuple[str, str, str, str, float, bool]

_STATE = {"loading": (RankState.LOADING, SlotState.LOADING), "ready": (RankState.READY, SlotState.READY),
          "in_use": (RankState.READY, SlotState.IN_USE)}  # a refused evict: held by a running batch


def set_gpu_capacity(planner: Planner, worker: WorkerId, capacity: str) -> None:
    """``worker``'s GPU pool now holds this many bytes for adapters ("GPU_BYTES:PAGE_BYTES", a "capacity" delta's
    version: issue 43 item 3, a pool that lent pages to its engine or took them back): the planner counts its room
    in them from its next plan. A malformed figure is logged and ignored (the rank's next full report repairs it),
    never fatal to the rest of its report."""
    try:
        gpu_bytes, page_bytes = capacity_of(capacity)
    except ValueError as e:
        log.warning("worker %s reported a GPU capacity the controller cannot read: %s", worker, e)
        return
    _set_gpu_bytes(planner, worker, gpu_bytes, page_bytes)


def _set_gpu_bytes(planner: Planner, worker: WorkerId, gpu_bytes: int | None, page_bytes: int | None) -> None:
    """``worker``'s GPU pool bytes and page, kept as the planner's capacity (its slots and host tier unchanged)."""
    have = planner.view.capacity(str(worker))
    if (have.bytes, have.page_bytes) != (gpu_bytes, page_bytes):
        planner.set_capacity(str(worker), have.slots, gpu_bytes, have.host_bytes, page_bytes, have.disk_bytes)


class ControllerCore:
    """What the controller knows and decides; no Ray, no clocks (``now`` is passed in)."""

    def __init__(self, config: ControllerConfig, epoch: int) -> None:
        self.config, self.epoch = config, epoch
        self.catalog = AdapterCatalog(config.catalog)
        self.planner = Planner(config.planner, epoch)
        self.readiness = ReadinessIndex(start_seq=epoch)
        # an older version some rank holds, or a waiting request or a hint names, stays loadable
        self.catalog.use(lambda adapter: self.readiness.versions_held(adapter) | named_versions(self.planner.view,
                                                                                                adapter))
        self.named: set[str] = set()  # adapters some queue or hint named a version of since the last retirement
        # a version retired moments ago that a queue report or hint names: kept again if it can be (``Pushes.revive``)
        self.revive: Callable[[str, str], bool] = lambda name, ref: False
        self.paths: dict[str, str] = {}  # adapter -> registered path, replayed to new workers
        self.commands_sent = 0
        self.failures: dict[tuple[WorkerId, str, str], Failure] = {}  # (worker, adapter, version) -> last failure
        self.load_failures = 0
        self.prefetch_no_room = 0  # prefetches a rank had no room for (every slot held): not failures
        self.recent_failures: deque[str] = deque(maxlen=20)
        self.hints_received = self.hints_accepted = 0  # hints given / taken (the rest ignored)
        self.routes_asked = 0  # requests routing advice was asked for
        self.lost = LostRanks()  # ranks lost and not heard from since, plans withheld from their replicas
        self.limits = RoutingLimits()  # replicas' admission limits and the requests routed there (routing advice)
        # measured load times and requests' leads (routing advice: an idle replica READY by arrival ranks first)
        self.clock = LoadClock(config.router.cold_s, config.router.staged_s)
        # residency a rank claims and the controller believes (registered versions it commanded, the rank acquired or a
        # restart adopted, within its slots), refusals counted
        self.admission = ReportAdmission(self.catalog, self.planner.view, self.readiness)

    # -- adapters and topology ------------------------------------------------------------------
    def register_adapter(self, name: str, path: str) -> str:
        """Read, validate and hash the adapter at ``path`` and make it the current version of ``name`` (both
        halves at once: the actor runs ``read_adapter`` on a thread and ``add_adapter`` on its loop)."""
        return self.add_adapter(self.read_adapter(name, path), path)

    def read_adapter(self, name: str, path: str, known: KnownVersion | None = None,
                     carried: bool = False) -> AdapterSpec:
        """The expensive half of a registration (the files read, validated and hashed): changes nothing, so
        it may run on any thread. ``known``: a version hashed before (a restored catalog's), taken without
        reading the weights if the file is provably the one hashed; ``carried``: a store version's config and
        header taken from ``known`` without asking the store (a restore, ``catalog_store``)."""
        return self.catalog.read(name, path, known, carried)

    def add_adapter(self, spec: AdapterSpec, path: str) -> str:
        """The cheap half: ``spec`` (from ``read_adapter``) becomes the current version of its name, the planner
        learns its shard size; ``path`` is what workers are given. Its version."""
        layout = shard_layout(spec, self.catalog.shape, 1, 0, torch.bfloat16)  # before any change: it may refuse
        self.catalog.add(spec)
        self.planner.register_adapter(AdapterInfo(spec.name, spec.version, layout.nbytes,  # a store's: its object,
                                                  spec.store.size if spec.store is not None else 0,  # disk-warmed
                                                  spec.device_only))  # a device push's, until it lands
        self.paths[spec.name] = path
        return spec.version

    def unregister_adapter(self, name: str, now: float) -> str:
        """Stop all new use of ``name`` (hints, queues, plans); its version. The caller drains the workers."""
        spec = self.catalog.unregister(name)
        self.planner.remove_adapter(name, now)
        self.paths.pop(name, None)
        return spec.version

    def add_replica(self, replica: str, tp: int, slots: int, host_bytes: int | None = None,
                    gpu_bytes: int | None = None, page_bytes: int | None = None,
                    disk_bytes: int | None = None) -> list[WorkerId]:
        """Idempotent: a replica already adopted from its workers' reports is kept as it is, but for the bytes of
        a paged GPU pool its workers report (issue 43). ``host_bytes``: each rank's host tier as the workers report
        it (bounds predictive staging); ``gpu_bytes`` / ``page_bytes``: each rank's GPU pool and its page, where
        it has pages (the planner counts GPU room in bytes, a shard in whole pages; else in slots); ``disk_bytes``:
        each rank's part of its node's disk tier (bounds disk warming)."""
        check_shape(replica, tp, slots)
        workers = [WorkerId(replica, k) for k in range(tp)]
        if replica in self.planner.view.replicas():
            if self.planner.view.workers(replica) != tuple(map(str, workers)):
                raise ConfigError(f"replica {replica!r} already exists with workers "
                                  f"{self.planner.view.workers(replica)}; remove it before changing its TP size")
            if (have := self.planner.view.capacity(str(workers[0])).slots) != slots:
                raise ConfigError(f"replica {replica!r} already exists with {have} slots per worker, not {slots}; "
                                  f"give every rank of a replica the same num_slots ({have})")
        else:
            self.planner.add_replica(ReplicaSpec(replica, tuple(map(str, workers)), slots,
                                                 host_bytes_per_worker=host_bytes, disk_bytes_per_worker=disk_bytes))
            self.readiness.add_replica(replica, tp)
        for wid in workers if gpu_bytes is not None else ():
            _set_gpu_bytes(self.planner, wid, gpu_bytes, page_bytes)
        return workers

    def remove_replica(self, replica: str) -> list[ReadinessEvent]:
        """A replica with no rank left (its attached ranks detached or died): it leaves the fleet (plans,
        routes, hints, queues, readiness). Its readiness ends with NOT_READY events."""
        self.check_replica(replica)
        self.planner.remove_replica(replica)
        self.lost.forget_replica(replica)
        self.failures = {k: f for k, f in self.failures.items() if k[0].replica != replica}
        self.limits.forget(replica)
        self.admission.claims.forget_replica(replica)
        return self.readiness.remove_replica(replica)

    def worker_lost(self, worker: WorkerId, gone: bool = True, now: float = 0.0,
                    cause: str = "") -> list[ReadinessEvent]:
        """A worker died or restarted empty: drop what it held, the replica is replanned. ``gone``: it is dead,
        hung or detached (not a restart that answers): its replica takes no routed requests until the worker
        is heard from again (a report or a full report); ``now``: when it was found lost (``lost_at``); ``cause``: how
        (``status()["loss_causes"]``)."""
        self.check_worker(worker)
        if gone:
            self.lost.lose(worker, now, cause)
        else:  # a new incarnation: what vouched for its predecessor's loads vouches for nothing it holds
            self.admission.claims.forget(worker)
        self.planner.report_residency(str(worker), [])
        self.planner.report_host(str(worker), full=True)  # a restart's host tier is empty; a hung one's is resynced
        self.failures = {k: f for k, f in self.failures.items() if k[0] != worker}
        self.clock.forget(str(worker))
        return self.readiness.drop_rank(worker.replica, worker.rank)

    # -- inputs (steps 1-3) ---------------------------------------------------------------------
    def report_queue(self, replica: str, adapters: Iterable[tuple[str, float]], now: float) -> None:
        """A replica's waiting requests, each ``(A, arrival)`` or ``(A@REF, arrival)`` for a request naming one
        version (``adapters/refs.py``): that version is kept and prefetched there while it waits. An unknown adapter
        fails the report; a version no longer kept only its own entry (its request fails alone at admission)."""
        self.check_replica(replica)
        entries = []
        for ref, t in adapters:
            name, tag = split_unchecked(ref)  # checked below: an unknown name fails the report
            self.check_adapter(name)
            try:
                entries.append(QueueEntry(name, t, version_of(self.catalog, name, tag, self.revive) if tag else ""))
            except LoraCacheError:
                continue  # not kept (any more): its request fails alone, naming the versions kept
        before = self.planner.view.queue(replica)
        self.planner.report_queue(replica, entries, now)
        self.named |= {e.adapter for e in (*before, *entries) if e.version}  # retired once nothing names them

    def hint(self, hint_id: str, adapter: str, replica: str, expected_s: float, now: float) -> bool:
        self.check_replica(replica)
        self.check_adapter(adapter)
        taken = replica not in self.lost.replicas() and self.planner.add_hint(Hint(hint_id, adapter, replica,
                                                                                    expected_s), now)
        self.hints_received += 1
        self.hints_accepted += taken
        return taken

    def hint_batches(self, batches: Iterable[list[tuple[str, str, str, float]]], now: float) -> list[HintOutcome]:
        """Many callers' batches of (hint id, adapter, replica, expected in s) at once, each hint by itself."""
        return [self._hint_batch(batch, now) for batch in batches]

    def _hint_batch(self, batch: list[tuple[str, str, str, float]], now: float) -> HintOutcome:
        replicas: dict[str, LoraCacheError | None] = {}  # name -> why it cannot be hinted (None: it can); once each
        adapters: dict[str, LoraCacheError | None] = {}
        hints: list[Hint] = []
        rejected: list[HintRejection] = []
        for i, (hint_id, adapter, replica, dt) in enumerate(batch):
            name, tag = split_unchecked(adapter)  # ``A@REF``: one version of A, checked below (a rejection of its own)
            error = _checked(replicas, self.check_replica, replica) or _checked(adapters, self.check_adapter, name)
            try:
                version = version_of(self.catalog, name, tag, self.revive) if tag and error is None else ""
            except LoraCacheError as e:
                error = e
            if error is not None:
                rejected.append(HintRejection(i, hint_id, error))
                continue
            self.clock.lead(dt)
            hints.append(Hint(hint_id, name, replica, now + max(0.0, dt), version))
            if version:
                self.named.add(name)
        down = self.lost.replicas()  # a hint to a replica with a lost rank is ignored: nothing is planned there
        taken = sum(hint.replica not in down and self.planner.add_hint(hint, now) for hint in hints)
        self.hints_received += len(hints)  # the rejected never reached the planner
        self.hints_accepted += taken
        return HintOutcome(taken, len(hints) - taken, tuple(rejected))

    def cancel_hint(self, hint_id: str, now: float) -> bool:
        return self.planner.cancel_hint(hint_id, now)

    def worker_report(self, worker: WorkerId, deltas: Iterable[ReportRow], now: float) -> list[ReadinessEvent]:
        """(adapter, version, state, error[, read_s]) changes from one worker; returns replica-level events (step 8).
        ``read_s`` of a READY: the seconds its load read the shard from storage (the warming gate's sample).

        A worker that reports is alive (its replica routable again, if it was lost).
        A worker that refused an evict (the adapter is loading or in use) says so with its state,
        "in_use" for a running batch's: the planner counts it pinned until the worker's next report.

        A failed load is not replanned at once (a broken file would be retried in a tight loop): the
        planner keeps counting it as loading until ``retry_failed`` releases it, after a backoff that
        doubles with every failure of the same adapter version on the same worker (up to a minute).
        """
        self.check_worker(worker)
        self.lost.heard_from(worker)
        events: list[ReadinessEvent] = []
        for adapter, version, state, error, *rest in deltas:
            read, acquired = rest[:1], len(rest) > 1 and rest[1] is True
            if state == "capacity":  # its GPU pool lent pages to its engine or took them back (issue 43 item 3)
                set_gpu_capacity(self.planner, worker, version)
                continue
            if state in HOST_STATES:  # its host tier, apart from the slots: routing's, no readiness
                shard = [AdapterKey(adapter, version)]
                if state == "staged":
                    self.planner.report_host(str(worker), staged=shard)
                else:
                    self.planner.report_host(str(worker), dropped=shard)
                continue
            rank_state, slot_state = _STATE.get(state, (None, None))
            key = (worker, adapter, version)
            if state == "failed":
                times = self.failures[key].times + 1 if key in self.failures else 1
                self.failures[key] = Failure(times, now + min(60.0, 0.5 * 2 ** (times - 1)), error)
                self.load_failures += 1
                self.recent_failures.append(f"{worker} {adapter}@{version}: {error}")
            elif state == "no_room":  # every slot held by running batches: tried again soon, no failure counted
                self.failures[key] = Failure(0, now + NO_ROOM_RETRY_S, error)
                self.prefetch_no_room += 1
            elif state == "ready":
                self.failures.pop(key, None)
                self.clock.ready(str(worker), adapter, version, now)
                if read and read[0] > 0 and adapter in self.catalog:
                    self.clock.read(self.planner.view.shard_bytes(worker.replica, adapter), float(read[0]))
            if state in ("gone", "failed", "no_room"):
                self.clock.dropped(str(worker), adapter, version)
            believed = rank_state is None or self.admission.admits(worker, adapter, version, acquired)
            if state == "gone":
                self.planner.drop_residency(str(worker), adapter, version)
            elif slot_state is not None and adapter in self.catalog and believed:  # an unregistered one: drained
                self.planner.update_residency(str(worker), ResidencyEntry(adapter, version, slot_state))
            if believed:  # a claim refused reaches neither the readiness index nor the planner (Route's view)
                events += self.readiness.report(worker.replica, worker.rank, adapter, version, rank_state)
        return events

    def sync_worker(self, worker: WorkerId, entries: Iterable[ResidencyRow],
                    host: Iterable[tuple[str, str]] | None = None, adopting: bool = False) -> list[ReadinessEvent]:
        """A full residency report (controller restart, or a resync after lost deltas): it replaces what
        was known of the worker, including commands assumed done. Readiness changes only where the
        report differs, so a resync that finds nothing new publishes nothing. ``host``: what its host tier
        holds (None: a rank that does not report it; what its deltas said is kept). Only what ``admission``
        believes counts (``adopting``: a restarted controller's first report of the rank, believed for
        registered versions within its slots, once: ``claims.py``)."""
        self.check_worker(worker)
        self.lost.heard_from(worker)  # it answered with its full report: alive
        if host is not None:
            self.planner.report_host(str(worker), [AdapterKey(a, v) for a, v in host], full=True)
        before = self.readiness.holdings(worker.replica, worker.rank)
        believed = self.admission.admitted(worker, [e for e in entries if e[2] in _STATE], before, adopting)
        planned = [ResidencyEntry(a, v, SlotState.IN_USE if refs else _STATE[s][1], refs)
                   for a, v, s, refs in believed if a in self.catalog]
        held = {(e.adapter, e.version) for e in planned}
        planned += [ResidencyEntry(a, v, SlotState.LOADING) for (w, a, v), f in sorted(self.failures.items())
                    if w == worker and not f.released and (a, v) not in held and a in self.catalog]  # backing off
        self.planner.report_residency(str(worker), planned)  # every slot it fills counts (an evict may follow)
        now = {(a, v): _STATE[s][0] for a, v, s, _ in believed}
        events: list[ReadinessEvent] = []
        for (a, v) in sorted(before.keys() - now.keys()):
            events += self.readiness.report(worker.replica, worker.rank, a, v, None)
        for (a, v), state in sorted(now.items(), key=lambda kv: kv[0]):
            if before.get((a, v)) is not state:
                events += self.readiness.report(worker.replica, worker.rank, a, v, state)
        return events

    def retry_failed(self, now: float) -> None:
        """Failed loads whose backoff has passed are no longer counted as loading: the next plan retries."""
        for key, failure in list(self.failures.items()):
            worker, adapter, version = key
            if failure.retry_at <= now and not failure.released:
                self.failures[key] = failure._replace(released=True)
                view = self.planner.view
                if worker.replica in view.replicas() and str(worker) in view.workers(worker.replica):
                    self.planner.drop_residency(str(worker), adapter, version)
                else:
                    del self.failures[key]

    # -- decisions (steps 3-4) ------------------------------------------------------------------
    def plan(self, now: float, full: bool = False) -> dict[WorkerId, list[Command]]:
        self.planner.set_warming(self.clock.miss_hurts(self.planner.view.max_bytes(),
                                                       self.config.planner.warm_min_miss_s), self.clock.read_s)
        plan = self.planner.plan_all(now) if full else self.planner.plan(now)
        out: dict[WorkerId, list[Command]] = {}
        down = self.lost.replicas()
        for w in plan.workers:
            replica, rank = w.worker.rsplit("/", 1)
            if replica in down:  # a replica with a lost rank gets no plans until it is whole again
                self.lost.withheld.add(WorkerId(replica, int(rank)))
                continue
            out[WorkerId(replica, int(rank))] = list(w.commands)
            self.admission.claims.commanded(WorkerId(replica, int(rank)), w.commands,
                                            self.planner.view.capacity(w.worker).slots)
            self.commands_sent += len(w.commands)
            self._time_prefetches(w.worker, replica, w.commands, now)
        return out

    def _time_prefetches(self, worker: str, replica: str, commands: Iterable[Command], now: float) -> None:
        """The clock times every prefetch sent, from here to the rank's READY report (routing's load times)."""
        view = self.planner.view
        for c in commands:
            if isinstance(c, Prefetch) and c.adapter in self.catalog:
                info = view.adapter(c.adapter)
                staged = view.holding(worker, info.key)[1] if info.version == c.version else False
                self.clock.sent(worker, c.adapter, c.version, view.shard_bytes(replica, c.adapter), staged, now)

    def route(self, items: list[RouteRequest], loads: dict[str, float] | None = None,
              finished: Iterable[tuple[str, str]] = ()) -> list[RouteAdvice]:
        """Routing advice (step 1): replicas ranked for each request's adapter, from residency, the plan in
        flight, queues and hints (``lora_cache.routing.advice``); ``loads``: the router's own in-flight counts;
        ``finished``: its requests that finished since its last call, (replica, adapter) each (``RoutingLimits.finish``:
        the adapters in flight are then the ones still running, not the newest picks).
        The shards the ranks reported in their host tiers count as staged only where a miss hurts (warming on:
        the workers' reads measured slow, ``LoadClock.miss_hurts``): on a store the page cache holds, a host copy
        saves a few ms, and ranking it above a cold replica cost the routing grid's uniform-m4 fleet its p99
        (1.12x the best simple router against 1.05 allowed)."""
        self.routes_asked += len(items)
        self.limits.finish(finished)
        return advise(self.planner.view, items, self.config.router, loads, down=self.lost.replicas(),
                      limits=self.limits, clock=self.clock, hosted=self.planner.warming,
                      resolve=lambda name, ref: version_of(self.catalog, name, ref))

    def status(self) -> dict[str, object]:
        return {"epoch": self.epoch, "adapters": len(self.catalog), "replicas": list(self.planner.view.replicas()),
                "readiness": self.readiness.counts(), "commands_sent": self.commands_sent,
                "queue_depths": {r: len(self.planner.view.queue(r)) for r in self.planner.view.replicas()},
                "hints_received": self.hints_received, "hints_accepted": self.hints_accepted,
                "active_hints": {r: len(self.planner.view.hints(r)) for r in self.planner.view.replicas()},
                "routes_asked": self.routes_asked,
                "load_failures": self.load_failures, "prefetch_no_room": self.prefetch_no_room,
                "recent_failures": list(self.recent_failures),
                "lost_ranks": {str(w): t for w, t in sorted(self.lost.lost_at.items())},
                "recent_losses": list(self.lost.recent_losses),
                "loss_causes": list(self.lost.loss_causes), "refused_reports": self.admission.refused_reports,
                "recent_refusals": list(self.admission.recent_refusals),
                "vouched_loads": self.admission.claims.counts(),
                "warming": {"on": self.planner.warming, **self.clock.gate(self.planner.view.max_bytes(),
                                                                         self.config.planner.warm_min_miss_s)},
                # what each rank may hold as the planner counts it: slots, and a paged pool's bytes and page
                "capacity": {w: self.planner.view.capacity(w)._asdict() for r in self.planner.view.replicas()
                             for w in self.planner.view.workers(r)}}

    # -- checks -------------------------------------------------------------------------------------
    def check_replica(self, replica: str) -> None:
        if replica not in self.planner.view.replicas():
            raise NotFoundError(f"replica {replica!r} is not known; known replicas: "
                                f"{list(self.planner.view.replicas())}")

    def check_adapter(self, adapter: str) -> None:
        if adapter not in self.catalog:
            raise NotFoundError(f"adapter {adapter!r} is not registered; register it first "
                                "(lora-cache register NAME PATH)")

    def check_worker(self, worker: WorkerId) -> None:
        self.check_replica(worker.replica)
        if str(worker) not in self.planner.view.workers(worker.replica):
            raise NotFoundError(f"worker {worker} is not part of replica {worker.replica!r}")

    def check_integrity(self) -> None:
        view = self.planner.view
        assert all(str(w) in view.workers(w.replica) for w in self.lost.down), "a lost rank the fleet lacks"
        self.planner.check_integrity()
        self.readiness.check_integrity()
        assert all(w.replica in view.replicas() for w in self.admission.claims.vouched), "claims of a replica gone"
        self.admission.claims.check_integrity(lambda w: view.capacity(str(w)).slots)
