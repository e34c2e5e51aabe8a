"""Versions registered ahead of their device pushes (lifecycle step 0; issue 44 item 5).

A trainer's device push is READY once every rank of its replica took its shard from the trainer's buffer; the
controller's registration of the version (its checks, its id, the ranks told) is a Ray call and a fan-out, several
times an 8B rank-16 shard's copy. So a trainer may have its next version registered while it still trains the
step (``DevicePushes.reserve``): the version is checked and given its id, and every rank and the controller's
catalog hold it loadable by that id, current nowhere (``DeviceSource.ahead``), so that the push itself is the
trainer's doorbells and nothing else; its commit (the same version registered again without the flag) makes it
current, in the name's order (docs/decisions.md, "A device push registered ahead").

``Ahead`` holds one catalog's such versions, under the catalog's lock: ``AdapterCatalog.get`` finds them by exact
version, ``add`` (the commit) takes one out, ``unregister`` drops a name's. A name holds at most ``MAX_AHEAD`` that no
user holds (``Retirement.users``: a rank's slots): a trainer registers one ahead of each push, and one it never pushed
(it stopped, or pushed another tag) is let go when the next ones come, so a rank whose controller gave it up keeps at
most that many, and one a slot was filled with as long as that slot holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from lora_cache.errors import NotFoundError

if TYPE_CHECKING:
    from lora_cache.adapters.catalog import AdapterCatalog
    from lora_cache.adapters.peft import AdapterSpec

MAX_AHEAD = 2  # versions of one name registered ahead of their device pushes


class Ahead:
    """One catalog's versions registered ahead of their device pushes (the module's docstring)."""

    def __init__(self, catalog: AdapterCatalog) -> None:
        self.catalog = catalog

    def reserve(self, spec: AdapterSpec) -> None:
        """Hold ``spec`` (``DeviceSource.ahead``) loadable by its exact version, no current version changed, until
        the catalog's ``add`` makes it current or ``drop`` lets it go. NotFoundError if its name is not registered:
        a version is registered ahead of a name's next push only, and the first push registers the name."""
        catalog = self.catalog
        # the versions of the name its users hold (a rank's slots: one loaded from a lapsed reservation), asked
        # outside the lock as ``Retirement.trim`` asks them: those are never let go here
        used = frozenset(v for in_use in list(catalog.retirement.users) for v in in_use(spec.name))
        with catalog._lock:
            current = catalog._specs.get(spec.name)
            if current is None:
                raise NotFoundError(f"adapter {spec.name!r} is not registered: a version is registered ahead of a "
                                    "name's next device push only; push its first version")
            if current.version == spec.version:
                return  # committed already (its commit came first): nothing to hold ahead
            ahead = catalog._ahead.setdefault(spec.name, OrderedDict())
            ahead[spec.version] = spec
            older = [v for v in ahead if v not in used and v != spec.version]  # never the one just registered
            for version in older[: max(0, len(ahead) - MAX_AHEAD)]:
                del ahead[version]  # the oldest first
            catalog.generation += 1

    def drop(self, name: str, version: str) -> bool:
        """Let go of ``name@version`` registered ahead (its push never came); False if it is not held ahead."""
        catalog = self.catalog
        with catalog._lock:
            ahead = catalog._ahead.get(name)
            if ahead is None or ahead.pop(version, None) is None:
                return False
            if not ahead:
                del catalog._ahead[name]
            catalog.generation += 1
            return True

    def has(self, name: str, version: str) -> bool:
        """Whether ``name@version`` is held registered ahead."""
        with self.catalog._lock:
            return version in self.catalog._ahead.get(name, {})
