"""Every figure of one policy's run, from what either engine returns (the real one or the simulator).

Request latencies use SGLang bench_serving's names (``{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms``,
request and token throughput; ``workers.engine.timings.summarize``). Cache figures:

- ``gpu_hit_rate``: requests that never stalled on an adapter load (their ``load_wait`` is 0);
- ``host_hit_rate``: loads whose shard was already staged in the pinned host tier;
- ``prefetch_accuracy``: prefetched loads used by a batch before their eviction or the run's end, over
  all prefetched loads evicted or resident at the end (one resident and never used counts as wasted;
  before 2026-11-25 only evicted loads were counted; None when nothing was prefetched);
- ``{mean,p99}_load_wait_ms``: adapter stall per request; ``{median,p99}_time_to_ready_ms``: load
  request to READY per load (one per rank);
- ``bytes_disk_to_host`` / ``bytes_host_to_gpu``: bytes moved per tier, all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.policies import BENCH_POLICIES
from workers.engine.timings import RequestRecord, summarize


@dataclass
class PolicyRun:
    """One policy's run on either engine; times in seconds since its clock started."""

    policy: str
    engine: str  # real or sim
    records: list[RequestRecord]
    ranks: list[dict[str, Any]]  # per worker: replica, rank and its cache counters (WorkerCache.stats() keys)
    loads: list[dict[str, Any]]  # per load: t_s (READY), replica, rank, nbytes, ready_ms, h2d_ms, host_hit
    steps: list[dict[str, Any]] = field(default_factory=list)  # per step (rank 0): kind, items, tokens, ms, ...
    wall_s: float = 0.0  # how long the run took on the host running it
    routing: dict[str, Any] = field(default_factory=dict)  # real runs: the router, its choices and calls
    startup: dict[str, float] = field(default_factory=dict)  # real runs: seconds of each start-up phase (bench.real)
    # each rank's counters at the end of the warm-up (bench.warmup), as ``ranks`` (increase since the start)
    ranks_at_warmup: list[dict[str, Any]] | None = None
    # real runs: the controller's warming at the end (ControllerCore.status()["warming"]: on, what its gate read)
    warming: dict[str, Any] = field(default_factory=dict)


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


def _sum(ranks: list[dict[str, Any]], key: str) -> int:
    return int(sum(int(r.get(key, 0) or 0) for r in ranks))


def figures(run: PolicyRun) -> dict[str, Any]:
    """Every figure of ``run`` as a flat dict (JSON-ready)."""
    out: dict[str, Any] = dict(summarize(run.records))
    done = [r for r in run.records if r.ok]
    out["gpu_hit_rate"] = sum(r.load_wait_s == 0 for r in done) / len(done) if done else 0.0
    host_hits, host_misses = _sum(run.ranks, "host_hits"), _sum(run.ranks, "host_misses")
    out["host_hit_rate"] = host_hits / (host_hits + host_misses) if host_hits + host_misses else 0.0
    used, unused = _sum(run.ranks, "prefetch_used"), _sum(run.ranks, "prefetch_unused")
    used += _sum(run.ranks, "prefetch_resident_used")  # still in their slots at the end: unused ones count
    unused += _sum(run.ranks, "prefetch_resident_unused")  # as wasted (conservative)
    oracle = run.policy in BENCH_POLICIES and BENCH_POLICIES[run.policy].oracle  # preloaded before the clock:
    out["prefetch_accuracy"] = used / (used + unused) if used + unused and not oracle else None  # no prefetch
    for key in ("loads", "prefetches", "demand_loads", "evictions", "load_failures", "bytes_host_to_gpu",
                "bytes_disk_to_host"):
        out[key] = _sum(run.ranks, key)
    ready = [float(x["ready_ms"]) for x in run.loads]
    out["median_time_to_ready_ms"] = _percentile(ready, 50)
    out["p99_time_to_ready_ms"] = _percentile(ready, 99)
    out.update(tier_costs(run))
    out["gc_longest_ms"] = max((float(r.get("gc_longest_ms", 0.0)) for r in run.ranks), default=0.0)  # real runs
    out["wall_s"] = run.wall_s
    out["warming_on"] = run.warming.get("on")  # real runs: the controller warmed the host tiers at the end
    out["start_to_first_request_s"] = run.startup.get("to_first_request_s")  # real runs: service start -> clock
    return out


TIER_KEYS = ("gpu_hits", "host_hit_loads", "host_hit_ready_ms_p50", "host_hit_ready_ms_p99", "disk_loads",
             "disk_ready_ms_p50", "disk_ready_ms_p99", "disk_read_ms_p50")


def tier_costs(run: PolicyRun) -> dict[str, Any]:
    """What a request's adapter costs by the tier it came from: a GPU hit waits nothing (``gpu_hits``: the
    requests that found it ready); a host-tier hit is a copy to the GPU (its loads' prefetch -> READY, p50/p99);
    a host-tier miss reads the file (disk or page cache) first (READY, and the read alone: ``disk_read_ms``)."""
    done = [r for r in run.records if r.ok]
    host = [float(x["ready_ms"]) for x in run.loads if x.get("host_hit")]
    disk = [x for x in run.loads if not x.get("host_hit", True)]
    disk_ready = [float(x["ready_ms"]) for x in disk]
    reads = [float(x["disk_ms"]) for x in disk if x.get("disk_ms") is not None]
    return {"gpu_hits": sum(r.load_wait_s == 0 for r in done), "host_hit_loads": len(host),
            "host_hit_ready_ms_p50": _percentile(host, 50) if host else None,
            "host_hit_ready_ms_p99": _percentile(host, 99) if host else None, "disk_loads": len(disk),
            "disk_ready_ms_p50": _percentile(disk_ready, 50) if disk else None,
            "disk_ready_ms_p99": _percentile(disk_ready, 99) if disk else None,
            "disk_read_ms_p50": _percentile(reads, 50) if reads else None}


def timeline(run: PolicyRun, bins: int = 40) -> dict[str, list[float]]:
    """Per time bin: GPU hit rate of the requests arriving in it and bytes moved host -> GPU in it."""
    end = max([r.token_s[-1] for r in run.records if r.token_s] + [x["t_s"] for x in run.loads] + [1e-9])
    width = end / bins
    hits, counts, moved = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    for r in run.records:
        if r.ok:
            b = min(bins - 1, int(r.arrival_s / width))
            counts[b] += 1
            hits[b] += r.load_wait_s == 0
    for x in run.loads:
        moved[min(bins - 1, max(0, int(x["t_s"] / width)))] += x["nbytes"]
    rate = np.divide(hits, counts, out=np.full(bins, np.nan), where=counts > 0)
    return {"t_s": [(i + 0.5) * width for i in range(bins)], "gpu_hit_rate": rate.tolist(),
            "bytes_host_to_gpu": moved.tolist()}


GOALS = (  # (label, policy, figure, reference policy, at most this ratio, workloads it applies to or None: all)
    ("global mean TTFT <= 0.40x ondemand", "global", "mean_ttft_ms", "ondemand", 0.40, None),
    ("global p99 TTFT <= 0.20x ondemand", "global", "p99_ttft_ms", "ondemand", 0.20, None),
    ("global p99 TTFT <= 1.15x oracle", "global", "p99_ttft_ms", "oracle", 1.15, None),
    ("global p99 TTFT <= 0.8x queue", "global", "p99_ttft_ms", "queue", 0.80, ("bursty", "zipf")),
    ("global p99 TTFT <= 0.75x queue", "global", "p99_ttft_ms", "queue", 0.75, None),  # issue 20, lead 0.05
    ("global p99 TTFT <= 0.75x overlap", "global", "p99_ttft_ms", "overlap", 0.75, None),
)

GAPS = (  # (name, the gap's upper end): the share of the gap from that baseline to the oracle a policy closes
    ("adapter_gap_closed", "ondemand"), ("queue_gap_closed", "queue"))
GAP_KEYS = tuple(f"{name}_{stat}" for name, _ in GAPS for stat in ("mean", "p99"))  # the figures ``gaps`` gives


def gaps(by_policy: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy, for mean and p99 TTFT: ``(baseline - policy) / (baseline - oracle)`` for each of ``GAPS``
    whose baseline and the oracle ran (1: as good as an infinite cache; 0: no better than the baseline;
    negative: worse). A gap the oracle does not open (baseline <= oracle) has no share and is left out."""
    out: dict[str, dict[str, float]] = {}
    if "oracle" not in by_policy:
        return out
    for policy, figs in by_policy.items():
        if policy == "oracle":
            continue
        row = {}
        for name, base in GAPS:
            if base not in by_policy or base == policy:
                continue
            for key, short in (("mean_ttft_ms", "mean"), ("p99_ttft_ms", "p99")):
                top, bottom = by_policy[base][key], by_policy["oracle"][key]
                if top > bottom:
                    row[f"{name}_{short}"] = (top - figs[key]) / (top - bottom)
        if row:
            out[policy] = row
    return out


def goals(by_policy: dict[str, dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """The issue's goals that this run's policies let us check: ratio, limit and whether it was met."""
    out = []
    for label, policy, key, ref, limit, kinds in GOALS:
        if policy not in by_policy or ref not in by_policy:
            continue
        if kinds is not None and not any(workload.startswith(k) for k in kinds):
            continue
        denominator = by_policy[ref][key]
        ratio = by_policy[policy][key] / denominator if denominator else float("inf")
        out.append({"goal": label, "ratio": ratio, "limit": limit, "met": ratio <= limit})
    return out
