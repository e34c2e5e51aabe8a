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
