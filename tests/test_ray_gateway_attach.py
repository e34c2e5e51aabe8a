"""An engine process outside the Ray cluster attaches a rank through the gateway (docs/integrating.md,
"Outside the Ray cluster"), on a real local Ray: the controller alone (``serve --replicas 0``) and the
gateway with token auth in this process; the engine is a plain subprocess that never imports Ray
(tests/gateway_engine.py). It receives a prefetch from a hint, reaches READY, steps, reports its queue
and detaches; a killed process is dropped the same way; bad streams get clear errors and leave the
attached rank alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.api import relay_codec as codec  # noqa: E402
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread  # noqa: E402
from lora_cache.api.v1 import lora_cache_service_pb2 as pb  # noqa: E402
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "gw-attach-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
REPLICA = "replica-g"


class Fleet:
    def __init__(self, service: Any, gateway: Any, stub: Any) -> None:
        self.service, self.gateway, self.stub = service, gateway, stub

    @property
    def controller(self) -> Any:
        return self.service.controller


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=4, rank="8,16"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    try:
        service = start(ServeConfig(adapters=str(root), replicas=0), CatalogConfig(model="tiny", max_rank=16),
                        PlannerConfig(policy="global"),
                        WorkerConfig(num_slots=3, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        try:
            gateway = start_gateway_thread(GatewayConfig(grpc_port=0, token=TOKEN), service.controller)
            channel = grpc.insecure_channel(gateway.target)
            try:
                yield Fleet(service, gateway, pb_grpc.LoraCacheServiceStub(channel))
            finally:
                channel.close()
                gateway.stop()
        finally:
            service.stop()
    finally:
        ray.shutdown()


class EngineProc:
    """tests/gateway_engine.py in a subprocess: outside Ray (no RAY_ADDRESS), one command at a time."""

    def __init__(self, fleet: Fleet, **args: Any) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"PYTHONPATH": str(ROOT)}
        doc = {"replica": REPLICA, "gateway": fleet.gateway.target, "token": TOKEN} | args
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "gateway_engine.py"), json.dumps(doc)],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the engine process exited ({self.proc.wait(30)})"
        return dict(json.loads(line))

    def call(self, op: str, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        assert "error" not in answer, answer["error"]
        return answer["ok"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def ready_on(fleet: Fleet, adapter: str) -> list[str]:
    return list(fleet.stub.Lookup(pb.LookupRequest(adapter=adapter), metadata=AUTH, timeout=30).ready_replicas)


def hint(fleet: Fleet, hint_id: str, adapter: str) -> None:
    request = pb.HintRequest(hints=[pb.PrefetchHint(hint_id=hint_id, adapter=adapter, replica=REPLICA)])
    assert fleet.stub.Hint(request, metadata=AUTH, timeout=30).accepted == 1


def named(name: str) -> bool:
    try:
        ray.get_actor(name, namespace="lora-cache")
        return True
    except ValueError:
        return False


RANK0 = "lora-cache-worker:replica-g:0"


def test_an_engine_outside_ray_attaches_through_the_gateway_serves_and_detaches(fleet: Fleet) -> None:
    engine = EngineProc(fleet, max_adapters=2, max_running=6)
    try:
        assert engine.hello == {"attached": RANK0, "ray": False, "model": "tiny"}  # Ray never imported there
        status = ray.get(fleet.controller.status.remote(), timeout=30)
        assert REPLICA in status["replicas"] and named(RANK0)  # the gateway hosts its endpoint
        # the hello's admission limits reach routing advice (issue 31)
        assert ray.get(fleet.controller.declared_limits.remote(REPLICA), timeout=30) == (2, 6)

        hint(fleet, "g-1", "adapter-001")  # the controller prefetches into the process, relayed by the gateway
        wait_for(lambda: REPLICA in ready_on(fleet, "adapter-001"), "READY through the gateway", timeout=90)
        assert ("adapter-001", "ready") in {tuple(r) for r in engine.call("residency")}
        assert len(engine.call("step", adapters=["adapter-001", "adapter-001"])) == 2
        stats = engine.call("stats")
        assert stats["gpu_hits"] == 1 and stats["gpu_misses"] == 0 and stats["commands_accepted"] >= 1
        assert stats["calls"] >= 3 and stats["errors"] == 0 and stats["lost"] == "None" and not stats["ray"]

        engine.call("queue", adapters=["adapter-002", "adapter-001"])  # through the gateway's ReportQueue
        wait_for(lambda: ray.get(fleet.controller.status.remote())["queue_depths"].get(REPLICA) == 2,
                 "queue", timeout=90)
        workers = ray.get(fleet.controller.worker_stats.remote(), timeout=30)  # a controller call relayed: stats
        assert [w["stats"]["gpu_hits"] for w in workers if w["worker"] == RANK0] == [1]

        engine.call("detach")
        wait_for(lambda: REPLICA not in ready_on(fleet, "adapter-001"), "the detached rank dropped", timeout=90)
        wait_for(lambda: not named(RANK0), "the endpoint killed", timeout=90)
        assert engine.proc.wait(60) == 0
        assert ray.get(fleet.controller.check_integrity.remote())
    finally:
        engine.close()


def test_a_killed_engine_process_is_a_dead_rank(fleet: Fleet) -> None:
    engine = EngineProc(fleet)
    try:
        assert engine.hello["attached"] == RANK0
        hint(fleet, "g-2", "adapter-003")
        wait_for(lambda: REPLICA in ready_on(fleet, "adapter-003"), "READY through the gateway", timeout=90)
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(30)
        wait_for(lambda: REPLICA not in ready_on(fleet, "adapter-003"), "the killed rank dropped", timeout=90)
        wait_for(lambda: not named(RANK0), "the endpoint killed with the stream", timeout=90)
        assert all(REPLICA not in ready_on(fleet, f"adapter-00{i}") for i in range(4))  # ready for nothing
    finally:
        engine.close()


def test_a_stopped_engine_process_with_its_stream_open_is_a_dead_rank(fleet: Fleet) -> None:
    """SIGSTOP: the socket stays open, but the process sends no RankAlive (the gateway's own takes are no
    sign of life), so its endpoint fails the controller's ping after liveness_s and the rank is dropped."""
    engine = EngineProc(fleet, liveness_s=3.0)
    try:
        assert engine.hello["attached"] == RANK0
        hint(fleet, "g-4", "adapter-000")
        wait_for(lambda: REPLICA in ready_on(fleet, "adapter-000"), "READY through the gateway", timeout=90)
        engine.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: REPLICA not in ready_on(fleet, "adapter-000"), "the silent rank dropped", timeout=90)
        assert named(RANK0)  # its stream is still open: the endpoint stays until the stream ends
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(30)
        wait_for(lambda: not named(RANK0), "the endpoint killed with the stream", timeout=90)
    finally:
        engine.close()


def _stream(fleet: Fleet, messages: list[pb.AttachRankRequest], metadata: Any = AUTH) -> grpc.RpcError:
    """Send ``messages`` up, read down until the gateway ends the stream with an error; that error."""
    done = threading.Event()

    def up() -> Iterator[pb.AttachRankRequest]:
        yield from messages
        done.wait(60)  # the stream stays open: the gateway must end it

    try:
        with pytest.raises(grpc.RpcError) as info:
            for _ in fleet.stub.AttachRank(up(), metadata=metadata, timeout=60):
                pass  # Attached, the adoption's describe (left unanswered)
    finally:
        done.set()
    return info.value


def hello(**kw: Any) -> pb.AttachRankRequest:
    fields: dict[str, Any] = {"replica": "replica-b", "rank": 0, "tp": 1, "num_slots": 3, "model": "tiny",
                              "incarnation": time.time_ns(), "liveness_s": 10.0, "start_s": 60.0,
                              "name_wait_s": 0.0} | kw
    return pb.AttachRankRequest(hello=pb.AttachHello(**fields))


@pytest.mark.parametrize(("messages", "code", "fragment"), [
    ([pb.AttachRankRequest(alive=pb.RankAlive())], grpc.StatusCode.INVALID_ARGUMENT,
     "first message of an AttachRank stream must be an AttachHello, not 'alive'"),
    ([hello(replica="bad/name")], grpc.StatusCode.INVALID_ARGUMENT,
     "replica 'bad/name' in the AttachHello is malformed"),
    ([hello(rank=1, tp=1)], grpc.StatusCode.INVALID_ARGUMENT, "rank 1 of replica 'replica-b' is not below tp 1"),
    ([hello(model="llama-3.1-8b")], grpc.StatusCode.INVALID_ARGUMENT,
     "serves model 'llama-3.1-8b' but the controller plans for 'tiny'"),
    ([hello(), hello()], grpc.StatusCode.INVALID_ARGUMENT, "a second AttachHello on its stream"),
    ([hello(), pb.AttachRankRequest(answer=pb.CallAnswer(call_id=12345, unregistered=True))],
     grpc.StatusCode.INVALID_ARGUMENT, "an answer for call 12345, which is not in flight on this stream"),
])
def test_bad_streams_get_clear_errors_and_leave_an_attached_rank_alone(fleet: Fleet, messages, code, fragment) -> None:
    error = _stream(fleet, messages)
    assert error.code() == code and fragment in error.details(), (error.code(), error.details())
    wait_for(lambda: not named("lora-cache-worker:replica-b:0"), "no endpoint left behind", timeout=90)


def test_the_gateway_refuses_a_stream_without_its_token_and_a_taken_rank(fleet: Fleet) -> None:
    error = _stream(fleet, [hello()], metadata=())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = EngineProc(fleet, token="not-the-token")  # the engine's side: a ConfigError naming the fix
    try:
        assert wrong.hello["error"] == "ConfigError" and "the bearer token is wrong" in wrong.hello["message"]
    finally:
        wrong.close()
    engine = EngineProc(fleet)
    try:
        assert engine.hello["attached"] == RANK0
        second = EngineProc(fleet, name_wait_s=0.0)  # the same rank again, while the first holds it
        try:
            assert second.hello["error"] == "ConflictError" and not second.hello["ray"]
            assert "rank 0 of replica 'replica-g' is already attached" in second.hello["message"]
        finally:
            second.close()
        # streams that name the attached rank itself, or misbehave beside it, end alone
        error = _stream(fleet, [hello(replica=REPLICA)])
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "rank 0 of replica 'replica-g' is already attached" in error.details()
        error = _stream(fleet, [hello(replica=REPLICA, model="llama-3.1-8b")])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "serves model 'llama-3.1-8b'" in error.details()
        error = _stream(fleet, [hello(), pb.AttachRankRequest(answer=pb.CallAnswer(call_id=7, unregistered=True))])
        assert "an answer for call 7, which is not in flight" in error.details()
        assert named(RANK0)
        # the bad streams and the refused rank did not disturb the attached one
        hint(fleet, "g-3", "adapter-002")
        wait_for(lambda: REPLICA in ready_on(fleet, "adapter-002"), "the attached rank still serving", timeout=90)
        engine.call("detach")
    finally:
        engine.close()


def test_an_engine_presents_its_client_certificate_and_speaks_for_its_own_replica_only(
        fleet: Fleet, tmp_path: Path) -> None:
    """Issue 46 items 1-2: an engine outside Ray attaches through a mutual-TLS gateway with its client certificate
    (``AttachConfig.tls_client_cert``), whose identity is bound to its replica: it attaches and reports its queue;
    an engine whose identity is bound to another replica is refused naming both, and nothing is made for it. (Before:
    an attached engine could present no certificate, so it could not attach under --tls-client-ca.)"""
    from tests.test_gateway_mtls import _issue  # certificates of a test CA, made with ``cryptography``

    ca, ca_cert, ca_key = _issue(tmp_path, "test-ca", None, ca=True)
    server = _issue(tmp_path, "localhost", (ca_cert, ca_key))[0]
    mine, other = (_issue(tmp_path, n, (ca_cert, ca_key))[0] for n in ("engine-g", "engine-x"))
    (tmp_path / "roles.json").write_text(json.dumps({
        "engine-g": {"roles": ["engine"], "replicas": [REPLICA]},
        "engine-x": {"roles": ["engine"], "replicas": ["replica-x"]}}))
    config = GatewayConfig(grpc_host="localhost", grpc_port=0, tls_cert=str(server.cert), tls_key=str(server.key),
                           tls_client_ca=str(ca.cert), tls_client_roles=str(tmp_path / "roles.json"))
    gateway = start_gateway_thread(config, fleet.controller)
    try:
        def engine(who: Any, **args: Any) -> EngineProc:
            return EngineProc(fleet, gateway=f"localhost:{gateway.port}", token="", tls_ca=str(ca.cert),
                              tls_client_cert=str(who.cert), tls_client_key=str(who.key), **args)

        stranger = engine(other, name_wait_s=0.0)
        try:
            assert stranger.hello["error"] == "GatewayLinkError", stranger.hello
            assert "AttachRank for replica 'replica-g' rank 0 refused" in stranger.hello["message"]
            assert "speaks for 'replica-x' only" in stranger.hello["message"]
        finally:
            stranger.close()
        assert not named(RANK0)
        own = engine(mine)
        try:
            assert own.hello["attached"] == RANK0 and not own.hello["ray"]
            own.call("queue", adapters=["adapter-003"])  # ReportQueue under its certificate, for its own replica
            wait_for(lambda: ray.get(fleet.controller.status.remote())["queue_depths"].get(REPLICA) == 1,
                     "its queue report", timeout=90)
            own.call("queue", adapters=[])
            own.call("detach")
            assert own.proc.wait(60) == 0
        finally:
            own.close()
        wait_for(lambda: not named(RANK0), "the endpoint killed", timeout=90)
    finally:
        gateway.stop()


def test_an_engine_outside_ray_resolves_a_new_adapter_under_a_root(fleet: Fleet, tmp_path: Path) -> None:
    """Issue 44 item 4: an engine attached through the gateway gets a request for a name nobody registered; its
    ``resolve`` (the ResolveAdapter RPC) has the controller register it from the adapter root, and returns once
    the rank's own catalog holds that version; a name under no root is NOT_FOUND, typed, for the engine. (Before:
    the attach seam had no call for it and refused the name.)"""
    import shutil

    root = Path(ray.get(fleet.controller.catalog_config.remote(), timeout=30).adapter_roots[0])
    shutil.copytree(root / "adapter-001", root / "tenant-new")  # a new tenant's adapter, arrived after the start
    engine = EngineProc(fleet)
    try:
        assert engine.hello["attached"] == RANK0
        got = engine.call("resolve", adapter="tenant-new")
        version = fleet.stub.Lookup(pb.LookupRequest(adapter="tenant-new"), metadata=AUTH, timeout=30).version
        assert got == {"version": version, "catalog": version}, got
        missing = engine.call("resolve", adapter="tenant-ghost")
        assert missing["error"] == "NotFoundError" and "tenant-ghost" in missing["message"], missing
        assert engine.call("resolve", adapter="tenant-new")["version"] == version  # known now: no call
        from lora_cache.api.client import ClientError, LoraCacheClient

        with LoraCacheClient(fleet.gateway.target, token=TOKEN) as router:  # a router's ResolveAdapter, too
            assert router.resolve("tenant-new") == version
            with pytest.raises(ClientError) as info:
                router.resolve("tenant-ghost")
            assert info.value.code == "NOT_FOUND"
            # a router that hints before it routes: the name resolves in the background, then the hint is taken
            shutil.copytree(root / "adapter-002", root / "tenant-hinted")
            hinted = router.hint([("h-tenant-hinted", "tenant-hinted", REPLICA)])
            assert (hinted.accepted, hinted.ignored, hinted.rejections) == (0, 1, ()), hinted

            def taken() -> bool:
                status = ray.get(fleet.controller.status.remote())
                return status["active_hints"].get(REPLICA, 0) >= 1 and status["resolver"]["hints_waiting"] == 0

            wait_for(taken, "the hint taken once its name resolved", timeout=60)
            assert router.lookup("tenant-hinted").version
        engine.call("detach")
    finally:
        engine.close()
        shutil.rmtree(root / "tenant-new", ignore_errors=True)
        shutil.rmtree(root / "tenant-hinted", ignore_errors=True)


def test_the_answers_codec_keeps_the_controllers_types() -> None:
    """What the controller reads of a relayed apply (``_collect``) survives the trip."""
    from lora_cache.vocab import ApplyResult

    _, ok, value = codec.from_answer(codec.answer(1, "apply", True, ApplyResult(1, 2, ("e",))), "apply")
    assert ok and value == ApplyResult(1, 2, ("e",)) and value.rejected_stale == 2


def test_an_engine_outside_ray_on_another_machine_serves_pushed_versions_from_its_own_copy(
        fleet: Fleet, tmp_path: Path) -> None:
    """Issue 44 item 2 through the gateway: an engine whose machine does not hold the controller's push area (its
    own push area here) fetches each pushed version over ``FetchPushed``, proves it and keeps a copy, and its slot
    holds that copy's slices of exactly what the trainer pushed; retired versions leave its copy (the relayed
    ``drop_pushed``) and an unregistered name leaves nothing; its copies lie under the gateway's service whatever its
    own ``AttachConfig.service`` says. (Before: its registrations of pushes failed.)"""
    from safetensors.torch import load

    from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE
    from lora_cache.integrations.ray_push import push_in_ray

    name = "trained-remote"
    root = Path(ray.get(fleet.controller.catalog_config.remote(), timeout=30).adapter_roots[0])
    tensors = load((root / "adapter-001" / WEIGHTS_FILE).read_bytes())
    config = json.loads((root / "adapter-001" / CONFIG_FILE).read_text())
    area = tmp_path / "engine-machine-memory"
    kept = lambda: sorted(p.name for p in (area / "lora-cache" / name).glob("*") if not p.name.startswith("."))  # noqa: E731
    # its AttachConfig.service names no service (through the gateway the service is the gateway's, told in Attached)
    engine = EngineProc(fleet, push_dir=str(area), service="not-the-gateways")
    try:
        assert engine.hello["attached"] == RANK0 and not engine.hello["ray"]
        for step in (1, 2, 3, 4, 5, 6):
            pushed = {k: (v.float() * (1 + step / 10)).to(v.dtype) for k, v in tensors.items()}
            done = push_in_ray(name, pushed, config, tag=step, timeout_s=120)
            assert not done.rank_pending, done
            got = engine.call("pushed", adapter=name)
            assert got["version"] == done.version and got["slot_is_the_file"], got
            assert Path(got["path"]) == area / "lora-cache" / name / str(step)
            held = load((area / "lora-cache" / name / str(step) / WEIGHTS_FILE).read_bytes())
            assert held.keys() == pushed.keys() and all(bool((held[k] == pushed[k]).all()) for k in held)
        assert engine.call("stats")["pushed_copied"] == 6
        wait_for(lambda: "1" not in kept() and "6" in kept(), f"version 1 dropped here ({kept()})", timeout=60)
        ray.get(fleet.controller.unregister_adapter.remote(name), timeout=60)
        wait_for(lambda: not kept(), f"no copy left after the unregistration ({kept()})", timeout=30)
        engine.call("detach")
        # FetchPushed's refusals: a version not kept, a bad name, a bad tag, each naming it
        for ask, code, fragment in [((name, "6"), grpc.StatusCode.NOT_FOUND, "not kept"),
                                    (("../up", "6"), grpc.StatusCode.INVALID_ARGUMENT, "name"),
                                    (("adapter-001", "a b"), grpc.StatusCode.INVALID_ARGUMENT, "tag")]:
            with pytest.raises(grpc.RpcError) as info:
                list(fleet.stub.FetchPushed(pb.FetchPushedRequest(name=ask[0], tag=ask[1]), metadata=AUTH,
                                            timeout=30))
            assert info.value.code() == code and fragment in info.value.details(), info.value.details()
    finally:
        engine.close()
