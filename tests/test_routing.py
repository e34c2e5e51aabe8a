"""Routing advice's plain core (lora_cache.routing.ranking): invariants of the bounded-load ranking."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_cache.errors import ConfigError, ConflictError
from lora_cache.planner.rendezvous import rendezvous_hash
from lora_cache.routing.ranking import (
    ReplicaLoad,
    Residence,
    RouteItem,
    RouterConfig,
    bound,
    rank,
    route_batch,
)

CONFIG = RouterConfig(min_bound=0.0, sticky=False)  # strict bounded loads, least-loaded cold picks
residences = st.sampled_from(list(Residence))
fleets = st.lists(st.tuples(residences, st.integers(0, 40)), min_size=1, max_size=12).map(
    lambda rows: [ReplicaLoad(f"replica-{i}", res, float(load)) for i, (res, load) in enumerate(rows)])


def test_the_core_imports_neither_torch_nor_ray() -> None:
    import subprocess

    code = "import sys, lora_cache.routing.ranking; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@given(fleets, st.floats(0, 2))
def test_every_replica_ranked_once_and_within_bound_first(fleet: list[ReplicaLoad], eps: float) -> None:
    ranked = rank("a", fleet, RouterConfig(epsilon=eps, min_bound=0.0))
    assert sorted(r.replica for r in ranked) == sorted(r.replica for r in fleet)
    flags = [r.within_bound for r in ranked]
    assert flags == sorted(flags, reverse=True)  # every replica with room before every one without
    assert flags[0]  # at least one replica always has room


@given(fleets, st.sampled_from([CONFIG, RouterConfig()]))
def test_a_ready_replica_under_the_bound_ranks_before_a_non_resident_one(fleet: list[ReplicaLoad],
                                                                         config: RouterConfig) -> None:
    ranked = rank("a", fleet, config)
    pos = {r.replica: i for i, r in enumerate(ranked)}
    for r in ranked:
        if r.reason is Residence.READY and r.within_bound:
            for other in ranked:
                if other.reason is Residence.COLD:
                    assert pos[r.replica] < pos[other.replica]


@given(fleets, st.floats(0, 1), st.sampled_from([0.0, 4.0, 8.0]), st.booleans())
def test_the_top_pick_stays_under_the_bound(fleet: list[ReplicaLoad], eps: float, floor: float, sticky: bool) -> None:
    top = rank("a", fleet, RouterConfig(epsilon=eps, min_bound=floor, sticky=sticky))[0]
    load = {r.replica: r.load for r in fleet}[top.replica]
    assert load + 1 <= bound([r.load for r in fleet], eps, floor=floor)


@given(st.integers(1, 16), st.integers(1, 300), st.floats(0, 1))
def test_a_hot_adapter_spreads_and_no_replica_exceeds_the_bound(n: int, requests: int, eps: float) -> None:
    """All requests for one adapter, resident on replica-0 only: routed loads stay within the bound of
    the fleet's load at every step, so the traffic spreads over more replicas as it grows."""
    fleet = [ReplicaLoad(f"replica-{i}", Residence.READY if i == 0 else Residence.COLD, 0.0) for i in range(n)]
    config = RouterConfig(epsilon=eps, min_bound=0.0)
    picks = route_batch([RouteItem("hot")] * requests, {"hot": fleet}, config)
    loads = dict.fromkeys((r.replica for r in fleet), 0)
    for i, ranked in enumerate(picks):
        cap = bound(list(loads.values()), eps)
        loads[ranked[0].replica] += 1
        assert max(loads.values()) <= cap, (i, loads, cap)
    assert max(loads.values()) <= (1 + eps) * requests / n + 1
    if requests > (1 + eps) * requests / n + 1:
        assert sum(1 for v in loads.values() if v) > 1


def test_the_resident_replica_takes_the_adapter_until_its_bound() -> None:
    fleet = [ReplicaLoad("r0", Residence.COLD, 2.0), ReplicaLoad("r1", Residence.READY, 3.0),
             ReplicaLoad("r2", Residence.STAGED, 2.0), ReplicaLoad("r3", Residence.LOADING, 2.0)]
    ranked = rank("a", fleet, CONFIG)  # cap = ceil(1.25 * 10 / 4) = 4: r1 has room
    assert [r.replica for r in ranked] == ["r1", "r3", "r2", "r0"]
    assert [r.reason for r in ranked] == [Residence.READY, Residence.LOADING, Residence.STAGED, Residence.COLD]
    over = rank("a", [r._replace(load=8.0) if r.replica == "r1" else r for r in fleet], CONFIG)
    assert over[-1].replica == "r1" and not over[-1].within_bound  # 9 > ceil(1.25 * 15 / 4) = 5


@given(st.lists(st.integers(0, 30), min_size=1, max_size=12))
def test_an_adapter_resident_nowhere_gets_the_least_loaded_replica(loads: list[int]) -> None:
    fleet = [ReplicaLoad(f"replica-{i}", Residence.COLD, float(x)) for i, x in enumerate(loads)]
    assert {r.replica: r.load for r in fleet}[rank("new", fleet, CONFIG)[0].replica] == min(loads)


@given(fleets, st.sampled_from([CONFIG, RouterConfig()]))
def test_deterministic_and_independent_of_input_order(fleet: list[ReplicaLoad], config: RouterConfig) -> None:
    a = rank("a", fleet, config)
    assert a == rank("a", list(reversed(fleet)), config)


@given(st.lists(st.integers(0, 6), min_size=2, max_size=12), st.sampled_from(["a", "b", "adapter-017"]))
def test_sticky_cold_picks_are_the_same_replica_while_it_has_room(loads: list[int], adapter: str) -> None:
    """Sticky, with cold_slack inf: an adapter resident nowhere goes to its hash-preferred replica whatever the
    (bounded) loads."""
    config = RouterConfig(min_bound=8.0, cold_slack=math.inf)
    fleet = [ReplicaLoad(f"replica-{i}", Residence.COLD, float(x)) for i, x in enumerate(loads)]
    idle = [r._replace(load=0.0) for r in fleet]
    assert rank(adapter, fleet, config)[0].replica == rank(adapter, idle, config)[0].replica
    others = {rank(name, idle, config)[0].replica for name in (f"adapter-{i:03d}" for i in range(64))}
    assert len(others) > 1  # different adapters prefer different replicas


@given(st.lists(st.floats(0, 50), min_size=2, max_size=12), st.sampled_from(["a", "b", "adapter-017"]))
def test_with_cold_traffic_a_cold_adapter_goes_to_the_replica_sent_fewest_requests_lately(recent: list[float],
                                                                                       adapter: str) -> None:
    """Issue 32: a router that counts its own traffic (cold_traffic) sends an adapter resident nowhere to the cold
    replica with room sent the fewest requests lately, whatever its hash order; a READY replica still comes first;
    without it the hash order stands (the controller's Route)."""
    fleet = [ReplicaLoad(f"replica-{i}", Residence.COLD, 0.0, recent=x) for i, x in enumerate(recent)]
    pick = rank(adapter, fleet, RouterConfig(cold_traffic=True))[0]
    assert pick.reason is Residence.COLD and dict(zip([r.replica for r in fleet], recent))[pick.replica] == min(recent)
    assert rank(adapter, fleet, RouterConfig())[0] == rank(adapter, [r._replace(recent=0.0) for r in fleet],
                                                           RouterConfig())[0]
    busiest = max(fleet, key=lambda r: r.recent)._replace(residence=Residence.READY)
    ready = [busiest if r.replica == busiest.replica else r for r in fleet]
    assert rank(adapter, ready, RouterConfig(cold_traffic=True))[0].replica == busiest.replica


def test_traffic_counts_decay_by_half_each_half_life_and_forget_a_replica() -> None:
    from lora_cache.routing.traffic import Traffic

    t = Traffic(10.0)
    t.add("r1", 0.0)
    t.add("r1", 0.0)
    assert t.get("r1", 0.0) == 2.0 and t.get("r2", 0.0) == 0.0
    assert t.get("r1", 10.0) == pytest.approx(1.0)
    t.add("r1", 20.0)
    assert t.get("r1", 20.0) == pytest.approx(1.5)
    t.forget("r1")
    assert t.get("r1", 20.0) == 0.0
    off = Traffic(0.0)
    off.add("r1", 0.0)
    assert off.get("r1", 0.0) == 0.0
    with pytest.raises(ConfigError, match=r"half_life_s is -1; give a finite number of seconds >= 0"):
        Traffic(-1)


@given(st.lists(st.integers(0, 6), min_size=2, max_size=12), st.sampled_from(["a", "b", "adapter-017"]),
       st.sampled_from([0.0, 1.0, 2.0]), st.sampled_from([0, 2, 3]))
def test_cold_picks_go_where_the_adapter_starts_soonest(loads: list[int], adapter: str, slack: float,
                                                        ties: int) -> None:
    """Issue 31: where adapter lanes are scarce (max_adapters < slots), an adapter resident nowhere goes to the
    hash-preferred replica among those within cold_slack of the least loaded (where it starts soonest), the same
    one whatever the loads of the others; where they are not, to its hash-preferred replica as before. Issue 42:
    where ``cold_ties`` or more share the least load, among those alone."""
    config = RouterConfig(min_bound=8.0, cold_slack=slack, cold_ties=ties)
    plain = [ReplicaLoad(f"replica-{i}", Residence.COLD, float(x)) for i, x in enumerate(loads)]
    idle = [r._replace(load=0.0) for r in plain]
    assert rank(adapter, plain, config)[0].replica == rank(adapter, idle, config)[0].replica
    fleet = [r._replace(scarce=True) for r in plain]
    pick = rank(adapter, fleet, config)[0].replica
    within = 0.0 if ties and loads.count(min(loads)) >= ties else slack
    soon = [r for r in fleet if r.load <= min(loads) + within]
    assert {r.replica: r.load for r in fleet}[pick] <= min(loads) + within
    assert pick == rank(adapter, [r._replace(load=0.0) for r in soon], config)[0].replica


def test_cold_picks_hash_among_the_least_loaded_where_enough_share_that_load() -> None:
    """Issue 42: two cold replicas idle and two one request behind, and an adapter whose hash prefers one behind: the
    pick is an idle one (``cold_ties=2``; off by default); with ``cold_ties=0``, or with one idle replica only, the
    hash decides within ``cold_slack`` (1) as before, so a lone idle replica does not take every cold pick."""
    fleet = [ReplicaLoad(f"replica-{i}", Residence.COLD, float(x), scarce=True) for i, x in enumerate([1, 0, 1, 0])]

    def preferred(adapter: str) -> ReplicaLoad:
        return min(fleet, key=lambda r: rendezvous_hash(adapter, r.replica))

    adapter = next(a for a in (f"adapter-{i}" for i in range(100)) if preferred(a).load == 1.0)
    config = RouterConfig(min_bound=8.0, cold_ties=2)
    assert rank(adapter, fleet, config)[0].replica in {"replica-1", "replica-3"}
    assert rank(adapter, fleet, dataclasses.replace(config, cold_ties=0))[0].replica == preferred(adapter).replica
    one_idle = [r._replace(load=1.0) if r.replica == "replica-3" else r for r in fleet]
    assert rank(adapter, one_idle, config)[0].replica == preferred(adapter).replica
    with pytest.raises(ConfigError, match=r"cold_ties is -1; give a whole number >= 0"):
        RouterConfig(cold_ties=-1)


def test_expected_wait_counts_the_queue_and_the_adapter_load() -> None:
    config = RouterConfig(request_s=0.1, cold_s=0.3, min_bound=0.0)
    (ranked,) = rank("a", [ReplicaLoad("r0", Residence.COLD, 2.0)], config)
    assert ranked.wait_s == pytest.approx(0.5)


@settings(max_examples=50)
@given(st.integers(1, 8), st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=60))
def test_a_batch_routes_every_item_and_spreads_like_a_stream(n: int, adapters: list[str]) -> None:
    fleet = [ReplicaLoad(f"replica-{i}", Residence.COLD, 0.0) for i in range(n)]
    picks = route_batch([RouteItem(a) for a in adapters], dict.fromkeys(adapters, fleet), CONFIG)
    assert len(picks) == len(adapters) and all(len(p) == n for p in picks)
    loads = [sum(1 for p in picks if p[0].replica == r.replica) for r in fleet]
    assert max(loads) - min(loads) <= 1 + CONFIG.epsilon * len(adapters) / n + 1


def test_token_weight_makes_long_prompts_weigh_more() -> None:
    fleet = [ReplicaLoad("r0", Residence.READY, 0.0), ReplicaLoad("r1", Residence.COLD, 0.0)]
    config = RouterConfig(epsilon=0.0, token_weight=0.01, min_bound=0.0)
    first, second = route_batch([RouteItem("a", 200), RouteItem("a", 0)], {"a": fleet}, config)
    assert first[0].replica == "r0" and second[0].replica == "r1"  # r0 carries 3 units, the bound is 2


@pytest.mark.parametrize(("field", "value", "fix"), [
    ("epsilon", -0.1, "give a number >= 0"), ("epsilon", float("inf"), "give a number >= 0"),
    ("cold_s", -1.0, "finite number >= 0"), ("min_bound", -1.0, "finite number >= 0"),
    ("request_s", float("nan"), "finite number >= 0"),
])
def test_config_errors_name_the_field_value_and_fix(field: str, value: object, fix: str) -> None:
    with pytest.raises(ConfigError, match=field) as e:
        RouterConfig(**{field: value})  # type: ignore[arg-type]
    assert fix in str(e.value)


def test_no_replicas_is_a_clear_error() -> None:
    with pytest.raises(ConflictError, match="no replicas to route adapter 'a'"):
        rank("a", [], CONFIG)


# -- admission limits (lora_cache.routing.limits, issue 31) -------------------------------------------------------
def test_a_replica_without_a_free_adapter_lane_ranks_after_one_that_can_start_the_request() -> None:
    """max_adapters 1: a replica running another adapter cannot start this one (head of line), READY or not."""
    config = RouterConfig()
    busy = ReplicaLoad("r0", Residence.READY, 1.0, {"b": 1}, max_adapters=1)
    idle = ReplicaLoad("r1", Residence.COLD, 0.0, {}, max_adapters=1)
    assert busy.lanes_short("a") == 1 and idle.lanes_short("a") == 0
    assert [r.replica for r in rank("a", [busy, idle], config)] == ["r1", "r0"]
    assert [r.replica for r in rank("a", [busy._replace(max_adapters=0), idle], config)] == ["r0", "r1"]  # no limit


def test_a_request_joins_its_adapters_running_batch_and_not_one_queued_behind_other_adapters() -> None:
    config = RouterConfig()
    running = ReplicaLoad("r0", Residence.READY, 3.0, {"a": 2, "b": 1}, max_adapters=2, scarce=True)  # a runs
    ready = ReplicaLoad("r1", Residence.READY, 0.0, {}, max_adapters=2, scarce=True)
    assert running.runs("a") and rank("a", [running, ready], config)[0].replica == "r0"
    plenty = [running._replace(scarce=False), ready._replace(scarce=False)]  # max_adapters = slots: no lane to save
    assert rank("a", plenty, config)[0].replica == "r1"
    queued = ReplicaLoad("r0", Residence.READY, 3.0, {"b": 1, "c": 1, "a": 1}, max_adapters=2)  # a waits for a lane
    assert not queued.runs("a") and queued.lanes_short("a") == 1
    assert rank("a", [queued, ready], config)[0].replica == "r1"


def test_join_over_lets_a_request_join_its_running_batch_past_the_bound_only_where_no_lane_is_waited_for() -> None:
    """Issue 42: overflow of a hot adapter to another replica holds a lane there for a whole request."""
    hot = ReplicaLoad("r0", Residence.READY, 12.0, {"a": 10, "b": 2}, max_adapters=4, scarce=True)  # a runs
    cold = ReplicaLoad("r1", Residence.COLD, 4.0, {"c": 2, "d": 2}, max_adapters=4, scarce=True)  # two lanes free
    cap = bound([12.0, 4.0], RouterConfig().epsilon, 1.0, RouterConfig().min_bound)
    assert cap < 13.0 <= 2 * cap  # one more request takes r0 past the bound, not past twice it
    assert rank("a", [hot, cold], RouterConfig())[0].replica == "r1"  # off (1.0): today's bound
    over = RouterConfig(join_over=2.0)
    assert [r.replica for r in rank("a", [hot, cold], over)] == ["r0", "r1"]
    assert rank("a", [hot, cold], over)[0].within_bound
    # an adapter waits for a lane there: joining keeps the lane busy longer, so the bound holds as before
    waiting = hot._replace(flying={"a": 8, "b": 2, "e": 1, "f": 1, "g": 1})
    assert waiting.runs("a") and rank("a", [waiting, cold], over)[0].replica == "r1"
    # a replica that does not run the adapter gets no wider bound, nor does one past twice the bound
    assert rank("b", [hot._replace(flying={"a": 12}), cold], over)[0].replica == "r1"
    others = [cold, cold._replace(replica="r2", load=0.0, flying={}), cold._replace(replica="r3", load=0.0, flying={})]
    assert rank("a", [hot, *others], over)[0].replica == "r0"  # 13 <= 2 x 8 (the bound of 4 replicas, min_bound)
    assert rank("a", [hot._replace(load=20.0), *others], over)[0].replica != "r0"  # 21 > 2 x 8
    # lanes not scarce (max_adapters = slots): joining saves nothing, the bound holds
    assert rank("a", [hot._replace(scarce=False), cold._replace(scarce=False)], over)[0].replica == "r1"
    with pytest.raises(ConfigError, match=r"join_over is 0\.5; give a number >= 1"):
        RouterConfig(join_over=0.5)


def test_a_join_ranks_first_only_while_the_fleets_adapters_in_flight_fill_a_share_of_its_lanes() -> None:
    """Issue 42: on 64 replicas of 4 lanes with 50 adapters at Zipf 1.5 about 23 adapters were in flight over 256
    lanes, and joins stacked the hot adapter's requests five or six deep on the replicas running it while replicas
    holding it READY had one or none. Where the distinct adapters in flight fill less than ``join_lanes`` of the
    fleet's lanes, a join ranks as any READY replica, least expected wait first; at or above it, first as before."""
    config = RouterConfig()
    assert config.join_lanes == 0.15
    running = ReplicaLoad("r0", Residence.READY, 3.0, {"a": 3}, max_adapters=4, scarce=True)
    few = [running] + [ReplicaLoad(f"r{i}", Residence.READY, 1.0, {"b": 1}, max_adapters=4, scarce=True)
                       for i in range(1, 8)]  # 2 adapters in flight over 32 lanes
    first = rank("a", few, config)[0]
    assert first.replica != "r0" and first.reason is Residence.READY and first.within_bound
    assert rank("a", few, RouterConfig(join_lanes=0.0))[0].replica == "r0"  # 0: joins always first
    many = [running] + [r._replace(flying={f"b{i}": 1}) for i, r in enumerate(few[1:])]  # 8 over 32 lanes: 0.25
    assert rank("a", many, config)[0].replica == "r0"
    assert rank("a", many, RouterConfig(join_lanes=0.25))[0].replica == "r0"  # the share reached: crowded
    assert rank("a", many, RouterConfig(join_lanes=0.26))[0].replica != "r0"
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match=r"join_lanes is .*give a share of the fleet's lanes from 0 to 1"):
            RouterConfig(join_lanes=bad)


in_flight = st.dictionaries(st.sampled_from("abcdefgh"), st.integers(1, 3), max_size=5)
scarce_fleets = st.lists(st.tuples(residences, st.integers(0, 10), in_flight), min_size=1, max_size=10).map(
    lambda rows: [ReplicaLoad(f"replica-{i}", res, float(load), flying, max_adapters=4, scarce=True)
                  for i, (res, load, flying) in enumerate(rows)])


@given(scarce_fleets, st.sampled_from([0.0, 0.1, 0.15, 0.3, 1.0]))
def test_join_lanes_turns_joins_off_below_the_share_and_changes_nothing_at_or_above_it(
        fleet: list[ReplicaLoad], share: float) -> None:
    config = RouterConfig(join_lanes=share)
    ranked = rank("a", fleet, config)
    in_flight_now = len({a for r in fleet for a in r.flying})
    if in_flight_now >= share * 4 * len(fleet):
        assert ranked == rank("a", fleet, RouterConfig(join_lanes=0.0))
    else:
        assert ranked == rank("a", fleet, RouterConfig(join=False))


def test_a_full_replica_ranks_last_and_a_batch_counts_its_own_picks_as_in_flight() -> None:
    config = RouterConfig()
    full = ReplicaLoad("r0", Residence.READY, 4.0, {"a": 4}, max_adapters=4, max_running=4)
    other = ReplicaLoad("r1", Residence.COLD, 0.0, {}, max_adapters=4, max_running=4)
    assert rank("a", [full, other], config)[0].replica == "r1"
    fleet = [ReplicaLoad(f"r{i}", Residence.COLD, 0.0, {}, max_adapters=1, scarce=True) for i in range(2)]
    picks = route_batch([RouteItem(a) for a in "xyx"], dict.fromkeys("xy", fleet), config)
    first = [p[0].replica for p in picks]
    assert first[0] != first[1] and first[2] == first[0]  # y takes the free lane; the second x joins the first


def test_routing_limits_remember_the_newest_picks_per_replica() -> None:
    from lora_cache.routing.limits import InFlight, ReplicaLimits, RoutingLimits

    limits = RoutingLimits(keep=4)
    limits.declare("r0", max_adapters=2, max_running=8)
    assert limits.limits("r0") == ReplicaLimits(2, 8) and limits.limits("r9") == ReplicaLimits()
    limits.record([("a", "r0"), ("b", "r0"), ("a", "r0"), ("c", "r0"), ("d", "r0")])
    assert list(limits.flying("r0", 3, ["z"]).items()) == [("a", 1), ("c", 1), ("d", 1)]  # oldest first
    assert limits.flying("r0", 10, []) == {"b": 1, "a": 1, "c": 1, "d": 1}  # at most `keep` remembered
    assert limits.flying("r0", None, ["z", "z"]) == {"z": 2}  # no router counts: the queue and hints
    with pytest.raises(ConfigError, match="max_adapters of replica 'r0' is -1"):
        limits.declare("r0", max_adapters=-1)
    with pytest.raises(ConfigError, match="keep is 0"):
        InFlight(0)
    limits.forget("r0")
    assert limits.limits("r0") == ReplicaLimits() and not limits.flying("r0", 3, [])


def test_where_every_lane_is_taken_the_replica_whose_running_batch_is_oldest_ranks_first() -> None:
    """Issue 31 (light load, max_adapters 1): with no replica able to start the request, it waits for a lane;
    the replica whose running batch's newest request was routed earliest frees one soonest. Before, residency
    decided (a READY replica whose batch had just started ranked first), then load."""
    from lora_cache.routing.limits import RoutingLimits

    config = RouterConfig()
    limits = RoutingLimits()
    limits.record([("a", "r0"), ("b", "r1")])  # r0's request is the older
    limits.declare("r0", max_adapters=1)
    limits.declare("r1", max_adapters=1)
    fleet = [ReplicaLoad(r, res, 1.0, limits.flying(r, 1.0, []), max_adapters=1, scarce=True,
                         frees=limits.lane_frees(r, 1.0))
             for r, res in (("r0", Residence.COLD), ("r1", Residence.READY))]
    assert [f.frees for f in fleet] == [1, 2] and limits.lane_frees("r0", None) == 0
    assert [r.replica for r in rank("x", fleet, config)] == ["r0", "r1"]
    assert rank("x", fleet, RouterConfig(oldest_first=False))[0].replica == "r1"  # the old rule: residency
    # a batch's own picks count: the second request goes where fewer lanes are short
    picks = route_batch([RouteItem("x"), RouteItem("y")], dict.fromkeys("xy", fleet), config)
    assert [p[0].replica for p in picks] == ["r0", "r1"]


def test_lane_frees_is_the_earliest_newest_pick_of_the_running_batches() -> None:
    from lora_cache.routing.limits import InFlight

    flight = InFlight()
    for replica, adapter in [("r", "a"), ("r", "b"), ("r", "a"), ("r", "c"), ("q", "a")]:
        flight.record(replica, adapter)  # sequence numbers 1..5
    assert flight.lane_frees("r", 4, 2) == 2  # a runs (newest pick 3), b runs (2), c waits: b frees first
    assert flight.lane_frees("r", 2, 2) == 3  # the newest two in flight only: a (3) and c (4) run
    assert flight.lane_frees("r", 4, 1) == 3 and flight.lane_frees("r", 0, 2) == flight.lane_frees("x", 3, 2) == 0


@given(st.lists(st.tuples(st.sampled_from(["r0", "r1"]), st.sampled_from("abcd"), st.booleans(), st.integers(0, 50)),
                max_size=60))
def test_with_finishes_told_the_adapters_in_flight_are_exactly_the_unfinished_requests(
        ops: list[tuple[str, str, bool, int]]) -> None:
    """Issue 42 (the routing grid's r2-a50-l0.9-zipf1-m8-tp1): requests end in any order; once the router tells
    each finish, the adapters Route counts in flight on a replica are the unfinished requests', whatever the
    order (each finish takes back its adapter's oldest pick: which of an adapter's requests ended changes no
    count), and a finish naming nothing in flight changes nothing."""
    from lora_cache.routing.limits import RoutingLimits

    limits = RoutingLimits()
    live: dict[str, list[str]] = {"r0": [], "r1": []}  # the truth: adapters of unfinished requests, routed order
    for replica, adapter, route, pick in ops:
        if route or not live[replica]:
            limits.record([(adapter, replica)])
            live[replica].append(adapter)
        else:  # any unfinished request of the replica ends, not the oldest
            done = live[replica].pop(pick % len(live[replica]))
            assert limits.finish([(replica, done)]) == 1
        assert limits.finish([(replica, "z")]) == 0  # nothing of it in flight: no change
        for r, adapters in live.items():
            assert limits.flying(r, len(adapters), []) == Counter(adapters), (r, adapters)
            # with more counted in flight than remembered (a router that lost a finish) no more is invented
            assert limits.flying(r, len(adapters) + 3, []) == Counter(adapters)


def test_a_request_goes_where_its_adapter_still_runs_once_the_newer_request_there_finished() -> None:
    """One lane per replica: r1's request of c was routed first, then r0's a and b; b (the newer) finished. Told,
    Route knows a still runs on r0 and a new request of a joins it there; guessing the oldest pick ended first,
    it took r0 to run b and sent the request to r1, whose lane c holds (it waits there for a whole request)."""
    from lora_cache.routing.limits import RoutingLimits

    def fleet(limits: RoutingLimits) -> list[ReplicaLoad]:
        loads = {"r0": 1.0, "r1": 1.0}
        return [ReplicaLoad(r, Residence.READY, load, limits.flying(r, load, []), max_adapters=1, scarce=True,
                            frees=limits.lane_frees(r, load)) for r, load in loads.items()]

    told, guessed = RoutingLimits(), RoutingLimits()
    for limits in (told, guessed):
        for r in ("r0", "r1"):
            limits.declare(r, max_adapters=1)
        limits.record([("c", "r1"), ("a", "r0"), ("b", "r0")])
    told.finish([("r0", "b")])
    assert told.flying("r0", 1.0, []) == {"a": 1} and guessed.flying("r0", 1.0, []) == {"b": 1}
    assert rank("a", fleet(told), RouterConfig())[0].replica == "r0"
    assert rank("a", fleet(guessed), RouterConfig())[0].replica == "r1"  # the guess: both a lane short, r1 older
