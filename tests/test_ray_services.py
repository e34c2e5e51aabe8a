"""Several services on one Ray cluster (issue 34): each `lora-cache serve --service NAME` has its own
controller, workers, placement groups and gateway; a taken name is refused and touches nothing; a
service that stops, or whose `serve` is SIGKILLed, takes away exactly what it started; the gateway's
health follows its controller.

One cluster for the module (this process: service "svc-a" and its gateway); the other services are
`lora-cache serve --address auto` processes that join it, as a user starts them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api.client import LoraCacheClient
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.app.serve import ServeConfig, start
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import CONTROLLER_NAME, WORKER_PREFIX
from tests.ray_local import init_local
from tests.serving import read_until, serve_argv
from tests.waiting import wait_for
from workers.attach.attachment import AttachConfig, attach
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
OTHER_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "head_dim": 16,
}  # the second service's base model: not tiny
A_ACTORS = {CONTROLLER_NAME, f"{WORKER_PREFIX}replica-0:0"}  # one service of one replica of TP 1, by name


class Cluster(NamedTuple):
    gcs: str
    service: Any
    gateway: Any
    tmp: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("services")
    make_adapters(tmp / "a", SynthConfig(model="tiny", count=2, rank="8"))
    (tmp / "other.json").write_text(json.dumps(OTHER_MODEL))
    make_adapters(tmp / "b", SynthConfig(model=str(tmp / "other.json"), count=3, rank="8"))
    init_local(num_cpus=4, namespace="svc-a", include_dashboard=False, log_to_driver=False)
    try:
        svc = start(
            ServeConfig(service="svc-a", adapters=str(tmp / "a"), replicas=1),
            CatalogConfig(model="tiny", max_rank=8),
            PlannerConfig(),
            WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)),
        )
        gateway = start_gateway_thread(GatewayConfig(grpc_port=0), svc.controller, health_name="svc-a")
        try:
            gcs = ray.get_runtime_context().gcs_address
            yield Cluster(gcs, svc, gateway, tmp)
        finally:
            gateway.stop()
            svc.stop()
    finally:
        ray.shutdown()


def serve(cluster: Cluster, service: str, adapters: str, *more: str) -> subprocess.Popen[str]:
    cmd = serve_argv(adapters, "--address", "auto", "--service", service, "--no-worker-logs", *more)
    env = {**os.environ, "RAY_ADDRESS": cluster.gcs, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def named(namespace: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def groups(service: str) -> set[str]:
    """The names of ``service``'s placement groups that are not removed."""
    return {
        g["name"]
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith(f"{service}:") and g["state"] != "REMOVED"
    }


def test_two_services_side_by_side_and_a_taken_name_refused(cluster: Cluster) -> None:
    """Issue 34: a second `serve` used the first one's controller (another base model silently shared it),
    failed on a placement group name that was taken, and its exit killed the first one's controller."""
    before = ray.get(cluster.service.controller.status.remote())
    b = serve(cluster, "svc-b", str(cluster.tmp / "b"), "--model", str(cluster.tmp / "other.json"))
    try:
        out = read_until(b, "lora-cache serving:")
        assert "3 adapters" in out[-1] and "(service svc-b)" in out[-1]
        gateway_b = next(line.split(" on ")[1].split()[0] for line in out if "gRPC gateway on" in line)
        assert named("svc-b") == A_ACTORS
        assert named("svc-a") == A_ACTORS
        assert groups("svc-b") == {"svc-b:replica-0"} and groups("svc-a") == {"svc-a:replica-0"}
        ctl_b = ray.get_actor(CONTROLLER_NAME, namespace="svc-b")
        catalog_b = ray.get(ctl_b.catalog_config.remote())
        assert catalog_b.model != "tiny" and ray.get(cluster.service.controller.catalog_config.remote()).model == "tiny"
        assert ray.get(ctl_b.status.remote())["adapters"] == 3 and before["adapters"] == 2
        with LoraCacheClient(gateway_b) as lc:
            assert lc.health("svc-b") == "SERVING" and lc.lookup("adapter-002").adapter == "adapter-002"
        # an engine rank joins svc-b from a process of another namespace (this one's is svc-a): it attached to
        # the default service's controller only (issue 34's leftover)
        host = HostTierConfig(host_bytes=1 << 22, pin=False)
        cpu = WorkerConfig(num_slots=2, device="cpu", dtype="float32", host=host)
        with attach(AttachConfig(replica="eng-b", service="svc-b"), cpu):
            wait_for(lambda: "eng-b" in ray.get(ctl_b.status.remote())["replicas"], "the rank in svc-b's fleet")
            assert "eng-b" not in ray.get(cluster.service.controller.status.remote())["replicas"]
        wait_for(lambda: "eng-b" not in ray.get(ctl_b.status.remote())["replicas"], "the detached rank gone")

        t0 = time.monotonic()  # the name svc-a is taken: refused before anything is created
        taken = serve(cluster, "svc-a", str(cluster.tmp / "a"), "--model", "tiny")
        _, err = taken.communicate(timeout=120)
        assert taken.returncode == 2, err[-2000:]
        assert "--service 'svc-a' is already running on this Ray cluster" in err and "another --service" in err
        assert "Traceback" not in err and time.monotonic() - t0 < 120
        assert named("svc-a") == A_ACTORS and groups("svc-a") == {"svc-a:replica-0"}
        assert ray.get(cluster.service.controller.status.remote())["epoch"] == before["epoch"]  # the same controller

        b.send_signal(signal.SIGTERM)  # svc-b stops: its own actors and groups go, svc-a's stay
        _, err_b = b.communicate(timeout=60)
        assert b.returncode == 0, err_b[-2000:]
        assert "not recommended" not in err_b, "Ray's warning on restartable detached actors in placement groups"
        wait_for(lambda: not named("svc-b") and not groups("svc-b"), "svc-b's actors and groups gone", timeout=30)
        assert named("svc-a") == A_ACTORS and groups("svc-a") == {"svc-a:replica-0"}
        assert ray.get(cluster.service.controller.status.remote())["adapters"] == 2
    finally:
        if b.poll() is None:
            b.kill()
            b.communicate()


def test_a_sigkilled_serve_leaves_nothing_of_its_service(cluster: Cluster) -> None:
    """Issue 34: `serve`'s controller, workers and placement groups were detached: a SIGKILLed `serve` left
    them running. They are owned by the `serve` process now, and Ray removes them when it dies."""
    c = serve(cluster, "svc-c", str(cluster.tmp / "a"), "--model", "tiny")
    try:
        read_until(c, "lora-cache serving:")
        assert named("svc-c") and groups("svc-c") == {"svc-c:replica-0"}
        c.send_signal(signal.SIGKILL)
        c.wait(30)
        wait_for(
            lambda: not named("svc-c") and not groups("svc-c"),
            "svc-c's actors and groups gone",
            timeout=40,
            detail=lambda: f"{named('svc-c')} {groups('svc-c')}",
        )
        assert named("svc-a") == A_ACTORS
    finally:
        if c.poll() is None:
            c.kill()
        c.communicate()


def test_health_follows_the_controller(cluster: Cluster) -> None:
    """Issue 34: health was set SERVING once and stayed so with the controller dead. NOT_SERVING within
    2 s of the controller going (here: killed; Ray restarts it), SERVING again once it answers."""
    with LoraCacheClient(cluster.gateway.target, timeout_s=5) as lc:
        assert {lc.health(name) for name in ("", "lora_cache.v1.LoraCacheService", "svc-a")} == {"SERVING"}
        ray.kill(cluster.service.controller, no_restart=False)
        t0 = time.monotonic()
        wait_for(lambda: lc.health("svc-a") == "NOT_SERVING", "NOT_SERVING", timeout=5, poll_s=0.05)
        assert time.monotonic() - t0 < 2.0
        assert lc.health("") == "NOT_SERVING"
        wait_for(lambda: lc.health("svc-a") == "SERVING", "SERVING again after the restart", timeout=60, poll_s=0.1)
