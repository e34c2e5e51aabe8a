"""The planner state that a controller restart must not lose: active hints, queue reports, popularity.

Residency is not here: a restarted controller rebuilds it from the workers' own reports (invariant 6).
`export_state` turns the three into plain data (JSON-ready); `restore_state` merges such data into a
planner that already knows the catalog and the replicas, skipping what names an adapter or a replica
that is gone, and counting nothing twice: restored queue entries are not new arrivals, and restored
hints are not new requests. Times are the controller's clock (wall seconds), so they survive a restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from lora_cache.planner.hints import HintBook
from lora_cache.planner.horizon import Horizon
from lora_cache.planner.popularity import Popularity, RankedCounts
from lora_cache.planner.records import AdapterInfo, Hint, QueueEntry

FORMAT = 1


class Restored(NamedTuple):
    """What a restore took, and what it skipped (unknown names, stale hints, known hint ids)."""

    hints: int
    queues: int
    counts: int
    skipped: int
    replicas: frozenset[str]  # replicas whose plan inputs changed


def export_state(hints: HintBook, queues: Mapping[str, tuple[QueueEntry, ...]], popularity: Popularity,
                 max_counts: int) -> dict[str, Any]:
    """Plain data; popularity keeps the `max_counts` largest counts per counter (the rest are the least
    popular, whose loss costs the least)."""
    return {
        "format": FORMAT,
        "hints": [[h.hint_id, h.adapter, h.replica, h.expected_s, *([h.version] if h.version else [])]
                  for h in hints.active.values()],
        "queues": {r: [[e.adapter, e.arrival_s, *([e.version] if e.version else [])] for e in q]
                   for r, q in queues.items()},
        "popularity": {
            "landmark_s": popularity.landmark_s,
            "fleet": _top(popularity.fleet, max_counts),
            "local": {r: _top(c, max_counts) for r, c in popularity.local.items()},
        },
    }


def restore_state(state: Mapping[str, Any], now: float, hints: HintBook, horizon: Horizon,
                  queues: dict[str, tuple[QueueEntry, ...]], popularity: Popularity,
                  catalog: Mapping[str, AdapterInfo], replicas: Mapping[str, object]) -> Restored:
    """Merge exported `state` in. Malformed data raises ValueError (the caller starts without it)."""
    if state.get("format") != FORMAT:
        raise ValueError(f"controller state has format {state.get('format')!r}, this controller reads {FORMAT}")
    skipped, touched = 0, set()
    taken_hints = 0
    for hint_id, adapter, replica, expected_s, *version in state["hints"]:  # a named version's, since issue 44
        hint = Hint(str(hint_id), str(adapter), str(replica), float(expected_s), str(version[0]) if version else "")
        if adapter in catalog and replica in replicas and hints.add(hint, now):
            horizon.watch(hint, now, hints.active)
            taken_hints += 1
            touched.add(replica)
        else:
            skipped += 1
    taken_queues = 0
    for replica, entries in state["queues"].items():
        queue = tuple(QueueEntry(str(a), float(t), str(v[0]) if v else "") for a, t, *v in entries if a in catalog)
        skipped += len(entries) - len(queue)
        if replica in replicas and queue and replica not in queues:  # a fresher report wins
            queues[replica] = queue
            taken_queues += 1
            touched.add(replica)
    counts, dropped = _merge_popularity(state["popularity"], popularity, catalog, replicas)
    return Restored(taken_hints, taken_queues, counts, skipped + dropped, frozenset(touched))


def _merge_popularity(saved: Mapping[str, Any], popularity: Popularity, catalog: Mapping[str, AdapterInfo],
                      replicas: Mapping[str, object]) -> tuple[int, int]:
    landmark = saved["landmark_s"]
    if landmark is None:
        return 0, 0
    popularity.restore_landmark(float(landmark))
    exponent = popularity.clock.exponent(float(landmark))
    taken = dropped = 0
    counters: list[tuple[str | None, Mapping[str, float]]] = [(None, saved["fleet"])]
    counters += sorted(saved["local"].items())
    for replica, values in counters:
        if replica is not None and replica not in replicas:
            dropped += len(values)
            continue
        for adapter, scaled in sorted(values.items()):
            amount = float(scaled) * 2.0 ** exponent  # rescaled to this planner's landmark
            unknown = adapter not in catalog or (replica is not None and adapter not in popularity.fleet.values)
            if unknown or not math.isfinite(amount) or amount <= 0.0:
                dropped += 1
                continue
            _counter(popularity, replica).add(adapter, amount)
            taken += 1
    return taken, dropped


def _counter(popularity: Popularity, replica: str | None) -> RankedCounts:
    if replica is None:
        return popularity.fleet
    local = popularity.local.get(replica)
    if local is None:
        local = popularity.local[replica] = RankedCounts(popularity.max_tracked_per_replica)
    return local


def _top(counts: RankedCounts, limit: int) -> dict[str, float]:
    return {key: -neg for neg, key in counts.order[:limit]}
