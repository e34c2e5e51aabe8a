"""``--engine sim``: the benchmark job's policies on the simulator, one ``PolicyRun`` each.

``sim_config`` is the simulated fleet of a ``BenchConfig``; ``run_policies`` simulates each policy in turn
over the same workload and calibration, as ``bench.run`` does for ``--engine sim`` and ``bench.sim.check``
does again with costs fitted from a real run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from bench.config import BenchConfig
from bench.figures import PolicyRun
from bench.policies import BenchPolicy
from bench.report import progress
from bench.sim.calibration import Calibration, load_calibration
from bench.sim.fleet import SimConfig, simulate
from bench.workloads import Workload
from lora_cache.planner import PlannerConfig


def sim_config(bench: BenchConfig, workload: Workload | None = None,
               warm_min_miss_s: float = PlannerConfig.warm_min_miss_s) -> SimConfig:
    """The fleet ``bench`` asks for, simulated: its replicas, slots, batching bounds, router, lead and store; with
    ``workload``, its warm-up's end (the first measured arrival) for the counters' snapshot. ``warm_min_miss_s``:
    the controller's warming gate (a real run's own, ``bench.sim.check``; else the planner's default, as a real
    service starts with)."""
    warm = workload.requests[workload.warmup].arrival_s if workload is not None and workload.warmup and \
        not workload.inflight and workload.warmup < len(workload.requests) else -1.0
    return SimConfig(model=bench.model, replicas=bench.replicas, tp=bench.tp, slots=bench.slots,
                     max_rank=bench.max_rank, page_rank=bench.page_rank, pool_pages=bench.pool_pages,
                     adapter_ranks=bench.adapter_ranks, max_running=bench.max_running,
                     max_adapters=bench.max_adapters, max_prefill_tokens=bench.max_prefill_tokens,
                     hint_lead_s=bench.hint_lead_s, host_bytes=bench.host_bytes, routing=bench.router,
                     join_over=bench.join_over,
                     host_eviction=bench.host_eviction, host_recent_s=bench.host_recent_s, host_tiers=bench.host_tiers,
                     store=bench.store, disk_bytes=bench.disk_bytes, fetch_order=bench.fetch_order, warmup_s=warm,
                     warm_min_miss_s=warm_min_miss_s)


def run_policies(bench: BenchConfig, policies: Sequence[BenchPolicy], workload: Workload, config: dict[str, Any],
                 calibration: Calibration | None = None,
                 warm_min_miss_s: float = PlannerConfig.warm_min_miss_s) -> list[PolicyRun]:
    """Each policy simulated over ``workload`` with ``calibration`` (default: ``bench.calibration``'s file) and
    the warming gate ``warm_min_miss_s`` (``sim_config``); the simulator's configuration and the calibration go
    into ``config`` (results.json's)."""
    calib = calibration if calibration is not None else load_calibration(bench.calibration)
    sim = sim_config(bench, workload, warm_min_miss_s)
    config["sim"] = dataclasses.asdict(sim)
    config["calibration"] = dataclasses.asdict(calib)
    runs = []
    for policy in policies:
        with progress(policy.name) as tick:
            t0 = time.perf_counter()
            result = simulate(sim, policy, workload, calib)
            tick(1.0)
        runs.append(result.as_policy_run(policy.name, time.perf_counter() - t0))
    return runs
