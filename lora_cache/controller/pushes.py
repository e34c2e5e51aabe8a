"""Pushes from a trainer's memory, on the controller (lifecycle step 0; issue 44 item 2).

``Pushes.push`` takes one pushed version (a name, a tag, the PEFT config's bytes and the safetensors bytes of
its weights, from the gateway's ``PushAdapter`` stream or a Ray object reference) and:
1. checks it off the event loop (``pushed.check_push``): a bad name, tag, config or tensor is refused here,
   naming what is wrong, before anything is written or sent to a rank;
2. writes it whole into the service's push area (``pushed.PushArea``: node memory, renamed into place);
3. registers that directory as any registration does (``Registrar``: its content hashed into the version, every
   rank given it with that version, in the name's turn among registrations; the hash taken from the push's bytes
   while they are written, ``pushed.digest``, so the file is not read back): the name's current version
   changes only once it is registered; a push that fails at any step leaves the previous version current, and
   its directory is removed again;
4. retires the name's pushed versions the catalog no longer keeps: past ``keep_versions`` and held by no rank (a
   version a request was admitted on stays while a rank holds it); those the ranks let go of later retire in the
   controller's health rounds (``retire_released``).
An unregistered adapter's pushed versions go with it (``forget``).

A retired pushed version's directory lingers ``LINGER_ROUNDS`` health rounds before it is removed: an engine's rank 0
accepts a request pinned to an older version while its own catalog keeps it, and the controller hears of the
request only in the engine's next queue report (milliseconds later). A queue report or hint that names a lingering
version brings it back into the catalog (``revive``, as the oldest older version), where its use keeps it as any
named version's; before, the controller removed its directory at once and the request failed on every rank.

A rank on another node has no copy of the controller's node memory: it asks for the version's bytes
(``payload``, only for a version the catalog keeps or a push being registered), proves them against the version it
was given and keeps a copy in its own node's push area (``workers.control.node_copies``); the versions retired here
are then dropped from those copies too (``WorkerFanout.drop_pushed``, only for names some rank copied), and an
unregistered name's copies go when each rank forgets it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import ray

from lora_cache.adapters.catalog import Registered, check_name
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.pushed import PushArea, PushDigest, check_push, check_tag, digest
from lora_cache.controller.core import ControllerCore, named_versions
from lora_cache.controller.registrations import Registrar
from lora_cache.errors import CapacityError, ConflictError, NotFoundError

LINGER_ROUNDS = 4  # health rounds a retired pushed version's directory outlives its retirement (``revive``)


class Pushed(NamedTuple):
    """A push's answer: the name, the trainer's tag, the version registered (a content hash), the version it
    replaced ("" if the name was new), and the ranks that did not answer (given it when they come back)."""

    name: str
    tag: str
    version: str
    previous: str
    rank_pending: tuple[str, ...] = ()


class Pushes:
    """The controller's side of pushed versions (the module's docstring)."""

    def __init__(self, core: ControllerCore, registrar: Registrar, service: str) -> None:
        catalog = core.config.catalog
        self.core, self.registrar = core, registrar
        self.area = PushArea(catalog.push_root(), service, catalog.push_bytes)
        self.pushes = self.refused = 0
        self.unregistered: Counter[Path] = Counter()  # pushes' directories not yet registered (or refused)
        self.copied: set[str] = set()  # names some rank on another node copied a version of (``payload``)
        self.node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self.rounds = 0  # health rounds (``retire_released``)
        self._area_dir = self.area.dir.resolve()  # a retired version's path under it: pushed here (``_retired``)
        self._lock = threading.Lock()  # ``lingering``: trims run on registration threads too
        # name -> version -> (its spec, the round it was retired in): retired pushed versions whose directory lingers
        self.lingering: dict[str, dict[str, tuple[AdapterSpec | Registered, int]]] = {}
        self.revived: dict[str, set[str]] = {}  # versions ``revive`` kept again, until the next health round
        core.catalog.retirement.watch(self._retired)
        # a push gives up the device version registered ahead under its tag, if any (``DevicePushes.displace``)
        self.displace: Callable[[str, str], Awaitable[None]] | None = None
        core.catalog.use(lambda name: self.revived.get(name, ()))
        core.revive = self.revive

    async def push(self, name: str, tag: str | int | None, config_bytes: bytes, weights: bytes) -> Pushed:
        """Check, keep and register one pushed version (the module's docstring); its ``Pushed``, or the error."""
        content: PushDigest | None = None
        try:
            check_name(name)
            tag = None if tag in (None, "") else check_tag(tag)
            catalog = self.core.catalog
            await asyncio.to_thread(check_push, name, config_bytes, weights, catalog.shape, catalog.config.max_rank)
            if tag is None:  # the content's hash names it: hashed before it is written
                content = await asyncio.to_thread(digest, config_bytes, weights)
                tag = content.tag
        except Exception:
            self.refused += 1
            raise
        if self.displace is not None:
            await self.displace(name, tag)
        target, new = self.area.path(name, tag), False
        self.claim(target)  # from before its write until it is registered or refused: no retire takes it
        try:
            if content is None:  # hashed from memory while it is written (both off the GIL)
                content, (path, new) = await asyncio.gather(asyncio.to_thread(digest, config_bytes, weights),
                                                            self.write(name, tag, config_bytes, weights))
            else:
                path, new = await self.write(name, tag, config_bytes, weights)
            assert content is not None
            # registered under the version hashed from memory: its file is not read back (``PushDigest.known``)
            (done,) = await self.registrar.register([(name, str(path))], {str(path): content.known(path)})
            if done.error is not None:
                raise done.error
            if done.rank_errors:
                raise ConflictError(f"pushed {name}@{tag} is registered as version {done.version}, but "
                                    f"{len(done.rank_errors)} rank(s) refused it: {'; '.join(done.rank_errors)}")
        except BaseException:
            self.release(target)
            if new:  # what it wrote goes, unless the catalog keeps it after all
                await asyncio.to_thread(self.area.retire, name, self.kept(name))
            self.refused += 1
            raise
        self.release(target)
        self.pushes += 1
        await self._retire(name)
        return Pushed(name, tag, done.version, done.previous, done.rank_pending)

    async def write(self, name: str, tag: str, config_bytes: bytes, weights: bytes) -> tuple[Path, bool]:
        """``PushArea.write`` off the loop; past ``push_bytes`` with versions lingering, they go first (a lingering
        directory is a courtesy to a request not reported yet, never a reason to refuse a push) and it is tried
        again."""
        try:
            return await asyncio.to_thread(self.area.write, name, tag, config_bytes, weights)
        except CapacityError:
            with self._lock:
                names, self.lingering = sorted(self.lingering), {}
            if not names:
                raise
            for lingered in names:
                await self._retire(lingered)
            return await asyncio.to_thread(self.area.write, name, tag, config_bytes, weights)

    def claim(self, target: Path) -> None:
        """A version's directory ``target`` is being written or registered: no retire takes it until ``release``."""
        self.unregistered[target] += 1

    def release(self, target: Path) -> None:
        """``claim``'s end: ``target`` registered, or refused."""
        self.unregistered[target] -= 1
        if not self.unregistered[target]:
            del self.unregistered[target]

    def _retired(self, name: str, specs: list[AdapterSpec | Registered]) -> None:
        """The catalog retired these versions: those pushed here linger (the module's docstring)."""
        pushed = {s.version: (s, self.rounds) for s in specs
                  if isinstance(s.path, Path) and s.path.is_relative_to(self._area_dir)}
        if pushed:  # trims run on registration threads too
            with self._lock:
                self.lingering.setdefault(name, {}).update(pushed)

    def revive(self, name: str, ref: str) -> bool:
        """``name``'s lingering version named ``ref`` (its version or its pushed tag), kept again in the catalog as its
        oldest older version (``Retirement.restore``); False if none lingers."""
        with self._lock:
            found = [(v, spec) for v, (spec, _) in self.lingering.get(name, {}).items() if ref in (v, spec.path.name)]
        for version, spec in found:
            self.revived.setdefault(name, set()).add(version)  # kept until its queue entry or hint is in the view
            if self.core.catalog.retirement.restore(spec):
                with self._lock:
                    self.lingering.get(name, {}).pop(version, None)
                return True
        return False

    async def retire_released(self) -> list[str]:
        """Retire the older versions past ``keep_versions`` that no rank holds any more (``AdapterCatalog.trim`` of
        each adapter a rank let go of a version of since the last call: ``ReadinessIndex.released``), and their
        pushed directories; the names that had some."""
        core = self.core
        self.rounds += 1
        self.revived = {}  # what ``revive`` kept is named in the view by now (or retires below)
        names, core.readiness.released = core.readiness.released | core.named, set()
        # a version a waiting request or a hint names is kept until they are gone (``named_versions``): asked again
        core.named = {name for name in core.named if name in core.catalog and named_versions(core.planner.view, name)}
        retired = [name for name in sorted(names) if name in core.catalog and core.catalog.trim(name)]
        expired = set()
        with self._lock:
            for name, versions in list(self.lingering.items()):
                if gone := [v for v, (_, at) in versions.items() if self.rounds - at >= LINGER_ROUNDS]:
                    expired.add(name)
                    for version in gone:
                        del versions[version]
                if not versions:
                    del self.lingering[name]
        for name in sorted(set(retired) | expired):
            await self._retire(name)
        return retired

    async def _retire(self, name: str) -> None:
        """Remove the pushed versions of ``name`` the catalog no longer keeps, here and in other nodes' copies."""
        removed = await asyncio.to_thread(self.area.retire, name, self.kept(name))
        if removed and name in self.copied:
            await self.registrar.fanout.drop_pushed(name, removed, self.node, str(self.area.dir))

    async def payload(self, name: str, tag: str) -> tuple[bytes, np.ndarray]:
        """The bytes of pushed version ``NAME/TAG`` (its config's and its weights'), for a rank on another node to
        copy (the module's docstring); NotFoundError unless the catalog keeps it or it is being registered."""
        path = self.area.path(check_name(name), check_tag(tag))
        if path.resolve() not in {p.resolve() for p in self.kept(name)} or not path.is_dir():
            raise NotFoundError(f"pushed version {name}@{tag} is not kept by this service (retired, never pushed, or "
                                "another service's); register the name's current version again")
        self.copied.add(name)
        return await asyncio.to_thread(self.area.read, name, tag)

    def kept(self, name: str) -> set[Path]:
        """The directories of the versions of ``name`` the catalog keeps, and of its pushes being written or
        registered (a retire computed meanwhile, by another push of the name or a health round, would take a
        directory the catalog is about to name, and the ranks would find it gone): the push area keeps those."""
        with self._lock:
            lingering = {s.path for s, _ in self.lingering.get(name, {}).values() if isinstance(s.path, Path)}
        return (set(self.core.catalog.paths(name).values()) | {p for p in self.unregistered if p.parent.name == name}
                | lingering)

    async def forget(self, name: str) -> None:
        """``name`` was unregistered: its pushed versions go."""
        with self._lock:
            self.lingering.pop(name, None)
        await asyncio.to_thread(self.area.retire, name, set())
