"""Prometheus metrics through ``ray.util.metrics``: Ray's metrics agent exports them on every node
(``ray_lora_cache_*`` on the node's metrics export port), so a Ray cluster's Prometheus scrapes them
with no extra server.

Only the Ray actors use this module (the plain cores keep plain counters): the controller records
planning, commands, hints and queue depths as they happen; each worker exports its cache counters
(per rank and tier) on a short timer, as increments since the last export, plus time-to-ready per
load. Every figure is tagged with its replica (and rank), so per-rank and per-replica views are
label selections.

Names follow Prometheus' base units: durations in ``_seconds``, sizes in ``_bytes`` (Ray appends ``_total`` to
counters, ``_bucket``/``_sum``/``_count`` to histograms). Every counter is exported from zero for each label
set it can have (the tiers, paths, kinds, outcomes, reasons), so ``rate()`` and ``increase()`` see its first
increment and a dashboard shows 0 rather than "no data".
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping

from ray.util.metrics import Counter, Gauge, Histogram

SECONDS_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10]
RANK_TAGS = ("replica", "rank")
LOADS_KEPT = 100_000  # loads waiting for the next export's observations (past it, the oldest are not observed)
COMMAND_KINDS = ("prefetch", "evict", "stage", "ranking")


def from_zero(counter: Counter, tags: Mapping[str, str]) -> None:
    """Export ``counter`` at 0 for ``tags`` now (``inc`` refuses 0; ``_record`` is what it calls)."""
    counter._record(0, tags=dict(tags))


class ControllerMetrics:
    """The controller's decisions and inputs."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.planner_s = Histogram("lora_cache_planner_latency_seconds", "time to compute one plan",
                                   boundaries=SECONDS_BUCKETS, tag_keys=("policy", "scope"))
        self.commands = Counter("lora_cache_commands_sent", "commands sent to workers", tag_keys=("kind",))
        self.rejected = Counter("lora_cache_commands_rejected", "commands a worker refused",
                                tag_keys=("reason",))
        self.queue_depth = Gauge("lora_cache_queue_depth", "requests waiting at a replica", tag_keys=("replica",))
        self.hints = Counter("lora_cache_hints", "router hints received", tag_keys=("outcome",))
        self.ready = Gauge("lora_cache_ready_adapters", "adapter versions every rank of a replica has ready",
                           tag_keys=("replica",))
        self.load_failures = Counter("lora_cache_load_failures_reported", "failed loads workers reported")
        for kind in COMMAND_KINDS:
            from_zero(self.commands, {"kind": kind})
        for reason in ("stale_epoch", "error"):
            from_zero(self.rejected, {"reason": reason})
        for outcome in ("accepted", "ignored"):
            from_zero(self.hints, {"outcome": outcome})
        from_zero(self.load_failures, {})

    def plan(self, seconds: float, full: bool, kinds: Mapping[str, int]) -> None:
        """One planning pass and the commands it sent, by kind ("prefetch", "evict", "stage", "ranking")."""
        self.planner_s.observe(seconds, tags={"policy": self.policy, "scope": "full" if full else "dirty"})
        for kind, count in sorted(kinds.items()):
            self.commands.inc(count, tags={"kind": kind})

    def rejected_commands(self, stale: int, errors: int) -> None:
        if stale:
            self.rejected.inc(stale, tags={"reason": "stale_epoch"})
        if errors:
            self.rejected.inc(errors, tags={"reason": "error"})

    def hint_outcome(self, accepted: int, ignored: int) -> None:
        if accepted:
            self.hints.inc(accepted, tags={"outcome": "accepted"})
        if ignored:
            self.hints.inc(ignored, tags={"outcome": "ignored"})

    def queues(self, depths: Mapping[str, int]) -> None:
        for replica, depth in depths.items():
            self.queue_depth.set(depth, tags={"replica": replica})

    def ready_counts(self, counts: Mapping[str, int]) -> None:
        for replica, count in counts.items():
            self.ready.set(count, tags={"replica": replica})


# cache counter -> (metric, tags added); exported as increments since the last export
_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "gpu_hits": ("hits", {"tier": "gpu"}),
    "gpu_misses": ("misses", {"tier": "gpu"}),
    "host_hits": ("hits", {"tier": "host"}),
    "host_misses": ("misses", {"tier": "host"}),
    "disk_hits": ("hits", {"tier": "disk"}),  # an object-store adapter's copy found on this node's disk
    "disk_fetches": ("misses", {"tier": "disk"}),  # ... not found: a whole object fetched from the store
    "prefetch_used": ("prefetch_outcomes", {"outcome": "used"}),
    "prefetch_unused": ("prefetch_outcomes", {"outcome": "unused"}),
    "bytes_host_to_gpu": ("bytes", {"path": "host_to_gpu"}),
    "bytes_disk_to_host": ("bytes", {"path": "disk_to_host"}),
    "disk_fetched_bytes": ("bytes", {"path": "store_to_disk"}),
    "load_failures": ("load_failures", {}),
    "evictions": ("evictions", {}),
    # workers.counters.COLD_WAYS (the host tier's cold reads by way; tests/test_direct_reads.py holds them equal)
    **{f"cold_{way}": ("cold_reads", {"way": way}) for way in ("direct", "preadv", "ahead")},
}


class WorkerMetrics:
    """One TP rank's cache figures; ``start`` exports the counters every ``every_s`` seconds."""

    def __init__(self, replica: str, rank: int, stats: Callable[[], Mapping[str, object]],
                 every_s: float = 1.0) -> None:
        self.tags = {"replica": replica, "rank": str(rank)}
        self.stats, self.every_s = stats, every_s
        tier = (*RANK_TAGS, "tier")
        self.counters = {
            "hits": Counter("lora_cache_hits", "lookups that found the adapter in the tier", tag_keys=tier),
            "misses": Counter("lora_cache_misses", "lookups that did not", tag_keys=tier),
            "prefetch_outcomes": Counter("lora_cache_prefetches_retired",
                                         "prefetched adapters freed, by whether a batch used them first",
                                         tag_keys=(*RANK_TAGS, "outcome")),
            "bytes": Counter("lora_cache_moved_bytes", "bytes copied, by path", tag_keys=(*RANK_TAGS, "path")),
            "load_failures": Counter("lora_cache_load_failures", "loads that failed", tag_keys=RANK_TAGS),
            "evictions": Counter("lora_cache_evictions", "slots freed", tag_keys=RANK_TAGS),
            "cold_reads": Counter("lora_cache_cold_reads", "host-tier reads of local adapter files found out of the "
                                  "page cache, by the way each went (HostTierConfig.direct_reads, read_ahead)",
                                  tag_keys=(*RANK_TAGS, "way")),
        }
        self.accuracy = Gauge("lora_cache_prefetch_accuracy",
                              "prefetched adapters used before eviction / prefetched adapters freed",
                              tag_keys=RANK_TAGS)
        self.slots = Gauge("lora_cache_slots", "GPU slots by state", tag_keys=(*RANK_TAGS, "state"))
        self.host_used = Gauge("lora_cache_host_tier_used_bytes", "bytes of the pinned host tier holding shards",
                               tag_keys=RANK_TAGS)
        self.ready_s = Histogram("lora_cache_time_to_ready_seconds", "prefetch or miss to READY on this rank",
                                 boundaries=SECONDS_BUCKETS, tag_keys=(*RANK_TAGS, "source"))
        self.h2d_s = Histogram("lora_cache_h2d_copy_seconds", "the one host-to-GPU copy of a shard",
                               boundaries=SECONDS_BUCKETS, tag_keys=RANK_TAGS)
        for metric, extra in _COUNTERS.values():
            from_zero(self.counters[metric], {**self.tags, **extra})
        self._last: dict[str, int] = {}
        self._stop = threading.Event()
        self._loads: deque[tuple[float, float, bool]] = deque(maxlen=LOADS_KEPT)  # loaded, not yet observed

    def loaded(self, ready_ms: float, h2d_ms: float, host_hit: bool) -> None:
        """One load's figures (the records carry milliseconds; exported in seconds), observed at the next ``export``:
        this runs as the load becomes READY, and two of Ray's histogram observations took ~0.05-0.1 ms there (a device
        push's READY, issue 44 item 5)."""
        self._loads.append((ready_ms, h2d_ms, host_hit))

    def export(self) -> None:
        """Push the gauges, then the counters' increments since the last export. Gauges first: Ray's reporter may
        flush between two records, and a scrape that sees this export's counters must not see the gauges derived
        from the same figures (the prefetch accuracy) still absent or one export behind (CI 2026-11-30: the
        retirements counted, the accuracy gauge not yet there)."""
        while self._loads:
            ready_ms, h2d_ms, host_hit = self._loads.popleft()
            self.ready_s.observe(ready_ms / 1e3, tags={**self.tags, "source": "host" if host_hit else "disk"})
            self.h2d_s.observe(h2d_ms / 1e3, tags=self.tags)
        stats = self.stats()
        used, unused = int(stats.get("prefetch_used", 0)), int(stats.get("prefetch_unused", 0))  # type: ignore[call-overload]
        if used + unused:
            self.accuracy.set(used / (used + unused), tags=self.tags)
        for state in ("ready", "loading"):
            self.slots.set(int(stats.get(f"slots_{state}", 0)), tags={**self.tags, "state": state})  # type: ignore[call-overload]
        self.host_used.set(int(stats.get("host_bytes_used", 0)), tags=self.tags)  # type: ignore[call-overload]
        for name, (metric, extra) in _COUNTERS.items():
            value = int(stats.get(name, 0))  # type: ignore[call-overload]
            delta = value - self._last.get(name, 0)
            if delta > 0:
                self.counters[metric].inc(delta, tags={**self.tags, **extra})
            self._last[name] = value

    def start(self) -> None:
        threading.Thread(target=self._run, name="lora-metrics", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.export()
            except Exception:  # metrics never take a worker down
                continue

    def stop(self) -> None:
        self._stop.set()
