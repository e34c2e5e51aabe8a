"""A push's doorbell (``workers.control.doorbell``): a trainer's request reaches a rank over a UNIX socket and the
answer comes back, each rank's connection served on its own thread (ranks load at once); a failure comes back as its
error class with the connection still usable; a malformed frame is refused and ends only its own connection; the
socket is the service user's alone and goes with the doorbell."""

from __future__ import annotations

import socket
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from lora_cache.errors import ConfigError, NotFoundError
from lora_cache.link.bell import FRAME, MAX_FRAME, Bell, bell_path, recv, ring_all
from workers.control.doorbell import Doorbell


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("bells", numbered=True))  # short: a UNIX socket's path holds 107 bytes


def echo(request: dict[str, Any]) -> dict[str, Any]:
    if request.get("name") == "missing":
        raise NotFoundError("adapter missing is not registered")
    if request.get("name") == "broken":
        raise ZeroDivisionError("not a lora-cache error")
    return {"record": {"adapter": request["name"], "version": request["version"]}}


def test_a_ring_reaches_each_rank_and_its_answer_comes_back(root: Path) -> None:
    bells = [Doorbell(bell_path(root, "svc", f"rank-{k}"), echo) for k in range(2)]
    try:
        assert len({b.path for b in bells}) == 2
        for bell in bells:
            assert stat.S_IMODE(bell.path.stat().st_mode) == 0o600
        clients = [Bell(b.path) for b in bells]
        for step in range(3):
            answers = ring_all(clients, [{"buffer": "t", "name": "a", "version": f"v{step}"}] * 2)
            assert [a["record"]["version"] for a in answers] == [f"v{step}"] * 2
        assert [b.rung for b in bells] == [3, 3]
    finally:
        for b in bells:
            b.close()
    assert not any(b.path.exists() for b in bells)


def test_a_failed_load_comes_back_as_its_error_and_the_connection_stays_usable(root: Path) -> None:
    bell = Doorbell(bell_path(root, "svc", "rank-0"), echo)
    try:
        client = Bell(bell.path)
        with pytest.raises(NotFoundError, match="missing is not registered"):
            client.ring({"buffer": "t", "name": "missing", "version": "v"})
        with pytest.raises(RuntimeError, match="not a lora-cache error"):
            client.ring({"buffer": "t", "name": "broken", "version": "v"})
        assert client.ring({"buffer": "t", "name": "a", "version": "v2"})["record"]["version"] == "v2"
    finally:
        bell.close()


def test_a_malformed_frame_is_refused_and_ends_only_its_own_connection(root: Path) -> None:
    bell = Doorbell(bell_path(root, "svc", "rank-0"), echo)
    try:
        good = Bell(bell.path)
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.settimeout(10)
        bad.connect(str(bell.path))
        bad.sendall(FRAME.pack(MAX_FRAME + 1))
        answer = recv(bad)
        assert answer["error"] == "ValueError" and "over" in answer["message"]
        assert bad.recv(1) == b""  # closed by the rank
        bad.close()
        assert good.ring({"buffer": "t", "name": "a", "version": "v"})["record"]["adapter"] == "a"
        assert bell.refused == 1
    finally:
        bell.close()


def test_each_connection_is_served_at_once_as_ranks_load_together(root: Path) -> None:
    both = threading.Barrier(2, timeout=10)  # each handler waits for the other: served one at a time, it would fail

    def meet(request: dict[str, Any]) -> dict[str, Any]:
        both.wait()
        return {"record": {"adapter": request["name"]}}

    bell = Doorbell(bell_path(root, "svc", "rank-0"), meet)
    try:
        answers = ring_all([Bell(bell.path), Bell(bell.path)], [{"name": "a"}, {"name": "b"}])
        assert [a["record"]["adapter"] for a in answers] == ["a", "b"]
    finally:
        bell.close()


def test_a_root_too_long_for_a_socket_and_a_bell_with_no_doorbell_are_refused_naming_the_fix(root: Path) -> None:
    with pytest.raises(ConfigError, match="--push-dir"):
        bell_path(root / ("x" * 100), "svc", "rank-0")
    gone = Doorbell(bell_path(root, "svc", "rank-9"), echo)
    gone.close()
    with pytest.raises(ConfigError, match="open_doorbell"):
        Bell(gone.path)
