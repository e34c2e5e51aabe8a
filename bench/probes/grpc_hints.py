"""Hint ingestion over gRPC, end to end into the controller (lifecycle steps 1-2), on CPU.

    python -m bench.probes.grpc_hints [--duration 10] [--clients 8] [--batch 100] [--replicas 2] [--out FILE.json]

Starts an embedded ``lora-cache serve`` (local Ray, CPU workers, tiny adapters) and the gRPC gateway
in this process; a separate load-generator process runs ``--clients`` asyncio tasks, each sending
Hint calls of ``--batch`` hints (unique ids, random registered adapters and replicas) through the
generated stubs as fast as their calls return. A Hint call returns once the controller has taken its
batch, so the figure is end to end: hints/s = hints the controller counted (its Status) during the
run / the run's wall time. Also reported: p50/p99/max call latency, calls refused (e.g.
RESOURCE_EXHAUSTED) and how many controller calls the gateway's ingest coalesced them into.
Target (issue 4): >= 20,000 hints/s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def _client(stub: Any, task: int, args: argparse.Namespace, adapters: list[str], replicas: list[str],
                  deadline: float, out: dict[str, Any]) -> None:
    from lora_cache.api.v1 import lora_cache_service_pb2 as pb

    rng = random.Random(task)
    seq = 0
    while time.perf_counter() < deadline:
        hints = [pb.PrefetchHint(hint_id=f"{os.getpid()}-{task}-{seq}-{j}", adapter=rng.choice(adapters),
                                 replica=rng.choice(replicas)) for j in range(args.batch)]
        seq += 1
        t0 = time.perf_counter()
        try:
            await stub.Hint(pb.HintRequest(hints=hints), timeout=30)
        except grpc.aio.AioRpcError as e:
            out["errors"][e.code().name] = out["errors"].get(e.code().name, 0) + 1
            continue
        out["latency_ms"].append((time.perf_counter() - t0) * 1e3)
        out["hints"] += args.batch


async def _load(target: str, args: argparse.Namespace, adapters: list[str], replicas: list[str]) -> dict[str, Any]:
    from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc

    out: dict[str, Any] = {"latency_ms": [], "hints": 0, "errors": {}}
    channels = [grpc.aio.insecure_channel(target) for _ in range(args.channels)]
    stubs = [pb_grpc.LoraCacheServiceStub(c) for c in channels]
    t0 = time.perf_counter()
    deadline = t0 + args.duration
    await asyncio.gather(*(_client(stubs[i % len(stubs)], i, args, adapters, replicas, deadline, out)
                           for i in range(args.clients)))
    out["wall_s"] = time.perf_counter() - t0
    for c in channels:
        await c.close()
    return out


def load_process(target: str, args: argparse.Namespace, adapters: list[str], replicas: list[str],
                 queue: Any) -> None:
    queue.put(asyncio.run(_load(target, args, adapters, replicas)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.adapters.synth import SynthConfig, make_adapters
    from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
    from lora_cache.app.serve import ServeConfig, start
    from lora_cache.planner import PlannerConfig
    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    root = Path(tempfile.mkdtemp(prefix="lora-cache-bench-"))
    adapters = [p.name for p in make_adapters(root, SynthConfig(model="tiny", count=args.adapters, rank="8,16"))]
    ray.init(address="local", num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    service = start(ServeConfig(adapters=str(root), replicas=args.replicas, tp=1),
                    CatalogConfig(model="tiny", max_rank=16),
                    PlannerConfig(policy="global", max_hints_per_replica=args.max_hints_per_replica,
                                  hint_ttl_s=args.hint_ttl_s),
                    WorkerConfig(num_slots=4, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
    gateway = start_gateway_thread(GatewayConfig(grpc_port=0), service.controller)
    replicas = [f"replica-{i}" for i in range(args.replicas)]
    try:
        ctl = service.controller
        before = ray.get(ctl.status.remote())["hints_received"]
        calls_before = gateway.gateway.ingest.calls
        queue = mp.get_context("spawn").SimpleQueue()
        proc = mp.get_context("spawn").Process(target=load_process, args=(gateway.target, args, adapters, replicas,
                                                                          queue))
        proc.start()
        load = queue.get()
        proc.join()
        status = ray.get(ctl.status.remote())
        confirmed = status["hints_received"] - before
        calls = gateway.gateway.ingest.calls - calls_before
        assert ray.get(ctl.check_integrity.remote())
    finally:
        gateway.stop()
        service.stop()
        ray.shutdown()
    lat = load["latency_ms"]
    return {
        "bench": "grpc_hints", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "hints_sent_ok": load["hints"], "hints_confirmed_by_controller": confirmed, "wall_s": load["wall_s"],
        "hints_per_s": confirmed / load["wall_s"], "calls": len(lat), "errors": load["errors"],
        "latency_ms": {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99), "max": max(lat, default=0.0),
                       "mean": statistics.fmean(lat) if lat else 0.0},
        "controller_calls": calls, "hints_per_controller_call": confirmed / calls if calls else 0.0,
        "hints_accepted": status["hints_accepted"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client tasks")
    parser.add_argument("--channels", type=int, default=2, help="gRPC channels the tasks share")
    parser.add_argument("--batch", type=int, default=100, help="hints per Hint call")
    parser.add_argument("--replicas", type=int, default=2, help="replicas (CPU workers, TP 1)")
    parser.add_argument("--adapters", type=int, default=16, help="registered tiny adapters")
    parser.add_argument("--max-hints-per-replica", type=int, default=1024,
                        help="the planner's active-hint bound per replica (the default ignores hints beyond 1024 "
                             "active ones cheaply; raise it to make every hint take the full accept path)")
    parser.add_argument("--hint-ttl-s", type=float, default=30.0,
                        help="the planner's hint TTL (a short one stands in for the queue reports that fulfil hints "
                             "in production, keeping hint tables short so that hints take the full accept path)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    lat, errors = result["latency_ms"], result["errors"] or 0
    print(f"\n| clients | batch | hints/s (controller) | p50 ms | p99 ms | hints per controller call | errors |\n"
          f"|---|---|---|---|---|---|---|\n| {args.clients} | {args.batch} | **{result['hints_per_s']:,.0f}** | "
          f"{lat['p50']:.2f} | {lat['p99']:.2f} | {result['hints_per_controller_call']:.0f} | {errors} |")


if __name__ == "__main__":
    main()
