"""Exponentially decayed request counts, fleet-wide and per replica (lifecycle step 3).

Counts are kept *scaled* to a landmark time t0 shared by every counter: an event at time t adds
2**((t - t0) / half_life), and the decayed count at `now` is scaled * 2**(-(now - t0) / half_life).
So nothing decays in place, comparing scaled values compares decayed counts, and an adapter's rank
only changes when its own count grows. When the exponent gets large every count is rescaled and t0
moves to `now` (same order, no overflow). Time is always passed in; the core reads no clock.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping

from lora_cache.planner.records import AdapterInfo

_RESCALE_EXPONENT = 256.0  # 2**256 is far from float overflow (2**1024), far enough from denormals


class RankedCounts:
    """Counts by key, with `order` kept sorted most-popular first ((-count, key), ties by key).

    With `limit`, only the `limit` largest counts are kept; a count pushed out is forgotten.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.values: dict[str, float] = {}
        self.order: list[tuple[float, str]] = []  # (-count, key), ascending
        self.limit = limit
        self.total = 0.0  # the sum of the counts (an adapter's share of the traffic is its count / total)

    def get(self, key: str) -> float:
        return self.values.get(key, 0.0)

    def add(self, key: str, amount: float) -> None:
        old = self.values.get(key)
        if old is not None:
            del self.order[bisect_left(self.order, (-old, key))]
        new = (old or 0.0) + amount
        self.values[key] = new
        self.total += amount
        insort(self.order, (-new, key))
        if self.limit is not None and len(self.order) > self.limit:
            neg, dropped = self.order.pop()
            del self.values[dropped]
            self.total += neg

    def forget(self, key: str) -> None:
        """Drop `key`'s count (an unregistered adapter); a no-op if it has none."""
        old = self.values.pop(key, None)
        if old is not None:
            del self.order[bisect_left(self.order, (-old, key))]
            self.total = max(0.0, self.total - old) if self.values else 0.0

    def rescale(self, factor: float) -> None:
        """Multiply every count by `factor` (counts that underflow to zero are forgotten)."""
        scaled = ((-neg * factor, key) for neg, key in self.order)
        self.order = sorted((-value, key) for value, key in scaled if value > 0.0)
        self.values = {key: -neg for neg, key in self.order}
        self.total = math.fsum(self.values.values())

    def check_integrity(self) -> None:
        assert self.order == sorted(self.order), "order is not sorted"
        assert len(self.order) == len(self.values), "order and values disagree in size"
        for neg, key in self.order:
            assert self.values.get(key) == -neg > 0.0, f"count of {key!r} is inconsistent or not positive"
        assert self.limit is None or len(self.order) <= self.limit, "more counts than the limit"
        exact = math.fsum(self.values.values())
        assert abs(self.total - exact) <= 1e-6 * max(1.0, exact), f"total {self.total} is not the sum {exact}"


RANK_MIN_AGE_S = 3.0  # ``Popularity.hottest``: a rate is read over at least this long since the first request


class DecayClock:
    """The landmark t0 that a set of counters is scaled to, for one half-life (module docstring): an event at ``now``
    adds ``2**exponent(now)``, a scaled count decays by ``2**-exponent(now)``; ``advance`` rescales the counters and
    moves t0 to ``now`` once the exponent grows large."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.landmark_s: float | None = None  # t0; None until the first time is passed

    def exponent(self, now: float) -> float:
        assert self.landmark_s is not None
        return (now - self.landmark_s) / self.half_life_s

    def advance(self, now: float, counters: Iterable[RankedCounts]) -> None:
        """Move to ``now`` (the caller guarantees time never goes back): the first time passed becomes t0; with a
        large exponent every one of ``counters`` is rescaled (same order, no overflow) and t0 moves to ``now``."""
        if self.landmark_s is None:
            self.landmark_s = now
        elif self.exponent(now) > _RESCALE_EXPONENT:
            factor = 2.0 ** -self.exponent(now)
            for counts in counters:
                counts.rescale(factor)
            self.landmark_s = now


class FleetRate:
    """A fleet-wide decayed count of its own half-life, scaled to its own landmark as ``Popularity``'s counts are,
    read as requests per second (a steady rate r reads r once a few half-lives have passed); and each adapter's
    first and last request and how many (``seen``)."""

    def __init__(self, half_life_s: float) -> None:
        self.clock = DecayClock(half_life_s)
        self.counts = RankedCounts()
        self.seen: dict[str, tuple[float, float, float]] = {}  # adapter -> (first request, last request, requests)

    def observe(self, adapter: str, now: float, weight: float = 1.0) -> None:
        first, _, requests = self.seen.get(adapter, (now, now, 0.0))
        self.seen[adapter] = (first, now, requests + weight)
        self.clock.advance(now, (self.counts,))
        self.counts.add(adapter, weight * 2.0 ** self.clock.exponent(now))

    def per_second(self, adapter: str, now: float) -> float:
        if self.clock.landmark_s is None:
            return 0.0
        return self.counts.get(adapter) * 2.0 ** -self.clock.exponent(now) * math.log(2.0) / self.half_life_s

    @property
    def half_life_s(self) -> float:
        return self.clock.half_life_s

    def top(self, n: int) -> list[str]:
        return [key for _, key in self.counts.order[:n]]


class Popularity:
    """Decayed counts of requests per adapter: one fleet-wide counter and one per replica; with ``short_half_life_s``
    also a fleet-wide rate of that shorter half-life, which ``hottest`` reads beside the fleet's counts."""

    def __init__(self, half_life_s: float, max_tracked_per_replica: int, short_half_life_s: float = 0.0,
                 idle_k: float = 0.0) -> None:
        self.max_tracked_per_replica = max_tracked_per_replica
        self.clock = DecayClock(half_life_s)  # the landmark t0 of ``fleet`` and ``local``
        self.started_s: float | None = None  # the first time passed: how long the counts have been kept
        self.short = FleetRate(short_half_life_s) if short_half_life_s > 0 else None
        self.idle_k = idle_k  # ``hottest``: an adapter not asked for in T seconds ranks at most idle_k / T per second
        self.fleet = RankedCounts()
        self.local: dict[str, RankedCounts] = {}
        self.touched: dict[str, dict[str, float]] = {}  # replica -> adapter -> when its requests last touched it

    @property
    def half_life_s(self) -> float:
        return self.clock.half_life_s

    @property
    def landmark_s(self) -> float | None:
        """t0 of the fleet's and the replicas' counts (durable.py saves it)."""
        return self.clock.landmark_s

    def restore_landmark(self, landmark_s: float) -> None:
        """Counts scaled to ``landmark_s`` are about to be restored (durable.py): it becomes t0 if none is set, and
        the counts are read over the window since then (a landmark moves only after 256 half-lives, past which
        ``observed_per_second``'s window no longer grows), not over the seconds since this planner started."""
        if self.clock.landmark_s is None:
            self.clock.landmark_s = landmark_s
        self.started_s = min(landmark_s, self.started_s if self.started_s is not None else math.inf)

    def advance(self, now: float) -> None:
        """Move to `now` (the caller guarantees time never goes back); rescale if counts grew large."""
        if self.started_s is None:
            self.started_s = now
        self.clock.advance(now, (self.fleet, *self.local.values()))

    def observe(self, adapter: str, replica: str, now: float, weight: float = 1.0) -> None:
        """Count one request (or `weight` requests) for `adapter` at `replica`, at `now`."""
        self.advance(now)
        amount = weight * 2.0 ** self.clock.exponent(now)
        self.fleet.add(adapter, amount)
        local = self.local.get(replica)
        if local is None:
            local = self.local[replica] = RankedCounts(self.max_tracked_per_replica)
        local.add(adapter, amount)
        if self.short is not None:
            self.short.observe(adapter, now, weight)
        self.touch(adapter, replica, now)

    def touch(self, adapter: str, replica: str, now: float) -> None:
        """A request for ``adapter`` at ``replica`` did something at ``now`` (hinted, queued, left the queue, its
        hint withdrawn): ``recent`` reads it (``PlannerConfig.linger_s``)."""
        seen = self.touched.setdefault(replica, {})
        seen.pop(adapter, None)
        seen[adapter] = now  # insertion order is time order: the oldest first
        if len(seen) > 2 * self.max_tracked_per_replica:  # bounded, whoever reads it
            for name in list(seen)[: len(seen) - self.max_tracked_per_replica]:
                del seen[name]

    def recent(self, replica: str, now: float, window_s: float) -> set[str]:
        """The adapters ``replica``'s requests touched within ``window_s`` of ``now``; older ones are forgotten."""
        seen = self.touched.get(replica)
        if not seen:
            return set()
        while seen:
            name, when = next(iter(seen.items()))
            if when >= now - window_s:
                break
            del seen[name]
        return set(seen)

    def decayed(self, adapter: str, now: float, replica: str | None = None) -> float:
        """The decayed count at `now` (>= the last time given): fleet-wide, or at one replica."""
        counts = self.fleet if replica is None else self.local.get(replica)
        if counts is None or self.landmark_s is None:
            return 0.0
        return counts.get(adapter) * 2.0 ** -self.clock.exponent(now)

    def hottest(self, now: float, limit: int) -> list[str]:
        """The requested adapters by their request rate now, most first (ties by name); of each counter, its
        ``limit`` largest. With the short rate kept (bench/reports/issue-42.md, "the host tier lets go of the fleet's
        least asked-for shard first"):

        - the larger of the counts' rate (the half-life's) and the short rate: a steady adapter keeps its place
          through a lull, and one that became popular lately ranks by its traffic now;
        - each read over the time since the adapter's first request (``RANK_MIN_AGE_S`` at least) where it had two
          or more, not over the counters' whole memory: a decayed count of a rate r that began t ago reads
          r * (1 - 2**(-t / half-life)), so a new adapter at 0.4/s read 0.15/s after 10 s and ranked below the
          adapters it replaced;
        - at most ``idle_k / T`` for an adapter not asked for in the last T seconds (for a steady one, T > idle_k /
          rate one time in e**idle_k): one that stopped falls below the ones asked for now in seconds, not in a
          half-life."""
        scale = self.per_second(now)
        names = dict.fromkeys(key for _, key in self.fleet.order[:limit])
        short = self.short
        if short is None:
            return sorted(names, key=lambda name: (-self.fleet.get(name), name))
        names.update(dict.fromkeys(short.top(limit)))

        def rate(name: str) -> float:
            long, fast = self.fleet.get(name) * scale, short.per_second(name, now)
            first, last, requests = short.seen.get(name, (now, now, 0.0))
            if requests >= 2:  # a rate over the adapter's own age (one request is not a rate)
                age = max(now - first, RANK_MIN_AGE_S) * math.log(2.0)
                long /= -math.expm1(-age / self.half_life_s)
                fast /= -math.expm1(-age / short.half_life_s)
            best = max(long, fast)
            return min(best, self.idle_k / (now - last)) if self.idle_k and now > last else best

        return sorted(names, key=lambda name: (-rate(name), name))

    def drop_replica(self, replica: str) -> None:
        self.local.pop(replica, None)
        self.touched.pop(replica, None)

    def forget(self, adapter: str) -> None:
        """An unregistered adapter: its counts go, fleet-wide and at every replica."""
        for counts in (self.fleet, *self.local.values()):
            counts.forget(adapter)
        if self.short is not None:
            self.short.counts.forget(adapter)
            self.short.seen.pop(adapter, None)
        for seen in self.touched.values():
            seen.pop(adapter, None)

    def scorer(self, replica: str, n_replicas: int, local_weight: float,
               catalog: Mapping[str, AdapterInfo], min_bytes: int, now: float | None = None,
               cost: Callable[[int], int] | None = None) -> ReplicaScorer:
        """``cost``: the GPU bytes a shard of n bytes takes on this replica (whole pages of a paged pool:
        ``Capacity.gpu_bytes``; None: its own bytes)."""
        fleet_weight = (1.0 - local_weight) / max(1, n_replicas)
        local = self.local.get(replica)
        return ReplicaScorer(self.fleet, local, fleet_weight, local_weight, catalog, min_bytes,
                             self.per_second(now), cost)

    def per_second(self, now: float | None) -> float:
        """Scaled count -> requests per second at `now`: a decayed count of a steady rate r converges to
        r * half_life / ln 2 (an underestimate for the first half-lives of a run or of a new adapter)."""
        if now is None or self.landmark_s is None:
            return 0.0
        return 2.0 ** -self.clock.exponent(now) * math.log(2.0) / self.half_life_s

    def observed_per_second(self, now: float | None, min_window_s: float) -> float:
        """``per_second`` over the time the counts were kept: a steady rate r counted since ``started_s`` has a
        decayed count of r * half_life / ln 2 * (1 - 2**(-age / half_life)), so this divides by that window (at
        least ``min_window_s``: a first request is not a rate) instead of its limit. Early in a run (an 8 s
        benchmark of a 60 s half-life) ``per_second`` reads a 7 req/s adapter as 0.5 req/s (issue 31)."""
        if now is None or self.landmark_s is None or self.started_s is None:
            return 0.0
        tau = self.half_life_s / math.log(2.0)
        window = tau * -math.expm1(-max(0.0, now - self.started_s) / tau)
        return 2.0 ** -self.clock.exponent(now) / max(window, min_window_s)

    def check_integrity(self) -> None:
        self.fleet.check_integrity()
        if self.short is not None:
            self.short.counts.check_integrity()
            assert self.short.counts.values.keys() <= self.short.seen.keys(), "a short rate with no request seen"
        for replica, counts in self.local.items():
            counts.check_integrity()
            for key in counts.values:
                assert key in self.fleet.values, f"{key!r} counted at {replica!r} but not fleet-wide"


class ReplicaScorer:
    """An adapter's expected value on one replica, per GPU byte its shard takes there.

    value = fleet_weight * fleet count + local_weight * the replica's count (scaled counts: only
    ratios and order are meaningful, and both are the same at every time). The bytes are the shard's rounded up
    to the pool's pages where it has them (``cost``, issue 43 item 2): a rank-24 shard in pages of rank 16 takes
    two pages and is worth keeping per those bytes, not per its own.
    """

    def __init__(self, fleet: RankedCounts, local: RankedCounts | None, fleet_weight: float,
                 local_weight: float, catalog: Mapping[str, AdapterInfo], min_bytes: int,
                 per_second: float = 0.0, cost: Callable[[int], int] | None = None) -> None:
        self._fleet, self._local = fleet, local
        self._fleet_weight, self._local_weight = fleet_weight, local_weight
        self._catalog = catalog
        self._cost = cost or (lambda size: size)  # monotone: the Fagin bound below holds with cost(min_bytes)
        self._min_bytes = self._cost(min_bytes)
        self._per_second = per_second  # scaled value -> requests per second at the plan's time

    def value(self, adapter: str, local_at_least: float = 0.0) -> float:
        local = self._local.values.get(adapter, 0.0) if self._local is not None else 0.0
        local = max(local, local_at_least)
        return self._fleet_weight * self._fleet.values.get(adapter, 0.0) + self._local_weight * local

    def rate(self, adapter: str) -> float:
        """Expected requests per second for `adapter` at this replica (the blend of `value`, decayed)."""
        return self.value(adapter) * self._per_second

    def none_reach(self, score: float, max_bytes: int, min_rate: float) -> bool:
        """Whether no adapter scoring ``score`` or less can be expected at ``min_rate`` (its value is at most
        ``score`` x the largest shard): a scan of ``ranked()`` for such a rate may stop there. False when the
        largest shard is unknown (0)."""
        return max_bytes > 0 and score * self._cost(max_bytes) * self._per_second < min_rate

    def score(self, adapter: str) -> float:
        return self.value(adapter) / self._cost(self._catalog[adapter].bytes_per_rank)

    def home_score(self, adapter: str, per_copy: float) -> float:
        """``score`` as it will be once a router that follows residency sends this replica its share of the
        adapter's traffic: the replica's count taken as at least ``per_copy`` (homes.py). So a hot adapter's
        new home is valued by what it will serve, not by the little it was sent while resident elsewhere."""
        return self.value(adapter, per_copy) / self._cost(self._catalog[adapter].bytes_per_rank)

    def ranked(self) -> Iterator[tuple[float, str]]:
        """(score, adapter) for every adapter with a positive score, best first, ties by name.

        Fagin's threshold algorithm over the two sorted counters: read both lists one row at a time;
        an adapter in neither list's read part scores at most the bound (next rows' counts over the
        smallest shard), so anything in the heap above the bound is final. Lazy: a caller that needs
        the top few reads only a little deeper than them.
        """
        fleet = self._fleet.order
        local = self._local.order if self._local is not None else []
        fleet_w, local_w, min_bytes = self._fleet_weight, self._local_weight, self._min_bytes
        seen: set[str] = set()
        heap: list[tuple[float, str]] = []
        for depth in range(max(len(fleet), len(local))):
            for order in (fleet, local):
                if depth < len(order) and order[depth][1] not in seen:
                    self._push(order[depth][1], seen, heap)
            next_fleet = -fleet[depth + 1][0] if depth + 1 < len(fleet) else 0.0
            next_local = -local[depth + 1][0] if depth + 1 < len(local) else 0.0
            bound = (fleet_w * next_fleet + local_w * next_local) / min_bytes
            while heap and -heap[0][0] > bound:
                neg, adapter = heapq.heappop(heap)
                yield -neg, adapter
        while heap:
            neg, adapter = heapq.heappop(heap)
            yield -neg, adapter

    def _push(self, adapter: str, seen: set[str], heap: list[tuple[float, str]]) -> None:
        seen.add(adapter)
        info = self._catalog.get(adapter)
        if info is not None:
            score = self.value(adapter) / self._cost(info.bytes_per_rank)
            if score > 0.0:
                heapq.heappush(heap, (-score, adapter))
