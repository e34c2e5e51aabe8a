"""Unit tests of the fleet planner's rules (CPU, no Ray): one rule per test, invariants checked after each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_cache.errors import ConfigError
from lora_cache.planner import (
    POLICIES,
    AdapterInfo,
    Hint,
    Plan,
    Planner,
    PlannerConfig,
    PlannerInputError,
    QueueEntry,
    ReplicaSpec,
    ResidencyEntry,
    SlotState,
    UnknownAdapterError,
    UnknownReplicaError,
    UnknownWorkerError,
)
from lora_cache.vocab import AdapterKey, Evict, Prefetch
from tests.planner_queries import dirty_replicas, popularity, ready_replicas

ROOT = Path(__file__).resolve().parents[1]
READY, IN_USE, LOADING = SlotState.READY, SlotState.IN_USE, SlotState.LOADING


# -- helpers ----------------------------------------------------------------------------------------
def make(policy: str = "global", replicas: int = 1, tp: int = 2, slots: int = 2, adapters: int = 8,
         bytes_per_rank: int = 100, bytes_per_worker: int | None = None, epoch: int = 7,
         host_bytes: int | None = None, start: float = 0.0, **config: object) -> Planner:
    """r0..rN, each with workers rK/w0..; adapters a0..aM at version v1, first planned at ``start``. Speculation's
    rules are tested without its rate gate (the small counts here stand for well under 0.5 requests per second)."""
    config.setdefault("speculate_min_rate", 0.0)
    config.setdefault("stage_min_rate", 0.0)
    config.setdefault("warm_host_share", 0.0)  # warming ahead of demand: test_warming.py
    config.setdefault("linger_s", 0.0)  # copies touched just now kept: test_homes.py, and the test below
    specs = [ReplicaSpec(f"r{r}", tuple(f"r{r}/w{k}" for k in range(tp)), slots, bytes_per_worker, host_bytes)
             for r in range(replicas)]
    infos = [AdapterInfo(f"a{i}", "v1", bytes_per_rank) for i in range(adapters)]
    planner = Planner(PlannerConfig(policy=policy, **config), epoch, infos, specs)  # type: ignore[arg-type]
    planner.plan(start)  # nothing held, nothing queued: clears the dirty flags of a new fleet
    return planner


def queue(planner: Planner, replica: str, *adapters: str, now: float = 1.0) -> None:
    planner.report_queue(replica, [QueueEntry(a, float(i)) for i, a in enumerate(adapters)], now)


def hold(planner: Planner, replica: str, *adapters: str, state: SlotState = READY, refcount: int = 0) -> None:
    """Every rank of `replica` reports holding exactly `adapters` (version v1)."""
    for worker in planner.view.workers(replica):
        planner.report_residency(worker, [ResidencyEntry(a, "v1", state, refcount) for a in adapters])


def prefetched(plan: Plan, worker: str) -> list[str]:
    commands = plan.for_worker(worker)
    return [c.adapter for c in commands.prefetches] if commands else []


def staged(plan: Plan, worker: str) -> list[str]:
    commands = plan.for_worker(worker)
    return [c.adapter for c in commands.stages] if commands else []


def evicted(plan: Plan, worker: str) -> list[str]:
    commands = plan.for_worker(worker)
    return sorted(c.adapter for c in commands.evicts) if commands else []


def held(planner: Planner, worker: str) -> set[str]:
    return {key.name for key in planner.view.residency(worker)}


def popular(planner: Planner, replica: str, counts: dict[str, int], now: float = 1.0) -> None:
    for adapter, count in counts.items():
        planner.record_request(adapter, replica, now, weight=count)


@pytest.fixture(autouse=True)
def _no_wall_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The core takes time as an argument; reading a clock inside it would break determinism."""
    import time

    def forbidden() -> float:
        raise AssertionError("the planner read the wall clock")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, forbidden)
    yield


# -- config and specs -------------------------------------------------------------------------------
def test_config_unknown_policy_lists_registered_ones() -> None:
    registered = "choose one of 'global', 'none', 'queue'"
    with pytest.raises(ConfigError, match=f"policy 'lru' is not registered; {registered}"):
        PlannerConfig(policy="lru")
    assert set(POLICIES) >= {"global", "queue", "none"}


@pytest.mark.parametrize(("field", "value", "words"), [
    ("half_life_s", 0.0, "half_life_s is 0.0; give a positive"),
    ("half_life_s", float("inf"), "half_life_s is inf"),
    ("hysteresis", -0.1, "hysteresis is -0.1; give a margin >= 0"),
    ("local_weight", 1.5, "local_weight is 1.5; give a weight in [0, 1]"),
    ("max_prefetches_per_plan", -1, "max_prefetches_per_plan is -1; give an int >= 0"),
    ("max_prefetches_per_plan", True, "max_prefetches_per_plan is True"),
    ("hint_ttl_s", -5, "hint_ttl_s is -5"),
    ("max_hints_per_replica", 0, "max_hints_per_replica is 0; give an int >= 1"),
    ("max_staged_per_replica", -2, "max_staged_per_replica is -2; give an int >= 0, e.g. 4 (0: no host-tier"),
    ("speculate_min_rate", -1.0, "speculate_min_rate is -1.0; give requests per second >= 0"),
    ("stage_host_share", 1.5, "stage_host_share is 1.5; give a share in [0, 1]"),
    ("stage_min_rate", float("nan"), "stage_min_rate is nan; give requests per second >= 0"),
])
def test_config_rejects_bad_values_quoting_value_and_fix(field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        PlannerConfig(**{field: value})  # type: ignore[arg-type]
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_config_is_frozen() -> None:
    config = PlannerConfig()
    with pytest.raises(AttributeError):
        config.policy = "none"  # type: ignore[misc]


@pytest.mark.parametrize(("build", "words"), [
    (lambda: AdapterInfo("a", "v1", 0), "bytes_per_rank of adapter 'a' is 0"),
    (lambda: AdapterInfo("", "v1", 10), "adapter name is ''"),
    (lambda: ReplicaSpec("r", (), 2), "replica 'r' has worker_ids ()"),
    (lambda: ReplicaSpec("r", ("w", "w"), 2), "lists a worker twice"),
    (lambda: ReplicaSpec("r", ("w",), -1), "slots of replica 'r' is -1"),
    (lambda: Hint("h", "a", "r", float("nan")), "expected_s of hint 'h' is nan"),
])
def test_specs_validate_their_values(build: object, words: str) -> None:
    with pytest.raises(PlannerInputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build()  # type: ignore[operator]


def test_epoch_must_be_a_non_negative_int() -> None:
    with pytest.raises(PlannerInputError, match="epoch is -1"):
        Planner(PlannerConfig(), -1)


# -- unknown names ----------------------------------------------------------------------------------
def test_unknown_replica_names_it_and_the_fix() -> None:
    planner = make()
    with pytest.raises(UnknownReplicaError) as info:
        queue(planner, "r9", "a0")
    message = str(info.value)
    assert "unknown replica 'r9' in report_queue" in message
    assert "known replicas: 'r0'" in message and "add_replica" in message
    assert isinstance(info.value, KeyError) and not message.startswith('"')


def test_unknown_adapter_in_queue_hint_and_residency() -> None:
    planner = make()
    in_queue = r"unknown adapter 'zz' in the queue of replica 'r0'.*register_adapter"
    with pytest.raises(UnknownAdapterError, match=in_queue):
        queue(planner, "r0", "a0", "zz")
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'zz' in hint 'h1'"):
        planner.add_hint(Hint("h1", "zz", "r0", 2.0), 1.0)
    with pytest.raises(UnknownReplicaError, match="unknown replica 'r5' in hint 'h1'"):
        planner.add_hint(Hint("h1", "a0", "r5", 2.0), 1.0)
    with pytest.raises(UnknownAdapterError, match="residency report of worker 'r0/w0'"):
        planner.report_residency("r0/w0", [ResidencyEntry("zz", "v1", READY)])
    assert planner.view.queue("r0") == ()  # a rejected report changes nothing
    planner.check_integrity()


def test_unknown_worker_and_bad_residency_values() -> None:
    planner = make()
    with pytest.raises(UnknownWorkerError, match=r"unknown worker 'w9' in report_residency.*add_worker"):
        planner.report_residency("w9", [])
    with pytest.raises(PlannerInputError, match=r"refcount of a0@v1 .* is -1"):
        planner.report_residency("r0/w0", [ResidencyEntry("a0", "v1", READY, -1)])
    with pytest.raises(PlannerInputError, match=r"state of a0@v1 .* is 'ready'; give a SlotState"):
        planner.report_residency("r0/w0", [ResidencyEntry("a0", "v1", "ready")])  # type: ignore[arg-type]
    with pytest.raises(PlannerInputError, match="reported a0@v1 twice"):
        planner.report_residency("r0/w0", [ResidencyEntry("a0", "v1", READY)] * 2)


def test_time_must_not_go_back() -> None:
    planner = make()
    queue(planner, "r0", "a0", now=5.0)
    with pytest.raises(PlannerInputError, match=r"now \(4.0\) is earlier than a time already given \(5.0\)"):
        planner.plan(4.0)


# -- policies -------------------------------------------------------------------------------------
def test_queue_policy_prefetches_the_queue_in_order_on_every_rank() -> None:
    planner = make("queue", slots=3)
    queue(planner, "r0", "a5", "a2", "a5", "a7", "a1")
    plan = planner.plan(1.0)
    for worker in planner.view.workers("r0"):
        commands = plan.for_worker(worker)
        assert commands is not None
        assert commands.prefetches == (Prefetch("a5", "v1", 0, 7), Prefetch("a2", "v1", 1, 7),
                                       Prefetch("a7", "v1", 2, 7))
    planner.check_integrity()


def test_queue_policy_ignores_hints_and_popularity() -> None:
    planner = make("queue", slots=4)
    popular(planner, "r0", {"a3": 100})
    assert planner.add_hint(Hint("h", "a4", "r0", 2.0), 1.0)
    queue(planner, "r0", "a1")
    plan = planner.plan_all(1.0)
    assert prefetched(plan, "r0/w0") == ["a1"]


def test_none_policy_plans_nothing() -> None:
    planner = make("none")
    hold(planner, "r0", "a0", "a1")
    queue(planner, "r0", "a2", "a3")
    popular(planner, "r0", {"a4": 10})
    assert planner.plan_all(1.0).is_empty


def test_global_orders_queue_then_hints_by_expected_time_then_popularity() -> None:
    planner = make(slots=5)
    popular(planner, "r0", {"a6": 50, "a7": 80})
    planner.add_hint(Hint("late", "a3", "r0", 3.0), 1.0)  # within the horizon (2 s ahead by default)
    planner.add_hint(Hint("soon", "a4", "r0", 2.5), 1.0)
    planner.add_hint(Hint("dup-of-queued", "a1", "r0", 2.0), 1.0)
    queue(planner, "r0", "a1", "a0")
    plan = planner.plan(1.0)
    assert prefetched(plan, "r0/w0") == ["a1", "a0", "a4", "a3", "a7"]
    assert [c.priority for c in plan.workers[0].prefetches] == [0, 1, 2, 3, 4]
    assert plan.for_worker("r0/w0") == plan.for_worker("r0/w1")._replace(worker="r0/w0")  # type: ignore[union-attr]


def test_queued_adapters_fill_room_before_any_popularity_prefetch() -> None:
    planner = make(slots=2)
    popular(planner, "r0", {"a6": 1000})
    queue(planner, "r0", "a1", "a2", "a3")
    plan = planner.plan_all(1.0)
    assert prefetched(plan, "r0/w0") == ["a1", "a2"]


# -- eviction rules ---------------------------------------------------------------------------------
def test_never_evicts_an_adapter_in_use() -> None:
    planner = make(slots=2)
    for worker in planner.view.workers("r0"):
        planner.report_residency(worker, [ResidencyEntry("a0", "v1", IN_USE, 1),
                                          ResidencyEntry("a1", "v1", READY, 2)])
    queue(planner, "r0", "a2", "a3")
    plan = planner.plan(1.0)
    assert all(not c.evicts and not c.prefetches for c in plan.workers)  # only stages (next section)
    hold(planner, "r0", "a0", "a1")  # released
    assert prefetched(planner.plan(1.0), "r0/w0") == ["a2", "a3"]


def test_in_use_on_one_rank_is_kept_and_loaded_on_the_others_first() -> None:
    planner = make(slots=2)
    planner.report_residency("r0/w0", [ResidencyEntry("a4", "v1", IN_USE, 1)])
    queue(planner, "r0", "a1", "a2")
    plan = planner.plan(1.0)
    assert prefetched(plan, "r0/w0") == ["a1"]
    assert prefetched(plan, "r0/w1") == ["a4", "a1"]  # same target, same priorities on every rank
    assert [c.priority for c in plan.for_worker("r0/w1").prefetches] == [0, 1]  # type: ignore[union-attr]


def test_never_evicts_a_queued_resident_even_when_the_queue_overflows() -> None:
    planner = make(slots=2)
    hold(planner, "r0", "a3")
    queue(planner, "r0", "a0", "a1", "a2", "a3")
    plan = planner.plan(1.0)
    assert evicted(plan, "r0/w0") == []
    assert prefetched(plan, "r0/w0") == ["a0"]  # the one free slot goes to the head of the queue


def test_queued_adapter_displaces_the_lowest_value_per_byte_resident() -> None:
    planner = make(slots=2, hysteresis=10.0)
    hold(planner, "r0", "a5", "a6")
    popular(planner, "r0", {"a5": 3, "a6": 2})
    queue(planner, "r0", "a1")
    plan = planner.plan(1.0)
    assert (evicted(plan, "r0/w0"), prefetched(plan, "r0/w0")) == (["a6"], ["a1"])


def test_eviction_uses_value_per_byte() -> None:
    planner = Planner(PlannerConfig(), 0, [AdapterInfo("big", "v1", 400), AdapterInfo("small", "v1", 100),
                                           AdapterInfo("q", "v1", 100)], [ReplicaSpec("r", ("w",), 2)])
    planner.report_residency("w", [ResidencyEntry("big", "v1", READY), ResidencyEntry("small", "v1", READY)])
    popular(planner, "r", {"big": 3, "small": 1})  # big: 3/400 per byte < small: 1/100
    planner.report_queue("r", [QueueEntry("q", 0.0)], 1.0)
    assert evicted(planner.plan(1.0), "w") == ["big"]


def test_popularity_prefetch_fills_free_room_only_up_to_the_limit() -> None:
    planner = make(slots=6, max_prefetches_per_plan=2)
    popular(planner, "r0", {"a1": 5, "a2": 4, "a3": 3, "a4": 2})
    queue(planner, "r0", "a7")
    plan = planner.plan_all(1.0)
    assert prefetched(plan, "r0/w0") == ["a7", "a1", "a2"]  # the queue is not limited, speculation is
    assert prefetched(planner.plan_all(1.0), "r0/w0") == ["a3", "a4"]


@pytest.mark.parametrize(("challenger", "swaps"), [(12, False), (13, True)])
def test_hysteresis_margin_guards_popularity_evictions(challenger: int, swaps: bool) -> None:
    planner = make(slots=1, hysteresis=0.25)
    hold(planner, "r0", "a1")
    popular(planner, "r0", {"a1": 10, "a2": challenger})  # 12 <= 10 * 1.25 < 13
    plan = planner.plan_all(1.0)
    assert (evicted(plan, "r0/w0"), prefetched(plan, "r0/w0")) == ((["a1"], ["a2"]) if swaps else ([], []))


def test_speculation_displaces_no_copy_a_request_touched_within_linger_s() -> None:
    """The swap above, but a1's request at r0 was just now (a router may have ranked r0 READY for the next one):
    a1 lingers ``linger_s`` before the more popular a2 takes its place."""
    planner = make(slots=1, hysteresis=0.25, linger_s=1.0)
    hold(planner, "r0", "a1")
    popular(planner, "r0", {"a1": 10, "a2": 13}, now=1.0)
    plan = planner.plan_all(1.5)
    assert (evicted(plan, "r0/w0"), prefetched(plan, "r0/w0")) == ([], [])
    plan = planner.plan_all(2.01)
    assert (evicted(plan, "r0/w0"), prefetched(plan, "r0/w0")) == (["a1"], ["a2"])
    planner.check_integrity()


def test_a_just_prefetched_adapter_is_not_evicted_by_the_next_plan() -> None:
    planner = make(slots=2, max_prefetches_per_plan=1)
    popular(planner, "r0", {"a1": 10, "a2": 9, "a3": 8})
    first = planner.plan_all(1.0)
    second = planner.plan_all(1.0)
    assert prefetched(first, "r0/w0") == ["a1"] and prefetched(second, "r0/w0") == ["a2"]
    assert evicted(second, "r0/w0") == [] and planner.plan_all(1.0).is_empty


def test_a_resident_trimmed_for_room_competes_again_so_the_next_plan_keeps_what_this_one_loads() -> None:
    """Over capacity (a big adapter reported on top), trimming drops the weakest incumbents first; one
    of them may still be worth more than any outsider. It must compete like a candidate: skipping it let
    this plan load a weaker outsider that the next plan evicted to take the trimmed one back (thrash)."""
    planner = make(slots=2, tp=1, bytes_per_worker=300, max_prefetches_per_plan=1, hysteresis=0.0)
    planner.register_adapter(AdapterInfo("big", "v1", 300))
    popular(planner, "r0", {"a0": 3, "a2": 1, "big": 4, "a1": 0.25})  # per byte: a0 > big > a2 > a1
    planner.report_residency("r0/w0", [ResidencyEntry(a, "v1", READY) for a in ("a0", "a2", "big")])
    first = planner.plan(1.0)
    assert evicted(first, "r0/w0") == ["big"] and prefetched(first, "r0/w0") == []
    assert planner.plan_all(1.0).is_empty


def test_deferred_candidates_still_displace_so_the_next_plan_only_fills_room() -> None:
    planner = make(slots=2, tp=1, max_prefetches_per_plan=1, hysteresis=0.0)
    hold(planner, "r0", "a5")
    planner.add_worker("r0", "r0/new", slots=2)  # a replacement rank: a5 is on one rank only
    popular(planner, "r0", {"a0": 4, "a1": 3, "a5": 1})
    first = planner.plan_all(1.0)
    assert evicted(first, "r0/w0") == ["a5"] and prefetched(first, "r0/new") == ["a0"]  # a5 not spread
    second = planner.plan_all(1.0)
    assert prefetched(second, "r0/w0") == prefetched(second, "r0/new") == ["a1"]
    assert evicted(second, "r0/w0") == evicted(second, "r0/new") == []


def test_stale_version_is_evicted_and_the_new_one_loaded() -> None:
    planner = make(slots=2)
    queue(planner, "r0", "a1")
    planner.plan(1.0)
    assert dirty_replicas(planner) == ()
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    assert dirty_replicas(planner) == ("r0",)
    plan = planner.plan(1.0)
    commands = plan.for_worker("r0/w0")
    assert commands is not None
    assert commands.evicts == (Evict("a1", "v1", 7),) and commands.prefetches == (Prefetch("a1", "v2", 0, 7),)


def test_stale_version_in_use_stays_until_released() -> None:
    planner = make(slots=2)
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    planner.report_residency("r0/w0", [ResidencyEntry("a1", "v1", IN_USE, 1)])
    plan = planner.plan(1.0)
    assert evicted(plan, "r0/w0") == []


def renewed(slots: int) -> tuple[Planner, Plan]:
    """Replica r0 holds a1@v1 READY on both ranks with a request queued for it; then a1@v2 is registered: the plan."""
    planner = make(slots=slots)
    hold(planner, "r0", "a1")
    queue(planner, "r0", "a1")
    planner.plan(1.0)
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    return planner, planner.plan(1.0)


def test_the_version_ready_everywhere_stays_until_the_new_one_is_ready_on_every_rank() -> None:
    """A new version becomes a replica's default only when every rank holds it READY (issue 44 item 3): until then
    the older version READY on every rank is kept (the engine admits requests at it) beside the new one's loads,
    and it goes once the new one is READY everywhere."""
    planner, plan = renewed(slots=2)
    for worker in ("r0/w0", "r0/w1"):
        assert prefetched(plan, worker) == ["a1"] and evicted(plan, worker) == []
    planner.report_residency("r0/w0", [ResidencyEntry("a1", "v1", READY), ResidencyEntry("a1", "v2", READY)])
    planner.report_residency("r0/w1", [ResidencyEntry("a1", "v1", READY), ResidencyEntry("a1", "v2", LOADING)])
    plan = planner.plan(1.1)
    assert evicted(plan, "r0/w0") == [] and evicted(plan, "r0/w1") == [], "v2 is not READY on r0/w1 yet"
    planner.report_residency("r0/w1", [ResidencyEntry("a1", "v1", READY), ResidencyEntry("a1", "v2", READY)])
    plan = planner.plan(1.2)
    for worker in ("r0/w0", "r0/w1"):
        commands = plan.for_worker(worker)
        assert commands is not None and commands.evicts == (Evict("a1", "v1", 7),), worker


def test_the_older_version_makes_room_for_its_new_one_when_nothing_else_can() -> None:
    """With one slot, the version READY everywhere gives its slot to its new version (requests then wait for it,
    as they would without the bridge); a version ready on one rank only is no bridge at all."""
    _, plan = renewed(slots=1)
    for worker in ("r0/w0", "r0/w1"):
        commands = plan.for_worker(worker)
        assert commands is not None and commands.evicts == (Evict("a1", "v1", 7),), worker
        assert commands.prefetches == (Prefetch("a1", "v2", 0, 7),)
    planner = make(slots=2)
    planner.report_residency("r0/w0", [ResidencyEntry("a1", "v1", READY)])
    queue(planner, "r0", "a1")
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    assert evicted(planner.plan(1.0), "r0/w0") == ["a1"], "v1 is READY on one rank only: never served, evicted"


@pytest.mark.parametrize("policy", ["global", "queue"])
def test_a_version_a_waiting_request_names_is_prefetched_there_and_kept_while_it_waits(policy: str) -> None:
    """Issue 44 item 3: a queued request naming an older version (``A@VERSION``, still kept) has that version
    prefetched on its replica beside the current one, after the target's keys and only where room is left; it is not
    evicted while a request waits for it, and goes once none does."""
    planner = make(policy, slots=3)
    planner.register_adapter(AdapterInfo("a1", "v2", 100))  # v1 stays loadable (the catalog keeps it)
    planner.report_queue("r0", [QueueEntry("a1", 0.0, "v1"), QueueEntry("a1", 0.5), QueueEntry("a2", 0.7)], 1.0)
    plan = planner.plan(1.0)
    for worker in ("r0/w0", "r0/w1"):
        commands = plan.for_worker(worker)
        assert commands is not None
        got = [(c.adapter, c.version) for c in commands.prefetches]
        assert set(got) == {("a1", "v2"), ("a2", "v1"), ("a1", "v1")}, got
        assert got[-1] == ("a1", "v1"), "the named version before the target's own keys"
    for worker in ("r0/w0", "r0/w1"):
        planner.report_residency(worker, [ResidencyEntry("a1", "v1", READY), ResidencyEntry("a1", "v2", READY),
                                          ResidencyEntry("a2", "v1", READY)])
    planner.report_queue("r0", [QueueEntry("a1", 0.0, "v1"), QueueEntry("a3", 0.8)], 1.1)  # a3 needs a slot
    plan = planner.plan(1.1)
    assert all(("a1", "v1") not in {(c.adapter, c.version) for c in plan.for_worker(w).evicts}
               for w in ("r0/w0", "r0/w1") if plan.for_worker(w) is not None), "evicted while a request waits"
    planner.report_queue("r0", [QueueEntry("a3", 0.8)], 1.2)  # the named request was admitted and finished
    for worker in ("r0/w0", "r0/w1"):
        planner.report_residency(worker, [ResidencyEntry("a1", "v1", READY), ResidencyEntry("a3", "v1", READY),
                                          ResidencyEntry("a2", "v1", READY)])
    planner.register_adapter(AdapterInfo("a4", "v1", 100))
    planner.report_queue("r0", [QueueEntry("a4", 0.9)], 1.3)
    plan = planner.plan(1.3)
    assert any(("a1", "v1") in {(c.adapter, c.version) for c in plan.for_worker(w).evicts}
               for w in ("r0/w0", "r0/w1") if plan.for_worker(w) is not None), "kept with nobody waiting"
    planner.check_integrity()


def test_a_hint_naming_a_version_prefetches_it_and_a_current_one_is_no_extra() -> None:
    """A near hint naming an older version prefetches it on the hinted replica; naming the current version is the
    same as naming none; durable state keeps the named versions of hints and queues."""
    planner = make(slots=2)
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    assert planner.add_hint(Hint("h1", "a1", "r0", 1.0, version="v1"), 1.0)
    assert planner.add_hint(Hint("h2", "a2", "r0", 1.0, version="v1"), 1.0)  # a2's current version
    plan = planner.plan(1.0)
    got = sorted((c.adapter, c.version) for c in plan.for_worker("r0/w0").prefetches)
    assert ("a1", "v1") in got and got.count(("a2", "v1")) <= 1, got
    planner.report_queue("r0", [QueueEntry("a3", 0.5, "v0")], 1.0)
    state = json.loads(json.dumps(planner.export_state()))
    fresh = make(slots=2)
    fresh.register_adapter(AdapterInfo("a1", "v2", 100))
    fresh.restore_state(state, 1.0)
    assert fresh.view.queue("r0") == (QueueEntry("a3", 0.5, "v0"),)
    assert {h.version for h in fresh.view.hints("r0")} == {"v1"}


def test_a_named_version_displaces_what_is_kept_for_its_value_alone() -> None:
    """Found by the Ray push test: every slot held by incumbents (resident, nothing asks for them) left a hinted
    older version no room, so it was never prefetched. A version a hint or a waiting request names outranks what
    the target keeps for its value alone; it never displaces what a request waits for."""
    planner = make(slots=2)
    hold(planner, "r0", "a2", "a3")  # incumbents: resident, neither queued nor hinted
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    assert planner.add_hint(Hint("h1", "a1", "r0", 1.0, version="v1"), 1.0)
    plan = planner.plan(1.0)
    for worker in ("r0/w0", "r0/w1"):
        commands = plan.for_worker(worker)
        assert commands is not None and (commands.prefetches[0].adapter, commands.prefetches[0].version) == ("a1", "v1")
        assert commands.evicts and {e.adapter for e in commands.evicts} <= {"a2", "a3"}
    planner = make(slots=2)
    hold(planner, "r0", "a2", "a3")
    queue(planner, "r0", "a2", "a3")  # both wanted by waiting requests: the named version waits for room
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    assert planner.add_hint(Hint("h1", "a1", "r0", 1.0, version="v1"), 1.0)
    assert evicted(planner.plan(1.0), "r0/w0") == []


def test_a_bridge_a_waiting_request_names_does_not_give_way_to_its_new_version() -> None:
    """With one slot, the version READY everywhere gives its slot to its new version, unless a waiting request names
    it (``A@VERSION``): then it stays, and the new version waits for room."""
    planner, _ = renewed(slots=1)
    planner.report_queue("r0", [QueueEntry("a1", 0.0, "v1"), QueueEntry("a1", 0.1)], 1.05)
    for worker in ("r0/w0", "r0/w1"):
        planner.report_residency(worker, [ResidencyEntry("a1", "v1", READY)])  # the eviction was refused meanwhile
    plan = planner.plan(1.1)
    for worker in ("r0/w0", "r0/w1"):
        assert evicted(plan, worker) == [], "the named bridge was evicted for its new version"
    planner.check_integrity()


def test_a_bridge_on_a_worker_over_its_capacity_goes_first() -> None:
    """Found by the planner's state machine (random profile, 2026-12-01): a worker with one slot reported both the
    new version (loading) and the old one (READY, a bridge until the new one is READY everywhere). The new version
    needed no prefetch, so no room was asked for and the bridge stayed: the worker planned over its capacity. A
    bridge is never needed: on a worker over its capacity it is evicted first (unless a waiting request names it)."""
    planner = make(tp=1, slots=1)
    queue(planner, "r0", "a1")
    planner.register_adapter(AdapterInfo("a1", "v2", 100))
    planner.report_residency("r0/w0", [ResidencyEntry("a1", "v1", READY), ResidencyEntry("a1", "v2", LOADING)])
    plan = planner.plan(1.0)
    assert evicted(plan, "r0/w0") == ["a1"] and plan.for_worker("r0/w0").evicts[0].version == "v1"
    planner.check_integrity()


def test_byte_budget_is_checked_besides_slots() -> None:
    infos = [AdapterInfo("huge", "v1", 500), AdapterInfo("mid", "v1", 300), AdapterInfo("tiny", "v1", 100)]
    planner = Planner(PlannerConfig(), 0, infos, [ReplicaSpec("r", ("w",), 4, 400)])
    planner.report_queue("r", [QueueEntry(a, float(i)) for i, a in enumerate(["huge", "mid", "tiny"])], 1.0)
    plan = planner.plan(1.0)
    assert prefetched(plan, "w") == ["mid", "tiny"]  # huge never fits one worker; mid + tiny = 400 bytes


# -- hints ------------------------------------------------------------------------------------------
def test_duplicate_hint_is_idempotent() -> None:
    planner = make(slots=4)
    assert planner.add_hint(Hint("h1", "a2", "r0", 5.0), 1.0)
    assert not planner.add_hint(Hint("h1", "a3", "r0", 2.0), 1.5)  # same id, whatever it says
    assert [h.adapter for h in planner.view.hints("r0")] == ["a2"]
    assert popularity(planner, "a2", 1.0) == pytest.approx(1.0) and popularity(planner, "a3", 1.5) == 0.0
    assert planner.stats.hints_ignored == 1


def test_cancelled_hint_is_dropped_and_a_late_duplicate_ignored() -> None:
    planner = make(slots=4, max_prefetches_per_plan=0)
    planner.add_hint(Hint("h1", "a2", "r0", 5.0), 1.0)
    assert prefetched(planner.plan(1.0), "r0/w0") == ["a2"]
    assert planner.cancel_hint("h1", 2.0)
    assert dirty_replicas(planner) == ("r0",) and planner.view.hints("r0") == ()
    assert not planner.add_hint(Hint("h1", "a2", "r0", 5.0), 2.0)
    assert not planner.cancel_hint("h1", 2.0)


def test_cancel_before_hint_leaves_a_tombstone() -> None:
    planner = make()
    assert not planner.cancel_hint("early", 1.0)
    assert not planner.add_hint(Hint("early", "a1", "r0", 3.0), 1.1)
    assert planner.view.hints("r0") == ()
    planner.check_integrity()


def test_tombstones_are_bounded_by_count_and_the_oldest_is_forgotten_first() -> None:
    """Issue 35: cancelling 819,200 unknown hint ids grew the controller by 260 MB (tombstones kept for
    hint_ttl_s with no count bound). Now at most max_tombstones are kept, the deadline heap stays within twice
    the live entries, and forgetting costs only idempotence for the oldest ids (a late duplicate of one is an
    ordinary hint: latency, never correctness)."""
    planner = make(max_tombstones=1000, hint_ttl_s=30.0)
    for i in range(200_000):
        assert not planner.cancel_hint(f"junk-{i}", 1.0)
    planner.check_integrity()  # tombstones <= 1000, heap bounded
    assert planner.add_hint(Hint("junk-0", "a1", "r0", 3.0), 1.1)  # forgotten: taken as a new hint
    assert not planner.add_hint(Hint("junk-199999", "a1", "r0", 3.0), 1.1)  # remembered: still ignored
    planner.check_integrity()


def test_max_tombstones_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"max_tombstones is 0; give an int >= 1, e.g. 65536"):
        PlannerConfig(max_tombstones=0)


def test_hint_is_fulfilled_by_its_queued_request_and_counted_once() -> None:
    planner = make(slots=4)
    planner.add_hint(Hint("h1", "a2", "r0", 2.0), 1.0)
    queue(planner, "r0", "a2", now=1.5)
    assert planner.view.hints("r0") == ()
    assert popularity(planner, "a2", 1.5) == pytest.approx(2 ** (-0.5 / 60))  # one count, at t=1.0


def test_hint_expires_after_ttl() -> None:
    planner = make(slots=4, hint_ttl_s=10.0, max_prefetches_per_plan=0)
    planner.add_hint(Hint("h1", "a2", "r0", 5.0), 1.0)
    planner.plan(1.0)
    planner.plan(15.0)
    assert len(planner.view.hints("r0")) == 1
    assert planner.plan(15.5).replicas == ("r0",)  # expiry dirties the replica
    assert planner.view.hints("r0") == ()
    assert not planner.add_hint(Hint("h2", "a2", "r0", 1.0), 16.0)  # stale on arrival
    planner.check_integrity()


def test_hints_per_replica_are_bounded() -> None:
    planner = make(max_hints_per_replica=2)
    assert planner.add_hint(Hint("h1", "a1", "r0", 2.0), 1.0)
    assert planner.add_hint(Hint("h2", "a2", "r0", 2.0), 1.0)
    assert not planner.add_hint(Hint("h3", "a3", "r0", 2.0), 1.0)


# -- staging: needed adapters without GPU room go to the host tiers ---------------------------------
def pin_all(planner: Planner, replica: str, *adapters: str) -> None:
    """Every rank of `replica` runs batches on exactly `adapters` (its slots, all in use)."""
    hold(planner, replica, *adapters, state=IN_USE, refcount=1)


def test_needed_adapters_without_gpu_room_are_staged_in_need_order_on_every_rank() -> None:
    planner = make(slots=2, max_prefetches_per_plan=0)
    pin_all(planner, "r0", "a0", "a1")
    queue(planner, "r0", "a4")
    planner.add_hint(Hint("h1", "a2", "r0", 3.0), 1.0)
    planner.add_hint(Hint("h2", "a3", "r0", 2.0), 1.0)
    plan = planner.plan(1.0)
    for worker in planner.view.workers("r0"):
        assert staged(plan, worker) == ["a4", "a3", "a2"]  # queued first, then hints by expected time
        assert prefetched(plan, worker) == [] and evicted(plan, worker) == []
        assert [c.priority for c in plan.for_worker(worker).stages] == [2, 3, 4]  # type: ignore[union-attr]
    assert planner.stats.stages == 6
    assert planner.view.residency("r0/w0").keys() == {AdapterKey("a0", "v1"), AdapterKey("a1", "v1")}  # not resident
    planner.check_integrity()


def test_a_stage_is_sent_once_while_wanted_and_again_after_it_was_dropped() -> None:
    planner = make(slots=2, max_prefetches_per_plan=0)
    pin_all(planner, "r0", "a0", "a1")
    queue(planner, "r0", "a2")
    assert staged(planner.plan(1.0), "r0/w0") == ["a2"]
    queue(planner, "r0", "a2", "a3", now=1.1)  # replanned: a2 is still wanted, so only a3 goes
    assert staged(planner.plan(1.1), "r0/w0") == ["a3"]
    queue(planner, "r0", "a3", now=1.2)  # a2 left (served elsewhere, say)
    assert planner.plan(1.2).is_empty
    queue(planner, "r0", "a3", "a2", now=1.3)  # back: its host copy may be gone, stage it again
    assert staged(planner.plan(1.3), "r0/w0") == ["a2"]
    pin_all(planner, "r0", "a0", "a1")  # a full report (the worker may have restarted): its next plan stages
    assert staged(planner.plan_all(1.4), "r0/w0") == ["a3", "a2"]  # what is wanted, again
    planner.check_integrity()


def test_a_needed_adapter_that_gets_room_is_prefetched_not_staged() -> None:
    planner = make(slots=2, max_prefetches_per_plan=0)
    pin_all(planner, "r0", "a0", "a1")
    queue(planner, "r0", "a2", "a3")
    planner.plan(1.0)
    hold(planner, "r0", "a0", "a1")  # released: both slots may be reused
    plan = planner.plan(1.1)
    assert prefetched(plan, "r0/w0") == ["a2", "a3"] and staged(plan, "r0/w0") == []
    assert "r0/w0" not in planner._fleet.staged  # nothing stays staged that the target no longer stages
    planner.check_integrity()


def test_stages_are_bounded_per_replica_and_off_at_zero() -> None:
    planner = make(slots=1, max_prefetches_per_plan=0, max_staged_per_replica=2)
    pin_all(planner, "r0", "a0")
    queue(planner, "r0", "a1", "a2", "a3", "a4")
    assert staged(planner.plan(1.0), "r0/w0") == ["a1", "a2"]
    planner = make(slots=1, max_prefetches_per_plan=0, max_staged_per_replica=0)
    pin_all(planner, "r0", "a0")
    queue(planner, "r0", "a1")
    assert planner.plan(1.0).is_empty


def test_only_the_global_policy_stages() -> None:
    planner = make(policy="queue", slots=1)
    pin_all(planner, "r0", "a0")
    queue(planner, "r0", "a1")
    assert planner.plan(1.0).is_empty  # S-LoRA's queue prefetch loads into GPU slots only


# -- predictive staging: popular adapters into the reported host tier (staging.py) --------------------
POPULAR = {"a0": 10, "a1": 9, "a2": 8, "a3": 7, "a4": 6, "a5": 5, "a6": 4, "a7": 3}


@pytest.mark.parametrize(("host", "share", "expected"), [
    (700, 1.0, ["a2", "a3", "a4", "a5", "a6"]),  # 700 - the 200 bytes the two held adapters also take there
    (700, 0.5, ["a2"]),  # 350 - 200
    (150, 1.0, []),  # no room left beside the held shards
    (None, 1.0, []),  # no host tier reported: nothing staged ahead
])
def test_popular_adapters_are_staged_in_demand_order_within_the_host_tier(
        host: int | None, share: float, expected: list[str]) -> None:
    planner = make(slots=2, max_prefetches_per_plan=0, host_bytes=host, stage_host_share=share)
    hold(planner, "r0", "a0", "a1")
    popular(planner, "r0", POPULAR)
    plan = planner.plan_all(1.0)
    for worker in planner.view.workers("r0"):
        assert staged(plan, worker) == expected  # most demanded first, never a0/a1 (held)
        assert not set(staged(plan, worker)) & held(planner, worker)
        kept = planner._fleet.staged.get(worker, frozenset())
        assert sum(planner.view.adapter(k.name).bytes_per_rank for k in kept) <= (host or 0)
    assert planner.plan_all(1.1).is_empty  # sent once while wanted
    planner.check_integrity()


def test_a_popular_adapter_below_the_stage_rate_is_not_staged() -> None:
    """Counts of 10 down to 3 with a 60 s half-life: 0.12 down to 0.035 requests per second."""
    planner = make(slots=2, max_prefetches_per_plan=0, host_bytes=10_000, stage_host_share=1.0, stage_min_rate=0.05)
    hold(planner, "r0", "a0", "a1")
    popular(planner, "r0", POPULAR)
    assert staged(planner.plan_all(1.0), "r0/w0") == ["a2", "a3", "a4", "a5"]  # not a6 (0.046/s) nor a7
    planner.check_integrity()


def test_popular_stages_come_after_needed_ones_and_skip_queued_adapters() -> None:
    planner = make(slots=2, max_prefetches_per_plan=0, host_bytes=1000, stage_host_share=1.0)
    pin_all(planner, "r0", "a0", "a1")
    popular(planner, "r0", POPULAR)
    queue(planner, "r0", "a6", "a7")
    plan = planner.plan(1.0)
    assert staged(plan, "r0/w0")[:2] == ["a6", "a7"]  # the needed ones, in need order
    assert staged(plan, "r0/w0")[2:] == ["a2", "a3", "a4", "a5"]  # then by popularity, up to 1000 - 400 bytes
    planner.check_integrity()


def test_a_popular_adapter_below_the_min_rate_is_staged_not_loaded() -> None:
    """Rates: a decayed count c with a 60 s half-life stands for c * ln 2 / 60 requests per second."""
    planner = make(slots=4, host_bytes=1000, speculate_min_rate=0.5, place_homes=False)  # homes: test_homes.py
    popular(planner, "r0", {"a1": 100, "a2": 10})  # about 1.2 and 0.12 requests per second
    plan = planner.plan_all(1.0)
    assert prefetched(plan, "r0/w0") == ["a1"]
    assert staged(plan, "r0/w0") == ["a2"]
    planner.check_integrity()


def test_speculative_copies_follow_routed_load_across_replicas() -> None:
    """Replica-aware speculation (issue 20 item 3): a replica loads a popular adapter only where its expected
    rate there (the replica's routed counts blended with the fleet's per replica) reaches the gate. An adapter
    routed to r0 alone is held at r0 only; one routed to both replicas, or so hot that its fleet share alone
    reaches the gate, is held at both: copies grow with routed load, not top-k everywhere."""
    planner = make(replicas=2, slots=3, tp=1, speculate_min_rate=0.5, local_weight=0.5,
                   place_homes=False)  # speculation alone (homes would put a1 in its home's free room)
    popular(planner, "r0", {"a1": 100, "a3": 300})  # rates at r0: 0.87 and 2.6/s; at r1 (fleet share): 0.29, 0.87
    popular(planner, "r1", {"a2": 100})
    popular(planner, "r0", {"a2": 100})  # a2: 1.2/s at both
    plan = planner.plan_all(1.0)
    assert sorted(prefetched(plan, "r0/w0")) == ["a1", "a2", "a3"]
    assert sorted(prefetched(plan, "r1/w0")) == ["a2", "a3"]  # not a1: its load goes to r0
    planner.check_integrity()


def test_removing_an_adapter_or_worker_forgets_its_stages() -> None:
    planner = make(slots=1, max_prefetches_per_plan=0)
    pin_all(planner, "r0", "a0")
    queue(planner, "r0", "a1", "a2")
    planner.plan(1.0)
    planner.remove_adapter("a1", 1.1)
    assert {k.name for k in planner._fleet.staged["r0/w0"]} == {"a2"}
    planner.remove_worker("r0/w1")
    assert "r0/w1" not in planner._fleet.staged
    planner.check_integrity()


# -- popularity -------------------------------------------------------------------------------------
def test_popularity_halves_every_half_life_fleet_wide_and_per_replica() -> None:
    planner = make(replicas=2, half_life_s=10.0)
    planner.record_request("a1", "r0", 0.0, weight=8)
    planner.record_request("a1", "r1", 10.0, weight=4)
    assert popularity(planner, "a1", 20.0) == pytest.approx(8 / 4 + 4 / 2)
    assert popularity(planner, "a1", 20.0, "r0") == pytest.approx(2.0)
    assert popularity(planner, "a1", 20.0, "r1") == pytest.approx(2.0)


def test_popularity_survives_many_half_lives_without_overflow() -> None:
    planner = make(half_life_s=1.0)
    for step in range(2000):
        planner.record_request("a1" if step % 3 else "a2", "r0", float(step))
    # a2 at steps 0, 3, ..., 1998; a1 at the others (1999, 1997, 1996, ...): geometric sums
    assert popularity(planner, "a2", 1999.0) == pytest.approx(0.5 * 8 / 7, rel=1e-9)
    assert popularity(planner, "a1", 1999.0) == pytest.approx(1.25 * 8 / 7, rel=1e-9)
    planner.check_integrity()


def test_replica_counts_blend_with_fleet_counts() -> None:
    planner = make(replicas=2, slots=1, local_weight=1.0)
    popular(planner, "r1", {"a1": 100})
    popular(planner, "r0", {"a2": 1})
    plan = planner.plan_all(1.0)
    assert prefetched(plan, "r0/w0") == ["a2"] and prefetched(plan, "r1/w0") == ["a1"]


# -- incremental planning ---------------------------------------------------------------------------
def test_a_queue_update_replans_only_its_replica() -> None:
    planner = make(replicas=3)
    planner.plan_all(1.0)
    queue(planner, "r1", "a3")
    assert dirty_replicas(planner) == ("r1",)
    plan = planner.plan(1.0)
    assert plan.replicas == ("r1",) and {w.replica for w in plan.workers} == {"r1"}
    assert planner.plan(1.0).replicas == ()
    queue(planner, "r1", "a3")  # the same queue again: nothing to do
    assert dirty_replicas(planner) == ()


def test_popularity_alone_is_replanned_lazily() -> None:
    planner = make(replicas=2)
    popular(planner, "r0", {"a4": 5})
    assert planner.plan(1.0).is_empty
    assert prefetched(planner.plan_all(1.0), "r0/w0") == ["a4"]


def test_readiness_does_not_dirty_but_a_release_does() -> None:
    planner = make()
    queue(planner, "r0", "a1")
    planner.plan(1.0)
    for worker in planner.view.workers("r0"):
        planner.update_residency(worker, ResidencyEntry("a1", "v1", READY))
    assert dirty_replicas(planner) == ()
    planner.update_residency("r0/w0", ResidencyEntry("a1", "v1", IN_USE, 1))
    assert dirty_replicas(planner) == ("r0",)


def test_sent_commands_are_assumed_done_so_replanning_is_a_fixpoint() -> None:
    planner = make(slots=3)
    popular(planner, "r0", {"a5": 3, "a6": 2})
    hold(planner, "r0", "a0", "a1")
    queue(planner, "r0", "a2", "a3")
    first = planner.plan_all(1.0)
    assert held(planner, "r0/w0") == {"a2", "a3", "a5"} and not first.is_empty
    assert planner.view.residency("r0/w0")[AdapterKey("a2", "v1")].state is LOADING
    assert planner.plan_all(1.0).is_empty


def test_lost_worker_drops_its_residency_and_dirties_its_replica() -> None:
    planner = make()
    queue(planner, "r0", "a1")
    planner.plan(1.0)
    planner.remove_worker("r0/w1")
    assert dirty_replicas(planner) == ("r0",) and planner.view.workers("r0") == ("r0/w0",)
    with pytest.raises(UnknownWorkerError):
        planner.view.residency("r0/w1")
    planner.add_worker("r0", "r0/w9", slots=2)
    plan = planner.plan(1.0)
    assert [w.worker for w in plan.workers] == ["r0/w9"] and prefetched(plan, "r0/w9") == ["a1"]
    planner.check_integrity()


def test_capacity_shrink_evicts_the_least_valuable_first() -> None:
    planner = make(slots=3)
    hold(planner, "r0", "a1", "a2", "a3")
    popular(planner, "r0", {"a1": 3, "a2": 1, "a3": 2})
    planner.set_capacity("r0/w0", 1)
    plan = planner.plan(1.0)
    # the replica plans for its smallest rank
    assert evicted(plan, "r0/w0") == evicted(plan, "r0/w1") == ["a2", "a3"]
    planner.set_capacity("r0/w0", 0)
    assert evicted(planner.plan(1.0), "r0/w0") == ["a1"]


def test_ready_replicas_needs_every_rank_loaded() -> None:
    planner = make(replicas=2)
    hold(planner, "r0", "a1")
    planner.report_residency("r1/w0", [ResidencyEntry("a1", "v1", READY)])
    planner.report_residency("r1/w1", [ResidencyEntry("a1", "v1", LOADING)])
    assert ready_replicas(planner, "a1") == ("r0",)


def test_remove_replica_forgets_its_queue_hints_and_counts() -> None:
    planner = make(replicas=2)
    queue(planner, "r1", "a1")
    planner.add_hint(Hint("h", "a2", "r1", 3.0), 1.0)
    planner.remove_replica("r1")
    assert planner.view.replicas() == ("r0",)
    planner.check_integrity()
    with pytest.raises(UnknownReplicaError):
        queue(planner, "r1", "a1")


# -- determinism ------------------------------------------------------------------------------------
_SCENARIO = """
import json
from lora_cache.planner import *
infos = [AdapterInfo(f"a{i}", "v1", 100 + (i % 3) * 50) for i in range(40)]
specs = [ReplicaSpec(f"r{r}", (f"r{r}/w0", f"r{r}/w1"), 4) for r in range(6)]
planner = Planner(PlannerConfig(max_prefetches_per_plan=3), 1, infos, specs)
plans = []
for step in range(60):
    now = step * 0.5
    replica = f"r{step % 6}"
    for j in range(3):
        planner.record_request(f"a{(step * 7 + j * 5) % 40}", replica, now)
    planner.report_queue(replica, [QueueEntry(f"a{(step + k) % 40}", now + k) for k in range(step % 4)], now)
    if step % 5 == 0:
        planner.add_hint(Hint(f"h{step}", f"a{step % 13}", f"r{(step + 1) % 6}", now + 2), now)
    plans.append(planner.plan(now) if step % 7 else planner.plan_all(now))
print(json.dumps([[str(c) for c in p.commands()] for p in plans]))
"""


def test_plans_do_not_depend_on_hash_order() -> None:
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        run = subprocess.run([sys.executable, "-c", _SCENARIO], env=env, capture_output=True, text=True,
                             check=True, cwd=ROOT)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    assert sum(len(p) for p in outputs[0]) > 20  # the scenario does plan something


def test_remove_adapter_forgets_it_everywhere_and_replans_who_used_it() -> None:
    planner = make(replicas=2, slots=3)
    queue(planner, "r0", "a1", "a2")
    planner.add_hint(Hint("h1", "a1", "r1", 2.0), 1.0)
    popular(planner, "r1", {"a1": 5})
    hold(planner, "r1", "a1", "a3")
    planner.plan_all(1.0)
    planner.remove_adapter("a1", 1.5)
    assert set(dirty_replicas(planner)) == {"r0", "r1"}
    assert [e.adapter for e in planner.view.queue("r0")] == ["a2"] and planner.view.hints("r1") == ()
    assert all("a1" not in held(planner, w) for r in ("r0", "r1") for w in planner.view.workers(r))
    plan = planner.plan(1.5)
    assert all(c.adapter != "a1" for w in plan.workers for c in w.commands)
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'a1'"):
        popularity(planner, "a1", 1.5)
    planner.check_integrity()


def test_a_paged_gpu_pool_is_counted_in_whole_pages() -> None:
    """Issue 43: a worker whose GPU pool has pages reports its bytes and page; the planner counts each shard in
    whole pages (a 60-byte shard takes a 100-byte page), so it plans what the pages hold, not what the bytes
    would: 4 of the 8 queued adapters in 400 bytes of 100-byte pages, where 6 fit in 400 plain bytes."""
    waiting = [f"a{i}" for i in range(8)]
    planner = make("queue", slots=8, tp=1, bytes_per_rank=60, bytes_per_worker=400, max_prefetches_per_plan=8)
    queue(planner, "r0", *waiting)
    assert prefetched(planner.plan(1.0), "r0/w0") == waiting[:6]
    planner = make("queue", slots=8, tp=1, bytes_per_rank=60, bytes_per_worker=400, max_prefetches_per_plan=8)
    planner.set_capacity("r0/w0", 8, 400, None, page_bytes=100)
    queue(planner, "r0", *waiting)
    assert prefetched(planner.plan(1.0), "r0/w0") == waiting[:4]
    with pytest.raises(PlannerInputError, match="page_bytes of worker 'r0/w0' is 0"):
        planner.set_capacity("r0/w0", 8, 400, None, page_bytes=0)
