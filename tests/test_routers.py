"""The real path's routing rules (bench.router.rules), plain core: each rule's decisions, batches routed as a
stream of single picks would be, and the same picks as the simulator's routers (bench.sim.fleet.ROUTERS)
on the same state, so a real run and its simulation route alike."""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest

from bench.policies import BENCH_POLICIES
from bench.real import RealConfig, run_policy
from bench.router.real import served_as_routed
from bench.router.rules import RULES, Affinity, LeastLoaded, LoraCache, RoundRobin, least_loaded, make_rule
from bench.sim.fleet import ROUTERS, RouteContext
from bench.workloads import WorkloadSpec, make_workload
from lora_cache.errors import ConfigError
from lora_cache.planner import AdapterInfo, Planner, PlannerConfig, ReplicaSpec, ResidencyEntry, SlotState
from lora_cache.routing.advice import RouteRequest, advise, residence
from lora_cache.routing.ranking import Residence, RouterConfig
from lora_cache.vocab import AdapterKey
from workers.engine.engine import EngineResult
from workers.engine.timings import RequestRecord

NAMES = [f"replica-{i}" for i in range(4)]


class FakeGateway:
    """``ready``: fixed sets; ``first``: a fixed answer per adapter; both record their calls."""

    def __init__(self, ready: Mapping[str, Collection[str]] | None = None,
                 first: Mapping[str, str] | None = None) -> None:
        self._ready, self._first = ready or {}, first or {}
        self.lookups: list[str] = []
        self.routes: list[tuple[list[str], dict[str, int]]] = []

    def ready(self, adapter: str) -> Collection[str]:
        self.lookups.append(adapter)
        return self._ready.get(adapter, ())

    def first(self, adapters: Sequence[str], loads: Mapping[str, int]) -> list[str]:
        self.routes.append((list(adapters), dict(loads)))
        return [self._first[a] for a in adapters]


def loads(*counts: int) -> dict[str, int]:
    return dict(zip(NAMES, counts))


def test_round_robin_continues_across_batches() -> None:
    rule, state = RoundRobin(), loads(0, 0, 0, 0)
    got = rule.route(["a", None, "b"], state, FakeGateway()) + rule.route(["c", "d", "e"], state, FakeGateway())
    assert got == [NAMES[i % 4] for i in range(6)]
    assert state == loads(2, 2, 1, 1)  # each pick counted


def test_least_loaded_counts_each_pick_before_the_next_and_breaks_ties_by_index() -> None:
    state = loads(2, 0, 0, 1)
    assert LeastLoaded().route(["a", "a", "b", None], state, FakeGateway()) == [NAMES[1], NAMES[2], NAMES[1], NAMES[2]]
    assert state == loads(2, 2, 2, 1)
    assert least_loaded(loads(1, 1, 1, 1)) == NAMES[0] and least_loaded(loads(3, 1, 0, 1), NAMES[:2]) == NAMES[1]


def test_affinity_takes_the_least_loaded_ready_replica_else_the_least_loaded() -> None:
    gateway = FakeGateway(ready={"a": {NAMES[2], NAMES[3]}})
    state = loads(0, 0, 4, 3)
    got = Affinity().route(["a", "b", None, "a"], state, gateway)
    assert got == [NAMES[3], NAMES[0], NAMES[1], NAMES[2]]  # a: ready on 2 and 3; 3 less loaded, then 4 = 4: index
    assert gateway.lookups == ["a", "b"]  # one Lookup per adapter of the batch, none for the base model


def test_lora_cache_asks_route_once_per_run_of_adapter_requests_with_its_loads() -> None:
    gateway = FakeGateway(first={"a": NAMES[3], "b": NAMES[1]})
    state = loads(1, 0, 0, 0)
    got = LoraCache().route(["a", "b", None, "a"], state, gateway)
    assert got == [NAMES[3], NAMES[1], NAMES[2], NAMES[3]]  # the base model: least loaded (after a and b)
    assert gateway.routes == [(["a", "b"], loads(1, 0, 0, 0)), (["a"], loads(1, 1, 1, 1))]
    assert state == loads(1, 1, 1, 2)


def test_a_route_answer_naming_no_router_replica_is_refused() -> None:
    with pytest.raises(ConfigError, match="Route answered"):
        LoraCache().route(["a"], loads(0, 0, 0, 0), FakeGateway(first={"a": "elsewhere"}))


def test_rules_are_the_simulators_and_unknown_names_are_refused() -> None:
    assert list(RULES) == list(ROUTERS)
    with pytest.raises(ConfigError, match="'nearest' is not registered; choose one of round-robin"):
        make_rule("nearest")


# -- the same picks as the simulator's routers ---------------------------------------------------------
def planner_fleet(rng: random.Random) -> Planner:
    """Four replicas of two workers, three slots each; eight adapters, some READY or LOADING here and there."""
    specs = [ReplicaSpec(name, (f"{name}/w0", f"{name}/w1"), 3) for name in NAMES]
    planner = Planner(PlannerConfig(policy="global", max_prefetches_per_plan=0), 1,
                      [AdapterInfo(f"a{i}", "v1", 100) for i in range(8)], specs)
    planner.plan(0.0)
    for name in NAMES:
        for adapter in rng.sample([f"a{i}" for i in range(8)], 3):
            state = rng.choice([SlotState.READY, SlotState.READY, SlotState.LOADING])
            ranks = ("w0", "w1") if rng.random() < 0.8 else ("w0",)
            for w in ranks:
                planner.update_residency(f"{name}/{w}", ResidencyEntry(adapter, "v1", state, 0))
    return planner


class PlannerGateway:
    """The gateway's answers from a planner, as the controller gives them (``advise``, residency)."""

    def __init__(self, planner: Planner, config: RouterConfig) -> None:
        self.planner, self.config = planner, config

    def ready(self, adapter: str) -> Collection[str]:
        key = AdapterKey(adapter, "v1")
        return [r for r in self.planner.view.replicas() if residence(self.planner.view, r, key) is Residence.READY]

    def first(self, adapters: Sequence[str], loads: Mapping[str, int]) -> list[str]:
        items = [RouteRequest(a) for a in adapters]
        return [a.ranked[0].replica for a in advise(self.planner.view, items, self.config, dict(loads))]


class CoreView:
    """What the simulator's lora-cache router calls: ``route`` (ControllerCore's signature)."""

    def __init__(self, planner: Planner, config: RouterConfig) -> None:
        self.planner, self.config = planner, config

    def route(self, items: list[RouteRequest], loads: dict[str, float] | None = None, finished: Any = ()) -> list:
        return advise(self.planner.view, items, self.config, loads)


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("config", [RouterConfig(), RouterConfig(min_bound=0.0, epsilon=0.1)])
@pytest.mark.parametrize("seed", range(6))
def test_batched_picks_equal_the_simulators_single_picks(name: str, config: RouterConfig, seed: int) -> None:
    rng = random.Random(seed)
    planner = planner_fleet(rng)
    gateway = PlannerGateway(planner, config)
    outstanding = [rng.randrange(6) for _ in NAMES]
    ctx = RouteContext(NAMES, outstanding, lambda a, i: NAMES[i] in gateway.ready(a), CoreView(planner, config), [])  # type: ignore[arg-type]
    sim, real = ROUTERS[name](), make_rule(name)
    state = dict(zip(NAMES, outstanding))
    for _ in range(5):  # batches of 1..7 due together, some for the base model
        batch = [None if rng.random() < 0.15 else f"a{rng.randrange(8)}" for _ in range(rng.randint(1, 7))]
        expected = []
        for adapter in batch:  # the simulator: one pick per request, each counted before the next
            i = sim.pick(adapter, ctx)
            outstanding[i] += 1
            expected.append(NAMES[i])
        assert real.route(batch, state, gateway) == expected, (name, batch)
        assert state == dict(zip(NAMES, outstanding))


# -- the run's check: every request served once, where it was routed --------------------------------------
def result(*rids: int) -> EngineResult:
    return EngineResult([RequestRecord(rid, None, 1, 1, 0.0, 0.0, (0.1,), 0.0) for rid in rids], [])


def test_served_as_routed_counts_and_names_what_went_wrong() -> None:
    choices = {0: NAMES[0], 1: NAMES[1], 2: NAMES[1]}
    assert served_as_routed(choices, {NAMES[0]: result(0), NAMES[1]: result(1, 2)}) == {
        "requests_per_replica": {NAMES[0]: 1, NAMES[1]: 2}, "served_by": {"0": NAMES[0], "1": NAMES[1], "2": NAMES[1]}}
    with pytest.raises(RuntimeError, match="request 2 was routed to replica-1 and served by replica-0"):
        served_as_routed(choices, {NAMES[0]: result(0, 2), NAMES[1]: result(1)})
    with pytest.raises(RuntimeError, match="served by both"):
        served_as_routed(choices, {NAMES[0]: result(0, 1), NAMES[1]: result(1, 2)})
    with pytest.raises(RuntimeError, match=r"missing \[2\]"):
        served_as_routed(choices, {NAMES[0]: result(0), NAMES[1]: result(1)})


def test_the_real_path_refuses_other_routers_for_a_closed_loop_before_starting_anything() -> None:
    names = [f"adapter-{i:03d}" for i in range(4)]
    workload = make_workload(WorkloadSpec(arrivals="inflight:4", requests=8, num_adapters=4), names)
    with pytest.raises(ConfigError, match="router 'affinity' routes open-loop arrivals only"):
        run_policy(RealConfig(router="affinity"), BENCH_POLICIES["global"], "/nonexistent", names, workload)
    with pytest.raises(ConfigError, match="router 'nearest' is not registered"):
        RealConfig(router="nearest")
