"""Secure by default (issue 46, item 2), on the CPU with a stand-in controller and a real gRPC server.

- Beyond loopback without authentication the gateway refuses to start (ConfigError naming the host and the
  fix), before anything starts; ``--insecure`` starts it with a loud warning and says so in its description.
- Unary calls are limited per client (a token bucket): one client over its rate gets RESOURCE_EXHAUSTED
  naming the limit and its flag, while a client of another credential keeps being served.
- A client is its credential: two routers behind one address with their own tokens are two clients, for
  calls and for streams.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from lora_cache.api.auth import ROLES, Allowed, Credentials, Grant
from lora_cache.api.callers import CallRate, check_speaks_for, speaks_for, token_digest
from lora_cache.api.gateway import GatewayConfig, is_loopback, start_gateway_thread
from lora_cache.api.servicer import SERVICE_NAME
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc
from lora_cache.errors import CapacityError, ConfigError, PermissionDeniedError
from tests.test_gateway import StallController
from tests.test_gateway_limits import WatchedController, _auth
from tests.waiting import wait_for


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_without_auth_is_allowed(host: str) -> None:
    assert is_loopback(host)
    assert "loopback only" in GatewayConfig(grpc_host=host, grpc_port=0).security()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "10.0.0.10", "gateway.example.com"])
def test_beyond_loopback_without_auth_is_refused_naming_the_host_and_the_fix(host: str, tmp_path: Path) -> None:
    assert not is_loopback(host)
    with pytest.raises(ConfigError) as info:
        GatewayConfig(grpc_host=host, grpc_port=0)
    message = str(info.value)
    assert f"grpc_host {host!r} listens beyond this machine" in message
    for fix in ("--token-file", "--router-token-file", "--tls-cert", "--insecure"):
        assert fix in message, fix
    (tmp_path / "token").write_text("t0ken\n")
    assert "bearer tokens" in GatewayConfig(grpc_host=host, grpc_port=0, token_file=str(tmp_path / "token")).security()
    (tmp_path / "routers").write_text("r1\nr2\n")
    assert GatewayConfig(grpc_host=host, router_token_file=str(tmp_path / "routers")).role_tokens() == {
        "r1": frozenset({"router"}), "r2": frozenset({"router"})}  # one token a line: one per router


def test_insecure_starts_beyond_loopback_with_a_loud_warning(caplog: pytest.LogCaptureFixture) -> None:
    config = GatewayConfig(grpc_host="0.0.0.0", grpc_port=0, insecure=True)
    assert config.security().startswith("INSECURE")
    with caplog.at_level(logging.WARNING, logger="lora_cache.api.gateway"):
        gw = start_gateway_thread(config, StallController())
    try:
        assert any(r.levelno == logging.WARNING and "NO AUTHENTICATION (--insecure)" in r.getMessage()
                   for r in caplog.records)
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            assert pb_grpc.LoraCacheServiceStub(channel).Status(pb.StatusRequest(), timeout=30).epoch == 1
    finally:
        gw.stop()


def test_call_rate_is_a_token_bucket_per_client_and_bounded() -> None:
    now = [0.0]
    rate = CallRate(per_s=2.0, burst=3, clock=lambda: now[0], max_clients=4)
    for _ in range(3):
        rate.take("token a", "Route")
    with pytest.raises(CapacityError, match=r"client token a is over its call rate \(2 calls/s, bursts of 3.*"
                                            r"--calls-per-client-s"):
        rate.take("token a", "Route")
    rate.take("token b", "Route")  # another client's bucket is its own
    now[0] = 0.5  # one call's worth refilled
    rate.take("token a", "Route")
    with pytest.raises(CapacityError):
        rate.take("token a", "Route")
    assert rate.refused == 2
    for i in range(10):  # many clients: full buckets are forgotten, the table stays bounded
        now[0] += 10.0
        rate.take(f"address 10.0.0.{i}", "Lookup")
    assert len(rate.buckets) <= 4


def test_one_client_over_its_call_rate_is_refused_and_another_credential_is_served(tmp_path: Path) -> None:
    (tmp_path / "routers").write_text("router-one\nrouter-two\n")  # two routers behind one address
    config = GatewayConfig(grpc_port=0, router_token_file=str(tmp_path / "routers"),
                           calls_per_client_s=0.001, call_burst_per_client=3)
    gw = start_gateway_thread(config, StallController())
    try:
        with grpc.insecure_channel(gw.target) as channel:
            stub = pb_grpc.LoraCacheServiceStub(channel)
            for _ in range(3):
                assert stub.Status(pb.StatusRequest(), metadata=_auth("router-one"), timeout=30).epoch == 1
            with pytest.raises(grpc.RpcError) as info:
                stub.Status(pb.StatusRequest(), metadata=_auth("router-one"), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = info.value.details()
            assert f"token {token_digest('router-one')}" in details and "router-one" not in details  # no secret
            assert "calls_per_client_s" in details and "--calls-per-client-s" in details
            for _ in range(3):  # the other router is its own client
                assert stub.Status(pb.StatusRequest(), metadata=_auth("router-two"), timeout=30).epoch == 1
    finally:
        gw.stop()


def test_leaked_streams_of_one_router_do_not_lock_out_another_router_behind_the_same_address(
        tmp_path: Path) -> None:
    """The issue's case: routers behind one address, each with its own token from one file; one leaks its
    Watch streams up to the limit, the other still opens its own."""
    (tmp_path / "routers").write_text("leaky\nsteady\n")
    ctl = WatchedController()
    gw = start_gateway_thread(GatewayConfig(grpc_port=0, router_token_file=str(tmp_path / "routers"),
                                            max_concurrent_rpcs=16, max_streams_per_client=2), ctl)
    try:
        with grpc.insecure_channel(gw.target) as channel:
            stub = pb_grpc.LoraCacheServiceStub(channel)
            leaked: list[Any] = [stub.WatchReadiness(pb.WatchReadinessRequest(), metadata=_auth("leaky"))
                                 for _ in range(4)]
            wait_for(lambda: ctl.watches == 2 and sum(s.done() for s in leaked) == 2,
                     what="two leaked streams open and two refused", timeout=30)
            assert {s.code() for s in leaked if s.done()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            mine = [stub.WatchReadiness(pb.WatchReadinessRequest(), metadata=_auth("steady")) for _ in range(2)]
            wait_for(lambda: ctl.watches == 4, what="the steady router's own two streams", timeout=30)
            assert not any(s.done() for s in mine)
            for s in [*leaked, *mine]:
                s.cancel()
    finally:
        gw.stop()


# -- engine credentials bound to their replicas (issue 46, item 1) ----------------------------------------------
def test_engine_tokens_bind_to_replicas_and_malformed_lines_are_named(tmp_path: Path) -> None:
    (tmp_path / "all").write_text("all-token\n")
    (tmp_path / "engines").write_text("any-engine\neng-0 replica-0\neng-01 replica-0 replica-1\nall-token replica-9\n")
    grants = GatewayConfig(token_file=str(tmp_path / "all"), engine_token_file=str(tmp_path / "engines")).token_grants()
    assert grants["any-engine"] == Grant(frozenset({"engine"}), None)
    assert grants["eng-0"] == Grant(frozenset({"engine"}), frozenset({"replica-0"}))
    assert grants["eng-01"].replicas == frozenset({"replica-0", "replica-1"})
    assert grants["all-token"] == Grant(frozenset(ROLES), None)  # the every-role token stays unbound
    assert Credentials(grants).unbound_engines() == 2
    (tmp_path / "routers").write_text("r1\nr2 replica-0\n")
    with pytest.raises(ConfigError, match=r"router_token_file .* line 2 has 2 words; give one token a line"):
        GatewayConfig(router_token_file=str(tmp_path / "routers"))
    (tmp_path / "ranks").write_text("eng-0-1 replica-0/1 replica-2\n")  # issue 46 item 1: "(and rank)"
    ranked = GatewayConfig(engine_token_file=str(tmp_path / "ranks")).token_grants()
    assert ranked["eng-0-1"].replicas == frozenset({"replica-0/1", "replica-2"})
    for bad in ("replica/x", "replica/", "/0", "replica/0/1", "replica/-1", "replica/12345", "r@/0"):
        (tmp_path / "bad").write_text(f"eng {bad}\n")
        with pytest.raises(ConfigError, match=rf"line 1: '{re.escape(bad)}' is not a replica or a rank; give "
                                              r"'TOKEN REPLICA\.\.\.', each REPLICA \(every rank\) or REPLICA/RANK"):
            GatewayConfig(engine_token_file=str(tmp_path / "bad"))


def test_a_call_speaks_for_the_replicas_of_its_bound_engine_grants_only() -> None:
    """``Credentials.judge``: what the gateway sets for the call's handler (``speaks_for``)."""
    creds = Credentials({"eng-0": Grant(frozenset({"engine"}), frozenset({"replica-0"})),
                         "eng-any": frozenset({"engine"}),
                         "both": Grant(frozenset({"engine", "router"}), frozenset({"replica-1"}))},
                        {"engine-cert": Grant(frozenset({"engine"}), frozenset({"replica-2"}))}, mutual_tls=True)
    report, attach = f"/{SERVICE_NAME}/ReportQueue", f"/{SERVICE_NAME}/AttachRank"
    assert creds.judge(report, "Bearer eng-0", []) == Allowed(frozenset({"replica-0"}))
    assert creds.judge(attach, "Bearer eng-any", []) == Allowed(None)
    assert creds.judge(report, "Bearer both", []) == Allowed(None)  # its router role reports any queue
    assert creds.judge(attach, "Bearer both", []) == Allowed(frozenset({"replica-1"}))  # attaching is the engine's
    assert creds.judge(attach, "Bearer eng-0", ["engine-cert"]) == Allowed(frozenset({"replica-0", "replica-2"}))
    assert creds.judge(attach, None, ["engine-cert"]) == Allowed(frozenset({"replica-2"}))
    assert creds.judge(attach, "Bearer eng-any", ["engine-cert"]) == Allowed(None)
    token = speaks_for.set(frozenset({"replica-0"}))
    try:
        check_speaks_for("replica-0", "ReportQueue")
        with pytest.raises(PermissionDeniedError, match="ReportQueue for replica 'replica-1' refused: this engine "
                                                        "credential speaks for 'replica-0' only"):
            check_speaks_for("replica-1", "ReportQueue")
    finally:
        speaks_for.reset(token)
    check_speaks_for("replica-1", "ReportQueue")  # outside a bound call: any replica
    token = speaks_for.set(frozenset({"replica-0/1", "replica-2"}))  # one rank of replica-0, all of replica-2
    try:
        check_speaks_for("replica-0", "AttachRank", 1)
        check_speaks_for("replica-2", "AttachRank", 0)
        check_speaks_for("replica-0", "ReportQueue")  # its replica's queue: any of its ranks speaks for it
        with pytest.raises(PermissionDeniedError, match=r"AttachRank for replica 'replica-0' rank 0 refused: this "
                                                        r"engine credential speaks for 'replica-0/1', 'replica-2'"):
            check_speaks_for("replica-0", "AttachRank", 0)
        with pytest.raises(PermissionDeniedError, match="ReportQueue for replica 'replica-1' refused"):
            check_speaks_for("replica-1", "ReportQueue")
        with pytest.raises(PermissionDeniedError, match="AttachRank for replica 'replica-01' rank 1 refused"):
            check_speaks_for("replica-01", "AttachRank", 1)  # a prefix of another name is not that replica
    finally:
        speaks_for.reset(token)
