"""The warm-up: a workload's first part, played before the measured window and reported apart (cold start).

``warm_workload(spec, names, warmup, replicas, slots)`` draws ``warmup + spec.requests`` requests from the same
arrival process and popularity (one stream: the warm-up's arrivals run straight into the measured window's),
the first ``warmup`` of them marked as the warm-up (``Workload.warmup``). A trace's warm-up is its first
``warmup`` replayed lines (the rest are measured). ``warmup`` -1 (auto, ``auto_warmup``): the shortest prefix
in which every replica, routed request i to replica i mod R, has seen as many distinct adapters as it has GPU
slots per rank (every policy's GPU slots are full, and the host tier holds those adapters), at most
``AUTO_CAP`` x the measured requests; a trace's auto warm-up is none.

``split_run(run, warmup)``: a policy's whole run as (measured window, cold start): requests by rid (the
warm-up's in the cold start), loads and steps by time (before the first measured request's arrival: the
cold start), and each rank's counters by the snapshot taken at that time (``PolicyRun.ranks_at_warmup``; the
real path takes it from the driver on a timer, the simulator in simulated time). The load counts and bytes
moved to the GPU are taken from the load log on each side, so they agree with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from bench.figures import PolicyRun
from bench.workloads import Workload, WorkloadSpec, make_workload
from lora_cache.errors import ConfigError
from workers.counters import STATS_COUNTERS

AUTO_CAP = 4  # the auto warm-up is at most this many times the measured requests
LOG_KEYS = ("loads", "bytes_host_to_gpu")  # counters taken from the load log on each side of the boundary


def auto_warmup(spec: WorkloadSpec, names: Sequence[str], replicas: int, slots: int) -> int:
    """Requests until every replica (round-robin) has seen ``slots`` distinct adapters; at most AUTO_CAP x N."""
    if spec.parsed_popularity().kind == "trace":
        return 0
    cap = AUTO_CAP * spec.requests
    drawn = make_workload(dataclasses.replace(spec, requests=spec.requests + cap), _names(spec, names, cap, slots))
    seen: list[set[str]] = [set() for _ in range(replicas)]
    want = min(slots, len(names))
    full = 0
    for i, r in enumerate(sorted(drawn.requests, key=lambda r: (r.arrival_s, r.rid))[:cap]):
        s = seen[i % replicas]
        if r.adapter is not None and len(s) < want:  # a request for the base model loads nothing
            s.add(r.adapter)
            full += len(s) == want
        if full == replicas:
            return i + 1
    return cap


def _names(spec: WorkloadSpec, names: Sequence[str], warmup: int, slots: int) -> list[str]:
    """The adapters of the warm workload: ``distinct`` needs one per request, warm-up included."""
    if spec.parsed_popularity().kind == "distinct" and not spec.num_adapters:
        return dataclasses.replace(spec, requests=spec.requests + warmup).adapter_names(slots)
    return list(names)


def warm_workload(spec: WorkloadSpec, names: Sequence[str], warmup: int, replicas: int,
                  slots: int) -> tuple[Workload, list[str]]:
    """The workload with its warm-up first (``warmup`` -1: ``auto_warmup``), and the adapters it uses."""
    if warmup < 0:
        warmup = auto_warmup(spec, names, replicas, slots)
    if spec.parsed_popularity().kind == "trace":
        lines = len(spec.trace_lines)
        if warmup >= lines:
            raise ConfigError(f"--warmup-requests {warmup}: the trace replays {lines} lines; a warm-up of its first "
                              "lines must leave some to measure: lower --warmup-requests")
        return dataclasses.replace(make_workload(spec, names), warmup=warmup), list(names)
    if warmup == 0:
        return make_workload(spec, names), list(names)
    all_names = _names(spec, names, warmup, slots)
    drawn = make_workload(dataclasses.replace(spec, requests=spec.requests + warmup), all_names)
    return dataclasses.replace(drawn, spec=spec, warmup=warmup), all_names


def boundary_s(run: PolicyRun, warmup: int) -> float:
    """When the measured window starts: the first measured request's arrival (inf: none measured)."""
    return min((r.arrival_s for r in run.records if r.rid >= warmup), default=math.inf)


def split_run(run: PolicyRun, warmup: int) -> tuple[PolicyRun, PolicyRun | None]:
    """(measured window, cold start) of ``run``; the cold start is None without a warm-up."""
    if warmup <= 0:
        return run, None
    t = boundary_s(run, warmup)
    mid = run.ranks_at_warmup
    before_ranks = mid if mid is not None else [{k: v for k, v in r.items() if k not in STATS_COUNTERS}
                                                for r in run.ranks]
    after_ranks = [_minus(r, m) for r, m in zip(run.ranks, mid)] if mid is not None else [dict(r) for r in run.ranks]
    cold_loads = [x for x in run.loads if x["t_s"] < t]
    warm_loads = [x for x in run.loads if x["t_s"] >= t]
    measured = dataclasses.replace(
        run, records=[r for r in run.records if r.rid >= warmup], loads=warm_loads,
        steps=[s for s in run.steps if s.get("t_s", math.inf) >= t], ranks=_logged(after_ranks, warm_loads),
        ranks_at_warmup=None)
    cold = dataclasses.replace(
        run, records=[r for r in run.records if r.rid < warmup], loads=cold_loads,
        steps=[s for s in run.steps if s.get("t_s", math.inf) < t], ranks=_logged(before_ranks, cold_loads),
        ranks_at_warmup=None)
    return measured, cold


def _minus(now: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {k: v - then.get(k, 0) if k in STATS_COUNTERS and isinstance(v, int | float) else v
            for k, v in now.items()}


def _logged(ranks: list[dict[str, Any]], loads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ranks`` with ``LOG_KEYS`` counted from ``loads`` (by replica and rank)."""
    out = []
    for r in ranks:
        mine = [x for x in loads if x.get("replica") == r.get("replica") and x.get("rank") == r.get("rank")]
        out.append({**r, "loads": len(mine), "bytes_host_to_gpu": sum(int(x["nbytes"]) for x in mine)})
    return out
