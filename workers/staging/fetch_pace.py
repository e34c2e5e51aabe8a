"""How a disk tier's fetches from an object store share the node's store (lifecycle step 5: reads by priority).

Before each block a fetch reads (``store_fetch.fetch_object``'s ``pause``), ``FetchPace.pause`` may hold it, up to
``YIELD_MAX_S`` at a time (the socket's flow control holds the store back meanwhile; a fetch held longer still reads
a block per ``YIELD_MAX_S``, so a stuck peer costs a trickle, never a deadlock):

- a warm stage's fetch (issue 42 item 3) reads nothing while its ``busy`` says a demand read is on this node, until a
  read joins it: a read of this process (``forget``), or of another that waits for its object (``awaited`` on the
  object's want file); from then on it is a demand fetch;
- a demand fetch reads nothing while a demand fetch of the node comes before it (``node_reads.NodeFetches``: the one
  that would end soonest alone first, from its first byte), where the tier's ``fetch_order`` is "soonest"; the time it
  moved, less its waits, is the store's rate the order counts from then on (``NodeFetches.moved``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

from workers.staging.node_reads import NodeFetches, awaited

YIELD_MAX_S = 2.0  # the longest a fetch pauses at a time (``FetchPace.pause``)
YIELD_POLL_S = 0.005  # how often a pausing fetch looks whether what it waits for ended


class FetchPace:
    """One disk tier's pauses: its warm fetches in flight and what each yields to, and how long they all paused."""

    def __init__(self, fetches: NodeFetches | None) -> None:
        """``fetches``: the node's order of demand fetches (None: they share the store, ``fetch_order`` "shared")."""
        self.fetches = fetches
        self._lock = threading.Lock()
        # name -> what a warm stage's fetch in flight yields to (``stage``'s ``busy``); a read that joins the fetch
        # takes it out (``forget``): from then on the fetch is that read's own, a demand fetch
        self._yielding: dict[str, Callable[[], bool]] = {}
        self.yields = 0  # pauses in which a warm fetch found a demand read and yielded
        self.yielded_s = 0.0  # their time
        self.turns = 0  # pauses in which a demand fetch waited for one before it on the node (``NodeFetches``)
        self.turn_wait_s = 0.0  # their time

    def yielding(self, name: str, busy: Callable[[], bool]) -> None:
        """This process's fetch of ``name`` is a warm stage's: it yields while ``busy()``."""
        with self._lock:
            self._yielding[name] = busy

    def forget(self, name: str) -> None:
        """A read of this process joined the fetch of ``name`` (or it ended): it yields no more."""
        with self._lock:
            self._yielding.pop(name, None)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "disk_yields": self.yields,  # warm fetches' pauses for demand reads (disk or host warm stages')
                "disk_yielded_ms": round(self.yielded_s * 1e3),
                "disk_turns": self.turns,  # demand fetches' pauses for one that ends sooner alone on the node
                "disk_turn_wait_ms": round(self.turn_wait_s * 1e3),
            }

    @contextlib.contextmanager
    def pause(self, name: str, nbytes: int, want: int = -1) -> Iterator[Callable[[], None] | None]:
        """The pause before each block of this process's fetch of ``name`` (``nbytes``; the module's docstring); None
        where it never pauses. ``want``: a warm stage's fetch, the want file of its object (open, closed at the end:
        ``awaited`` is polled on it); -1: a demand fetch."""
        fetches, warm = self.fetches, want >= 0
        if not warm and fetches is None:
            yield None
            return
        turn, entered, joined, entering = "", False, not warm, threading.Lock()
        began, waited = 0.0, 0.0  # its first block's time, and its waits for its turn since

        def pause() -> None:
            nonlocal turn, entered, joined, began, waited
            start = now = time.monotonic()
            waited_turn = False
            while now - start < YIELD_MAX_S:
                if not joined:
                    with self._lock:
                        busy = self._yielding.get(name)
                    if busy is None or awaited(want):
                        joined = True
                    elif not busy():
                        break
                if joined:
                    if fetches is None:
                        break
                    with entering:  # once (a fetch's parts call it from several threads), at its first block, not
                        if not entered:  # while it waits for its first byte: none waits on it for the store's latency
                            turn, entered, began = fetches.enter(nbytes), True, time.monotonic()
                    if not fetches.ahead(turn):
                        break
                if now == start:
                    waited_turn = joined
                    with self._lock:
                        self.turns += joined
                        self.yields += not joined
                time.sleep(YIELD_POLL_S)
                now = time.monotonic()
            if now > start:
                with self._lock:
                    if waited_turn:
                        self.turn_wait_s += now - start
                        waited += now - start
                    else:
                        self.yielded_s += now - start

        try:
            yield pause
            if fetches is not None and entered and not warm:  # done: the store's rate, alone (a joined warm fetch
                fetches.moved(nbytes, time.monotonic() - began - waited)  # moved part of it while yielding: not timed)
        finally:
            if fetches is not None:
                with entering:
                    fetches.leave(turn)
            if warm:
                os.close(want)
