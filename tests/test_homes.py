"""Fleet placement (issue 20 item 3, lora_cache/planner/homes.py): distinct adapters spread over the fleet's
free slots at their homes (the routing advice's own order), copies in proportion to the traffic share."""

from __future__ import annotations

from collections import Counter

import pytest

from lora_cache.errors import ConfigError
from lora_cache.planner import (
    AdapterInfo,
    Hint,
    Plan,
    Planner,
    PlannerConfig,
    QueueEntry,
    ReplicaSpec,
    ResidencyEntry,
    SlotState,
)
from lora_cache.planner.homes import copies
from lora_cache.planner.popularity import Popularity, RankedCounts
from lora_cache.planner.rendezvous import preference
from lora_cache.routing.advice import RouteRequest, advise
from lora_cache.routing.ranking import ReplicaLoad, Residence, RouterConfig, rank
from tests.planner_queries import home_book


def fleet(replicas: int = 4, slots: int = 2, adapters: int = 6, tp: int = 2, **config: object) -> Planner:
    specs = [ReplicaSpec(f"r{r}", tuple(f"r{r}/w{k}" for k in range(tp)), slots) for r in range(replicas)]
    infos = [AdapterInfo(f"a{i}", "v1", 100) for i in range(adapters)]
    config.setdefault("speculate_min_rate", 1e9)  # no speculation: the homes alone
    config.setdefault("home_spread", 1.0)  # a home per replica's worth of traffic (the spread: its own tests)
    planner = Planner(PlannerConfig(**config), 3, infos, specs)  # type: ignore[arg-type]
    planner.advance(-3600.0)  # counts kept for an hour: a count of n reads as n over a half-life's window (1/87 s)
    return planner


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
    names = planner.view.replicas()
    assert sorted(placed) == sorted(f"a{i}" for i in range(adapters))
    assert all(len(where) == 1 for where in placed.values()), placed
    assert max(Counter(r for where in placed.values() for r in where).values()) <= slots
    spilled = 0
    for name, (where,) in ((n, tuple(w)) for n, w in placed.items()):
        order = preference(name, names)
        spilled += where != order[0]
        advice = advise(planner.view, [RouteRequest(name)], RouterConfig())[0]
        assert advice.ranked[0].replica == where and advice.ranked[0].reason is Residence.LOADING
    assert spilled < adapters / 2


def test_a_catalog_larger_than_the_fleet_places_only_adapters_with_traffic() -> None:
    planner = fleet(replicas=2, slots=2, adapters=6)  # 4 slots, 6 adapters: no fill
    assert settle(planner, 0.0) == {}
    planner.record_request("a3", "r0", 1.0, weight=100)  # ~1.2 requests/s fleet-wide each, half the traffic:
    planner.record_request("a5", "r0", 1.0, weight=100)  # one home each, wherever they were counted
    planner.record_request("a1", "r0", 1.0, weight=20)  # 0.23/s: below home_min_rate (0.5), not placed
    placed = settle(planner, 1.0)
    assert placed == {name: {preference(name, planner.view.replicas())[0]} for name in ("a3", "a5")}


def test_a_hot_adapter_gets_homes_in_proportion_to_its_share_of_the_traffic() -> None:
    planner = fleet(replicas=4, slots=3, adapters=13)  # 12 slots, 13 adapters: traffic decides
    planner.record_request("a0", "r0", 1.0, weight=600)  # 60% of the traffic: 3 of 4 replicas (2.3/s each)
    for name in ("a1", "a2", "a3", "a4"):
        planner.record_request(name, "r1", 1.0, weight=100)  # 10% each: one home each
    placed = settle(planner, 1.0)
    order = preference("a0", planner.view.replicas())
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


def test_a_hot_adapter_whose_rate_is_young_gets_the_homes_its_rate_supports_not_none() -> None:
    """All the traffic (share 1: a home on each of 8 replicas) but ~1.2 requests/s so far (young counts
    underestimate a rate): 2 homes of at least home_min_rate (0.5/s) each, not 8 of 0.15/s, and not none
    (on Zipf 1.5 the top adapter got no home for its first 25 s, and an affinity router hot-spotted it)."""
    planner = fleet(replicas=8, slots=2, adapters=20)
    planner.record_request("a0", "r0", 1.0, weight=100)
    placed = settle(planner, 1.0)
    assert placed == {"a0": set(preference("a0", planner.view.replicas())[:2])}


def full_fleet(cold_weight: float, **config: object) -> tuple[Planner, dict[str, set[str]]]:
    """4 replicas x 2 slots, 20 adapters (no fill): each replica's slots hold two cold adapters its own queue
    loaded (a1..a8, each counted there with ``cold_weight``); the queues are then empty."""
    planner = fleet(replicas=4, slots=2, adapters=20, **config)
    names = planner.view.replicas()
    for i, replica in enumerate(names):
        pair = [f"a{2 * i + 1}", f"a{2 * i + 2}"]
        for name in pair:
            planner.record_request(name, replica, 0.5, weight=cold_weight)
        planner.report_queue(replica, [(name, 0.5) for name in pair], 0.5)
    settle(planner, 0.5)
    for replica in names:
        planner.report_queue(replica, [], 0.6)
    assert not any(c.prefetches or c.evicts for c in planner.plan_all(0.6).workers)
    return planner, {r: {f"a{2 * i + 1}", f"a{2 * i + 2}"} for i, r in enumerate(names)}


def changes(plan: Plan) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(replica -> adapters loaded, replica -> adapters evicted), each on every rank of the replica."""
    loaded: dict[str, list[set[str]]] = {}
    evicted: dict[str, list[set[str]]] = {}
    for commands in plan.workers:
        replica = commands.worker.split("/")[0]
        loaded.setdefault(replica, []).append({p.adapter for p in commands.prefetches})
        evicted.setdefault(replica, []).append({e.adapter for e in commands.evicts})
    for per_rank in (*loaded.values(), *evicted.values()):
        assert all(ranks == per_rank[0] for ranks in per_rank), f"ranks of one replica disagree: {per_rank}"
    return ({r: v[0] for r, v in loaded.items() if v[0]}, {r: v[0] for r, v in evicted.items() if v[0]})


def held_at(planner: Planner, replica: str, traffic: dict[str, float], now: float) -> None:
    """a0's requests counted at replicas (``traffic``: replica -> weight), and a0 loaded at ``replica`` by a
    request queued there (a need), as a router would have placed it; the queue is then empty again."""
    for where, weight in traffic.items():
        planner.record_request("a0", where, now, weight=weight)
    planner.report_queue(replica, [("a0", now)], now)
    loaded, _ = changes(planner.plan_all(now))
    assert loaded == {replica: {"a0"}}  # nowhere else yet: no replica holds it, so none was followed
    planner.report_queue(replica, [], now)


@pytest.mark.parametrize("speculate_min_rate", [1e9, 0.5])  # homes alone; with speculation (must not undo them)
@pytest.mark.parametrize(("cold_weight", "copies_"), [(20.0, 3), (90.0, 2)])  # 300 of 460: 3 homes; of 1020: 2
def test_a_hot_adapter_displaces_colder_incumbents_at_its_homes_on_a_full_fleet(
        speculate_min_rate: float, cold_weight: float, copies_: int) -> None:
    """A full fleet (every slot taken by cold adapters) still gets a hot adapter's copies, at the homes the
    advice routes it to, each in place of the least valuable incumbent, once its traffic shows that the
    router sends it where it is resident (all of it went to the replica that holds it). Then the placement
    is stable: later plans, with speculation on, evict nothing. The new copies are worth their home score,
    not the little traffic they saw before a router could send them any: with cold adapters of 90 (above the
    speculation gate) the displaced one would otherwise win its slot back at the next plan."""
    planner, cold = full_fleet(cold_weight=cold_weight, speculate_min_rate=speculate_min_rate)
    order = preference("a0", planner.view.replicas())
    held_at(planner, order[0], {order[0]: 300}, 1.0)  # at its first home, which got all of its requests
    loaded, evicted = changes(planner.plan_all(2.5))  # the homes reassigned (home_refresh_s): copies follow
    homes = set(order[1:copies_])
    assert loaded == {r: {"a0"} for r in homes}
    assert set(evicted) == homes and all(len(v) == 1 and v <= cold[r] for r, v in evicted.items())
    for i in range(1, 6):
        assert changes(planner.plan_all(2.5 + i)) == ({}, {}), f"placement undone at plan {i}"
    planner.check_integrity()


def test_a_router_that_ignores_residency_gets_no_displacing_copies() -> None:
    """The same hot adapter, but its requests were spread over every replica (round-robin): the one that
    holds it got a replica's share, so a copy elsewhere would too, and is not worth an eviction."""
    planner, _ = full_fleet(cold_weight=20.0)
    order = preference("a0", planner.view.replicas())
    held_at(planner, order[0], dict.fromkeys(planner.view.replicas(), 75.0), 1.0)
    assert changes(planner.plan_all(2.5)) == ({}, {})
    planner.check_integrity()


def test_a_home_displaces_only_an_incumbent_worth_clearly_less_by_the_live_count() -> None:
    """a0 held off its home (its one home is another replica) and followed there: at 110 requests it is not
    worth 1.25x an incumbent of its home (100), at 210 it is. The second decision comes between two
    assignments of the homes: a home's count per copy is read live."""
    planner, _ = full_fleet(cold_weight=100.0)  # cold incumbents of ~1.2/s each, 800 counts in all
    order = preference("a0", planner.view.replicas())
    held_at(planner, order[-1], {order[-1]: 110}, 1.0)
    assert changes(planner.plan_all(2.1)) == ({}, {})  # reassigned: one home, followed, not worth it yet
    assignments = home_book(planner).assignments
    planner.record_request("a0", order[-1], 2.2, weight=100)
    loaded, evicted = changes(planner.plan_all(2.2))
    assert loaded == {order[0]: {"a0"}} and list(evicted) == [order[0]]
    assert home_book(planner).assignments == assignments
    planner.check_integrity()


def test_a_copy_its_requests_touched_just_now_lingers_before_a_home_displaces_it() -> None:
    """Regression (tests/test_ray_serve.py's READY-first test, CI 7676240): a router ranked a replica first for an
    adapter it had heard READY there, and the plan that followed the previous request's completion evicted that copy
    for a home before the request arrived. A copy the replica's requests touched (here: a hint given and withdrawn)
    within ``linger_s`` is displaced by no home; after it, the home takes its place as before."""
    planner, cold = full_fleet(cold_weight=100.0)
    order = preference("a0", planner.view.replicas())
    held_at(planner, order[-1], {order[-1]: 110}, 1.0)
    assert changes(planner.plan_all(2.1)) == ({}, {})
    for i, victim in enumerate(sorted(cold[order[0]])):  # what a0's home would displace, touched just now
        planner.add_hint(Hint(f"h-cold-{i}", victim, order[0], 2.15), 2.1)
    for i in range(len(cold[order[0]])):
        planner.cancel_hint(f"h-cold-{i}", 2.15)  # their requests completed
    planner.record_request("a0", order[-1], 2.2, weight=100)  # a0 is worth a home at order[0] now
    assert changes(planner.plan_all(2.2)) == ({}, {}), "a copy touched 0.05 s ago was displaced"
    loaded, evicted = changes(planner.plan_all(2.15 + planner.config.linger_s + 0.01))  # the linger passed
    assert loaded == {order[0]: {"a0"}} and list(evicted) == [order[0]]
    planner.check_integrity()


def test_a_bad_linger_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"linger_s is -1.0; give a finite number of seconds >= 0"):
        PlannerConfig(linger_s=-1.0)


def test_the_homes_are_reassigned_only_when_what_they_rest_on_changes() -> None:
    """An assignment reads every replica and, with the catalog placed, every adapter (45 ms a plan on 1,000
    replicas x 10,000 adapters): it is kept across plans until the fleet's shape changes, an adapter newly
    reaches home_min_rate or wants clearly more homes, or home_refresh_s passes."""
    planner = fleet(replicas=4, slots=2, adapters=6)  # the catalog fits: every adapter placed once
    book = home_book(planner)
    settle(planner, 0.0)
    first = book.assignments
    for i in range(5):  # the same inputs, and requests that change no copies: nothing is reassigned
        planner.record_request("a1", "r0", 0.1 + 0.1 * i, weight=2)  # ~0.1/s: below home_min_rate
        planner.plan_all(0.1 + 0.1 * i)
    assert book.assignments == first
    planner.register_adapter(AdapterInfo("a6", "v1", 100))  # the shape changed: at once, a6 placed
    placed = loads(planner.plan_all(0.6))
    assert list(placed) == ["a6"] and len(placed["a6"]) == 1
    assert book.assignments == first + 1
    planner.record_request("a2", "r0", 0.7, weight=300)  # a2 newly at home_min_rate: at once
    planner.plan_all(0.7)
    assert book.assignments == first + 2
    planner.plan_all(0.8)
    assert book.assignments == first + 2
    planner.plan_all(1.7)  # home_refresh_s (1 s) passed: reassigned as counts drift
    assert book.assignments == first + 3
    planner.check_integrity()


def young_fleet(**config: object) -> Planner:
    """4 replicas x 8 slots, 32 adapters (the fleet's slots hold the catalog), whose counts start now (t=0): the
    real 4-GPU run of issue 31 (Zipf 1.5, 16 requests/s, the top adapter 44% of them, 8 s in all)."""
    specs = [ReplicaSpec(f"r{r}", (f"r{r}/w0",), 8) for r in range(4)]
    infos = [AdapterInfo(f"a{i}", "v1", 100) for i in range(32)]
    planner = Planner(PlannerConfig(speculate_min_rate=1e9, **config), 3, infos, specs)  # type: ignore[arg-type]
    planner.plan_all(0.0)
    arrivals = [(0.1 + i / 7, "a0", "r0") for i in range(35)]  # 7 requests/s of a0 for 5 s, and 9/s of a1..a9
    arrivals += [(0.05 + i / 9, f"a{1 + i % 9}", "r1") for i in range(45)]
    for t, adapter, replica in sorted(arrivals):
        planner.record_request(adapter, replica, t)
    return planner


def homes_of(planner: Planner, adapter: str) -> set[str]:
    book = home_book(planner)
    return {r for r in planner.view.replicas() if any(h.key.name == adapter for h in book.homes(r))}


def test_a_hot_adapters_rate_is_read_over_the_time_its_counts_were_kept() -> None:
    """5 s into a run, a0 has had 7 requests/s: read over a 60 s half-life's limit window (87 s) that is 0.4/s, below
    home_min_rate, and a0 got no copies beyond its one catalog home; on the real run its only copies were where the
    advice had sent its overflow, and requests queued behind prefills on those replicas while another idled
    (issue 31). Read over the 5 s its counts were kept: 7/s, as many homes as its share asks."""
    planner = young_fleet(home_spread=1.0)
    planner.plan_all(5.0)
    share = 35 / 80
    assert len(homes_of(planner, "a0")) == copies(share, 4) == 2
    popularity = planner._popularity  # the estimator itself
    assert popularity.observed_per_second(5.0, 1.0) * popularity.fleet.get("a0") == pytest.approx(7.0, rel=0.1)


def test_a_hot_adapter_gets_spread_homes_so_a_router_can_pick_the_less_loaded_copy() -> None:
    """home_spread 2 (the default): a copy takes at most half a replica's worth of traffic, so a0 (44%) is at home on
    every replica of 4 and the advice picks the least loaded of them; a1..a9 (6% each) still get one home."""
    planner = young_fleet()
    planner.plan_all(5.0)
    assert homes_of(planner, "a0") == set(planner.view.replicas())
    assert all(len(homes_of(planner, f"a{i}")) == 1 for i in range(1, 10))
    assert copies(0.44, 4, 2.0) == 4 and copies(0.06, 4, 2.0) == 1 and copies(0.2, 8, 2.0) == 4


@pytest.mark.parametrize("age", [0.5, 2.0, 30.0, 600.0])
def test_a_steady_rate_reads_as_itself_at_any_age_of_the_counts(age: float) -> None:
    """A steady 5 requests/s counted since t=0 reads as 5/s at any age (per_second, the limit, reads it as less until
    the counts are a few half-lives old); under min_window_s the count is taken over that window."""
    popularity = Popularity(half_life_s=60.0, max_tracked_per_replica=16)
    popularity.advance(0.0)
    n = int(age * 5)
    for i in range(n):
        popularity.observe("a", "r0", (i + 0.5) / 5)
    rate = popularity.fleet.get("a") * popularity.observed_per_second(age, 1.0)  # scaled count -> per second
    assert rate == pytest.approx(n / max(age, 1.0) if age < 1.0 else 5.0, rel=0.05)
    if age >= 600.0:
        assert popularity.observed_per_second(age, 1.0) == pytest.approx(popularity.per_second(age), rel=0.01)


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


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_bad_home_refresh_is_refused_with_the_fix(value: float) -> None:
    from lora_cache.planner.errors import ConfigError
    with pytest.raises(ConfigError, match=r"home_refresh_s is .*give seconds >= 0, e.g. 1.0"):
        PlannerConfig(home_refresh_s=value)


def _thrash_free(planner: Planner, first: Plan, now: float) -> None:
    """A second plan at the same time never evicts what the first prefetched."""
    second = planner.plan_all(now)
    for commands in second.workers:
        earlier = first.for_worker(commands.worker)
        loaded = {(p.adapter, p.version) for p in earlier.prefetches} if earlier else set()
        assert not loaded & {(e.adapter, e.version) for e in commands.evicts}, (
            f"{commands.worker} evicts {loaded} right after prefetching it: {second}")


def _state_machine_config(**overrides: float) -> PlannerConfig:
    base = dict(policy="global", half_life_s=10.0, hint_ttl_s=8.0, hysteresis=0.0, max_prefetches_per_plan=1,
                max_staged_per_replica=0, hint_horizon_s=0.0, stage_host_share=0.0)
    return PlannerConfig(**(base | overrides))  # type: ignore[arg-type]


def test_a_home_takes_a_speculative_loads_place_instead_of_evicting_it_in_the_next_plan() -> None:
    """Regression (the official CI's state machine, 2026-11-27): speculation gave a new worker's one slot to a
    locally popular adapter; the next plan weighed it as an incumbent and evicted it for a hot adapter's home."""
    infos = [AdapterInfo(f"a{i}", "v1", 200 if i == 4 else 100) for i in range(7)]
    specs = [ReplicaSpec(r, (f"{r}/w0",), s) for r, s in zip(["r0", "r1", "r2"], [0, 1, 0], strict=True)]
    planner = Planner(_state_machine_config(local_weight=0.5, speculate_min_rate=0.0), 3, infos, specs)
    planner.record_request("a0", "r1", 0.0)
    planner.plan(0.0)
    planner.remove_worker("r0/w0")
    planner.record_request("a4", "r0", 0.0)
    planner.add_worker("r0", "r0/n1", 1)
    first = planner.plan(0.0)
    assert [p.adapter for c in first.workers for p in c.prefetches] == ["a0"], first
    _thrash_free(planner, first, 0.0)


def test_a_hot_home_takes_a_colder_homes_place_instead_of_evicting_it_in_the_next_plan() -> None:
    """Regression (state-machine exploration, 2026-11-27): a home without counts per copy filled the free room
    first; the next plan evicted it for a home with traffic of its own that had found the room taken."""
    infos = [AdapterInfo(f"a{i}", "v1", 200 if i == 3 else 100) for i in range(7)]
    specs = [ReplicaSpec(r, tuple(f"{r}/w{k}" for k in range(tp)), 0)
             for r, tp in zip(["r0", "r1", "r2"], [1, 3, 1], strict=True)]
    planner = Planner(_state_machine_config(local_weight=0.0, speculate_min_rate=1.0), 3, infos, specs)
    arrivals = iter(range(1, 100))

    def queue(replica: str, adapters: list[str]) -> None:
        old = list(planner.view.queue(replica))
        planner.report_queue(replica, old + [QueueEntry(a, float(next(arrivals))) for a in adapters], 0.0)

    queue("r0", ["a1", "a3", "a3"])
    planner.plan_all(0.0)
    planner.add_hint(Hint("h0", "a0", "r1", 0.0), 0.0)
    planner.remove_worker("r2/w0")
    planner.report_residency("r1/w0", [ResidencyEntry("a0", "v1", SlotState.READY)])
    queue("r2", ["a1"])
    queue("r0", ["a3"])
    planner.add_hint(Hint("h1", "a0", "r1", 0.0), 0.0)
    planner.add_worker("r2", "r2/n2", 2)
    planner.advance(0.0)
    first = planner.plan_all(0.0)
    assert [p.adapter for c in first.workers if c.worker == "r2/n2" for p in c.prefetches] == ["a1", "a0"], first
    _thrash_free(planner, first, 0.0)


def test_while_the_fleet_holds_the_catalog_copies_never_take_a_requested_adapters_last_copy() -> None:
    """Regression (tests/test_ray_serve.py, 1 run in 3-4): 3 replicas x 3 slots hold the 9 adapters, and a0..a2,
    each followed to the replica that got most of its requests, want 2 homes. Their extra copies were placed before
    the other adapters' first homes and displaced the only copies of a5 and a6, requested too: the fleet ended with
    every slot held by a0..a2, and an adapter loaded for a request was evicted after it, so the next one loaded it
    again. Now every requested adapter keeps a place; a request for a3 displaces one adapter (a need), and a3
    stays once its hint is withdrawn."""
    infos = [AdapterInfo(f"a{i}", "v1", 100) for i in range(9)]
    specs = [ReplicaSpec(f"r{r}", (f"r{r}/w0",), 3) for r in range(3)]
    planner = Planner(PlannerConfig(), 3, infos, specs)
    planner.advance(-3600.0)
    held = {"r0": ["a0", "a1", "a4"], "r1": ["a0", "a2", "a5"], "r2": ["a1", "a2", "a6"]}

    def report(replica: str, adapters: list[str]) -> None:
        planner.report_residency(f"{replica}/w0", [ResidencyEntry(a, "v1", SlotState.READY, 0) for a in adapters])

    def where() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for r in planner.view.replicas():
            for key in planner.view.residency(f"{r}/w0"):
                out.setdefault(key.name, set()).add(r)
        return out

    for replica, adapters in held.items():
        report(replica, adapters)
    for name, (most, rest) in {"a0": ("r0", "r1"), "a1": ("r0", "r2"), "a2": ("r1", "r2")}.items():
        planner.record_request(name, most, 0.0, weight=100)
        planner.record_request(name, rest, 0.0, weight=20)
    for name, replica in {"a3": "r0", "a4": "r0", "a5": "r1", "a6": "r2", "a7": "r0"}.items():
        planner.record_request(name, replica, 0.0, weight=20)
    for i in range(3):
        planner.plan_all(i * 0.1)
        placed = where()
        assert {"a4", "a5", "a6"} <= placed.keys(), f"a requested adapter's last copy went for copies: {placed}"
    planner.add_hint(Hint("h3", "a3", "r1", 1.0), 1.0)  # the router's cold pick for a3
    planner.plan(1.0)
    report("r1", sorted(k.name for k in planner.view.residency("r1/w0")))  # loaded: READY
    planner.cancel_hint("h3", 1.05)  # its request completed
    for i in range(3):
        planner.plan_all(1.05 + i)
        assert "a3" in where(), f"a3, loaded for its request, was evicted after it: {where()}"
    planner.check_integrity()
