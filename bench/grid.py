"""The routing grid (issue 31): is ``global`` routed by ``Route`` never worse than a simple router?

Every simulator fleet of a grid that varies replicas (2-64), adapters (50-5,000), load (0.3-0.9 of the
fleet's capacity), popularity (uniform, Zipf 0.6-1.5, bursty), ``max_adapters`` (1, 4, the slots) and TP
(1, 4) runs ``global`` behind three routers: ``lora-cache`` (``Route``), ``affinity`` and ``least-loaded``.
The property: Route's p99 TTFT is at most 1.05x, and its mean at most 1.0x, the better of the other two.

    python -m bench.sweep --grid routing --out grid              # every point (hours on one core)
    python -m bench.sweep --grid routing --points 'r2-*' --out grid
    python -m bench.sweep --grid routing-quick --out grid        # the CI subset (tests/test_routing_grid.py)

Load is against an estimate of what the fleet serves (``capacity``): a replica runs at most
``min(max_running, max_adapters)`` requests at once when every running request has its own adapter (the
worst case: more requests per adapter only add capacity), each for a prefill and ``output/2`` decode
steps of the calibration's costs. So a point at load 0.9 is below saturation for every popularity.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from bench.policies import BENCH_POLICIES
from bench.sim import SimConfig, simulate
from bench.sim.calibration import Calibration, load_calibration
from bench.workloads import WorkloadSpec, make_workload
from lora_cache.errors import ConfigError
from lora_cache.routing.ranking import RouterConfig

SLOTS = 8
ROUTERS = ("lora-cache", "affinity", "least-loaded")
P99_LIMIT, MEAN_LIMIT = 1.05, 1.0  # Route against the better of affinity and least-loaded
POPULARITIES = ("uniform", "zipf:0.6", "zipf:1", "zipf:1.5", "bursty")
INPUT_LEN, OUTPUT_LEN = 512, 128  # the workload's longest prompt and output (uniform in [1, len])


class Point(NamedTuple):
    """One fleet of the grid and its workload."""

    replicas: int
    adapters: int
    load: float  # of the fleet's capacity
    popularity: str  # a WorkloadSpec popularity ('bursty': three phases over the adapters)
    max_adapters: int
    tp: int
    requests: int = 0  # 0: 15 s of arrivals, 400-2000

    @property
    def name(self) -> str:
        pop = self.popularity.replace(":", "")
        return f"r{self.replicas}-a{self.adapters}-l{self.load:g}-{pop}-m{self.max_adapters}-tp{self.tp}"

    def spec(self, calibration: Calibration) -> WorkloadSpec:
        rate = self.load * capacity(calibration, self.max_adapters) * self.replicas
        pop = self.popularity
        if pop == "bursty":  # three phases: a fifth, two fifths, two fifths of the adapters
            a = self.adapters
            pop = f"bursty:{a // 5},{2 * a // 5},{a - a // 5 - 2 * a // 5}"
        requests = self.requests or int(min(2000, max(400, 15 * rate)))
        return WorkloadSpec(
            arrivals=f"poisson:{rate:.4g}",
            popularity=pop,
            requests=requests,
            num_adapters=self.adapters,
            random_input_len=INPUT_LEN,
            random_output_len=OUTPUT_LEN,
            workload_seed=0,
        )

    def fleet(self, router: str, join_over: float = RouterConfig.join_over) -> SimConfig:
        return SimConfig(
            join_over=join_over,
            replicas=self.replicas,
            tp=self.tp,
            slots=SLOTS,
            max_adapters=self.max_adapters,
            host_bytes=4 << 30,
            hint_lead_s=0.05,
            routing=router,
        )


def capacity(calibration: Calibration, max_adapters: int, max_running: int = SimConfig.max_running) -> float:
    """Requests/s one replica serves with one request per running adapter (module docstring)."""
    k = min(max_running, max_adapters)
    prefill = calibration.prefill_s(INPUT_LEN // 2, 1)
    decode = calibration.decode_s(k, k)
    return k / (prefill + (OUTPUT_LEN / 2) * decode)


def full_grid() -> list[Point]:
    """Every combination: replicas 2, 8, 64; adapters 50, 500, 5,000; load 0.3, 0.6, 0.9; five popularities;
    max_adapters 1, 4, slots; TP 1, 4."""
    return [
        Point(*p)
        for p in itertools.product((2, 8, 64), (50, 500, 5000), (0.3, 0.6, 0.9), POPULARITIES, (1, 4, SLOTS), (1, 4))
    ]


def quick_grid() -> list[Point]:
    """The CI subset: small fleets where the admission limit binds and where it does not (about 30 s)."""
    return [
        Point(2, 50, 0.3, "uniform", 1, 1, 300),  # light load, one lane: where the running batch was routed
        Point(2, 50, 0.6, "zipf:1", 1, 1, 300),
        Point(2, 50, 0.9, "uniform", 4, 1, 300),
        Point(2, 50, 0.9, "zipf:1.5", 4, 4, 300),
        Point(2, 50, 0.6, "bursty", SLOTS, 1, 300),
    ]


GRIDS = {"routing": full_grid, "routing-quick": quick_grid}


class Outcome(NamedTuple):
    point: Point
    figures: dict[str, dict[str, float]]  # router -> mean_ttft_ms, p99_ttft_ms, ready_on_arrival, sim_s

    @property
    def p99_ratio(self) -> float:
        best = min(self.figures[r]["p99_ttft_ms"] for r in ROUTERS[1:])
        return self.figures["lora-cache"]["p99_ttft_ms"] / best

    @property
    def mean_ratio(self) -> float:
        best = min(self.figures[r]["mean_ttft_ms"] for r in ROUTERS[1:])
        return self.figures["lora-cache"]["mean_ttft_ms"] / best

    @property
    def holds(self) -> bool:
        return self.p99_ratio <= P99_LIMIT and self.mean_ratio <= MEAN_LIMIT


def select(points: Iterable[Point], patterns: str) -> list[Point]:
    """Points whose name matches any of the comma-separated shell patterns ('' or '*': all)."""
    pats = [p for p in patterns.split(",") if p] or ["*"]
    return [p for p in points if any(fnmatch.fnmatchcase(p.name, pat) for pat in pats)]


def run_point(point: Point, calibration: Calibration, policy: str = "global",
              join_over: float = RouterConfig.join_over) -> Outcome:
    spec = point.spec(calibration)
    workload = make_workload(spec, spec.adapter_names(SLOTS))
    figures = {}
    for router in ROUTERS:
        t0 = time.perf_counter()
        s = simulate(point.fleet(router, join_over), BENCH_POLICIES[policy], workload, calibration).summary()
        figures[router] = {
            "mean_ttft_ms": s["mean_ttft_ms"],
            "p99_ttft_ms": s["p99_ttft_ms"],
            "ready_on_arrival": s["ready_on_arrival"],
            "sim_s": time.perf_counter() - t0,
        }
    return Outcome(point, figures)


def run_grid(points: Sequence[Point], calibration: str, out: Path | None, log: TextIO,
             join_over: float = RouterConfig.join_over) -> list[Outcome]:
    if not points:
        raise ConfigError(
            f"the grid selection is empty; check --points (shell patterns over names like {full_grid()[0].name})"
        )
    cal = load_calibration(calibration)
    outcomes = []
    for point in points:
        o = run_point(point, cal, join_over=join_over)
        outcomes.append(o)
        print(line(o), file=log, flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "routing.json").write_text(json.dumps([as_dict(x) for x in outcomes], indent=1))
            (out / "routing.md").write_text(table(outcomes) + "\n")
    return outcomes


def as_dict(o: Outcome) -> dict[str, Any]:
    return {
        "point": o.point.name,
        **o.point._asdict(),
        "figures": o.figures,
        "p99_ratio": o.p99_ratio,
        "mean_ratio": o.mean_ratio,
        "holds": o.holds,
    }


def line(o: Outcome) -> str:
    f = o.figures
    cells = " ".join(f"{r} {f[r]['mean_ttft_ms']:.0f}/{f[r]['p99_ttft_ms']:.0f}" for r in ROUTERS)
    return (
        f"{o.point.name}: {cells} ms; Route/best p99 {o.p99_ratio:.2f} mean {o.mean_ratio:.2f}"
        f"{'' if o.holds else '  FAILS'}"
    )


def table(outcomes: Sequence[Outcome]) -> str:
    head = ["point", *(f"{r} mean/p99 ms" for r in ROUTERS), "p99 / best", "mean / best", "holds"]
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for o in outcomes:
        f = o.figures
        rows.append(
            f"| {o.point.name} | "
            + " | ".join(f"{f[r]['mean_ttft_ms']:.1f} / {f[r]['p99_ttft_ms']:.1f}" for r in ROUTERS)
            + f" | {o.p99_ratio:.3f} | {o.mean_ratio:.3f} | {'yes' if o.holds else 'NO'} |"
        )
    if outcomes:
        worst_p99 = max(outcomes, key=lambda o: o.p99_ratio)
        worst_mean = max(outcomes, key=lambda o: o.mean_ratio)
        rows += [
            "",
            f"{sum(o.holds for o in outcomes)} of {len(outcomes)} points hold; worst p99 ratio "
            f"{worst_p99.p99_ratio:.3f} ({worst_p99.point.name}), worst mean ratio "
            f"{worst_mean.mean_ratio:.3f} ({worst_mean.point.name})",
        ]
    return "\n".join(rows)
