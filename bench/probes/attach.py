"""What the engine seam's relay adds to a controller call: one call, to a worker actor and to an attached rank.

    python -m bench.probes.attach --calls 300

Starts a local Ray, the service with one worker actor (replica-0), and attaches this process as the
rank of a second replica (``probe``) through ``workers/attach/attachment.py``. Then times the same calls through
both handles, one at a time: ``describe`` (the full report a resync reads) and ``apply([])`` (an empty
command batch, what every plan sends). The worker actor answers itself; the endpoint relays to this
process's serve thread and back (``take`` / ``answer``). A third rank (``probe-gw``) attaches through the
gRPC gateway (``AttachConfig(gateway=...)``, as a process outside the cluster would; here the same
process, over loopback): its endpoint is hosted by the gateway, which relays over the AttachRank stream.
Then times an engine step's own seam calls in
this process (``acquire`` + ``release`` of a 32-request batch, ``acquire_ready``, ``report_queue``).
Prints JSON: median and p90 ms per call.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.app.serve import ServeConfig, start
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import NAMESPACE, WorkerId, worker_name
from workers.attach.attachment import AttachConfig, attach
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig


def _times(call: Callable[[], Any], calls: int, warm: int = 20) -> dict[str, float]:
    for _ in range(warm):
        call()
    ms = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return {"median_ms": round(statistics.median(ms), 3), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3)}


def _call(method: Any, *args: Any) -> Any:
    return ray.get(method.remote(*args))


def _engine_calls(rank: Any, calls: int, batch: int = 32) -> dict[str, Any]:
    """An engine step's seam calls in the attached process itself, both adapters resident (hits): a batch
    of ``batch`` requests over them."""
    names = sorted(rank.catalog.names())[:2]
    for name in names:
        rank.cache.prefetch(name).result(timeout=60)
    requests = [names[i % len(names)] for i in range(batch)]

    def step() -> None:
        rank.release(rank.acquire(requests))

    def pin() -> None:
        pinned = rank.acquire_ready(names)
        if pinned is not None:
            rank.release(pinned)

    return {f"engine.acquire+release({batch} requests, 2 adapters)": _times(step, calls),
            "engine.acquire_ready+release(2 adapters)": _times(pin, calls),
            "engine.report_queue(32 entries)": _times(lambda: rank.report_queue([(n, 0.0) for n in requests]),
                                                      calls)}


def probe(calls: int) -> dict[str, Any]:
    worker = WorkerConfig(num_slots=2, device="cpu", dtype="float32",
                          host=HostTierConfig(host_bytes=1 << 22, pin=False))
    with tempfile.TemporaryDirectory() as root:
        make_adapters(root, SynthConfig(model="tiny", count=2, rank="8"))
        ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
        try:
            service = start(ServeConfig(adapters=root, replicas=1), CatalogConfig(model="tiny", max_rank=8),
                            PlannerConfig(policy="none"), worker)
            stack = contextlib.ExitStack()  # the gateway, once started
            try:
                gcs = ray.get_runtime_context().gcs_address
                gateway = start_gateway_thread(GatewayConfig(grpc_port=0), service.controller)
                stack.callback(gateway.stop)
                with attach(AttachConfig(replica="probe", address=gcs), worker) as rank, \
                        attach(AttachConfig(replica="probe-gw", gateway=gateway.target), worker):
                    handles = {"worker_actor": service.workers[WorkerId("replica-0", 0)],
                               "attached": ray.get_actor(worker_name(WorkerId("probe", 0)), namespace=NAMESPACE),
                               "gateway": ray.get_actor(worker_name(WorkerId("probe-gw", 0)), namespace=NAMESPACE)}
                    out: dict[str, Any] = {"calls": calls}
                    for kind, handle in handles.items():
                        out[f"{kind}.describe"] = _times(functools.partial(_call, handle.describe), calls)
                        out[f"{kind}.apply"] = _times(functools.partial(_call, handle.apply, []), calls)
                    out.update(_engine_calls(rank, calls))
                    return out
            finally:
                stack.close()
                service.stop()
        finally:
            ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.attach", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per handle and kind")
    print(json.dumps(probe(parser.parse_args(argv).calls), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
