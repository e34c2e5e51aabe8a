"""The gateway's hint ingest (lifecycle step 2): a bounded queue of hint batches, coalesced into controller calls.

Each Hint call submits its batch and awaits that batch's own outcome. While a controller call is in
flight, newly submitted batches wait and leave together in the next one, so the controller takes
one call per round trip however many routers call: batching grows with load, and an idle gateway
forwards a lone batch at once. Hints waiting or in flight never exceed ``capacity``; a batch that
does not fit is refused at once (CapacityError: RESOURCE_EXHAUSTED) rather than queued.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from lora_cache.api.validate import HintTuple
from lora_cache.controller.core import HintOutcome
from lora_cache.errors import CapacityError

Send = Callable[[list[list[HintTuple]]], Awaitable[list[HintOutcome]]]
Waiting = tuple[list[HintTuple], "asyncio.Future[HintOutcome]"]  # a caller's batch and its outcome

FLUSH_HINTS = 16_384  # most hints per controller call: bounds one call's size and the controller's pause
FLUSH_S = 5.0  # close(): calls in flight get this long to finish before they are cancelled
MAX_INFLIGHT = 2  # controller calls in flight: one being processed while the next is on its way


class GatewayClosedError(ConnectionError):
    """The gateway stopped before the batch reached the controller (UNAVAILABLE: retry)."""


class HintIngest:
    """Batches of concurrent Hint calls -> one ``send`` (controller.hint_batches) per round trip."""

    def __init__(self, send: Send, capacity: int, flush_hints: int = FLUSH_HINTS,
                 max_inflight: int = MAX_INFLIGHT) -> None:
        self.send, self.capacity = send, capacity
        self.flush_hints, self.max_inflight = flush_hints, max_inflight
        self.queued = 0  # hints waiting or in flight (bounded by capacity)
        self.rejected = 0  # batches refused because the queue was full
        self.calls = 0  # controller calls made
        self._pending: deque[Waiting] = deque()
        self._inflight = 0
        self._wake = asyncio.Event()  # set when a batch arrives or a controller call returns
        self._runner: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()  # controller calls in flight (kept referenced)

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run(), name="hint-ingest")

    async def submit(self, hints: list[HintTuple]) -> HintOutcome:
        """Queue one caller's batch; its outcome once the controller took it (or refused it)."""
        if self._runner is None:
            raise GatewayClosedError("the gateway is not running; retry once it has started")
        if self.queued + len(hints) > self.capacity:
            self.rejected += 1
            raise CapacityError(f"the gateway's hint ingest queue is full ({self.queued} of {self.capacity} hints "
                                f"are waiting for the controller); this batch of {len(hints)} was not taken: "
                                "back off and retry, or raise the gateway's ingest_queue_hints")
        future: asyncio.Future[HintOutcome] = asyncio.get_running_loop().create_future()
        self._pending.append((hints, future))
        self.queued += len(hints)
        self._wake.set()
        return await future  # a cancelled caller's batch is still sent: hints are idempotent

    async def close(self, flush_s: float = FLUSH_S) -> None:
        """Stop: batches not yet sent fail with GatewayClosedError; calls in flight get ``flush_s`` to
        finish, then are cancelled and their batches fail with GatewayClosedError too (a controller that
        does not answer never holds the gateway's stop)."""
        if self._runner is not None:
            self._runner.cancel()
            self._runner = None
        while self._pending:
            hints, future = self._pending.popleft()
            self.queued -= len(hints)
            if not future.done():
                future.set_exception(GatewayClosedError("the gateway is shutting down; this batch was not "
                                                        "sent to the controller: retry"))
        if self._flushes:
            _, late = await asyncio.wait(set(self._flushes), timeout=flush_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and self._inflight < self.max_inflight:
                self._inflight += 1
                task = asyncio.get_running_loop().create_task(self._flush(self._take()))
                self._flushes.add(task)
                task.add_done_callback(self._flushes.discard)

    def _take(self) -> list[Waiting]:
        """Waiting batches, oldest first, up to flush_hints hints (at least one batch)."""
        taken: list[Waiting] = []
        n = 0
        while self._pending and (not taken or n + len(self._pending[0][0]) <= self.flush_hints):
            batch = self._pending.popleft()
            taken.append(batch)
            n += len(batch[0])
        return taken

    async def _flush(self, taken: list[Waiting]) -> None:
        try:
            outcomes = await self.send([hints for hints, _ in taken])
        except asyncio.CancelledError:  # close() gave up on the controller: the callers may retry
            for _, future in taken:
                if not future.done():
                    future.set_exception(GatewayClosedError("the gateway shut down before the controller answered "
                                                            "this batch; it may or may not have been applied: "
                                                            "retry (hints are idempotent)"))
            raise
        except Exception as e:  # the controller call failed: every batch in it gets the error
            for _, future in taken:
                if not future.done():
                    future.set_exception(e)
        else:
            for (_, future), outcome in zip(taken, outcomes, strict=True):
                if not future.done():
                    future.set_result(outcome)
        finally:
            self.queued -= sum(len(hints) for hints, _ in taken)
            self._inflight -= 1
            self.calls += 1
            self._wake.set()
