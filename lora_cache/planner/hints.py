"""Router hints (lifecycle step 1): active hints per replica, and tombstones for idempotence.

A hint is active from `add` until a queued request for its adapter arrives at its replica (fulfilled),
it is cancelled, or `ttl_s` passes after its expected time (expired). A fulfilled or cancelled hint's
id is remembered for a while (a tombstone), so a duplicate or late copy is ignored; a cancel that
arrives before its hint leaves a tombstone too. Lost, duplicated or reordered hints cost latency only.
Tombstones are bounded by count as well as by time: past `max_tombstones` the oldest is forgotten (a very
late duplicate of it then becomes an ordinary hint: a prefetch, never a wrong answer), so a client that
cancels unknown ids by the million holds a bounded amount of the controller's memory.
"""

from __future__ import annotations

import heapq

from lora_cache.planner.records import Hint


class HintBook:
    """Active hints and tombstones, all bounded: by `max_per_replica`, `max_tombstones` and by time."""

    def __init__(self, ttl_s: float, max_per_replica: int, max_tombstones: int = 65536) -> None:
        self.ttl_s = ttl_s
        self.max_per_replica = max_per_replica
        self.max_tombstones = max_tombstones
        self.active: dict[str, Hint] = {}
        self.by_replica: dict[str, dict[str, Hint]] = {}  # replica -> hint id -> hint
        self.tombstones: dict[str, float] = {}  # hint id -> when it is forgotten, oldest buried first
        self._deadlines: list[tuple[float, str]] = []  # heap: expiry of active hints and tombstones (and stale
        # entries of tombstones forgotten early, dropped when the heap outgrows the live entries twice over)

    def add(self, hint: Hint, now: float) -> bool:
        """Make `hint` active; False if its id is known, it is already stale, or its replica is full."""
        if hint.hint_id in self.active or hint.hint_id in self.tombstones:
            return False
        if self._expiry(hint) < now:
            return False
        per_replica = self.by_replica.setdefault(hint.replica, {})
        if len(per_replica) >= self.max_per_replica:
            return False
        self.active[hint.hint_id] = per_replica[hint.hint_id] = hint
        heapq.heappush(self._deadlines, (self._expiry(hint), hint.hint_id))
        return True

    def cancel(self, hint_id: str, now: float) -> Hint | None:
        """Close an active hint (returned); an unknown id leaves a tombstone for a late hint."""
        if hint_id in self.active:
            return self._close(hint_id, now)
        if hint_id not in self.tombstones:
            self._bury(hint_id, now + self.ttl_s)
        return None

    def fulfil(self, replica: str, adapter: str, now: float) -> Hint | None:
        """A request for `adapter` arrived at `replica`: close the earliest hint that forecast it."""
        candidates = [h for h in self.by_replica.get(replica, {}).values() if h.adapter == adapter]
        if not candidates:
            return None
        first = min(candidates, key=lambda h: (h.expected_s, h.hint_id))
        return self._close(first.hint_id, now)

    def expire(self, now: float) -> set[str]:
        """Drop hints and tombstones past their time; the replicas whose active hints changed."""
        touched: set[str] = set()
        while self._deadlines and self._deadlines[0][0] < now:
            when, hint_id = heapq.heappop(self._deadlines)
            hint = self.active.get(hint_id)
            if hint is not None and self._expiry(hint) == when:
                self._unlink(hint)
                touched.add(hint.replica)
            elif self.tombstones.get(hint_id) == when:
                del self.tombstones[hint_id]
        return touched

    def for_replica(self, replica: str) -> list[Hint]:
        """Active hints of `replica`, soonest expected first (ties by hint id)."""
        hints = self.by_replica.get(replica, {}).values()
        return sorted(hints, key=lambda h: (h.expected_s, h.hint_id))

    def drop_replica(self, replica: str) -> None:
        for hint in list(self.by_replica.get(replica, {}).values()):
            self._unlink(hint)

    def check_integrity(self) -> None:
        flat = {i: h for hints in self.by_replica.values() for i, h in hints.items()}
        assert flat == self.active, "by_replica and active disagree"
        for replica, hints in self.by_replica.items():
            assert hints, f"empty hint table kept for {replica!r}"
            assert len(hints) <= self.max_per_replica, f"{replica!r} holds more hints than the limit"
            assert all(h.replica == replica for h in hints.values()), "a hint filed under the wrong replica"
        assert not self.active.keys() & self.tombstones.keys(), "a hint is both active and a tombstone"
        assert len(self.tombstones) <= self.max_tombstones, "more tombstones than max_tombstones"
        assert len(self._deadlines) <= 2 * (len(self.active) + len(self.tombstones)) + 64, "the deadline heap grew"
        pending = set(self._deadlines)
        for hint in self.active.values():
            assert (self._expiry(hint), hint.hint_id) in pending, f"hint {hint.hint_id!r} never expires"
        for hint_id, when in self.tombstones.items():
            assert (when, hint_id) in pending, f"tombstone {hint_id!r} is never forgotten"

    def _close(self, hint_id: str, now: float) -> Hint:
        hint = self.active[hint_id]
        self._unlink(hint)
        self._bury(hint_id, max(hint.expected_s, now) + self.ttl_s)
        return hint

    def _unlink(self, hint: Hint) -> None:
        del self.active[hint.hint_id]
        per_replica = self.by_replica[hint.replica]
        del per_replica[hint.hint_id]
        if not per_replica:
            del self.by_replica[hint.replica]

    def _bury(self, hint_id: str, until: float) -> None:
        self.tombstones[hint_id] = until
        heapq.heappush(self._deadlines, (until, hint_id))
        while len(self.tombstones) > self.max_tombstones:
            del self.tombstones[next(iter(self.tombstones))]  # the oldest buried
        if len(self._deadlines) > 2 * (len(self.active) + len(self.tombstones)) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the deadline heap from the live hints and tombstones (amortized: at most every other push)."""
        self._deadlines = [(self._expiry(h), i) for i, h in self.active.items()]
        self._deadlines += [(when, i) for i, when in self.tombstones.items()]
        heapq.heapify(self._deadlines)

    def _expiry(self, hint: Hint) -> float:
        return hint.expected_s + self.ttl_s
