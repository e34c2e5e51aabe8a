"""Issue 46 item 1, the controller's side: a rank's READY is believed only for a load the controller commanded to
it, one its engine's ``acquire`` started (``Delta.acquired``), or, once, what a restarted controller finds it
holding; never beyond its slots; and nothing a rank reports registers an adapter, before or after a restart.

Real parts throughout: the controller's core, CPU ``WorkerCache``s and their ``CommandGate``s for the commanded and
acquired loads, ``WorkerLinks`` and ``Adoption`` for the restart (workers that answer ``describe`` in-process).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.controller.links import WorkerLinks
from lora_cache.routing.advice import RouteRequest
from lora_cache.vocab import Prefetch, WorkerId, delta_row, worker_name
from tests.test_control import Outbox as ControlOutbox
from workers.cache import WorkerCache, WorkerConfig
from workers.control.commands import CommandGate
from workers.staging.host_config import HostTierConfig

R0, R1 = WorkerId("r0", 0), WorkerId("r1", 0)  # two TP-1 replicas of two slots each


class Outbox(ControlOutbox):
    """A rank's deltas as its outbox numbers them; ``take(n)`` waits (bounded, no sleeps) for n READYs."""

    def take(self, ready: int) -> list[tuple[Any, ...]]:
        with self.cond:
            assert self.cond.wait_for(lambda: sum(d.state == "ready" for d in self.deltas) >= ready, timeout=30)
            out, self.deltas = self.deltas, []
        return [delta_row(0, d)[1:] for d in out]


@pytest.fixture
def fleet(tmp_path: Path):
    make_adapters(tmp_path, SynthConfig(model="tiny", count=4, rank="8"))
    core = ControllerCore(ControllerConfig(catalog=CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny",
                                                                 max_rank=16)), epoch=3)
    for d in sorted(tmp_path.iterdir()):
        core.register_adapter(d.name, str(d))
    ranks = {}
    for wid in (R0, R1):
        core.add_replica(wid.replica, tp=1, slots=2)
        cache = WorkerCache(WorkerConfig(num_slots=2, tp=1, tp_rank=0, device="cpu",
                                         host=HostTierConfig(host_bytes=1 << 20, pin=False)), core.catalog)
        outbox = Outbox()
        ranks[wid] = (cache, CommandGate(cache, outbox.push), outbox)
    try:
        yield core, ranks
    finally:
        for cache, _, _ in ranks.values():
            cache.close()


def _reasons(core: ControllerCore, adapter: str) -> dict[str, str]:
    (advice,) = core.route([RouteRequest(adapter)])
    return {r.replica: r.reason.value for r in advice.ranked}


def test_a_ready_never_commanded_nor_acquired_is_not_advertised_and_is_counted(fleet) -> None:
    """The issue's attack: an engine attached as r0 claims READY for a registered adapter it was never commanded
    to load and never acquired. Before: Lookup advertised r0 and Route ranked it first (the planner took the claim
    too). Now neither does, the planner does not count it, and the refusal is counted with its reason."""
    core, _ = fleet
    version = core.catalog.get("adapter-000").version
    assert core.worker_report(R0, [("adapter-000", version, "ready", "")], now=1.0) == []
    assert core.readiness.lookup("adapter-000").ready == ()
    assert _reasons(core, "adapter-000")["r0"] == "cold" and core.planner.view.residency(str(R0)) == {}
    status = core.status()
    assert status["refused_reports"] == 1
    assert "never commanded that load to this rank" in status["recent_refusals"][-1]
    assert str(R0) in status["recent_refusals"][-1]
    core.check_integrity()


def test_a_commanded_load_is_believed_and_only_on_the_rank_it_was_commanded_to(fleet) -> None:
    """A prefetch the plan sent r1 comes back READY from the real cache: believed (Lookup, Route); the same claim
    from r0, which was never sent it, is refused. A command vouches for its version on that rank until the rank
    restarts (not only for one load: a "gone" may overtake a newer command of the same version)."""
    core, ranks = fleet
    core.report_queue("r1", [("adapter-001", 0.0)], now=1.0)
    plan = core.plan(now=1.0)
    sent = [c.adapter for c in plan[R1] if isinstance(c, Prefetch)]
    assert "adapter-001" in sent
    _, gate, outbox = ranks[R1]
    assert not gate.apply(plan[R1]).errors
    events = core.worker_report(R1, outbox.take(ready=len(sent)), now=1.0)
    assert sorted(e.adapter for e in events if e.ready) == sorted(sent)
    assert core.readiness.lookup("adapter-001").ready == ("r1",)
    assert _reasons(core, "adapter-001")["r1"] == "ready"
    version = core.catalog.get("adapter-001").version
    assert core.admission.claims.how(R1, ("adapter-001", version)) == "commanded"
    assert core.status()["refused_reports"] == 0
    to_r0 = {c.adapter for c in plan.get(R0, []) if isinstance(c, Prefetch)}
    other = next(a for a in sent if a not in to_r0)  # sent to r1, never to r0
    v_other = core.catalog.get(other).version
    assert core.worker_report(R0, [(other, v_other, "ready", "")], now=2.0) == []
    assert "r0" not in core.readiness.lookup(other).ready and core.status()["refused_reports"] == 1
    core.worker_lost(R1, gone=False)  # a new incarnation of r1: the command vouched for its predecessor's load
    assert core.worker_report(R1, [("adapter-001", version, "ready", "")], now=3.0) == []
    core.check_integrity()


def test_a_load_the_engines_acquire_started_is_believed(fleet) -> None:
    """An engine's acquire that missed loads the adapter itself (no command): its deltas say so, and its READY is
    believed; so is the same rank's full report of it later (a resync after lost deltas)."""
    core, ranks = fleet
    cache, _, outbox = ranks[R0]
    batch = cache.acquire(["adapter-002"])
    cache.settle()
    rows = outbox.take(ready=1)
    assert all(row[-1] is True for row in rows if row[2] in ("loading", "ready")), "an acquire's load is marked"
    (event,) = core.worker_report(R0, rows, now=1.0)
    assert event.ready and core.readiness.lookup("adapter-002").ready == ("r0",)
    assert _reasons(core, "adapter-002")["r0"] == "ready"
    cache.release(batch)
    core.worker_lost(R0, now=2.0)  # lost (a hung rank), then its full report: the same process, still believed
    full = [(r["adapter"], r["version"], r["state"], r["refs"], r["acquired"]) for r in cache.residency()]
    core.sync_worker(R0, full)
    assert core.readiness.lookup("adapter-002").ready == ("r0",) and core.status()["refused_reports"] == 0
    core.check_integrity()


def test_a_full_report_is_believed_only_with_a_reason_and_within_the_slots(fleet) -> None:
    """A resync's full report: an entry nothing vouches for is refused; after a restart of the rank (a new
    incarnation) nothing its predecessor was commanded vouches for it either."""
    core, _ = fleet
    v = {a: core.catalog.get(a).version for a in ("adapter-000", "adapter-001", "adapter-002")}
    core.sync_worker(R0, [("adapter-000", v["adapter-000"], "ready", 0),
                          ("adapter-001", v["adapter-001"], "ready", 0, True)])
    assert core.readiness.holdings("r0", 0).keys() == {("adapter-001", v["adapter-001"])}
    assert core.status()["refused_reports"] == 1
    core.sync_worker(R0, [(a, version, "ready", 0, True) for a, version in v.items()])  # 3 in 2 slots
    assert len(core.readiness.holdings("r0", 0)) == 2 and core.status()["refused_reports"] == 2
    core.worker_lost(R0, gone=False)  # a new incarnation: it starts empty
    assert core.status()["vouched_loads"] == {}
    core.sync_worker(R0, [("adapter-001", v["adapter-001"], "ready", 0)])
    assert core.readiness.holdings("r0", 0) == {}
    core.check_integrity()


class _Worker:
    """A worker that answers ``describe`` with ``report`` and takes registrations (a Ray handle's shape)."""

    class _Method:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def remote(self, *args: Any) -> Any:
            return asyncio.ensure_future(self.fn(*args))

    def __init__(self, report: dict[str, Any]) -> None:
        self.report, self.given = report, list[str]()
        self.describe, self.register_adapters = self._Method(self._describe), self._Method(self._register)

    async def _describe(self) -> dict[str, Any]:
        return self.report

    async def _register(self, entries: list[Any]) -> list[tuple[str, str]]:
        self.given += [e[0] for e in entries]
        return [(e[0], "") for e in entries]


def test_a_restarted_controller_registers_nothing_a_rank_reports_and_believes_its_holdings_once(fleet,
                                                                                               tmp_path: Path) -> None:
    """The issue's restart path: a rank's full report named an adapter (and its path) the durable catalog lacks,
    and the restarted controller's rebuild registered it. Now registrations come only from the durable catalog:
    the rebuild registers nothing; what the rank holds of the registered versions, its predecessor's commands,
    is believed once, within its slots. An engine attaching afterwards is not: it was never commanded."""
    core, _ = fleet
    v0 = core.catalog.get("adapter-000").version
    extra = tmp_path / "extra"
    make_adapters(extra, SynthConfig(model="tiny", count=1, rank="8"))
    (planted,) = list(extra.iterdir())
    report = {"replica": "r2", "rank": 0, "tp": 1, "slots": 2, "host_bytes": 1 << 20, "incarnation": 1, "seq": 0,
              "model": "tiny", "adapters": {"planted": str(planted)},
              "residency": [("adapter-000", v0, "ready", 0), ("planted", "v-planted", "ready", 0)]}
    worker = _Worker(report)
    handles = {worker_name(WorkerId("r2", 0)): worker}

    async def replan() -> None:
        pass

    async def scenario() -> WorkerLinks:
        links = WorkerLinks(core, None, lambda events: None, replan, find=handles.__getitem__,  # type: ignore[arg-type]
                            named=lambda: list(handles), call_timeout_s=1.0)
        await asyncio.wait_for(links.adoption.rebuild(), 10)
        return links

    asyncio.run(scenario())
    assert "planted" not in core.catalog and "planted" not in core.paths, "a rank's report registered an adapter"
    assert core.readiness.lookup("adapter-000").ready == ("r2",), "a restart believes registered holdings, once"
    assert core.status()["vouched_loads"] == {"adopted": 1}
    assert "planted@v-planted is not a registered version" in core.status()["recent_refusals"][-1]
    core.check_integrity()


def test_the_drain_reads_a_real_ranks_full_report_with_its_marker(fleet) -> None:
    """The drain before an unregistration (``WorkerFanout.holders``) reads each rank's ``describe()`` rows, which
    gained the ``acquired`` field: a real rank's report (``WorkerControl.describe``) still names what it holds."""
    from types import SimpleNamespace

    from lora_cache.controller.fanout import WorkerFanout
    from workers.control.outbox import Outbox as RankOutbox
    from workers.control.rank import WorkerControl

    core, ranks = fleet
    cache, _, _ = ranks[R0]
    outbox = RankOutbox("w", 0.01, send=lambda name, incarnation, batch: None)
    try:
        control = WorkerControl("r0", core.catalog, cache, outbox)
        batch = cache.acquire(["adapter-003"])
        cache.settle()
        cache.release(batch)
        rows = control.describe("node")["residency"]
    finally:
        outbox.close()
    assert [(a, s, acquired) for a, _, s, _, acquired in rows] == [("adapter-003", "ready", True)]

    class Handle:
        describe = SimpleNamespace(remote=lambda: asyncio.sleep(0, result={"residency": rows}))

    fanout = WorkerFanout(SimpleNamespace(handles={R0: Handle()}))  # type: ignore[arg-type]
    held = asyncio.run(fanout.holders("adapter-003", 5.0))
    assert held == {R0: {core.catalog.get("adapter-003").version}}
