"""Request-time resolution (lifecycle step 0; issue 44 item 4): a name nobody registered, asked for by a request,
registered on demand from the catalog's roots.

Platforms with thousands of tenants add adapters all day; a request for a new tenant's adapter should serve without
an operator's step. A request (``Route``, or an engine's ``resolve_adapter``) naming an adapter the catalog lacks
asks the ``Resolver``, which looks for it under each of ``adapter_roots`` in order (a directory ``ROOT/NAME``, a
store prefix ``s3://BUCKET/PREFIX/NAME``) and registers the first it finds through the ``Registrar``, as
``register`` would. Bounded on every side, so no request pattern becomes a herd on the store:

- **one lookup per name**: requests for a name being resolved wait for the same flight (single-flight);
- **a name found nowhere** is answered "not found" for ``resolve_miss_s`` without asking the roots again;
- **a deadline** (``resolve_s``) for each request's wait (the flight goes on for the next one);
- **caps**: ``resolve_parallel`` names at once, ``resolve_bytes`` of weights registered on demand in all.

Each refusal is its own type for the router: ``NotFoundError`` (not under any root), ``CapacityError`` (over
capacity), ``ResolveTimeoutError`` (timed out); a name under a root whose adapter is bad gets that adapter's error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from lora_cache.adapters.catalog import AdapterCatalog, check_name
from lora_cache.adapters.objects import is_store_url
from lora_cache.adapters.refs import base_name
from lora_cache.errors import (
    AdapterMissingError,
    CapacityError,
    LoraCacheError,
    NotFoundError,
    ResolveTimeoutError,
)

if TYPE_CHECKING:
    from lora_cache.controller.core import HintOutcome

Register = Callable[[str, str], Awaitable[tuple[str, LoraCacheError | None]]]  # (name, path) -> (version, error)


class Resolver:
    """Unregistered names registered on demand from the catalog's roots (the module's rules)."""

    def __init__(self, catalog: AdapterCatalog, register: Register) -> None:
        self.catalog, self.register = catalog, register
        self.config = catalog.config
        self._flights: dict[str, asyncio.Task[str]] = {}  # name -> its one lookup in progress
        self._missing: dict[str, float] = {}  # name -> until when it is answered "not found" (time.monotonic())
        self.resolved_bytes = 0  # weights registered on demand so far
        self.lookups = self.resolved = self.refused = 0  # counted for status
        self._later: set[asyncio.Task[None]] = set()  # background resolutions for hints (``later``)
        self.hints_dropped = 0  # hints whose name could not be resolved
        # names an operator unregistered (the newest 4096): a hint never registers one again (``may_find``); a
        # request (``resolve``) still may, as it may any name under a root
        self.unregistered: dict[str, None] = {}

    def on(self) -> bool:
        return self.config.resolve_s > 0 and bool(self.config.adapter_roots)

    async def resolve(self, name: str) -> str:
        """The version of ``name``, registered on demand if it lies under a root; the module's typed errors."""
        if name in self.catalog:
            return self.catalog.get(name).version
        check_name(name)
        if not self.on():
            raise self._not_found(name, "on-demand registration is off (--resolve-s 0) or there are no roots")
        now = time.monotonic()
        if self._missing.get(name, 0.0) > now:
            raise self._not_found(name, "it was under none of the roots moments ago")
        flight = self._flights.get(name)
        if flight is None:
            if len(self._flights) >= self.config.resolve_parallel:
                self.refused += 1
                raise CapacityError(
                    f"adapter {name!r} is not registered and {len(self._flights)} names are being resolved on demand "
                    f"already (--resolve-parallel {self.config.resolve_parallel}): over capacity; retry shortly, or "
                    "register it ahead (lora-cache register NAME PATH)")
            flight = self._flights[name] = asyncio.get_running_loop().create_task(self._lookup(name))
            flight.add_done_callback(lambda _: self._flights.pop(name, None))
        try:
            return await asyncio.wait_for(asyncio.shield(flight), self.config.resolve_s)
        except TimeoutError:
            raise ResolveTimeoutError(
                f"adapter {name!r} is not registered and its on-demand registration did not end within "
                f"--resolve-s {self.config.resolve_s:g} s (it goes on: a later request may find it registered); "
                "retry, or register it ahead (lora-cache register NAME PATH)") from None

    async def _lookup(self, name: str) -> str:
        """Each root in order: the first that holds ``name`` registers it; none: "not found" for a while."""
        self.lookups += 1
        for root in self.config.adapter_roots:
            path = f"{root.rstrip('/')}/{name}" if is_store_url(root) else str(Path(root) / name)
            if not is_store_url(root) and not await asyncio.to_thread(Path(path).is_dir):
                continue
            if self.resolved_bytes >= self.config.resolve_bytes:
                self.refused += 1
                raise CapacityError(
                    f"adapter {name!r} is not registered, and the adapters registered on demand hold "
                    f"{self.resolved_bytes} bytes (--resolve-bytes {self.config.resolve_bytes}): over capacity; "
                    "register it ahead (lora-cache register NAME PATH), or raise --resolve-bytes")
            version, error = await self.register(name, path)
            if isinstance(error, AdapterMissingError):
                continue  # not under this store prefix
            if error is not None:
                raise error
            self.resolved += 1
            self.resolved_bytes += self.catalog.get(name).file_bytes
            return version
        self._missing[name] = time.monotonic() + self.config.resolve_miss_s
        if len(self._missing) > 4 * 4096:  # forget the oldest misses: a scan of names cannot grow it without end
            for old in sorted(self._missing, key=self._missing.__getitem__)[: len(self._missing) // 2]:
                del self._missing[old]
        raise self._not_found(name, f"it is under none of the roots {list(self.config.adapter_roots)}")

    @staticmethod
    def _not_found(name: str, why: str) -> NotFoundError:
        return NotFoundError(f"adapter {name!r} is not registered; register it first (lora-cache register NAME "
                             f"PATH), or put it under an adapter root: {why}")

    def forgot(self, name: str) -> None:
        """An operator unregistered ``name``: hints for it are refused as before, not resolved (``may_find``)."""
        self.unregistered.pop(name, None)
        self.unregistered[name] = None
        if len(self.unregistered) > 4096:
            del self.unregistered[next(iter(self.unregistered))]

    def may_find(self, name: str) -> bool:
        """Whether a lookup of ``name`` could find it, asked without one: a valid name not found lately, and a store
        root (only a lookup tells), or a local root holding its directory (a stat)."""
        if not self.on() or self._missing.get(name, 0.0) > time.monotonic() or name in self.unregistered:
            return False
        try:
            check_name(name)
        except LoraCacheError:
            return False
        return any(is_store_url(root) or (Path(root) / name).is_dir() for root in self.config.adapter_roots)

    def later(self, name: str, then: Callable[[], Awaitable[None]]) -> None:
        """Resolve ``name`` in the background, for a caller that does not wait (a hint), then ``then()`` once it is
        registered; a refusal (not found, over capacity, timed out) only counts (``hints_dropped``)."""
        async def run() -> None:
            try:
                await self.resolve(name)
            except LoraCacheError:
                self.hints_dropped += 1
                return
            await then()

        task = asyncio.get_running_loop().create_task(run())
        self._later.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._later.discard)

    def stats(self) -> dict[str, int]:
        return {"lookups": self.lookups, "resolved": self.resolved, "refused": self.refused,
                "resolved_bytes": self.resolved_bytes, "in_flight": len(self._flights),
                "hints_waiting": len(self._later), "hints_dropped": self.hints_dropped}


HintTuple = tuple[str, str, str, float]  # (hint id, adapter or A@REF, replica, expected in s)


def unregistered_hints(batches: list[list[HintTuple]], outcomes: list[HintOutcome], catalog: AdapterCatalog,
                       replicas: Collection[str], may_find: Callable[[str], bool],
                       ) -> tuple[list[HintOutcome], dict[str, list[HintTuple]]]:
    """The hints refused only because nobody registered their adapter (a known replica, an unknown name a root may
    hold: ``Resolver.may_find``): taken out of the rejections and answered as ignored (not taken now), with the
    hints by name, to be hinted again once the name resolves (``Resolver.later``): a router that hints a new
    tenant's request before routing it by ``Route`` gets it prefetched as soon as it is registered. A name no root
    holds stays rejected (NOT_FOUND, as before)."""
    waiting: dict[str, list[HintTuple]] = {}
    out = []
    for batch, outcome in zip(batches, outcomes):
        kept = []
        for rejection in outcome.rejections:
            hint = batch[rejection.index]
            name = base_name(hint[1])
            if (isinstance(rejection.error, NotFoundError) and hint[2] in replicas and name not in catalog
                    and may_find(name)):
                waiting.setdefault(name, []).append(hint)
            else:
                kept.append(rejection)
        deferred = len(outcome.rejections) - len(kept)
        out.append(outcome._replace(ignored=outcome.ignored + deferred, rejections=tuple(kept)) if deferred
                   else outcome)
    return out, waiting
