"""Routing advice's settings in the simulator: one workload, the ``lora-cache`` router under several
``RouterConfig``s (and the other routers for reference), TTFT and the share of requests whose adapter
was READY on arrival.

    python -m bench.probes.route_advice --replicas 32 --rate 64 --requests 3000 --adapters 200 --lead 0.05 \\
        --variants "default;sticky=0;min_bound=0;sticky=0,min_bound=0;epsilon=1"

A variant is ``field=value`` pairs of ``lora_cache.routing.ranking.RouterConfig`` ("default": none).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

from bench.policies import BENCH_POLICIES
from bench.sim import ROUTERS, SimConfig, simulate
from bench.sim.calibration import load_calibration
from bench.workloads import WorkloadSpec, make_workload
from lora_cache.errors import ConfigError
from lora_cache.routing.ranking import RouterConfig


def router_config(variant: str) -> RouterConfig:
    """``field=value,...`` -> RouterConfig (booleans as 0/1)."""
    if variant in ("", "default"):
        return RouterConfig()
    kinds = {f.name: f.type for f in dataclasses.fields(RouterConfig)}
    values: dict[str, object] = {}
    for pair in variant.split(","):
        name, sep, value = pair.partition("=")
        if not sep or name not in kinds:
            raise ConfigError(f"variant part {pair!r} is not FIELD=VALUE with a RouterConfig field "
                              f"({', '.join(kinds)})")
        values[name] = bool(int(value)) if kinds[name] == "bool" else float(value)
    return RouterConfig(**values)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.route_advice", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=32)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rate", type=float, default=64.0, help="Poisson arrivals per second (fleet)")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--zipf", type=float, default=0.9)
    p.add_argument("--lead", type=float, default=0.05, help="hint lead, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="global")
    p.add_argument("--variants", default="default", help="';'-separated RouterConfig variants for lora-cache")
    p.add_argument("--others", default="affinity", help="comma list of other routers to run for reference")
    ns = p.parse_args(argv)
    spec = WorkloadSpec(arrivals=f"poisson:{ns.rate:g}", popularity=f"zipf:{ns.zipf:g}", requests=ns.requests,
                        num_adapters=ns.adapters, workload_seed=ns.seed)
    workload = make_workload(spec, spec.adapter_names(ns.slots))
    calibration = load_calibration("h200-llama8b")
    base = SimConfig(replicas=ns.replicas, slots=ns.slots, max_adapters=ns.slots, hint_lead_s=ns.lead)
    runs = [("lora-cache", v) for v in ns.variants.split(";")] + [(r, "-") for r in ns.others.split(",") if r]
    print("| router | RouterConfig | mean TTFT ms | p99 TTFT ms | ready on arrival | sim s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for router, variant in runs:
        if router not in ROUTERS:
            raise SystemExit(f"router {router!r} is not one of {', '.join(ROUTERS)}")
        config = router_config(variant) if router == "lora-cache" else None
        t0 = time.perf_counter()
        result = simulate(dataclasses.replace(base, routing=router), BENCH_POLICIES[ns.policy], workload,
                          calibration, router=config)
        s = result.summary()
        print(f"| {router} | {variant} | {s['mean_ttft_ms']:.1f} | {s['p99_ttft_ms']:.1f} | "
              f"{s['ready_on_arrival']:.3f} | {time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
