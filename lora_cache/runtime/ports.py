"""Ports for servers this process starts in another (an engine rank's ``torch.distributed`` rendezvous, which rank 0
serves: ``workers.engine.hosted.rendezvous``; in the tests and the benchmark moto, the proxy, Redis, a Ray node,
``lora-cache serve``).

A port the kernel chose (``bind(0)``, then released) is an *ephemeral* one, and between the draw and the other
process's bind any outgoing connection on the machine may take it as its local port: a Ray cluster starting holds
dozens of long-lived gRPC channels. The server then cannot bind it; a raylet whose metrics or agent port is
taken so dies after ``ray start`` succeeded, and the GCS marks its node dead a minute later (the two-node test's
intermittent failure in CI; measured: docs/known-issues.md). Ports below the kernel's ephemeral range
(``ip_local_port_range``) are only ever taken by an explicit bind, so they are drawn from there: each one probed
free, none handed out twice by this process, from a random start (another process drawing at once rarely meets
the same ports, and a probe skips any it bound).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 24000  # below: Ray's default worker ports (10002-19999) and the loopback test's per-node worker ranges
_handed: set[int] = set()


def ephemeral_low() -> int:
    """The lowest port the kernel hands an outgoing connection (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every address now, below the ephemeral range (the module's docstring)."""
    high = ephemeral_low()
    if high - LOW < 4 * n:
        raise RuntimeError(f"the ephemeral ports start at {high} (ip_local_port_range): too few ports below it, from "
                           f"{LOW}, for {n} servers; raise the range's low end")
    span = high - LOW
    start = random.randrange(span)
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for i in range(span):
            port = LOW + (start + i) % span
            if port in _handed:
                continue
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                s.close()
                continue
            socks.append(s)  # held until all n are found: distinct
            ports.append(port)
            if len(ports) == n:
                _handed.update(ports)
                return ports
    finally:
        for s in socks:
            s.close()
    raise RuntimeError(f"fewer than {n} free ports in {LOW}..{high - 1} (below the ephemeral range)")


def free_port() -> int:
    """One port free on every address now, below the ephemeral range (the module's docstring)."""
    return free_ports(1)[0]
