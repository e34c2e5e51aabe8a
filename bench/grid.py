"""The routing grid (issue 31): is ``global`` routed by ``Route`` never worse than a simple router?

Every simulator fleet of a grid that varies replicas (2-64), adapters (50-5,000), load (0.3-0.9 of the
fleet's capacity), popularity (uniform, Zipf 0.6-1.5, bursty), ``max_adapters`` (1, 4, the slots) and TP
(1, 4) runs ``global`` behind three routers: ``lora-cache`` (``Route``), ``affinity`` and ``least-loaded``.
The property: Route's p99 TTFT is at most 1.05x, and its mean at most 1.0x, the better of the other two.

    python -m bench.sweep --grid routing --out grid              # every point (hours on one core)
    python -m bench.sweep --grid routing --points 'r2-*' --out grid
    python -m bench.sweep --grid routing-quick --out grid        # the CI subset (tests/test_routing_grid.py)
    python -m bench.sweep --grid routing --seeds 0,1,2,3 --jobs 2 --out grid   # judged on medians of 4 seeds
    python -m bench.sweep --grid routing --host-eviction popular --out grid     # every fleet's host tier order

A p99 of 400-2,000 requests swings between workload seeds as much as the bound itself (issue 42: five of six points
that missed at seed 0 held at another), so with ``--seeds`` each point runs every seed (the same fleet, another
draw of arrivals, adapters and lengths) and is judged on the median over seeds of Route's ratios to the better
simple router of the same seed (paired: the three routers see the same requests); the tables give each seed's
ratios too. ``--jobs`` runs points in that many processes (the simulator is deterministic: the figures do not
change).

Load is against an estimate of what the fleet serves (``capacity``): a replica runs at most
``min(max_running, max_adapters)`` requests at once when every running request has its own adapter (the
worst case: more requests per adapter only add capacity), each for a prefill and ``output/2`` decode
steps of the calibration's costs. So a point at load 0.9 is below saturation for every popularity.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import itertools
import json
import statistics
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
from workers.staging.eviction import EVICTION

SLOTS = 8
ROUTERS = ("lora-cache", "affinity", "least-loaded")
P99_LIMIT, MEAN_LIMIT = 1.05, 1.0  # Route against the better of affinity and least-loaded
POPULARITIES = ("uniform", "zipf:0.6", "zipf:1", "zipf:1.5", "bursty")
INPUT_LEN, OUTPUT_LEN = 512, 128  # the workload's longest prompt and output (uniform in [1, len])


@dataclasses.dataclass(frozen=True)
class Knobs:
    """What a grid run sets on every point's fleet beside the point itself (``--join-over``, ``--host-eviction``):
    the same for all three routers, so each point still compares routers alone."""

    join_over: float = RouterConfig.join_over
    host_eviction: str = SimConfig.host_eviction

    def __post_init__(self) -> None:  # a clear error before any point runs
        RouterConfig(join_over=self.join_over)
        if self.host_eviction not in EVICTION:
            raise ConfigError(f"--host-eviction is {self.host_eviction!r}; give one of {', '.join(EVICTION)}")


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

    def spec(self, calibration: Calibration, seed: int = 0) -> WorkloadSpec:
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
            workload_seed=seed,
        )

    def fleet(self, router: str, knobs: Knobs = Knobs()) -> SimConfig:
        return SimConfig(
            join_over=knobs.join_over,
            host_eviction=knobs.host_eviction,
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


Figures = dict[str, dict[str, float]]  # router -> mean_ttft_ms, p99_ttft_ms, ready_on_arrival, sim_s


class Outcome(NamedTuple):
    """One point's runs, one per workload seed, judged on the median over seeds of Route's ratios."""

    point: Point
    runs: tuple[Figures, ...]  # per seed, in ``seeds``' order
    seeds: tuple[int, ...] = (0,)

    @property
    def figures(self) -> Figures:
        """Per router, each figure's median over the seeds (the one run's own with one seed)."""
        return {r: {k: statistics.median(run[r][k] for run in self.runs) for k in self.runs[0][r]}
                for r in ROUTERS}

    def p99_ratios(self) -> list[float]:
        return [run["lora-cache"]["p99_ttft_ms"] / min(run[r]["p99_ttft_ms"] for r in ROUTERS[1:])
                for run in self.runs]

    def mean_ratios(self) -> list[float]:
        return [run["lora-cache"]["mean_ttft_ms"] / min(run[r]["mean_ttft_ms"] for r in ROUTERS[1:])
                for run in self.runs]

    @property
    def p99_ratio(self) -> float:
        return statistics.median(self.p99_ratios())

    @property
    def mean_ratio(self) -> float:
        return statistics.median(self.mean_ratios())

    @property
    def holds(self) -> bool:
        return self.p99_ratio <= P99_LIMIT and self.mean_ratio <= MEAN_LIMIT


def select(points: Iterable[Point], patterns: str) -> list[Point]:
    """Points whose name matches any of the comma-separated shell patterns ('' or '*': all)."""
    pats = [p for p in patterns.split(",") if p] or ["*"]
    return [p for p in points if any(fnmatch.fnmatchcase(p.name, pat) for pat in pats)]


def run_point(point: Point, calibration: Calibration, policy: str = "global",
              knobs: Knobs = Knobs(), seed: int = 0) -> Figures:
    """One point at one workload seed: every router's figures."""
    spec = point.spec(calibration, seed)
    workload = make_workload(spec, spec.adapter_names(SLOTS))
    figures = {}
    for router in ROUTERS:
        t0 = time.perf_counter()
        s = simulate(point.fleet(router, knobs), BENCH_POLICIES[policy], workload, calibration).summary()
        figures[router] = {
            "mean_ttft_ms": s["mean_ttft_ms"],
            "p99_ttft_ms": s["p99_ttft_ms"],
            "ready_on_arrival": s["ready_on_arrival"],
            "sim_s": time.perf_counter() - t0,
        }
    return figures


def _judged(point: Point, calibration: Calibration, knobs: Knobs, seeds: tuple[int, ...]) -> Outcome:
    return Outcome(point, tuple(run_point(point, calibration, knobs=knobs, seed=s) for s in seeds), seeds)


def run_grid(points: Sequence[Point], calibration: str, out: Path | None, log: TextIO,
             knobs: Knobs = Knobs(), seeds: Sequence[int] = (0,), jobs: int = 1) -> list[Outcome]:
    """Every point at every seed (``jobs`` points at once, in processes), in the points' order."""
    if not points:
        raise ConfigError(
            f"the grid selection is empty; check --points (shell patterns over names like {full_grid()[0].name})"
        )
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"grid seeds {list(seeds)}: give distinct workload seeds >= 0 (e.g. --seeds 0,1,2,3)")
    if jobs < 1:
        raise ConfigError(f"--jobs is {jobs}; give 1 or more processes")
    cal, picked = load_calibration(calibration), tuple(seeds)  # a clear error before any point runs
    outcomes: list[Outcome] = []

    def done(o: Outcome) -> None:
        outcomes.append(o)
        print(line(o), file=log, flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "routing.json").write_text(json.dumps([as_dict(x) for x in outcomes], indent=1))
            (out / "routing.md").write_text(table(outcomes) + "\n")

    if jobs == 1:
        for point in points:
            done(_judged(point, cal, knobs, picked))
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            for o in pool.map(_judged, points, itertools.repeat(cal), itertools.repeat(knobs),
                              itertools.repeat(picked)):
                done(o)
    return outcomes


def as_dict(o: Outcome) -> dict[str, Any]:
    return {
        "point": o.point.name,
        **o.point._asdict(),
        "figures": o.figures,
        "seeds": list(o.seeds),
        "runs": list(o.runs),
        "p99_ratios": o.p99_ratios(),
        "mean_ratios": o.mean_ratios(),
        "p99_ratio": o.p99_ratio,
        "mean_ratio": o.mean_ratio,
        "holds": o.holds,
    }


def line(o: Outcome) -> str:
    f = o.figures
    cells = " ".join(f"{r} {f[r]['mean_ttft_ms']:.0f}/{f[r]['p99_ttft_ms']:.0f}" for r in ROUTERS)
    per_seed = "" if len(o.seeds) == 1 else (
        " (seeds " + ", ".join(f"{s}: {p:.2f}/{m:.2f}" for s, p, m in zip(o.seeds, o.p99_ratios(), o.mean_ratios()))
        + ")")
    return (
        f"{o.point.name}: {cells} ms; Route/best p99 {o.p99_ratio:.2f} mean {o.mean_ratio:.2f}{per_seed}"
        f"{'' if o.holds else '  FAILS'}"
    )


def table(outcomes: Sequence[Outcome]) -> str:
    several = any(len(o.seeds) > 1 for o in outcomes)
    head = ["point", *(f"{r} mean/p99 ms" for r in ROUTERS), "p99 / best", "mean / best",
            *(["p99 / mean per seed"] if several else []), "holds"]
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for o in outcomes:
        f = o.figures
        per_seed = [", ".join(f"{s}: {p:.3f} / {m:.3f}" for s, p, m in zip(o.seeds, o.p99_ratios(),
                                                                             o.mean_ratios()))] if several else []
        rows.append(
            f"| {o.point.name} | "
            + " | ".join(f"{f[r]['mean_ttft_ms']:.1f} / {f[r]['p99_ttft_ms']:.1f}" for r in ROUTERS)
            + f" | {o.p99_ratio:.3f} | {o.mean_ratio:.3f} | " + "".join(p + " | " for p in per_seed)
            + f"{'yes' if o.holds else 'NO'} |"
        )
    if outcomes:
        worst_p99 = max(outcomes, key=lambda o: o.p99_ratio)
        worst_mean = max(outcomes, key=lambda o: o.mean_ratio)
        over = f" (medians over workload seeds {', '.join(map(str, outcomes[0].seeds))})" if several else ""
        rows += [
            "",
            f"{sum(o.holds for o in outcomes)} of {len(outcomes)} points hold{over}; worst p99 ratio "
            f"{worst_p99.p99_ratio:.3f} ({worst_p99.point.name}), worst mean ratio "
            f"{worst_mean.mean_ratio:.3f} ({worst_mean.point.name})",
        ]
    return "\n".join(rows)
