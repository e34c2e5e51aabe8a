"""Pushes from a trainer's device buffer, on the controller (lifecycle step 0; issue 44 item 5).

A push by value (``pushes.py``) writes and hashes the version before any rank takes it: passes over the bytes on
the host that alone cost more than the 1.3x of a shard's host-to-device copy the issue allows. A device push turns
the order around (docs/decisions.md, "What item 5's goal needs"):

1. ``push``: the trainer declares the version (the name, its tag, the config, the image's header and size); it is
   checked as a push's (``pushed.check_head``: names, shapes, dtypes, rank), a tag the name holds already is refused
   (a tag names one content, and nothing cheap could prove the bytes equal), and it is registered at once as a
   device-only version (``device_source``): an id of its own (``device_versions.device_known``), no file, every rank
   given its spec from the carried config and header. The planner commands no load of it anywhere and keeps it where
   it is held. Then the trainer has the ranks of its replica take their shards from its buffer (their doorbells,
   ``workers.control.doorbell``): each READY reaches the controller as any load's, and the replica switches to the
   version when every rank has (invariant 4 as ever).
2. ``land``: the trainer hands over the image's bytes (copied off its GPU while the ranks loaded) once every rank
   is READY. The node copy is written into the push area under ``NAME/TAG`` and hashed as a push's; if it is the
   image declared (size, header, config), the version keeps its id and becomes an ordinary pushed version: its
   file's proof replaces the device-only spec, current or older (``AdapterCatalog.promote``), on the controller and
   on every rank (a registration of the same id, which a rank takes as the landing), and the planner may load it
   anywhere. A landing that does not match changes nothing and is refused by name.
3. ``expire`` (each health round): a device version not landed within ``CatalogConfig.push_land_s`` (the trainer
   died, or never copied its buffer) is given up: the planner may evict it, and if it is still its name's current
   version, the version before it is registered again, so that new work takes a version that can be loaded anywhere.

A device-only version is not saved in the durable catalog: a restarted controller has the version before it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import NamedTuple

from lora_cache.adapters.catalog import check_name
from lora_cache.adapters.device_versions import device_known, landed_known
from lora_cache.adapters.peft import KnownVersion
from lora_cache.adapters.pushed import check_head, check_tag, digest
from lora_cache.controller.pushes import Pushed, Pushes
from lora_cache.errors import ConfigError, ConflictError, LoraCacheError, NotFoundError
from lora_cache.planner.records import AdapterInfo
from lora_cache.vocab import AdapterKey


class Pending(NamedTuple):
    """A device push registered and not yet landed."""

    tag: str
    known: KnownVersion
    path: Path  # where its node copy lands (``PushArea.path``)
    at: float  # time.monotonic() of its registration
    previous: str  # the version it replaced ("" if its name was new)


class Landed(NamedTuple):
    """A landing's answer: the device version, now with a file; the content hash of its bytes; the ranks that did not
    answer (they take it when they come back)."""

    name: str
    tag: str
    version: str
    content: str
    rank_pending: tuple[str, ...] = ()


class DevicePushes:
    """The controller's side of device pushes (the module's docstring), beside ``Pushes`` (the push area, its
    bookkeeping of directories being written, the registrar)."""

    def __init__(self, pushes: Pushes) -> None:
        self.pushes, self.core, self.registrar = pushes, pushes.core, pushes.registrar
        self.land_s = pushes.core.config.catalog.push_land_s
        self.pending: dict[tuple[str, str], Pending] = {}  # (name, version) -> its push, until it lands or expires
        self.registering: set[tuple[str, str]] = set()  # (name, tag) of pushes being registered (not yet pending)
        self.pushed = self.landed = self.expired = self.refused = 0

    async def push(self, name: str, tag: str | int | None, config_bytes: bytes, head: bytes, size: int) -> Pushed:
        """Register a device push's version (step 1); its ``Pushed``, or the error (nothing changed)."""
        try:
            check_name(name)
            if tag in (None, ""):
                raise ConfigError(f"device push of {name}: give its tag (the trainer's step); a device version is "
                                  "named by its trainer, its content is not hashed before the ranks take it")
            tag = check_tag(tag)
            if not isinstance(size, int) or isinstance(size, bool) or size < 8:
                raise ConfigError(f"device push {name}@{tag}: the image's size {size!r} is not a byte count; give "
                                  "the buffer's numel()")
            catalog = self.core.catalog
            await asyncio.to_thread(check_head, name, config_bytes, head, size, catalog.shape, catalog.config.max_rank)
            path = self.pushes.area.path(name, tag)
            if self._held(name, tag, path):
                raise ConflictError(f"adapter {name!r} has a version tagged {tag!r} already; a tag names one content: "
                                    "push under the next step's tag")
            known = device_known(name, tag, config_bytes, head, size)
        except Exception:
            self.refused += 1
            raise
        self.registering.add((name, tag))  # no await since the check: a second push of the tag meanwhile is refused
        self.pushes.claim(path)  # no retire takes its directory's name meanwhile
        try:
            # answered once the ranks were sent it: each rank the trainer rings waits for it there
            (done,) = await self.registrar.register([(name, str(path))], {str(path): known}, answered=False)
            if done.error is not None:
                raise done.error
        except BaseException:
            self.refused += 1
            raise
        finally:
            self.registering.discard((name, tag))
            self.pushes.release(path)
        self.pending[(name, done.version)] = Pending(tag, known, path, time.monotonic(), done.previous)
        self.pushed += 1
        return Pushed(name, tag, done.version, done.previous, done.rank_pending)

    def _held(self, name: str, tag: str, path: Path) -> bool:
        """Whether ``name`` has a version tagged ``tag``: pushed (its directory), kept or being registered, or a
        device push of it pending."""
        return (path.exists() or path in self.pushes.kept(name) or (name, tag) in self.registering
                or any(n == name and p.tag == tag for (n, _), p in self.pending.items()))

    async def land(self, name: str, version: str, config_bytes: bytes, weights: bytes) -> Landed:
        """The node copy of device version ``name@version`` (step 2); its ``Landed``, or the error (the version
        stays device-only until it lands or expires)."""
        pending = self.pending.get((name, version))
        if pending is None:
            raise NotFoundError(f"no device push of {name}@{version} is waiting for its node copy: it landed already, "
                                f"was given up after {self.land_s:.0f} s, or was never pushed here; push the next "
                                "version")
        pushes, path = self.pushes, pending.path
        pushes.claim(path)
        new = False
        try:
            content, (written, new) = await asyncio.gather(asyncio.to_thread(digest, config_bytes, weights),
                                                           pushes.write(name, pending.tag, config_bytes, weights))
            known = landed_known(content, written, pending.known)
            spec = await asyncio.to_thread(self.core.read_adapter, name, str(written), known)
            turn = self.registrar.turns.take(name)  # in the name's order among its registrations
            try:
                await turn.wait()
                if (name, version) not in self.pending or not self.core.catalog.promote(spec):
                    if self.pending.pop((name, version), None) is not None and name in self.core.catalog:
                        self._loadable(name, version)  # retired meanwhile: nothing for the planner to keep
                    raise NotFoundError(f"device push {name}@{version} was given up or retired before its node copy "
                                        "landed; push the next version")
                del self.pending[(name, version)]
                self._loadable(name, version)
                entries: list[tuple[str, str, KnownVersion | None]] = [(name, str(written), known)]
                current = self.core.catalog.get(name)
                if current.version != version and current.known is not None:
                    # an older version landed: a rank that never took it as a device version (restarted since, or
                    # it refused it) takes the landing as a registration, current; the current one again after it
                    entries.append((name, self.core.paths.get(name, str(current.path)), current.known))
                sent = self.registrar.fanout.submit_registrations(entries)
            finally:
                turn.done()
        except BaseException:
            self.refused += 1
            if new:  # what it wrote goes (the catalog names that directory for the device version: no retire takes
                # it), so that a landing of the right bytes may write it again
                await asyncio.to_thread(pushes.area.drop, name, [pending.tag])
            raise
        finally:
            pushes.release(path)
        ranks = (await self.registrar.fanout.registered(sent))[0]
        self.landed += 1
        await self.registrar.plan()
        return Landed(name, pending.tag, version, content.version, tuple(ranks.pending))

    def _loadable(self, name: str, version: str) -> None:
        """The planner may command, evict and retire ``name@version`` as any version (it landed, or was given up)."""
        if not self.core.planner.view.device_only(AdapterKey(name, version)):
            return  # so already: an AdapterInfo of it would make it the planner's current version
        info = self.core.planner.view.adapter(name)
        self.core.planner.register_adapter(AdapterInfo(name, version, info.bytes_per_rank, info.object_bytes))

    def forget(self, name: str) -> None:
        """``name`` was unregistered: its device pushes waiting to land are dropped (a landing of one is refused)."""
        for key in [k for k in self.pending if k[0] == name]:
            del self.pending[key]

    async def health_round(self) -> list[str]:
        """The controller's health round's retirements: device pushes never landed first (``expire``), then the
        pushed versions no rank holds any more (``Pushes.retire_released``); the names retired."""
        await self.expire()
        return await self.pushes.retire_released()

    async def withdraw(self, name: str, version: str) -> bool:
        """Give up device version ``name@version`` now, as ``expire`` does (its trainer saw a rank refuse it, e.g. a
        NaN in the image); False if it is not waiting to land."""
        pending = self.pending.get((name, version))
        if pending is None:
            return False
        await self._give_up([((name, version), pending)])
        return True

    async def expire(self, now: float | None = None) -> list[str]:
        """Give up the device versions not landed within ``land_s`` (step 3); their names."""
        now = time.monotonic() if now is None else now
        gone = [(key, p) for key, p in self.pending.items() if now - p.at >= self.land_s]
        await self._give_up(gone)
        return [name for (name, _), _ in gone]

    async def _give_up(self, gone: list[tuple[tuple[str, str], Pending]]) -> None:
        """One still its name's current version gives way to the version before it, registered again; one with none
        before it stays as it is (where it is held, it is served; nowhere else can it be loaded) until its name is
        pushed again."""
        for (name, version), pending in gone:
            del self.pending[(name, version)]
            self.expired += 1
            catalog = self.core.catalog
            if name in catalog and catalog.current(name) == version:
                try:
                    before = catalog.get(name, pending.previous) if pending.previous else None
                except LoraCacheError:
                    before = None  # retired meanwhile
                if before is None:
                    continue
                where, known = str(before.path), before.known
                (done,) = await self.registrar.register([(name, where)], {where: known} if known else None)
                if done.error is not None:
                    continue
            if name in catalog:
                self._loadable(name, version)  # an older version now: evicted and retired as any
