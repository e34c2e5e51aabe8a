"""The Route RPC end to end on CPU: the real ControllerCore behind the gateway (forwarded as the actor
does), the Python client and the ``lora-cache route`` command; per-item errors beside good items."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.api.client import ClientError, LoraCacheClient, RouteItem
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc
from lora_cache.app.cli import main
from lora_cache.controller.core import ControllerConfig, ControllerCore, HintOutcome
from lora_cache.routing.advice import RouteAdvice, RouteRequest
from lora_cache.vocab import WorkerId

MAX_ITEMS = 16


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class CoreController:
    """The actor's ``route`` over a real ControllerCore: the same forwarding, without Ray."""

    def __init__(self, core: ControllerCore) -> None:
        self.core, self.lock = core, threading.Lock()
        self.route = _Remote(self._route)
        self.hint_batches = _Remote(self._hint_batches)  # the gateway's hint ingest needs it

    async def _hint_batches(self, batches: list[list[tuple[str, str, str, float]]]) -> list[HintOutcome]:
        with self.lock:
            return self.core.hint_batches(batches, 2.0)

    async def _route(self, items: list[RouteRequest], outstanding: dict[str, float] | None = None,
                     finished: Any = ()) -> list[RouteAdvice]:
        await asyncio.sleep(0)
        with self.lock:
            return self.core.route(items, outstanding, finished)


class Served(NamedTuple):
    core: ControllerCore
    target: str
    names: list[str]
    versions: list[str]


@pytest.fixture
def served(tiny_adapters: Any) -> Iterator[Served]:
    paths: list[Path] = tiny_adapters(3)
    core = ControllerCore(ControllerConfig(CatalogConfig(adapter_roots=(str(paths[0].parent),), model="tiny",
                                                         max_rank=16)), epoch=1)
    versions = [core.register_adapter(p.name, str(p)) for p in paths]
    names = [p.name for p in paths]
    for r in range(3):
        core.add_replica(f"replica-{r}", 2, 4)
    a, va = names[0], versions[0]
    for rank in (0, 1):  # adapter 0: ready on replica-0, loading on replica-1 (one rank ready, one loading)
        core.worker_report(WorkerId("replica-0", rank), [(a, va, "ready", "", 0.0, True)], 1.0)  # acquired loads
    core.worker_report(WorkerId("replica-1", 0), [(a, va, "ready", "", 0.0, True)], 1.0)
    core.worker_report(WorkerId("replica-1", 1), [(a, va, "loading", "", 0.0, True)], 1.0)
    gw = start_gateway_thread(GatewayConfig(grpc_port=0, max_hints_per_call=MAX_ITEMS), CoreController(core))
    try:
        yield Served(core, gw.target, names, versions)
    finally:
        gw.stop()


def test_route_ranks_by_residency_with_reasons_and_waits(served: Served) -> None:
    a = served.names[0]
    with LoraCacheClient(served.target) as lc:
        (route,) = lc.route([RouteItem(a, request_id="req-1")])
    assert route.error is None and route.request_id == "req-1" and route.version == served.versions[0]
    assert [(r.replica, r.reason) for r in route.replicas][:2] == [("replica-0", "ready"), ("replica-1", "loading")]
    assert route.replicas[2].reason == "cold"
    waits = [r.expected_wait_s for r in route.replicas]
    assert waits[0] == 0.0 < waits[1] < waits[2]
    assert all(r.within_bound for r in route.replicas)


def test_a_bad_item_fails_alone_and_the_good_ones_are_routed(served: Served) -> None:
    a, b = served.names[0], served.names[1]
    items = [RouteItem(a), RouteItem("ghost"), RouteItem("-bad name"), RouteItem(a, version="v0ld"), RouteItem(b)]
    with LoraCacheClient(served.target) as lc:
        routes = lc.route(items, max_replicas=2)
    assert [r.error is None for r in routes] == [True, False, False, False, True]
    assert routes[1].error is not None and routes[1].error.code == "NOT_FOUND"
    assert "adapter 'ghost' is not registered" in routes[1].error.message
    assert "lora-cache register" in routes[1].error.message
    assert routes[2].error is not None and routes[2].error.code == "INVALID_ARGUMENT"
    assert "adapter '-bad name' (item 2) is malformed" in routes[2].error.message
    assert routes[3].error is not None and routes[3].error.code == "NOT_FOUND"  # a version not kept (issue 44)
    assert "no version or pushed tag 'v0ld' kept" in routes[3].error.message
    assert "kept: versions" in routes[3].error.message
    assert len(routes[0].replicas) == len(routes[4].replicas) == 2  # max_replicas


def test_whole_call_errors_name_the_value_and_the_fix(served: Served) -> None:
    with LoraCacheClient(served.target) as lc:
        for call, code, fragment in [
            (lambda: lc.route([]), "INVALID_ARGUMENT", "the batch of route items is empty; send 1 to 16"),
            (lambda: lc.route([served.names[0]] * (MAX_ITEMS + 1)), "INVALID_ARGUMENT",
             "has 17 route items, more than this server's max_hints_per_call (16); split it"),
            (lambda: lc.route([served.names[0]], {"replica-9": 1}), "NOT_FOUND", "unknown replicas ['replica-9']"),
        ]:
            with pytest.raises(ClientError) as e:
                call()
            assert e.value.code == code and fragment in e.value.message, e.value


def test_a_burst_spreads_and_the_routers_loads_count(served: Served) -> None:
    a = served.names[0]
    with LoraCacheClient(served.target) as lc:
        burst = lc.route([a] * 12)
        busy = lc.route([a], outstanding={"replica-0": 20, "replica-1": 0, "replica-2": 0})
    picks = [r.replicas[0].replica for r in burst]
    assert picks[0] == "replica-0" and len(set(picks)) > 1  # the resident replica first, then the overflow
    assert busy[0].replicas[0].replica != "replica-0" and not busy[0].replicas[-1].within_bound


def test_the_routers_finishes_reach_the_advice_and_a_malformed_one_fails_the_call(served: Served) -> None:
    """``finished`` (issue 42): each request the router says finished takes its adapter's pick back on that
    replica, so the adapters Route counts in flight are the ones still running; a malformed entry fails the whole
    call, naming the field, the entry and the fix."""
    a, b = served.names[0], served.names[1]
    with LoraCacheClient(served.target) as lc:
        (first,) = lc.route([b], outstanding=dict.fromkeys(["replica-0", "replica-1", "replica-2"], 0))
        where = first.replicas[0].replica
        assert served.core.limits.flying(where, 1, []) == {b: 1}
        (then,) = lc.route([a], outstanding={**dict.fromkeys(["replica-0", "replica-1", "replica-2"], 0), where: 1},
                           finished=[(where, b), ("replica-2", "never-routed")])
        went = then.replicas[0].replica
        assert served.core.limits.flying(where, 5, []) == ({a: 1} if went == where else {})
        for bad, fragment in [(("-x", a), "replica '-x' (finished_requests 0) is malformed"),
                              (("replica-0", "b@"), "adapter 'b@' (finished_requests 0) is malformed")]:
            with pytest.raises(ClientError) as e:
                lc.route([a], finished=[bad])
            assert e.value.code == "INVALID_ARGUMENT" and fragment in e.value.message, e.value
        with pytest.raises(ClientError) as e:
            lc.route([a], finished=[("replica-0", a)] * (MAX_ITEMS + 1))
        assert "reports 17 finished requests, more than this server's max_hints_per_call (16)" in e.value.message


def test_the_stubs_alone_and_the_cli(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    with grpc.insecure_channel(served.target) as channel:
        reply = pb_grpc.LoraCacheServiceStub(channel).Route(
            pb.RouteRequest(items=[pb.RouteItem(adapter=served.names[0], tokens=100)]), timeout=30)
    assert reply.items[0].replicas[0].reason == pb.ROUTE_REASON_READY
    assert main(["route", served.names[0], "ghost", "--max-replicas", "1", "--server", served.target]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out[0]["replicas"][0]["replica"] == "replica-0" and out[0]["replicas"][0]["reason"] == "ready"
    assert out[1]["error"]["code"] == "NOT_FOUND" and out[1]["replicas"] == []
