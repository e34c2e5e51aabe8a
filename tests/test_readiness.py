"""The replica-level readiness index: ready only when every rank is (invariant 4)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lora_cache.controller.readiness import RankState, ReadinessIndex
from lora_cache.errors import NotFoundError

READY, LOADING = RankState.READY, RankState.LOADING


def test_replica_ready_only_when_every_rank_is() -> None:
    idx = ReadinessIndex()
    idx.add_replica("r0", 2)
    assert idx.report("r0", 0, "a", "v1", READY) == []
    assert idx.lookup("a").loading == ("r0",) and idx.lookup("a").ready == ()
    (event,) = idx.report("r0", 1, "a", "v1", READY)
    assert event.ready and (event.replica, event.adapter, event.version) == ("r0", "a", "v1")
    assert idx.lookup("a").ready == ("r0",) and idx.is_ready("r0", "a", "v1")
    assert idx.report("r0", 1, "a", "v1", READY) == []  # duplicate report: idempotent
    idx.check_integrity()


def test_losing_a_rank_makes_the_replica_not_ready() -> None:
    idx = ReadinessIndex()
    idx.add_replica("r0", 2)
    idx.report("r0", 0, "a", "v1", READY)
    idx.report("r0", 1, "a", "v1", READY)
    (event,) = idx.drop_rank("r0", 1)
    assert not event.ready and not idx.is_ready("r0", "a", "v1")
    assert idx.lookup("a").loading == ("r0",)
    idx.check_integrity()


def test_versions_are_distinct_and_events_are_filtered_by_cursor() -> None:
    idx = ReadinessIndex()
    idx.add_replica("r0", 1)
    idx.add_replica("r1", 1)
    idx.report("r0", 0, "a", "v1", READY)
    cursor = idx.last_seq
    idx.report("r1", 0, "a", "v2", READY)
    idx.report("r1", 0, "b", "v1", READY)
    assert [e.adapter for e in idx.events_after(cursor)] == ["a", "b"]
    assert [e.replica for e in idx.events_after(0, adapter="a")] == ["r0", "r1"]
    assert [e.version for e in idx.events_after(0, replica="r1", adapter="a")] == ["v2"]


def test_unknown_replica_or_rank_is_a_clear_error() -> None:
    idx = ReadinessIndex()
    idx.add_replica("r0", 2)
    with pytest.raises(NotFoundError, match="replica 'nope' is not known"):
        idx.report("nope", 0, "a", "v", READY)
    with pytest.raises(NotFoundError, match=r"has ranks 0\.\.1, not 2"):
        idx.report("r0", 2, "a", "v", READY)
    assert idx.counts() == {"replicas": 1, "ready": 0, "held": 0}


def test_event_log_is_bounded() -> None:
    idx = ReadinessIndex(max_events=5)
    idx.add_replica("r0", 1)
    for i in range(20):
        idx.report("r0", 0, f"a{i}", "v", READY)
    assert len(idx.events_after(0)) == 5 and idx.last_seq == 20
    idx.check_integrity()


class ReadinessMachine(RuleBasedStateMachine):
    """Random reports, drops and replica changes; ready iff every rank READY, events consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = ReadinessIndex(max_events=50)
        self.tp = {"r0": 1, "r1": 2, "r2": 4}
        for r, t in self.tp.items():
            self.idx.add_replica(r, t)
        self.model: dict[tuple[str, str], dict[int, RankState]] = {}
        self.announced: dict[tuple[str, str], bool] = {}

    @rule(replica=st.sampled_from(["r0", "r1", "r2"]), rank=st.integers(0, 3), adapter=st.sampled_from("abc"),
          state=st.sampled_from([READY, LOADING, None]))
    def report(self, replica: str, rank: int, adapter: str, state: RankState | None) -> None:
        if rank >= self.tp[replica]:
            return
        events = self.idx.report(replica, rank, adapter, "v", state)
        ranks = self.model.setdefault((replica, adapter), {})
        if state is None:
            ranks.pop(rank, None)
        else:
            ranks[rank] = state
        self._check_events(events)

    @rule(replica=st.sampled_from(["r0", "r1", "r2"]), rank=st.integers(0, 3))
    def drop(self, replica: str, rank: int) -> None:
        if rank >= self.tp[replica]:
            return
        for ranks in (v for (r, _), v in self.model.items() if r == replica):
            ranks.pop(rank, None)
        self._check_events(self.idx.drop_rank(replica, rank))

    def _check_events(self, events: list) -> None:
        for e in events:
            assert self.announced.get((e.replica, e.adapter), False) != e.ready, "event repeats the state"
            self.announced[(e.replica, e.adapter)] = e.ready

    @invariant()
    def ready_iff_all_ranks_ready(self) -> None:
        self.idx.check_integrity()
        for (replica, adapter), ranks in self.model.items():
            want = len(ranks) == self.tp[replica] and all(s is READY for s in ranks.values())
            assert self.idx.is_ready(replica, adapter, "v") == want
            assert self.announced.get((replica, adapter), False) == want


TestReadinessMachine = ReadinessMachine.TestCase
TestReadinessMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
