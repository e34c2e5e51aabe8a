"""The engine seam's plain parts, without Ray: its config, the replica checks an attaching rank meets, and
the benchmark's ``--attach`` option. (The seam itself, on a real Ray, is tests/test_ray_attach.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.run import BenchConfig
from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.errors import ConfigError
from lora_cache.runtime.ports import free_port
from lora_cache.vocab import WorkerId
from workers.attach.attachment import AttachConfig


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replica": ""}, "replica '' must be a non-empty name"),
    ({"replica": "a:b"}, "without ':' or '/'"),
    ({"address": ""}, "never starts a Ray of its own"),
    ({"poll_s": 5.0, "liveness_s": 5.0}, r"poll_s \(5.0\) must be > 0 and below liveness_s \(5.0\)"),
    ({"poll_s": 0.0}, r"poll_s \(0.0\) must be > 0"),
    ({"flush_s": 0.0}, r"flush_s \(0.0\) must be > 0"),
])
def test_attach_config_names_the_value_and_the_fix(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        AttachConfig(**({"replica": "replica-0"} | kwargs))


def test_a_rank_joins_its_replica_only_with_the_same_tp_and_slots(tmp_path: Path) -> None:
    """Ranks attach one at a time: the first adds the replica, each later one must agree with it."""
    make_adapters(tmp_path, SynthConfig(model="tiny", count=2, rank="8"))
    core = ControllerCore(ControllerConfig(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=8)), 1)
    assert core.add_replica("r0", 2, 4) == [WorkerId("r0", 0), WorkerId("r0", 1)]
    assert core.add_replica("r0", 2, 4) == [WorkerId("r0", 0), WorkerId("r0", 1)]  # the second rank: idempotent
    with pytest.raises(ConfigError, match=r"replica 'r0' already exists with 4 slots per worker, not 3"):
        core.add_replica("r0", 2, 3)
    with pytest.raises(ConfigError, match=r"replica 'r0' already exists with workers"):
        core.add_replica("r0", 1, 4)
    # a rank with a paged GPU pool (issue 43) reports its bytes and page: the planner counts its room in them
    core.add_replica("r0", 2, 4, gpu_bytes=4096, page_bytes=1024)
    for wid in (WorkerId("r0", 0), WorkerId("r0", 1)):
        assert core.planner.view.capacity(str(wid)) == (4, 4096, None, 1024, None)
    core.check_integrity()


def test_serve_may_run_the_controller_alone_and_attach_needs_the_real_engine() -> None:
    assert ServeConfig(replicas=0).replicas == 0  # engines attach their own ranks
    with pytest.raises(ConfigError, match=r"replicas \(-1\) must be >= 0"):
        ServeConfig(replicas=-1)
    assert BenchConfig(engine="real", attach=True).attach
    with pytest.raises(ConfigError, match="--attach runs the real engine's ranks in their own processes; it needs "
                                          "--engine real, not 'sim'"):
        BenchConfig(engine="sim", attach=True)


def test_attach_outside_any_cluster_fails_fast_and_names_the_address() -> None:
    """An engine process whose address reaches no Ray cluster (outside it, or the head down) is told so at
    once, before anything is built; it never starts a Ray of its own (docs/integrating.md, outside the
    cluster)."""

    import ray

    from lora_cache.runtime.cluster import ClusterUnreachableError
    from workers.attach.attachment import attach
    from workers.cache import WorkerConfig

    if ray.is_initialized():  # an earlier test of this session left Ray up: attach would not connect at all
        pytest.skip("this process is already in a Ray cluster")
    port = free_port()  # a port nobody listens on
    with pytest.raises(ClusterUnreachableError, match=f"127.0.0.1:{port}"):
        attach(AttachConfig(replica="replica-0", address=f"127.0.0.1:{port}"), WorkerConfig(device="cpu"))


def test_lora_cache_attach_is_the_seam() -> None:
    """``from lora_cache import attach`` (what an engine imports) is the seam, loaded on first use."""
    import lora_cache
    import workers.attach.attachment

    assert lora_cache.attach is workers.attach.attachment.attach
    assert lora_cache.AttachConfig is AttachConfig and lora_cache.Attachment is workers.attach.attachment.Attachment
    with pytest.raises(AttributeError, match="no attribute 'detach'"):
        lora_cache.detach  # noqa: B018


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_relay_delivers_each_answer_to_its_own_caller_in_call_order() -> None:
    """Calls reach the process in the order they were made (the worker actor's order); answers, in any
    order, reach their own callers; an exception answer raises in its caller; a late answer is dropped."""
    import asyncio

    from lora_cache.vocab import Call
    from workers.attach.attachment import Relay

    async def scenario() -> None:
        relay = Relay("w", liveness_s=5.0)
        first = asyncio.ensure_future(relay.call("describe"))
        second = asyncio.ensure_future(relay.call("apply", ["cmd"]))
        third = asyncio.ensure_future(relay.call("stats"))
        calls: list[Call] = []
        while len(calls) < 3:
            calls += await relay.take(1.0)
        assert [(m, a) for _, m, a in calls] == [("describe", ()), ("apply", (["cmd"],)), ("stats", ())]
        (i1, _, _), (i2, _, _), (i3, _, _) = calls
        assert relay.answer([(i3, True, {"loads": 1}), (i1, False, KeyError("nope"))]) == 2
        assert await third == {"loads": 1}
        with pytest.raises(KeyError, match="nope"):
            await first
        second.cancel()  # its caller gives up; the process's answer then finds no one
        with pytest.raises(asyncio.CancelledError):
            await second
        assert relay.answer([(i2, True, "late")]) == 0
        assert await relay.take(0.01) == []  # nothing queued: the poll times out empty

    asyncio.run(scenario())


def test_the_relay_gives_a_starting_process_its_grace_then_the_usual_liveness() -> None:
    """Before its first poll a process has ``start_s`` (its serve thread may start late on a loaded host,
    while the controller already calls it); after it, ``liveness_s`` as always."""
    from workers.attach.attachment import EndpointStaleError, Relay

    clock = Clock()
    relay = Relay("lora-cache-worker:r:0", liveness_s=1.0, clock=clock, start_s=30.0)
    clock.now += 25.0
    relay.check_live()  # not polled yet, inside the grace
    clock.now += 10.0
    with pytest.raises(EndpointStaleError, match=r"has not polled for calls for 35\.0 s since the endpoint was made"):
        relay.check_live()
    relay.answer([])
    clock.now += 0.5
    relay.check_live()
    clock.now += 1.0
    with pytest.raises(EndpointStaleError):
        relay.check_live()


def test_the_relay_fails_waiting_calls_and_pings_once_the_process_stops_polling() -> None:
    import asyncio

    from workers.attach.attachment import EndpointStaleError, Relay

    async def scenario() -> None:
        clock = Clock()
        relay = Relay("lora-cache-worker:r:0", liveness_s=0.01, clock=clock)  # checked every 10 ms of real time
        assert await relay.take(0.0) == []
        relay.check_live()  # it just polled
        clock.now += 0.005
        pending = asyncio.ensure_future(relay.call("describe"))
        calls = await relay.take(1.0)
        assert [m for _, m, _ in calls] == ["describe"]
        clock.now += 60.0  # the process took the call and then went quiet
        with pytest.raises(EndpointStaleError, match=r"lora-cache-worker:r:0: .* has not polled for calls for 60.0 s"):
            await pending
        with pytest.raises(EndpointStaleError):
            relay.check_live()
        relay.answer([])  # an answer is a sign of life again
        relay.check_live()

    asyncio.run(scenario())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gateway": "nohost"}, r"gateway 'nohost' is not host:port; give the gateway's address, e.g. 10.0.0.5:50051"),
    ({"gateway": "h:99999"}, r"gateway 'h:99999' is not host:port"),
    ({"gateway": "h:50051", "address": "10.0.0.1:6379"},
     r"address \('10.0.0.1:6379'\) and gateway \('h:50051'\) are both set: .* give one"),
    ({"token": "t"}, r"token, token_file, tls_ca and tls_client_cert/key are the gateway's: set gateway='host:port'"),
    ({"tls_client_cert": "/c"}, r"tls_client_cert/key are the gateway's"),
    ({"gateway": "h:1", "token": "t", "token_file": "/x"}, "both token and token_file are set"),
    ({"gateway": "h:1", "token_file": "/nonexistent/token"}, r"token_file '/nonexistent/token' is not a file"),
])
def test_attach_config_through_the_gateway_names_the_value_and_the_fix(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        AttachConfig(**({"replica": "replica-0"} | kwargs))


def test_attach_config_client_certificate_is_checked_before_anything_starts(tmp_path) -> None:
    """The rank's client certificate (mutual TLS): both files, with tls_ca, and a key of that certificate."""
    from tests.test_gateway_mtls import _issue

    ca, ca_cert, ca_key = _issue(tmp_path, "ca", None, ca=True)
    one, two = (_issue(tmp_path, n, (ca_cert, ca_key))[0] for n in ("engine-1", "engine-2"))
    base = {"replica": "replica-0", "gateway": "h:1", "tls_ca": str(ca.cert)}
    ok = AttachConfig(**base, tls_client_cert=str(one.cert), tls_client_key=str(one.key))
    assert ok.tls_client_cert == str(one.cert)
    for kwargs, message in [
        ({"tls_client_cert": str(one.cert)}, "tls_client_cert .* and tls_client_key .* go together"),
        ({"tls_client_cert": str(one.cert), "tls_client_key": str(two.key)},
         "tls_client_key .* is not the private key of tls_client_cert"),
        ({"tls_client_cert": str(one.key), "tls_client_key": str(one.cert)},
         "swap --tls-client-cert and --tls-client-key"),
        ({"tls_client_cert": str(tmp_path / "none.crt"), "tls_client_key": str(one.key)},
         "tls_client_cert .* is not a file; give the path of this rank's client certificate"),
    ]:
        with pytest.raises(ConfigError, match=message):
            AttachConfig(**(base | kwargs))
    with pytest.raises(ConfigError, match="give tls_ca too"):
        AttachConfig(replica="replica-0", gateway="h:1", tls_client_cert=str(one.cert), tls_client_key=str(one.key))


def test_attach_through_a_gateway_nobody_serves_fails_fast_and_names_it() -> None:
    """The engine's side alone: no gateway listens at the address, so the hello gets no answer and the
    error says where it looked; nothing is left running."""

    from workers.attach.attachment import attach
    from workers.attach.grpc_transport import GatewayLinkError
    from workers.cache import WorkerConfig

    port = free_port()  # a port nobody listens on
    with pytest.raises(GatewayLinkError, match=f"the gateway at 127.0.0.1:{port} is unreachable"):
        attach(AttachConfig(replica="replica-0", gateway=f"127.0.0.1:{port}"), WorkerConfig(device="cpu"))
