"""The reference engine served through Ray Serve, each replica's slots planned by lora-cache, requests routed by
``LoraCacheRouter``: a Ray Serve user's many-adapter deployment (``lora_cache.integrations.ray_serve``).

    python examples/ray_serve_lora.py                      # CPU, tiny model: a local Ray, lora-cache, 3 replicas
    python examples/ray_serve_lora.py --routing serve      # the same app routed by Ray Serve's own multiplexing

Each replica attaches to the lora-cache controller as the replica ``serve-LoraEngine-<id>`` (``CacheReplica``)
and runs the reference engine (``workers/engine``) in streaming mode over its attachment: the public seam
(``Attachment``: exact versions, the engine's version exchange, pipelined loads), never the cache behind it.
A request names its adapter as Serve's multiplexed model id
(``handle.options(multiplexed_model_id=...)`` or the HTTP header ``serve_multiplexed_model_id``).

GPUs: start lora-cache on the cluster (``lora-cache serve --replicas 0 --adapters DIR --model llama-3.1-8b
--grpc-host 0.0.0.0 --token-file TOKEN``: beyond loopback it needs authentication; the router sends it as
``token=``), then deploy ``app(routing, "<gateway host>:50051", replicas, ReplicaCacheConfig(device="cuda",
dtype="bfloat16", num_slots=...), engine_config(model=..., device="cuda", dtype="bfloat16", cuda_graphs=True))``: an
engine on cuda gives each replica ``ray_actor_options={"num_gpus": 1}``. ``python -m bench.probes.ray_serve --device
cuda --model llama-3.1-8b`` runs it so, both routings (``bench/gpu/serve.sh``). One Serve replica is
one TP rank here (the reference engine's TP ranks meet over ``torch.distributed`` from one process each; a TP > 1
engine in Serve keeps rank 0 in the replica and its other ranks in ``CacheReplica``'s rank actors).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import threading
import time
from typing import Any

from ray import serve

from lora_cache.integrations.ray_serve import CacheReplica, ReplicaCacheConfig, router_config
from workers.engine.config import EngineConfig
from workers.engine.hosted import HostedEngine, rendezvous
from workers.engine.workload import Request

SLOTS = 4  # adapter slots per replica (both routings: equal memory)
LOAD_CAUSES = ("prefetches", "demand_loads", "prefetch_used", "prefetch_unused", "evictions", "stages")


def engine_config(**overrides: Any) -> EngineConfig:
    """The reference engine on CPU with the tiny model (a few ms per step)."""
    base: dict[str, Any] = dict(
        model="tiny",
        device="cpu",
        dtype="float32",
        num_slots=SLOTS,
        max_rank=16,
        max_running=8,
        max_adapters=4,
        max_prefill_tokens=512,
        max_seq_len=256,
        cuda_graphs=False,
    )
    return EngineConfig(**{**base, **overrides})


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16)
class LoraEngine:
    """One Serve replica: its cache attached to lora-cache, the reference engine running over it."""

    def __init__(
        self, cache: ReplicaCacheConfig, engine: EngineConfig, multiplexed: bool = False, ahead: bool = True
    ) -> None:
        self.cache = CacheReplica(cache)
        self.multiplexed = multiplexed  # Ray Serve's own routing: its LRU of model ids, loaded on a miss
        self.ahead = ahead  # lora-cache: a miss loads before the request reaches the engine (off its steps)
        self.hosted = HostedEngine(self.cache.rank)  # the public seam, as any integrator's engine
        self.hosted.build(engine, rendezvous(1), 0)
        self.start = time.time()
        self.rids = itertools.count()
        self.waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}  # rid -> its caller
        self.lock = threading.Lock()  # protects waiting
        self.died: BaseException | None = None  # why the engine's run ended, if it failed
        self.runner = threading.Thread(target=self._run, name="reference-engine", daemon=True)
        self.runner.start()
        threading.Thread(target=self._finish, name="engine-finished", daemon=True).start()

    def _run(self) -> None:
        try:
            self.hosted.run([], self.start, report=self.cache.rank.report_queue, streaming=True)
        except BaseException as e:  # the engine is gone: its requests fail (``_finish``), later ones at once
            self.died = e
            raise

    def _finish(self) -> None:
        while (rids := self.hosted.finished(0.5)) is not None:
            for rid in rids:
                with self.lock:
                    loop, future = self.waiting.pop(rid)
                loop.call_soon_threadsafe(future.set_result, None)
        with self.lock:  # the run is over: nothing still waiting will finish
            left, self.waiting = list(self.waiting.values()), {}
        for loop, future in left:
            loop.call_soon_threadsafe(future.set_exception, RuntimeError(f"the engine stopped: {self.died!r}"))

    @serve.multiplexed(max_num_models_per_replica=SLOTS)
    async def load(self, adapter: str) -> str:
        """Ray Serve's load-on-miss (the baseline only): the adapter into a slot before the request runs."""
        await asyncio.to_thread(lambda: self.cache.rank.prefetch(adapter).result(timeout=60))
        return adapter

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        adapter = serve.get_multiplexed_model_id()
        began = time.perf_counter()
        hit = adapter in self.cache.rank.ready_names()  # READY on arrival: no load on this request's path
        if self.multiplexed:
            await self.load(adapter)
        elif self.ahead and not hit:  # else the engine's step loads it, and the batch's other requests wait
            await self.cache.ensure_ready(adapter)
        submitted = time.perf_counter()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        rid = next(self.rids)
        if not self.runner.is_alive():
            raise RuntimeError(f"replica {self.cache.name}: its engine stopped ({self.died!r})")
        with self.lock:
            self.waiting[rid] = (loop, future)
        item = Request(rid, adapter, int(request.get("input_len", 64)), int(request.get("output_len", 1)),
                           time.time() - self.start)
        try:
            self.hosted.submit([item])
        except BaseException:  # refused (NotFoundError: an adapter this engine does not serve): this one alone
            with self.lock:
                self.waiting.pop(rid, None)
            raise
        await future
        stats = self.cache.rank.stats()
        return {
            "replica": self.cache.name,
            "adapter": adapter,
            "hit": hit,
            "ms": (time.perf_counter() - began) * 1e3,
            "before_engine_ms": (submitted - began) * 1e3,  # the load on a miss (both routings), before the engine
            "loads": stats["loads"],  # this replica's, so far
            "gpu_hits": stats["gpu_hits"],
            "gpu_misses": stats["gpu_misses"],
            # the loads by cause, this replica's so far (the probe's `load_causes`): started by a prefetch (the
            # controller's commands; under Serve's routing, @serve.multiplexed's load), by an acquire that missed,
            # and what became of the prefetched ones evicted so far (a batch used them or not), host-tier stages
            **{k: stats[k] for k in LOAD_CAUSES},
        }

    def __del__(self) -> None:
        self.hosted.end_stream()
        self.cache.shutdown()


def app(
    routing: str = "lora-cache",
    server: str = "127.0.0.1:50051",
    replicas: int = 3,
    cache: ReplicaCacheConfig | None = None,
    engine: EngineConfig | None = None,
    ahead: bool = True,
    **router: Any,
) -> Any:
    """The Serve application: ``routing`` lora-cache (``LoraCacheRouter``) or serve (Ray Serve's multiplexing);
    ``ahead``: under lora-cache, a request's adapter is loaded before the engine takes it (``ensure_ready``)."""
    cache = cache or ReplicaCacheConfig(num_slots=SLOTS)
    options: dict[str, Any] = {"num_replicas": replicas}
    if routing == "lora-cache":
        options["request_router_config"] = router_config(server=server, **router)
    deployment: Any = LoraEngine  # a serve.Deployment (mypy sees the class)
    engine = engine or engine_config(num_slots=cache.num_slots, max_adapters=min(4, cache.num_slots))
    if engine.device == "cuda":  # one GPU a replica (Ray sets its CUDA_VISIBLE_DEVICES: rank 0 on cuda:0)
        options["ray_actor_options"] = {"num_cpus": 0, "num_gpus": 1}
    return deployment.options(**options).bind(cache, engine, routing == "serve", ahead)


def main() -> None:
    import ray

    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.adapters.synth import SynthConfig, make_adapters
    from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
    from lora_cache.app.serve import ServeConfig, start
    from lora_cache.planner import PlannerConfig
    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routing", choices=("lora-cache", "serve"), default="lora-cache")
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="serve-adapters-")
    make_adapters(root, SynthConfig(model="tiny", count=args.adapters, rank="8,16"))
    ray.init(namespace="lora-cache", include_dashboard=False)
    service = start(
        ServeConfig(adapters=root, replicas=0),
        CatalogConfig(model="tiny", max_rank=16),
        PlannerConfig(policy="global" if args.routing == "lora-cache" else "none"),
        WorkerConfig(),
    )
    gateway = start_gateway_thread(GatewayConfig(grpc_port=0), service.controller)
    try:
        cache = ReplicaCacheConfig(num_slots=SLOTS, worker={"host": HostTierConfig(host_bytes=64 << 20, pin=False)})
        handle = serve.run(app(args.routing, gateway.target, cache=cache), name="lora")
        names = sorted(p.name for p in __import__("pathlib").Path(root).iterdir())
        calls = [handle.options(multiplexed_model_id=names[i % len(names)]).remote({}) for i in range(args.requests)]
        out = [c.result() for c in calls]
        print(
            f"{len(out)} requests over {len({o['replica'] for o in out})} replicas; "
            f"hit rate {sum(o['hit'] for o in out) / len(out):.2f}; "
            f"mean {sum(o['ms'] for o in out) / len(out):.1f} ms"
        )
    finally:
        serve.shutdown()
        gateway.stop()
        service.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
