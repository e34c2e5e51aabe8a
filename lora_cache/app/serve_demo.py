"""``lora-cache serve --demo N``: a router's traffic against the running service, over gRPC only.

It plays what a router does: for each arriving request it picks an adapter (Zipf-like) and a
replica, sends ``Hint(adapter -> replica)`` the moment it routes, reports each replica's waiting
queue, and watches the readiness stream; it prints every replica-level READY with the time since
the hint, then the service's status (residency, hit rates, commands). Nothing here touches Ray: it
is the same path an external router takes.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import defaultdict

from lora_cache.api.client import ClientError, Hint, LoraCacheClient, Resync
from lora_cache.errors import LoraCacheError


def run_router_demo(target: str, token: str | None, adapters: list[str], requests: int = 24, seed: int = 0,
                    timeout_s: float = 60.0) -> dict[str, object]:
    """Route ``requests`` requests for ``adapters`` through the gateway at ``target``; wait until each
    hinted (replica, adapter) is ready."""
    rng = random.Random(seed)
    with LoraCacheClient(target, token=token) as client:
        status = client.status()
        replicas = [r.replica for r in status.replicas]
        adapters = sorted(adapters)
        if not replicas or not adapters:
            raise LoraCacheError(f"the service at {target} has {len(replicas)} replicas and {len(adapters)} adapters")
        print(f"router demo: {requests} requests over {len(adapters)} adapters and {len(replicas)} replicas, "
              f"through {target}", flush=True)
        ready_at: dict[tuple[str, str], float] = {}
        cond = threading.Condition()
        watcher = threading.Thread(target=_watch, args=(client, ready_at, cond), daemon=True)
        watcher.start()
        hinted: dict[tuple[str, str], float] = {}
        queues: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for i in range(requests):
            adapter = adapters[min(int(rng.paretovariate(1.1)) - 1, len(adapters) - 1)]
            replica = replicas[i % len(replicas)]
            now = time.time()
            client.hint([Hint(f"demo-{seed}-{i}", adapter, replica, 0.05)])
            hinted.setdefault((replica, adapter), now)
            queues[replica].append((adapter, now))
            if i % 4 == 3:  # engines report their queues now and then; serving drains them
                for r, queue in queues.items():
                    client.report_queue(r, queue[-4:])
            time.sleep(rng.expovariate(40.0))
        deadline = time.monotonic() + timeout_s
        with cond:
            cond.wait_for(lambda: hinted.keys() <= ready_at.keys() or time.monotonic() > deadline,
                          timeout=timeout_s)
        missing = sorted(hinted.keys() - ready_at.keys())
        waits = [max(0.0, ready_at[k] - t) * 1e3 for k, t in hinted.items() if k in ready_at]
        for replica, adapter in sorted(hinted):
            if (replica, adapter) in ready_at:
                wait = max(0.0, ready_at[replica, adapter] - hinted[replica, adapter]) * 1e3
                print(f"  READY {adapter:14} on {replica}: {wait:7.1f} ms after the first hint", flush=True)
        for r in replicas:
            client.report_queue(r, [])  # the demo's requests are served
        final = client.status()
        counters = final.counters
        print(f"status: {final.ready_residencies} replica-ready adapter versions, {final.commands_sent} commands "
              f"sent, hints {final.hints_accepted}/{final.hints_received} taken, GPU hit rate "
              f"{counters.gpu_hit_rate:.2f}, host hit rate {counters.host_hit_rate:.2f}", flush=True)
        if missing:
            raise LoraCacheError(f"not ready within {timeout_s:.0f} s: {missing}")
        median, worst = statistics.median(waits), max(waits)
        print(f"every hinted (replica, adapter) became ready: median {median:.1f} ms, max {worst:.1f} ms after "
              "its first hint", flush=True)
        return {"requests": requests, "pairs": len(hinted), "median_hint_to_ready_ms": median,
                "max_hint_to_ready_ms": worst, "ready_residencies": final.ready_residencies}


def _watch(client: LoraCacheClient, ready_at: dict[tuple[str, str], float], cond: threading.Condition) -> None:
    try:
        # From the controller's first event (after_seq=0), not from now: the planner may place adapters
        # before the router starts (homes, when the fleet holds the catalog), and a pair READY before the
        # watch began would send no event, so the demo would wait for it in vain.
        for event in client.watch(after_seq=0):
            if isinstance(event, Resync):  # fell behind: the ready set now stands for the events missed
                with cond:
                    for replica, adapter, _version in event.ready:
                        ready_at.setdefault((replica, adapter), time.time())
                    cond.notify_all()
            elif event.ready:
                with cond:
                    ready_at.setdefault((event.replica, event.adapter), time.time())
                    cond.notify_all()
    except ClientError as e:  # the demo closed its channel: the stream ends with it
        if e.code != "CANCELLED":
            raise
