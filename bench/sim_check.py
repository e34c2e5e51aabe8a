"""``python -m bench.sim_check DIR/results.json``: the simulator against a real run, after the fact.

Fits the simulator's costs from the run's own step and load logs (``fit_calibration``, the provisional
H200 calibration filling what the logs cannot fit), simulates the same workload, fleet and policies
(round-robin routing, as the real router), and prints real vs simulated mean and p99 TTFT per policy
with the relative error (the benchmark issue's check: within 15%).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.figures import figures
from bench.policies import BENCH_POLICIES
from bench.run import BenchConfig, _run_sim
from bench.sim.calibration import fit_calibration, load_calibration
from bench.workloads import WorkloadSpec, make_workload


def check(doc: dict) -> dict:
    bench = BenchConfig(**doc["config"]["bench"])
    w = doc["config"]["workload"]
    spec = WorkloadSpec(arrivals=w["arrivals"], popularity=w["popularity"], requests=w["requests"],
                        random_input_len=w["random_input_len"], random_output_len=w["random_output_len"],
                        random_range_ratio=w["random_range_ratio"], workload_seed=w["seed"],
                        num_adapters=doc["config"]["adapters"])
    workload = make_workload(spec, spec.adapter_names(bench.slots))
    steps = [s for run in doc["steps"].values() for s in run]
    loads = [x for run in doc["loads"].values() for x in run]
    calib = fit_calibration(steps, loads, name="fitted", source="the run's step and load logs",
                            base=load_calibration("h200-llama8b"))
    sims = _run_sim(bench, [BENCH_POLICIES[p] for p in doc["figures"]], workload, {}, calib)
    out = {}
    for name, sim in zip(doc["figures"], sims):
        real, simulated = doc["figures"][name], figures(sim)
        out[name] = {k: {"real": real[k], "sim": simulated[k], "error": simulated[k] / real[k] - 1}
                     for k in ("mean_ttft_ms", "p99_ttft_ms")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="results.json of a --engine real run")
    ns = parser.parse_args(argv)
    out = check(json.loads(ns.results.read_text()))
    for name, figs in out.items():
        print(f"{name:>9}: " + "  ".join(f"{k} real {v['real']:.1f} sim {v['sim']:.1f} ({v['error']:+.0%})"
                                        for k, v in figs.items()))
    within = all(abs(v["error"]) <= 0.15 for figs in out.values() for v in figs.values())
    print(f"within 15%: {'yes' if within else 'no'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
