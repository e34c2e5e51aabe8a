"""An operable service on the command line (issue 34), without Ray: serve's checks before Ray starts,
grouped options, one JSON style, exit codes, `watch --timeout-s`, and the client's retries on UNAVAILABLE."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api.client import CHANNEL_OPTIONS, KEEPALIVE, LoraCacheClient
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.app.cli import build_parser, main
from lora_cache.app.client_cli import proto_json
from lora_cache.app.serve import ServeConfig
from lora_cache.controller.readiness import ReadinessIndex
from lora_cache.errors import ConfigError
from tests.test_watch_resync import IndexController


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ops")
    make_adapters(root / "ad", SynthConfig(model="tiny", count=1, rank="8"))
    return root / "ad"


def serve_fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``serve argv`` exits 2 within 3 s, before Ray starts, with its error on stderr (no traceback)."""
    import ray

    t0 = time.monotonic()
    assert main(["serve", *argv]) == 2
    assert time.monotonic() - t0 < 3.0
    assert not ray.is_initialized(), "Ray was started before the options were checked"
    err = capsys.readouterr().err
    assert err.startswith("lora-cache serve: error: ") and "Traceback" not in err
    return err


def test_serve_checks_paths_sizes_ports_and_files_before_ray_starts(
    adapters: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: each of these became a Ray traceback 9-12 s after start (or named a flag that does not exist,
    or asked "which base model?" for a directory that was not there)."""
    err = serve_fails(capsys, "--adapters", str(tmp_path / "nope"), "--model", "tiny")
    assert f"--adapters {tmp_path / 'nope'}: no such directory" in err and "--adapter-root " not in err
    err = serve_fails(capsys, "--adapters", str(tmp_path / "nope"))  # without --model: the same message
    assert "no such directory" in err and "which base model" not in err
    err = serve_fails(capsys, "--adapters", str(adapters), "--adapter-roots", str(tmp_path / "gone"))
    assert f"--adapter-roots {tmp_path / 'gone'}: no such directory" in err
    err = serve_fails(capsys, "--adapters", str(adapters), "--max-rank", "1024", "--host-bytes", str(1 << 20))
    assert "--host-bytes 1048576 (1.0 MiB) cannot hold one slot: a rank-1024 shard of tiny at TP 1 takes 4194304" in err
    assert "raise --host-bytes to at least 4194304" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = serve_fails(capsys, "--adapters", str(adapters), "--grpc-port", str(port))
    assert f"--grpc-port {port} on --grpc-host 127.0.0.1: it is taken" in err and "(0: any free port)" in err
    err = serve_fails(capsys, "--adapters", str(adapters), "--token-file", str(tmp_path / "no-token"))
    assert "token_file" in err and "is not a file" in err
    err = serve_fails(capsys, "--adapters", str(adapters), "--grpc-host", "0.0.0.0")  # issue 46: no auth
    assert "grpc_host '0.0.0.0' listens beyond this machine" in err and "--token-file" in err and "--insecure" in err
    err = serve_fails(capsys, "--adapters", str(adapters), "--service", "Bad_Name")
    assert "--service 'Bad_Name' is not a service name" in err
    monkeypatch.setenv("LORA_CACHE_PUSH_THREADS", "many")  # read by the controller's pushes: refused at the start
    err = serve_fails(capsys, "--adapters", str(adapters))
    assert "LORA_CACHE_PUSH_THREADS='many' is not a thread count" in err and "whole number from 1 to 256" in err
    monkeypatch.delenv("LORA_CACHE_PUSH_THREADS")
    monkeypatch.setenv("LORA_CACHE_PUSH_NICE", "-5")  # a push's passes above the engines: refused at the start
    err = serve_fails(capsys, "--adapters", str(adapters))
    assert "LORA_CACHE_PUSH_NICE='-5' is not a niceness" in err and "whole number from 0" in err


def test_serve_options_are_grouped_by_the_config_they_build() -> None:
    """Issue 34: 59 options in one flat list; now one argument group per config dataclass."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    titles = [g.title for g in serve._action_groups]
    for title in (
        "ServeConfig",
        "CatalogConfig",
        "PlannerConfig",
        "RouterConfig",
        "WorkerConfig",
        "HostTierConfig",
        "GatewayConfig",
        "ObserveConfig",
    ):
        assert title in titles
    group = {a.dest: g.title for g in serve._action_groups for a in g._group_actions}
    assert group["service"] == group["replicas"] == "ServeConfig" and group["host_bytes"] == "HostTierConfig"
    assert group["grpc_port"] == "GatewayConfig" and group["log_level"] == "ObserveConfig"
    assert "ServeConfig:" in serve.format_help()


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("serve", "demo", "make-adapters", "inspect", "hint", "route", "watch", "status", "register"):
        assert command in out


def test_status_prints_snake_case_and_numbers_as_numbers() -> None:
    """Issue 34: `status` printed camelCase keys and 64-bit numbers as strings, unlike `lookup` and `route`."""
    status = pb.StatusResponse(
        epoch=1 << 40,
        adapters=3,
        commands_sent=7,
        replicas=[
            pb.ReplicaStatus(
                replica="replica-0",
                queue_depth=2,
                workers=[pb.WorkerStatus(worker="w", counters=pb.CacheCounters(gpu_hits=5, gpu_hit_rate=0.5))],
            )
        ],
    )
    out = json.loads(json.dumps(proto_json(status)))
    assert out["epoch"] == 1 << 40 and out["commands_sent"] == 7 and out["hints_received"] == 0
    worker = out["replicas"][0]["workers"][0]
    assert worker["counters"]["gpu_hits"] == 5 and worker["counters"]["gpu_hit_rate"] == 0.5
    assert out["replicas"][0]["queue_depth"] == 2 and "queueDepth" not in out["replicas"][0]
    response = pb.WatchReadinessResponse(events=[pb.ReadinessEvent(seq=9, state=pb.READINESS_STATE_READY)])
    assert proto_json(response)["events"][0] == {
        "seq": 9,
        "replica": "",
        "adapter": "",
        "version": "",
        "state": "READINESS_STATE_READY",
    }


def test_watch_honours_timeout_s() -> None:
    """Issue 34: `watch --timeout-s 5` hung for 600 s on a stream with nothing to say."""
    idx = ReadinessIndex()
    idx.add_replica("replica-0", 1)
    gw = start_gateway_thread(GatewayConfig(grpc_port=0), IndexController(idx))
    try:
        rc: list[int] = []
        t0 = time.monotonic()
        thread = threading.Thread(
            target=lambda: rc.append(main(["watch", "--server", gw.target, "--timeout-s", "1"])), daemon=True
        )
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "watch ignored --timeout-s"
        assert rc == [0] and time.monotonic() - t0 < 10
    finally:
        gw.stop()


def test_exit_codes_usage_2_server_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 34: usage errors exited 1 (a bare SystemExit message), server-side ones 2."""
    assert main(["route", "a", "--outstanding", "replica-0", "--server", "127.0.0.1:9"]) == 2
    assert "--outstanding 'replica-0' is malformed" in capsys.readouterr().err
    assert main(["register", "a=", "--server", "127.0.0.1:9"]) == 2
    assert main(["status", "--server", "127.0.0.1:9", "--token-file", str(tmp_path / "none")]) == 2  # not a traceback
    assert "--token-file" in capsys.readouterr().err
    assert main(["lookup", "a", "--server", "127.0.0.1:9", "--timeout-s", "0.5"]) == 1  # the server is not there
    assert "UNAVAILABLE" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["status", "--bogus"])
    assert e.value.code == 2


class FlakyLookup:
    """A LoraCacheService whose Lookup is UNAVAILABLE ``failures`` times, then answers."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb.LookupResponse(adapter=request.adapter, version="v1")

    def server(self) -> tuple[Any, int]:
        from concurrent import futures

        handler = grpc.method_handlers_generic_handler(
            "lora_cache.v1.LoraCacheService",
            {
                "Lookup": grpc.unary_unary_rpc_method_handler(
                    self.lookup, pb.LookupRequest.FromString, pb.LookupResponse.SerializeToString
                )
            },
        )
        server = grpc.server(futures.ThreadPoolExecutor(2), handlers=(handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, port


def test_idempotent_calls_are_retried_on_unavailable() -> None:
    """Issue 34: the client had no retry policy: a gateway restart failed every call in flight."""
    flaky = FlakyLookup(failures=2)
    server, port = flaky.server()
    try:
        with LoraCacheClient(f"127.0.0.1:{port}", timeout_s=5) as lc:
            assert lc.lookup("a").version == "v1" and flaky.calls == 3
    finally:
        server.stop(0)
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.keepalive_time_ms"] > 0 and dict(KEEPALIVE) == {k: options[k] for k in dict(KEEPALIVE)}
    config = json.loads(options["grpc.service_config"])
    retried = {n["method"] for c in config["methodConfig"] for n in c["name"]}
    # registrations carry the client's request id (issue 46 item 3a): a retry is answered as the first was
    assert {"Lookup", "Route", "Status", "Hint", "RegisterAdapter", "RegisterAdapters"} <= retried
    assert "UnregisterAdapter" not in retried
    from workers.attach.grpc_transport import KEEPALIVE as ATTACH_KEEPALIVE

    assert ATTACH_KEEPALIVE == KEEPALIVE, "the AttachRank stream pings as the routers' client does"


def test_service_names_are_checked() -> None:
    assert ServeConfig(service="llama-8b").service == "llama-8b"
    for bad in ("", "-x", "UPPER", "a" * 64, "a:b"):
        with pytest.raises(ConfigError, match="is not a service name"):
            ServeConfig(service=bad)
