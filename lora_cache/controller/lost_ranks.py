"""Ranks lost and not heard from since, and the plans withheld from their replicas (lifecycle steps 3-4, 7).

``ControllerCore`` keeps one ``LostRanks``: a rank found dead, hung or detached (``lose``) makes its replica
take no hints, plans or routes until it reports again (``heard_from``); the plans its replica's ranks were not
sent meanwhile are ``withheld``, and once the replica is whole ``returned`` names those ranks (the caller
resyncs them: the planner assumed the withheld commands applied). Plain Python, no Ray, no clock.
"""

from __future__ import annotations

from collections import deque

from lora_cache.vocab import WorkerId


class LostRanks:
    """Which ranks are lost, since when, and whose plans were withheld meanwhile."""

    def __init__(self) -> None:
        self.down: set[WorkerId] = set()  # ranks lost (dead, hung, detached) and not heard from since
        self.withheld: set[WorkerId] = set()  # workers whose plans were not sent (their replica was down)
        self.lost_at: dict[WorkerId, float] = {}  # when each rank in ``down`` was found lost (wall clock)
        self.recent_losses: deque[tuple[str, float]] = deque(maxlen=64)  # (worker, when found lost), newest last
        self.loss_causes: deque[tuple[str, float, str]] = deque(maxlen=64)  # (worker, when, how it was found lost)

    def lose(self, worker: WorkerId, now: float, cause: str = "") -> None:
        """``worker`` was found lost at ``now`` (a rank already lost keeps its first time); ``cause``: how (a ping
        unanswered, its lifeline closed, ...), kept in ``loss_causes`` for whoever asks why."""
        self.loss_causes.append((str(worker), now, cause))
        if worker not in self.down:
            self.down.add(worker)
            self.lost_at[worker] = now
            self.recent_losses.append((str(worker), now))

    def heard_from(self, worker: WorkerId) -> None:
        """A lost rank reported again: alive (its replica is planned and routed again once no rank is lost)."""
        self.down.discard(worker)
        self.lost_at.pop(worker, None)

    def replicas(self) -> set[str]:
        """Replicas with a rank lost and not heard from since: no hints taken, no plans sent, no routes."""
        return {w.replica for w in self.down}

    def returned(self) -> list[WorkerId]:
        """Workers whose plans were withheld while their replica was down and that is whole again: the
        caller resyncs them (the planner assumed the withheld commands applied)."""
        down = self.replicas()
        back = sorted(w for w in self.withheld if w.replica not in down)
        self.withheld -= set(back)
        return back

    def forget_replica(self, replica: str) -> None:
        """``replica`` left the fleet: none of its ranks is lost or withheld any more."""
        for worker in [w for w in self.down | self.withheld if w.replica == replica]:
            self.down.discard(worker)
            self.withheld.discard(worker)
            self.lost_at.pop(worker, None)
