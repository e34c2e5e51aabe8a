"""The hint horizon (lifecycle step 3): near hints are needs, far hints only fill free room.

A hint expected more than `horizon_s` ahead is *far*: a router that forecasts a request minutes ahead
must not take the GPU from the requests waiting now. Far hints never evict and never hold a slot that
a queued request or a near hint could use: the policy admits them only into room left free after the
needed adapters, the incumbents, speculation and the homes (or stages them), after every near need. A far
hint becomes an ordinary (near) hint at `expected_s - horizon_s`; `due(now)` names the replicas to replan
then, so the planner replans as time passes, not only when an input arrives.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from lora_cache.planner.records import Hint


class Horizon:
    """Which hints are near, and when the far ones come within the horizon (bounded by the active hints)."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._due: list[tuple[float, str, str]] = []  # heap: (when the hint turns near, hint id, replica)

    def is_near(self, hint: Hint, now: float) -> bool:
        return hint.expected_s - self.horizon_s <= now

    def split(self, hints: Iterable[Hint], now: float) -> tuple[list[Hint], list[Hint]]:
        """(near, far), each in the given order."""
        near: list[Hint] = []
        far: list[Hint] = []
        for hint in hints:
            (near if self.is_near(hint, now) else far).append(hint)
        return near, far

    def watch(self, hint: Hint, now: float, active: Mapping[str, Hint]) -> None:
        """Remember when a far hint turns near (a near one needs nothing)."""
        if self.is_near(hint, now):
            return
        heapq.heappush(self._due, (hint.expected_s - self.horizon_s, hint.hint_id, hint.replica))
        if len(self._due) > 2 * len(active) + 64:  # cancelled or fulfilled far hints: drop their entries
            self._due = [d for d in self._due if active.get(d[1]) is not None]
            heapq.heapify(self._due)

    def due(self, now: float, active: Mapping[str, Hint]) -> set[str]:
        """Replicas with an active hint that turned near by `now` (their plan changes)."""
        touched: set[str] = set()
        while self._due and self._due[0][0] <= now:
            _, hint_id, replica = heapq.heappop(self._due)
            hint = active.get(hint_id)
            if hint is not None and hint.replica == replica:
                touched.add(replica)
        return touched

    def check_integrity(self, active: Mapping[str, Hint], now: float | None) -> None:
        pending = {(hint_id, replica) for _, hint_id, replica in self._due}
        for hint in active.values():
            if now is not None and not self.is_near(hint, now):
                assert (hint.hint_id, hint.replica) in pending, f"far hint {hint.hint_id!r} never turns near"
        assert len(self._due) <= 2 * len(active) + 64, f"{len(self._due)} horizon entries for {len(active)} hints"
