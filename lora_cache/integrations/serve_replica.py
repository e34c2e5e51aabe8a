"""Ray Serve, the replica side (lifecycle steps 4-9): a Serve replica's TP ranks attached as one lora-cache replica.

A split of ``ray_serve.py`` (the router, and the public names) along its seam: the router runs in Serve's
proxies and handles and never attaches; this side runs in the replicas and only attaches. ``CacheReplica``
attaches rank 0 in the replica's process and ranks 1.. in ``RankActor``s, all as ranks of the lora-cache replica
``replica_name(replica_id)`` (the one name both sides use); ``lease()`` holds one exact version on every rank,
``ensure_ready`` loads a miss before an engine that batches takes the request. Import the names from
``lora_cache.integrations.ray_serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.request_router import ReplicaID

from lora_cache.adapters.refs import split_ref, version_of
from lora_cache.errors import ConfigError, NotFoundError
from lora_cache.vocab import AdapterKey

if TYPE_CHECKING:
    from workers.attach.attachment import Attachment, WorkerConfig

log = logging.getLogger("lora_cache.integrations.ray_serve")  # the integration's one logger, as before the split

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def replica_name(replica_id: ReplicaID) -> str:
    """The lora-cache replica a Serve replica attaches as (and the router's name for it)."""
    return _UNSAFE.sub("-", f"serve-{replica_id.deployment_id.name}-{replica_id.unique_id}")


# -- the replica side ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaCacheConfig:
    """How a Serve replica's ranks attach (``AttachConfig``'s link fields, ``WorkerConfig``'s cache fields)."""

    tp: int = field(
        default=1,
        metadata={
            "help": "TP ranks of the replica (rank 0 in the replica's process, the others in actors of their own)"
        },
    )
    num_slots: int = field(default=8, metadata={"help": "adapter slots per rank"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda (rank k on its actor's GPU)"})
    dtype: str = field(default="float32", metadata={"help": "slot dtype (bfloat16 on GPUs)"})
    max_batch: int = field(default=64, metadata={"help": "most adapters one acquire holds"})
    address: str = field(default="auto", metadata={"help": "the Ray cluster of the controller"})
    gateway: str = field(default="", metadata={"help": "attach through the gateway instead (host:port)"})
    token_file: str = field(default="", metadata={"help": "the gateway's bearer token file"})
    tls_ca: str = field(default="", metadata={"help": "PEM file of the CA that signed the gateway's certificate "
                                                      "(set: attach over TLS)"})
    tls_client_cert: str = field(default="", metadata={"help": "PEM certificate the ranks present to a gateway with "
                                                               "--tls-client-ca (with tls_ca)"})
    tls_client_key: str = field(default="", metadata={"help": "PEM private key of tls_client_cert"})
    acquire_timeout_s: float = field(
        default=30.0,
        metadata={"help": "longest wait for the ranks to agree on a version (a re-registration on its way)"},
    )
    slot_wait_s: float = field(
        default=30.0,
        metadata={"help": "a request whose adapter finds every slot held by other requests waits this long for one "
                          "to be let go (its turn), then fails with SlotsBusyError; 0: fails at once"},
    )
    worker: dict[str, Any] = field(default_factory=dict, metadata={"help": "more WorkerConfig fields"})

    def __post_init__(self) -> None:
        if self.tp < 1 or self.num_slots < 1:
            raise ConfigError(f"tp ({self.tp}) and num_slots ({self.num_slots}) must be >= 1")
        if self.acquire_timeout_s <= 0:
            raise ConfigError(f"acquire_timeout_s is {self.acquire_timeout_s}; give a positive number of seconds")
        if not 0 <= self.slot_wait_s <= 3600:
            raise ConfigError(f"slot_wait_s is {self.slot_wait_s}; give 0..3600 seconds (0: a request finding every "
                              "slot held fails at once)")

    def worker_config(self, rank: int) -> WorkerConfig:
        from workers.attach.attachment import WorkerConfig

        device = self.device if self.device == "cpu" else "cuda:0"  # each rank's process sees its own GPU
        return WorkerConfig(
            tp=self.tp,
            tp_rank=rank,
            num_slots=self.num_slots,
            device=device,
            dtype=self.dtype,
            max_batch=self.max_batch,
            **self.worker,
        )

    def attach_config(self, replica: str) -> Any:
        from workers.attach.attachment import AttachConfig

        return AttachConfig(replica=replica, address=self.address, gateway=self.gateway, token_file=self.token_file,
                            tls_ca=self.tls_ca, tls_client_cert=self.tls_client_cert,
                            tls_client_key=self.tls_client_key)


def _attach(config: ReplicaCacheConfig, replica: str, rank: int) -> Attachment:
    from workers.attach.attachment import attach

    return attach(config.attach_config(replica), config.worker_config(rank))


@ray.remote(num_cpus=0)
class RankActor:
    """TP rank ``k >= 1`` of a Serve replica: its attached cache, acquired and released by rank 0's leases."""

    def __init__(self, config: ReplicaCacheConfig, replica: str, rank: int) -> None:
        self.rank = _attach(config, replica, rank)
        self.slot_wait_s = config.slot_wait_s
        self.leases: dict[str, Any] = {}  # lease id -> this rank's batch, until released
        self.calls: Counter[str] = Counter()  # rank 0's calls here, by method (``counts``)

    def rows(self, names: list[str]) -> Any:
        self.calls["rows"] += 1
        return self.rank.version_rows(names)

    def acquire(self, lease: str, key: AdapterKey, slot_wait_s: float | None = None) -> int:
        """Hold exactly ``key`` for ``lease``; ``slot_wait_s``: what is left of the lease's wait for a slot (rank 0
        waited first), default the whole ``ReplicaCacheConfig.slot_wait_s``."""
        self.calls["acquire"] += 1
        batch = self.rank.acquire([key], slot_wait_s=self.slot_wait_s if slot_wait_s is None else slot_wait_s)
        self.leases[lease] = batch
        return int(batch.slots[0])

    def hold(self, lease: str, key: AdapterKey, slot_wait_s: float | None = None) -> int:
        """``acquire`` exactly ``key``, or -1 (nothing held) when this rank does not know that version (yet)."""
        self.calls["hold"] += 1
        catalog = self.rank.catalog
        if key.name not in catalog or key.version not in catalog.versions(key.name):
            return -1
        return self.acquire(lease, key, slot_wait_s)

    def prefetch(self, name: str, version: str | None = None) -> None:
        """``name``'s current version (or exactly ``version``) READY here (loaded if not); blocks until it is (a
        failed load raises)."""
        self.rank.prefetch(name, version).result()

    def counts(self) -> dict[str, int]:
        """Calls taken, by method: a request's lease costs one (``hold``) where the ranks know its version."""
        return dict(self.calls)

    def release(self, lease: str) -> None:
        self.calls["release"] += 1
        batch = self.leases.pop(lease, None)
        if batch is not None:
            self.rank.release(batch)

    def detach(self) -> None:
        self.rank.detach()


@dataclass
class Lease:
    """One request's hold on its adapter: ``key`` (one exact version), and its slot on every rank."""

    ident: str
    key: AdapterKey
    slots: list[int]  # per rank
    batch: Any  # rank 0's Batch (``batch.slot_index`` for rank 0's kernels)


class CacheReplica:
    """The replica side of a ``@serve.deployment``: build it in ``__init__``; ``lease()`` per request."""

    def __init__(self, config: ReplicaCacheConfig | None = None, replica: str | None = None) -> None:
        self.config = config or ReplicaCacheConfig()
        self.name = replica or replica_name(serve.get_replica_context().replica_id)
        self.rank = _attach(self.config, self.name, 0)  # rank 0, in this process: the engine's own
        gpus = 1 if self.config.device != "cpu" else 0
        self.ranks = [
            RankActor.options(num_gpus=gpus).remote(self.config, self.name, k)  # type: ignore[attr-defined]
            for k in range(1, self.config.tp)
        ]
        ray.get([r.rows.remote([]) for r in self.ranks])  # every rank attached before the replica serves
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[str, float]] = {}  # requests waiting for their adapter (the queue report)
        self._lock = threading.Lock()  # protects _waiting

    # -- per request ----------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lease(self, adapter: str | None = None) -> AsyncIterator[Lease]:
        """Hold ``adapter`` (default: the request's multiplexed model id) at one version on every rank for the
        request; released when the block ends."""
        name = adapter or serve.get_multiplexed_model_id()
        held = await asyncio.to_thread(self.acquire, name)
        try:
            yield held
        finally:
            await asyncio.to_thread(self.release, held)

    @contextlib.contextmanager
    def lease_sync(self, adapter: str) -> Iterator[Lease]:
        held = self.acquire(adapter)
        try:
            yield held
        finally:
            self.release(held)

    def acquire(self, adapter: str) -> Lease:
        """Agree on one version of ``adapter`` over the ranks and hold exactly it on each (a miss loads it;
        blocking: from a thread). Raises ``NotFoundError`` for an adapter the controller never registered.

        One round trip to the other ranks: rank 0 picks the version (its newest READY, else its current one) and
        every other rank holds exactly that one; only where a rank does not know it (a re-registration on its way)
        do the ranks exchange their versions first (``_agree``). Either way every rank holds one exact version.

        ``adapter`` may name one version, ``NAME@VERSION`` or ``NAME@TAG`` (the tag a trainer pushed it under:
        ``lora_cache.adapters.refs``): every rank holds exactly that one, loaded where it is not; a version no longer
        kept is ``NotFoundError`` naming those that are."""
        if not adapter:
            raise NotFoundError(
                "the request names no adapter: send it with "
                "handle.options(multiplexed_model_id=...) or the serve_multiplexed_model_id header"
            )
        name, ref = split_ref(adapter)
        ident = f"{self.name}-{next(self._ids)}"
        self._queue(+1, ident, name)
        try:
            if ref is not None:
                return self._hold_named(ident, name, ref)
            held = self._hold(ident, self._agree(adapter, ranks=False))
            if held is None:
                held = self._hold(ident, self._agree(adapter), exact=True)
            assert held is not None  # exact: every rank acquires the agreed version (or raises)
            return held
        finally:
            self._queue(-1, ident, name)

    def _hold_named(self, ident: str, name: str, ref: str) -> Lease:
        """Exactly the version ``ref`` stands for on every rank; a rank that does not know it yet (its registration
        on its way) is asked again until ``acquire_timeout_s``."""
        if name not in self.rank.catalog:  # on demand under an adapter root, or the controller's typed refusal
            self.rank.resolve(name, self.config.acquire_timeout_s)
        key = AdapterKey(name, version_of(self.rank.catalog, name, ref))
        deadline = time.monotonic() + self.config.acquire_timeout_s
        while (held := self._hold(ident, key)) is None:
            if time.monotonic() > deadline:
                raise NotFoundError(f"the {self.config.tp} ranks of {self.name} do not all know {key} after "
                                    f"{self.config.acquire_timeout_s} s (a registration that did not reach every "
                                    "rank, or a version retired there); check `lora-cache status`")
            time.sleep(0.01)  # a registration on its way to the other ranks: poll its arrival
        return held

    def _hold(self, ident: str, key: AdapterKey, exact: bool = False) -> Lease | None:
        """``key`` held on every rank, or None (nothing held) when a rank does not know it and not ``exact``."""
        deadline = time.monotonic() + self.config.slot_wait_s  # the lease's one wait for a slot, over every rank
        batch = self.rank.acquire([key], slot_wait_s=self.config.slot_wait_s)  # a turn, not a failure, if all held
        try:
            left = max(0.0, deadline - time.monotonic())  # what rank 0's wait left to the others (waiting at once)
            ask = [(r.acquire if exact else r.hold).remote(ident, key, left) for r in self.ranks]
            slots = [int(batch.slots[0]), *ray.get(ask)]
        except BaseException:
            self._let_go(ident, batch)
            raise
        if min(slots) < 0:  # a rank lacks that version: let go everywhere, then agree over the ranks
            self._let_go(ident, batch)
            return None
        return Lease(ident, key, slots, batch)

    def _let_go(self, ident: str, batch: Any) -> None:
        """Release a lease not handed out, on every rank, and wait for it (the next try acquires again)."""
        self.rank.release(batch)
        ray.get([r.release.remote(ident) for r in self.ranks])

    def release(self, lease: Lease) -> None:
        """After the request's kernels are enqueued (on every rank). The other ranks' releases are not waited for:
        a rank actor runs its calls from this process in order, so no later acquire there overtakes one."""
        self.rank.release(lease.batch)
        for r in self.ranks:
            r.release.remote(lease.ident)

    async def ensure_ready(self, adapter: str | None = None) -> bool:
        """Wait, off the event loop, until ``adapter`` (default: the request's multiplexed model id) is READY on
        every rank, loading it where it is not, without holding it: for an engine that acquires in its own steps
        (the reference engine), so that a miss loads beside its steps rather than inside one, stalling the other
        requests of the batch (what ``@serve.multiplexed``'s load-on-miss gives). Nothing is asked of the other
        ranks when rank 0 has it READY (the controller plans the ranks of a replica alike; the engine's own
        version exchange settles the rest). Returns whether it was READY on rank 0 on arrival. A load that fails
        here is left to the engine's own acquire (which loads on a miss, or fails the request with why)."""
        name, ref = split_ref(adapter or serve.get_multiplexed_model_id())
        version = None if ref is None else version_of(self.rank.catalog, name, ref)  # NAME@REF: exactly that one
        if (name in self.rank.ready_names() if version is None
                else AdapterKey(name, version) in self.rank.ready_keys()):
            return True
        waits: list[Any] = [
            asyncio.wrap_future(self.rank.prefetch(name, version)),
            *(r.prefetch.remote(name, version) for r in self.ranks),
        ]
        for outcome in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.info(
                    "%s: loading %s ahead of the engine failed (%s); the engine loads it", self.name, name, outcome
                )
        return False

    def _agree(self, adapter: str, ranks: bool = True) -> AdapterKey:
        """The version every rank holds for this request: READY on every rank if one is, else the current one
        (``ranks`` False: over rank 0 alone, no round trip: its newest READY, else its current one)."""
        deadline = time.monotonic() + self.config.acquire_timeout_s
        while True:
            if adapter not in self.rank.catalog:  # registered on demand if it lies under an adapter root, else
                # the controller's typed refusal: NotFoundError (under no root), CapacityError, ResolveTimeoutError
                self.rank.resolve(adapter, max(0.1, deadline - time.monotonic()))
            rows = [self.rank.version_rows([adapter])]
            if ranks:
                rows += ray.get([r.rows.remote([adapter]) for r in self.ranks])
            key = self.rank.agree(rows, [adapter])[adapter]
            if key is not None:
                return key
            if time.monotonic() > deadline:
                raise NotFoundError(
                    f"the {self.config.tp} ranks of {self.name} did not agree on a version of "
                    f"{adapter!r} within {self.config.acquire_timeout_s} s (a re-registration that "
                    "did not reach every rank); check `lora-cache status`"
                )
            time.sleep(0.01)  # a registration on its way to the other ranks: poll its arrival

    def _queue(self, step: int, ident: str, adapter: str) -> None:
        """The replica's waiting requests' adapters, in arrival order, to the controller (never blocks)."""
        with self._lock:
            key = hash(ident)
            if step > 0:
                self._waiting[key] = (adapter, time.time())
            else:
                self._waiting.pop(key, None)
            entries = sorted(self._waiting.values(), key=lambda e: e[1])
        self.rank.report_queue(entries)

    def ready(self) -> set[str]:
        """Adapters READY on rank 0."""
        return self.rank.ready_names()

    def shutdown(self) -> None:
        """Detach every rank (the controller drops what they held). Idempotent."""
        with contextlib.suppress(Exception):
            ray.get([r.detach.remote() for r in self.ranks], timeout=30)
        self.rank.detach()
