"""bench.ports: ports for a server another process starts, drawn where no outgoing connection can take them."""

from __future__ import annotations

import socket

import pytest

from bench import ports


def test_ports_are_distinct_free_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    first = ports.free_ports(8)
    second = ports.free_ports(8)
    assert len(set(first + second)) == 16  # none handed out twice by this process, though none was bound meanwhile
    for port in first + second:
        assert ports.LOW <= port < ports.ephemeral_low()
        with socket.socket() as s:  # free: a server can bind it on every address
            s.bind(("0.0.0.0", port))


def test_a_port_some_process_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    held = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", held))
        s.listen()
        monkeypatch.setattr(ports, "_handed", set())  # forgotten, so only the probe can refuse it
        monkeypatch.setattr(ports.random, "randrange", lambda span: held - ports.LOW)  # the scan starts there
        assert held not in ports.free_ports(3)


def test_too_few_ports_below_the_ephemeral_range_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOW + 10)
    with pytest.raises(RuntimeError, match=r"ip_local_port_range.*raise the range's low end"):
        ports.free_ports(4)
