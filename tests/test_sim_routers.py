"""The simulator's routers (bench.sim.fleet.ROUTERS): every one routes every request; lora-cache's advice
keeps adapters where they are resident."""

from __future__ import annotations

import dataclasses

import pytest

from bench.policies import BENCH_POLICIES
from bench.run import BenchConfig, check_router
from bench.sim import ROUTERS, SimConfig, simulate
from bench.sim.calibration import load_calibration
from bench.workloads import Workload, WorkloadSpec, make_workload
from lora_cache.errors import ConfigError

H200 = load_calibration("h200-llama8b")
FLEET = SimConfig(replicas=4, tp=1, slots=4, max_adapters=4, hint_lead_s=0.05)


def zipf(requests: int = 300, seed: int = 0) -> Workload:
    spec = WorkloadSpec(arrivals="poisson:12", popularity="zipf:0.9", requests=requests, num_adapters=40,
                        random_input_len=256, random_output_len=32, workload_seed=seed)
    return make_workload(spec, spec.adapter_names(FLEET.slots))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_every_router_routes_every_request(router: str, tp: int) -> None:
    wl = zipf(120)
    config = dataclasses.replace(FLEET, routing=router, tp=tp)
    result = simulate(config, BENCH_POLICIES["global"], wl, H200, check=True)
    assert [r.rid for r in result.records] == [r.rid for r in wl.requests]
    assert all(r.token_s for r in result.records)


def test_lora_cache_routing_beats_round_robin_on_hit_rate() -> None:
    """Seeded runs, an ordering of hit rates (ready on arrival), not a timing."""
    wl = zipf()
    hit = {router: simulate(dataclasses.replace(FLEET, routing=router), BENCH_POLICIES["global"], wl,
                            H200).summary()["ready_on_arrival"] for router in ("round-robin", "lora-cache")}
    assert hit["lora-cache"] > hit["round-robin"], hit


def test_router_names_are_checked() -> None:
    with pytest.raises(ConfigError, match="routing 'random' is not registered; choose one of round-robin"):
        SimConfig(routing="random")
    with pytest.raises(ConfigError, match="router 'nearest' is not registered"):
        BenchConfig(engine="sim", router="nearest")
    with pytest.raises(ConfigError, match="router 'nearest' is not registered"):
        BenchConfig(engine="real", router="nearest")
    for router in ROUTERS:  # every router runs on the real path too (bench.router.rules)
        assert BenchConfig(engine="real", router=router).router == router
    with pytest.raises(ConfigError, match="--router affinity routes open-loop arrivals only on --engine real"):
        check_router(BenchConfig(engine="real", router="affinity"), WorkloadSpec(arrivals="inflight:8"))
    check_router(BenchConfig(engine="sim", router="affinity"), WorkloadSpec(arrivals="inflight:8"))


def test_join_over_reaches_the_simulated_controllers_routing_advice_and_is_checked_before_a_run() -> None:
    """``--join-over`` (RouterConfig.join_over, issue 42) on the simulator: a fleet whose lanes are scarcer than its
    slots routes differently with it, every request still served, every integrity check holding."""
    from bench.sim.job import sim_config

    assert sim_config(BenchConfig(engine="sim", join_over=2.0)).join_over == 2.0
    with pytest.raises(ConfigError, match=r"join_over is 0\.5; give a number >= 1"):
        BenchConfig(engine="sim", join_over=0.5)
    spec = WorkloadSpec(arrivals="poisson:10", popularity="zipf:1.5", requests=300, num_adapters=40,
                        random_input_len=512, random_output_len=128, workload_seed=0)
    wl = make_workload(spec, spec.adapter_names(8))
    scarce = SimConfig(replicas=2, tp=1, slots=8, max_adapters=4, hint_lead_s=0.05, routing="lora-cache")
    runs = {j: simulate(dataclasses.replace(scarce, join_over=j), BENCH_POLICIES["global"], wl, H200, check=True)
            for j in (1.0, 2.0)}
    for result in runs.values():
        assert [r.rid for r in result.records] == [r.rid for r in wl.requests] and all(r.ok for r in result.records)
    assert [r.token_s for r in runs[1.0].records] != [r.token_s for r in runs[2.0].records]
