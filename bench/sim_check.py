"""The simulator against a real run: ``python -m bench.sim_check DIR/results.json`` after the fact, or
``python -m bench.run --engine real --check-sim`` in the same job.

Fits the simulator's costs from the run's own step and load logs (``fit_calibration``, the provisional
H200 calibration filling what the logs cannot fit), simulates the same workload, fleet and policies
(round-robin routing, as the real router), and compares mean and p99 TTFT per policy (the benchmark
issue's check: within 15%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.figures import figures
from bench.policies import BENCH_POLICIES, BenchPolicy
from bench.run import BenchConfig, _run_sim
from bench.sim.calibration import fit_calibration, load_calibration
from bench.workloads import Workload, WorkloadSpec, make_workload

KEYS = ("mean_ttft_ms", "p99_ttft_ms")


def compare(bench: BenchConfig, policies: Sequence[BenchPolicy], workload: Workload,
            real: Mapping[str, Mapping[str, Any]], steps: list[dict[str, Any]],
            loads: list[dict[str, Any]]) -> dict[str, Any]:
    """``real``: each policy's figures; ``steps``/``loads``: the real run's logs the costs are fitted from."""
    calib = fit_calibration(steps, loads, name=f"fitted-{bench.model}", source="the real run's step and load logs",
                            base=load_calibration("h200-llama8b"))
    sims = _run_sim(bench, policies, workload, {}, calib)
    out: dict[str, Any] = {"calibration": dataclasses.asdict(calib), "policies": {}}
    for policy, sim in zip(policies, sims):
        r, s = real[policy.name], figures(sim)
        out["policies"][policy.name] = {k: {"real": r[k], "sim": s[k], "error": s[k] / r[k] - 1 if r[k] else math.inf}
                                        for k in KEYS}
    out["within_15pct"] = all(abs(v["error"]) <= 0.15 for p in out["policies"].values() for v in p.values())
    return out


def check(doc: dict[str, Any]) -> dict[str, Any]:
    """``compare`` for a results.json document of a ``--engine real`` run."""
    bench = BenchConfig(**doc["config"]["bench"])
    w = doc["config"]["workload"]
    spec = WorkloadSpec(arrivals=w["arrivals"], popularity=w["popularity"], requests=w["requests"],
                        random_input_len=w["random_input_len"], random_output_len=w["random_output_len"],
                        random_range_ratio=w["random_range_ratio"], workload_seed=w["seed"],
                        num_adapters=doc["config"]["adapters"])
    workload = make_workload(spec, spec.adapter_names(bench.slots))
    return compare(bench, [BENCH_POLICIES[p] for p in doc["figures"]], workload, doc["figures"],
                   [s for run in doc["steps"].values() for s in run], [x for run in doc["loads"].values() for x in run])


def format_comparison(out: Mapping[str, Any]) -> str:
    lines = [f"{name:>9}: " + "  ".join(f"{k} real {v['real']:.1f} sim {v['sim']:.1f} ({v['error']:+.0%})"
                                        for k, v in figs.items()) for name, figs in out["policies"].items()]
    return "\n".join([*lines, f"within 15%: {'yes' if out['within_15pct'] else 'no'}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="results.json of a --engine real run")
    ns = parser.parse_args(argv)
    print(format_comparison(check(json.loads(ns.results.read_text()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
