"""Applying the controller's commands on a worker (lifecycle step 4), plain Python.

Every command carries the controller's epoch; a worker remembers the newest epoch it has seen and
rejects older ones (invariant 6). Commands are idempotent: a repeated prefetch returns the load in
flight, a repeated evict of an absent adapter does nothing, a repeated stage finds the shard staged
(invariant 7). A stage changes no slot, so it has no delta; its outcome is in the cache's counters. A ranking
replaces the host tier's last one (its eviction order's, ``workers.staging.eviction``) and changes nothing else.

The residency changes a command makes are reported by the cache (``WorkerCache.on_change``), like
those an engine makes. The controller assumes its commands took effect, so the gate corrects it where
one did not: a prefetch refused before any load started ("failed"), and an evict refused because the
adapter is loading or in use (its state again, "in_use" for a running batch's, so that the planner
neither evicts it again nor counts its slot as free: a prefetch into that slot would evict another
adapter, which the planner would load again, and so on).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from lora_cache.errors import LoraCacheError, SlotsBusyError
from lora_cache.vocab import AdapterKey, ApplyResult, Command, Delta, Evict, Prefetch, Ranking, Stage
from workers.cache import WorkerCache
from workers.staging.warming import WarmQueue

__all__ = ["CommandGate"]


class CommandGate:
    """Epoch check + idempotent application of commands to a WorkerCache.

    ``push`` takes the deltas: a cache built without ``on_change`` reports its changes there too, so
    every residency change reaches ``push`` exactly once, whoever made it."""

    def __init__(self, cache: WorkerCache, push: Callable[[Delta], None]) -> None:
        self.cache, self.push = cache, push
        if cache.on_change is None:
            cache.on_change = push
        self.epoch = 0
        self._lock = threading.Lock()  # protects epoch, the counters and _warm
        self._warm: WarmQueue | None = None  # speculative stages (warm_queue)
        self._to_disk: set[AdapterKey] = set()  # the queued speculative stages that fetch into the disk tier only
        self.accepted = self.rejected = 0

    def apply(self, commands: Iterable[Command]) -> ApplyResult:
        accepted = rejected = 0
        errors: list[str] = []
        for command in commands:
            with self._lock:
                if command.epoch < self.epoch:
                    rejected += 1
                    continue
                self.epoch = command.epoch
            if isinstance(command, Ranking):  # the host tier's eviction order (``EvictionOrder.ranked``); never fails
                self.cache.host.order.ranked(command.names)
                accepted += 1
                continue
            try:
                error = self._apply_one(command)
            except LoraCacheError as e:  # refused before any load started; a bad command costs that command only
                error = str(e)
                if isinstance(command, Prefetch):  # the controller assumed it loading: say it is not
                    self.push(Delta(command.adapter, command.version, "failed", error=error))
            if error is None:
                accepted += 1
            else:
                errors.append(f"{type(command).__name__} {command.adapter}@{command.version}: {error}")
        with self._lock:
            self.accepted += accepted
            self.rejected += rejected
        return ApplyResult(accepted, rejected, tuple(errors))

    def warm_queue(self) -> WarmQueue:
        """The rank's warm stages (made at the first one): read one at a time while the host tier is idle."""
        with self._lock:
            if self._warm is None:
                host = self.cache.host
                self._warm = WarmQueue(self._warm_stage, host.demand.busy, self._shard_bytes,
                                       host.config.warm_read_bytes_per_s / host.ranks_here)
            return self._warm

    def close(self) -> None:
        """Stop the warm stages' driver (queued ones are dropped; a read in flight completes in the host tier)."""
        with self._lock:
            warm, self._warm = self._warm, None
        if warm is not None:
            warm.close()

    def _warm_stage(self, name: str, version: str) -> Any:
        """A warm stage's read: the host tier leaves no demand-read marker for it (``node_reads``). A disk warm
        stage fetches the store adapter's object into the node's disk tier and reads nothing into the host tier."""
        with self._lock:
            key = AdapterKey(name, version)
            to_disk = key in self._to_disk
            self._to_disk.discard(key)
        if to_disk:  # the object into the node's disk tier, nothing into the host tier; its fetch yields the store
            return self.cache.disk.stage(self.cache.catalog.get(name, version), self.cache.host.demand.busy)
        with self.cache.host.demand.speculative():
            return self.cache.stage(name, version)

    def _shard_bytes(self, name: str, version: str) -> int:
        """What a warm stage moves, for the read rate limit: the shard; a disk warm stage's, the whole object."""
        with self._lock:
            to_disk = AdapterKey(name, version) in self._to_disk
        store = self.cache.catalog.get(name, version).store
        return store.size if to_disk and store is not None else self.cache.layout_of(name, version).nbytes

    def _apply_one(self, command: Prefetch | Evict | Stage) -> str | None:
        """Why the command failed at once, or None; the cache reports the changes it makes."""
        if isinstance(command, Evict):
            if not self.cache.evict(command.adapter, command.version):
                self.cache.restate(command.adapter, command.version)  # absent: nothing to say
            return None
        if isinstance(command, Stage) and command.speculative:
            queue = self.warm_queue()
            with self._lock:  # a host warm stage of a key queued for the disk makes it a host one (it fetches too)
                key = AdapterKey(command.adapter, command.version)
                if command.disk and (not queue.holds(key) or key in self._to_disk):
                    self._to_disk.add(key)
                else:
                    self._to_disk.discard(key)
            queue.offer(command.adapter, command.version)  # read (or fetched) once the host tier is idle
            return None
        if isinstance(command, Stage):
            self.cache.stage(command.adapter, command.version)  # no room or a failed read: counted there
            return None
        assert isinstance(command, Prefetch)
        future = self.cache.prefetch(command.adapter, command.version, commanded=True)
        failed = future.exception() if future.done() else None  # e.g. no host-tier room: reported "failed"
        # every slot held by running batches is counted (prefetch_no_room), not an error to log
        return None if failed is None or isinstance(failed, SlotsBusyError) else str(failed)
