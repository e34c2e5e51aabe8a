"""The shared vocabulary of the control plane and the data plane: ids, commands, reports, actor names.

Both floors speak these words: the planner and the controller (``lora_cache/``) produce commands and read
reports; every TP rank (``workers/``) applies the commands and produces the reports. Plain Python, no
Ray, torch or gRPC, so a router, an attached engine process and the simulator can all import it.

- ids: ``AdapterKey`` (one version of one adapter), ``WorkerId`` (one TP rank of one replica), and the
  Ray actor names (``NAMESPACE``, ``CONTROLLER_NAME``, ``worker_name``);
- commands, controller -> rank (lifecycle step 4): ``Prefetch``, ``Evict``, ``Stage``; answered by
  ``ApplyResult``;
- reports, rank -> controller (step 7): ``ReadinessRecord`` inside a ``Delta``, sent numbered as
  ``DeltaRow``s;
- the relay of an attached rank: a ``Call`` down, an ``Answer`` up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from lora_cache.errors import ConfigError

# -- ids ----------------------------------------------------------------------------------------------


class AdapterKey(NamedTuple):
    """One version of one adapter: the key of the planner, the host tier and the slot table."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


class WorkerId(NamedTuple):
    """One TP rank of one replica."""

    replica: str
    rank: int

    def __str__(self) -> str:
        return f"{self.replica}/{self.rank}"


# The names by which the control plane finds its actors on a Ray cluster: the controller, and each TP
# rank's worker (a ``lora-cache serve`` worker actor or an attached rank's endpoint). A service's Ray
# namespace is its name (``serve --service``, ``NAMESPACE`` by default), so several services share a
# cluster, each with its own controller and workers under the same names; its placement groups, which
# Ray names cluster-wide, carry the service's name (``placement_group_name``).
NAMESPACE = "lora-cache"
SERVICE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # a service's name: its namespace, its groups' prefix


def check_service_name(service: str, option: str = "--service") -> None:
    """Refuse a name no service can have (``ConfigError``), naming ``option`` and the fix."""
    if not SERVICE_NAME.fullmatch(service):
        raise ConfigError(f"{option} {service!r} is not a service name: give 1-63 lowercase letters, digits and "
                          "dashes, starting with a letter or digit, e.g. lora-cache-llama")
CONTROLLER_NAME = "lora-cache-controller"
WORKER_PREFIX = "lora-cache-worker:"


def worker_name(worker: WorkerId) -> str:
    return f"{WORKER_PREFIX}{worker.replica}:{worker.rank}"


def placement_group_name(service: str, replica: str) -> str:
    return f"{service}:{replica}"


def parse_worker_name(name: str) -> WorkerId:
    replica, rank = name[len(WORKER_PREFIX):].rsplit(":", 1)
    return WorkerId(replica, int(rank))


# -- commands, controller -> rank (lifecycle step 4) ---------------------------------------------------
# Idempotent, tagged with the planner's epoch, so a worker can drop commands from an older controller
# (invariants 6 and 7). A worker applies its evicts before its prefetches, loads prefetches in priority
# order (0 first), and stages last (a ranking, if any, after them). Every rank of a replica is planned from
# the same target, so one adapter has the same priority on every rank; each rank loads only its own shard.


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Load `adapter@version` into a slot of this worker; lower `priority` first."""

    adapter: str
    version: str
    priority: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Evict:
    """Free the slot that holds `adapter@version` (never one in use: the planner checks)."""

    adapter: str
    version: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Stage:
    """Read `adapter@version`'s shard into this worker's pinned host tier, with no GPU slot (step 5 alone).

    For a needed (queued or hinted) adapter that found no GPU room: when a slot frees, its load is one
    host-to-GPU copy instead of a disk read and a copy. A staged shard is an ordinary host-tier entry
    (LRU, evictable), so a stage never changes what the planner counts as resident."""

    adapter: str
    version: str
    priority: int
    epoch: int
    speculative: bool = False  # a warm stage (planner/warming.py): read only while no load is in flight
    disk: bool = False  # a disk warm stage (speculative): fetch a store adapter's object into the node's disk tier only


@dataclass(frozen=True, slots=True)
class Ranking:
    """The fleet's adapters by how often they are asked for, most first (the planner's decayed fleet-wide counts), as
    many as this worker's host tier can use; it replaces the last one. Under the host tier's ``popular`` eviction the
    idle shard of the adapter ranked lowest, or not ranked, goes first (workers/staging/eviction.py); other orders
    ignore it. Nothing is loaded or freed, so it has no delta."""

    names: tuple[str, ...]
    epoch: int


Command = Prefetch | Evict | Stage | Ranking


class ApplyResult(NamedTuple):
    """A rank's answer to one batch of commands."""

    accepted: int
    rejected_stale: int  # from an older controller epoch
    errors: tuple[str, ...]  # commands that named something this worker cannot load, with why


# -- reports, rank -> controller (lifecycle step 7) -----------------------------------------------------


class ReadinessRecord(NamedTuple):
    """What a worker reports to the controller when a shard became READY (lifecycle step 7)."""

    adapter: str
    version: str
    tp_rank: int
    slot: int
    disk_ms: float  # disk -> pinned host staging (0 on a host-tier hit)
    h2d_ms: float  # the host -> GPU copies, by events: the first chunk's start to the last one's end
    ready_ms: float  # from the request to load until READY
    nbytes: int
    host_hit: bool
    after_write_back: bool = False  # its copies followed a write-back of the slot's last shard (exclusive tiers)
    read_way: str = ""  # a host-tier miss's read of a local file found cold: direct | preadv | ahead (``HostTierConfig
    # .direct_reads`` / ``read_ahead``, ``workers.staging.read_ways``); "" for a hit, a warm file, a store object


class Delta(NamedTuple):
    """A change of this worker's residency, pushed to the controller (step 7)."""

    adapter: str
    version: str
    state: str  # "loading" (a slot was taken) | "ready" | "gone" (slot freed) | "failed" (no slot) | "in_use";
    # "no_room" (a prefetch found every slot held by running batches: not there, not a failure);
    # the host tier's: "staged" (a whole shard read in) | "unstaged" (dropped by its LRU);
    # the GPU pool's: "capacity" (it lent or took back pages: ``capacity_delta``; no adapter)
    record: ReadinessRecord | None = None
    error: str = ""
    acquired: bool = False  # "loading"/"ready": the rank's own load (its engine's acquire that missed, an arrival's
    # early load, a direct prefetch call), not a controller's command


def capacity_delta(gpu_bytes: int, page_bytes: int) -> Delta:
    """A rank's GPU pool now holds ``gpu_bytes`` for adapters in pages of ``page_bytes`` (issue 43 item 3: a pool
    that lends pages to its engine and takes them back). No adapter; the two figures ride in ``version``, so that
    the delta keeps its place in the rank's numbered stream after the evictions the lending made."""
    return Delta("", f"{gpu_bytes}:{page_bytes}", "capacity")


def capacity_of(delta_version: str) -> tuple[int, int]:
    """(gpu_bytes, page_bytes) of a "capacity" delta's ``version`` (``capacity_delta``); ValueError if malformed."""
    gpu, _, page = delta_version.partition(":")
    gpu_bytes, page_bytes = int(gpu), int(page)
    if gpu_bytes < 0 or page_bytes <= 0:
        raise ValueError(f"capacity {delta_version!r}: give gpu_bytes >= 0 and page_bytes > 0 as 'GPU:PAGE'")
    return gpu_bytes, page_bytes


# (seq, adapter, version, state, error[, read_s[, acquired]]): a Delta as sent, numbered; read_s (READY only): the
# seconds the load read its shard from storage (0: a host-tier hit; absent from older senders); acquired: the rank
# started the load itself, not a command (the controller believes a READY only of a load it commanded or one so
# marked: lora_cache/controller/claims.py; absent from older senders: False)
DeltaRow = (tuple[int, str, str, str, str] | tuple[int, str, str, str, str, float]
            | tuple[int, str, str, str, str, float, bool])


def delta_row(seq: int, delta: Delta) -> tuple[int, str, str, str, str, float, bool]:
    """``delta`` as sent, numbered ``seq`` (``workers/control/outbox.py``)."""
    read_s = delta.record.disk_ms / 1e3 if delta.record is not None else 0.0  # READY: its store read
    return (seq, delta.adapter, delta.version, delta.state, delta.error, read_s, delta.acquired)

# -- the relay of an attached rank (workers/attach/attachment.py) ---------------------------------------------------
Call = tuple[int, str, tuple[Any, ...]]  # (call id, method, arguments)
Answer = tuple[int, bool, Any]  # (call id, ok, result or the exception raised)
