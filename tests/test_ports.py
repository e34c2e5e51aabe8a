"""lora_cache.runtime.ports: ports for a server another process starts, where no outgoing connection can take them."""

from __future__ import annotations

import socket

import pytest

from lora_cache.runtime import ports
from workers.engine.hosted import rendezvous


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


def test_an_engine_replicas_ranks_meet_on_a_port_below_the_ephemeral_range() -> None:
    """Rank 0's ``torch.distributed`` store binds the rendezvous port after it was drawn: a port the kernel chose
    (``bind(0)``, the rule before) could be taken by an outgoing connection meanwhile (EADDRINUSE in a CI run)."""
    meet = rendezvous(2)
    assert ports.LOW <= meet.port < ports.ephemeral_low() and meet.world == 2
    with socket.socket() as s:
        s.bind((meet.host, meet.port))  # free where rank 0 binds it
