"""``--engine sim``: the fleet (router, replicas of TP ranks, controller) in simulated time.

``simulate(config, policy, workload, calibration)`` runs one benchmark policy over one workload and
returns the same per-request ``RequestRecord``s the real engine returns, each rank's cache counters
(``WorkerCache.stats()`` keys), every load, every step and a time series. Only costs are simulated
(from the calibration); the planner and controller core, the scheduler and admission rules, the slot
table and the counters are the real code. No wall clock and no randomness of its own: the workload's
seed decides everything, so the same inputs give identical records.

The router sees a request ``hint_lead_s`` before it dispatches it (open loop): it routes it then (the
same rule for every policy), and a policy with hints sends the hint at that moment. Half a second
(the default) stands for the time a request spends upstream of the engine once its adapter is known:
the router's own queue, tokenization and prompt assembly, an agent's previous step; it is long enough
to read a rank-64 Llama-8B shard from disk (about 170 ms at 2 GB/s) and copy it, so hints can help,
and short against the popularity half-life, so they do not just restate popularity. In closed-loop
mode (``inflight``: N requests in flight over the fleet, the next released when one finishes) a
request is known only when it is released: no hint (one with no lead says nothing the queue does not).
The real path's router (``bench.real``, ``bench.router.rules``) has the same four rules, pick for pick.

Adapter i gets LoRA rank ``adapter_ranks[i % len]`` (``make-adapters --rank 16,64``); every policy has
``slots`` slots per rank sized for the largest rank (equal GPU memory), except the oracle: a slot
per adapter, all READY before t=0 (an infinite cache with zero load cost).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from bench.figures import PolicyRun
from bench.policies import BenchPolicy
from bench.router.rules import RULES, make_rule
from bench.sim.calibration import Calibration
from bench.sim.controller import SimController, SyntheticCatalog
from bench.sim.events import Loop
from bench.sim.host_tier import SimHostTier
from bench.sim.replica import ReplicaHooks, SimReplica, StepRecord
from bench.sim.store import SimStore
from bench.sim.worker import LoadRecord, SimWorker
from bench.store import parse_store
from bench.workloads import Workload
from lora_cache.adapters.shapes import resolve_model
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig
from lora_cache.controller.core import ControllerCore
from lora_cache.errors import ConfigError
from lora_cache.planner import PlannerConfig
from lora_cache.routing.advice import RouteRequest
from lora_cache.routing.ranking import RouterConfig
from lora_cache.vocab import AdapterKey, WorkerId
from workers.cache import WorkerConfig, pool_pages
from workers.counters import STATS_COUNTERS, STATS_SUMMARIES
from workers.engine.admission import ADMISSION
from workers.engine.config import EngineConfig
from workers.engine.scheduler import check_requests
from workers.engine.timings import RequestRecord, summarize
from workers.engine.workload import Request
from workers.staging.disk_tier import FETCH_ORDERS, DiskTierConfig
from workers.staging.eviction import RECENT_S

COUNTERS, RESERVOIRS = STATS_COUNTERS, STATS_SUMMARIES  # as WorkerCache.stats(); the load records have the latencies


class RouteContext(NamedTuple):
    """What a router may read when it routes a request: its own counts, the engines' residency, the controller."""

    names: list[str]  # replica names, by index
    outstanding: list[int]  # per replica: requests routed there and not finished
    resident: Callable[[str, int], bool]  # the adapter is READY on every rank of replica i (the engines' report)
    controller: ControllerCore
    finished: list[tuple[str, str]]  # lora-cache: (replica, adapter) of requests finished since the last Route


class SimGateway:
    """``bench.router.rules.Gateway`` over the simulated fleet: READY on every rank from the engines' report, and
    ``Route`` answered by the controller core at once (no RPC latency)."""

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    def ready(self, adapter: str) -> list[str]:
        return [name for i, name in enumerate(self.ctx.names) if self.ctx.resident(adapter, i)]

    def first(self, adapters: Sequence[str], loads: Mapping[str, int]) -> list[str]:
        finished = list(self.ctx.finished)
        self.ctx.finished.clear()  # each finish told once, as the real router's (``bench.router.real``)
        advice = self.ctx.controller.route([RouteRequest(a) for a in adapters],
                                           {name: float(n) for name, n in loads.items()}, finished)
        for item in advice:
            if item.error is not None:
                raise item.error
        return [item.ranked[0].replica for item in advice]


class Router:
    """One of the real path's routing rules (``bench.router.rules.RULES``: the same picks and tie-breaks), asked
    for one request at a time with the router's own outstanding counts."""

    def __init__(self, name: str) -> None:
        self.rule = make_rule(name)

    def pick(self, adapter: str | None, ctx: RouteContext) -> int:
        """The replica (index) for the next request, which needs ``adapter`` (None: the base model)."""
        loads = dict(zip(ctx.names, ctx.outstanding))
        (replica,) = self.rule.route([adapter], loads, SimGateway(ctx))
        return ctx.names.index(replica)


ROUTERS: dict[str, Callable[[], Router]] = {name: functools.partial(Router, name) for name in RULES}


@dataclass(frozen=True)
class SimConfig:
    """The simulated fleet: replicas of TP ranks, their slots and batching bounds, router and controller."""

    replicas: int = field(default=2, metadata={"help": "replicas (TP groups)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel ranks per replica"})
    slots: int = field(default=8, metadata={"help": "GPU adapter slots per rank (the oracle gets one per adapter)"})
    max_running: int = field(default=32, metadata={"help": "most requests running per replica"})
    max_adapters: int = field(default=4, metadata={"help": "most distinct adapters among a replica's running requests"})
    max_prefill_tokens: int = field(default=4096, metadata={"help": "prompt tokens per prefill step"})
    hint_lead_s: float = field(default=0.05, metadata={
        "help": "the router knows (routes, hints) a request this long before it dispatches it (0.05: forwards "
                "within milliseconds; 0.5: a router that queues requests)"})
    routing: str = field(default="least-loaded", metadata={"help": f"router: {' | '.join(ROUTERS)}"})
    join_over: float = field(default=RouterConfig.join_over, metadata={
        "help": "the lora-cache router's RouterConfig.join_over (where ``simulate`` is given no RouterConfig)"})
    disk_bytes: int = field(default=DiskTierConfig.disk_cache_bytes, metadata={
        "help": "s3: bytes of the node's disk tier (LRU by bytes; bench/sim/store.py)"})
    fetch_order: str = field(default=DiskTierConfig.fetch_order, metadata={
        "help": "s3: how the node's demand fetches share the store: soonest | shared (bench/sim/store.py)"})
    plan_interval_s: float = field(default=0.5, metadata={
        "help": "the controller's timer: retry failed loads and replan the whole fleet"})
    sync_s: float = field(default=5.0, metadata={"help": "the controller resyncs every worker's residency this often"})
    max_staged: int = field(default=PlannerConfig.max_staged_per_replica, metadata={
        "help": "the planner's max_staged_per_replica (global: needed adapters without GPU room staged on the host)"})
    stage_share: float = field(default=PlannerConfig.stage_host_share, metadata={
        "help": "the planner's stage_host_share (global: popular adapters staged within this share of the host tier)"})
    warm_share: float = field(default=PlannerConfig.warm_host_share, metadata={
        "help": "the planner's warm_host_share (global: the fleet's host tiers filled ahead of demand, warming.py)"})
    warm_min_miss_s: float = field(default=PlannerConfig.warm_min_miss_s, metadata={
        "help": "the planner's warm_min_miss_s (global: warm only once the workers' store reads of the largest shard "
                "take this long; 0: warm from the start, as real runs before the gate did, bench.sim.check)"})
    model: str = field(default="llama-3.1-8b", metadata={"help": "model shape (decides adapter shard bytes)"})
    max_rank: int = field(default=64, metadata={"help": "largest LoRA rank (sizes the slots)"})
    page_rank: int = field(default=0, metadata={"help": "GPU pages sized for this rank (0: slots of max_rank)"})
    pool_pages: int = field(default=0, metadata={"help": "GPU pages per rank (0: slots adapters of max_rank)"})
    adapter_ranks: str = field(default="16,64", metadata={"help": "LoRA ranks given to the adapters in turn"})
    host_bytes: int = field(default=2 << 30, metadata={"help": "pinned host tier bytes per rank"})
    read_threads: int = field(default=4, metadata={"help": "disk reader threads per rank"})
    host_eviction: str = field(default="lru", metadata={
        "help": "the host tier's eviction order: lru | popular | segmented (HostTierConfig.eviction)"})
    host_recent_s: float = field(default=RECENT_S, metadata={
        "help": "eviction popular: a shard touched this lately goes after every other (HostTierConfig.recent_s)"})
    host_tiers: str = field(default="exclusive", metadata={
        "help": "whether GPU slots and the host tier may hold one shard both: inclusive | exclusive "
                "(HostTierConfig.tiers)"})
    series_s: float = field(default=1.0, metadata={"help": "time-series bucket, simulated seconds"})
    mid_step_reads: bool = field(default=False, metadata={
        "help": "a disk read that starts during a step's compute slows it for the time it overlaps it (as "
                "fit_calibration counts reads); off: only the reads in flight when its compute starts count"})
    store: str = field(default="page-cache", metadata={
        "help": "where a host-tier miss reads from (bench.store, bench.sim.store): page-cache | device | "
                "s3:BANDWIDTH,LATENCY"})
    warmup_s: float = field(default=-1.0, metadata={
        "help": "take every rank's counters at this simulated time (the measured window's start, bench.warmup); "
                "< 0: none"})
    settle_s: float = field(default=1.0, metadata={
        "help": "the fleet runs this long before the first request's clock (the real path starts its clock 1 s "
                "after the engines are built): the controller's first plans come before traffic, as they do there"})

    def __post_init__(self) -> None:
        for name in ("replicas", "tp", "slots", "max_running", "max_adapters", "max_prefill_tokens", "read_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} is {getattr(self, name)}; give an integer >= 1")
        if self.max_adapters > self.slots:
            raise ConfigError(f"max_adapters ({self.max_adapters}) exceeds slots ({self.slots}): a batch's adapters "
                              "must fit in the slots; lower max_adapters or add slots")
        if isinstance(self.max_staged, bool) or not isinstance(self.max_staged, int) or self.max_staged < 0:
            raise ConfigError(f"max_staged is {self.max_staged!r}; give an int >= 0 (0: no host-tier staging)")
        if self.routing not in ROUTERS:
            raise ConfigError(f"routing {self.routing!r} is not registered; choose one of {', '.join(ROUTERS)}")
        if isinstance(self.disk_bytes, bool) or not isinstance(self.disk_bytes, int) or self.disk_bytes < 1:
            raise ConfigError(f"disk_bytes is {self.disk_bytes!r}; give the node's disk tier in bytes, an int >= 1")
        if self.fetch_order not in FETCH_ORDERS:
            raise ConfigError(f"fetch_order is {self.fetch_order!r}; give one of {', '.join(FETCH_ORDERS)}")
        if not 0 <= self.hint_lead_s < float("inf"):
            raise ConfigError(f"hint_lead_s is {self.hint_lead_s}; give seconds >= 0, e.g. 0.5")
        for name in ("plan_interval_s", "sync_s", "series_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} is {getattr(self, name)}; give a positive number of seconds")
        if not 0 <= self.settle_s < float("inf"):
            raise ConfigError(f"settle_s is {self.settle_s}; give seconds >= 0 (1.0: the real path's; 0: the first "
                              "request comes as the fleet starts)")
        parse_store(self.store)
        if max(self.lora_ranks()) > self.max_rank:  # the model resolves, the ranks parse
            raise ConfigError(f"adapter_ranks {self.adapter_ranks!r} exceed max_rank ({self.max_rank}), which sizes "
                              "the slots; raise max_rank or use smaller ranks")

    def lora_ranks(self) -> list[int]:
        return SynthConfig(model=self.model, rank=self.adapter_ranks).ranks()


@dataclass
class SimResult:
    """What one simulated run gives: the real engine's records plus the fleet's counters and logs."""

    policy: str
    records: list[RequestRecord]  # by rid
    ranks: list[dict[str, object]]  # per rank: replica, rank, slots and WorkerCache.stats() keys
    loads: list[LoadRecord]  # every completed load, in completion order
    steps: list[StepRecord]  # every step, in completion order
    series: list[dict[str, float | None]]  # per series_s bucket of simulated time
    controller: dict[str, object]
    ready_on_arrival: list[bool]  # by rid: the adapter was READY on every rank of its replica when it arrived
    end_s: float  # simulated time of the last token
    events: int
    ranks_at_warmup: list[dict[str, object]] | None = None  # each rank's counters at ``SimConfig.warmup_s``
    store: dict[str, float] | None = None  # the simulated store's totals (device, s3)

    def totals(self) -> dict[str, int]:
        return {k: sum(int(r[k]) for r in self.ranks) for k in COUNTERS}  # type: ignore[call-overload]

    def summary(self) -> dict[str, float]:
        """bench_serving's summary of the records, the fleet's cache totals and the hit rate at arrival."""
        ready = [ok for ok, r in zip(self.ready_on_arrival, self.records) if r.adapter is not None]
        ttr = sorted(ld.ready_s - ld.start_s for ld in self.loads)
        return {**summarize(self.records), **self.totals(),
                "ready_on_arrival": sum(ready) / len(ready) if ready else 1.0,
                "median_time_to_ready_ms": ttr[len(ttr) // 2] * 1e3 if ttr else 0.0}

    def as_policy_run(self, policy: str, wall_s: float) -> PolicyRun:
        """The benchmark's per-policy result, in the real path's shapes (``bench.real``)."""
        ranks = [{k: v for k, v in r.items() if k not in RESERVOIRS} for r in self.ranks]
        loads = [{"adapter": ld.adapter, **ld.as_log()} for ld in self.loads]
        return PolicyRun(policy, "sim", self.records, ranks, loads, [s.as_log() for s in self.steps], wall_s,
                         ranks_at_warmup=self.ranks_at_warmup)  # type: ignore[arg-type]

    def describe(self) -> dict[str, object]:
        """For the results JSON (records and logs are left to the caller)."""
        return {"policy": self.policy, "summary": self.summary(), "controller": self.controller, "ranks": self.ranks,
                "series": self.series, "end_s": self.end_s, "events": self.events}


def simulate(config: SimConfig, policy: BenchPolicy, workload: Workload, calibration: Calibration, *,
             check: bool = False, router: RouterConfig | None = None) -> SimResult:
    """Run ``workload`` on the simulated fleet under ``policy``; ``check``: integrity checks as it goes;
    ``router``: the controller's routing-advice settings (the ``lora-cache`` router's), default RouterConfig()."""
    return _Fleet(config, policy, workload, calibration, check, router).run()


class _Fleet:
    """Builds the fleet, drives the router and collects results (one run)."""

    def __init__(self, config: SimConfig, policy: BenchPolicy, workload: Workload, calibration: Calibration,
                 check: bool, router: RouterConfig | None = None) -> None:
        self.config, self.policy, self.workload, self.check = config, policy, workload, check
        self.loop = loop = Loop()
        names = list(workload.adapters)
        self.requests: list[Request] = list(workload.requests)
        ranks = config.lora_ranks()
        catalog = SyntheticCatalog(resolve_model(config.model), {n: ranks[i % len(ranks)] for i, n in enumerate(names)},
                                   calibration.slot_dtype)
        planner = PlannerConfig(policy=policy.planner, max_staged_per_replica=config.max_staged,
                                stage_host_share=config.stage_share, warm_host_share=config.warm_share,
                                warm_min_miss_s=config.warm_min_miss_s)
        self.controller = SimController(loop, calibration, planner, catalog, config.plan_interval_s, config.sync_s,
                                        router or RouterConfig(join_over=config.join_over))
        for name in names:
            self.controller.core.register_adapter(name, f"simulated/{name}")
        keys = {n: AdapterKey(n, catalog.get(n).version) for n in names}
        nbytes = shard_bytes(catalog, config.tp, calibration.slot_dtype)
        model = parse_store(config.store)  # one store for the fleet's host (the benchmark's machine)
        objects = shard_bytes(catalog, 1, calibration.slot_dtype)
        self.store = None if model.kind == "page-cache" else SimStore(model, loop, calibration, objects,
                                                                      config.disk_bytes, config.fetch_order)
        self.disk_bytes: int | None = None  # s3: each rank's part of the node's disk tier, as a worker reports it
        if model.kind == "s3":  # the controller learns a store adapter's object from its registration (disk warming)
            plans = self.controller.core.planner  # as ControllerCore.add_adapter registers a store version
            for name in names:
                plans.register_adapter(dataclasses.replace(plans.view.adapter(name), object_bytes=objects[name]))
            self.disk_bytes = config.disk_bytes // max(1, config.replicas * config.tp)
        self.ranks_at_warmup: list[dict[str, object]] | None = None
        if config.host_bytes < max(nbytes.values()):
            raise ConfigError(f"host_bytes ({config.host_bytes}) must hold one shard ({max(nbytes.values())} bytes "
                              f"at rank {max(ranks)}, TP {config.tp}); raise host_bytes")
        slots = len(names) if policy.oracle else config.slots
        engine = EngineConfig(model=config.model, tp=config.tp, device="cpu", num_slots=slots, max_rank=config.max_rank,
                              page_rank=0 if policy.oracle else config.page_rank,  # the oracle: a slot per adapter
                              pool_pages=0 if policy.oracle else config.pool_pages,
                              max_running=config.max_running, max_adapters=config.max_adapters,
                              max_prefill_tokens=config.max_prefill_tokens, admission=policy.admission,
                              max_seq_len=max(2, *(r.input_len + r.output_len for r in self.requests)))
        check_requests(self.requests, engine, names)
        self.loads: list[LoadRecord] = []
        self.hooks = ReplicaHooks(self._done, self.controller.queue)
        self.replicas: list[SimReplica] = []
        self.workers: list[SimWorker] = []
        for i in range(config.replicas):
            self._add_replica(f"replica-{i}", engine, calibration, keys, nbytes)
        self.router = ROUTERS[config.routing]()
        self.outstanding = [0] * config.replicas
        self.route_context = RouteContext([r.name for r in self.replicas], self.outstanding, self._resident,
                                          self.controller.core, [])
        self.replica_of = [-1] * len(self.requests)
        self.ready_on_arrival = [False] * len(self.requests)
        self.finished = 0
        self.released = 0  # closed loop: requests released so far
        self.series: list[dict[str, float | None]] = []
        self.counts = {"arrived": 0, "ready_on_arrival": 0}  # requests with an adapter: arrived, of them READY
        self._last = dict.fromkeys((*COUNTERS, "done", "tokens", "arrived", "ready_on_arrival"), 0)
        self._steps_seen = self._tokens = 0

    def _add_replica(self, name: str, engine: EngineConfig, calibration: Calibration, keys: dict[str, AdapterKey],
                     nbytes: dict[str, int]) -> None:
        """A replica's TP workers (the oracle's with every adapter READY), known to the controller."""
        config = self.config
        pool = self._pool(engine, calibration)
        self.controller.core.add_replica(name, config.tp, engine.num_slots, config.host_bytes, *pool,
                                         disk_bytes=self.disk_bytes)
        self.controller.core.limits.declare(name, engine.max_adapters, engine.max_running)  # the engine's own
        ranks = []
        for k in range(config.tp):
            host = SimHostTier(self.loop, calibration, config.host_bytes, config.read_threads, self.store,
                               config.host_eviction, config.host_tiers, config.host_recent_s)
            worker = SimWorker(name, k, engine.num_slots, self.loop, calibration, keys, nbytes, host,
                               config.max_running + config.max_adapters,
                               functools.partial(self.controller.push, WorkerId(name, k)), self.loads.append,
                               *self._pages(engine, calibration))
            if self.policy.oracle:
                worker.preload(self.workload.adapters)
            self.controller.add_worker(WorkerId(name, k), worker)
            ranks.append(worker)
        self.workers += ranks
        self.replicas.append(SimReplica(name, engine, ADMISSION[self.policy.admission](), ranks, self.loop,
                                        calibration, self.hooks, resolve_model(config.model).num_layers,
                                        config.mid_step_reads))

    def _pages(self, engine: EngineConfig, calibration: Calibration) -> tuple[int | None, int | None]:
        """(pages, page bytes) of a rank's paged pool (``workers.cache.pool_pages``), or (None, None): slots."""
        if not engine.page_rank or engine.page_rank >= engine.max_rank:
            return None, None
        dtype = getattr(torch, calibration.slot_dtype)
        worker = WorkerConfig(num_slots=engine.num_slots, page_rank=engine.page_rank, pool_pages=engine.pool_pages,
                              tp=engine.tp)
        page, pages = pool_pages(worker, resolve_model(self.config.model), engine.max_rank, dtype)
        return pages, page * dtype.itemsize

    def _pool(self, engine: EngineConfig, calibration: Calibration) -> tuple[int | None, int | None]:
        """(GPU bytes, page bytes) a paged rank reports to the controller (``WorkerControl.describe``), or Nones."""
        pages, page_bytes = self._pages(engine, calibration)
        return (None, None) if pages is None or page_bytes is None else (pages * page_bytes, page_bytes)

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        loop, n = self.loop, len(self.requests)
        loop.now = -self.config.settle_s  # the fleet (and the controller's plans) before the clock
        self.controller.start()
        if self.workload.inflight:
            for _ in range(min(self.workload.inflight, n)):
                loop.at(0.0, self._release)
        else:
            for r in self.requests:
                loop.at(max(loop.now, r.arrival_s - self.config.hint_lead_s), self._route, r.rid)
        loop.after(self.config.series_s, self._sample)
        if self.config.warmup_s >= 0:
            loop.at(max(loop.now, self.config.warmup_s), self._snapshot)
        loop.run(lambda: self.finished == n)
        if self.finished < n:
            raise RuntimeError(f"simulation stalled at t={loop.now:.3f} s with {n - self.finished} of {n} requests "
                               "unfinished: a bug in the simulator or the engine's scheduler")
        self._sample(final=True)
        if self.check:
            self._check_integrity()
        records = sorted((rec for r in self.replicas for rec in r.scheduler.records()), key=lambda rec: rec.rid)
        ranks = [{"replica": w.replica, "rank": w.rank, "slots": len(w.table.slots), **w.stats()}
                 for w in self.workers]
        return SimResult(self.policy.name, records, ranks, self.loads, self.hooks.steps, self.series,
                         self.controller.stats(), self.ready_on_arrival, loop.now, loop.events, self.ranks_at_warmup,
                         self.store.stats() if self.store is not None else None)

    def _snapshot(self) -> None:
        """Every rank's counters at the warm-up's end (``bench.warmup.split_run``)."""
        self.ranks_at_warmup = [{"replica": w.replica, "rank": w.rank, **w.counts()} for w in self.workers]

    def _release(self) -> None:
        """Closed loop: the next request arrives now (no hint: nothing is known ahead of it)."""
        rid = self.released
        self.released += 1
        self.requests[rid] = self.requests[rid]._replace(arrival_s=self.loop.now)
        self._route(rid)

    def _route(self, rid: int) -> None:
        """The router learns of request ``rid``: picks its replica, hints it, dispatches it at its arrival."""
        request, now = self.requests[rid], self.loop.now
        index = self.router.pick(request.adapter, self.route_context)
        self.outstanding[index] += 1
        self.replica_of[rid] = index
        if self.policy.hints and request.adapter is not None and not self.workload.inflight:
            self.controller.hint(f"hint-{rid}", request.adapter, self.replicas[index].name, request.arrival_s - now)
        at = request.arrival_s + self.workload.submit_lag_s.get(rid, 0.0)  # a real run's submission, replayed
        if at > now:
            self.loop.at(at, self._dispatch, rid)
        else:
            self._dispatch(rid)

    def _resident(self, adapter: str, index: int) -> bool:
        return all(w.is_ready(adapter) for w in self.replicas[index].workers)

    def _dispatch(self, rid: int) -> None:
        request, replica = self.requests[rid], self.replicas[self.replica_of[rid]]
        self.ready_on_arrival[rid] = request.adapter is None or all(w.is_ready(request.adapter)
                                                                    for w in replica.workers)
        if request.adapter is not None:
            self.counts["arrived"] += 1
            self.counts["ready_on_arrival"] += self.ready_on_arrival[rid]
        replica.submit(request)

    def _done(self, rid: int, t: float) -> None:
        self.outstanding[self.replica_of[rid]] -= 1
        adapter = self.requests[rid].adapter
        if self.config.routing == "lora-cache" and adapter is not None:  # told with the router's next Route call
            self.route_context.finished.append((self.replicas[self.replica_of[rid]].name, adapter))
        self.finished += 1
        if self.workload.inflight and self.released < len(self.requests):
            self._release()

    # -- time series -----------------------------------------------------------------------------------
    def _sample(self, final: bool = False) -> None:
        """One bucket: what happened since the last sample (counters summed over every rank)."""
        steps = self.hooks.steps
        self._tokens += sum(s.items for s in steps[self._steps_seen:])
        self._steps_seen = len(steps)
        now = dict.fromkeys(COUNTERS, 0)
        for w in self.workers:
            for k, v in w.counts().items():
                now[k] += v
        now |= {"done": self.finished, "tokens": self._tokens, **self.counts}
        delta = {k: v - self._last[k] for k, v in now.items()}
        self._last = now
        lookups = delta["gpu_hits"] + delta["gpu_misses"]
        self.series.append({"t_s": self.loop.now, **delta,
                            "gpu_hit_rate": delta["gpu_hits"] / lookups if lookups else None,
                            "ready_on_arrival_rate": delta["ready_on_arrival"] / delta["arrived"]
                            if delta["arrived"] else None})
        if not final and self.finished < len(self.requests):
            self.loop.after(self.config.series_s, self._sample)
        if self.check:
            self._check_integrity()

    def _check_integrity(self) -> None:
        for w in self.workers:
            w.check_integrity()
        self.controller.core.check_integrity()


def shard_bytes(catalog: SyntheticCatalog, tp: int, dtype: str) -> dict[str, int]:
    """Bytes of one rank's shard of every adapter the catalog has a rank for, registered or not (every rank's
    shard has the same size: even TP splits); ``bench.bound`` sizes a run's adapters with it too."""
    by_rank: dict[int, int] = {}
    out = {}
    for name, rank in catalog.ranks.items():
        if rank not in by_rank:
            spec = catalog.read(name, f"simulated/{name}")
            by_rank[rank] = shard_layout(spec, catalog.shape, tp, 0, getattr(torch, dtype)).nbytes
        out[name] = by_rank[rank]
    return out
