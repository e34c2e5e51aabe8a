"""The gateway against hostile clients (issue 35, items 2 and 6), on the CPU with a stand-in controller.

- Streams per client: one client that opens more WatchReadiness streams than its limit gets
  RESOURCE_EXHAUSTED naming the limit, and another client's Status still succeeds (before: 1,030 idle
  streams of one client took every RPC slot).
- Oversized names and paths: INVALID_ARGUMENT naming the limit, the value cut (before: the error echoed
  the value and failed as a raw metadata-limit error).
- Roles: a router's token cannot register or attach, an engine's cannot hint, an operator's cannot
  route; PERMISSION_DENIED names the role needed; the plain token file keeps every role.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc
from lora_cache.api.validate import MAX_PATH_CHARS
from lora_cache.controller.readiness import RankState, ReadinessIndex, WatchBatch
from lora_cache.errors import AdapterError, ConfigError, NotFoundError
from tests.test_gateway import StallController, _Remote, code_of
from tests.test_watch_resync import IndexController
from tests.waiting import wait_for


class WatchedController(StallController):
    """The stand-in controller, with readiness watches that wait (as the real long poll does) and lookups."""

    def __init__(self) -> None:
        super().__init__()
        self.watches = 0
        self.begin_watch = _Remote(self._begin_watch)
        self.poll_events = _Remote(self._poll_events)
        self.lookup_adapter = _Remote(self._lookup_adapter)
        self.register_one = _Remote(self._register_one)

    async def _lookup_adapter(self, adapter: str) -> dict[str, Any]:
        raise NotFoundError(f"adapter {adapter!r} is not registered")  # as the real one: it names the adapter

    async def _register_one(self, name: str, path: str, request_id: str = "") -> Any:
        raise AdapterError(f"{path!r} is not under an adapter root")

    async def _begin_watch(self, replica: str | None, adapter: str | None) -> int:
        self.watches += 1
        return 0

    async def _poll_events(self, after: int, replica: Any, adapter: Any, timeout_s: float) -> WatchBatch:
        await asyncio.sleep(timeout_s)
        return WatchBatch([])


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_one_client_cannot_take_every_stream_and_others_keep_their_calls(tmp_path: Path) -> None:
    (tmp_path / "greedy").write_text("greedy-token")
    (tmp_path / "other").write_text("other-token")
    ctl = WatchedController()
    config = GatewayConfig(
        grpc_port=0,
        max_concurrent_rpcs=8,
        max_streams_per_client=3,
        token_file=str(tmp_path / "greedy"),
        router_token_file=str(tmp_path / "other"),
    )
    gw = start_gateway_thread(config, ctl)
    try:
        with grpc.insecure_channel(gw.target) as channel:
            stub = pb_grpc.LoraCacheServiceStub(channel)
            streams = [
                stub.WatchReadiness(pb.WatchReadinessRequest(), metadata=_auth("greedy-token")) for _ in range(10)
            ]
            wait_for(
                lambda: ctl.watches == 3 and sum(s.done() for s in streams) == 7,
                what="three streams open and seven refused",
                timeout=30,
            )
            refused = [s for s in streams if s.done()]
            assert {s.code() for s in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert "max_streams_per_client=3" in refused[0].details()
            assert stub.Status(pb.StatusRequest(), metadata=_auth("other-token"), timeout=30).epoch == 1
            mine = stub.WatchReadiness(pb.WatchReadinessRequest(), metadata=_auth("other-token"))
            wait_for(lambda: ctl.watches == 4, what="the other client's own stream", timeout=30)
            assert not mine.done()
            for s in [*streams, mine]:
                s.cancel()
    finally:
        gw.stop()


def test_oversized_names_and_paths_name_the_limit_and_do_not_echo_the_value() -> None:
    gw = start_gateway_thread(GatewayConfig(grpc_port=0), WatchedController())
    try:
        with grpc.insecure_channel(gw.target) as channel:
            stub = pb_grpc.LoraCacheServiceStub(channel)
            huge = "a" * 100_000
            code, message = code_of(lambda: stub.Lookup(pb.LookupRequest(adapter=huge), timeout=30))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "(100000 characters)" in message
            assert len(message) < 1000
            code, message = code_of(
                lambda: stub.RegisterAdapter(pb.RegisterAdapterRequest(name="ok", path="/" + "p" * 20_000), timeout=30)
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and f"more than {MAX_PATH_CHARS}" in message
            assert len(message) < 1000
            code, message = code_of(
                lambda: stub.RegisterAdapter(pb.RegisterAdapterRequest(name="ok", path="a\0b"), timeout=30)
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "NUL byte" in message
            for bad in ("has space", "x" * 129):  # a registration's request id (issue 46 item 3a)
                code, message = code_of(lambda: stub.RegisterAdapter(
                    pb.RegisterAdapterRequest(name="ok", path="/a", request_id=bad), timeout=30))  # noqa: B023
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in message, message
                assert "1-128 printable ASCII characters without spaces" in message and len(message) < 1000
            # a malformed hint is rejected by itself (issue 46): the call answers, its rejection names the limit
            answer = stub.Hint(
                pb.HintRequest(hints=[pb.PrefetchHint(hint_id="h" * 50_000, adapter="a", replica="r")]), timeout=30
            )
            (rejected,) = answer.rejections
            assert rejected.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "(50000 characters)" in rejected.message
            assert len(rejected.message) < 1000 and len(rejected.hint_id) <= 128 and answer.accepted == 0
    finally:
        gw.stop()


@pytest.fixture
def roles(tmp_path: Path) -> Any:
    for role in ("all", "router", "engine", "operator"):
        (tmp_path / role).write_text(f"{role}-token")
    config = GatewayConfig(
        grpc_port=0,
        token_file=str(tmp_path / "all"),
        router_token_file=str(tmp_path / "router"),
        engine_token_file=str(tmp_path / "engine"),
        operator_token_file=str(tmp_path / "operator"),
    )
    gw = start_gateway_thread(config, WatchedController())
    channel = grpc.insecure_channel(gw.target)
    try:
        yield pb_grpc.LoraCacheServiceStub(channel)
    finally:
        channel.close()
        gw.stop()


@pytest.mark.parametrize(
    ("token", "rpc", "needed"),
    [
        ("router", "register", "operator"),
        ("router", "unregister", "operator"),
        ("router", "attach", "engine"),
        ("engine", "hint", "router"),
        ("engine", "lookup", "router"),
        ("engine", "register", "operator"),
        ("operator", "route", "router"),
        ("operator", "watch", "router"),
        ("operator", "attach", "engine"),
    ],
)
def test_each_role_calls_only_its_own_rpcs(roles: Any, token: str, rpc: str, needed: str) -> None:
    stub, auth = roles, _auth(f"{token}-token")
    calls = {
        "register": lambda: stub.RegisterAdapter(pb.RegisterAdapterRequest(name="a", path="a"), metadata=auth),
        "unregister": lambda: stub.UnregisterAdapter(pb.UnregisterAdapterRequest(name="a"), metadata=auth),
        "attach": lambda: stub.AttachRank(iter([pb.AttachRankRequest(alive=pb.RankAlive())]), metadata=auth),
        "hint": lambda: stub.Hint(pb.HintRequest(), metadata=auth),
        "lookup": lambda: stub.Lookup(pb.LookupRequest(adapter="a"), metadata=auth),
        "route": lambda: stub.Route(pb.RouteRequest(), metadata=auth),
        "watch": lambda: stub.WatchReadiness(pb.WatchReadinessRequest(), metadata=auth),
    }
    code, message = code_of(calls[rpc])
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, message)
    assert f"needs the {needed} role" in message and f"--{needed}-token-file" in message


def test_every_role_sees_status_and_the_plain_token_keeps_every_role(roles: Any) -> None:
    stub = roles
    for role in ("all", "router", "engine", "operator"):
        assert stub.Status(pb.StatusRequest(), metadata=_auth(f"{role}-token"), timeout=30).epoch == 1
    code, message = code_of(lambda: stub.Hint(pb.HintRequest(), metadata=_auth("all-token")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "batch of hints is empty" in message  # past the roles
    code, _ = code_of(lambda: stub.Status(pb.StatusRequest(), metadata=_auth("nobody")))
    assert code == grpc.StatusCode.UNAUTHENTICATED


class CountingController(IndexController):
    """The watch calls over a real ReadinessIndex, counting the long polls in flight at once."""

    def __init__(self, idx: ReadinessIndex) -> None:
        super().__init__(idx)
        self.begun = self.waiting = self.most = 0
        self.poll_events = _Remote(self._counted)
        self.begin_watch = _Remote(self._begin)

    async def _begin(self, replica: str | None, adapter: str | None) -> int:
        self.begun += 1
        return await self._begin_watch(replica, adapter)

    async def _counted(self, after: int, replica: Any, adapter: Any, timeout_s: float) -> WatchBatch:
        long = timeout_s > 0
        self.waiting += long
        self.most = max(self.most, self.waiting)
        try:
            return await self._poll_events(after, replica, adapter, timeout_s)
        finally:
            self.waiting -= long


def test_watch_streams_share_one_controller_long_poll_and_each_gets_its_own_events() -> None:
    """Issue 35 item 6: each WatchReadiness stream held a long poll of the controller of its own (the actor runs
    1,000 calls at once). Now one poll serves every stream of the gateway, each filtered for its stream."""
    idx = ReadinessIndex(start_seq=10)
    idx.add_replica("replica-0", 1)
    ctl = CountingController(idx)
    gw = start_gateway_thread(GatewayConfig(grpc_port=0), ctl)
    try:
        with grpc.insecure_channel(gw.target) as channel:
            stub = pb_grpc.LoraCacheServiceStub(channel)
            streams = [stub.WatchReadiness(pb.WatchReadinessRequest(adapter=f"a{k % 2}")) for k in range(20)]
            wait_for(lambda: ctl.begun == 20, what="twenty watch streams open", timeout=30)
            with ctl.lock:
                idx.report("replica-0", 0, "a0", "v1", RankState.READY)
                idx.report("replica-0", 0, "a1", "v1", RankState.READY)
            for k, s in enumerate(streams):
                (event,) = next(s).events
                assert (event.adapter, event.seq) == (f"a{k % 2}", 11 + k % 2), "another stream's event"
            late = stub.WatchReadiness(pb.WatchReadinessRequest(after_seq=10))  # a cursor behind: caught up
            assert [e.adapter for e in next(late).events] == ["a0", "a1"]
            assert ctl.most == 1, f"{ctl.most} long polls of the controller at once"
            for s in [*streams, late]:
                s.cancel()
    finally:
        gw.stop()


def test_the_demo_router_gets_a_token_with_the_router_role(tmp_path: Path) -> None:
    """Known issue (issue 35): ``serve --demo`` with only role token files ran its router with
    ``bearer_token()`` (the every-role token: None there), so every demo call failed UNAUTHENTICATED.
    ``token_for("router")`` is the token the demo router sends."""
    for role in ("router", "engine", "operator"):
        (tmp_path / role).write_text(f"{role}-secret\n")
    roles = GatewayConfig(**{f"{r}_token_file": str(tmp_path / r) for r in ("router", "engine", "operator")})
    assert roles.token_for("router") == "router-secret" and roles.token_for("engine") == "engine-secret"
    assert GatewayConfig(token="all-roles").token_for("router") == "all-roles"
    assert GatewayConfig().token_for("router") is None  # auth off
    with pytest.raises(ConfigError, match="no token carries the router role; give --router-token-file"):
        GatewayConfig(engine_token_file=str(tmp_path / "engine")).token_for("router")
