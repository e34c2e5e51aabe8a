"""Routing advice from the planner's view (lora_cache.routing.advice): residency per replica, loads, per-item errors."""

from __future__ import annotations

import pytest

from lora_cache.errors import ConflictError, NotFoundError
from lora_cache.planner import (
    AdapterInfo,
    Hint,
    Planner,
    PlannerConfig,
    QueueEntry,
    ReplicaSpec,
    ResidencyEntry,
    SlotState,
)
from lora_cache.routing.advice import RouteRequest, advise, residence
from lora_cache.routing.ranking import Residence, RouterConfig
from lora_cache.vocab import AdapterKey

CONFIG = RouterConfig(min_bound=0.0, sticky=False)


def fleet(replicas: int = 4) -> Planner:
    """r0..rN of two workers, two slots each; adapters a0..a7 at v1."""
    specs = [ReplicaSpec(f"r{r}", (f"r{r}/w0", f"r{r}/w1"), 2) for r in range(replicas)]
    planner = Planner(PlannerConfig(policy="global", max_prefetches_per_plan=0), 1,
                      [AdapterInfo(f"a{i}", "v1", 100) for i in range(8)], specs)
    planner.plan(0.0)
    return planner


def hold(planner: Planner, worker: str, adapter: str, state: SlotState, refcount: int = 0) -> None:
    planner.update_residency(worker, ResidencyEntry(adapter, "v1", state, refcount))


def test_residence_reads_every_rank_and_the_stages() -> None:
    planner = fleet()
    key = AdapterKey("a7", "v1")
    for w in ("r0/w0", "r0/w1"):
        hold(planner, w, "a7", SlotState.READY)
    hold(planner, "r1/w0", "a7", SlotState.IN_USE, 1)
    hold(planner, "r1/w1", "a7", SlotState.LOADING)
    for w in ("r2/w0", "r2/w1"):  # r2's slots are pinned by batches: a queued a7 is staged on its host tiers
        hold(planner, w, "a0", SlotState.IN_USE, 1)
        hold(planner, w, "a1", SlotState.IN_USE, 1)
    planner.report_queue("r2", [QueueEntry("a7", 1.0)], 1.0)
    assert not planner.plan(1.0).is_empty
    hold(planner, "r3/w0", "a7", SlotState.READY)  # one rank of two (not yet replanned): the other has nothing
    got = {r: residence(planner.view, r, key) for r in planner.view.replicas()}
    assert got == {"r0": Residence.READY, "r1": Residence.LOADING, "r2": Residence.STAGED, "r3": Residence.COLD}


def test_a_replica_without_workers_is_cold() -> None:
    planner = fleet(2)
    planner.remove_worker("r1/w0")
    planner.remove_worker("r1/w1")
    assert residence(planner.view, "r1", AdapterKey("a0", "v1")) is Residence.COLD


def test_advice_ranks_by_residence_and_counts_queues_and_hints_as_load() -> None:
    planner = fleet()
    for w in ("r0/w0", "r0/w1"):
        hold(planner, w, "a1", SlotState.READY)
    (advice,) = advise(planner.view, [RouteRequest("a1")], CONFIG)
    assert advice.error is None and advice.ranked[0].replica == "r0" and advice.ranked[0].reason is Residence.READY
    for i in range(3):  # r0 is busy now: 3 queued + 2 hinted, the others idle; bound ceil(1.25 * 6 / 4) = 2
        planner.report_queue("r0", [QueueEntry("a2", float(j)) for j in range(3)], 2.0)
        planner.add_hint(Hint(f"h{i}", "a3", "r0", 5.0), 2.0)
    (advice,) = advise(planner.view, [RouteRequest("a1")], CONFIG)
    assert advice.ranked[-1].replica == "r0" and not advice.ranked[-1].within_bound
    (mine,) = advise(planner.view, [RouteRequest("a1")], CONFIG, loads={"r0": 0.0})  # the router's own count wins
    assert mine.ranked[0].replica == "r0"


def test_bad_items_fail_alone_and_take_no_load() -> None:
    planner = fleet(2)
    items = [RouteRequest("a0"), RouteRequest("ghost"), RouteRequest("a0", "v9"), RouteRequest("a0")]
    out = advise(planner.view, items, CONFIG)
    assert [type(a.error).__name__ if a.error else None for a in out] == [None, "NotFoundError", "ConflictError", None]
    assert "adapter 'ghost' is not registered" in str(out[1].error)
    assert "version 'v9' of adapter 'a0' is not current ('v1')" in str(out[2].error)
    assert {out[0].ranked[0].replica, out[3].ranked[0].replica} == {"r0", "r1"}  # 2 good items, 2 idle replicas
    assert out[0].version == "v1" and out[1].ranked == []


def test_whole_call_errors() -> None:
    with pytest.raises(ConflictError, match="no replicas to route to"):
        advise(Planner(PlannerConfig(), 1, [AdapterInfo("a0", "v1", 100)]).view, [RouteRequest("a0")], CONFIG)
    with pytest.raises(NotFoundError, match=r"loads name unknown replicas \['r9'\]"):
        advise(fleet(2).view, [RouteRequest("a0")], CONFIG, loads={"r9": 1.0})


def test_a_named_version_is_routed_where_that_version_is_ready() -> None:
    """Issue 44 item 3: a request admitted on (or naming) a version kept beside the current one goes where that
    very version is READY, not where the current one is; a reference that names nothing kept fails alone."""
    planner = fleet(3)
    for w in ("r0/w0", "r0/w1"):
        hold(planner, w, "a0", SlotState.READY)  # the current version, v1
    for w in ("r1/w0", "r1/w1"):  # the older version v0, still kept (a request in flight uses it)
        planner.update_residency(w, ResidencyEntry("a0", "v0", SlotState.READY, 0))
    kept = {"v0": "v0", "step-7": "v0", "v1": "v1"}  # versions, and the tag v0 was pushed under

    def resolve(name: str, ref: str) -> str:
        if name != "a0" or ref not in kept:
            raise NotFoundError(f"adapter {name!r} has no version or pushed tag {ref!r} kept")
        return kept[ref]

    items = [RouteRequest("a0@step-7"), RouteRequest("a0", "v0"), RouteRequest("a0"), RouteRequest("a0@v1"),
             RouteRequest("a0@v9"), RouteRequest("ghost@v0")]
    out = advise(planner.view, items, CONFIG, resolve=resolve)
    assert [(a.adapter, a.version) for a in out[:4]] == [("a0", "v0"), ("a0", "v0"), ("a0", "v1"), ("a0", "v1")]
    alone = [advise(planner.view, [i], CONFIG, resolve=resolve)[0] for i in items[:4]]  # each in an idle fleet
    assert [(a.ranked[0].replica, a.ranked[0].reason) for a in alone] == [
        ("r1", Residence.READY), ("r1", Residence.READY), ("r0", Residence.READY), ("r0", Residence.READY)]
    assert all(r.reason is not Residence.READY for r in alone[0].ranked[1:]), "v1's replica ranked READY for v0"
    assert isinstance(out[4].error, NotFoundError) and "'v9'" in str(out[4].error) and out[4].ranked == []
    assert isinstance(out[5].error, NotFoundError) and "adapter 'ghost' is not registered" in str(out[5].error)
    (old,) = advise(planner.view, [RouteRequest("a0", "v0")], CONFIG)  # without a resolver: the current one only
    assert isinstance(old.error, ConflictError)


def test_a_named_version_takes_an_engine_lane_of_its_own() -> None:
    """Two versions of one adapter are two adapters to an engine's ``max_adapters`` (it admits ``A@VERSION`` as a
    row of its own): a replica whose one lane runs ``a0`` is full for ``a0@v0``."""
    from lora_cache.routing.limits import RoutingLimits

    planner = fleet(2)
    for r in ("r0", "r1"):
        for w in (f"{r}/w0", f"{r}/w1"):
            hold(planner, w, "a0", SlotState.READY)
            planner.update_residency(w, ResidencyEntry("a0", "v0", SlotState.READY, 0))
    limits = RoutingLimits()
    for r in ("r0", "r1"):
        limits.declare(r, max_adapters=1, max_running=8)
    out = advise(planner.view, [RouteRequest("a0"), RouteRequest("a0@v0"), RouteRequest("a0")], CONFIG,
                 limits=limits, resolve=lambda name, ref: ref)
    first, named, again = (a.ranked[0].replica for a in out)
    assert named != first, "the named version was sent to the replica whose one lane runs the current version"
    assert again == first, "a second request of the current version left the replica already running it"


def test_a_queued_request_naming_a_version_holds_that_versions_lane() -> None:
    """A waiting request for ``a0@v0`` runs in the engine's lane of ``a0@v0`` (a row of its own), not ``a0``'s: the
    routing limits count it there, as ``Route`` counts a routed one (``_lane``)."""
    from lora_cache.routing.advice import replica_loads
    from lora_cache.routing.limits import RoutingLimits

    planner = fleet(2)
    planner.report_queue("r0", [QueueEntry("a0", 0.0, "v0"), QueueEntry("a0", 0.1), QueueEntry("a0", 0.2, "v1")], 1.0)
    limits = RoutingLimits()
    for r in ("r0", "r1"):
        limits.declare(r, max_adapters=1, max_running=8)
    loads = {r.replica: r for r in replica_loads(planner.view, AdapterKey("a0", "v1"), {}, limits=limits)}
    assert loads["r0"].flying == {"a0@v0": 1, "a0": 2}, loads["r0"].flying
    assert not loads["r1"].flying
