"""Requests into a running replica as a router releases them, and finished request ids back out.

A ``Feed`` sits between a router (any thread: a Ray call's, a pipe reader's) and rank 0's serving
loop, which alone takes requests: the other TP ranks see them only in rank 0's broadcast step plans,
so every rank of a replica runs the same requests in the same order by construction (``engine.py``).

Router side: ``submit`` (a request's arrival time stays its ``arrival_s``: the scheduler admits it at
the first round at or after both that time and its delivery, and TTFT counts from ``arrival_s``),
``submitting`` (a submit under way, its new names resolving first: several at once, none held up by another's
resolution; ``close`` waits for those begun before it), ``close`` (end of stream: the loop stops once every
request is done) and ``finished`` (a long poll for
request ids done since the last call; None once the run is over). Engine side: ``take`` (what came
since the last take, and whether the stream is closed), ``arrival`` (a future done on the next submit
or close: a WAIT round waits on it beside its loads), ``watch`` (a callback told of each submit at once,
in the submitter's thread: the engine pins or loads an arrival's adapter then, not at its next round)
and ``done``; ``stop`` ends the run's polls.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future

from lora_cache.adapters.refs import versions_named
from lora_cache.errors import ConfigError
from workers.engine.workload import Request


class Feed:
    """One run's request stream into one replica (single use: ``stop`` is final)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # protects every field below
        self._changed = threading.Condition(self._lock)  # finished ids or stop: wakes ``finished``
        self._new: list[Request] = []  # submitted, not yet taken by the loop
        self._closed = False  # end of stream: nothing more will be submitted
        self._closing = False  # ``close`` was called: no submit may begin (those under way finish first)
        self._submitting = 0  # submits under way (``submitting``)
        self._received: dict[int, float] = {}  # rid -> time.perf_counter() its submit reached the feed (``received``)
        self._settled = threading.Condition(self._lock)  # a submit under way ended: wakes ``close``
        self._stopped = False  # the run is over (the loop left)
        self._arrival: Future[None] = Future()  # done on the next submit/close after a take
        self._done: list[int] = []  # finished, not yet polled
        self._watch: Callable[[list[Request]], None] | None = None  # told of each submit (``watch``)

    # -- the router's side ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def submitting(self, rids: Sequence[int]) -> Iterator[None]:
        """A submit of requests ``rids`` under way (its new names resolving, then ``submit``): any number at once,
        so a slow one holds up no other; ``close`` waits for every one begun before it, so the end of stream still
        comes after the requests submitted before it. One begun after ``close`` is refused (ConfigError)."""
        with self._lock:
            if self._closing or self._closed:
                raise ConfigError(_after_close(rids))
            self._submitting += 1
        try:
            yield
        finally:
            with self._settled:
                self._submitting -= 1
                self._settled.notify_all()

    def submit(self, requests: Iterable[Request]) -> None:
        batch = list(requests)
        with self._lock:
            if self._closed:
                raise ConfigError(_after_close([r.rid for r in batch]))
            self._new += batch
            now = time.perf_counter()  # the run's own clock (a wall clock may be slewed or stepped meanwhile)
            for r in batch:
                self._received.setdefault(r.rid, now)
            self._wake()
            watch = self._watch
        if watch is not None and batch:  # outside the lock: the loop's take never waits on it
            watch(batch)

    def close(self) -> None:
        """End of stream: the loop stops once every request submitted so far is done. Waits for the submits under
        way (``submitting``): their requests go in before the end."""
        with self._settled:
            self._closing = True
            while self._submitting:
                self._settled.wait()
            self._closed = True
            self._wake()

    def received(self, t0: float) -> dict[int, float]:
        """rid -> when its submit reached the feed, in seconds after ``t0`` (the run's clock start as
        ``time.perf_counter()``, the clock its steps are timed on): how late a router's submission arrives, which TTFT
        counts (``RequestRecord.received_s``)."""
        with self._lock:
            return {rid: t - t0 for rid, t in self._received.items()}

    def finished(self, timeout_s: float = 1.0) -> list[int] | None:
        """Request ids finished (served or failed) since the last call, waiting up to ``timeout_s`` for one;
        None once the run is over and every id was handed out."""
        with self._changed:
            if not self._done and not self._stopped:
                self._changed.wait(timeout_s)
            if not self._done and self._stopped:
                return None
            out, self._done = self._done, []
            return out

    # -- the serving loop's side (rank 0) ------------------------------------------------------------
    def watch(self, callback: Callable[[list[Request]], None] | None) -> None:
        """Call ``callback`` with each submitted batch, in the submitting thread, after it is queued
        (``Arrivals.arrived``); None: stop."""
        with self._lock:
            self._watch = callback

    def named_versions(self, name: str) -> set[str]:
        """The versions of ``name`` that requests submitted and not yet taken name (``A@VERSION``, as a submit pins
        them): a catalog user (``AdapterCatalog.use``), so that a registration between a submit and the loop's take
        (which gives the version a row of the exchange: ``RankEngine.named_versions``) does not retire it."""
        with self._lock:
            return versions_named((r.adapter for r in self._new), name)

    def take(self) -> tuple[list[Request], bool]:
        """Requests submitted since the last take, and whether the stream is closed."""
        with self._lock:
            out, self._new = self._new, []
            if self._arrival.done():
                self._arrival = Future()
            return out, self._closed

    def arrival(self) -> Future[None]:
        """Done when a submit or close lands after the last ``take`` (already done if one has)."""
        with self._lock:
            return self._arrival

    def done(self, rids: Iterable[int]) -> None:
        with self._changed:
            self._done += rids
            if self._done:
                self._changed.notify_all()

    def stop(self) -> None:
        """The run is over: pollers get what is left, then None."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def _wake(self) -> None:
        if not self._arrival.done():
            self._arrival.set_result(None)


def _after_close(rids: Sequence[int]) -> str:
    return f"requests {list(rids)[:8]} submitted after the end of the stream; submit every request before close()"
