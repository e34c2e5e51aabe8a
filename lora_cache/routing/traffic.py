"""A router's own count of the requests it sent to each replica lately, decayed (lifecycle step 1). Plain Python.

``Traffic.get(replica, now)`` is the number of requests sent there, each weighing ``2 ** -(age / half_life_s)``:
about the replica's recent request rate times ``half_life_s / ln 2``. The ranking's ``RouterConfig.cold_traffic``
places a cold adapter on the replica with the least of it (``ReplicaLoad.recent``): a router that ranks locally
(``LoraCacheRouter``) sees every request it sends, where its in-flight counts are almost always 0 at light load and
tell the replicas apart by nothing, and rendezvous hashing alone can put the two hottest adapters on one replica for
good (bench/RESULTS.md, issue 32 sixth round).
"""

from __future__ import annotations

import math

from lora_cache.errors import ConfigError


class Traffic:
    """Decayed counts of requests per replica (``half_life_s`` 0: always 0)."""

    def __init__(self, half_life_s: float) -> None:
        if not 0 <= half_life_s < math.inf:
            raise ConfigError(f"half_life_s is {half_life_s}; give a finite number of seconds >= 0 (0: no count)")
        self.half_life_s = half_life_s
        self._counts: dict[str, tuple[float, float]] = {}  # replica -> (count, at)

    def get(self, replica: str, now: float) -> float:
        count, at = self._counts.get(replica, (0.0, now))
        if count <= 0 or not self.half_life_s:
            return 0.0
        return count * 2.0 ** (-max(0.0, now - at) / self.half_life_s)

    def add(self, replica: str, now: float, weight: float = 1.0) -> None:
        """One request (``weight``) sent to ``replica`` at ``now`` (monotonic seconds)."""
        if self.half_life_s:
            self._counts[replica] = (self.get(replica, now) + weight, now)

    def forget(self, replica: str) -> None:
        self._counts.pop(replica, None)
