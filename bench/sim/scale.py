"""How fast the simulator runs a large fleet, and where the time goes (wall clock of this process).

    python -m bench.sim.scale [--replicas 64 --tp 4 --slots 16 --adapters 5000 --requests 20000
                               --rate 320 --policies global,queue,ondemand,oracle] [--out FILE.json]

For each policy: the wall time of building the fleet (of it, ``ControllerCore.register_adapter`` for
every adapter), of the run (of it, time inside ``ControllerCore`` calls; the rest is the simulator and
the engine's scheduler), simulated seconds, events, and p99 TTFT. Timers wrap the core's methods from
outside; the simulation itself reads no clock.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

from bench.policies import parse_policies
from bench.sim.calibration import load_calibration
from bench.sim.fleet import SimConfig, _Fleet
from bench.workloads import WorkloadSpec, make_workload
from lora_cache.controller.core import ControllerCore

CORE_CALLS = ("report_queue", "hint_batches", "worker_report", "sync_worker", "retry_failed", "plan")


def _timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--adapters", type=int, default=5000)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--rate", type=float, default=320.0)
    p.add_argument("--policies", default="global,queue,ondemand,oracle")
    p.add_argument("--calibration", default="h200-llama8b")
    p.add_argument("--out", type=Path)
    ns = p.parse_args()
    config = SimConfig(replicas=ns.replicas, tp=ns.tp, slots=ns.slots, max_adapters=ns.slots)
    spec = WorkloadSpec(arrivals=f"poisson:{ns.rate}", popularity="zipf:1.5", requests=ns.requests,
                        num_adapters=ns.adapters)
    workload = make_workload(spec, spec.adapter_names(ns.slots))
    calibration = load_calibration(ns.calibration)
    rows = []
    for policy in parse_policies(ns.policies):
        register: list[float] = [0.0]
        t0 = time.perf_counter()
        with patch.object(ControllerCore, "register_adapter", _timed(ControllerCore.register_adapter, register)):
            fleet = _Fleet(config, policy, workload, calibration, check=False)
        build_s = time.perf_counter() - t0
        core, spent = fleet.controller.core, [0.0]
        for name in CORE_CALLS:
            setattr(core, name, _timed(getattr(core, name), spent))
        t0 = time.perf_counter()
        result = fleet.run()
        run_s = time.perf_counter() - t0
        row = {"policy": policy.name, "build_s": round(build_s, 1), "of_which_register_s": round(register[0], 1),
               "run_s": round(run_s, 1), "of_which_controller_core_s": round(spent[0], 1),
               "simulated_s": round(result.end_s, 1), "events": result.events,
               "p99_ttft_ms": round(result.summary()["p99_ttft_ms"], 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if ns.out:
        config_ = {k: str(v) for k, v in vars(ns).items()}
        ns.out.write_text(json.dumps({"config": config_, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
