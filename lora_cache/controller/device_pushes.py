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

``reserve`` does step 1 ahead of the push, while the trainer trains: the version checked and given its id, held by
every rank and this catalog current nowhere (``DeviceSource.ahead``, ``lora_cache/adapters/ahead.py``), so that the
push is the trainer's doorbells alone; ``commit`` then makes it current, in the name's order. A push of its tag
registered now gives it up (``displace``: the trainer's guess, never a claim); one never committed is given up after
``AHEAD_LAND_TIMES`` x ``push_land_s``.

A device-only version is not saved in the durable catalog: a restarted controller has the version before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from lora_cache.adapters.catalog import check_name
from lora_cache.adapters.device_versions import committed, device_known, landed_known
from lora_cache.adapters.peft import KnownVersion
from lora_cache.adapters.pushed import check_head, check_tag, digest
from lora_cache.adapters.shards import shard_layout
from lora_cache.controller.pushes import Pushed, Pushes
from lora_cache.errors import ConfigError, ConflictError, LoraCacheError, NotFoundError
from lora_cache.planner.records import AdapterInfo
from lora_cache.vocab import AdapterKey

AHEAD_LAND_TIMES = 10  # a version registered ahead and never committed is given up after this many times push_land_s
# (a trainer's step may be long: one registered at its start is committed at its end)


class Pending(NamedTuple):
    """A device push registered and not yet landed."""

    tag: str
    known: KnownVersion
    path: Path  # where its node copy lands (``PushArea.path``)
    at: float  # time.monotonic() of its registration (or its commit, for one registered ahead)
    previous: str  # the version it replaced ("" if its name was new; one registered ahead: the current then)
    ahead: bool = False  # registered ahead of its push, not yet committed (``reserve``)


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
        self.pushed = self.reserved = self.landed = self.expired = self.refused = 0
        pushes.displace = self.displace  # a push by value of a tag registered ahead gives that version up first

    async def _declared(self, name: str, tag: str | int | None, config_bytes: bytes, head: bytes, size: int,
                        ahead: bool = False) -> tuple[str, Path, KnownVersion]:
        """A device push's declaration checked (``push``'s step 1): its tag, where it lands and its version (a new
        id), or the error (counted)."""
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
            if ahead and name not in catalog:
                raise NotFoundError(f"adapter {name!r} is not registered: a version is registered ahead of a name's "
                                    "next device push only; push its first version")
            await asyncio.to_thread(check_head, name, config_bytes, head, size, catalog.shape, catalog.config.max_rank)
            path = self.pushes.area.path(name, tag)
            if not ahead:
                await self.displace(name, tag)
            if self._held(name, tag, path):
                raise ConflictError(f"adapter {name!r} has a version tagged {tag!r} already; a tag names one content: "
                                    "push under the next step's tag")
            return tag, path, device_known(name, tag, config_bytes, head, size, ahead)
        except Exception:
            self.refused += 1
            raise

    async def push(self, name: str, tag: str | int | None, config_bytes: bytes, head: bytes, size: int) -> Pushed:
        """Register a device push's version (step 1); its ``Pushed``, or the error (nothing changed)."""
        tag, path, known = await self._declared(name, tag, config_bytes, head, size)
        with self._registering(name, tag, path):
            # answered once the ranks were sent it: each rank the trainer rings waits for it there
            (done,) = await self.registrar.register([(name, str(path))], {str(path): known}, answered=False)
            if done.error is not None:
                raise done.error
        self.pending[(name, done.version)] = Pending(tag, known, path, time.monotonic(), done.previous)
        self.pushed += 1
        return Pushed(name, tag, done.version, done.previous, done.rank_pending)

    async def reserve(self, name: str, tag: str | int | None, config_bytes: bytes, head: bytes, size: int) -> Pushed:
        """Register version ``tag`` of ``name`` ahead of its device push (step 1 done before the trainer's step ends:
        docs/decisions.md, "A device push registered ahead"): checked as ``push``'s, with its own id, every rank and
        this catalog holding it loadable by that id and current nowhere (``DeviceSource.ahead``), the planner keeping
        it where a rank loads it. The trainer then rings the ranks with that id, its push's only path to READY, and
        ``commit`` makes it current. Its ``Pushed`` (``previous``: the current version now), answered once every rank
        answered; or the error (nothing changed). One never committed is given up as a push never landed."""
        tag, path, known = await self._declared(name, tag, config_bytes, head, size, ahead=True)
        with self._registering(name, tag, path):
            spec = await asyncio.to_thread(self.core.read_adapter, name, str(path), known)
            turn = self.registrar.turns.take(name)  # in the name's order among its registrations
            try:
                await turn.wait()
                if name in self.registrar.draining or name not in self.core.catalog:
                    raise ConflictError(f"adapter {name!r} is being unregistered or was unregistered; register it "
                                        "again, then push its first version")
                previous = self.core.catalog.current(name)
                nbytes = shard_layout(spec, self.core.catalog.shape, 1, 0, torch.bfloat16).nbytes  # may refuse
                self.core.catalog.ahead.reserve(spec)
                self.core.planner.register_adapter(AdapterInfo(name, spec.version, nbytes, 0, True), ahead=True)
                sent = self.registrar.fanout.submit_registrations([(name, str(path), known)])
            finally:
                turn.done()
        self.pending[(name, known.version)] = Pending(tag, known, path, time.monotonic(), previous, ahead=True)
        self.reserved += 1
        ranks = (await self.registrar.fanout.registered(sent))[0]
        return Pushed(name, tag, known.version, previous, tuple(ranks.pending))

    @contextlib.contextmanager
    def _registering(self, name: str, tag: str, path: Path) -> Iterator[None]:
        """``name@tag`` being registered (no await since its check: a second push or reservation of the tag meanwhile
        is refused) into ``path`` (no retire takes that directory's name meanwhile); an error counted as refused."""
        self.registering.add((name, tag))
        self.pushes.claim(path)
        try:
            yield
        except BaseException:
            self.refused += 1
            raise
        finally:
            self.registering.discard((name, tag))
            self.pushes.release(path)

    async def commit(self, name: str, version: str) -> Pushed:
        """Make ``name@version``, registered ahead (``reserve``) and rung to its trainer's ranks, the name's current
        version: registered again, in the name's order, without ``DeviceSource.ahead``; its node copy then lands
        as any device push's (``land``, within ``push_land_s`` of this). Answered once the ranks were sent it. Its
        ``Pushed``, or the error (NotFoundError: not registered ahead here, e.g. given up after ``push_land_s``)."""
        pending = self.pending.get((name, version))
        if pending is None or not pending.ahead:
            raise NotFoundError(f"no device version {name}@{version} is registered ahead and waiting for its commit: "
                                f"it was committed already, given up after {self.land_s:.0f} s, or never registered "
                                "ahead here; push the step again")
        known, where = committed(pending.known), str(pending.path)
        with self._registering(name, pending.tag, pending.path):
            (done,) = await self.registrar.register([(name, where)], {where: known}, answered=False)
            if done.error is not None:
                raise done.error
        now = pending._replace(known=known, at=time.monotonic(), previous=done.previous, ahead=False)
        withdrawn = (name, version) not in self.pending  # meanwhile: a rank refused its image (e.g. a NaN)
        self.pending[(name, version)] = now
        if withdrawn:
            await self._give_up([((name, version), now)])  # the version before it current again
            raise NotFoundError(f"device version {name}@{version} was withdrawn while it was committed (a rank refused "
                                "its image); push the step again")
        self.pushed += 1
        return Pushed(name, pending.tag, done.version, done.previous, done.rank_pending)

    async def displace(self, name: str, tag: str) -> None:
        """A push of ``name@tag`` registered now (by value, or from a device buffer) gives up the version registered
        ahead under that tag, if any: a version registered ahead is its trainer's guess at its next push, never a
        claim on the tag (its commit is then refused, and its trainer's push registers itself)."""
        gone = [(key, p) for key, p in self.pending.items() if key[0] == name and p.tag == tag and p.ahead]
        if gone:
            await self._give_up(gone)

    def _held(self, name: str, tag: str, path: Path) -> bool:
        """Whether ``name`` has a version tagged ``tag``: pushed (its directory), kept or being registered, or a
        device push of it pending."""
        return (path.exists() or path in self.pushes.kept(name) or (name, tag) in self.registering
                or any(n == name and p.tag == tag for (n, _), p in self.pending.items()))

    async def land(self, name: str, version: str, config_bytes: bytes, weights: bytes) -> Landed:
        """The node copy of device version ``name@version`` (step 2); its ``Landed``, or the error (the version
        stays device-only until it lands or expires)."""
        pending = self.pending.get((name, version))
        if pending is None or pending.ahead:
            raise NotFoundError(f"no device push of {name}@{version} is waiting for its node copy: it landed already, "
                                f"was given up after {self.land_s:.0f} s, was registered ahead and never committed, "
                                "or was never pushed here; push the next version")
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
        """Give up the device versions not landed within ``land_s`` (step 3), and those registered ahead and not
        committed within ``AHEAD_LAND_TIMES`` times it; their names."""
        now = time.monotonic() if now is None else now
        gone = [(key, p) for key, p in self.pending.items()
                if now - p.at >= self.land_s * (AHEAD_LAND_TIMES if p.ahead else 1)]
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
            if pending.ahead:  # never committed: current nowhere; the ranks keep its registration (two a name at
                catalog.ahead.drop(name, version)  # most, ``MAX_AHEAD``) until their name's next ones
                if name in catalog:
                    self._loadable(name, version)
                continue
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
