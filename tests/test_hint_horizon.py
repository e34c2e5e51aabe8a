"""The hint horizon (issue 19, item 4): hints far ahead only fill free room, never evict, and turn into
ordinary hints as time brings them within the horizon (CPU, no Ray)."""

from __future__ import annotations

import pytest

from lora_cache.errors import ConfigError
from lora_cache.planner import Hint, Planner, PlannerConfig
from lora_cache.vocab import AdapterKey
from tests.planner_queries import dirty_replicas, needed_adapters
from tests.test_planner import evicted, hold, make, popular, prefetched, queue, staged


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "2"])
def test_hint_horizon_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match=f"hint_horizon_s is {value!r}; give a finite number of seconds >= 0"):
        PlannerConfig(hint_horizon_s=value)  # type: ignore[arg-type]


def test_issue_19_two_far_hints_do_not_keep_a_queued_adapter_from_a_slot() -> None:
    """The reproduction: two hints 3,000 s ahead took both slots of a worker, and a queued adapter then
    got no slot (only a stage). Far hints may use free room, but a waiting request displaces them."""
    planner = make(slots=2, tp=1)
    planner.add_hint(Hint("far-1", "a0", "r0", 3001.0), 1.0)
    planner.add_hint(Hint("far-2", "a1", "r0", 3001.0), 1.0)
    assert prefetched(planner.plan(1.0), "r0/w0") == ["a0", "a1"]  # the room was free: they may use it
    hold(planner, "r0", "a0", "a1")
    queue(planner, "r0", "a2", now=2.0)
    plan = planner.plan(2.0)
    assert prefetched(plan, "r0/w0") == ["a2"] and staged(plan, "r0/w0") == []
    assert len(evicted(plan, "r0/w0")) == 1
    assert needed_adapters(planner, "r0") == ("a2",)
    planner.check_integrity()


def test_a_far_hint_never_evicts_and_is_staged_instead() -> None:
    planner = make(slots=2, max_prefetches_per_plan=0)
    hold(planner, "r0", "a0", "a1")  # incumbents with no popularity at all
    planner.add_hint(Hint("far", "a2", "r0", 100.0), 1.0)
    plan = planner.plan(1.0)
    for worker in planner.view.workers("r0"):
        assert evicted(plan, worker) == [] and prefetched(plan, worker) == []
        assert staged(plan, worker) == ["a2"]
    planner.check_integrity()


def test_far_hints_rank_after_queued_and_near_ones() -> None:
    planner = make(slots=5)
    popular(planner, "r0", {"a7": 80})
    planner.add_hint(Hint("far", "a3", "r0", 60.0), 1.0)
    planner.add_hint(Hint("near", "a4", "r0", 2.5), 1.0)
    queue(planner, "r0", "a1")
    plan = planner.plan(1.0)
    assert prefetched(plan, "r0/w0") == ["a1", "a4", "a7", "a3"]  # a3 counts as one request: below a7
    assert needed_adapters(planner, "r0") == ("a1", "a4")


def test_a_resident_far_hinted_adapter_is_not_displaced_by_speculation() -> None:
    """Speculation could evict it for a more popular adapter, but the far hint would load it back once
    room frees: kept until a need (queued or near) displaces it."""
    planner = make(slots=1, tp=1, hysteresis=0.0)
    planner.add_hint(Hint("far", "a3", "r0", 60.0), 1.0)
    hold(planner, "r0", "a3")
    popular(planner, "r0", {"a7": 80})
    assert planner.plan_all(1.0).is_empty
    queue(planner, "r0", "a5", now=1.5)
    assert evicted(planner.plan(1.5), "r0/w0") == ["a3"]


def test_a_far_hint_becomes_a_need_when_time_brings_it_within_the_horizon() -> None:
    """No new input arrives: the planner marks the replica dirty when the hint crosses the horizon, so
    the next incremental plan (the controller's tick) gives it the slot an idle incumbent holds."""
    planner = make(slots=1, tp=1, max_prefetches_per_plan=0, hint_horizon_s=2.0)
    hold(planner, "r0", "a0")
    planner.add_hint(Hint("h", "a1", "r0", 10.0), 1.0)
    assert evicted(planner.plan(1.0), "r0/w0") == []
    planner.advance(7.9)
    assert dirty_replicas(planner) == ()  # still 2.1 s ahead: far
    assert planner.plan(7.9).is_empty
    planner.advance(8.0)
    assert dirty_replicas(planner) == ("r0",)
    plan = planner.plan(8.0)
    assert evicted(plan, "r0/w0") == ["a0"] and prefetched(plan, "r0/w0") == ["a1"]
    assert planner.view.residency("r0/w0").keys() == {AdapterKey("a1", "v1")}
    planner.check_integrity()


def test_horizon_entries_of_withdrawn_far_hints_stay_bounded() -> None:
    planner: Planner = make(slots=1)
    for i in range(2000):
        planner.add_hint(Hint(f"h{i}", "a1", "r0", 1000.0), 1.0)
        planner.cancel_hint(f"h{i}", 1.0)
    planner.check_integrity()  # asserts at most 2 * active + 64 pending horizon entries


def test_a_far_hint_does_not_demote_its_adapters_home_and_so_spare_an_incumbent() -> None:
    """State machine, --hypothesis-seed=14, shrunk. a0 and a2 each have one request (hints, counted when seen), so
    both are homed on r1 (a0 first, on both replicas, as a free-room home: no replica holds it, so its routing is
    unseen; a2, whose request went to r0 that holds it, with a count per copy: it may displace); r1 holds a1 (no
    requests) and has one free slot; a0's one request is below the speculation rate gate. Without the far hint
    for a0, a0's home claims the free slot and a2's home displaces a1. With it, a0 took the slot as a far hint's
    free-room load before the homes were placed, a0's home was skipped (already held) and a2's home displaced
    that far load first: a1 was spared, and a0 not even loaded. Far hints now take the room the homes leave, so
    the hint changes no eviction."""
    def fleet(far_hint: bool) -> Planner:
        planner = make(replicas=2, tp=1, slots=2, adapters=4, hint_horizon_s=0.0, speculate_min_rate=0.5)
        planner.set_capacity("r0/w0", 1)
        hold(planner, "r0", "a2")
        planner.add_hint(Hint("h0", "a2", "r0", 0.0), 0.0)  # near: due now
        hold(planner, "r1", "a1")
        planner.add_hint(Hint("h2", "a0", "r1", 4.5), 0.0)  # far: beyond a horizon of 0 s
        if not far_hint:
            planner.cancel_hint("h2", 0.0)  # its request is still counted (the hint was seen)
        return planner

    with_hint, without = (fleet(far).plan_all(0.0) for far in (True, False))
    assert evicted(without, "r1/w0") == ["a1"] and prefetched(without, "r1/w0") == ["a0", "a2"]
    assert evicted(with_hint, "r1/w0") == evicted(without, "r1/w0")
    assert prefetched(with_hint, "r1/w0") == ["a0", "a2"]  # a0 loads as the home it is, not as a far hint
