"""Controller state that survives a controller restart: hints, queue reports, popularity (issue 19), and the
catalog (issue 29, ``catalog_store.py``).

Residency is rebuilt from the workers' reports (invariant 6); what only the controller knew is kept in
Ray's GCS key-value store (``ray.experimental.internal_kv``, what Ray itself keeps its own metadata in):
the health loop takes a bounded snapshot at most every ``period_s``, and only when it changed, and the
write runs on a thread, off the event loop that serves hints. A restarted controller restores it after
the rebuild and before its first plan. What happened in the last period before a crash is lost: routers
re-send hints and engines re-report queues, and a lost hint costs latency, never correctness
(invariant 7).

``Snapshots`` is the plain core (encoding, the bound, the throttle); ``KvStore`` is the thin Ray shell;
``DurableState`` joins them for the actor: ``restore`` once on start, ``persist`` from the health loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lora_cache.controller import catalog_store
from lora_cache.controller.catalog_copy import CatalogCopy, check_location
from lora_cache.controller.catalog_store import CatalogSnapshots
from lora_cache.controller.core import ControllerCore
from lora_cache.errors import ConfigError
from lora_cache.planner import Planner

if TYPE_CHECKING:
    from lora_cache.controller.request_ids import RequestIds

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DurableConfig:
    """How the controller keeps its state across restarts."""

    period_s: float = field(default=1.0, metadata={"help": "at most one state snapshot per this many seconds"})
    max_bytes: int = field(default=4 << 20, metadata={"help": "bound of one snapshot; popularity is cut to fit"})
    max_counts: int = field(default=4096, metadata={"help": "popularity counts kept per counter in a snapshot"})
    key: str = field(default="controller-state/v1", metadata={"help": "key in Ray's GCS key-value store"})
    catalog_key: str = field(default="controller-catalog/v1", metadata={
        "help": "key of the catalog's snapshot (names, paths, versions) in Ray's GCS key-value store"})
    catalog_copy: str = field(default="", metadata={
        "help": "also keep the catalog's snapshot here, off the cluster: an absolute directory or s3://BUCKET/PREFIX; "
                "a controller finding none in the GCS (a new cluster, the head lost) restores it (catalog_copy.py)"})

    def __post_init__(self) -> None:
        if isinstance(self.period_s, bool) or not isinstance(self.period_s, int | float) \
                or not math.isfinite(self.period_s) or self.period_s <= 0:
            raise ConfigError(f"period_s is {self.period_s!r}; give a positive number of seconds, e.g. 1.0")
        for name, least in (("max_bytes", 1024), ("max_counts", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} is {value!r}; give an int >= {least}")
        if not self.key:
            raise ConfigError("key is empty; give the GCS key of the snapshot, e.g. 'controller-state/v1'")
        if self.catalog_copy:
            check_location(self.catalog_copy)
        if not self.catalog_key or self.catalog_key == self.key:
            raise ConfigError(f"catalog_key is {self.catalog_key!r}; give a GCS key of its own, other than key "
                              f"({self.key!r}), e.g. 'controller-catalog/v1'")


def encode(planner: Planner, config: DurableConfig) -> bytes:
    """The planner's durable state in at most ``max_bytes``: popularity keeps fewer counts until it fits."""
    counts = config.max_counts
    while True:
        data = json.dumps(planner.export_state(counts), separators=(",", ":")).encode()
        if len(data) <= config.max_bytes:
            return data
        if counts == 0:
            raise ConfigError(f"the controller's hints and queues alone take {len(data)} bytes, over max_bytes "
                              f"({config.max_bytes}); raise max_bytes")
        counts //= 2


def decode(data: bytes) -> dict[str, Any]:
    state = json.loads(data)
    if not isinstance(state, dict):
        raise ValueError(f"controller state is a {type(state).__name__}, not an object")
    return state


class Snapshots:
    """When to take a snapshot: at most once per period, and only when it differs from the last saved."""

    def __init__(self, config: DurableConfig) -> None:
        self.config = config
        self.saved: bytes | None = None  # the last snapshot written
        self.taken_at = -math.inf
        self.writes = 0

    def take(self, planner: Planner, now: float) -> bytes | None:
        """A snapshot to write now, or None (too soon, or nothing changed)."""
        if now - self.taken_at < self.config.period_s:
            return None
        self.taken_at = now
        data = encode(planner, self.config)
        return None if data == self.saved else data

    def written(self, data: bytes) -> None:
        self.saved = data
        self.writes += 1


class KvStore:
    """The snapshot in Ray's GCS key-value store (blocking calls: run them on a thread)."""

    def __init__(self, key: str, namespace: str) -> None:
        self.key, self.namespace = key, namespace

    def get(self) -> bytes | None:
        from lora_cache.runtime import ray_compat

        return ray_compat.kv_get(self.key, self.namespace)

    def put(self, data: bytes) -> None:
        from lora_cache.runtime import ray_compat

        ray_compat.kv_put(self.key, data, self.namespace)


class DurableState:
    """The controller's snapshots in the GCS kv store: what the actor restores and persists (blocking
    reads and writes run on a thread, off the event loop). The planner's state and the catalog each have
    a key of their own (``catalog_store.py``: the catalog is never cut to a bound)."""

    def __init__(self, config: DurableConfig, namespace: str) -> None:
        self.snapshots = Snapshots(config)
        self.store = KvStore(config.key, namespace)
        self.restored: dict[str, int] = {}  # what the last restore brought back, by kind (for status)
        self.catalog = CatalogSnapshots()
        self.catalog_store = KvStore(config.catalog_key, namespace)
        self.catalog_copy = CatalogCopy(config.catalog_copy, namespace) if config.catalog_copy else None
        self.catalog_restored: dict[str, int] = {}
        self._catalog_saved = -1  # the catalog generation the last snapshot written holds
        self._catalog_writing = asyncio.Lock()  # one catalog write at a time; a write covers the calls behind it
        self.answers_store = KvStore(f"{config.catalog_key}/request-ids", namespace)  # request_ids.py
        self.backlog_store = KvStore(f"{config.catalog_key}/backlog", namespace)  # backlog.py: what is left of it
        self.backlog_restored = 0
        self.answers_restored = 0
        self._answers_saved = 0  # the RequestIds generation the last write holds
        self._answers_writing = asyncio.Lock()

    async def restore(self, planner: Planner) -> None:
        """Hints, queues and popularity from the last snapshot a predecessor wrote (none on a first start)."""
        try:
            data = await asyncio.to_thread(self.store.get)
            if data:
                restored = planner.restore_state(decode(data), time.time())
                self.restored = {k: v for k, v in restored._asdict().items() if isinstance(v, int)}
                log.info("restored controller state: %s", self.restored)
        except Exception as e:  # a bad or unreadable snapshot: start without it (hints are re-sent, queues re-reported)
            log.warning("could not restore the controller's state (%s: %s); starting without it", type(e).__name__, e)

    async def restore_catalog(self, core: ControllerCore) -> None:
        """The catalog from the last snapshot, each entry's files read again on a thread (a file provably the
        one hashed is not hashed again; a changed one comes back under its new version or not at all)."""
        copied = False
        try:
            data = await asyncio.to_thread(self.catalog_store.get)
            if not data and self.catalog_copy is not None:  # a new cluster (its head lost): the copy off it
                data, copied = await asyncio.to_thread(self.catalog_copy.get), True
            if not data:
                return
            saved = await asyncio.to_thread(catalog_store.decode, data)
        except Exception as e:  # unreadable: the workers' reports still bring back what they hold
            log.warning("could not read the catalog's snapshot (%s: %s); starting from the workers' reports",
                        type(e).__name__, e)
            return
        restored = await asyncio.to_thread(catalog_store.read_saved, core, saved)
        catalog_store.apply(core, restored)
        self._catalog_saved = -1  # what changed (a new version, an entry left out) is saved at the next chance
        self.catalog_restored = {k: v for k, v in restored._asdict().items() if isinstance(v, int)}
        self.catalog_restored["entries"] = len(restored.entries)
        self.catalog_restored["from_copy"] = int(copied)
        log.info("restored the catalog: %s", self.catalog_restored)

    async def save_catalog(self, core: ControllerCore) -> None:
        """Write the catalog's snapshot if it changed since the last one written; returns once a snapshot
        holding every change made before the call is written (or the write failed: logged, tried again)."""
        wanted = core.catalog.generation
        async with self._catalog_writing:
            if self._catalog_saved >= wanted:
                return  # the write this call waited for holds its changes
            generation, paths = core.catalog.generation, core.paths.copy()  # the copy: one C call, on the loop
            try:  # the snapshot holds at least every change up to ``generation`` (the catalog is thread-safe)
                data = await asyncio.to_thread(self.catalog.take, core.catalog, paths)
                await asyncio.to_thread(self.catalog_store.put, data)
                if self.catalog_copy is not None:
                    await asyncio.to_thread(self.catalog_copy.put, data)
            except Exception as e:  # GCS (or the copy's storage) unreachable: the health loop tries again
                log.warning("could not save the catalog: %s", e)
                return
            self._catalog_saved = generation
            self.catalog.writes += 1

    async def save_answers(self, ids: RequestIds) -> None:
        """Write the answers of registrations by request id if they changed since the last write; returns once a
        write holding every answer kept before the call is done (or failed: logged; the next call writes)."""
        wanted = ids.generation
        async with self._answers_writing:
            if self._answers_saved >= wanted:
                return
            generation, data = ids.generation, ids.encode()
            try:
                await asyncio.to_thread(self.answers_store.put, data)
            except Exception as e:  # GCS unreachable: a retry by id after a restart then registers again
                log.warning("could not save the registrations' request-id answers: %s", e)
                return
            self._answers_saved = generation

    async def restore_answers(self, ids: RequestIds) -> None:
        """The answers a predecessor kept, so a retry by request id after a restart gets the same answer."""
        try:
            data = await asyncio.to_thread(self.answers_store.get)
            if data:
                self.answers_restored = ids.load(data)
                log.info("restored %d registrations' request-id answers", self.answers_restored)
        except Exception as e:  # unreadable: retries by id register again (the catalog is as it was)
            log.warning("could not restore the request-id answers (%s: %s); retries by id register again",
                        type(e).__name__, e)

    async def save_backlog(self, items: list[tuple[str, str]]) -> None:
        """What is left of the background registration (``backlog.py``), for a restarted controller to go on with."""
        data = zlib.compress(json.dumps(items).encode())
        try:
            await asyncio.to_thread(self.backlog_store.put, data)
        except Exception as e:  # GCS unreachable: a restart before the next save registers those on demand only
            log.warning("could not save the background registration's %d adapters: %s", len(items), e)

    async def restore_backlog(self) -> list[tuple[str, str]]:
        """What a predecessor left of its background registration (none on a first start, or unreadable)."""
        try:
            data = await asyncio.to_thread(self.backlog_store.get)
            items = [(str(n), str(p)) for n, p in json.loads(zlib.decompress(data))] if data else []
        except Exception as e:  # unreadable: those adapters register on demand only
            log.warning("could not restore the background registration (%s: %s)", type(e).__name__, e)
            return []
        self.backlog_restored = len(items)
        return items

    async def persist(self, planner: Planner) -> None:
        """A snapshot of what only the controller knows, if due and changed (the write runs on a thread)."""
        data = self.snapshots.take(planner, time.monotonic())
        if data is None:
            return
        try:
            await asyncio.to_thread(self.store.put, data)
            self.snapshots.written(data)
        except Exception as e:  # GCS unreachable: the next period tries again
            log.warning("could not save the controller's state: %s", e)
