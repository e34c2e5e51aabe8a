"""Fleet placement (issue 20 item 3, lora_cache/planner/homes.py): distinct adapters spread over the fleet's
free slots at their homes (the routing advice's own order), copies in proportion to the traffic share."""

from __future__ import annotations

from collections import Counter

import pytest

from lora_cache.advice import RouteRequest, advise
from lora_cache.planner import AdapterInfo, Plan, Planner, PlannerConfig, ReplicaSpec
from lora_cache.planner.homes import copies
from lora_cache.planner.popularity import RankedCounts
from lora_cache.routing import ReplicaLoad, Residence, RouterConfig, preference, rank


def fleet(replicas: int = 4, slots: int = 2, adapters: int = 6, tp: int = 2, **config: object) -> Planner:
    specs = [ReplicaSpec(f"r{r}", tuple(f"r{r}/w{k}" for k in range(tp)), slots) for r in range(replicas)]
    infos = [AdapterInfo(f"a{i}", "v1", 100) for i in range(adapters)]
    config.setdefault("speculate_min_rate", 1e9)  # no speculation: the homes alone
    return Planner(PlannerConfig(**config), 3, infos, specs)  # type: ignore[arg-type]


def loads(plan: Plan) -> dict[str, set[str]]:
    """adapter -> replicas whose every worker was told to load it."""
    per_worker: dict[str, set[str]] = {}
    for commands in plan.workers:
        assert not commands.evicts, f"homes evicted {commands.evicts} at {commands.worker}"
        for p in commands.prefetches:
            per_worker.setdefault(p.adapter, set()).add(commands.worker)
    out: dict[str, set[str]] = {}
    for adapter, workers in per_worker.items():
        replicas = {w.split("/")[0] for w in workers}
        for r in replicas:
            assert {f"{r}/w0", f"{r}/w1"} <= workers, f"{adapter} loaded on only some ranks of {r}"
        out[adapter] = replicas
    return out


def settle(planner: Planner, now: float, rounds: int = 4) -> dict[str, set[str]]:
    placed: dict[str, set[str]] = {}
    for i in range(rounds):
        for adapter, replicas in loads(planner.plan_all(now + i * 1e-3)).items():
            placed.setdefault(adapter, set()).update(replicas)
    planner.check_integrity()
    return placed


@pytest.mark.parametrize(("share", "replicas", "expected"), [
    (0.0, 8, 1), (0.01, 8, 1), (0.125, 8, 1), (0.13, 8, 2), (0.5, 4, 2), (1.0, 4, 4), (3.0, 4, 4), (0.3, 1, 1)])
def test_copies_follow_the_traffic_share(share: float, replicas: int, expected: int) -> None:
    assert copies(share, replicas) == expected


def test_the_home_order_is_where_the_advice_sends_a_cold_adapter_and_its_overflow() -> None:
    replicas = [f"replica-{i}" for i in range(16)]
    for adapter in ("a0", "adapter-077", "x"):
        cold = [ReplicaLoad(r, Residence.COLD, 0.0) for r in replicas]
        assert [p.replica for p in rank(adapter, cold, RouterConfig())] == preference(adapter, replicas)
        first = preference(adapter, replicas)[0]
        full = [r._replace(load=100.0) if r.replica == first else r for r in cold]  # over the bound: overflow
        assert rank(adapter, full, RouterConfig())[0].replica == preference(adapter, replicas)[1]


@pytest.mark.parametrize(("replicas", "slots", "adapters"), [(4, 2, 6), (4, 2, 8), (8, 3, 20), (3, 4, 12)])
def test_a_fleet_that_holds_the_catalog_places_every_adapter_once_where_the_advice_sends_it(
        replicas: int, slots: int, adapters: int) -> None:
    """Nothing requested yet: each adapter goes to the first replica of its order with a slot left (its first
    home unless that one is full), no replica gets more than its slots, and the advice routes there."""
    planner = fleet(replicas=replicas, slots=slots, adapters=adapters)
    placed = settle(planner, 0.0)
    names = planner.replicas()
    assert sorted(placed) == sorted(f"a{i}" for i in range(adapters))
    assert all(len(where) == 1 for where in placed.values()), placed
    assert max(Counter(r for where in placed.values() for r in where).values()) <= slots
    spilled = 0
    for name, (where,) in ((n, tuple(w)) for n, w in placed.items()):
        order = preference(name, names)
        spilled += where != order[0]
        advice = advise(planner, [RouteRequest(name)], RouterConfig())[0]
        assert advice.ranked[0].replica == where and advice.ranked[0].reason is Residence.LOADING
    assert spilled < adapters / 2


def test_a_catalog_larger_than_the_fleet_places_only_adapters_with_traffic() -> None:
    planner = fleet(replicas=2, slots=2, adapters=6)  # 4 slots, 6 adapters: no fill
    assert settle(planner, 0.0) == {}
    planner.record_request("a3", "r0", 1.0, weight=100)  # ~1.2 requests/s fleet-wide each, half the traffic:
    planner.record_request("a5", "r0", 1.0, weight=100)  # one home each, wherever they were counted
    planner.record_request("a1", "r0", 1.0, weight=20)  # 0.23/s: below home_min_rate (0.5), not placed
    placed = settle(planner, 1.0)
    assert placed == {name: {preference(name, planner.replicas())[0]} for name in ("a3", "a5")}


def test_a_hot_adapter_gets_homes_in_proportion_to_its_share_of_the_traffic() -> None:
    planner = fleet(replicas=4, slots=3, adapters=13)  # 12 slots, 13 adapters: traffic decides
    planner.record_request("a0", "r0", 1.0, weight=600)  # 60% of the traffic: 3 of 4 replicas (2.3/s each)
    for name in ("a1", "a2", "a3", "a4"):
        planner.record_request(name, "r1", 1.0, weight=100)  # 10% each: one home each
    placed = settle(planner, 1.0)
    order = preference("a0", planner.replicas())
    assert placed["a0"] == set(order[:3])
    assert all(len(placed[n]) == 1 for n in ("a1", "a2", "a3", "a4"))
    per_replica = Counter(r for replicas in placed.values() for r in replicas)
    assert max(per_replica.values()) <= 3  # never over a replica's slots


def test_homes_never_evict_and_a_needed_adapter_still_displaces_them() -> None:
    planner = fleet(replicas=1, slots=2, adapters=2)  # one replica, catalog fits: a0 and a1 placed
    assert settle(planner, 0.0) == {"a0": {"r0"}, "a1": {"r0"}}
    planner.register_adapter(AdapterInfo("a2", "v1", 100))  # now 3 adapters for 2 slots: no fill
    planner.report_queue("r0", [("a2", 1.0)], 1.0)
    plan = planner.plan(1.0)
    evicts = {c.adapter for commands in plan.workers for c in commands.evicts}
    prefetches = {c.adapter for commands in plan.workers for c in commands.prefetches}
    assert prefetches == {"a2"} and len(evicts) == 1  # the need displaces one home
    planner.check_integrity()


def test_homes_off_places_nothing_without_traffic() -> None:
    assert settle(fleet(replicas=4, slots=2, adapters=6, place_homes=False), 0.0) == {}


def test_the_fleet_total_is_the_sum_of_the_counts_through_adds_forgets_limits_and_rescales() -> None:
    counts = RankedCounts(limit=3)
    for i, amount in enumerate((5.0, 1.0, 3.0, 2.0, 7.0)):
        counts.add(f"k{i}", amount)
        counts.check_integrity()
    counts.forget("k4")
    counts.check_integrity()
    counts.rescale(0.5)
    counts.check_integrity()
    assert counts.total == pytest.approx(sum(counts.values.values()))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_a_bad_home_min_rate_is_refused_with_the_fix(value: float) -> None:
    from lora_cache.planner.errors import ConfigError
    with pytest.raises(ConfigError, match=r"home_min_rate.*place_homes"):
        PlannerConfig(home_min_rate=value)
