"""The gateway's side of an AttachRank stream (``lora_cache/api/rank_link.py``) and its codec, on CPU
without Ray: the link over a real ``Relay`` (the endpoint's core), the controller's side recorded. (The
whole path, a process outside a real Ray cluster attaching through a real gateway, is
tests/test_ray_gateway_attach.py.)"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.files import BlockCrcs, FileIdentity, WeightsSource
from lora_cache.adapters.peft import KnownVersion
from lora_cache.api import relay_codec as codec
from lora_cache.api.rank_link import RankLink
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.validate import RequestError
from lora_cache.errors import ConfigError, ConflictError, NotFoundError
from lora_cache.link.relay import Relay
from lora_cache.vocab import ApplyResult, Evict, Prefetch, Ranking, Stage
from tests.waiting import wait_for

NAME = "lora-cache-worker:replica-0:0"


def hello(**kw: Any) -> pb.AttachRankRequest:
    fields: dict[str, Any] = {"replica": "replica-0", "rank": 0, "tp": 1, "num_slots": 2, "model": "tiny",
                              "incarnation": 7, "liveness_s": 5.0, "start_s": 60.0, "name_wait_s": 0.0} | kw
    return pb.AttachRankRequest(hello=pb.AttachHello(**fields))


def report(incarnation: int = 7) -> dict[str, Any]:
    return {"replica": "replica-0", "rank": 0, "tp": 1, "model": "tiny", "incarnation": incarnation, "seq": 3,
            "node": "host-a", "slots": 2, "host_bytes": 1 << 22, "adapters": {"a": "/r/a"}, "epoch": 11,
            "residency": [("a", "v1", "ready", 1, False), ("b", "v2", "loading", 0, True)],
            "host": [("a", "v1"), ("c", "v1")]}


class RelayHost:
    """``RankHost`` over a real ``Relay``; the controller's calls are the test's, its inputs recorded."""

    def __init__(self, catalog: CatalogConfig | None = None, registrations: dict[str, str] | None = None) -> None:
        self.relay: Relay | None = None
        self.service = "svc"
        self.events: list[Any] = []
        self.config = catalog or CatalogConfig(adapter_roots=("/r",), model="tiny", max_rank=16)
        self.registrations = registrations or {}
        self.versions: dict[str, str] = {}

    async def catalog(self) -> CatalogConfig:
        return self.config

    async def open(self, h: pb.AttachHello) -> None:
        self.relay = Relay(NAME, h.liveness_s, start_s=h.start_s)
        self.events.append("open")

    async def adopt(self, h: pb.AttachHello) -> None:
        assert self.relay is not None
        info = await self.relay.call("describe")  # as worker_started(adopt=True) does, through the endpoint
        for name, path in self.registrations.items():  # and the registrations replayed
            self.versions[name] = await self.relay.call("register_adapter", name, path)
        self.events.append(("adopted", info["incarnation"], info["residency"]))

    async def take(self, timeout_s: float) -> list[codec.Call]:
        assert self.relay is not None
        return await self.relay.take(timeout_s, alive=False)

    async def answer(self, results: list[tuple[int, bool, Any]]) -> None:
        assert self.relay is not None
        self.relay.answer(results)

    async def report(self, incarnation: int, batch: list[codec.DeltaRow]) -> None:
        self.events.append(("report", incarnation, batch))

    async def leave(self, h: pb.AttachHello) -> None:
        self.events.append("left")


class Engine:
    """The engine's side of the stream: messages up through a queue, messages down read one at a time."""

    def __init__(self, link: RankLink) -> None:
        self.up: asyncio.Queue[pb.AttachRankRequest | None] = asyncio.Queue()
        self.down = link.run(self._requests())

    async def _requests(self) -> AsyncIterator[pb.AttachRankRequest]:
        while (m := await self.up.get()) is not None:
            yield m

    async def next(self) -> pb.AttachRankResponse:
        return await asyncio.wait_for(anext(self.down), 10)


def test_the_link_relays_calls_both_ways_and_the_end_of_the_stream_detaches() -> None:
    async def scenario() -> None:
        host = RelayHost()
        engine = Engine(RankLink(lambda name: host, poll_s=0.05))
        engine.up.put_nowait(hello())
        attached = (await engine.next()).attached
        assert (attached.model, attached.max_rank, list(attached.adapter_roots), attached.worker_name) == (
            "tiny", 16, ["/r"], NAME)
        assert host.events == ["open"]
        call = (await engine.next()).call  # the adoption describes the rank first, through the pump
        assert call.WhichOneof("call") == "describe"
        assert host.relay is not None and host.relay._polled is None  # the pump's takes are no sign of life
        engine.up.put_nowait(pb.AttachRankRequest(answer=codec.answer(call.call_id, "describe", True, report())))
        assert (await engine.next()).WhichOneof("message") == "adopted"
        assert host.events[-1] == ("adopted", 7, [("a", "v1", "ready", 1, False), ("b", "v2", "loading", 0, True)])

        # the controller's apply: typed commands down, an ApplyResult back to its caller
        commands = [Evict("b", "v2", 11), Prefetch("a", "v1", 0, 11), Stage("c", "v3", 2, 11)]
        applied = asyncio.ensure_future(host.relay.call("apply", commands))
        call = (await engine.next()).call
        assert codec.from_call(call) == (call.call_id, "apply", (commands,))
        result = ApplyResult(2, 1, ("Prefetch x@y: no such adapter",))
        engine.up.put_nowait(pb.AttachRankRequest(answer=codec.answer(call.call_id, "apply", True, result)))
        assert await asyncio.wait_for(applied, 10) == result

        # an error answer raises the rank's own error class in the caller
        registered = asyncio.ensure_future(host.relay.call("register_adapter", "d", "/r/d"))
        call = (await engine.next()).call
        assert (call.register_adapter.name, call.register_adapter.path) == ("d", "/r/d")
        error = ConfigError("adapter 'd' has rank 64 above max_rank 16")
        engine.up.put_nowait(pb.AttachRankRequest(answer=codec.answer(call.call_id, "register_adapter", False, error)))
        with pytest.raises(ConfigError, match="rank 64 above max_rank 16"):
            await asyncio.wait_for(registered, 10)

        engine.up.put_nowait(pb.AttachRankRequest(alive=pb.RankAlive()))  # a sign of life reaches the relay
        engine.up.put_nowait(pb.AttachRankRequest(deltas=codec.deltas(7, [(4, "a", "v1", "gone", ""),
                                                                          (5, "c", "v3", "failed", "no slot"),
                                                                          (6, "d", "v4", "no_room", "all held")])))
        stats = asyncio.ensure_future(host.relay.call("stats"))  # the deltas went first: the stats call follows
        call = (await engine.next()).call
        engine.up.put_nowait(pb.AttachRankRequest(answer=codec.answer(call.call_id, "stats", True,
                                                                      {"loads": 3, "load_ms": {"p50": 1.5}})))
        assert await asyncio.wait_for(stats, 10) == {"loads": 3, "load_ms": {"p50": 1.5}}
        assert host.relay._polled is not None
        assert ("report", 7, [(4, "a", "v1", "gone", "", 0.0, False),
                              (5, "c", "v3", "failed", "no slot", 0.0, False),
                              (6, "d", "v4", "no_room", "all held", 0.0, False)]) in host.events

        engine.up.put_nowait(None)  # the engine detaches: the stream ends and the rank leaves
        with pytest.raises(StopAsyncIteration):
            await engine.next()
        assert host.events[-1] == "left"

    asyncio.run(scenario())


@pytest.mark.parametrize(("first", "error", "message"), [
    (pb.AttachRankRequest(alive=pb.RankAlive()), RequestError,
     r"first message of an AttachRank stream must be an AttachHello, not 'alive'; send"),
    (hello(replica="bad name!"), RequestError, r"replica 'bad name!' in the AttachHello is malformed"),
    (hello(rank=2, tp=2), RequestError, r"rank 2 of replica 'replica-0' is not below tp 2; a TP rank is 0..tp-1"),
    (hello(num_slots=0), RequestError, r"num_slots is 0 for rank 0 of 'replica-0'; give 1 to 65536"),
    (hello(num_slots=10**9), RequestError, r"num_slots is 1000000000 .*; give 1 to 65536"),
    (hello(tp=100_000), RequestError, r"tp is 100000 in the AttachHello of replica 'replica-0'; give 1 to 64"),
    (hello(name_wait_s=1e9), RequestError, r"name_wait_s \(1e\+09\) must be at most 60 s"),
    (hello(liveness_s=0.0), RequestError, r"liveness_s \(0.0\) must be > 0"),
    (hello(model="llama-3.1-8b"), ConfigError,
     r"serves model 'llama-3.1-8b' but the controller plans for 'tiny'; attach with the service's model"),
])
def test_a_bad_hello_is_refused_before_anything_is_made(first, error, message) -> None:
    async def scenario() -> None:
        host = RelayHost()
        engine = Engine(RankLink(lambda name: host))
        engine.up.put_nowait(first)
        with pytest.raises(error, match=message):
            await engine.next()
        assert host.events == []  # no endpoint made, so nothing to leave

    asyncio.run(scenario())


@pytest.mark.parametrize(("message", "fragment"), [
    (hello(), r"lora-cache-worker:replica-0:0: a second AttachHello on its stream; send the hello once"),
    (pb.AttachRankRequest(answer=pb.CallAnswer(call_id=99, unregistered=True)),
     r"an answer for call 99, which is not in flight on this stream \(1 are\); answer each RelayedCall once"),
    (pb.AttachRankRequest(), r"an AttachRankRequest with no message \(None\)"),
])
def test_bad_input_after_the_hello_ends_this_stream_and_the_rank_leaves(message, fragment) -> None:
    async def scenario() -> None:
        host = RelayHost()
        engine = Engine(RankLink(lambda name: host, poll_s=0.05))
        engine.up.put_nowait(hello())
        await engine.next()  # attached
        assert (await engine.next()).call.WhichOneof("call") == "describe"  # in flight, not answered
        engine.up.put_nowait(message)
        with pytest.raises(RequestError, match=fragment):
            while True:
                await engine.next()
        assert host.events[-1] == "left"

    asyncio.run(scenario())


def test_an_answer_of_the_wrong_kind_names_the_call_and_the_fix() -> None:
    wrong = codec.answer(4, "stats", True, {"loads": 1})
    with pytest.raises(RequestError, match=r"call 4 was describe, whose answer is describe or error, not "
                                           r"'stats_json'; answer each RelayedCall with the result of its own call"):
        codec.from_answer(wrong, "describe")


def test_the_codec_round_trips_reports_calls_and_errors() -> None:
    assert codec.from_report(codec.report(report())) == report()
    assert codec.from_report(codec.report({**report(), "disk_bytes": 64 << 30}))["disk_bytes"] == 64 << 30
    for stage in (Stage("c", "v3", 2, 11, True), Stage("c", "v3", 2, 11, True, True), Stage("c", "v3", 2, 11)):
        assert codec.from_command(codec.command(stage)) == stage  # a disk warm stage stays one over the link
    for ranking in (Ranking(("b", "a", "c"), 12), Ranking((), 3)):
        assert codec.from_command(codec.command(ranking)) == ranking  # the host tier's order, names in order
    known = KnownVersion("v1", "c0ffee", "boot", WeightsSource("/r/a/adapter_model.safetensors", "v1",
                                                                FileIdentity(1, 2, 3 << 20, -4, 5), 64, 7,
                                                                BlockCrcs([0, 1, 0xFFFFFFFF]), 6))
    for c in [(1, "describe", ()), (2, "stats", ()), (3, "unregister_adapter", ("a",)),
              (4, "register_adapter", ("a", "/r/a", None)), (5, "apply", ([Prefetch("a", "v", 3, 9)],)),
              (6, "register_adapter", ("a", "/r/a", known)),
              (7, "register_adapters", ([("a", "/r/a", known), ("b", "/r/b", None)],)),
              (9, "drop_pushed", ("a", ["3", "step-4"], "node-1", "/dev/shm/lora-cache-pushed-0/svc"))]:
        assert codec.from_call(codec.call(c)) == c
    assert codec.from_answer(codec.answer(9, "drop_pushed", True, ["3"]), "drop_pushed") == (9, True, ["3"])
    answered = codec.answer(7, "register_adapters", True, [("v1", ""), ("", "AdapterChangedError: changed")])
    assert codec.from_answer(answered, "register_adapters") == (7, True, [("v1", ""), ("", "AdapterChangedError: "
                                                                                        "changed")])
    bad = codec.call((8, "register_adapters", ([("a", "/r/a", known)],)))
    bad.register_adapters.adapters[0].known.block_crcs = b"\x00" * 5
    with pytest.raises(RequestError, match=r"block_crcs holds 5 bytes, not 4 per block"):
        codec.from_call(bad)
    _, ok, error = codec.from_answer(codec.answer(1, "describe", False, NotFoundError("no adapter 'z'")), "describe")
    assert not ok and isinstance(error, NotFoundError) and str(error) == "no adapter 'z'"
    _, _, other = codec.from_answer(codec.answer(1, "stats", False, ZeroDivisionError("oops")), "stats")
    assert isinstance(other, codec.RelayedCallError) and str(other) == "ZeroDivisionError: oops"
    stats = codec.answer(1, "stats", True, {"gpu_hits": 2, "load_ms": {"p99": 3.0}})
    assert json.loads(stats.stats_json) == {"gpu_hits": 2, "load_ms": {"p99": 3.0}}
    with pytest.raises(RequestError, match=r"residency state 10 is not one of"):  # 9: CAPACITY (issue 43 item 3)
        codec.from_deltas(pb.ResidencyDeltas(deltas=[pb.ResidencyDelta(seq=1, state=pb.ResidencyState.ValueType(10))]))
    rows = [(1, "a", "v1", "loading", ""), (2, "a", "v1", "ready", "", 0.25)]  # an older sender's rows lack read_s
    assert codec.from_deltas(codec.deltas(5, rows)) == (5, [(1, "a", "v1", "loading", "", 0.0, False),
                                                            (2, "a", "v1", "ready", "", 0.25, False)])
    acquired = [(3, "b", "v1", "ready", "", 0.5, True)]  # an acquire's load: the marker crosses the relay
    assert codec.from_deltas(codec.deltas(5, acquired)) == (5, acquired)
    host = [(6, "a", "v1", "staged", "", 0.0, False), (7, "a", "v1", "unstaged", "", 0.0, False)]  # its host tier
    assert codec.from_deltas(codec.deltas(5, host)) == (5, host)
    described = {"replica": "r", "rank": 0, "tp": 1, "model": "tiny", "incarnation": 1, "seq": 7, "node": "n",
                 "slots": 2, "host_bytes": 1, "adapters": {}, "epoch": 1, "residency": []}
    assert codec.from_report(codec.report({**described, "host": [("a", "v1")]}))["host"] == [("a", "v1")]
    assert codec.from_report(codec.report({**described, "host": []}))["host"] == []
    assert codec.from_report(codec.report(described))["host"] is None  # an older rank: host tier not reported
    paged = codec.from_report(codec.report({**described, "gpu_bytes": 4096, "page_bytes": 1024}))  # issue 43
    assert (paged["gpu_bytes"], paged["page_bytes"]) == (4096, 1024)
    assert "page_bytes" not in codec.from_report(codec.report(described))  # slots of the largest rank
    for bad_read in (-1.0, float("nan"), 1e9):
        delta = pb.ResidencyDelta(seq=3, adapter="a", state=pb.RESIDENCY_STATE_READY, read_s=bad_read)
        forged = pb.ResidencyDeltas(deltas=[delta])
        with pytest.raises(RequestError, match=r"delta 3 of 'a': read_s is .*; send the seconds the load read"):
            codec.from_deltas(forged)


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls+token"])
def test_an_engine_attaches_through_a_real_grpc_server_and_loads_what_it_is_told(tmp_path, secure: bool) -> None:
    """The engine's side for real (``attach(AttachConfig(gateway=...))``: a CPU ``WorkerCache``, its serve
    thread, outbox and the gRPC transport) against the servicer on a real grpc.aio server, the cluster side
    a ``Relay`` driven by the test: the replayed registration, a prefetch, its deltas, a hit, the detach.
    ``tls+token``: the server speaks TLS and wants the bearer token (the gateway's interceptor); the engine
    sends them (``tls_ca``, ``token_file``)."""
    import subprocess
    import threading

    import grpc

    from lora_cache.adapters.synth import SynthConfig, make_adapters
    from lora_cache.api.auth import CallerCheck
    from lora_cache.api.ingest import HintIngest
    from lora_cache.api.servicer import Servicer, generic_handler
    from workers.attach.attachment import AttachConfig, attach
    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    make_adapters(tmp_path, SynthConfig(model="tiny", count=1, rank="8"))
    adapter = "adapter-000"
    host = RelayHost(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=8),
                     {adapter: str(tmp_path / adapter)})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    cert, key, token = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "token"
    security: dict[str, Any] = {}
    if secure:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out",
                        str(cert)], check=True, capture_output=True)
        token.write_text("tok-123\n")
        security = {"tls_ca": str(cert), "token_file": str(token)}

    async def serve() -> tuple[Any, int]:
        server = grpc.aio.server(interceptors=[CallerCheck("tok-123")] if secure else None)
        async def no_hints(batches: Any) -> list[Any]:  # this test sends none
            raise AssertionError(batches)

        servicer = Servicer(controller=None, ingest=HintIngest(no_hints, 16), max_items=16, rank_host=lambda name: host)
        server.add_generic_rpc_handlers((generic_handler(servicer),))
        port = (server.add_secure_port("localhost:0", grpc.ssl_server_credentials([(key.read_bytes(),
                                                                                      cert.read_bytes())]))
                if secure else server.add_insecure_port("localhost:0"))
        await server.start()
        return server, port

    server, port = on_loop(serve())
    try:
        worker = WorkerConfig(num_slots=2, device="cpu", dtype="float32",
                              host=HostTierConfig(host_bytes=1 << 22, pin=False))
        rank = attach(AttachConfig(replica="replica-0", gateway=f"localhost:{port}", poll_s=0.2, **security), worker)
        try:
            assert rank.catalog.names() == [adapter] and host.events[-1][0] == "adopted"
            version = host.versions[adapter]
            assert host.relay is not None
            result = on_loop(host.relay.call("apply", [Prefetch(adapter, version, 0, 5)]))
            assert (result.accepted, result.rejected_stale, result.errors) == (1, 0, ())
            rank.cache.settle()
            wait_for(lambda: "ready" in reported(host), "the load's deltas reported")
            assert reported(host)[:2] == ["loading", "ready"]
            # the read's shard in its host tier, let go of once READY (exclusive tiers, the default), over gRPC
            wait_for(lambda: len(reported(host, slots=False)) >= 2, "the host tier's deltas reported")
            assert reported(host, slots=False) == ["staged", "unstaged"]
            batch = rank.acquire([adapter])
            rank.release(batch)
            assert rank.cache.stats()["gpu_hits"] == 1
            stats = on_loop(host.relay.call("stats"))
            assert stats["gpu_hits"] == 1 and stats["commands_accepted"] == 1
        finally:
            rank.detach()
        wait_for(lambda: host.events[-1] == "left", "the rank left with its stream")
        assert rank.served.lost is None
    finally:
        on_loop(server.stop(0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def reported(host: RelayHost, slots: bool = True) -> list[str]:
    """The states the rank reported, in order: its slots' (``slots``), or its host tier's."""
    return [d[3] for e in host.events if e[0] == "report" for d in e[2]
            if (d[3] not in ("staged", "unstaged")) == slots]


@pytest.mark.parametrize(("forged", "fragment"), [
    ({"tp": 100_000}, "its report says tp 100000, but its hello said 1"),
    ({"slots": 0}, "its report says slots 0, but its hello said 2"),
    ({"replica": "replica-9"}, "its report says replica 'replica-9', but its hello said 'replica-0'"),
    ({"residency": [(f"a{k}", "v", "ready", 0) for k in range(3)]}, "holds 3 adapters in 2 slots"),
])
def test_a_report_outside_the_hello_shape_ends_the_stream(forged: dict[str, Any], fragment: str) -> None:
    """Issue 35 item 2: the controller adopted whatever shape an attached rank's report claimed (tp=100000
    grew it by 100 MB). The gateway now checks the report against the hello before the controller sees it."""
    async def scenario() -> None:
        host = RelayHost()
        engine = Engine(RankLink(lambda name: host, poll_s=0.05))
        engine.up.put_nowait(hello())
        await engine.next()  # attached
        call = (await engine.next()).call
        engine.up.put_nowait(pb.AttachRankRequest(answer=codec.answer(call.call_id, "describe", True,
                                                                      report() | forged)))
        with pytest.raises(RequestError, match=re.escape(fragment)):
            while True:
                await engine.next()
        assert host.events[-1] == "left"

    asyncio.run(scenario())


def test_one_hello_at_a_time_waits_for_a_name() -> None:
    """Issue 35 item 2: hellos that waited for a taken name without bound locked out the good rank after them.
    A hello's wait is bounded (``name_wait_s`` at most 60 s), and a second hello for a name being waited for
    is refused at once."""
    async def scenario() -> None:
        gate = asyncio.Event()

        class WaitingHost(RelayHost):
            async def open(self, h: pb.AttachHello) -> None:
                await gate.wait()  # a predecessor holds the name
                await super().open(h)

        first = Engine(RankLink(lambda name: WaitingHost()))
        first.up.put_nowait(hello(name_wait_s=30.0))
        waiting = asyncio.ensure_future(first.next())
        await asyncio.sleep(0.05)
        second = Engine(RankLink(lambda name: RelayHost()))
        second.up.put_nowait(hello(name_wait_s=30.0))
        with pytest.raises(ConflictError, match="another AttachHello for lora-cache-worker:replica-0:0 is waiting"):
            await second.next()
        gate.set()
        assert (await waiting).WhichOneof("message") == "attached"
        first.up.put_nowait(None)

    asyncio.run(scenario())
