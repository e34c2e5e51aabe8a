"""What each rank's host tier holds, as the controller learns it (issue 42 item 4): routing's STAGED is a shard the
worker reported in its host tier (a load's read, a stage, a warm stage), or a stage for a known request sent and
still wanted; never a warm stage only sent (the worker reads those one at a time when its store is idle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.planner import PlannerConfig
from lora_cache.routing.advice import RouteRequest
from lora_cache.routing.ranking import Residence
from lora_cache.vocab import AdapterKey, Stage, WorkerId

R0, R1 = WorkerId("replica-0", 0), WorkerId("replica-1", 0)


def _core(tiny_adapters: Any, adapters: int = 4, slots: int = 4, **planner: Any) -> tuple[ControllerCore, list[str]]:
    paths: list[Path] = tiny_adapters(adapters)
    catalog = CatalogConfig(adapter_roots=(str(paths[0].parent),), model="tiny", max_rank=16)
    core = ControllerCore(ControllerConfig(catalog, planner=PlannerConfig(policy="global", **planner)), epoch=1)
    for p in paths:
        core.register_adapter(p.name, str(p))
    for wid in (R0, R1):
        core.add_replica(wid.replica, 1, slots, 1 << 30)
    return core, [p.name for p in paths]


def _reasons(core: ControllerCore, adapter: str) -> dict[str, Residence]:
    (advice,) = core.route([RouteRequest(adapter)], {"replica-0": 0.0, "replica-1": 0.0})
    return {r.replica: r.reason for r in advice.ranked}


def test_a_reported_host_copy_is_staged_for_routing_until_it_is_dropped(tiny_adapters: Any) -> None:
    core, names = _core(tiny_adapters, warm_min_miss_s=0.0)  # a miss hurts (warming on from the start)
    a = names[0]
    version = core.planner.view.adapter(a).version
    assert _reasons(core, a) == {"replica-0": Residence.COLD, "replica-1": Residence.COLD}
    core.worker_report(R1, [(a, version, "staged", "", 0.0)], 1.0)
    assert _reasons(core, a)["replica-1"] is Residence.STAGED and _reasons(core, a)["replica-0"] is Residence.COLD
    assert core.planner.view.hosted(str(R1)) == {AdapterKey(a, version)}
    core.worker_report(R1, [(a, version, "unstaged", "", 0.0)], 2.0)
    assert _reasons(core, a)["replica-1"] is Residence.COLD and not core.planner.view.hosted(str(R1))
    core.worker_report(R1, [(a, "an-older-version", "staged", "", 0.0)], 3.0)  # not the version routed
    assert _reasons(core, a)["replica-1"] is Residence.COLD
    core.check_integrity()


def test_host_copies_steer_routing_only_where_a_miss_hurts(tiny_adapters: Any) -> None:
    """On a store whose reads are fast (the gate closed: no read measured slow), a host copy saves a few ms and
    does not outrank a cold replica; once the workers' reads are measured slow it does."""
    core, names = _core(tiny_adapters)  # the default gate
    a = names[0]
    version = core.planner.view.adapter(a).version
    core.worker_report(R1, [(a, version, "staged", "", 0.0)], 1.0)
    core.plan(1.0)
    assert not core.planner.warming and _reasons(core, a)["replica-1"] is Residence.COLD
    nbytes = core.planner.view.max_bytes()
    for _ in range(3):  # reads of the largest shard measured slow (as READY deltas' read_s report them)
        core.clock.read(nbytes, 2 * core.config.planner.warm_min_miss_s)
    core.plan(2.0)
    assert core.planner.warming and _reasons(core, a)["replica-1"] is Residence.STAGED


def test_a_full_report_replaces_the_host_tier_and_a_loss_or_an_unregister_clears_it(tiny_adapters: Any) -> None:
    core, names = _core(tiny_adapters, warm_min_miss_s=0.0)
    a, b = names[:2]
    va, vb = (core.planner.view.adapter(n).version for n in (a, b))
    core.worker_report(R0, [(a, va, "staged", "")], 1.0)
    core.sync_worker(R0, [], host=[(b, vb), ("never-registered", "v1")])  # a resync: its host tier as it is now
    assert core.planner.view.hosted(str(R0)) == {AdapterKey(b, vb)}
    core.sync_worker(R0, [])  # a rank that does not report its host tier: what its deltas said is kept
    assert core.planner.view.hosted(str(R0)) == {AdapterKey(b, vb)}
    core.worker_lost(R0, gone=False)  # restarted: empty
    assert not core.planner.view.hosted(str(R0))
    core.worker_report(R0, [(b, vb, "staged", "")], 2.0)
    core.unregister_adapter(b, 3.0)
    assert not core.planner.view.hosted(str(R0))
    core.check_integrity()


def test_a_warm_stage_only_sent_is_not_staged_for_routing(tiny_adapters: Any) -> None:
    """The warm placement sends speculative stages; routing counts one only once the worker reports it read."""
    core, _ = _core(tiny_adapters, adapters=12, slots=1, warm_min_miss_s=0.0)  # more than the slots hold
    plan = core.plan(0.0, full=True)
    warm = [(wid, c.adapter) for wid, cmds in plan.items() for c in cmds if isinstance(c, Stage) and c.speculative]
    assert warm, "no warm stage sent"
    wid, adapter = warm[0]
    assert _reasons(core, adapter)[wid.replica] is Residence.COLD, "a warm stage counted before it was read"
    core.worker_report(wid, [(adapter, core.planner.view.adapter(adapter).version, "staged", "")], 1.0)
    assert _reasons(core, adapter)[wid.replica] is Residence.STAGED
