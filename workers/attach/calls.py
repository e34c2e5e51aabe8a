"""An attached rank's serve thread (lifecycle step 4): the controller's calls, relayed by the rank's endpoint.

A Ray driver or actor cannot receive calls, so the endpoint queues them (``lora_cache.link``); this thread
long-polls the queue through the rank's transport (``take``), runs the calls in order on ``WorkerControl`` (the
same code a worker actor forwards to) and answers each as it finishes. While one runs, a second thread tells
the endpoint the process is alive (a registration hashing a large adapter is not a dead rank).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lora_cache.link.relay import RELAYED
from lora_cache.vocab import Answer, Call, WorkerId
from workers.attach.transport import RankTransport
from workers.control.rank import WorkerControl

log = logging.getLogger(__name__)


class CallLoop:
    """Serves the controller's relayed calls for one attached rank until ``stopping`` is set or the link is gone."""

    def __init__(self, name: str, wid: WorkerId, transport: RankTransport, control: WorkerControl, node: str,
                 poll_s: float, max_call_s: float) -> None:
        self.name, self.transport, self.control, self.node = name, transport, control, node
        self.poll_s, self.max_call_s = poll_s, max_call_s
        self.calls = self.errors = 0  # controller calls served, and those that raised
        self.lost: BaseException | None = None  # why the serve thread stopped before detach, if it did
        self.stopping = threading.Event()  # set by detach (or a test standing in for a wedged thread)
        self.thread = threading.Thread(target=self._serve, name=f"lora-attach-{wid}", daemon=True)
        self._running_since: float | None = None  # monotonic start of the controller call being run, if any
        self._beating = threading.Thread(target=self._heartbeat, name=f"lora-attach-beat-{wid}", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self._beating.start()

    def join(self) -> None:
        """After ``stopping`` is set: wait for the serve thread's last call and the heartbeat to end."""
        if self.thread.is_alive():
            self.thread.join(timeout=self.poll_s + 60)
        if self._beating.is_alive():
            self._beating.join(timeout=self.poll_s + 5)

    def _serve(self) -> None:
        """Take the controller's calls, run them in order, answer; until detach or the link is gone."""
        handlers: dict[str, Callable[..., Any]] = {
            "apply": self.control.apply, "describe": lambda: self.control.describe(self.node),
            "register_adapter": self.control.register_adapter, "register_adapters": self.control.register_adapters,
            "unregister_adapter": self.control.unregister_adapter, "stats": self.control.stats,
            "drop_pushed": self.control.drop_pushed}
        assert set(handlers) == set(RELAYED)
        while not self.stopping.is_set():
            try:
                calls = self.transport.take(self.poll_s)
            except Exception as e:  # the endpoint was killed (detach) or died: the controller sees a dead worker
                self._gone("endpoint lost", e)
                return
            for call in calls:  # each answered as it finishes: a batch of slow calls (registering many
                answer = self._run(handlers, call)  # adapters) is not a silent process
                try:
                    self.transport.answer([answer])
                except Exception as e:  # detached while the call ran (nobody waits for it now), or the link is gone
                    self._gone("could not answer the controller", e)
                    return

    def _gone(self, what: str, error: Exception) -> None:
        """The serve thread ends on ``error`` from the transport: quietly while detaching, else the rank is lost."""
        if not self.stopping.is_set():
            log.warning("%s: %s (%s); this rank no longer receives commands", self.name, what, error)
            self.lost = error

    def _heartbeat(self) -> None:
        """While a controller call runs (a registration hashing a large adapter, a describe of thousands of
        slots), tell the endpoint the process is alive every ``poll_s``; not when idle (then not polling is
        the sign of a dead serve thread) and not past ``max_call_s`` into one call (a wedged call)."""
        while not self.stopping.wait(self.poll_s):
            since = self._running_since
            if since is not None and time.monotonic() - since < self.max_call_s:
                try:
                    self.transport.alive()
                except Exception:  # the link is gone: the serve thread notices and stops
                    return

    def _run(self, handlers: dict[str, Callable[..., Any]], call: Call) -> Answer:
        ident, method, args = call
        self.calls += 1
        self._running_since = time.monotonic()
        try:
            return ident, True, handlers[method](*args)
        except Exception as e:  # the controller's call fails with it, as a worker actor's would
            self.errors += 1
            return ident, False, e
        finally:
            self._running_since = None
