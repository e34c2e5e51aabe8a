"""A two-node Ray cluster on this machine, started the way operators start one, token auth on (off on a Ray
without it, below 2.52: the floor's CI run).

``ray start --head`` and ``ray start --address`` run as separate processes (their own process groups,
distinct ports, a short temporary dir); deploy/start-service.sh starts ``lora-cache serve --address auto``
as the cluster configs do, and it joins with a replica's two ranks on the two nodes; a hint over gRPC
reaches readiness; ``ray job submit`` runs the quick benchmark with deploy/runtime_env.yaml; ``lora-cache
serve --address host:port`` with a missing or wrong token fails fast with the fix. Every process this file
starts is stopped by it (its process group, or its pid), every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api.client import Hint, LoraCacheClient
from lora_cache.runtime import ray_compat
from lora_cache.runtime.ports import free_ports

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)  # ray, lora-cache and python of this interpreter come first on PATH
OBJECT_STORE_BYTES = 128 << 20  # per node: small, so /dev/shm of a CI container suffices
TOKEN_AUTH = ray_compat.has_token_auth()
WORKER_PORTS = 20000  # node i's workers bind 20000 + 2000 i .. + 1999 (below lora_cache.runtime.ports.LOW)


def stop_group(pgid: int, grace_s: float = 3.0) -> None:
    """SIGTERM the process group ``pgid`` (a node's Ray processes), SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


class Loopback:
    """Head and worker node on 127.0.0.1, each ``ray start`` in a new session so that its daemons form one
    process group this test can stop (never ``ray stop``: it would stop every Ray on the machine)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token_file = root / "auth_token"
        self.token_file.write_text(secrets.token_hex(32))
        self.token_file.chmod(0o600)
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
        self.env.update(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0")
        # Two nodes' daemons on a 2-core machine beside the test: under CI's load the GCS once declared the second
        # node dead for missed health checks (Ray's default: 5 misses, one each 3 s) and the replica could not be
        # placed. This cluster tolerates 20 (a minute); the product's own loss detection is not under test here.
        self.env.update(RAY_health_check_failure_threshold="20")
        if TOKEN_AUTH:
            self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_file))
        (self.gcs_port, self.dashboard_port, client_port, *self.node_ports) = free_ports(11)
        self.gcs = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.groups: list[int] = []
        self.head_args = ["--head", "--port", str(self.gcs_port), "--include-dashboard", "true",
                          "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                          "--ray-client-server-port", str(client_port)]

    def _node_args(self, i: int) -> list[str]:
        metrics, agent, agent_grpc, runtime_env = self.node_ports[4 * i: 4 * i + 4]
        # Each raylet hands its workers ports from its own range, in order and without probing; two nodes on one
        # host with Ray's default range (10002-19999 for both) gave two workers port 10005 and one died at start
        # (CI, stop 58). Disjoint ranges below the ports free_ports draws from (lora_cache.runtime.ports.LOW+).
        low = WORKER_PORTS + 2000 * i
        return ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--num-gpus", "0",
                "--min-worker-port", str(low), "--max-worker-port", str(low + 1999),
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--metrics-export-port", str(metrics),
                "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
                "--runtime-env-agent-port", str(runtime_env), "--temp-dir", str(self.root / "ray"),
                "--disable-usage-stats"]

    def ray_start(self, args: list[str], timeout_s: float = 90.0) -> None:
        log = self.root / f"ray-start-{len(self.groups)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(["ray", "start", *args], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.groups.append(proc.pid)  # its pid is the group id of every daemon it starts
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"ray start {' '.join(args)} -> {rc}:\n{log.read_text()[-3000:]}"

    def start(self) -> None:
        self.ray_start([*self.head_args, *self._node_args(0)])
        self.ray_start(["--address", self.gcs, *self._node_args(1)])

    def deaths(self) -> str:
        """What the nodes' daemons logged about failing (a failure's detail): the GCS on nodes found dead or
        unhealthy, and every daemon's errors and exits (both nodes log into the one ``--temp-dir``)."""
        logs = self.root / "ray" / "session_latest" / "logs"
        out = []
        for log in sorted(logs.glob("*")):
            if not log.is_file() or not log.name.startswith(("gcs_server", "raylet", "dashboard_agent",
                                                              "runtime_env_agent", "monitor")):
                continue
            gcs = log.name.startswith("gcs_server")
            lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                     if (gcs and ("dead" in line.lower() or "health check" in line.lower()))
                     or " E " in line[:40] or " C " in line[:40] or "Traceback" in line or "Error" in line
                     or "exit" in line.lower() or "address already in use" in line.lower()]
            if lines:
                out.append(f"{log.name}:\n  " + "\n  ".join(lines[-12:]))
        return "\nThe nodes' daemons on failing:\n" + "\n".join(out)

    def stop(self) -> None:
        for pgid in reversed(self.groups):
            stop_group(pgid)


@pytest.fixture(scope="module")
def loopback() -> Iterator[Loopback]:
    root = Path(tempfile.mkdtemp(prefix="lc-", dir="/tmp"))  # short: Ray's unix sockets live under it (107 chars)
    cluster = Loopback(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def serve_args(adapters: Path, grpc_port: int) -> list[str]:
    """A replica of two ranks, one per node (STRICT_SPREAD), the gRPC gateway on ``grpc_port``."""
    return ["--adapters", str(adapters), "--model", "tiny", "--max-rank", "8", "--replicas", "1", "--tp", "2",
            "--placement", "STRICT_SPREAD", "--worker-cpus", "0.5", "--slots", "2", "--host-bytes", str(4 << 20),
            "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port), "--placement-timeout-s", "60"]


def wait_for_line(log: Path, text: str, timeout_s: float) -> str:
    """The log's text once it holds ``text``; fails with the log if time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = log.read_text()
        if text in out:
            return out
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} within {timeout_s} s:\n{log.read_text()[-4000:]}")


def worker_nodes(cluster: Loopback) -> dict[str, str]:
    """Alive WorkerActor name -> node id, from Ray's state API (the dashboard, with the token)."""
    done = subprocess.run(["ray", "list", "actors", "--address", cluster.dashboard, "--format", "json",
                           "--filter", "class_name=WorkerActor", "--filter", "state=ALIVE"],
                          env=cluster.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return {a["name"]: a["node_id"] for a in json.loads(done.stdout)}


def wait_ready(server: str, adapter: str, replica: str, timeout_s: float) -> None:
    with LoraCacheClient(server) as lc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if replica in lc.lookup(adapter).ready:
                return
            time.sleep(0.2)
    raise AssertionError(f"{replica} not ready for {adapter} within {timeout_s} s")


def test_serve_joins_two_nodes_hint_ready_then_benchmark_job(loopback: Loopback, tmp_path: Path) -> None:
    """deploy/start-service.sh as the cluster configs run it (``--address auto``; RAY_ADDRESS names the head)."""
    make_adapters(tmp_path / "adapters", SynthConfig(model="tiny", count=3, rank="8"))
    (grpc_port,) = free_ports(1)
    env = {**loopback.env, "RAY_ADDRESS": loopback.gcs, "LORA_CACHE_HOME": str(tmp_path / "svc")}
    script, log, pidfile = REPO / "deploy" / "start-service.sh", tmp_path / "svc/serve.log", tmp_path / "svc/serve.pid"
    t0 = time.monotonic()
    try:
        started = subprocess.run([str(script), "start", *serve_args(tmp_path / "adapters", grpc_port)], env=env,
                                 capture_output=True, text=True, timeout=150)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:] + loopback.deaths()
        assert f"(2 nodes alive, token auth {'on' if TOKEN_AUTH else 'off'})" in started.stdout
        try:
            wait_for_line(log, "lora-cache serving:", 120)
        except AssertionError as e:
            raise AssertionError(f"{e}{loopback.deaths()}") from None
        print(f"serve joined and placed in {time.monotonic() - t0:.1f} s")
        nodes = worker_nodes(loopback)  # the replica's two ranks, one on each node
        assert len(nodes) == 2 and len(set(nodes.values())) == 2, nodes

        server = f"127.0.0.1:{grpc_port}"
        with LoraCacheClient(server) as lc:
            assert lc.health() == "SERVING"
            assert lc.hint([Hint("loopback-1", "adapter-001", "replica-0")]).accepted == 1
        wait_ready(server, "adapter-001", "replica-0", 60)
        print(f"hinted adapter ready at {time.monotonic() - t0:.1f} s")

        stopped = subprocess.run([str(script), "stop"], env=env, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0 and "lora-cache serve stopped" in stopped.stdout, stopped.stderr
        assert "lora-cache: shutting down" in log.read_text()  # a clean stop (Ctrl-C), not the SIGKILL fallback
    finally:
        if pidfile.is_file():  # the test failed with the service up: end it by its pid
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
    print(f"serve stopped at {time.monotonic() - t0:.1f} s")

    # The benchmark starts its own controller and workers (namespace lora-cache), hence after the stop.
    out_dir = tmp_path / "bench"
    done = subprocess.run(
        ["ray", "job", "submit", "--address", loopback.dashboard, "--working-dir", str(REPO),
         "--runtime-env", str(REPO / "deploy" / "runtime_env.yaml"), "--",
         "python", "-m", "bench.run", "--quick", "--out", str(out_dir)],
        env=loopback.env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout
    assert (out_dir / "results.json").is_file()
    print(f"benchmark job done at {time.monotonic() - t0:.1f} s")


@pytest.mark.skipif(not TOKEN_AUTH, reason=f"Ray {ray.__version__} has no token auth (2.52+)")
@pytest.mark.parametrize("case", ["mode unset", "wrong token"])
def test_serve_with_a_missing_or_wrong_token_fails_fast_with_the_fix(loopback: Loopback, tmp_path: Path,
                                                                     case: str) -> None:
    env = dict(loopback.env)
    if case == "mode unset":
        del env["RAY_AUTH_MODE"]
        expected = ["requires token authentication", "RAY_AUTH_MODE is unset", "set RAY_AUTH_MODE=token"]
    else:
        (tmp_path / "wrong_token").write_text(secrets.token_hex(32))
        env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "wrong_token")
        expected = ["refused this process's token", f"RAY_AUTH_TOKEN_PATH={tmp_path / 'wrong_token'}",
                    "ray get-auth-token"]
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "lora_cache.app.cli", "serve", "--address", loopback.gcs, *serve_args(tmp_path, 0)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert time.monotonic() - t0 < 20  # Ray alone: 20 s, then only "Failed to connect"
    for text in expected:
        assert text in done.stderr, done.stderr[-2000:]
