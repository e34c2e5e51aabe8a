"""What the planner is told: catalog entries, replicas, queues, hints and residency reports.

Specs (`AdapterInfo`, `ReplicaSpec`, `Hint`) validate their own values; whether the names they carry
exist is checked by the planner, which knows the fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from lora_cache.planner.errors import PlannerInputError
from lora_cache.vocab import AdapterKey


class Capacity(NamedTuple):
    """What one worker may hold: a number of slots and, if set, a byte budget for all of them; and the
    bytes of its pinned host tier as the worker reports them (None: unknown, nothing is staged ahead).
    ``page_bytes``: the GPU pool's page (issue 43: a shard takes whole pages, so its bytes count rounded up to
    them; None: no pages, a shard counts its own bytes)."""

    slots: int
    bytes: int | None = None
    host_bytes: int | None = None
    page_bytes: int | None = None
    disk_bytes: int | None = None  # this rank's part of its node's disk tier (store adapters' objects; None: none)

    def gpu_bytes(self, size: int) -> int:
        """The GPU bytes a shard of ``size`` bytes takes here: whole pages, if the pool has them."""
        page = self.page_bytes
        return size if not page else -(-size // page) * page


class SlotState(Enum):
    LOADING = "loading"
    READY = "ready"
    IN_USE = "in_use"


class Residency(NamedTuple):
    """The state of one adapter version on one worker, as the worker last reported it."""

    state: SlotState
    refcount: int = 0

    @property
    def pinned(self) -> bool:
        """A batch may be using it: never evicted."""
        return self.state is SlotState.IN_USE or self.refcount > 0


class ResidencyEntry(NamedTuple):
    """One line of a worker's residency report."""

    adapter: str
    version: str
    state: SlotState
    refcount: int = 0


class QueueEntry(NamedTuple):
    """A waiting request of a replica: its adapter and when it arrived (identifies new arrivals); ``version``: the
    one version it names (``A@VERSION``, issue 44 item 3), or "" for the version the replica serves."""

    adapter: str
    arrival_s: float
    version: str = ""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """The catalog as the planner needs it: every TP rank's shard of `name` takes `bytes_per_rank`."""

    name: str
    version: str
    bytes_per_rank: int
    object_bytes: int = 0  # an adapter from an object store: its object's bytes (a disk tier holds it whole); else 0
    # a device push's version before its node copy (lora_cache/adapters/device_source.py): loaded by its push only,
    # never by a command; kept where it is held until it lands
    device_only: bool = False
    key: AdapterKey = field(init=False, repr=False, compare=False)  # (name, version), made once

    def __post_init__(self) -> None:
        check_id("adapter name", self.name)
        check_id(f"version of adapter {self.name!r}", self.version)
        if not _is_int(self.bytes_per_rank) or self.bytes_per_rank < 1:
            raise PlannerInputError(f"bytes_per_rank of adapter {self.name!r} is {self.bytes_per_rank!r}; "
                                    "give the size in bytes of one rank's shard (an int >= 1)")
        if not _is_int(self.object_bytes) or self.object_bytes < 0:
            raise PlannerInputError(f"object_bytes of adapter {self.name!r} is {self.object_bytes!r}; give the bytes "
                                    "of its object in a store (an int >= 1), or 0 for an adapter of local files")
        object.__setattr__(self, "key", AdapterKey(self.name, self.version))


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """A replica: its TP workers in rank order and what each may hold."""

    replica_id: str
    worker_ids: tuple[str, ...]
    slots_per_worker: int
    bytes_per_worker: int | None = None
    host_bytes_per_worker: int | None = None  # each rank's host tier (predictive staging's bound)
    disk_bytes_per_worker: int | None = None  # each rank's part of its node's disk tier (disk warming's bound)

    def __post_init__(self) -> None:
        check_id("replica id", self.replica_id)
        if not isinstance(self.worker_ids, tuple) or not self.worker_ids:
            raise PlannerInputError(f"replica {self.replica_id!r} has worker_ids {self.worker_ids!r}; "
                                    "give a non-empty tuple of worker ids in rank order")
        for worker in self.worker_ids:
            check_id(f"worker id of replica {self.replica_id!r}", worker)
        if len(set(self.worker_ids)) != len(self.worker_ids):
            raise PlannerInputError(f"replica {self.replica_id!r} lists a worker twice in "
                                    f"{self.worker_ids!r}; each TP rank is a distinct worker")
        check_capacity(f"replica {self.replica_id!r}", self.capacity)

    @property
    def capacity(self) -> Capacity:
        return Capacity(self.slots_per_worker, self.bytes_per_worker, self.host_bytes_per_worker,
                        disk_bytes=self.disk_bytes_per_worker)


@dataclass(frozen=True, slots=True)
class Hint:
    """A router's forecast: a request for `adapter` is heading to `replica`, expected at `expected_s`.

    `hint_id` makes hints idempotent: a second hint with a known id (active, fulfilled or cancelled)
    is ignored, whatever it says.
    """

    hint_id: str
    adapter: str
    replica: str
    expected_s: float
    version: str = ""  # the one version its request names (issue 44 item 3); "": the version the replica serves

    def __post_init__(self) -> None:
        check_id("hint id", self.hint_id)
        check_id(f"adapter of hint {self.hint_id!r}", self.adapter)
        check_id(f"replica of hint {self.hint_id!r}", self.replica)
        check_time(f"expected_s of hint {self.hint_id!r}", self.expected_s)
        if self.version:
            check_id(f"version of hint {self.hint_id!r}", self.version)


def check_id(what: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise PlannerInputError(f"{what} is {value!r}; give a non-empty string")


def check_time(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlannerInputError(f"{what} is {value!r}; give a finite time in seconds "
                                "(the controller's clock)")


def check_capacity(what: str, capacity: Capacity) -> None:
    slots, budget, host, page, disk = capacity
    if not _is_int(slots) or slots < 0:
        raise PlannerInputError(f"slots of {what} is {slots!r}; "
                                "give the number of adapter slots (an int >= 0)")
    if budget is not None and (not _is_int(budget) or budget < 0):
        raise PlannerInputError(f"bytes of {what} is {budget!r}; give a byte budget (an int >= 0) "
                                "or None to count slots only")
    if host is not None and (not _is_int(host) or host < 0):
        raise PlannerInputError(f"host_bytes of {what} is {host!r}; give the bytes of the worker's host tier "
                                "(an int >= 0) or None if unknown (no predictive staging)")
    if page is not None and (not _is_int(page) or page < 1):
        raise PlannerInputError(f"page_bytes of {what} is {page!r}; give the bytes of a page of the GPU pool "
                                "(an int >= 1) or None if the pool has no pages")
    if disk is not None and (not _is_int(disk) or disk < 0):
        raise PlannerInputError(f"disk_bytes of {what} is {disk!r}; give the bytes of the worker's part of its "
                                "node's disk tier (an int >= 0) or None if it has none (no disk warming)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
