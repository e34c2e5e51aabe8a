"""The replica's serving loop and ``run_engine``: requests in, per-request timings out.

One round, on every rank (rank 0's clock times arrivals and tokens):
  1. rules that prefetch (overlap): each rank pins (acquires) the wanted adapters READY on it, so no
     load can evict them, and reports them; the element-wise minimum over ranks is the replica's view;
  2. rank 0 takes the requests submitted since the last round (a streaming run's ``Feed``); its scheduler
     turns the clock and that view into a StepPlan; a gloo broadcast hands it to all (the other ranks
     see requests only in these plans, so every rank runs the same ones in the same order).
     The plan also carries the adapters rank 0's catalog registered since the last round (``StepPlan.names``):
     every rank appends them to its version exchange, in that order, before the next round, so a replica
     serves adapters registered while it runs (a request for a name the catalog lacks fails alone);
  3. every rank runs it: prefill or decode (acquire, prefetch, layers with the LoRA kernels and the
     all-reduce, release, wait for the tokens), or a wait for the next load or arrival.
Between rounds (rules that prefetch, rank 0 of a streaming run): each submit pins its request's adapter if
READY, else starts its load, in the submitting thread (``Feed.watch`` -> ``Arrivals.arrived``), so neither
waits for the next round; the round after the scheduler took the request releases those pins (its own hold
what it wants). Ranks other than rank 0 see requests only in plans: on them this starts at the next round.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import KnownVersion
from lora_cache.adapters.refs import split_ref, version_of
from lora_cache.errors import ConfigError, LoraCacheError
from lora_cache.runtime import heap
from workers.attach.versions import ReducedVersions
from workers.engine.admission import ADMISSION, AdmissionRule
from workers.engine.catalog import known_versions, load_catalog
from workers.engine.config import EngineConfig
from workers.engine.feed import Feed
from workers.engine.kv_rows import split_report
from workers.engine.rank import RankEngine, RankStats
from workers.engine.scheduler import STOP, Scheduler, StepPlan, check_requests
from workers.engine.timings import RequestRecord, summarize
from workers.engine.tp import Comm, spawn
from workers.engine.workload import Request


class EngineResult(NamedTuple):
    records: list[RequestRecord]  # one per request, by rid
    ranks: list[RankStats]  # one per TP rank

    def summary(self) -> dict[str, float]:
        return summarize(self.records)


class Hooks(NamedTuple):
    """How a replica run meets the outside world (the benchmark sets these; defaults: alone)."""

    start_wall: float | None = None  # time.time() at which the clock starts (None: once every rank is built)
    on_queue: Callable[[list[tuple[str, float]]], None] | None = None  # rank 0: the waiting queue changed
    # (adapter, arrival as time.time()) per waiting request, in queue order
    inflight: int = 0  # closed loop: this many requests waiting or running (0: arrivals as given)
    feed: Feed | None = None  # rank 0: requests submitted while it runs, until the feed's end of stream
    # (``workers/engine/feed.py``); the ranks without it follow rank 0's plans


def run_engine(config: EngineConfig, requests: Sequence[Request]) -> EngineResult:
    """Serve ``requests`` on one replica of ``config.tp`` ranks (processes when tp > 1); a request may name one
    version its catalog keeps (``A@VERSION`` or ``A@TAG``: ``pinned_refs``)."""
    catalog = load_catalog(config)
    requests = pinned_refs(requests, catalog)
    check_requests(requests, config, catalog.names())
    rule = ADMISSION[config.admission]()  # made here: ranks get it pickled (a rule class must be importable)
    # every rank takes the versions this catalog found (``load_catalog``): they agree on each adapter's version
    serve = functools.partial(serve_rank, config, rule, tuple(requests), known=known_versions(catalog))
    if config.tp == 1:
        return serve(Comm())
    return spawn(serve, config.tp, config.device_kind())


def _bad_ref(request: Request, error: LoraCacheError) -> LoraCacheError:
    return ConfigError(f"request {request.rid}: {error}")


def pinned_refs(requests: Sequence[Request], catalog: AdapterCatalog,
                refuse: Callable[[Request, LoraCacheError], LoraCacheError] = _bad_ref) -> list[Request]:
    """``requests`` with each reference to one version (``A@VERSION``, ``A@TAG``) made its exact version
    (``A@VERSION``), for a run (``run_engine``) and a streaming submit (``HostedEngine.submit``) alike; for a
    request whose reference is malformed or names a version this catalog does not keep, raises ``refuse(request,
    error)`` from the error: by default a ConfigError naming the request and the versions kept, before anything
    runs (the submit passes its own, which keeps the error's class for its remote callers)."""
    out = []
    for r in requests:
        if r.adapter and "@" in r.adapter:
            try:
                name, ref = split_ref(r.adapter)
                r = r._replace(adapter=f"{name}@{version_of(catalog, name, ref or '')}")
            except LoraCacheError as e:
                raise refuse(r, e) from e
        out.append(r)
    return out


def serve_rank(config: EngineConfig, rule: AdmissionRule, requests: tuple[Request, ...], comm: Comm,
               engine: RankEngine | None = None, hooks: Hooks | None = None,
               known: Mapping[str, KnownVersion] | None = None) -> EngineResult:
    """One rank's whole run (rank 0 also schedules and records); ``engine``: built already (over a worker's
    cache, see ``RankEngine``), or None to build one here, its catalog taking the driver's ``known`` versions.
    The engine is closed at the end."""
    if engine is None:
        engine = RankEngine(config, comm, known=known)
        engine.warm_up()
    hooks = hooks or Hooks()
    feed = hooks.feed if comm.rank == 0 else None
    if feed is not None and rule.prefetch:
        feed.watch(engine.arrivals.arrived)  # an arrival's adapter is pinned or loaded at once, not at the next round
    scheduler = Scheduler(config, rule, requests, hooks.inflight, feed is not None) if comm.rank == 0 else None
    heap.freeze()  # no full collection walks the built engine mid-run (a ~100 ms stall; lora_cache/runtime/heap.py)
    wall0: float | None = None
    clock0: float | None = None  # the run's clock start, as time.perf_counter()
    try:
        comm.barrier()  # every rank built: the clock starts now (or at hooks.start_wall)
        if comm.rank == 0:  # the versions the requests given at start name: a row each (as a submit's, ``_take``)
            engine.add_names(tuple(sorted({r.adapter for r in requests if r.adapter and "@" in r.adapter}
                                          - set(engine.index))))
        if comm.world > 1:  # one names list for the version exchange: rank 0's (a rank's catalog may lag at build)
            engine.adopt(comm.broadcast(engine.names if comm.rank == 0 else None))
        t0 = time.perf_counter()
        if hooks.start_wall is not None:
            t0 += hooks.start_wall - time.time()
            time.sleep(max(0.0, t0 - time.perf_counter()))
        wall0 = time.time() - (time.perf_counter() - t0)
        clock0 = t0
        plan, queue, named_rows = StepPlan(STOP), None, NamedRows(NAMED_ROWS_IDLE)
        while True:
            vec = comm.min_control(engine.readiness(plan.wanted))  # every rule: the versions (invariant 1)
            added: tuple[str, ...] = ()
            if feed is not None and scheduler is not None:
                engine.arrivals.taken()  # before the take: an arrival after it keeps its pin a round more
                added = _take(feed, scheduler, engine)
            elif scheduler is not None:
                added = engine.new_names()
            dropped: tuple[str, ...] = ()
            if scheduler is not None:  # of the named rows alone (``RankVersions.named``), not every name: each round
                dropped = named_rows.dropped(engine.versions.named, scheduler.named_in_use())
            plan = comm.broadcast(_plan(scheduler, time.perf_counter() - t0, engine, vec, added, dropped))
            engine.add_names(plan.names, plan.dropped, plan.retired)  # every rank, this round: the next exchange
            if scheduler is not None and hooks.on_queue is not None and (now := scheduler.queue(plan)) != queue:
                queue = now
                hooks.on_queue([(a, wall0 + t) for a, t in now])
            if plan.kind == STOP:
                break
            step = engine.execute(plan, feed.arrival() if feed is not None else None)
            if scheduler is not None and step is not None:
                scheduler.finish_step(plan, step.end_s - t0, step.load_wait_s, step.outputs)
            if feed is not None and scheduler is not None:
                feed.done(scheduler.take_finished())
    finally:
        if feed is not None and scheduler is not None:
            feed.watch(None)
            feed.done(scheduler.take_finished())  # failures found in the last round's plan
            feed.stop()
        stats = engine.close()
        heap.thaw()
    ranks = comm.gather(stats)
    records = scheduler.records() if scheduler is not None else []
    if feed is not None and clock0 is not None:  # when each streamed submit reached rank 0 (bench.sim.check replays it)
        received = feed.received(clock0)
        records = [dataclasses.replace(r, received_s=received.get(r.rid)) for r in records]
    return EngineResult(records, ranks)


def _take(feed: Feed, scheduler: Scheduler, engine: RankEngine) -> tuple[str, ...]:
    """Rank 0 of a streaming run: the requests submitted since the last round, and the end of stream; returns the
    names its catalog registered since the last round (read after the take: an adapter registered before its
    request was submitted is among them or known already). A request for an adapter outside the version
    exchange's names and those fails alone: the loop goes on."""
    new, closed = feed.take()
    added = engine.new_names()
    index = engine.index
    # requests naming one version (``A@VERSION``, made so by the submit): a row of the exchange each, on every rank
    named = sorted({r.adapter for r in new if r.adapter and "@" in r.adapter and r.adapter not in index})
    added += tuple(n for n in named if n not in added)
    if new:
        known: Collection[str] = engine.index if not added else {*engine.index, *added}
        scheduler.add(new, known)
    if closed:
        scheduler.end()
    return added


def _plan(scheduler: Scheduler | None, now: float, engine: RankEngine, reduced: torch.Tensor,
          added: tuple[str, ...] = (), dropped: tuple[str, ...] = ()) -> StepPlan | None:
    """Rank 0: the ranks' reduced reports -> failures of the last step, then the next plan (carrying ``added``,
    the names every rank appends to the exchange after it; their requests wait a round: no version yet)."""
    if scheduler is None:
        return None
    reduced, kv_held = split_report(reduced, engine.kv_lend)
    view = ReducedVersions(reduced, engine.names, engine.versions.codes)
    if failed := view.step_failures():
        scheduler.fail_step(failed)
    plan = scheduler.plan(now, view.readiness(), view.versions(), kv_held)
    retired = engine.releases.take()  # () at TP 1: nothing is watched
    return plan._replace(names=added, dropped=dropped, retired=retired) if added or dropped or retired else plan


NAMED_ROWS_IDLE = 64  # rows of named versions no request uses that stay in the exchange (the most recently used)


class NamedRows:
    """Rank 0: which rows of named versions (``A@VERSION``, one per version a request named) to drop from the version
    exchange, so that it does not grow with every version requests ever named (an RL loop names a new one every
    few seconds). A row some pending, waiting or running request names stays; of the others, the ``keep`` used
    most recently stay too (a request naming one again is admitted without the round a new row waits); the rest
    go, least recently used first."""

    def __init__(self, keep: int = NAMED_ROWS_IDLE) -> None:
        self.keep = keep
        self.round = 0
        self.last: dict[str, int] = {}  # named row -> the last round a request used it (or it joined)

    def dropped(self, named: Sequence[str], used: set[str]) -> tuple[str, ...]:
        """The rows of ``named`` (the exchange's named rows now, in its order: ``RankVersions.named``) to drop this
        round, given the named versions in ``used``. It takes those rows alone, not every name of the exchange: this
        runs every round and the exchange grows with every adapter registered."""
        self.round += 1
        last = {n: self.round if n in used or n not in self.last else self.last[n] for n in named}
        idle = sorted((last[n], i, n) for i, n in enumerate(named) if n not in used)  # ties: the older row first
        out = tuple(n for _, _, n in idle[: max(0, len(idle) - self.keep)])
        self.last = {n: t for n, t in last.items() if n not in out}
        return out
