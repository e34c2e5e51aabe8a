"""Replica-level readiness from per-rank reports (lifecycle steps 7-8), plain Python.

A replica is ready for ``adapter@version`` only when every one of its TP ranks reported it READY
(invariant 4). The index answers "where is A ready or loading?" and keeps a bounded, sequenced log of
replica-level events that subscribers read from a cursor. A subscriber whose cursor points before what
the log still holds (it fell behind ``max_events``, or the cursor is from before a controller restart)
or past its newest event gets a ``Resync`` instead of a silent gap: the current ready set and the cursor
to resume from. ``Doorbell`` wakes the subscribers that wait for the log to grow (the one asyncio part).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from lora_cache.errors import ConflictError, NotFoundError


class RankState(Enum):
    LOADING = "loading"
    READY = "ready"


class ReadinessEvent(NamedTuple):
    seq: int
    replica: str
    adapter: str
    version: str
    ready: bool  # True: every rank ready; False: the replica stopped being ready (evicted, rank lost)


class Resync(NamedTuple):
    """Events after a subscriber's cursor are gone: here is the state instead, and where to go on from."""

    resume_after: int  # the cursor to continue from: no event after it is lost
    lost_after: int  # the subscriber's cursor: events after it (up to resume_after) may have been missed
    ready: tuple[tuple[str, str, str], ...]  # (replica, adapter, version) ready now, filtered like the watch
    reason: str


class WatchBatch(NamedTuple):
    """One read of the log: events after the cursor, or a resync (then no events)."""

    events: list[ReadinessEvent]
    resync: Resync | None = None


class EventsLost(ConflictError):
    """Raised by readers that cannot take a resync: the events after the cursor are gone."""

    def __init__(self, resync: Resync) -> None:
        super().__init__(f"readiness events after {resync.lost_after} are gone ({resync.reason}); resume after "
                         f"{resync.resume_after} from the current state ({len(resync.ready)} ready residencies)")
        self.resync = resync


class Lookup(NamedTuple):
    adapter: str
    ready: tuple[str, ...]  # replicas where every rank has it READY
    loading: tuple[str, ...]  # replicas where some rank has it, not all READY


@dataclass
class ReadinessIndex:
    """Per (replica, adapter@version): which ranks hold it and in what state."""

    max_events: int = 10_000
    _tp: dict[str, int] = field(default_factory=dict)  # replica -> TP size
    _ranks: dict[tuple[str, str, str], dict[int, RankState]] = field(default_factory=dict)
    _ready: set[tuple[str, str, str]] = field(default_factory=set)  # (replica, adapter, version) all ready
    _events: deque[ReadinessEvent] = field(default_factory=deque)
    start_seq: int = 0  # the controller passes its epoch, so sequence numbers grow across restarts
    _seq: int = 0
    _floor: int = 0  # the newest sequence number whose event is no longer in the log (start_seq at first)
    released: set[str] = field(default_factory=set)  # adapters a rank let go of a version of since last taken

    def __post_init__(self) -> None:
        self._seq = max(self._seq, self.start_seq)
        self._floor = max(self._floor, self.start_seq)

    def add_replica(self, replica: str, tp: int) -> None:
        self._tp[replica] = tp

    def remove_replica(self, replica: str) -> list[ReadinessEvent]:
        events = [e for r in range(self._tp.get(replica, 0)) for e in self.drop_rank(replica, r)]
        self._tp.pop(replica, None)
        return events

    def report(self, replica: str, rank: int, adapter: str, version: str,
               state: RankState | None) -> list[ReadinessEvent]:
        """Rank ``rank`` of ``replica`` now holds ``adapter@version`` in ``state`` (None: not at all)."""
        tp = self._tp.get(replica)
        if tp is None:
            raise NotFoundError(f"replica {replica!r} is not known; known replicas: {sorted(self._tp)}")
        if not 0 <= rank < tp:
            raise NotFoundError(f"replica {replica!r} has ranks 0..{tp - 1}, not {rank}")
        key = (replica, adapter, version)
        ranks = self._ranks.setdefault(key, {})
        if state is None:
            ranks.pop(rank, None)
        else:
            ranks[rank] = state
        if not ranks:
            del self._ranks[key]
            self.released.add(adapter)  # a version may have left its last rank: the catalog's ``trim`` asks
        return self._update(key, tp)

    def versions_held(self, adapter: str) -> set[str]:
        """The versions of ``adapter`` some rank holds (any state): the controller's catalog keeps them loadable."""
        return {v for (_, a, v) in list(self._ranks) if a == adapter}  # a copy: safe from another thread

    def drop_rank(self, replica: str, rank: int) -> list[ReadinessEvent]:
        """A worker was lost or restarted empty: forget everything it held."""
        keys = [k for k, ranks in self._ranks.items() if k[0] == replica and rank in ranks]
        return [e for k in keys for e in self.report(replica, rank, k[1], k[2], None)]

    def holdings(self, replica: str, rank: int) -> dict[tuple[str, str], RankState]:
        """What rank ``rank`` of ``replica`` holds, as last reported: (adapter, version) -> state."""
        return {(a, v): ranks[rank] for (r, a, v), ranks in self._ranks.items() if r == replica and rank in ranks}

    def _update(self, key: tuple[str, str, str], tp: int) -> list[ReadinessEvent]:
        ranks = self._ranks.get(key, {})
        now = len(ranks) == tp and all(s is RankState.READY for s in ranks.values())
        if now == (key in self._ready):
            return []
        (self._ready.add if now else self._ready.discard)(key)
        self._seq += 1
        event = ReadinessEvent(self._seq, key[0], key[1], key[2], now)
        self._events.append(event)
        if len(self._events) > self.max_events:
            self._floor = self._events.popleft().seq
        return [event]

    def is_ready(self, replica: str, adapter: str, version: str) -> bool:
        return (replica, adapter, version) in self._ready

    def lookup(self, adapter: str, version: str | None = None) -> Lookup:
        """Replicas where ``adapter`` (any version, or exactly ``version``) is READY on every rank, and those where
        some rank holds it and not all have it READY."""
        ready = sorted({r for r, a, v in self._ready if a == adapter and version in (None, v)})
        loading = sorted({r for r, a, v in self._ranks if a == adapter and version in (None, v)} - set(ready))
        return Lookup(adapter, tuple(ready), tuple(loading))

    def events_after(self, seq: int, replica: str | None = None, adapter: str | None = None,
                     limit: int = 1000) -> list[ReadinessEvent]:
        """Events with a sequence number above ``seq`` (the subscriber's cursor), optionally filtered."""
        out = [e for e in self._events if e.seq > seq and replica in (None, e.replica) and adapter in (None, e.adapter)]
        return out[:limit]

    def read(self, after: int, replica: str | None = None, adapter: str | None = None,
             limit: int = 1000) -> WatchBatch:
        """What a subscriber at cursor ``after`` (0: from the oldest event of this controller) reads next:
        the events after it, or a ``Resync`` when some of them are gone or the cursor is foreign."""
        reason = self._gap(after)
        if reason is None:
            return WatchBatch(self.events_after(after or self.start_seq, replica, adapter, limit))
        ready = tuple(sorted(k for k in self._ready if replica in (None, k[0]) and adapter in (None, k[1])))
        return WatchBatch([], Resync(self._seq, after, ready, reason))

    def _gap(self, after: int) -> str | None:
        if after > self._seq:
            return f"cursor {after} is past the newest event {self._seq} (from another controller or cluster)"
        if 0 < after < self.start_seq:
            return f"cursor {after} is from before the controller restarted (its events start after {self.start_seq})"
        if (after or self.start_seq) < self._floor:
            return (f"the subscriber fell behind: the event log keeps the last {self.max_events} events, "
                    f"the oldest kept is {self._floor + 1}")
        return None

    @property
    def last_seq(self) -> int:
        return self._seq

    def ready_per_replica(self) -> dict[str, int]:
        """Adapter versions every rank has ready, per replica (0 for a replica with none)."""
        out = dict.fromkeys(self._tp, 0)
        for replica, _, _ in self._ready:
            out[replica] += 1
        return out

    def counts(self) -> dict[str, int]:
        return {"replicas": len(self._tp), "ready": len(self._ready), "held": len(self._ranks)}

    def check_integrity(self) -> None:
        for (replica, _, _), ranks in self._ranks.items():
            assert replica in self._tp, f"residency for unknown replica {replica}"
            assert ranks, "empty rank map kept"
            assert all(0 <= r < self._tp[replica] for r in ranks), f"rank out of range in {replica}"
        for key in self._ready:
            ranks = self._ranks.get(key, {})
            assert len(ranks) == self._tp[key[0]] and all(s is RankState.READY for s in ranks.values()), \
                f"{key} marked ready but not every rank is READY"
        assert len(self._events) <= self.max_events
        assert self.start_seq <= self._floor <= self._seq, "event log floor out of range"
        assert not self._events or self._events[0].seq == self._floor + 1, "a gap below the oldest kept event"


class Doorbell:
    """Wakes the long polls waiting for readiness events (``ControllerActor.poll_events``) when some are
    published; each waiter re-reads the index itself."""

    def __init__(self) -> None:
        self._rung = asyncio.Condition()  # waiters sleep on it; notified (never holding data) on publish

    def ring(self, events: list[ReadinessEvent]) -> None:
        if events:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._rung:
            self._rung.notify_all()

    async def wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Until ``done()`` holds (checked now and on every ring) or ``timeout_s`` has passed."""
        async with self._rung:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._rung.wait_for(done), timeout_s)
