"""A push's doorbell: a trainer on a rank's node has the rank take a version from an open buffer with no Ray call on
the push's path (issue 44 item 5).

Measured on one H100 and one H200 (bench/reports/issue-44.md, "a push into the ranks' slots"), one Ray call from a
trainer to a rank and back takes 1.6-2.5 ms, more than the whole push of an 8B rank-16 shard may take (1.3x its 1.55
ms host-to-device copy), while the rank's own part is 0.7-1.3x. The trainer and the ranks it pushes to share a node
(the ranks open its GPU buffer by CUDA IPC), so the push's request can go the way a node's processes talk: a UNIX
socket per rank (``Doorbell``), in the node's push area (the service's own user, mode 0600), one small framed
request per push and the rank's readiness record back (``Bell``). A trainer pushing to several ranks rings them all,
then reads every answer (``ring_all``): the ranks load at once.

Frames: a 4-byte little-endian length, then JSON (at most ``MAX_FRAME`` bytes). A request is
``{"buffer", "name", "version"}``; an answer ``{"record": {...}}`` (``ReadinessRecord`` fields) or ``{"error": CLASS,
"message": TEXT}``, raised on the trainer's side as that ``lora_cache.errors`` class (``RuntimeError`` otherwise). A
malformed or oversized frame is answered with an error and its connection closed; nothing else on the rank changes.

Only the request's path changes: the version is registered as any other (the controller's), the buffer opened as
``workers.control.images`` says, the load is ``WorkerCache.load_image``, and READY reaches the controller through
the rank's outbox as for any load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lora_cache.errors as errors
from lora_cache.errors import ConfigError, LoraCacheError

log = logging.getLogger(__name__)
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


class Doorbell:
    """The rank's side: listens on ``path``; each connection's requests are answered in order, on that connection's
    own thread, by ``handle(request) -> answer`` (an exception becomes an error answer). ``setup`` runs first on
    every thread it starts (e.g. ``torch.cuda.set_device``)."""

    def __init__(self, path: Path, handle: Callable[[dict[str, Any]], dict[str, Any]],
                 setup: Callable[[], None] = lambda: None) -> None:
        self.path, self.handle, self.setup = path, handle, setup
        self.rung = self.refused = 0
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead rank's socket (the name is this worker's own)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._accept, name="lora-doorbell", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lora-doorbell-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self.setup()
        try:
            while not self._closed.is_set():
                try:
                    request = recv(conn)
                except (ConnectionError, OSError):
                    return
                except ValueError as e:  # malformed: answered, then this connection ends (its framing is lost)
                    with self._lock:
                        self.refused += 1
                    with contextlib.suppress(OSError):
                        send(conn, {"error": "ValueError", "message": str(e)})
                    return
                try:
                    answer = self.handle(request)
                    with self._lock:
                        self.rung += 1
                except Exception as e:  # the request's failure, not the doorbell's
                    answer = {"error": type(e).__name__, "message": str(e)}
                try:
                    send(conn, answer)
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


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
