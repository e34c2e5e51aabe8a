"""The relay between the controller and an attached rank's process (``workers/attach/attachment.py``), plain asyncio.

The controller calls a rank's endpoint as it calls a worker actor; the endpoint queues each call here,
the process takes the calls (a long poll), runs them in order on ``WorkerControl`` and answers them.
The endpoint is a Ray actor (``workers/attach/ray_transport.py``); for a rank attached through the gateway it is
hosted by the gateway, which takes on the process's behalf (``lora_cache/api/rank_link.py``). The
relay itself knows neither Ray nor gRPC, so it is tested on CPU with a clock of the test's own.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from lora_cache.errors import LoraCacheError
from lora_cache.vocab import Call

# what the controller calls
RELAYED = ("apply", "describe", "register_adapter", "register_adapters", "unregister_adapter", "stats", "drop_pushed")


class EndpointStaleError(LoraCacheError, ConnectionError):
    """The attached process behind an endpoint stopped polling for calls."""




class Relay:
    """Calls queued for a process that polls for them, and their answers: the endpoint's core, plain asyncio
    (one event loop, so the queue and the waiting calls need no lock). ``clock``: monotonic seconds."""

    def __init__(self, name: str, liveness_s: float, clock: Callable[[], float] = time.monotonic,
                 start_s: float | None = None) -> None:
        self.name, self.liveness_s, self.clock = name, liveness_s, clock
        self._calls: asyncio.Queue[Call] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # call id -> its caller's answer
        self._ids = itertools.count()
        self.start_s = liveness_s if start_s is None else start_s  # the grace before the process's first poll
        self._created = clock()
        self._polled: float | None = None  # the process's last sign of life (take or answer); None: none yet

    async def call(self, method: str, *args: Any) -> Any:
        """Queue the call for the process and wait for its answer; fail it (``EndpointStaleError``) once the
        process has not polled for ``liveness_s``, so that no caller (the controller's health loop
        resyncs through here) waits forever on a wedged process."""
        ident = next(self._ids)
        answer = self._waiting[ident] = asyncio.get_running_loop().create_future()
        self._calls.put_nowait((ident, method, args))
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(answer), self.liveness_s)
                except asyncio.TimeoutError:
                    self.check_live()
        finally:
            self._waiting.pop(ident, None)

    def check_live(self) -> None:
        if self._polled is None:
            idle = self.clock() - self._created
            if idle > self.start_s:
                raise EndpointStaleError(f"{self.name}: its engine process has not polled for calls for {idle:.1f} s "
                                         "since the endpoint was made (it never started serving)")
            return
        idle = self.clock() - self._polled
        if idle > self.liveness_s:
            raise EndpointStaleError(f"{self.name}: its engine process has not polled for calls for {idle:.1f} s")

    async def take(self, timeout_s: float, alive: bool = True) -> list[Call]:
        """The calls queued for the process, oldest first; waits up to ``timeout_s`` for the first.
        ``alive``: the take is the process's own poll, a sign of life; the gateway's pump takes on the
        process's behalf with ``alive=False`` (its stream's ``RankAlive`` and answers are the signs)."""
        if alive:
            self._polled = self.clock()
        try:
            first = await asyncio.wait_for(self._calls.get(), timeout_s)
        except asyncio.TimeoutError:
            return []
        calls = [first]
        while not self._calls.empty():
            calls.append(self._calls.get_nowait())
        if alive:
            self._polled = self.clock()
        return calls

    def answer(self, results: list[tuple[int, bool, Any]]) -> int:
        """(call id, ok, value or exception) for calls taken earlier; how many still had a caller."""
        self._polled = self.clock()  # it is alive: it answers
        delivered = 0
        for ident, ok, value in results:
            waiter = self._waiting.get(ident)
            if waiter is None or waiter.done():
                continue  # its caller gave up (stale, or cancelled by a timeout of its own)
            if ok:
                waiter.set_result(value)
            else:
                waiter.set_exception(value)
            delivered += 1
        return delivered
