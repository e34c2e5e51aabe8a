"""The simulator sweep of issue 20: fleets of 8-64 replicas, TP 1 and 4, Zipf and bursty popularity over
200-5,000 adapters; every policy with every router; ``global`` at router leads 0, 0.05 and 0.5 s.

    python -m bench.sweep --out sweep                       # every scenario below (about an hour, one core)
    python -m bench.sweep --scenarios fleet32-zipf0.9 --routers affinity,lora-cache --out sweep

The baselines take no hints, so they run once per router (their figures hold at every lead); the oracle
(every adapter resident, an infinite cache) runs once per scenario with the least-loaded router. Each run
is ``bench.run``'s simulator path, written under ``OUT/<scenario>/<router>/<policy>[-lead]``; the tables
(``OUT/sweep.md``, and printed) give per scenario, router, policy and lead the mean and p99 TTFT, GPU and
host hit rates, prefetch accuracy, GB to the GPU and from disk, and the p99 against ``queue`` with the
``affinity`` router (the strongest baseline pair: S-LoRA's queue prefetch behind llm-d's lora-affinity
scorer) and against the oracle. The summary gives, per scenario and ``global`` row, the share of the gap
between the best baseline (any baseline behind any router, per figure) and the oracle that ``global``
closes, at mean and p99 TTFT (1: at the oracle; 0: no better than the best baseline).

``--grid routing`` runs the routing grid instead (``bench/grid.py``: ``global`` behind Route against the
affinity and least-loaded routers over replicas, adapters, load, popularity, ``max_adapters`` and TP).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.config import BenchConfig
from bench.grid import GRIDS, Knobs, run_grid, select
from bench.grid import table as grid_table
from bench.report import cell
from bench.run import run
from bench.sim import ROUTERS
from bench.workloads import WorkloadSpec
from lora_cache.errors import ConfigError, LoraCacheError
from lora_cache.routing.ranking import RouterConfig

# 4 GiB host tier per rank, every policy the same (the sweep's figures were taken with it). At 2 GiB,
# 8 rank-64 misses at once no longer fail: the last waits for host room (host_waits; docs/known-issues.md)
FLEET = {"slots": 8, "max_adapters": 8, "host_bytes": 4 << 30}
# name -> (BenchConfig fields, WorkloadSpec fields); about 4 requests/s per TP-1 replica (2 per TP-4 one)
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "fleet8-zipf0.9": ({"replicas": 8, **FLEET},
                       {"popularity": "zipf:0.9", "num_adapters": 200, "arrivals": "poisson:32", "requests": 2000}),
    "fleet8-bursty": ({"replicas": 8, **FLEET},
                      {"popularity": "bursty:40,80,80", "num_adapters": 200, "arrivals": "poisson:32",
                       "requests": 2000}),
    "fleet32-zipf0.9": ({"replicas": 32, **FLEET},
                        {"popularity": "zipf:0.9", "num_adapters": 200, "arrivals": "poisson:64", "requests": 3000}),
    "fleet32-zipf1.5": ({"replicas": 32, **FLEET},
                        {"popularity": "zipf:1.5", "num_adapters": 1000, "arrivals": "poisson:64", "requests": 3000}),
    # the hot adapter changes 3 times (a fresh Zipf ranking every 1,500 requests, about 23 s): copies of the
    # new hot adapter must land on a fleet whose slots are all taken
    "fleet32-zipf1.5-shift": ({"replicas": 32, **FLEET},
                              {"popularity": "zipf:1.5,4", "num_adapters": 1000, "arrivals": "poisson:64",
                               "requests": 6000}),
    "fleet64-zipf0.9": ({"replicas": 64, **FLEET},
                        {"popularity": "zipf:0.9", "num_adapters": 5000, "arrivals": "poisson:128",
                         "requests": 6000}),
    "fleet8-tp4-zipf0.9": ({"replicas": 8, "tp": 4, **FLEET},
                           {"popularity": "zipf:0.9", "num_adapters": 500, "arrivals": "poisson:16",
                            "requests": 1500}),
}
BASELINES = ("ondemand", "overlap", "queue")
LEADS = (0.0, 0.05, 0.5)
COLUMNS = (("mean_ttft_ms", 1), ("p99_ttft_ms", 1), ("gpu_hit_rate", 1), ("host_hit_rate", 1),
           ("prefetch_accuracy", 1), ("bytes_host_to_gpu", 1e-9), ("bytes_disk_to_host", 1e-9))
HEAD = ("router", "policy", "lead s", "mean TTFT ms", "p99 TTFT ms", "GPU hit", "host hit", "prefetch acc.",
        "GB to GPU", "GB disk", "p99 / queue+affinity", "p99 / oracle")


@dataclasses.dataclass(frozen=True)
class Row:
    router: str
    policy: str
    lead: float | None  # None: takes no hints
    figures: dict[str, Any]


def run_one(scenario: str, router: str, policy: str, lead: float, out: Path, seed: int,
            calibration: str) -> dict[str, Any]:
    fleet, work = SCENARIOS[scenario]
    bench = BenchConfig(engine="sim", policies=policy, out=str(out), plots=False, router=router,
                        hint_lead_s=lead, calibration=calibration, **fleet)
    spec = WorkloadSpec(workload_seed=seed, **work)
    doc = run(bench, spec)
    return dict(doc["figures"][policy])


def sweep(scenario: str, routers: Sequence[str], out: Path, seed: int, calibration: str,
          log: Any = sys.stderr) -> list[Row]:
    rows = []
    jobs: list[tuple[str, str, float | None]] = [("least-loaded", "oracle", None)]
    for router in routers:
        jobs += [(router, p, None) for p in BASELINES] + [(router, "global", lead) for lead in LEADS]
    for router, policy, lead in jobs:
        t0 = time.perf_counter()
        where = out / scenario / router / (policy if lead is None else f"{policy}-{lead:g}")
        figs = run_one(scenario, router, policy, 0.0 if lead is None else lead, where, seed, calibration)
        rows.append(Row(router, policy, lead, figs))
        print(f"{scenario} {router} {policy} {'' if lead is None else lead}: p99 {figs['p99_ttft_ms']:.1f} ms "
              f"({time.perf_counter() - t0:.0f} s)", file=log, flush=True)
    return rows


def table(scenario: str, rows: Sequence[Row]) -> str:
    ref = next((r.figures["p99_ttft_ms"] for r in rows if (r.router, r.policy) == ("affinity", "queue")), None)
    oracle = next((r.figures["p99_ttft_ms"] for r in rows if r.policy == "oracle"), None)
    lines = [f"### {scenario}", "", "| " + " | ".join(HEAD) + " |", "| --- | --- |" + " ---: |" * (len(HEAD) - 2)]
    for r in rows:
        p99 = r.figures["p99_ttft_ms"]
        cells = [cell(r.figures.get(k), s) for k, s in COLUMNS]
        ratios = [f"{p99 / ref:.2f}" if ref else "-", f"{p99 / oracle:.2f}" if oracle else "-"]
        lead = "-" if r.lead is None else f"{r.lead:g}"
        lines.append(f"| {r.router} | {r.policy} | {lead} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def gap_closed(baseline: float, oracle: float, value: float) -> float | None:
    """The share of the gap between the best baseline and the oracle that ``value`` closes (1: at the oracle,
    0: no better than the baseline, < 0: worse); None where the baseline is already at the oracle."""
    gap = baseline - oracle
    return (baseline - value) / gap if gap > 0 else None


def gaps(rows: Sequence[Row]) -> list[tuple[Row, dict[str, float | None]]]:
    """Per ``global`` row, the share of the gap it closes at mean and p99 TTFT (``gap_closed``): against the
    best baseline of the scenario (any baseline policy behind any router, per figure) and the oracle."""
    oracle = next((r for r in rows if r.policy == "oracle"), None)
    base = [r for r in rows if r.policy in BASELINES]
    if oracle is None or not base:
        return []
    out = []
    for r in rows:
        if r.policy != "global":
            continue
        shares = {k: gap_closed(min(b.figures[k] for b in base), oracle.figures[k], r.figures[k])
                  for k in ("mean_ttft_ms", "p99_ttft_ms")}
        out.append((r, shares))
    return out


def gap_table(results: Sequence[tuple[str, Sequence[Row]]]) -> str:
    """Per scenario (fleet), each ``global`` row's share of the best-baseline-to-oracle gap, at mean and p99."""
    lines = ["### share of the gap between the best baseline and the oracle that global closes", "",
             "| scenario | router | lead s | best baseline mean / p99 ms | oracle mean / p99 ms | global mean / p99 ms "
             "| gap closed, mean | gap closed, p99 |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for scenario, rows in results:
        oracle = next((r for r in rows if r.policy == "oracle"), None)
        base = [r for r in rows if r.policy in BASELINES]
        for r, shares in gaps(rows):
            assert oracle is not None
            best = [min(b.figures[k] for b in base) for k in ("mean_ttft_ms", "p99_ttft_ms")]
            share = ["-" if v is None else f"{v:.2f}" for v in shares.values()]
            o, g = oracle.figures, r.figures
            lines.append(f"| {scenario} | {r.router} | {r.lead:g} | {best[0]:.1f} / {best[1]:.1f} | "
                         f"{o['mean_ttft_ms']:.1f} / {o['p99_ttft_ms']:.1f} | "
                         f"{g['mean_ttft_ms']:.1f} / {g['p99_ttft_ms']:.1f} | {share[0]} | {share[1]} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma list of {', '.join(ROUTERS)}")
    p.add_argument("--out", default="sweep", help="directory for every run's results and sweep.md")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--calibration", default="h200-llama8b", help="simulator costs (bench/calibration)")
    p.add_argument("--grid", default="", help=f"run a grid instead of the scenarios: {', '.join(GRIDS)} "
                   "(bench/grid.py: global behind Route against affinity and least-loaded)")
    p.add_argument("--points", default="", help="--grid: comma list of shell patterns over point names "
                   "(e.g. 'r2-*-m1-*'; default: every point)")
    p.add_argument("--join-over", type=float, default=RouterConfig.join_over, help="--grid: the lora-cache router's "
                   "RouterConfig.join_over (1: off)")
    p.add_argument("--host-eviction", default=Knobs.host_eviction, help="--grid: every fleet's host tier order "
                   "(SimConfig.host_eviction: lru, popular, segmented)")
    p.add_argument("--seeds", default="", help="--grid: comma list of workload seeds; each point runs every seed and "
                   "is judged on the medians of Route's ratios (default: --seed alone)")
    p.add_argument("--jobs", type=int, default=1, help="--grid: points run at once, in processes")
    ns = p.parse_args(argv)
    if ns.grid:
        return grid_main(ns.grid, ns.points, ns.calibration, Path(ns.out), ns.join_over,
                         ns.seeds or str(ns.seed), ns.jobs, ns.host_eviction)
    scenarios = [s for s in ns.scenarios.split(",") if s]
    routers = [r for r in ns.routers.split(",") if r]
    try:
        bad = [s for s in scenarios if s not in SCENARIOS] + [r for r in routers if r not in ROUTERS]
        if bad or not scenarios or not routers:
            raise ConfigError(f"unknown or missing scenarios/routers {bad}; scenarios: {', '.join(SCENARIOS)}; "
                              f"routers: {', '.join(ROUTERS)}")
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        text = []
        done: list[tuple[str, list[Row]]] = []
        for scenario in scenarios:
            rows = sweep(scenario, routers, out, ns.seed, ns.calibration)
            (out / scenario / "rows.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
            done.append((scenario, rows))
            text.append(table(scenario, rows))
            (out / "sweep.md").write_text("\n\n".join([*text, gap_table(done)]) + "\n")
            print(text[-1] + "\n", flush=True)
        print(gap_table(done), flush=True)
    except LoraCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def grid_main(name: str, points: str, calibration: str, out: Path, join_over: float = RouterConfig.join_over,
              seeds: str = "0", jobs: int = 1, host_eviction: str = Knobs.host_eviction) -> int:
    try:
        if name not in GRIDS:
            raise ConfigError(f"grid {name!r} is not one of {', '.join(GRIDS)}")
        knobs = Knobs(join_over, host_eviction)  # a clear error before any point runs
        try:
            picked = tuple(int(s) for s in seeds.split(",") if s.strip())
        except ValueError:
            raise ConfigError(f"--seeds is {seeds!r}; give a comma list of workload seeds, e.g. 0,1,2,3") from None
        outcomes = run_grid(select(GRIDS[name](), points), calibration, out, sys.stderr, knobs, picked, jobs)
    except LoraCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(grid_table(outcomes), flush=True)
    return 0 if all(o.holds for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
