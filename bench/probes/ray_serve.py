"""One Ray Serve app, two routings, equal memory: ``LoraCacheRouter`` with the controller planning the replicas'
slots (policy global, hints) against Ray Serve's own multiplexed routing (power of two choices with model-id
affinity, ``@serve.multiplexed``'s LRU of ``--slots`` models per replica, loaded on a miss; the controller plans
nothing: policy none). The app is ``examples/ray_serve_lora.py``: the reference engine on CPU, tiny model, each
replica ``--slots`` adapter slots.

    python -m bench.probes.ray_serve --replicas 3 --slots 4 --adapters 16 --rate 12 --requests 240

An open loop of Poisson arrivals, adapters by Zipf popularity (``bench.workloads``' rule), one output token per
request: its latency from the handle's call to its result is its TTFT (bench_serving's ``mean_ttft_ms``,
``p99_ttft_ms``). ``gpu_hit_rate``: the share of requests whose adapter was READY on their replica when they
arrived; ``loads``: copies into slots over the replicas; ``replica_ms_mean``: a request's time inside its replica;
``router``: ``LoraCacheRouter``'s own counters (requests ranked, ready first, fallbacks, readiness events, hint and
cancel calls); ``before_engine_ms_mean``: the part of a request's replica time before the engine took it (its load
on a miss, under both routings), ``engine_ms_mean`` the rest. The controller and
the gateway run in a ``lora-cache serve`` process of their own (``--gateway process``, as deployed) or in this
driver (``--gateway thread``); ``--policy``, ``--epsilon``, ``--min-bound``, ``--serve-args`` and ``--router``
(``RouterSettings`` as JSON) vary the lora-cache side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def workload(adapters: list[str], requests: int, rate: float, alpha: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** alpha for i in range(len(adapters))]
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate)
        out.append((t, rng.choices(adapters, weights)[0]))
    return out


async def _play(handle: Any, arrivals: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """Each request sent at its arrival time (open loop), timed from the call to its result."""
    start = time.perf_counter()

    async def one(at: float, adapter: str) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter()
        out = await handle.options(multiplexed_model_id=adapter).remote({})
        return {**out, "ttft_ms": (time.perf_counter() - sent) * 1e3}

    return list(await asyncio.gather(*(one(at, a) for at, a in arrivals)))


def _route_probe(target: str, names: list[str], n: int) -> dict[str, float]:
    """``n`` sequential Route calls from this process (an idle fleet): what one advice costs a router."""
    if n <= 0:
        return {}
    from lora_cache.api.client import LoraCacheClient

    client = LoraCacheClient(target, timeout_s=10)
    took = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            client.route([names[i % len(names)]])
            took.append((time.perf_counter() - t0) * 1e3)
    finally:
        client.close()
    return {"route_ms_median": float(np.median(took)), "route_ms_p99": float(np.percentile(took, 99))}


class _ServeProcess:
    """``lora-cache serve --replicas 0`` in a process of its own, joined to this driver's Ray cluster."""

    def __init__(self, proc: subprocess.Popen[bytes], target: str) -> None:
        self.proc, self.target = proc, target

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve_process(args: argparse.Namespace, root: str, policy: str) -> _ServeProcess:
    import ray

    from lora_cache.api.client import ClientError, LoraCacheClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "lora_cache.app.cli", "serve", "--address", ray.get_runtime_context().gcs_address,
            "--replicas", "0", "--adapters", root, "--model", "tiny", "--max-rank", "16", "--policy", policy,
            "--epsilon", str(args.epsilon), "--min-bound", str(args.min_bound), "--grpc-host", "127.0.0.1",
            "--grpc-port", str(port), *args.serve_args.split()]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    service = _ServeProcess(proc, f"127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    while True:
        try:
            with LoraCacheClient(service.target, timeout_s=2) as client:
                if client.status().adapters == args.adapters:
                    return service
        except ClientError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            service.stop()
            raise RuntimeError(f"lora-cache serve did not come up at {service.target} (exit {proc.poll()})")
        time.sleep(0.2)


def run(routing: str, args: argparse.Namespace, root: str, names: list[str]) -> dict[str, Any]:
    from ray import serve

    from examples.ray_serve_lora import app, engine_config
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
    from lora_cache.app.serve import ServeConfig, start
    from lora_cache.integrations.ray_serve import ReplicaCacheConfig
    from lora_cache.planner import PlannerConfig
    from lora_cache.routing.ranking import RouterConfig
    from workers.cache import WorkerConfig
    from workers.host_tier import HostTierConfig

    policy = args.policy if routing == "lora-cache" else "none"
    if args.gateway == "process":  # as deployed: the controller and the gateway in `lora-cache serve`'s process
        service: Any = _serve_process(args, root, policy)
        target = service.target
    else:  # in this driver's process, beside the load generator and the handle's router
        service = start(
            ServeConfig(adapters=root, replicas=0),
            CatalogConfig(model="tiny", max_rank=16),
            PlannerConfig(policy=policy),
            WorkerConfig(),
            RouterConfig(epsilon=args.epsilon, min_bound=args.min_bound),
        )
        gateway = start_gateway_thread(GatewayConfig(grpc_port=0), service.controller)
        target = gateway.target
    try:
        cache = ReplicaCacheConfig(
            num_slots=args.slots, worker={"host": HostTierConfig(host_bytes=args.host_mib << 20, pin=False)}
        )
        handle = serve.run(
            app(
                routing,
                target,
                args.replicas,
                cache,
                engine_config(num_slots=args.slots, max_adapters=min(4, args.slots)),
                not args.no_ahead,
                **{"epsilon": args.epsilon, "min_bound": args.min_bound, **json.loads(args.router)},
            ),
            name=f"bench-{routing}",
            route_prefix=None,
        )
        for name in names[: args.replicas]:  # every replica up and its engine warm before the clock
            handle.options(multiplexed_model_id=name).remote({}).result(timeout_s=120)
        probe = _route_probe(target, names, args.route_probe) if routing == "lora-cache" else {}
        arrivals = workload(names, args.requests, args.rate, args.alpha, args.seed)
        load_before = os.getloadavg()[0]
        start_t = time.perf_counter()
        results = asyncio.run(_play(handle, arrivals))
        ttft = np.array([r["ttft_ms"] for r in results])  # the handle's call to its result: routing included
        loads: dict[str, int] = {}
        for r in results:
            loads[r["replica"]] = max(loads.get(r["replica"], 0), r["loads"])
        inner = getattr(getattr(getattr(handle, "_router", None), "_asyncio_router", None), "_request_router", None)
        counts = dict(getattr(inner, "counts", {}))  # LoraCacheRouter's own (this driver's handle)
        return {
            "routing": routing,
            "replica_ms_mean": float(np.mean([r["ms"] for r in results])),  # arrival at the replica to the result
            "before_engine_ms_mean": float(np.mean([r["before_engine_ms"] for r in results])),  # loads off its steps
            "engine_ms_mean": float(np.mean([r["ms"] - r["before_engine_ms"] for r in results])),
            "loadavg": [load_before, os.getloadavg()[0]],  # the machine's 1-minute load average, before and after
            "router": counts,
            "requests": len(results),
            "mean_ttft_ms": float(ttft.mean()),
            "p99_ttft_ms": float(np.percentile(ttft, 99)),
            "median_ttft_ms": float(np.median(ttft)),
            "gpu_hit_rate": sum(r["hit"] for r in results) / len(results),
            "loads": sum(loads.values()),
            "replicas_used": len(loads),
            "wall_s": time.perf_counter() - start_t,
            "policy": policy,
            **probe,
        }
    finally:
        serve.delete(f"bench-{routing}")
        if args.gateway == "thread":
            gateway.stop()
        service.stop()


def main(argv: list[str] | None = None) -> int:
    import ray

    from lora_cache.adapters.synth import SynthConfig, make_adapters

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--slots", type=int, default=4, help="adapter slots per replica (both routings)")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=12.0, help="requests per second (Poisson)")
    p.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    p.add_argument("--host-mib", type=int, default=16, help="host tier per replica (MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routings", default="serve,lora-cache")
    p.add_argument("--policy", default="global", help="the planner's policy under lora-cache routing")
    p.add_argument("--epsilon", type=float, default=0.25, help="RouterConfig.epsilon (the advice's load bound)")
    p.add_argument("--min-bound", type=float, default=8.0, help="RouterConfig.min_bound")
    p.add_argument(
        "--gateway",
        choices=("process", "thread"),
        default="process",
        help="the controller and gateway in a `lora-cache serve` process of their own (as deployed) or in this "
        "driver's process (beside the load generator and the handle's router)",
    )
    p.add_argument("--serve-args", default="", help="more `lora-cache serve` options (--gateway process)")
    p.add_argument("--router", default="{}", help="more LoraCacheRouter settings (JSON)")
    p.add_argument(
        "--no-ahead",
        action="store_true",
        help="lora-cache routing: a miss loads inside the engine's step (the replica's ensure_ready off)",
    )
    p.add_argument("--route-probe", type=int, default=0, help="time this many Route calls before the run")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="serve-bench-")
    make_adapters(root, SynthConfig(model="tiny", count=args.adapters, rank="8,16"))
    names = sorted(d.name for d in Path(root).iterdir())
    ray.init(address="local", num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for routing in args.routings.split(","):
            rows.append(run(routing, args, root, names))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    print(f"{'routing':<11} {'mean_ttft_ms':>12} {'p99_ttft_ms':>11} {'gpu_hit_rate':>12} {'loads':>6}")
    for r in rows:
        print(
            f"{r['routing']:<11} {r['mean_ttft_ms']:>12.1f} {r['p99_ttft_ms']:>11.1f} {r['gpu_hit_rate']:>12.2f} "
            f"{r['loads']:>6}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
