"""`lora-cache serve` without `--address` (issue 34): a cluster of its own, on 127.0.0.1 only, that dies with it.

Ray made `_node_ip_address="127.0.0.1"` the machine's external address, so the embedded cluster's raylet,
GCS, agents and metrics listened beyond the machine. And a SIGKILLed `serve` left Ray's agents
(`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) running. One `serve` process, inspected through /proc (Linux).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from pathlib import Path

import pytest

from lora_cache.runtime import ray_compat
from tests.serving import make_adapters, read_until, serve_argv
from tests.waiting import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc")]

ROOT = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it, now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def listening(pids: set[int]) -> list[str]:
    """The local addresses (hex, as /proc writes them) on which ``pids`` listen for TCP connections."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                out.append(cols[1])
    return out


def loopback(address: str) -> bool:
    host = address.split(":")[0]
    return host in ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")  # 127.0.0.1,
    # ::1, ::ffff:127.0.0.1


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "(Z)" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return "(" + Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] + ")"
    except OSError:
        return "(gone)"


def test_embedded_serve_listens_on_loopback_only_and_a_sigkill_leaves_nothing(tmp_path: Path) -> None:
    make_adapters(tmp_path / "ad", 2, cwd=ROOT)
    cmd = serve_argv(tmp_path / "ad", "--no-worker-logs")
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9", "PYTHONPATH": str(ROOT)}  # ignored without --address auto
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = read_until(proc, "lora-cache serving:")
        metrics = next(line for line in lines if "lora-cache metrics" in line)
        assert "http://127.0.0.1:" in metrics, metrics
        tree = descendants(proc.pid)
        assert len(tree) > 3, "Ray's processes run below serve"
        addresses = listening(tree)
        assert addresses and all(loopback(a) for a in addresses), f"listening beyond 127.0.0.1: {addresses}"

        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        wait_for(
            lambda: not alive(tree),
            "every process of the embedded cluster gone",
            timeout=40,
            poll_s=0.5,
            detail=lambda: str(alive(tree)),
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_a_service_joins_an_embedded_serves_cluster_by_its_loopback_address(tmp_path: Path) -> None:
    """Issue 46: Ray made ``--address 127.0.0.1:PORT`` the machine's address, where the embedded cluster does
    not listen ("no Ray cluster answers at 192.0.2.2:PORT"); a second ``serve`` now joins it on loopback."""
    make_adapters(tmp_path / "ad", 2, cwd=ROOT)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    env.update(PYTHONPATH=str(ROOT), RAY_AUTH_TOKEN_PATH=str(token))
    if ray_compat.has_token_auth():
        env["RAY_AUTH_MODE"] = "token"
    procs: list[subprocess.Popen[str]] = []
    try:
        head = subprocess.Popen(serve_argv(tmp_path / "ad", "--no-worker-logs", "--replicas", "0"), cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(head)
        started = next(line for line in read_until(head, "lora-cache serving:") if "cluster of this process" in line)
        gcs = started.split("--address ")[1].strip()
        assert gcs.startswith("127.0.0.1:"), started
        joiner = subprocess.Popen(
            serve_argv(tmp_path / "ad", "--no-worker-logs", "--replicas", "0", "--address", gcs, "--service", "other"),
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(joiner)
        lines = read_until(joiner, "lora-cache serving:")
        assert any(f"joined the Ray cluster at {gcs} (1 nodes alive" in line for line in lines), lines
    finally:
        for proc in reversed(procs):  # the joiner first: its cluster is the head's
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.communicate()
