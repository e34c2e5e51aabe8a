"""Older versions retired by use, past a bound (lifecycle step 0; issue 44 item 3).

An ``AdapterCatalog`` keeps, besides each name's current version, older ones loadable by exact version for the
requests admitted on them: the ``keep_versions`` newest, and past that bound those still in use. Who uses a
version says so itself (``use``): a rank's cache names the versions its slots hold or are loading, the
controller those any rank reports. ``trim`` retires the older versions past the bound that no user names; a user
calls it when a use ends (a slot freed, a rank's report of one gone), and the catalog after each registration.
A version whose files were rewritten in place goes at once whatever its use (the catalog's ``add``): its bytes
are gone. docs/decisions.md, "A version retires by use, past a bound", says why use and not a lease or a timer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lora_cache.adapters.catalog import AdapterCatalog

InUse = Callable[[str], Collection[str]]  # a name -> the versions of it in use there


class Retirement:
    """One catalog's older versions retired by use (the module's docstring); it works under the catalog's lock."""

    def __init__(self, catalog: AdapterCatalog) -> None:
        self.catalog = catalog
        self.users: list[InUse] = []

    def use(self, in_use: InUse) -> None:
        """Keep the older versions ``in_use(name)`` names loadable past ``keep_versions`` until a ``trim`` finds
        them no longer in use. ``in_use`` is called without the catalog's lock held (it may take its own locks,
        e.g. a rank's slot book) and must not call the catalog."""
        self.users.append(in_use)

    def unuse(self, in_use: InUse) -> None:
        """Stop asking ``in_use`` (its owner closed); what it kept retires at the next ``trim`` or registration."""
        if in_use in self.users:
            self.users.remove(in_use)

    def trim(self, name: str) -> list[str]:
        """Retire the older versions of ``name`` past ``keep_versions`` that no user names any more; the versions
        retired (none: nothing changed, and the catalog's ``generation`` stays)."""
        catalog = self.catalog
        with catalog._lock:
            if len(catalog._older.get(name, ())) <= catalog.config.keep_versions:
                return []  # nothing past the bound: the common case, without asking the users
        used = frozenset(v for in_use in list(self.users) for v in in_use(name))
        with catalog._lock:
            older = catalog._older.get(name)
            if older is None:
                return []
            stale = list(older)[: max(0, len(older) - catalog.config.keep_versions)]
            dropped = [v for v in stale if v not in used]
            for version in dropped:
                del older[version]
                catalog._parsed.pop((name, version), None)
            if not older:
                del catalog._older[name]
            if dropped:
                catalog.generation += 1
            return dropped
