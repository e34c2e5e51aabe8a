"""Issue 31: an idle replica where the adapter will be READY by the request's arrival ranks first; where none is
idle (heavy load) the READY replica keeps the adapter. Load times and the lead are what the controller measured
(``lora_cache.routing.clock``), on the real controller path (``ControllerCore.route``) and in the plain ranking.

Before ``RouterConfig.idle_ready``, Route sent a light-load request to a busy replica where its adapter was READY
while an idle replica would have loaded it before the request arrived
(``test_route_prefers_an_idle_replica_that_loads_the_adapter_in_time`` failed: replica-0 first)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.errors import ConfigError
from lora_cache.routing.advice import RouteRequest
from lora_cache.routing.clock import LoadClock
from lora_cache.routing.ranking import ReplicaLoad, Residence, RouterConfig, rank
from lora_cache.vocab import Prefetch, WorkerId


def test_the_clock_fits_a_fixed_cost_and_a_cost_per_byte_per_kind() -> None:
    clock = LoadClock(cold_s=0.1, staged_s=0.01)
    assert clock.load_s(1e6, staged=False) == 0.1 and clock.load_s(1e6, staged=True) == 0.01  # priors
    assert clock.lead_s == 0.0
    for i, nbytes in enumerate([1e6, 4e6] * 5):  # 10 ms fixed + 5 ms per MB, from storage
        clock.sent("r/0", f"a{i}", "v", nbytes, False, 1.0)
        clock.ready("r/0", f"a{i}", "v", 1.0 + 0.010 + 0.005 * nbytes / 1e6)
    assert clock.load_s(2e6, staged=False) == pytest.approx(0.020)
    assert clock.load_s(2e6, staged=False, spread=True) == pytest.approx(0.020)  # on the line: no spread
    assert clock.load_s(1e6, staged=True) == 0.01  # the host tier's kind has no sample: its prior
    clock.sent("r/0", "b", "v", 1e6, True, 2.0)
    clock.ready("r/0", "b", "v", 2.002)
    assert clock.load_s(3e6, staged=True) == pytest.approx(0.006)  # one size: proportional
    clock.sent("r/0", "c", "v", 1e6, False, 3.0)
    clock.dropped("r/0", "c", "v")  # failed or gone: no sample
    clock.ready("r/0", "c", "v", 9.0)
    assert clock.load_s(2e6, staged=False) == pytest.approx(0.020)
    mixed = LoadClock()
    for i, dt in enumerate([0.005, 0.055] * 10):  # one size: host-tier hits and reads alike, 30 ms on average
        mixed.sent("r/0", f"a{i}", "v", 1e6, False, 0.0)
        mixed.ready("r/0", f"a{i}", "v", dt)
    assert mixed.load_s(1e6, staged=False) == pytest.approx(0.030, rel=0.02)
    assert mixed.load_s(1e6, staged=False, spread=True) == pytest.approx(0.055, rel=0.02)  # most likely done by then
    for dt in (0.05, 0.05, 0.05):
        clock.lead(dt)
    assert clock.lead_s == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="cold_s"):
        LoadClock(cold_s=-1.0)


replicas = st.lists(
    st.tuples(
        st.sampled_from(list(Residence)),
        st.sampled_from([0, 0, 1, 2, 5, 12]),
        st.sampled_from([0.0, 0.01, 0.03, 0.1, 0.3]),
    ),
    min_size=1,
    max_size=8,
)
leads = st.sampled_from([0.0, 0.02, 0.05, 0.2])


def _fleet(rows: list[tuple[Residence, int, float]]) -> list[ReplicaLoad]:
    return [
        ReplicaLoad(f"replica-{i}", res, float(load), ready_s=0.0 if res is Residence.READY else ready)
        for i, (res, load, ready) in enumerate(rows)
    ]


def test_a_load_queued_behind_others_on_its_worker_is_no_sample_of_a_load() -> None:
    """Issue 31: a fleet's first placement sends each worker 8 prefetches at once; the last is READY after the worker's
    queue of loads, not one load's time. Counted as samples, 8 ms loads read as 0.36 s (fit plus spread) for the whole
    run, and no cold adapter was ever ready by a 50 ms lead (idle_ready never fired; bench/RESULTS.md 2026-11-26)."""
    clock = LoadClock(cold_s=0.1, staged_s=0.01)
    for k in range(8):  # a burst to one worker: each waits for those before it
        clock.sent("r/0", f"a{k}", "v", 1e6, False, 0.0)
    clock.sent("s/0", "b", "v", 1e6, False, 0.0)  # another worker's load is no queue of r/0's
    for k in range(8):
        clock.ready("r/0", f"a{k}", "v", 0.010 * (k + 1))
    clock.ready("s/0", "b", "v", 0.012)
    assert clock.samples(staged=False) == pytest.approx(1.0 + 0.97)  # the first of the burst and s/0's, no more
    assert clock.load_s(1e6, staged=False, spread=True) < 0.013  # the 10 and 12 ms loads, not their queue
    clock.sent("r/0", "c", "v", 1e6, False, 1.0)  # r/0's queue is empty again: a sample
    clock.ready("r/0", "c", "v", 1.010)
    assert clock.samples(staged=False) == pytest.approx((1.0 + 0.97) * 0.97 + 1.0)
    clock.sent("r/0", "d", "v", 1e6, False, 2.0)
    clock.sent("r/0", "e", "v", 1e6, False, 2.0)
    clock.dropped("r/0", "d", "v")  # a failed load leaves the queue: e was sent behind it all the same
    clock.ready("r/0", "e", "v", 2.5)
    assert clock.load_s(1e6, staged=False, spread=True) < 0.013  # the 10 and 12 ms loads, not their queue



@given(replicas, leads)
def test_an_idle_replica_ready_by_arrival_ranks_first(rows: list[tuple[Residence, int, float]], lead: float) -> None:
    fleet = _fleet(rows)
    ranked = rank("a", fleet, RouterConfig(), lead_s=lead)
    by_name = {r.replica: r for r in fleet}
    on_time = [
        r for r in ranked if r.within_bound and by_name[r.replica].load == 0 and by_name[r.replica].ready_s <= lead
    ]
    if on_time:
        assert ranked[0] in on_time


@given(replicas, leads)
def test_where_no_replica_is_idle_load_times_and_lead_change_nothing(
    rows: list[tuple[Residence, int, float]], lead: float
) -> None:
    fleet = [r._replace(load=r.load + 1) for r in _fleet(rows)]  # heavy: every replica busy
    unknown = [r._replace(ready_s=float("inf")) for r in fleet]
    assert rank("a", fleet, RouterConfig(), lead_s=lead) == rank("a", unknown, RouterConfig(), lead_s=0.0)


def _core(tiny_adapters: Any, adapters: int = 3) -> tuple[ControllerCore, list[str]]:
    paths: list[Path] = tiny_adapters(adapters)
    core = ControllerCore(
        ControllerConfig(CatalogConfig(adapter_roots=(str(paths[0].parent),), model="tiny", max_rank=16)), epoch=1
    )
    names = [p.name for p in paths]
    for p in paths:
        core.register_adapter(p.name, str(p))
    for r in range(2):
        core.add_replica(f"replica-{r}", 1, 4)
    version = core.planner.view.adapter(names[0]).version
    core.worker_report(WorkerId("replica-0", 0), [(names[0], version, "ready", "", 0.0, True)], 0.5)  # acquired
    return core, names


def _measure(core: ControllerCore, adapter: str, load_s: float, lead_s: float, now: float = 1.0) -> None:
    """A hinted request of ``adapter`` on replica-1 (lead ``lead_s``): the plan's prefetches there (``adapter`` and
    any the planner adds), each READY ``load_s`` later."""
    (outcome,) = core.hint_batches([[("h-" + adapter, adapter, "replica-1", lead_s)]], now)
    assert outcome.accepted == 1
    plan = core.plan(now)
    sent = [c for c in plan.get(WorkerId("replica-1", 0), []) if isinstance(c, Prefetch)]
    assert adapter in [c.adapter for c in sent]
    core.worker_report(WorkerId("replica-1", 0), [(c.adapter, c.version, "ready", "") for c in sent], now + load_s)
    core.cancel_hint("h-" + adapter, now + load_s)


def test_route_prefers_an_idle_replica_that_loads_the_adapter_in_time(tiny_adapters: Any) -> None:
    core, names = _core(tiny_adapters, adapters=5)
    _measure(core, names[1], load_s=0.01, lead_s=0.05)  # loads take 10 ms; requests come 50 ms after routing
    assert core.clock.lead_s == pytest.approx(0.05)
    (light,) = core.route([RouteRequest(names[0])], {"replica-0": 2.0, "replica-1": 0.0})
    assert [(r.replica, r.reason) for r in light.ranked] == [
        ("replica-1", Residence.COLD),  # idle, READY by arrival
        ("replica-0", Residence.READY),
    ]
    (heavy,) = core.route([RouteRequest(names[0])], {"replica-0": 3.0, "replica-1": 1.0})
    assert heavy.ranked[0].replica == "replica-0"  # none idle: it stays where it is READY


def test_route_keeps_the_ready_replica_when_the_load_would_not_finish_in_time(tiny_adapters: Any) -> None:
    core, names = _core(tiny_adapters)
    _measure(core, names[1], load_s=0.2, lead_s=0.05)  # loads take 200 ms: longer than the lead
    (light,) = core.route([RouteRequest(names[0])], {"replica-0": 2.0, "replica-1": 0.0})
    assert light.ranked[0].replica == "replica-0"
    fresh, names = _core(tiny_adapters)  # nothing measured, no hint: no lead, the prior (0.1 s) for a load
    (light,) = fresh.route([RouteRequest(names[0])], {"replica-0": 2.0, "replica-1": 0.0})
    assert light.ranked[0].replica == "replica-0"


def _scarce(ready_late_s: float, lead: float, idle: int = 2, runs_here: bool = False) -> list[ReplicaLoad]:
    """Four replicas of 4 adapter lanes, scarcer than their slots: the adapter READY on a busy replica-0, and
    ``idle`` idle replicas where it would be READY ``ready_late_s`` after the request's arrival."""
    flying = {"a": 1, "b": 1} if runs_here else {"b": 1, "c": 1}
    fleet = [ReplicaLoad("replica-0", Residence.READY, 2.0, flying, 4, scarce=True, ready_s=0.0)]
    for i in range(1, 4):
        busy = i > idle
        fleet.append(ReplicaLoad(f"replica-{i}", Residence.COLD, 1.0 if busy else 0.0, {"d": 1} if busy else {}, 4,
                                 scarce=True, ready_s=lead + ready_late_s))
    return fleet


def test_where_lanes_are_scarce_an_idle_replica_ready_within_a_prefill_of_arrival_ranks_first_while_idle_ones_abound(
) -> None:
    """Issue 42: on light-load fleets of 4 lanes at TP 4 (r8-a50-l0.3-uniform-m4-tp4: p99 1.185x least-loaded's,
    median of seeds 0-2) Route sent a request where its adapter was READY behind one to three others while an idle
    replica would have loaded it within a few ms of its arrival. Where lanes are scarce the idle-replica rule stays
    off while the fleet's idle replicas are few (an idle replica's lanes are what the requests no busy replica can
    start need), and a join still ranks first (it takes no lane); with ``idle_joins`` (off) the idle replica ranks
    before the join while the idle lanes could take every adapter in flight."""
    lead, config = 0.05, RouterConfig()
    assert config.idle_share == 0.25 and config.idle_late_s == 0.03
    first = rank("a", _scarce(0.02, lead), config, lead_s=lead)[0]
    assert first.replica in ("replica-1", "replica-2") and first.reason is Residence.COLD
    assert rank("a", _scarce(0.05, lead), config, lead_s=lead)[0].replica == "replica-0"  # READY too late there
    assert rank("a", _scarce(0.02, lead, idle=1), config, lead_s=lead)[0].replica == "replica-0"  # one idle: few
    assert config.idle_joins == math.inf  # off: a join first
    assert rank("a", _scarce(0.02, lead, runs_here=True), config, lead_s=lead)[0].replica == "replica-0"
    # idle_joins: before the join while the two idle replicas' 8 lanes take idle_joins x the 3 adapters in flight
    for factor, first_reason in ((1.0, Residence.COLD), (2.5, Residence.COLD), (3.0, Residence.READY)):
        ranked = rank("a", _scarce(0.02, lead, runs_here=True), RouterConfig(idle_joins=factor), lead_s=lead)
        assert ranked[0].reason is first_reason, factor
    one_idle = rank("a", _scarce(0.02, lead, idle=1, runs_here=True), RouterConfig(idle_joins=1.0), lead_s=lead)
    assert one_idle[0].replica == "replica-0"  # one idle replica: no idle_share rule at all
    off = RouterConfig(idle_share=float("inf"))
    assert rank("a", _scarce(0.02, lead), off, lead_s=lead)[0].replica == "replica-0"
    plenty = [r._replace(scarce=False) for r in _scarce(0.02, lead)]  # lanes not scarce: idle_ready as before
    assert rank("a", plenty, config, lead_s=lead)[0].replica == "replica-0"
    for bad in ({"idle_joins": -1.0}, {"idle_joins": math.nan}, {"idle_share": -0.1}, {"idle_share": float("nan")},
                {"idle_late_s": -1.0}, {"idle_late_s": float("inf")}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RouterConfig(**bad)  # type: ignore[arg-type]


@given(replicas, leads)
def test_where_lanes_are_scarce_and_few_replicas_are_idle_the_idle_share_rule_changes_nothing(
    rows: list[tuple[Residence, int, float]], lead: float
) -> None:
    fleet = [r._replace(max_adapters=4, scarce=True) for r in _fleet(rows)]
    config = RouterConfig()
    idle = sum(1 for r in fleet if r.load <= 0)
    ranked = rank("a", fleet, config, lead_s=lead)
    late = lead + config.idle_late_s
    if idle < max(2, config.idle_share * len(fleet)):
        assert ranked == rank("a", fleet, RouterConfig(idle_share=float("inf")), lead_s=lead)
    elif any(r.load <= 0 and r.ready_s <= late for r in fleet):  # idle ones abound (no joins here): one READY
        first = next(r for r in fleet if r.replica == ranked[0].replica)  # within a prefill of arrival first
        assert first.load <= 0 and first.ready_s <= late


@given(replicas, leads, st.sampled_from([1, 2, 4]))
def test_idle_replicas_rank_before_joins_only_while_their_lanes_could_take_every_adapter_in_flight(
    rows: list[tuple[Residence, int, float]], lead: float, lanes: int
) -> None:
    """``idle_joins`` at 1: with fewer idle lanes than distinct adapters in flight, the ranking is the default one
    (idle replicas after joins); with as many, an idle replica READY within a prefill of arrival ranks first, joins
    or not."""
    fleet = [r._replace(max_adapters=lanes, scarce=True, flying={"a" if i % 2 else f"x{i % 3}": int(r.load)}
                        if r.load > 0 else {}) for i, r in enumerate(_fleet(rows))]
    config = RouterConfig(idle_joins=1.0)
    ranked = rank("a", fleet, config, lead_s=lead)
    idle_lanes = sum(r.max_adapters for r in fleet if r.load <= 0)
    in_flight = len({a for r in fleet for a in r.flying})
    spare = sum(1 for r in fleet if r.load <= 0) >= max(2, config.idle_share * len(fleet))
    late = lead + config.idle_late_s
    if idle_lanes < in_flight:
        assert ranked == rank("a", fleet, RouterConfig(), lead_s=lead)
    elif spare and any(r.load <= 0 and r.ready_s <= late for r in fleet):
        first = next(r for r in fleet if r.replica == ranked[0].replica)
        assert first.load <= 0 and first.ready_s <= late
