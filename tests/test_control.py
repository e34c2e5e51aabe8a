"""Controller core + worker command gate, wired without Ray: queue -> plan -> loads -> readiness."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.controller.core import NO_ROOM_RETRY_S, ControllerConfig, ControllerCore
from lora_cache.controller.fanout import WorkerFanout
from lora_cache.controller.links import PING_MISSES, Link, WorkerLinks
from lora_cache.errors import ConfigError, ConflictError, NotFoundError
from lora_cache.planner import PlannerConfig
from lora_cache.routing.advice import RouteRequest
from lora_cache.vocab import AdapterKey, Delta, Evict, Prefetch, Ranking, Stage, WorkerId, delta_row, worker_name
from tests.planner_queries import popularity
from workers.cache import WorkerCache, WorkerConfig
from workers.control.commands import CommandGate
from workers.staging.host_config import HostTierConfig


class Outbox:
    """Collects a worker's deltas; ``wait(n)`` blocks until n arrived (no sleeps)."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.cond = threading.Condition()

    def push(self, delta: Delta) -> None:
        with self.cond:
            self.deltas.append(delta)
            self.cond.notify_all()

    def drain(self, states: tuple[str, ...], count: int) -> list[Delta]:
        with self.cond:
            assert self.cond.wait_for(lambda: sum(d.state in states for d in self.deltas) >= count, timeout=30)
            out, self.deltas = self.deltas, []
        return out


@pytest.fixture
def fleet(tmp_path: Path):
    make_adapters(tmp_path, SynthConfig(model="tiny", count=6, rank="8,16"))
    catalog = CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16)
    core = ControllerCore(ControllerConfig(catalog=catalog), epoch=5)
    for d in sorted(tmp_path.iterdir()):
        core.register_adapter(d.name, str(d))
    core.add_replica("r0", tp=2, slots=2)
    workers = {}
    for rank in range(2):
        cache = WorkerCache(WorkerConfig(num_slots=2, tp=2, tp_rank=rank, device="cpu",
                                         host=HostTierConfig(host_bytes=1 << 20, pin=False)), core.catalog)
        outbox = Outbox()
        workers[WorkerId("r0", rank)] = (cache, CommandGate(cache, outbox.push), outbox)
    try:
        yield core, workers
    finally:
        for cache, _, _ in workers.values():
            cache.close()


def _deliver(core: ControllerCore, workers, ready: int):
    events = []
    for wid, (_, _, outbox) in workers.items():
        deltas = outbox.drain(("ready", "failed"), ready)
        events += core.worker_report(wid, [delta_row(0, d)[1:] for d in deltas], now=1.0)
    return events


def test_queue_report_to_replica_readiness(fleet) -> None:
    core, workers = fleet
    core.report_queue("r0", [("adapter-000", 0.0), ("adapter-001", 0.5)], now=1.0)
    plan = core.plan(now=1.0)
    assert set(plan) == set(workers)
    for wid, commands in plan.items():
        assert [c.adapter for c in commands if isinstance(c, Prefetch)] == ["adapter-000", "adapter-001"]
        assert all(c.epoch == 5 for c in commands)
        result = workers[wid][1].apply(commands)
        assert result.accepted == 2 and not result.errors
    events = _deliver(core, workers, ready=2)
    assert sorted((e.adapter, e.ready) for e in events) == [("adapter-000", True), ("adapter-001", True)]
    assert core.readiness.lookup("adapter-000").ready == ("r0",)
    core.check_integrity()


def test_replica_not_ready_until_every_rank(fleet) -> None:
    core, workers = fleet
    core.report_queue("r0", [("adapter-002", 0.0)], now=1.0)
    plan = core.plan(now=1.0)
    rank0 = WorkerId("r0", 0)
    workers[rank0][1].apply(plan[rank0])
    deltas = workers[rank0][2].drain(("ready",), 1)
    assert core.worker_report(rank0, [delta_row(0, d)[1:] for d in deltas], now=1.0) == []
    assert core.readiness.lookup("adapter-002").loading == ("r0",)


def test_stale_epoch_commands_are_rejected(fleet) -> None:
    core, workers = fleet
    _, gate, _ = workers[WorkerId("r0", 0)]
    version = core.catalog.get("adapter-000").version
    assert gate.apply([Prefetch("adapter-000", version, 0, epoch=7)]).accepted == 1
    result = gate.apply([Prefetch("adapter-001", core.catalog.get("adapter-001").version, 0, epoch=6),
                         Evict("adapter-000", version, epoch=6)])
    assert result.rejected_stale == 2 and result.accepted == 0
    assert gate.apply([Prefetch("adapter-000", version, 0, epoch=7)]).accepted == 1  # idempotent repeat


def _sync_all(core: ControllerCore, workers) -> None:
    """Every worker's full residency report (running batches' references included), as after a resync."""
    for wid, (cache, _, outbox) in workers.items():
        with outbox.cond:
            outbox.deltas = []
        core.sync_worker(wid, [(r["adapter"], r["version"], r["state"], r["refs"], r["acquired"])
                               for r in cache.residency()])


def test_a_queued_adapter_without_gpu_room_is_staged_then_loads_from_the_host_tier(fleet) -> None:
    """Both slots run batches: the controller stages the queued adapter on every rank (its shard read into
    the host tier, no slot touched); once a batch ends, the prefetch that follows is a host-tier hit."""
    core, workers = fleet
    running = {}
    for wid, (cache, _, _) in workers.items():
        running[wid] = cache.acquire(["adapter-000", "adapter-001"])
        cache.settle()
    _sync_all(core, workers)
    core.report_queue("r0", [("adapter-002", 0.5)], now=1.0)
    plan = core.plan(now=1.0)
    version = core.catalog.get("adapter-002").version
    for wid, (cache, gate, _) in workers.items():
        assert plan[wid] == [Stage("adapter-002", version, 2, epoch=5)]  # after the two pinned slots
        before = cache.residency()
        assert gate.apply(plan[wid]).accepted == 1
        staged = cache.stage("adapter-002")  # the read the command started (a repeat starts none)
        assert staged is not None and staged.result(timeout=30).key == AdapterKey("adapter-002", version)
        assert cache.residency() == before and cache.stats()["stages"] == 1
    assert core.plan(now=1.0) == {}  # sent once while it stays wanted
    for wid, (cache, _, _) in workers.items():
        cache.release(running[wid])
    _sync_all(core, workers)
    plan = core.plan(now=1.1)
    for wid, (cache, gate, _) in workers.items():
        loads = [c for c in plan[wid] if isinstance(c, Prefetch)]
        assert [c.adapter for c in loads] == ["adapter-002"]
        gate.apply(plan[wid])
        record = cache.prefetch("adapter-002").result(timeout=30)
        assert record.host_hit and record.disk_ms == 0.0
        cache.check_integrity()
    core.check_integrity()


def test_stage_commands_are_epoch_checked_and_a_bad_one_costs_only_itself(fleet) -> None:
    core, workers = fleet
    cache, gate, outbox = workers[WorkerId("r0", 0)]
    version = core.catalog.get("adapter-003").version
    result = gate.apply([Stage("adapter-003", version, 0, epoch=7), Stage("adapter-004", version, 0, epoch=6),
                         Stage("ghost", "v", 1, epoch=7)])
    assert (result.accepted, result.rejected_stale) == (1, 1) and "ghost" in result.errors[0]
    # A stage changes no slot; once its shard is on the host, the host tier reports it (and nothing else).
    staged = outbox.drain(("staged",), 1)  # waits for the read: its delta races the assertions otherwise
    assert staged == [Delta("adapter-003", version, "staged")] and cache.residency() == []
    cache.check_integrity()


def test_the_fleets_ranking_reaches_the_host_tiers_order_epoch_checked_and_without_a_delta(tmp_path: Path) -> None:
    """``global`` with warming on sends each rank the fleet's most requested adapters, most first (``Ranking``); the
    gate hands it whole to the host tier's ``popular`` order, refuses one of an older epoch, touches no slot and
    sends no delta; a tier of another order ignores it."""
    make_adapters(tmp_path, SynthConfig(model="tiny", count=4, rank="8"))
    catalog = CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=8)
    planner = PlannerConfig(place_homes=False, warm_min_miss_s=0.0)  # warm (and rank) without measuring reads
    core = ControllerCore(ControllerConfig(catalog=catalog, planner=planner), epoch=5)
    names = [d.name for d in sorted(tmp_path.iterdir())]
    for name in names:
        core.register_adapter(name, str(tmp_path / name))
    core.add_replica("r0", tp=1, slots=2, host_bytes=1 << 20)
    core.report_queue("r0", [(name, float(t)) for t, name in enumerate(n for i, n in enumerate(names[:3])
                                                                        for _ in range(1 + i))], now=1.0)
    core.report_queue("r0", [], now=1.1)  # served: adapter-002 requested 3 times, adapter-001 twice, adapter-000 once
    rankings = [c for c in core.plan(1.2, full=True)[WorkerId("r0", 0)] if isinstance(c, Ranking)]
    # the requested by rate, then the warm key never requested (staged ahead: kept before a tail write-back)
    assert rankings == [Ranking(("adapter-002", "adapter-001", "adapter-000", "adapter-003"), 5)]
    for eviction, kept in (("popular", list(rankings[0].names)), ("lru", [])):
        cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", host=HostTierConfig(
            host_bytes=1 << 20, pin=False, eviction=eviction)), core.catalog)
        outbox = Outbox()
        gate = CommandGate(cache, outbox.push)
        try:
            assert gate.apply([Ranking(("adapter-003",), 5), rankings[0]]).accepted == 2  # the newer replaces
            stale = gate.apply([Ranking(("adapter-003",), 4)])
            assert (stale.accepted, stale.rejected_stale, stale.errors) == (0, 1, ())
            assert cache.host.order.ranking() == kept
            assert cache.stats()["host_rankings"] == (2 if kept else 0)  # the rankings the order took
            assert outbox.deltas == [] and cache.residency() == []
        finally:
            cache.close()


def test_bad_inputs_are_clear_errors_and_change_nothing(fleet) -> None:
    core, workers = fleet
    before = core.status()
    with pytest.raises(NotFoundError, match="replica 'nope' is not known"):
        core.report_queue("nope", [("adapter-000", 0.0)], now=1.0)
    with pytest.raises(NotFoundError, match="adapter 'ghost' is not registered"):
        core.report_queue("r0", [("adapter-000", 0.0), ("ghost", 0.1)], now=1.0)
    with pytest.raises(NotFoundError, match="adapter 'ghost' is not registered"):
        core.hint("h1", "ghost", "r0", 2.0, now=1.0)
    with pytest.raises(NotFoundError, match="worker r0/5 is not part"):
        core.worker_report(WorkerId("r0", 5), [], now=1.0)
    assert core.status() == before and core.plan(now=1.0) == {}
    _, gate, _ = workers[WorkerId("r0", 0)]
    result = gate.apply([Prefetch("ghost", "v", 0, epoch=5)])  # a bad command costs only itself
    assert result.accepted == 0 and "ghost" in result.errors[0]
    core.check_integrity()


def test_lost_worker_makes_replica_not_ready(fleet) -> None:
    core, workers = fleet
    core.report_queue("r0", [("adapter-000", 0.0)], now=1.0)
    for wid, commands in core.plan(now=1.0).items():
        workers[wid][1].apply(commands)
    _deliver(core, workers, ready=1)
    (event,) = core.worker_lost(WorkerId("r0", 1), gone=False)  # restarted empty and said so
    assert not event.ready and core.readiness.lookup("adapter-000").ready == ()
    replan = core.plan(now=2.0)  # the queued adapter is planned again for the restarted rank
    assert [c.adapter for c in replan[WorkerId("r0", 1)]] == ["adapter-000"]


def test_a_lost_replica_leaves_the_hints_and_the_plans_until_it_returns(fleet) -> None:
    """Issue 35 item 1: hints to a replica whose rank was lost (dead, hung, detached) were still taken and
    planned, and commands sent to its surviving rank. Now the replica takes no hints and gets no plans
    until the rank is heard from; then the ranks whose plans were withheld are resynced (``returned``)."""
    core, _ = fleet
    lost = WorkerId("r0", 1)
    core.worker_lost(lost, now=5.0)
    assert core.status()["lost_ranks"] == {"r0/1": 5.0}
    (outcome,) = core.hint_batches([[("h-lost", "adapter-001", "r0", 0.0)]], now=1.0)
    assert (outcome.accepted, outcome.ignored) == (0, 1), "a hint to a lost replica was taken"
    assert not core.hint("h-lost-2", "adapter-001", "r0", 0.0, now=1.0)
    core.report_queue("r0", [("adapter-000", 0.0)], now=1.0)
    assert core.plan(now=2.0) == {} and core.plan(now=2.0, full=True) == {}, "planned for a lost replica"
    assert core.lost.returned() == []
    core.sync_worker(lost, [])  # it answered its full report: alive, empty
    assert core.lost.returned() == [WorkerId("r0", 0), lost], "the withheld ranks are resynced on return"
    assert "adapter-000" in [c.adapter for c in core.plan(now=3.0, full=True)[lost]]
    (outcome,) = core.hint_batches([[("h-back", "adapter-001", "r0", 0.0)]], now=3.0)
    assert outcome.accepted == 1
    core.check_integrity()


def test_a_replica_with_a_lost_rank_is_not_routed_to_until_the_rank_is_heard_from(fleet) -> None:
    """Issue 31: after a replica's rank was lost, Route still ranked the replica first for most cold adapters.
    Now a lost rank (dead, hung or detached: not a restart that answers) takes its replica out of the advice
    until the rank reports again; with every replica out, Route says so instead of advising a dead one."""
    core, _ = fleet
    core.add_replica("r1", tp=1, slots=2)
    cold = [RouteRequest(f"adapter-00{i}") for i in range(6)]

    def picked() -> set[str]:
        return {r.replica for advice in core.route(cold) for r in advice.ranked}

    assert picked() == {"r0", "r1"}
    core.worker_lost(WorkerId("r0", 1))
    assert picked() == {"r1"}
    core.check_integrity()
    core.worker_lost(WorkerId("r1", 0))
    with pytest.raises(ConflictError, match="every replica has a rank that is lost"):
        core.route(cold)
    core.sync_worker(WorkerId("r0", 1), [])  # it answered its full report: alive, if empty
    assert picked() == {"r0"}
    core.worker_report(WorkerId("r1", 0), [], now=3.0)  # a report of any kind: alive
    assert picked() == {"r0", "r1"}
    core.worker_lost(WorkerId("r1", 0), gone=False)  # restarted empty and said so: still routable
    assert picked() == {"r0", "r1"}
    core.check_integrity()


def test_a_failed_load_is_retried_after_a_backoff_not_in_a_loop(fleet) -> None:
    """A prefetch the worker refuses at once still reports 'failed'; the planner keeps it counted as
    loading (no tight retry loop) until the backoff passes, then plans it again; success clears it."""
    core, workers = fleet
    rank0 = WorkerId("r0", 0)
    cache, gate, outbox = workers[rank0]
    core.report_queue("r0", [("adapter-000", 0.0)], now=1.0)
    commands = core.plan(now=1.0)[rank0]
    cache.catalog.unregister("adapter-000")  # the worker cannot load it now: refused synchronously
    assert gate.apply(commands).errors
    (failed,) = outbox.drain(("failed",), 1)
    assert "adapter-000" in failed.error
    core.worker_report(rank0, [(failed.adapter, failed.version, failed.state, failed.error)], now=1.0)
    assert core.status()["load_failures"] == 1 and "adapter-000" in core.status()["recent_failures"][0]
    core.retry_failed(now=1.2)
    assert rank0 not in core.plan(now=1.2)  # backing off: nothing re-sent
    assert rank0 not in core.plan(now=1.3, full=True)
    core.retry_failed(now=1.6)  # 0.5 s after the first failure
    retried = core.plan(now=1.6)[rank0]
    assert [c.adapter for c in retried] == ["adapter-000"]
    cache.catalog.register("adapter-000", core.paths["adapter-000"])
    assert not gate.apply(retried).errors
    ready = [d for d in outbox.drain(("ready",), 1) if d.state == "ready"]
    core.worker_report(rank0, [delta_row(0, d)[1:] for d in ready], now=2.0)
    assert not core.failures
    core.check_integrity()


def test_a_prefetch_without_room_is_planned_again_soon_and_is_no_failure(fleet) -> None:
    """Issue 46 (back-pressure, not failure): a prefetch that finds both slots held by a running batch reports
    "no_room"; the controller counts it apart (``prefetch_no_room``; no load failure, none in recent failures),
    keeps it counted as loading for ``NO_ROOM_RETRY_S``, never doubled, then plans it again; once the batch let go,
    it loads. (Before: "failed", a load failure with its doubling backoff.)"""
    core, workers = fleet
    rank0 = WorkerId("r0", 0)
    cache, gate, outbox = workers[rank0]
    held = cache.acquire(["adapter-001", "adapter-002"])
    cache.settle()
    outbox.drain(("ready",), 2)
    for round_ in range(2):  # twice: the backoff stays NO_ROOM_RETRY_S
        t = 1.0 + round_
        core.report_queue("r0", [("adapter-000", t)], now=t)
        commands = core.plan(now=t)[rank0]
        assert [c.adapter for c in commands if isinstance(c, Prefetch)] == ["adapter-000"]
        assert not gate.apply(commands).errors
        (no_room,) = [d for d in outbox.drain(("no_room",), 1) if d.state == "no_room"]
        core.worker_report(rank0, [delta_row(0, no_room)[1:]], now=t)
        status = core.status()
        assert (status["load_failures"], status["prefetch_no_room"]) == (0, round_ + 1)
        assert status["recent_failures"] == [] and not any(d.state == "failed" for d in outbox.deltas)
        core.retry_failed(now=t + NO_ROOM_RETRY_S / 2)
        assert rank0 not in core.plan(now=t + NO_ROOM_RETRY_S / 2)  # not in a tight loop
        core.retry_failed(now=t + NO_ROOM_RETRY_S)
    cache.release(held)
    retried = core.plan(now=3.0)[rank0]
    assert [c.adapter for c in retried if isinstance(c, Prefetch)] == ["adapter-000"]
    assert not gate.apply(retried).errors
    ready = [d for d in outbox.drain(("ready",), 1) if d.state == "ready" and d.adapter == "adapter-000"]
    core.worker_report(rank0, [delta_row(0, d)[1:] for d in ready], now=3.1)
    assert not core.failures
    core.check_integrity()


def test_resync_repairs_a_lost_ready_and_publishes_nothing_when_nothing_changed(fleet) -> None:
    core, workers = fleet
    core.report_queue("r0", [("adapter-001", 0.0)], now=1.0)
    for wid, commands in core.plan(now=1.0).items():
        workers[wid][1].apply(commands)
    for _, _, outbox in workers.values():
        outbox.drain(("ready",), 1)  # the deltas are lost on the way
    assert core.readiness.lookup("adapter-001").ready == ()
    events = []
    for wid, (cache, _, _) in workers.items():
        full = [(r["adapter"], r["version"], r["state"], r["refs"]) for r in cache.residency()]
        events += core.sync_worker(wid, full)
    assert [(e.adapter, e.ready) for e in events] == [("adapter-001", True)]
    assert core.readiness.lookup("adapter-001").ready == ("r0",)
    for wid, (cache, _, _) in workers.items():  # a second resync finds nothing new
        full = [(r["adapter"], r["version"], r["state"], r["refs"]) for r in cache.residency()]
        assert core.sync_worker(wid, full) == []
    assert core.plan(now=2.0) == {}
    core.check_integrity()


def test_popular_adapters_are_staged_into_the_host_tier_the_worker_reports(tmp_path: Path) -> None:
    """Issue 20 item 4 end to end on CPU: a replica added with its workers' host tier (as ``describe`` reports
    it) gets Stage commands for its popular adapters, most requested first, within that tier; the worker's
    gate reads them into its host tier with no slot, so a later miss is one copy."""
    make_adapters(tmp_path, SynthConfig(model="tiny", count=6, rank="8,16"))
    catalog = CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16)
    # homes off: with them, the top two would fill the free slots (test_homes.py); here staging is the subject
    # (and warm stages: test_warming.py)
    planner = PlannerConfig(place_homes=False, warm_host_share=0.0)
    core = ControllerCore(ControllerConfig(catalog=catalog, planner=planner), epoch=5)
    names = [d.name for d in sorted(tmp_path.iterdir())]
    for name in names:
        core.register_adapter(name, str(tmp_path / name))
    host_bytes = 1 << 20
    core.add_replica("r0", tp=1, slots=2, host_bytes=host_bytes)
    assert core.planner.view.capacity("r0/0").host_bytes == host_bytes
    cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", host=HostTierConfig(host_bytes=host_bytes, pin=False)),
                        core.catalog)
    try:
        gate = CommandGate(cache, Outbox().push)
        arrivals = [(name, float(t)) for t, name in enumerate(n for i, n in enumerate(names) for _ in range(6 - i))]
        core.report_queue("r0", arrivals, now=1.0)  # adapter i requested 6 - i times
        core.report_queue("r0", [], now=1.1)  # all served
        commands = core.plan(1.2, full=True).get(WorkerId("r0", 0), [])
        stages = [c.adapter for c in commands if isinstance(c, Stage)]
        assert stages and not [c for c in commands if isinstance(c, Prefetch)]  # well under 0.5 requests/s
        assert stages == sorted(stages, key=lambda n: popularity(core.planner, n, 1.2) /
                                core.planner.view.adapter(n).bytes_per_rank, reverse=True)
        assert sum(core.planner.view.adapter(n).bytes_per_rank for n in stages) <= host_bytes
        gate.apply(commands)
        for name in stages:
            entry = cache.stage(name)  # idempotent: the read the command started, or its entry
            assert entry is not None and entry.result(timeout=30) is not None
            assert cache.host.contains(AdapterKey(name, core.planner.view.adapter(name).version))
        assert cache.stats()["host_bytes_used"] <= host_bytes and cache.residency() == []  # no slot taken
    finally:
        cache.close()


def test_a_rank_is_believed_only_for_registered_versions_within_its_slots(fleet) -> None:
    """Issue 35 item 2: a rank's READY for an adapter never registered (or a version the controller does not
    know) made its replica ready for it; a rank could claim more adapters than it has slots. Such claims are
    refused and counted; a removal is always believed. (The claims say their engine's acquire started the loads:
    issue 46 refuses any other claim the controller did not command, tests/test_claims.py.)"""
    core, _ = fleet
    r0, r1 = WorkerId("r0", 0), WorkerId("r0", 1)
    version = core.catalog.get("adapter-000").version
    for rank in (r0, r1):
        assert core.worker_report(rank, [("ghost", "v1", "ready", "", 0.0, True),
                                         ("adapter-000", "forged", "ready", "", 0.0, True)], now=1.0) == []
    assert core.readiness.counts()["held"] == 0 and core.status()["refused_reports"] == 4
    assert "ghost@v1 is not a registered version" in core.status()["recent_refusals"][0]
    events = [e for rank in (r0, r1)
              for e in core.worker_report(rank, [("adapter-000", version, "ready", "", 0.0, True)], 1.0)]
    assert [e.ready for e in events] == [True], "a registered version is believed"
    others = [(f"adapter-00{k}", core.catalog.get(f"adapter-00{k}").version) for k in (1, 2, 3)]
    core.worker_report(r0, [(a, v, "ready", "", 0.0, True) for a, v in others], now=1.0)  # 2 slots: one more fits
    assert len(core.readiness.holdings("r0", 0)) == 2 and core.status()["refused_reports"] == 6
    core.sync_worker(r1, [(a, v, "ready", 0, True) for a, v in [("adapter-000", version), *others]])
    assert len(core.readiness.holdings("r0", 1)) == 2, "a full report beyond the slots"
    assert ("adapter-000", version) in core.readiness.holdings("r0", 1), "what it held first is kept"
    core.worker_report(r0, [("adapter-000", version, "gone", "")], now=1.0)
    assert ("adapter-000", version) not in core.readiness.holdings("r0", 0)
    core.check_integrity()


def test_a_replica_shape_is_bounded_and_a_replica_with_no_rank_left_leaves(fleet) -> None:
    """Issue 35 item 2: tp=100000 was adopted (100 MB of controller memory), 0 slots taken."""
    core, _ = fleet
    for tp, slots, fragment in [(100_000, 2, "tp is 100000; give an integer from 1 to 64"),
                                (1, 0, "slots is 0; give an integer from 1 to 65536"),
                                (1, 10**9, "slots is 1000000000; give an integer from 1 to 65536")]:
        with pytest.raises(ConfigError, match=fragment):
            core.add_replica("forged", tp=tp, slots=slots)
    assert "forged" not in core.planner.view.replicas()
    version = core.catalog.get("adapter-000").version
    for rank in (0, 1):
        core.worker_report(WorkerId("r0", rank), [("adapter-000", version, "ready", "", 0.0, True)], now=1.0)
    core.hint("h1", "adapter-001", "r0", 0.0, now=1.0)
    (event,) = core.remove_replica("r0")
    assert not event.ready and core.planner.view.replicas() == () and core.readiness.counts()["replicas"] == 0
    with pytest.raises(NotFoundError):
        core.hint("h2", "adapter-001", "r0", 0.0, now=1.0)
    core.check_integrity()


class _Method:
    """``handle.method.remote(...)`` of a worker in this process: an awaitable, as Ray's ObjectRef is."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self.fn(*args))


class _LifelineWorker:
    """A worker whose lifeline is a real TCP connection to the controller's links; ``die`` drops it as the
    kernel does for a killed process; ``describe`` fails while it is dead."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report, self.dead, self.writer = report, False, None
        self.lifeline, self.describe, self.ping = _Method(self._lifeline), _Method(self._describe), _Method(self._ping)

    async def _lifeline(self, host: str, port: int, nonce: str) -> None:
        reader, self.writer = await asyncio.open_connection(host, port)
        self.writer.write(f"{nonce}\n".encode())
        await self.writer.drain()
        await reader.read()

    async def _describe(self) -> dict[str, Any]:
        if self.dead:
            raise ConnectionError("the worker is dead")
        return self.report

    async def _ping(self) -> bool:
        if self.dead:
            raise ConnectionError("the worker is dead")
        return True

    def die(self) -> None:
        self.dead = True
        self.writer.transport.abort()


def _victim_links(core: ControllerCore, worker: Any, publish: Any = lambda events: None) -> WorkerLinks:
    """Links to replica r0's two ranks, both linked at incarnation 1: rank 1 is ``worker`` (the one under test),
    rank 0 a stand-in. Built inside the test's event loop."""

    async def replan() -> None:
        pass

    links = WorkerLinks(core, None, publish, replan, find=lambda name: None, named=lambda: [])  # type: ignore[arg-type]
    for rank in (0, 1):
        links.handles[WorkerId("r0", rank)] = worker if rank == 1 else object()
        links.links[WorkerId("r0", rank)] = Link(1, 0)
    return links


SCENARIO_S = 30.0  # a lifeline scenario that has not ended by then hangs: fail it, never wait out CI


async def _until(condition: Any, what: str) -> None:
    """Wait for ``condition()`` (the state the next step needs), failing with ``what`` past ``SCENARIO_S``."""
    deadline = asyncio.get_running_loop().time() + SCENARIO_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {SCENARIO_S:.0f} s: {what}"
        await asyncio.sleep(0.001)


def _heard(links: WorkerLinks) -> bool:
    """The controller has read a lifeline's hello: its end now counts (the barrier before a worker dies)."""
    return bool(links.lifelines._heard)


def test_a_closed_lifeline_loses_the_rank_at_once_and_its_late_deltas_are_not_believed(fleet) -> None:
    """Issue 35 item 1: a rank's death reached the controller only at the next failed ping or the restarted
    worker's hello (Lookup said READY for up to 1.4 s), and deltas the dead rank had sent before dying
    brought its readiness back. Now the end of its lifeline loses it at once; until a full report answered
    after the loss, nothing it sent is believed."""
    core, _ = fleet
    version = core.catalog.get("adapter-000").version
    victim = WorkerId("r0", 1)
    published: list[Any] = []

    async def scenario() -> None:
        worker = _LifelineWorker({"incarnation": 2, "seq": 0, "residency": []})
        links = _victim_links(core, worker, published.extend)
        for rank in (0, 1):
            links.receive(worker_name(WorkerId("r0", rank)), 1, [(1, "adapter-000", version, "ready", "", 0.0, True)])
        assert core.readiness.lookup("adapter-000").ready == ("r0",)
        links.lifelines.watch(victim, worker)
        await _until(lambda: _heard(links), "the lifeline's hello read")
        worker.die()
        await _until(lambda: victim in core.lost.down, "the rank lost at its lifeline's end")
        assert core.readiness.lookup("adapter-000").ready == (), "ready after the rank was lost"
        assert not links.receive(worker_name(victim), 1, [(2, "adapter-000", version, "ready", "")])
        await asyncio.sleep(0.05)  # the resync it triggered fails (dead): nothing comes back
        assert core.readiness.lookup("adapter-000").ready == () and victim in core.lost.down
        worker.dead = False  # it answers again (a restart), empty: back, and not ready until it reloads
        await links.resync(victim)
        assert victim not in core.lost.down and core.readiness.lookup("adapter-000").ready == ()
        links.lifelines.close()

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_S))
    core.check_integrity()


class _RestartingWorker(_LifelineWorker):
    """A worker under a name whose actor restarted: its lifeline calls fail before they connect (Ray failing a call
    sent while the actor restarted, after the new process is up), ``fails`` times, then connect."""

    def __init__(self, report: dict[str, Any], fails: int) -> None:
        super().__init__(report)
        self.fails, self.calls = fails, 0

    async def _lifeline(self, host: str, port: int, nonce: str) -> None:
        self.calls += 1
        if self.calls <= self.fails:
            raise ConnectionError("the actor is restarting (the call never reached it)")
        await super()._lifeline(host, port, nonce)


def test_a_lifeline_call_that_never_connected_is_not_a_death(fleet, monkeypatch) -> None:
    """The CI's stop 47 (tests/test_ray_hardening.py): after a rank's SIGKILL and restart, a lifeline call sent
    while it restarted failed once the new process had reported, and that failure lost the healthy rank again (its
    replica left the routes until the next resync). A failed call that never opened its connection says nothing
    of the process under the name: the rank stays, the lifeline is called again (ever less often) until it
    connects; one that had connected and then failed is a death."""
    import lora_cache.controller.lifelines as lifelines

    monkeypatch.setattr(lifelines, "LIFELINE_RETRY_S", 0.01)
    core, _ = fleet
    victim = WorkerId("r0", 1)

    async def scenario() -> None:
        worker = _RestartingWorker({"incarnation": 2, "seq": 0, "residency": []}, fails=3)
        links = _victim_links(core, worker)
        links.lifelines.watch(victim, worker)
        await _until(lambda: _heard(links), "three failed calls, then a connected one")
        assert worker.calls == 4 and not core.lost.down, "a lifeline call that never connected lost the rank"
        worker.die()  # the connected one ends: a death
        await _until(lambda: victim in core.lost.down, "the rank lost at its lifeline's end")
        links.lifelines.close()

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_S))
    core.check_integrity()


class _KilledWorker(_LifelineWorker):
    """A killed worker's lifeline call as Ray ends it: the connection ends at the kill (the kernel closes it), the
    call itself fails only later, when ``failed`` is set (Ray answers it once the restarted process is up)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report)
        self.failed = asyncio.Event()

    async def _lifeline(self, host: str, port: int, nonce: str) -> None:
        await super()._lifeline(host, port, nonce)
        await self.failed.wait()
        raise ConnectionError("ActorUnavailableError: the actor restarted")


def test_a_killed_ranks_lifeline_call_failing_after_its_restart_does_not_lose_it_again(fleet) -> None:
    """The kill is counted once, at the connection's end; the call's own failure arrives after the restarted
    process reported (measured: 0.3-0.8 s after it was up), and must not lose the healthy rank again."""
    core, _ = fleet
    victim = WorkerId("r0", 1)

    async def scenario() -> None:
        worker = _KilledWorker({"incarnation": 2, "seq": 0, "residency": []})
        links = _victim_links(core, worker)
        links.lifelines.watch(victim, worker)
        await _until(lambda: _heard(links), "the lifeline's hello read")
        worker.die()  # the kill: its connection ends, the rank is lost at once
        await _until(lambda: victim in core.lost.down, "the rank lost at its lifeline's end")
        worker.dead = False
        await links.resync(victim)  # the restarted process reported: back
        assert victim not in core.lost.down
        worker.failed.set()  # only now does Ray fail the killed process's call
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert victim not in core.lost.down, "the killed process's call, failing late, lost the restarted rank"
        links.lifelines.close()

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_S))
    core.check_integrity()


class _SlowPingWorker(_LifelineWorker):
    """A rank whose pings fail while it is dead (Ray restarting it) and, once back, are answered only when
    ``answer`` is set (a process just restarted on a loaded machine): a round's ping waits for it at most
    the links' ``ping_timeout_s``."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report)
        self.answer = asyncio.Event()

    async def _ping(self) -> bool:
        if self.dead:
            raise ConnectionError("ActorUnavailableError: the actor is restarting")
        await self.answer.wait()
        return True


def test_a_restarted_rank_starts_its_count_of_missed_pings_again(fleet) -> None:
    """The fresh-clone CI of stop 56: a rank SIGKILLed by one test and restarted by Ray (the same actor handle) was
    lost again at the next test's first slow ping, because the pings that failed while it restarted were still
    counted: one slow answer lost a rank, whatever ``PING_MISSES`` said. A new incarnation starts the count again,
    and a round sent before it reported does not count against it."""
    core, _ = fleet
    victim = WorkerId("r0", 1)

    async def scenario() -> None:
        worker = _SlowPingWorker({"incarnation": 2, "seq": 0, "residency": []})
        links = _victim_links(core, worker)
        links.handles[WorkerId("r0", 0)] = _LifelineWorker({})  # the stand-in answers its pings
        links.ping_timeout_s = 0.05
        worker.dead = True  # Ray restarts it: every ping fails, more than PING_MISSES in a row
        for _ in range(PING_MISSES + 1):
            await links.ping_all()
        assert victim in core.lost.down
        worker.dead = False
        stale = asyncio.ensure_future(links.ping_all())  # a round sent to the restarting process, answered late
        await asyncio.sleep(0)
        await links.resync(victim)  # the restarted process (incarnation 2) reported: back
        assert victim not in core.lost.down
        await stale
        assert victim not in core.lost.down, "a round sent before the restart reported counted against the new one"
        for missed in range(1, PING_MISSES):
            await links.ping_all()  # the new process misses pings (loaded), fewer than PING_MISSES in a row
            assert victim not in core.lost.down, f"a restarted rank lost after {missed} missed ping(s)"
        await links.ping_all()
        assert victim in core.lost.down, f"{PING_MISSES} missed pings in a row did not lose the restarted rank"
        worker.answer.set()
        await links.resync(victim)
        await links.ping_all()
        assert victim not in core.lost.down and victim not in links.missed
        links.lifelines.close()

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_S))
    core.check_integrity()


class _LateHelloWorker(_LifelineWorker):
    """A process killed just after it opened its lifeline, on a loaded loop: its call fails before the controller
    has read the connection's hello, which is read (and the connection's end seen) only when ``hello_and_die``
    sends it. Every later call fails before it connects (the name's process is gone or restarting)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report)
        self.nonce: str | None = None

    async def _lifeline(self, host: str, port: int, nonce: str) -> None:
        if self.nonce is not None:
            raise ConnectionError("the actor is restarting (the call never reached it)")
        _, self.writer = await asyncio.open_connection(host, port)
        self.nonce = nonce
        raise ConnectionError("ActorDiedError: killed")

    async def hello_and_die(self) -> None:
        self.writer.write(f"{self.nonce}\n".encode())
        await self.writer.drain()
        self.writer.close()


@pytest.mark.parametrize("restarted", [False, True], ids=["same-process", "restarted-meanwhile"])
def test_a_lifeline_whose_hello_is_read_after_its_call_failed_still_counts_for_its_own_process(
        fleet, restarted: bool) -> None:
    """The CI's stop 48 hung here: a process killed right after connecting, whose call ended before the hello
    was read, was never lost (its hello read as a stranger's; pings were the only way left). A late hello still
    counts, for the process its call was sent to: the rank is lost, unless a newer incarnation has reported
    meanwhile (that restarted process is not lost again for its predecessor's connection)."""
    core, _ = fleet
    victim = WorkerId("r0", 1)

    async def scenario() -> None:
        worker = _LateHelloWorker({"incarnation": 2, "seq": 0, "residency": []})
        links = _victim_links(core, worker)
        links.lifelines.watch(victim, worker)
        await _until(lambda: worker.nonce is not None and worker.nonce not in links.lifelines._expected,
                     "the first call failed")
        assert not core.lost.down, "a call that failed before its hello was read counted as a death"
        if restarted:
            await links.resync(victim)  # the restarted process (incarnation 2) reported
        await worker.hello_and_die()
        nonce = worker.nonce
        await _until(lambda: nonce not in links.lifelines._ended and nonce not in links.lifelines._connected,
                     "the late hello read and its connection's end seen")
        assert (victim in core.lost.down) is not restarted, (
            "a restarted rank lost for its predecessor's connection" if restarted else
            "a process whose hello was read after its call failed was never lost")
        links.lifelines.close()

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_S))
    core.check_integrity()


def test_a_stopping_service_does_not_take_its_workers_orderly_deaths_for_losses(fleet, caplog) -> None:
    """``Service.stop`` tells the controller to stop watching before it kills anything (the sixth stop's CI
    saw "worker replica-0/0 is lost" at an orderly shutdown: Ray fails calls on a killed controller before
    its process is gone, so killing it first was not enough). After ``quiesce`` neither a closed lifeline,
    a failed ping nor a lost command is a loss, and nothing is logged as one."""
    core, _ = fleet
    version = core.catalog.get("adapter-000").version
    victim = WorkerId("r0", 1)

    async def replan() -> None:
        pass

    async def scenario() -> None:
        links = WorkerLinks(core, None, lambda events: None, replan, find=lambda name: None,  # type: ignore[arg-type]
                            named=lambda: [])
        worker = _LifelineWorker({"incarnation": 2, "seq": 0, "residency": []})
        for rank in (0, 1):
            links.handles[WorkerId("r0", rank)] = worker
            links.links[WorkerId("r0", rank)] = Link(1, 0)
            links.receive(worker_name(WorkerId("r0", rank)), 1, [(1, "adapter-000", version, "ready", "", 0.0, True)])
        links.lifelines.watch(victim, worker)
        await _until(lambda: _heard(links), "the lifeline's hello read")
        links.quiesce()
        links.lifelines.watch(WorkerId("r0", 0), worker)  # a late watch starts nothing
        assert links.lifelines.tasks == {}
        worker.die()
        await links.ping_all()
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(ConnectionError("the worker is dead"))
        await links._collect(victim, failed)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:  # the lifeline's server side reads the connection's end before this looks
            await asyncio.wait(others, timeout=10)
        assert not core.lost.down and core.readiness.lookup("adapter-000").ready == ("r0",)

    with caplog.at_level("WARNING", logger="lora_cache.controller"):
        asyncio.run(scenario())
    assert not [r.getMessage() for r in caplog.records], "an orderly stop was reported as losses"
    core.check_integrity()


def test_stats_leave_out_a_replica_that_left_the_fleet_while_its_workers_were_asked(fleet) -> None:
    """Found by the Ray Serve test: a replica whose attached ranks all went was removed while ``stats`` awaited
    its workers, and ``Status`` then failed NOT_FOUND for every caller ('unknown worker ... in capacity')."""
    core, _ = fleet
    asked = asyncio.Event()

    class _Slow:
        class stats:
            @staticmethod
            def remote() -> Any:
                async def answer() -> dict[str, int]:
                    asked.set()
                    await asyncio.sleep(0.05)
                    return {"loads": 0}
                return answer()

    async def replan() -> None:
        pass

    async def scenario() -> list[dict[str, object]]:
        links = WorkerLinks(core, None, lambda events: None, replan, find=lambda name: None,  # type: ignore[arg-type]
                            named=lambda: [])
        core.add_replica("r1", tp=1, slots=2)
        for wid in (WorkerId("r0", 0), WorkerId("r1", 0)):
            links.handles[wid] = _Slow()
        task = asyncio.ensure_future(WorkerFanout(links).stats(5.0))
        await asked.wait()
        core.remove_replica("r1")  # its ranks are gone while the call is out
        return await task

    rows = asyncio.run(scenario())
    assert [row["worker"] for row in rows] == [worker_name(WorkerId("r0", 0))]
    core.check_integrity()


class _SilentWorker:
    """A worker Ray holds calls to (its node was lost, its restart waits for a node): ``describe`` answers only
    once ``wake`` is set; ``register_adapters`` records what it was given."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report, self.wake, self.given = report, asyncio.Event(), []
        self.describe, self.register_adapters = _Method(self._describe), _Method(self._register)

    async def _describe(self) -> dict[str, Any]:
        await self.wake.wait()
        return self.report

    async def _register(self, entries: list[Any]) -> list[tuple[str, str]]:
        self.given += [e[0] for e in entries]
        return [(e[0], "") for e in entries]


def test_a_restarted_controller_serves_while_a_rank_of_a_lost_node_does_not_answer(fleet) -> None:
    """Issue 35, the node-loss failure of the fresh-clone CI: the controller was on the lost node; restarted on
    the head, its rebuild awaited ``describe`` of the lost node's workers, which Ray holds until they are placed
    again (never, until a node comes): no Lookup answered for more than 30 s. Now the rebuild asks for
    ``call_timeout_s``, adopts who answered, counts the silent rank lost (its replica ready for nothing) and
    adopts it when it answers, giving it every registration."""
    core, _ = fleet
    version = core.catalog.get("adapter-000").version
    shape = {"replica": "r0", "tp": 2, "slots": 2, "host_bytes": 1 << 20, "incarnation": 1, "seq": 0,
             "adapters": {}}
    answering = _SilentWorker({**shape, "rank": 0, "residency": [("adapter-000", version, "ready", 0)]})
    answering.wake.set()
    silent = _SilentWorker({**shape, "rank": 1, "residency": []})
    handles = {worker_name(WorkerId("r0", 0)): answering, worker_name(WorkerId("r0", 1)): silent}

    async def replan() -> None:
        pass

    async def scenario() -> None:
        links = WorkerLinks(core, None, lambda events: None, replan, find=handles.__getitem__,  # type: ignore[arg-type]
                            named=lambda: list(handles), call_timeout_s=0.2)
        await asyncio.wait_for(links.adoption.rebuild(), 5)  # before: waited for the silent worker forever
        assert set(links.handles) == {WorkerId("r0", 0)} and WorkerId("r0", 1) in core.lost.down
        assert core.readiness.lookup("adapter-000").ready == (), "ready with a rank that never answered"
        links.adoption.adopt_late()  # the health loop's call: still silent, still lost
        await asyncio.sleep(0.3)
        assert WorkerId("r0", 1) in core.lost.down and WorkerId("r0", 1) not in links.handles
        silent.wake.set()  # placed again (empty): it answers, and says it started
        assert not await links.worker_started(worker_name(WorkerId("r0", 1)), 1, False)
        assert WorkerId("r0", 1) in links.handles and WorkerId("r0", 1) not in core.lost.down
        assert set(silent.given) == set(core.paths), "an adopted worker got every registration"
        assert core.readiness.lookup("adapter-000").ready == ()
        while links.adoption.adopting:
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_S))
    core.check_integrity()
