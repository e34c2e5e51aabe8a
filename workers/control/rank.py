"""What the controller calls on one TP rank, whoever hosts it: the worker actor (``workers/actor.py``) or
an engine's own process attached through ``workers/attach/attachment.py`` (lifecycle steps 4 and 7).

``WorkerControl`` composes the rank's ``WorkerCache``, its ``CommandGate`` and its ``Outbox``: adapter
registrations replayed by the controller, commands, the full residency report a (re)started controller
rebuilds from, and the cache's counters. Plain Python; the hosts only forward to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection

from lora_cache.adapters.catalog import AdapterCatalog, check_carried
from lora_cache.adapters.device_source import DeviceSource
from lora_cache.adapters.peft import AdapterSpec, KnownVersion
from lora_cache.errors import ConfigError, LoraCacheError, NotFoundError
from lora_cache.vocab import ApplyResult, Command
from workers.cache import WorkerCache
from workers.control.commands import CommandGate
from workers.control.node_copies import NodeCopies
from workers.control.outbox import Outbox
from workers.gpu.lend import Lease


class WorkerControl:
    """One rank's control surface; ``replica`` and the cache's config say which rank it is."""

    def __init__(self, replica: str, catalog: AdapterCatalog, cache: WorkerCache, outbox: Outbox,
                 copies: NodeCopies | None = None) -> None:
        self.replica, self.catalog, self.cache, self.outbox = replica, catalog, cache, outbox
        self.copies = copies  # pushed versions copied to this node (None: read where registered)
        self.gate = CommandGate(cache, outbox.push)
        self.paths: dict[str, str] = {}  # adapter -> the path it was registered from (reported to the controller)
        self.leases: list[Lease] = []  # the pool's pages lent by resize_pool, oldest first
        self.taken = self.hashed = 0  # registrations taken on the controller's word (same file) / hashed here
        self.arrived = threading.Condition()  # notified after each batch of registrations (``await_version``)
        self.refusals: dict[tuple[str, str], str] = {}  # (name, version) -> why this rank refused it (the last 64)

    def register_adapter(self, name: str, path: str, known: KnownVersion | None = None) -> str:
        """Register ``name`` from ``path``; its version. ``known``: the version the controller hashed (lifecycle
        step 0): taken without reading the weights if this rank's own open proves the file is the one the
        controller hashed (``peft.proves``), else hashed here, and refused if it hashes to another version. Where
        a stat and the config prove the file unchanged on the controller's machine (or the store version came with
        its config and header), nothing is parsed now: only the version's identity is kept until the adapter is
        first loaded or staged here, when the full read and the same checks run (``AdapterCatalog.add_lazy``)."""
        registered = path  # reported to the controller as it named it
        if known is not None and self._device_only(name, known.version):
            return self._land(name, path, known)
        if self.copies is not None:  # a pushed version in another node's memory: this node's copy of it
            path, known = self.copies.localize(name, path, known)
        if self.catalog.add_lazy(name, path, known) is not None:  # proven by a stat and the config: parsed at
            self.paths[name] = registered  # its first load or stage here (``AdapterCatalog.get``), checked then
            self.taken += 1
            return known.version  # type: ignore[union-attr]
        spec = self._read(name, path, known)  # a store version: no request to the store
        if spec.device is not None and spec.device.ahead:  # a device push's, ahead of it: loadable, not current
            self.catalog.ahead.reserve(spec)
            self.taken += 1
            return spec.version
        self.catalog.add(spec)
        self.paths[name] = registered
        if known is not None and (spec.store or spec.source) is known.source:  # taken as proven, not re-read
            self.taken += 1
        else:
            self.hashed += 1
        return spec.version

    def _device_only(self, name: str, version: str) -> bool:
        """Whether this rank holds ``name@version`` as a device push's version whose node copy has not landed."""
        try:
            return self.catalog.get(name, version).device_only
        except LoraCacheError:
            return False

    def _land(self, name: str, path: str, known: KnownVersion) -> str:
        """The node copy of device version ``known`` landed (``DevicePushes.land``): its file proven under the same id
        (this node's copy, on another node) takes the device-only spec's place, current or older, the current
        version unchanged. A registration of the same device version again changes nothing, but for the commit of
        one registered ahead of its push (``DeviceSource.ahead`` no longer set), which makes it current."""
        if isinstance(known.source, DeviceSource):
            if not known.source.ahead and self.catalog.current(name) != known.version:
                self.catalog.add(self._read(name, path, known))
                self.paths[name] = path
                self.taken += 1
            return known.version
        registered = path
        if self.copies is not None:
            path, copied = self.copies.localize(name, path, known)
            known = copied or known
        spec = self._read(name, path, known)
        if self.catalog.promote(spec) and self.catalog.current(name) == spec.version:
            self.paths[name] = registered
        self.taken += 1
        return spec.version

    def _read(self, name: str, path: str, known: KnownVersion | None) -> AdapterSpec:
        """``name`` at ``path`` read as the version ``known`` carries (its config and header where it carries them),
        refused if it is another (``check_carried``)."""
        return check_carried(name, self.catalog.read(name, path, known, carried=True), known)

    def register_adapters(self, entries: list[tuple[str, str, KnownVersion | None]]) -> list[tuple[str, str]]:
        """Each (name, path, known) registered by itself: (its version, "") or ("", why not); a bad one fails
        alone and leaves this rank's catalog as it was for that name."""
        out = []
        for name, path, known in entries:
            try:
                out.append((self.register_adapter(name, path, known), ""))
            except (LoraCacheError, OSError, ValueError) as e:  # reported per entry to the controller
                out.append(("", f"{type(e).__name__}: {e}"))
                if known is not None:
                    self.refusals[(name, known.version)] = out[-1][1]
                    while len(self.refusals) > 64:
                        del self.refusals[next(iter(self.refusals))]
        with self.arrived:
            self.arrived.notify_all()
        return out

    def await_version(self, name: str, version: str, timeout_s: float) -> None:
        """Return once ``name@version`` is registered on this rank, waiting up to ``timeout_s`` for its registration
        (a device push's: the controller answers the trainer once it sent the registration, not once every rank
        took it, and the trainer's doorbell may come first). NotFoundError naming why if this rank refused it or
        it did not come."""
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while not self._known(name, version):
                why = self.refusals.get((name, version))
                left = deadline - time.monotonic()
                if why is not None or left <= 0:
                    raise NotFoundError(f"{name}@{version} is not registered on rank {self.replica}/"
                                        f"{self.cache.config.tp_rank}: " + (f"it refused it ({why})" if why else
                                        f"its registration did not come within {timeout_s:.0f} s") +
                                        "; push the next version")
                self.arrived.wait(left)

    def _known(self, name: str, version: str) -> bool:
        try:
            self.catalog.get(name, version)
        except LoraCacheError:
            return False
        return True

    def unregister_adapter(self, name: str) -> bool:
        """Forget ``name`` (the controller drained it first) and drop its shards from the host tier, every version
        (``HostTier.drop_adapter``: a registration again reads afresh); False if it was not registered here."""
        self.paths.pop(name, None)
        known = name in self.catalog
        if known:
            self.catalog.unregister(name)  # first: no new fetch of it starts after the drop
        self.cache.host.drop_adapter(name)
        if self.copies is not None:
            self.copies.forget(name)
        return known

    def drop_pushed(self, name: str, tags: list[str], node: str, area: str) -> list[str]:
        """The controller retired pushed versions ``tags`` of ``name``: this node's copies of them go (the tags
        removed; none where this rank reads where registered)."""
        return self.copies.drop(name, tags, node, area) if self.copies is not None else []

    def resize_pool(self, lent_bytes: int, keep: Collection[str] = ()) -> dict[str, object]:
        """Lend ``lent_bytes`` of the GPU pool to the engine in all (issue 43 item 3): more than now lends the
        difference (``PoolLender.give_back``: whole pages, free first, then idle adapters, ``keep`` last; refused
        whole, changing nothing, if the free and idle pages fall short); less takes leases back, newest first, and
        lends what is still short. Returns the pool's capacity, what is lent (whole pages), what was evicted, and
        what was lent before (``was_lent_bytes``: a replica's other ranks are put back to it if one refuses)."""
        if lent_bytes < 0:
            raise ConfigError(f"resize_pool({lent_bytes}): give the bytes to lend in all, >= 0 (0: take all back)")
        lender, was = self.cache.lender, self._lent()
        while self.leases and self._lent() > lent_bytes:  # the newest leases back first
            lender.take_back(self.leases.pop())
        evicted: tuple[str, ...] = ()
        if lent_bytes > self._lent():  # never fails after a take-back: the pages just freed cover it
            lease = lender.give_back(lent_bytes - self._lent(), keep)
            self.leases.append(lease)
            evicted = lease.evicted
        return {"capacity_bytes": lender.capacity_bytes(), "lent_bytes": self._lent(),
                "page_bytes": lender.page_bytes, "evicted": list(evicted), "was_lent_bytes": was}

    def _lent(self) -> int:
        return sum(lease.nbytes for lease in self.leases)

    def apply(self, commands: list[Command]) -> ApplyResult:
        return self.gate.apply(commands)

    def describe(self, node: str) -> dict[str, object]:
        """Who this rank is and everything it holds: the controller rebuilds from this."""
        seq = self.outbox.seq  # first: every delta up to it is reflected in the residency read after it
        config, cache = self.cache.config, self.cache
        # a paged GPU pool (issue 43): the planner counts its room in bytes, a shard in whole pages
        # (or one that lent pages to its engine, item 3: its bytes for adapters now)
        capacity = cache.lender.capacity_bytes()
        paged = ({"gpu_bytes": capacity, "page_bytes": cache.lender.page_bytes}
                 if cache.page_numel < cache.slot_numel or capacity < cache.pool_bytes else {})
        return {**paged, "replica": self.replica, "rank": config.tp_rank, "tp": config.tp,
                "model": self.catalog.shape.name, "incarnation": self.outbox.incarnation, "seq": seq, "node": node,
                "slots": config.num_slots, "host_bytes": config.host.host_bytes, "adapters": dict(self.paths),
                # its part of the node's disk tier (every rank of this service here shares it): disk warming's bound
                "disk_bytes": config.disk.disk_cache_bytes // max(1, cache.host.ranks_here),
                "epoch": self.gate.epoch,
                "residency": [(r["adapter"], r["version"], r["state"], r["refs"], r.get("acquired") is True)
                              for r in self.cache.residency()],
                "host": [(k.name, k.version) for k in self.cache.host.contents()]}  # its host tier, apart

    def stats(self) -> dict[str, object]:
        return {**self.cache.stats(), "epoch": self.gate.epoch, "commands_accepted": self.gate.accepted,
                "commands_rejected": self.gate.rejected, "registrations_taken": self.taken,
                "registrations_hashed": self.hashed,
                # pushed versions this rank copied into its node's memory from another node's / found there
                "pushed_copied": self.copies.copied if self.copies else 0,
                "pushed_reused": self.copies.reused if self.copies else 0}
