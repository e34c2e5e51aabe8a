"""Issue 31: the replica where a hot adapter is READY does not take a multiple of its share at light load.

``min_bound`` (8) lets a replica take eight requests before the load bound applies. On the routing grid's light-load
fleets whose lanes are not scarce, the one replica where a hot adapter was READY took 3-7 in flight while the others
held 1-2; its requests then arrived during each other's prefill steps and waited for them, and they made the p99
(r8-a500-l0.3-zipf1.5-m8-tp4: 27 arrivals within 35 ms of the previous one at the same replica under Route, 18 under
least-loaded; bench/RESULTS.md, 2026-11-26, issue 31 fifth round). ``RouterConfig.weigh_over``: where lanes are not
scarce, a resident replica above the fleet's proportional bound ((1 + epsilon) x the mean, without ``min_bound``)
ranks after the soonest cold replicas when its expected wait exceeds theirs plus a load (``weigh_cold`` for it alone).
Off by default (it costs 1-3% of the mean on light-load fleets of one-rank replicas; bench/RESULTS.md).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lora_cache.routing.ranking import ReplicaLoad, Residence, RouterConfig, bound, rank


def _fleet(loads: list[int], ready: int = 0, scarce: bool = False) -> list[ReplicaLoad]:
    return [
        ReplicaLoad(
            f"replica-{i}",
            Residence.READY if i == ready else Residence.COLD,
            float(load),
            max_adapters=4 if scarce else 0,
            scarce=scarce,
        )
        for i, load in enumerate(loads)
    ]


ON = RouterConfig(weigh_over=True)


def _first(fleet: list[ReplicaLoad], config: RouterConfig = ON) -> str:
    return rank("adapter-x", fleet, config)[0].replica


def test_a_hot_ready_replica_over_its_share_yields_to_a_cold_one_at_light_load() -> None:
    light = _fleet([5, 1, 1, 1])  # mean 2: its share is 3, it holds 5 (min_bound 8 would let it take 8)
    assert _first(light) != "replica-0", "the READY replica took a multiple of its share"
    assert _first(light, RouterConfig()) == "replica-0"  # off by default: as before
    assert _first(_fleet([3, 1, 1, 1])) == "replica-0"  # within its share: it stays where it is READY


def test_at_heavy_load_and_where_lanes_are_scarce_residency_decides_as_before() -> None:
    heavy = _fleet([12, 9])  # within (1 + epsilon) x the mean: stickiness
    assert _first(heavy) == "replica-0"
    scarce = _fleet([5, 1, 1, 1], scarce=True)
    assert _first(scarce) == _first(scarce, RouterConfig(weigh_over=False))


@given(st.lists(st.integers(0, 8), min_size=2, max_size=8))
def test_a_ready_replica_ranks_first_only_within_its_share_or_its_wait(loads: list[int]) -> None:
    config = ON
    fleet = _fleet(loads)
    share = bound([float(x) for x in loads], config.epsilon)
    colds = [x for x in loads[1:] if x + 1 <= bound([float(x) for x in loads], config.epsilon, floor=config.min_bound)]
    if _first(fleet) == "replica-0" and colds:
        wait, cold_wait = loads[0] * config.request_s, min(colds) * config.request_s + config.cold_s
        assert loads[0] + 1 <= share or wait <= cold_wait


# ``RouterConfig.weigh_arrivals`` (issue 31, sixth round; off by default, bench/RESULTS.md): where lanes are not scarce
# and a replica has a lane free for every request in flight, it ranks by the request's expected start there: the later
# of its adapter's READY past the lead and the prefills of the requests arriving there first. On
# r8-a500-l0.3-zipf1.5-m8-tp4 the tail was requests sent to a replica where one or two others were about to arrive.

ARRIVALS = RouterConfig(weigh_arrivals=True)


def _arriving(ready_arriving: int, cold_ready_s: float, load: float = 1.0, scarce: bool = False) -> list[ReplicaLoad]:
    lanes = 4 if scarce else 8
    return [
        ReplicaLoad(
            "replica-0",
            Residence.READY,
            load + 1,
            max_adapters=lanes,
            scarce=scarce,
            ready_s=0.0,
            arriving=ready_arriving,
        ),
        ReplicaLoad("replica-1", Residence.COLD, load, max_adapters=lanes, scarce=scarce, ready_s=cold_ready_s),
    ]


def _pick(fleet: list[ReplicaLoad], config: RouterConfig) -> str:
    return rank("adapter-x", fleet, config, lead_s=0.05)[0].replica


def test_a_ready_replica_with_requests_about_to_arrive_yields_to_a_cold_one_whose_load_fits_the_lead() -> None:
    fleet = _arriving(ready_arriving=2, cold_ready_s=0.04)  # the cold load lands before the request arrives
    assert _pick(fleet, ARRIVALS) == "replica-1", "the request waits behind two prefills where it is READY"
    assert _pick(fleet, RouterConfig()) == "replica-0"  # off by default: residency decides
    assert _pick(_arriving(ready_arriving=0, cold_ready_s=0.04), ARRIVALS) == "replica-0"  # nothing ahead of it


def test_residency_decides_where_the_load_is_slower_than_the_prefills_ahead_or_lanes_are_taken() -> None:
    assert _pick(_arriving(ready_arriving=1, cold_ready_s=0.2), ARRIVALS) == "replica-0"  # 150 ms load vs 30 ms
    assert _pick(_arriving(ready_arriving=2, cold_ready_s=0.04, load=8.0), ARRIVALS) == "replica-0"  # lanes taken
    scarce = _arriving(ready_arriving=2, cold_ready_s=0.04, scarce=True)
    assert _pick(scarce, ARRIVALS) == _pick(scarce, RouterConfig())
