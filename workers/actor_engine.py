"""A hosted engine's calls on the worker actor (``bench.run --engine real``): the reference engine built and run in
the worker's own process, beside its cache. A mixin of ``workers.actor.WorkerActor`` (its seam: the engine's
calls, apart from the cache's control calls), which provides ``cache``, ``cache_init_s``, ``engine``, ``config``
and ``replica``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from lora_cache.runtime import heap
from lora_cache.vocab import CONTROLLER_NAME, ReadinessRecord
from workers.engine.config import EngineConfig
from workers.engine.engine import EngineResult
from workers.engine.hosted import HostedEngine, Rendezvous, rendezvous
from workers.engine.workload import Request

if TYPE_CHECKING:
    from workers.cache import WorkerCache, WorkerConfig


class HostedEngineCalls:
    cache: WorkerCache
    cache_init_s: float
    engine: HostedEngine
    config: WorkerConfig
    replica: str

    def preload(self, names: list[str], timeout_s: float = 600.0) -> list[ReadinessRecord]:
        """Load every named adapter, one at a time (the host tier stages a bounded number of shards at
        once), and wait until each is READY here: the oracle's infinite cache."""
        return [self.cache.prefetch(n).result(timeout=timeout_s) for n in names]

    @ray.method(concurrency_group="engine")
    def engine_rendezvous(self, world: int) -> Rendezvous:
        return rendezvous(world)

    @ray.method(concurrency_group="engine")
    def engine_build(self, config: EngineConfig, meet: Rendezvous) -> dict[str, float]:
        """Build this rank's engine; returns the seconds its start-up phases took (this cache's too)."""
        return {"cache_init_s": self.cache_init_s, **self.engine.build(config, meet, self.config.tp_rank)}

    @ray.method(concurrency_group="engine")
    def engine_run(self, requests: list[Request], start_wall: float, inflight: int = 0,
                   report_queue: bool = False, streaming: bool = False) -> EngineResult:
        """Serve ``requests`` from ``start_wall`` (time.time()); rank 0 reports its queue if asked and, if
        ``streaming``, takes the requests ``engine_submit`` brings until ``engine_end_stream``."""
        report: Callable[[list[tuple[str, float]]], None] | None = None
        if report_queue:
            controller = ray.get_actor(CONTROLLER_NAME)

            def report(queue: list[tuple[str, float]]) -> None:
                ray.get(controller.report_queue.remote(self.replica, queue), timeout=30)
        try:
            return HostedEngine.strip(self.engine.run(requests, start_wall, inflight, report, streaming))
        finally:
            self.engine.close()
            heap.freeze()  # the run thawed the heap: collect what the engine left, freeze the rest again

    @ray.method(concurrency_group="submit")
    def engine_submit(self, requests: list[Request]) -> None:
        self.engine.submit(requests)

    @ray.method(concurrency_group="feed")
    def engine_end_stream(self) -> None:
        self.engine.end_stream()

    @ray.method(concurrency_group="finished")
    def engine_finished(self, timeout_s: float = 1.0) -> list[int] | None:
        """Request ids done since the last call (a long poll); None once the run is over."""
        return self.engine.finished(timeout_s)
