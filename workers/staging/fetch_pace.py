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

        def holds() -> str | None:
            """What holds the fetch back now: "yield" (a warm fetch, for a demand read), "turn" (a demand fetch of
            the node before it), or None."""
            nonlocal turn, entered, joined, began
            if not joined:
                with self._lock:
                    busy = self._yielding.get(name)
                if busy is not None and not awaited(want):
                    return "yield" if busy() else None
                joined = True  # a read of the object joined it: a demand fetch from now on
            if fetches is None:
                return None
            with entering:  # once (a fetch's parts call it from several threads), at its first block, not while it
                if not entered:  # waits for its first byte: none waits on it for the store's latency
                    turn, entered, began = fetches.enter(nbytes), True, time.monotonic()
            return "turn" if fetches.ahead(turn) else None

        def pause() -> None:
            nonlocal waited
            kind = holds()
            if kind is None:
                return
            with self._lock:  # counted as the wait begins: a watcher sees the fetch held back while it is
                self.turns += kind == "turn"
                self.yields += kind == "yield"
            start = now = time.monotonic()
            while now - start < YIELD_MAX_S:
                time.sleep(YIELD_POLL_S)
                now = time.monotonic()
                if holds() is None:
                    break
            with self._lock:
                if kind == "turn":
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
