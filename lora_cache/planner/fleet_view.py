"""The planner's read side (lifecycle steps 1 and 8): what the fleet looks like now, read-only.

Routing advice (``lora_cache.routing.advice``) and the controller's queries read the fleet through this view,
never through the whole ``Planner``: a reader cannot change an input, and the planner keeps only what feeds
its plans. Each read names what it was asked about in its error (``UnknownReplicaError`` and the like).
"""

from __future__ import annotations

from lora_cache.planner.hints import HintBook
from lora_cache.planner.records import AdapterInfo, Capacity, Hint, QueueEntry, Residency
from lora_cache.planner.state import FleetState
from lora_cache.vocab import AdapterKey


class FleetView:
    """The planner's books, read-only: replicas and their workers, capacities, adapters, residency, queues, hints."""

    def __init__(self, fleet: FleetState, hints: HintBook) -> None:
        self._fleet, self._hints = fleet, hints

    def replicas(self) -> tuple[str, ...]:
        return tuple(sorted(self._fleet.workers))

    def workers(self, replica: str) -> tuple[str, ...]:
        return tuple(self._fleet.require_replica(replica, "workers"))

    def capacity(self, worker: str) -> Capacity:
        self._fleet.require_worker(worker, "capacity")
        return self._fleet.capacity[worker]

    def max_bytes(self) -> int:
        """The largest shard in the catalog, bytes per rank (0: no adapter)."""
        return self._fleet.max_bytes()

    def adapter(self, name: str) -> AdapterInfo:
        return self._fleet.require_adapter(name, "adapter")

    def device_only(self, key: AdapterKey) -> bool:
        """Whether ``key`` is a device push's version whose node copy has not landed: it can be made READY only
        where its trainer pushed it (``AdapterInfo.device_only``)."""
        return key in self._fleet.device_only

    def residency(self, worker: str) -> dict[AdapterKey, Residency]:
        """What the planner believes `worker` holds (its last report plus commands sent since)."""
        self._fleet.require_worker(worker, "residency")
        return dict(self._fleet.residency[worker])

    def holding(self, worker: str, key: AdapterKey, hosted: bool = True) -> tuple[Residency | None, bool]:
        """Routing's view of one adapter version on `worker`: its residency (None: not held) and whether its
        host tier holds the shard (one copy from a slot): a stage for a known request sent and still wanted (read
        at once, ahead of warm ones), or (``hosted``) a shard the worker reported there (a load's read, a stage, a
        warm stage). A warm stage counts only once reported: the worker reads those one at a time, when its
        store is idle."""
        fleet = self._fleet
        fleet.require_worker(worker, "holding")
        host = key in fleet.staged.get(worker, ()) or (hosted and key in fleet.hosted.get(worker, ()))
        return fleet.residency[worker].get(key), host

    def shard_bytes(self, replica: str, adapter: str) -> float:
        """Bytes of one rank's shard of `adapter` on `replica` (its bytes per rank at TP 1 over the replica's TP):
        the size the load clock times loads and reads by."""
        return self.adapter(adapter).bytes_per_rank / max(1, len(self.workers(replica)))

    def hosted(self, worker: str) -> frozenset[AdapterKey]:
        """The shards `worker`'s host tier holds, as it reported them."""
        self._fleet.require_worker(worker, "hosted")
        return self._fleet.hosted.get(worker, frozenset())

    def queue(self, replica: str) -> tuple[QueueEntry, ...]:
        self._fleet.require_replica(replica, "queue")
        return self._fleet.queues.get(replica, ())

    def hints(self, replica: str) -> tuple[Hint, ...]:
        self._fleet.require_replica(replica, "hints")
        return tuple(self._hints.for_replica(replica))
