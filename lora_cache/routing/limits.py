"""Routing limits (lifecycle step 1): what a replica can start now, beside the routing advice. Plain Python.

A request's wait on a replica is not its share of the replica's load alone. The engine's scheduler
(``workers.engine.scheduler``) starts a waiting request only while the batch has room: at most
``max_running`` requests and at most ``max_adapters`` *distinct* adapters among the running ones
(``EngineConfig.max_adapters``; vLLM's ``max_loras``, SGLang's ``max_loras_per_batch``). A request for
an adapter that is already in flight there joins its batch at once; one for a new adapter needs a free
adapter lane, and where every lane is taken it waits at the head of the queue until a whole adapter's
requests finish, however light the replica's load is. A router that counts requests only (or ranks by
residency alone) sends such requests to a replica that cannot start them while another could: in the
simulator, with ``max_adapters`` below the slots, every policy behind the old ranking had a p99 3-7x
that of the same policy behind the least-loaded router (bench/RESULTS.md, 2026-11-26).

``RoutingLimits`` keeps, per replica, the limits it declared (``declare``: the engine's ``max_adapters``
and ``max_running``; unknown: no limit) and the adapters of the requests in flight there, as the
controller can know them:

- with the router's own in-flight counts (``Route``'s ``outstanding_requests``): the adapters of the
  newest ``count`` requests the advice sent there (``InFlight``: every first pick is recorded; the
  oldest are taken to have finished first), less the requests the router said finished (``Route``'s
  ``finished_requests``: the oldest pick of that adapter there goes, ``InFlight.finish``). Requests end in no fixed
  order (their outputs differ in length: uniform in 1-128 tokens on the routing grid), so the oldest-first
  guess alone kept adapters whose requests had ended and dropped ones still running: at 8 lanes on two
  replicas under heavy load (r2-a50-l0.9-zipf1-m8-tp1) Route believed both replicas three lanes short for a new
  adapter's request and sent it to the one really four short (the other was one short); its p99 was 1.21x
  affinity's (median of 5 seeds; issue 42, bench/reports/issue-42.md). A router that reports its finishes
  gives the exact adapters in flight; one that does not is ranked as before;
- without: the replica's reported waiting queue and its active hints (requests routed there, not yet
  queued).

``lora_cache.routing.ranking`` reads them as ``ReplicaLoad.flying``, ``max_adapters`` and ``max_running``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import NamedTuple

from lora_cache.errors import ConfigError

KEEP = 4096  # picks remembered per replica (more than any replica's max_running)


class ReplicaLimits(NamedTuple):
    """What one replica's scheduler admits at once (0: unknown, no limit)."""

    max_adapters: int = 0  # distinct adapters among the running requests (EngineConfig.max_adapters)
    max_running: int = 0  # requests running at once (EngineConfig.max_running)


class InFlight:
    """Per replica, the adapters of the requests the advice sent there, newest last (at most ``keep``), each with
    its routing sequence number (one counter over the fleet: a smaller one was routed earlier)."""

    def __init__(self, keep: int = KEEP) -> None:
        if keep < 1:
            raise ConfigError(f"keep is {keep}; give a count >= 1 (picks remembered per replica)")
        self.keep = keep
        self._picks: dict[str, deque[tuple[str, int]]] = {}
        self._seq = 0

    def record(self, replica: str, adapter: str) -> None:
        self._seq += 1
        self._picks.setdefault(replica, deque(maxlen=self.keep)).append((adapter, self._seq))

    def finish(self, replica: str, adapter: str) -> bool:
        """A request of ``adapter`` the router sent to ``replica`` finished: its oldest pick there goes (which of
        an adapter's requests ended does not change the adapters in flight). False where none is remembered
        (forgotten, never routed here, or told twice): nothing changes."""
        picks = self._picks.get(replica)
        if not picks:
            return False
        for i, (name, _) in enumerate(picks):
            if name == adapter:
                del picks[i]
                return True
        return False

    def newest(self, replica: str, count: float) -> Counter[str]:
        """Adapters of the newest ``count`` picks of ``replica`` (the requests still in flight), with counts."""
        picks = self._picks.get(replica)
        if not picks:
            return Counter()
        n = min(int(count), len(picks))
        return Counter(picks[i][0] for i in range(len(picks) - n, len(picks))) if n > 0 else Counter()

    def lane_frees(self, replica: str, count: float, max_adapters: int) -> int:
        """Where every lane of ``replica`` is taken, which running batch frees one first, as a routing sequence
        number: of the first ``max_adapters`` adapters among its newest ``count`` picks (oldest first: those
        that run), the least of each one's newest pick (a batch frees its lane when its newest request ends; the
        one routed earliest is likeliest to end first). 0: nothing in flight (or no limit)."""
        picks = self._picks.get(replica)
        n = min(int(count), len(picks)) if picks else 0
        if picks is None or n <= 0 or max_adapters <= 0:
            return 0
        last: dict[str, int] = {}
        for i in range(len(picks) - n, len(picks)):
            adapter, seq = picks[i]
            if adapter in last or len(last) < max_adapters:
                last[adapter] = seq
        return min(last.values())

    def forget(self, replica: str) -> None:
        self._picks.pop(replica, None)


class RoutingLimits:
    """Declared limits and requests in flight, per replica (module docstring)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._limits: dict[str, ReplicaLimits] = {}
        self.in_flight = InFlight(keep)

    def declare(self, replica: str, max_adapters: int = 0, max_running: int = 0) -> None:
        """The replica's engine admits at most ``max_adapters`` distinct adapters and ``max_running`` requests
        per batch (0: unknown). A replica declared again takes the new limits."""
        for name, value in (("max_adapters", max_adapters), ("max_running", max_running)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"{name} of replica {replica!r} is {value!r}; give an int >= 0 (the engine's {name}; 0: unknown)"
                )
        self._limits[replica] = ReplicaLimits(max_adapters, max_running)

    def forget(self, replica: str) -> None:
        """The replica is gone: its limits and its picks."""
        self._limits.pop(replica, None)
        self.in_flight.forget(replica)

    def limits(self, replica: str) -> ReplicaLimits:
        return self._limits.get(replica, ReplicaLimits())

    def flying(self, replica: str, load: float | None, waiting: Iterable[str]) -> Counter[str]:
        """The adapters in flight on ``replica``: with the router's count ``load``, the newest ``load`` picks;
        without (None), the adapters ``waiting`` there (its queue and active hints)."""
        if load is not None:
            return self.in_flight.newest(replica, load)
        return Counter(waiting)

    def lane_frees(self, replica: str, load: float | None) -> int:
        """With the router's count ``load``, ``InFlight.lane_frees`` under the replica's declared ``max_adapters``;
        without (None), 0: unknown."""
        if load is None:
            return 0
        return self.in_flight.lane_frees(replica, load, self.limits(replica).max_adapters)

    def record(self, picks: Iterable[tuple[str, str]]) -> None:
        """First picks the router takes: (adapter, replica) pairs, in order."""
        for adapter, replica in picks:
            self.in_flight.record(replica, adapter)

    def finish(self, done: Iterable[tuple[str, str]]) -> int:
        """Requests the router says finished: (replica, adapter) pairs (``InFlight.finish``); how many matched a
        remembered pick."""
        return sum(self.in_flight.finish(replica, adapter) for replica, adapter in done)
