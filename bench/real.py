"""``--engine real``: one policy through the real path, on the embedded Ray or the cluster a job runs on.

Per policy, a fresh service (controller, one placement group of TP worker actors per replica, the gRPC
gateway) so no policy inherits another's cache. Every worker hosts one rank of the reference engine
(``workers.engine.hosted``) over its own ``WorkerCache``, which the controller drives too. With
``attach``, the service runs the controller alone and every engine rank runs in a process of its own
that attaches to it through the engine seam (``workers/attach/attachment.py``, ``bench.attached``), as an external
engine would; the engine code, the cache and the controller's commands are the same. Then, from one
shared wall-clock start:

- the router (a thread here, ``bench.router.real.Router``) routes each request ``hint_lead_s`` before its arrival by its
  rule (``bench.router.rules``: round-robin, least-loaded, affinity over the gateway's ``Lookup``, or
  lora-cache's ``Route`` advice with the router's own in-flight counts), and, for policies with hints,
  sends the chosen replica a gRPC ``Hint`` then (lifecycle step 1);
- at the request's arrival it submits it to that replica's engine, whose rank 0 takes it into its
  waiting queue (``workers/engine/feed.py``; the other ranks follow rank 0's plans); a request that
  reaches the engine late is admitted when it gets there, and its TTFT still counts from its arrival;
- the engines tell the router which requests finished (its in-flight counts), and after the last
  submission the router ends every replica's stream;
- each replica's rank 0 reports its waiting queue to the controller as it changes (policies that plan).

Closed-loop workloads (``inflight:N``) are routed round-robin up front, N / R in flight per replica.
Every run checks that each request was served once, by the replica the router chose.
The oracle preloads every adapter (slots for all of them) before the clock starts.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from bench.attached import ProcessFleet
from bench.figures import PolicyRun
from bench.policies import BenchPolicy
from bench.router.real import Router, served_as_routed
from bench.router.rules import make_rule
from bench.store import StoreModel, parse_store
from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.shards import max_shard_numel
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.app.serve import ServeConfig, Service, start
from lora_cache.errors import ConfigError
from lora_cache.planner import PlannerConfig
from lora_cache.routing.ranking import RouterConfig
from lora_cache.runtime import heap
from lora_cache.vocab import CONTROLLER_NAME, NAMESPACE, ReadinessRecord
from workers.cache import WorkerConfig
from workers.cache import pool_pages as pool_of
from workers.counters import STATS_COUNTERS, STATS_SUMMARIES
from workers.engine.config import EngineConfig
from workers.engine.kv_rows import check_pool, kv_slab, row_pages
from workers.engine.workload import Request
from workers.staging.disk_tier import DiskTierConfig
from workers.staging.eviction import RECENT_S
from workers.staging.host_config import HostTierConfig

if TYPE_CHECKING:
    from bench.config import BenchConfig
    from bench.workloads import Workload


@dataclass(frozen=True)
class RealConfig:
    """The fleet of a real run: replicas of TP workers, each hosting an engine rank."""

    model: str = "tiny"
    num_layers: int = 0  # 0: all of the model's
    replicas: int = 1
    tp: int = 1
    slots: int = 8  # GPU slots per rank (equal for every policy but the oracle)
    max_rank: int = 64
    page_rank: int = 0  # GPU pages sized for this rank (issue 43; 0: slots of max_rank)
    pool_pages: int = 0  # GPU pages per rank (0: slots adapters of max_rank)
    max_running: int = 32
    max_adapters: int = 4
    max_prefill_tokens: int = 4096
    max_seq_len: int = 2048
    hint_lead_s: float = 0.05  # a router that forwards within milliseconds (0.5: one that queues)
    gpus: bool = False
    gpu_share: float = 1.0  # the share of one GPU each rank asks for (ServeConfig.gpu_share)
    dtype: str = "float32"  # slots and compute; bfloat16 on GPUs
    worker_cpus: float = 0.25
    host_bytes: int = 2 << 30
    host_eviction: str = "lru"  # HostTierConfig.eviction
    host_recent_s: float = RECENT_S  # HostTierConfig.recent_s
    host_tiers: str = "exclusive"  # HostTierConfig.tiers
    direct_reads: str = "off"  # HostTierConfig.direct_reads: off | on | auto
    read_ahead: bool = False  # HostTierConfig.read_ahead
    timeout_s: float = 900.0  # one policy's whole run
    engine: dict[str, Any] = field(default_factory=dict)  # further EngineConfig fields (e.g. share_weights)
    attach: bool = False  # engine ranks in processes of their own, attached through the seam
    router: str = "round-robin"  # the routing rule (bench.router.rules.RULES)
    join_over: float = RouterConfig.join_over  # the controller's routing advice (RouterConfig.join_over)
    store: str = "page-cache"  # bench.store: page-cache | device (pages dropped) | s3:... (adapters_dir is s3://)
    disk_root: str = ""  # s3: each policy's disk tier is a fresh directory under it (empty: a temporary one)
    disk_bytes: int = DiskTierConfig.disk_cache_bytes  # s3: the node's disk tier (DiskTierConfig.disk_cache_bytes)
    fetch_order: str = DiskTierConfig.fetch_order  # s3: how the node's demand fetches share the store
    # the controller's warming gate (PlannerConfig.warm_min_miss_s), recorded with the run: bench.sim.check replays it
    warm_min_miss_s: float = PlannerConfig.warm_min_miss_s

    def store_model(self) -> StoreModel:
        return parse_store(self.store)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.tp < 1 or self.slots < 1:
            raise ConfigError(f"replicas ({self.replicas}), tp ({self.tp}) and slots ({self.slots}) must be >= 1")
        if self.hint_lead_s < 0:
            raise ConfigError(f"hint_lead_s must be >= 0 seconds, got {self.hint_lead_s}")
        make_rule(self.router)  # a clear error for an unknown name
        parse_store(self.store)


class Phases:
    """Seconds of each start-up phase of a policy run, from ``t0`` (``time.perf_counter``)."""

    def __init__(self, t0: float) -> None:
        self.last = t0
        self.times: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name], self.last = now - self.last, now

    def describe(self) -> str:
        return ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in self.times.items())


def serve_config(config: RealConfig, adapters_dir: str, engine: EngineConfig) -> ServeConfig:
    """The service of a run, as ``lora-cache serve`` would be started for it: its replicas' engines' admission
    limits (Route's adapter lanes) declared the way serve declares them (``--max-adapters``/``--max-running``);
    attached ranks (``attach``: no replicas here) declare them in their hello (``bench.attached``)."""
    return ServeConfig(adapters=adapters_dir, replicas=0 if config.attach else config.replicas, tp=config.tp,
                       gpus=config.gpus, gpu_share=config.gpu_share if config.gpus else 1.0,
                       worker_cpus=config.worker_cpus, max_adapters=engine.max_adapters,
                       max_running=engine.max_running)


def own_kv_pages(bench: BenchConfig) -> int:
    """The pool pages the engine's own KV cache (``max_running`` rows and the padding row) takes on a rank: what a
    ``--kv-rows`` pool holds beyond the adapters' bytes of the run with its own KV cache it is compared with."""
    engine = EngineConfig(model=bench.model, num_layers=bench.num_layers, tp=bench.tp, num_slots=bench.slots,
                          max_rank=bench.max_rank, max_running=bench.max_running, max_seq_len=bench.max_seq_len)
    worker = WorkerConfig(num_slots=bench.slots, tp=bench.tp, page_rank=bench.page_rank, pool_pages=bench.pool_pages)
    dtype = torch.bfloat16 if bench.use_gpus() else torch.float32
    page, _ = pool_of(worker, engine.shape(), bench.max_rank, dtype)
    return (bench.max_running + 1) * row_pages(kv_slab(engine), engine.layers, page)[1]


def route(requests: list[Request], replicas: int) -> list[list[Request]]:
    """Request i to replica i mod R (in arrival order): the router's rule, the same for every policy."""
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.rid))
    return [ordered[i::replicas] for i in range(replicas)]


def run_policy(config: RealConfig, policy: BenchPolicy, adapters_dir: str, names: list[str], workload: Workload,
               tick: Callable[[float], None] = lambda _: None) -> PolicyRun:
    """Serve ``workload`` under ``policy``; ``tick(fraction of the stream's time elapsed)`` for progress."""
    slots = len(names) if policy.oracle else config.slots
    page_rank = 0 if policy.oracle else config.page_rank  # the oracle: a slot per adapter
    pool_pages = 0 if policy.oracle else config.pool_pages
    worker = WorkerConfig(num_slots=slots, dtype=config.dtype, page_rank=page_rank, pool_pages=pool_pages,
                          max_batch=max(256, config.max_running + config.max_adapters),
                          host=HostTierConfig(host_bytes=config.host_bytes, eviction=config.host_eviction,
                                              recent_s=config.host_recent_s,
                                              tiers=config.host_tiers,
                                              drop_page_cache=config.store_model().kind == "device",
                                              direct_reads=config.direct_reads, read_ahead=config.read_ahead),
                          disk=_disk_tier(config, policy))
    engine = EngineConfig(model=config.model, num_layers=config.num_layers, tp=config.tp, num_slots=slots,
                          page_rank=page_rank, pool_pages=pool_pages,
                          max_rank=config.max_rank, max_running=config.max_running,
                          max_adapters=min(config.max_adapters, slots), max_prefill_tokens=config.max_prefill_tokens,
                          max_seq_len=config.max_seq_len, admission=policy.admission,
                          # the oracle (an adapter per slot) keeps its own KV cache: its pool holds every adapter
                          **{k: v for k, v in config.engine.items() if not (policy.oracle and k == "kv_rows")})
    if engine.kv_rows:  # the KV rows in the pool: refused here, before the service starts, if they cannot fit
        page, pages = pool_of(worker, engine.shape(), config.max_rank, getattr(torch, config.dtype))
        check_pool(engine, page, pages, -(-max_shard_numel(engine.shape(), config.tp, config.max_rank,
                                                           getattr(torch, config.dtype)) // page))
    serve = serve_config(config, adapters_dir, engine)
    catalog = CatalogConfig(adapter_roots=(adapters_dir,), model=config.model, max_rank=config.max_rank)
    if workload.inflight and config.router != "round-robin":
        raise ConfigError(f"router {config.router!r} routes open-loop arrivals only (poisson, trace); a closed loop "
                          f"(inflight:{workload.inflight}) is routed round-robin up front: use --router round-robin "
                          "or open-loop arrivals")
    t_begin = time.perf_counter()
    phases = Phases(t_begin)
    _refuse_running_service()
    planner = PlannerConfig(policy=policy.planner, warm_min_miss_s=config.warm_min_miss_s)
    service = start(serve, catalog, planner, worker, router=RouterConfig(join_over=config.join_over))
    phases.mark("service_s")  # Ray actors (workers with their caches) up, every adapter registered
    gateway = None
    replicas = [f"replica-{i}" for i in range(config.replicas)]
    fleet: Fleet | None = None
    try:
        gateway = start_gateway_thread(GatewayConfig(grpc_port=0), service.controller)
        fleet = (ProcessFleet.start(replicas, worker, config.tp, config.gpus, engine) if config.attach
                 else ActorFleet(service, replicas))
        phases.mark("gateway_fleet_s")
        if policy.oracle:
            fleet.preload(names, config.timeout_s)
            phases.mark("preload_s")
        ranks = fleet.build(engine, config.timeout_s)
        phases.mark("engine_build_s")  # base weights, KV cache, warm-up (kernels compiled, decode graphs captured)
        phases.times.update(ranks or {})  # within the phases above: the slowest rank's cache, model and warm-up
        since_wall = time.time()  # counters and the load log from here: hinted loads may precede the clock
        heap.freeze()  # the router's hints and the gateway are not stalled by full collections (thawed below)
        before = fleet.stats()
        start_wall = time.time() + 1.0
        phases.mark("stats_s")
        phases.times["to_first_request_s"] = phases.last - t_begin + 1.0 + min(
            (r.arrival_s for r in workload.requests), default=0.0)
        print(f"policy {policy.name}: start to first request {phases.times['to_first_request_s']:.1f} s "
              f"({phases.describe()})", file=sys.stderr, flush=True)
        snap = _Snapshot(fleet, before, start_wall, workload)  # every rank's counters as the warm-up ends
        results, choices, routing = _serve(config, policy, fleet, gateway.target, replicas, workload, start_wall, tick)
        run = _collect(policy, fleet, results[: config.replicas], start_wall, since_wall, before)
        run.ranks_at_warmup = snap.result()
        run.warming = dict(ray.get(service.controller.status.remote(), timeout=60).get("warming", {}))
        run.routing = {**routing, **served_as_routed(choices, dict(zip(replicas, results)))}
        run.wall_s = time.perf_counter() - t_begin
        run.startup = phases.times
        return run
    finally:
        _teardown(heap.thaw, gateway.stop if gateway is not None else None,
                  fleet.stop if fleet is not None else None, service.stop,
                  # s3: the policy's fetched copies, once its workers are gone (a catalog's worth per policy
                  # would otherwise fill the machine's disk over a run of several)
                  functools.partial(shutil.rmtree, worker.disk.disk_cache, ignore_errors=True)
                  if config.store_model().kind == "s3" else None)


def _teardown(*steps: Callable[[], None] | None) -> None:
    """Run every step, in order, even after one fails: the service's stop above all (a controller left alive
    under the service's name refuses every later policy); then raise the first failure, unless the run itself
    is already raising (its error is the one to report; this one is printed)."""
    failure: BaseException | None = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception as e:
            print(f"bench: teardown step {getattr(step, '__qualname__', step)} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            failure = failure or e
    if failure is not None and sys.exc_info()[1] is None:
        raise failure


def _disk_tier(config: RealConfig, policy: BenchPolicy) -> DiskTierConfig:
    """s3: a fresh disk tier per policy (no policy finds another's fetched copies), one GET per object (moto's
    ranged GETs cost the whole object); otherwise the default (unused: the adapters are local files)."""
    if config.store_model().kind != "s3":
        return DiskTierConfig()
    root = Path(config.disk_root or tempfile.mkdtemp(prefix="bench-disk-tier-")) / policy.name
    shutil.rmtree(root, ignore_errors=True)
    return DiskTierConfig(disk_cache=str(root), disk_cache_bytes=config.disk_bytes, fetch_part_bytes=0,
                          fetch_order=config.fetch_order)


class _Snapshot:
    """Every rank's counters (as increases since ``before``) when the first measured request arrives
    (``bench.warmup``), taken by a timer thread of the driver; none for a closed loop or without a warm-up."""

    def __init__(self, fleet: Fleet, before: dict[tuple[str, int], dict[str, Any]], start_wall: float,
                 workload: Workload) -> None:
        self.ranks: list[dict[str, Any]] | None = None
        self.timer: threading.Timer | None = None
        if workload.warmup and not workload.inflight and workload.warmup < len(workload.requests):
            at = start_wall + workload.requests[workload.warmup].arrival_s

            def take() -> None:
                with contextlib.suppress(Exception):  # no snapshot: the split takes counters from the load log
                    now = fleet.stats()
                    self.ranks = [{"replica": replica, "rank": rank, **{k: v - before[(replica, rank)][k]
                                                                        for k, v in stats.items() if k in COUNTERS}}
                                  for (replica, rank), stats in now.items()]

            self.timer = threading.Timer(max(0.0, at - time.time()), take)
            self.timer.daemon = True
            self.timer.start()

    def result(self) -> list[dict[str, Any]] | None:
        if self.timer is not None:
            self.timer.join(timeout=60)
        return self.ranks


def _serve(config: RealConfig, policy: BenchPolicy, fleet: Fleet, target: str, replicas: list[str],
           workload: Workload, start_wall: float, tick: Callable[[float], None],
           ) -> tuple[list[Any], dict[int, str], dict[str, Any]]:
    """Every rank's run from ``start_wall``, fed by the router (open loop) or given its requests up front
    (closed loop, round-robin): the runs' results, the router's choice per request and its description."""
    report = policy.planner != "none"
    if workload.inflight:
        routed = route(workload.requests, config.replicas)
        runs = fleet.run(routed, start_wall, -(-workload.inflight // config.replicas), report)
        results = _wait(runs, start_wall, workload, config.timeout_s, tick)
        choices = {r.rid: replica for replica, reqs in zip(replicas, routed) for r in reqs}
        return results, choices, {"router": "round-robin (up front)"}
    runs = fleet.run([[] for _ in replicas], start_wall, 0, report, streaming=True)
    router = Router(target, fleet, replicas, workload.requests, start_wall, config.hint_lead_s, policy, config.router)
    try:
        results = _wait(runs, start_wall, workload, config.timeout_s, tick)
    finally:
        router.stop()
    router.check()
    return results, router.choices, router.describe()


def _refuse_running_service() -> None:
    """The benchmark starts its own controller under the service's name; on a cluster where
    ``lora-cache serve`` runs it would attach to that one and measure (and disturb) production."""
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return
    raise ConfigError(f"a lora-cache controller ({CONTROLLER_NAME!r} in namespace {NAMESPACE!r}) is already running "
                      "on this Ray cluster; stop the service first (deploy/start-service.sh stop, or Ctrl-C its "
                      "`lora-cache serve`), or run the benchmark on a cluster of its own")


class ActorFleet:
    """The engine ranks hosted in the service's worker actors (``workers/engine/hosted.py``)."""

    def __init__(self, service: Service, replicas: list[str]) -> None:
        self.service = service
        self.ranks = {r: [service.workers[w] for w in sorted(service.workers) if w.replica == r] for r in replicas}
        self.keys = [(replica, rank) for replica, hs in self.ranks.items() for rank in range(len(hs))]

    def preload(self, names: list[str], timeout_s: float) -> None:
        ray.get([h.preload.remote(names) for hs in self.ranks.values() for h in hs], timeout=timeout_s)

    def build(self, engine: EngineConfig, timeout_s: float) -> dict[str, float]:
        """Every rank's engine; the slowest rank's seconds per start-up phase (its cache's, its engine's)."""
        refs = []
        for handles in self.ranks.values():
            meet = ray.get(handles[0].engine_rendezvous.remote(len(handles)), timeout=60)
            refs += [h.engine_build.remote(engine, meet) for h in handles]
        phases: dict[str, float] = {}
        for times in ray.get(refs, timeout=timeout_s):
            for k, v in (times or {}).items():
                phases[f"rank_{k}"] = max(v, phases.get(f"rank_{k}", 0.0))
        return phases

    def run(self, routed: list[list[Request]], start_wall: float, inflight: int, report: bool,
            streaming: bool = False) -> list[Future[Any]]:
        """Every rank's run, the replicas' rank 0 first (they report the queue, if ``report``; and take
        ``submit``ted requests until ``end_streams``, if ``streaming``)."""
        self._fed: list[ray.ObjectRef[Any]] = []
        refs = [hs[0].engine_run.remote(reqs, start_wall, inflight, report, streaming) for hs, reqs in
                zip(self.ranks.values(), routed)]
        refs += [h.engine_run.remote(reqs, start_wall, inflight) for hs, reqs in zip(self.ranks.values(), routed)
                 for h in hs[1:]]
        return [ref.future() for ref in refs]

    def submit(self, replica: str, requests: list[Request]) -> None:
        self._fed.append(self.ranks[replica][0].engine_submit.remote(requests))  # checked by end_streams

    def end_streams(self) -> None:
        """Every replica's end of stream, once its submissions returned (they run side by side on rank 0: an end
        sent behind a submit could start before it); raises if a submission failed."""
        fed, self._fed = self._fed, []
        try:
            ray.get(fed, timeout=60)
        finally:  # every replica's stream ends, a failed submission or not: its run returns
            ends = [hs[0].engine_end_stream.remote() for hs in self.ranks.values()]
            ray.get(ends, timeout=60)

    def finished(self, replica: str, timeout_s: float) -> list[int] | None:
        return ray.get(self.ranks[replica][0].engine_finished.remote(timeout_s),  # type: ignore[no-any-return]
                       timeout=timeout_s + 60)

    def stats(self) -> dict[tuple[str, int], dict[str, Any]]:
        """Every worker's ``stats()``, by (replica, rank), in one round trip."""
        return dict(zip(self.keys, ray.get([h.stats.remote() for hs in self.ranks.values() for h in hs], timeout=60)))

    def load_logs(self) -> dict[tuple[str, int], list[tuple[float, ReadinessRecord]]]:
        return dict(zip(self.keys, ray.get([h.load_log.remote() for hs in self.ranks.values() for h in hs],
                                           timeout=60)))

    def stop(self) -> None:
        for handle in self.service.workers.values():
            with contextlib.suppress(Exception):  # killed by the service's stop either way
                ray.get(handle.shutdown.remote(), timeout=30)


Fleet = ActorFleet | ProcessFleet


def _wait(runs: list[Future[Any]], start_wall: float, workload: Workload, timeout_s: float,
          tick: Callable[[float], None]) -> list[Any]:
    span = max((r.arrival_s for r in workload.requests), default=0.0) or 1.0
    deadline = time.monotonic() + timeout_s
    pending = set(runs)
    while pending:
        _, pending = futures.wait(pending, timeout=0.5)
        tick(min(1.0, max(0.0, (time.time() - start_wall) / span)))
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engines did not finish within {timeout_s:.0f} s; raise --timeout-s or send "
                               "fewer requests")
    return [f.result() for f in runs]


# WorkerCache.stats()'s counts are reported as the increase over the run; its latency summaries are
# dropped: the load log has every load's timings.
COUNTERS, SUMMARIES = frozenset(STATS_COUNTERS), frozenset(STATS_SUMMARIES)


def _collect(policy: BenchPolicy, fleet: Fleet, results: list[Any], start_wall: float,
             since_wall: float, before: dict[tuple[str, int], dict[str, Any]]) -> PolicyRun:
    """Records, each rank's counters and loads since the engines were built (so the oracle's preload is
    not counted; a load a hint started just before the clock is, with a negative ``t_s``), and rank 0's
    step log."""
    records = sorted((r for res in results for r in res.records), key=lambda r: r.rid)
    after, logs = fleet.stats(), fleet.load_logs()
    stats, loads = [], []
    replicas = list(dict.fromkeys(replica for replica, _ in after))
    engines = {(replica, s.rank): s for replica, res in zip(replicas, results) for s in res.ranks}
    for (replica, rank), now in after.items():
        then = before[(replica, rank)]
        stats.append({"replica": replica, "rank": rank, **{k: v - then[k] if k in COUNTERS else v
                                                           for k, v in now.items() if k not in SUMMARIES},
                      **engines[(replica, rank)].gc,  # the engine process's collector pauses
                      **({"kv": engines[(replica, rank)].kv} if engines[(replica, rank)].kv else {})})  # kv_rows
        loads += [{"t_s": t - start_wall, "replica": replica, "rank": rank, "adapter": rec.adapter,
                   "nbytes": rec.nbytes, "ready_ms": rec.ready_ms, "h2d_ms": rec.h2d_ms, "disk_ms": rec.disk_ms,
                   "host_hit": rec.host_hit, "after_write_back": rec.after_write_back, "read_way": rec.read_way}
                  for t, rec in logs[(replica, rank)] if t >= since_wall]
    steps = [{"replica": replica, "t_s": s.wall_s - start_wall, **s._asdict()}  # t_s: the loads' clock
             for replica, res in zip(replicas, results) for s in res.ranks[0].step_log]
    return PolicyRun(policy.name, "real", records, stats, sorted(loads, key=lambda x: x["t_s"]), steps)
