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
on a miss, under both routings), ``engine_ms_mean`` the rest; ``load_causes``: the replicas' loads started by a
prefetch (ours: the controller's commands; Serve's: its multiplexed load) or by an acquire that missed, and of the
prefetched loads evicted, those a batch used first and those it never used (``workers/counters.py``). The controller and
the gateway run in a ``lora-cache serve`` process of their own (``--gateway process``, as deployed) or in this
driver (``--gateway thread``); ``--policy``, ``--epsilon``, ``--min-bound``, ``--serve-args`` and ``--router``
(``RouterSettings`` as JSON) vary the lora-cache side.

GPUs: ``--device cuda`` runs the same app with one Serve replica per GPU (``num_gpus=1``), the reference engine in
bfloat16 with CUDA graphs, ``--model``-shaped adapters of ``--adapter-ranks`` (``bench.run``'s adapter directory,
``$TMPDIR/lora-cache-bench-adapters-MODEL`` by default: written once, reused), the same ``--slots`` per replica and
the same host tier (``--host-mib``, pinned) under both routings (``bench/gpu/serve.sh``):

    python -m bench.probes.ray_serve --device cuda --model llama-3.1-8b --adapter-ranks 16,64 --replicas 4 \
        --slots 4 --adapters 64 --rate 40 --requests 240 --input-len 512 --host-mib 8192

Its inputs (options checked before Ray starts, the adapter directory, the arrivals) are ``serve_inputs.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.probes.serve_inputs import DEVICES, adapters_for, check, dtype, engine_overrides, max_rank, workload
from lora_cache.runtime.ports import free_port


def _phase(routing: str, what: str) -> None:
    """A run's progress on stderr as it goes (a killed run's log says how far it got)."""
    print(f"[{time.strftime('%H:%M:%S')}] {routing}: {what}", file=sys.stderr, flush=True)


async def _play(handle: Any, arrivals: list[tuple[float, str]], body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each request sent at its arrival time (open loop), timed from the call to its result."""
    start = time.perf_counter()

    async def one(at: float, adapter: str) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter()
        out = await handle.options(multiplexed_model_id=adapter).remote(body)
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

    port = free_port()
    argv = [sys.executable, "-m", "lora_cache.app.cli", "serve", "--address", ray.get_runtime_context().gcs_address,
            "--replicas", "0", "--adapters", root, "--model", args.model, "--max-rank", str(max_rank(args)),
            "--policy", policy,
            "--epsilon", str(args.epsilon), "--min-bound", str(args.min_bound), "--grpc-host", "127.0.0.1",
            "--grpc-port", str(port), *args.serve_args.split()]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    service = _ServeProcess(proc, f"127.0.0.1:{port}")
    deadline = time.monotonic() + (120 if args.device == "cpu" else 240)
    while True:
        try:
            with LoraCacheClient(service.target, timeout_s=2) as client:
                if client.status().adapters >= args.adapters:  # a reused directory may hold more
                    return service
        except ClientError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            service.stop()
            raise RuntimeError(f"lora-cache serve did not come up at {service.target} (exit {proc.poll()})")
        time.sleep(0.2)


def run(routing: str, args: argparse.Namespace, root: str, names: list[str]) -> dict[str, Any]:
    from ray import serve

    from examples.ray_serve_lora import LOAD_CAUSES, app, engine_config
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
    from lora_cache.app.serve import ServeConfig, start
    from lora_cache.integrations.ray_serve import ReplicaCacheConfig
    from lora_cache.planner import PlannerConfig
    from lora_cache.routing.ranking import RouterConfig
    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    policy = args.policy if routing == "lora-cache" else "none"
    if args.fresh_state:  # the controller's snapshot (popularity, hints, queues) of the routing before this one
        from lora_cache.controller.snapshots import DurableConfig
        from lora_cache.runtime import ray_compat
        from lora_cache.vocab import NAMESPACE

        ray_compat.kv_del(DurableConfig().key, NAMESPACE)
    if args.gateway == "process":  # as deployed: the controller and the gateway in `lora-cache serve`'s process
        service: Any = _serve_process(args, root, policy)
        target = service.target
    else:  # in this driver's process, beside the load generator and the handle's router
        service = start(
            ServeConfig(adapters=root, replicas=0),
            CatalogConfig(model=args.model, max_rank=max_rank(args)),
            PlannerConfig(policy=policy),
            WorkerConfig(),
            RouterConfig(epsilon=args.epsilon, min_bound=args.min_bound),
        )
        gateway = start_gateway_thread(GatewayConfig(grpc_port=0), service.controller)
        target = gateway.target
    _phase(routing, f"lora-cache service up (policy {policy})")
    try:
        gpu = args.device == "cuda"
        host = HostTierConfig(host_bytes=args.host_mib << 20, pin=gpu)  # the same for both routings
        cache = ReplicaCacheConfig(num_slots=args.slots, device=args.device, dtype=dtype(args), worker={"host": host})
        setup_t = time.perf_counter()
        handle = serve.run(
            app(
                routing,
                target,
                args.replicas,
                cache,
                engine_config(**engine_overrides(args)),
                not args.no_ahead,
                **{"epsilon": args.epsilon, "min_bound": args.min_bound, **json.loads(args.router)},
            ),
            name=f"bench-{routing}",
            route_prefix=None,
        )
        body = {"input_len": args.input_len, "output_len": args.output_len}
        warm_s = 120 if args.device == "cpu" else 300  # a GPU replica's engine build: model, warm-up, CUDA graphs
        _phase(routing, f"app deployed ({time.perf_counter() - setup_t:.1f} s); warming {args.replicas} replicas")
        for name in names[: args.replicas]:  # every replica up and its engine warm before the clock
            handle.options(multiplexed_model_id=name).remote(body).result(timeout_s=warm_s)
        _phase(routing, f"replicas warm ({time.perf_counter() - setup_t:.1f} s); playing {args.requests} requests")
        probe = _route_probe(target, names, args.route_probe) if routing == "lora-cache" else {}
        arrivals = workload(names, args.requests, args.rate, args.alpha, args.seed)
        load_before = os.getloadavg()[0]
        start_t = time.perf_counter()
        results = asyncio.run(_play(handle, arrivals, body))
        ttft = np.array([r["ttft_ms"] for r in results])  # the handle's call to its result: routing included
        loads: dict[str, int] = {}
        causes: dict[str, dict[str, int]] = {}  # replica -> its counters by cause (the latest: the largest)
        for r in results:
            loads[r["replica"]] = max(loads.get(r["replica"], 0), r["loads"])
            mine = causes.setdefault(r["replica"], {})
            for k in LOAD_CAUSES:
                mine[k] = max(mine.get(k, 0), int(r.get(k, 0)))
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
            # loads started by a prefetch (ours: the plan's commands; Serve's: its multiplexed load) or by an acquire
            # that missed; prefetched loads evicted so far used by a batch first or not; stages (host tier only)
            "load_causes": {k: sum(c[k] for c in causes.values()) for k in LOAD_CAUSES},
            "wall_s": time.perf_counter() - start_t,
            "policy": policy,
            "device": args.device,
            "model": args.model,
            "setup_s": start_t - setup_t,  # serve.run and the warm-up calls: the replicas' engines built
            **probe,
        }
    finally:
        serve.delete(f"bench-{routing}")
        if args.gateway == "thread":
            gateway.stop()
        service.stop()


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument(
        "--device", default="cpu", help=f"where the replicas' engines run: {' or '.join(DEVICES)} (one GPU a replica)"
    )
    p.add_argument("--model", default="tiny", help="the model shape (llama-3.1-8b on GPUs)")
    p.add_argument("--adapter-ranks", default="8,16", help="ranks of the adapters made (used in turn)")
    p.add_argument(
        "--adapter-dir",
        default="",
        help="the adapters' directory (bench.run's rule: missing ones "
        "written, others reused); default: a fresh one for tiny, else $TMPDIR/lora-cache-bench-adapters-MODEL",
    )
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens of each request")
    p.add_argument(
        "--output-len", type=int, default=1, help="output tokens of each request (1: its latency is its TTFT)"
    )
    p.add_argument("--engine", default="{}", help="more EngineConfig fields (JSON), both routings")
    p.add_argument(
        "--fresh-state",
        action="store_true",
        help="each routing's controller starts without the popularity counts, hints and queues of the routing "
        "before it (the controller's snapshot in Ray's GCS, which a later `lora-cache serve` restores otherwise)",
    )
    p.add_argument(
        "--preflight",
        action="store_true",
        help="check the options, import what the runs need (Ray Serve, the app), print versions, exit",
    )
    p.add_argument(
        "--write-adapters",
        action="store_true",
        help="write the missing adapters (bench.run's rule), print where, exit: a step of its own before the timed "
        "runs (8B-shaped adapters take seconds of a core each)",
    )
    p.add_argument("--json", help="write the rows here too")
    return p


def preflight() -> None:
    """What a run imports (in this driver, the replicas and ``lora-cache serve``), before anything starts."""
    import importlib
    from importlib.metadata import version

    import torch

    # Ray Serve's HTTP side (fastapi, starlette, uvicorn, pydantic) comes with ray.serve; named here to report them
    for module in (
        "ray",
        "ray.serve",
        "fastapi",
        "starlette",
        "uvicorn",
        "pydantic",
        "grpc",
        "examples.ray_serve_lora",
        "lora_cache.app.cli",
        "lora_cache.integrations.ray_serve",
        "bench.run",
    ):
        importlib.import_module(module)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    got = ", ".join(
        f"{name} {version(name)}"
        for name in ("ray", "fastapi", "starlette", "uvicorn", "pydantic", "grpcio", "protobuf")
    )
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} ({gpus} GPUs), {got}: ready")


def main(argv: list[str] | None = None) -> int:
    from lora_cache.errors import ConfigError

    p = build_parser()
    args = p.parse_args(argv)
    try:
        check(args)
    except ConfigError as e:
        p.error(str(e))
    if args.preflight:
        preflight()
        return 0
    root, names = adapters_for(args)
    if args.write_adapters:
        return 0
    import ray

    cpus = 2 if args.device == "cpu" else None  # GPUs: Ray's own count of both
    ray.init(address="local", num_cpus=cpus, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
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
