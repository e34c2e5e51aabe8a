"""A push's doorbell: a trainer on a rank's node has the rank take a version from an open buffer with no Ray call on
the push's path (issue 44 item 5).

Measured on one H100 and one H200 (bench/reports/issue-44.md, "a push into the ranks' slots"), one Ray call from a
trainer to a rank and back takes 1.6-2.5 ms, more than the whole push of an 8B rank-16 shard may take (1.3x its 1.55
ms host-to-device copy), while the rank's own part is 0.7-1.3x. The trainer and the ranks it pushes to share a node
(the ranks open its GPU buffer by CUDA IPC), so the push's request can go the way a node's processes talk: a UNIX
socket per rank (``Doorbell``), in the node's push area (the service's own user, mode 0600), one small framed
request per push and the rank's readiness record back (``Bell``). A trainer pushing to several ranks rings them all,
then reads every answer (``ring_all``): the ranks load at once.

The frames and the trainer's side (``Bell``, ``ring_all``) are ``lora_cache.link.bell``'s. A malformed or oversized
frame is answered with an error and its connection closed; nothing else on the rank changes.

Only the request's path changes: the version is registered as any other (the controller's), the buffer opened as
``workers.control.images`` says, the load is ``WorkerCache.load_image``, and READY reaches the controller through
the rank's outbox as for any load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lora_cache.link.bell import recv, send

log = logging.getLogger(__name__)


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
