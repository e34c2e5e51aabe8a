"""A push's doorbell, the trainer's side and the wire (issue 44 item 5): a trainer on a rank's node has the rank take a
version from an open buffer with no Ray call on the push's path. The rank's side, and why, is
``workers.control.doorbell``.

Frames: a 4-byte little-endian length, then JSON (at most ``MAX_FRAME`` bytes). A request is
``{"buffer", "name", "version"}``; an answer ``{"record": {...}}`` (``ReadinessRecord`` fields) or ``{"error": CLASS,
"message": TEXT}``, raised on the trainer's side as that ``lora_cache.errors`` class (``RuntimeError`` otherwise).
A trainer pushing to several ranks rings them all, then reads every answer (``ring_all``): the ranks load at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lora_cache.errors as errors
from lora_cache.errors import ConfigError, LoraCacheError

FRAME = struct.Struct("<I")
MAX_FRAME = 1 << 16  # a request or an answer is a few hundred bytes
MAX_PATH = 107  # sun_path's bytes, less the terminating NUL


def bell_path(root: Path, service: str, worker: str) -> Path:
    """The doorbell socket of ``worker`` of ``service`` under the push root ``root``: a short name (sun_path holds
    107 bytes), one per (service, worker). A root too long for it is refused naming the fix."""
    digest = hashlib.blake2b(f"{service}\0{worker}".encode(), digest_size=8).hexdigest()
    path = root / f".bell-{digest}.sock"
    if len(os.fsencode(path)) > MAX_PATH:
        raise ConfigError(f"the push doorbell's socket {path} is {len(os.fsencode(path))} bytes, over the "
                          f"{MAX_PATH} a UNIX socket's path may hold; set a shorter --push-dir (default /dev/shm/...)")
    return path


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"a doorbell frame of {len(body)} bytes is over {MAX_FRAME}")
    sock.sendall(FRAME.pack(len(body)) + body)


def recv(sock: socket.socket) -> dict[str, Any]:
    """One frame's message; ConnectionError at the peer's end of stream, ValueError for a malformed frame."""
    (n,) = FRAME.unpack(_exactly(sock, FRAME.size))
    if n > MAX_FRAME:
        raise ValueError(f"a doorbell frame of {n} bytes is over {MAX_FRAME}: not a doorbell client, or a corrupt one")
    message = json.loads(_exactly(sock, n))
    if not isinstance(message, dict):
        raise ValueError(f"a doorbell frame holds {type(message).__name__}, not an object")
    return message


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(left)
        if not part:
            raise ConnectionError("the doorbell's peer closed the connection")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class Bell:
    """The trainer's side: one connection to one rank's doorbell (``ring``; ``ring_all`` for several)."""

    def __init__(self, path: str | Path, timeout_s: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(path))
        except OSError as e:
            self.sock.close()
            raise ConfigError(f"no push doorbell answers at {path} ({e}): open it on the rank first "
                              "(WorkerActor.open_doorbell), from a process on the rank's node") from e

    def ring(self, request: dict[str, Any]) -> dict[str, Any]:
        return ring_all([self], [request])[0]

    def close(self) -> None:
        self.sock.close()


def ring_all(bells: Sequence[Bell], requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send each bell its request, then read every answer (the ranks work at once); the first error answer raised as
    its ``lora_cache.errors`` class (after every answer is read, so each connection stays in step)."""
    for bell, request in zip(bells, requests, strict=True):
        send(bell.sock, request)
    answers = [recv(bell.sock) for bell in bells]
    for answer in answers:
        if "error" in answer:
            kind = getattr(errors, str(answer["error"]), None)
            cls = kind if isinstance(kind, type) and issubclass(kind, LoraCacheError) else RuntimeError
            raise cls(str(answer.get("message", "")))
    return answers
