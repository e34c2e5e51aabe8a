"""Questions only tests ask of a `Planner`: read from its books, not part of its API.

The controller, the routing advice and the simulator ask the planner what they need through its public
queries (`replicas`, `workers`, `residency`, `holding`, `queue`, `hints`, ...); these look further in,
to check what it decided and why.
"""

from __future__ import annotations

from lora_cache.planner import Planner, SlotState
from lora_cache.planner.homes import HomeBook
from lora_cache.planner.records import check_time
from lora_cache.vocab import AdapterKey

_LOADED = (SlotState.READY, SlotState.IN_USE)


def needed_adapters(planner: Planner, replica: str) -> tuple[str, ...]:
    """What the policy treats as needed soon at `replica` (never evicted there), most urgent first:
    the queue, then hints within the horizon (far hints are not needs: they only fill free room)."""
    planner._fleet.require_replica(replica, "needed_adapters")
    view = planner._replan.view(replica, planner._now)
    return view.queued + view.hinted


def dirty_replicas(planner: Planner) -> tuple[str, ...]:
    """The replicas `plan(now)` would replan."""
    return tuple(sorted(planner._replan.dirty))


def ready_replicas(planner: Planner, adapter: str) -> tuple[str, ...]:
    """Replicas where every rank holds the current version of `adapter`, loaded."""
    fleet = planner._fleet
    key = fleet.require_adapter(adapter, "ready_replicas").key
    candidates = {fleet.replica_of[w] for w in fleet.holders.get(adapter, ())}
    return tuple(sorted(r for r in candidates if _loaded_everywhere(planner, r, key)))


def popularity(planner: Planner, adapter: str, now: float, replica: str | None = None) -> float:
    """Decayed request count of `adapter` at `now`: fleet-wide, or at one replica."""
    check_time("now", now)
    planner._fleet.require_adapter(adapter, "popularity")
    if replica is not None:
        planner._fleet.require_replica(replica, "popularity")
    return planner._popularity.decayed(adapter, now, replica)


def _loaded_everywhere(planner: Planner, replica: str, key: AdapterKey) -> bool:
    workers = planner._fleet.workers[replica]
    return bool(workers) and all(
        (r := planner._fleet.residency[w].get(key)) is not None and r.state in _LOADED for w in workers)


def home_book(planner: Planner) -> HomeBook:
    """The fleet placement the planner keeps across plans (homes.py)."""
    return planner._replan.homes
