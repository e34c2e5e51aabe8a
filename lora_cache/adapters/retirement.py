"""Older versions retired by use, past a bound (lifecycle step 0; issue 44 item 3).

An ``AdapterCatalog`` keeps, besides each name's current version, older ones loadable by exact version for the
requests admitted on them: the ``keep_versions`` newest, and past that bound those still in use. Who uses a
version says so itself (``use``): a rank's cache names the versions its slots hold or are loading, the
controller those any rank reports. ``trim`` retires the older versions past the bound that no user names; a user
calls it when a use ends (a slot freed, a rank's report of one gone), and the catalog after each registration.
A version whose files were rewritten in place goes at once whatever its use (the catalog's ``add``): its bytes
are gone. docs/decisions.md, "A version retires by use, past a bound", says why use and not a lease or a timer.

Where one process decides for several (a TP replica: rank 0 admits every request, so only it knows what a request
submitted there names before the other ranks hear of it), the others ``gate`` their retirement on its word: a
gate names the versions it lets go (``Gate``), and rank 0 ``watch``es what its own trims retire, to send it to
them (``workers.engine.releases``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lora_cache.adapters.catalog import AdapterCatalog, Registered
    from lora_cache.adapters.peft import AdapterSpec

InUse = Callable[[str], Collection[str]]  # a name -> the versions of it in use there
Gate = Callable[[str, list[str]], Collection[str]]  # a name, its unused versions past the bound -> those it lets go
Watcher = Callable[[str, "list[AdapterSpec | Registered]"], None]  # a name, the versions a trim retired


class Retirement:
    """One catalog's older versions retired by use (the module's docstring); it works under the catalog's lock."""

    def __init__(self, catalog: AdapterCatalog) -> None:
        self.catalog = catalog
        self.users: list[InUse] = []
        self.gates: list[Gate] = []
        self.watchers: list[Watcher] = []

    def use(self, in_use: InUse) -> None:
        """Keep the older versions ``in_use(name)`` names loadable past ``keep_versions`` until a ``trim`` finds
        them no longer in use. ``in_use`` is called without the catalog's lock held (it may take its own locks,
        e.g. a rank's slot book) and must not call the catalog."""
        self.users.append(in_use)

    def unuse(self, in_use: InUse) -> None:
        """Stop asking ``in_use`` (its owner closed); what it kept retires at the next ``trim`` or registration."""
        if in_use in self.users:
            self.users.remove(in_use)

    def gate(self, gate: Gate) -> None:
        """Retire an unused version past the bound only once every gate lets it go (``gate(name, stale)``: the name
        and its unused versions past the bound, oldest first; called without the catalog's lock, as a user is);
        ``ungate`` it when its owner closes."""
        self.gates.append(gate)

    def ungate(self, gate: Gate) -> None:
        if gate in self.gates:
            self.gates.remove(gate)

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher(name, specs)`` after each trim that retired versions, with their specs, oldest first
        (outside the catalog's lock; it must not call the catalog); ``unwatch`` it when its owner closes."""
        self.watchers.append(watcher)

    def unwatch(self, watcher: Watcher) -> None:
        if watcher in self.watchers:
            self.watchers.remove(watcher)

    def restore(self, spec: AdapterSpec | Registered) -> bool:
        """Keep ``spec`` again as the oldest of its name's older versions (one retired moments ago, past the bound,
        that a request turns out to name: ``controller.pushes.Pushes.revive``; its caller's use keeps it, as no trim
        runs here); False if the name is not registered or has that version already."""
        catalog = self.catalog
        with catalog._lock:
            current = catalog._specs.get(spec.name)
            if current is None or current.version == spec.version or spec.version in catalog._older.get(spec.name, {}):
                return False
            older = catalog._older.setdefault(spec.name, OrderedDict())
            older[spec.version] = spec
            older.move_to_end(spec.version, last=False)
            catalog.generation += 1
            return True

    def trim(self, name: str) -> list[str]:
        """Retire the older versions of ``name`` past ``keep_versions`` that no user names any more; the versions
        retired (none: nothing changed, and the catalog's ``generation`` stays)."""
        catalog = self.catalog
        with catalog._lock:
            if len(catalog._older.get(name, ())) <= catalog.config.keep_versions:
                return []  # nothing past the bound: the common case, without asking the users
        used = frozenset(v for in_use in list(self.users) for v in in_use(name))
        gates = list(self.gates)
        let_go: set[str] = set()  # with gates: the unused versions past the bound, as the lock saw them, all let go
        if gates:
            with catalog._lock:
                seen = list(catalog._older.get(name, ()))
            unused = [v for v in seen[: max(0, len(seen) - catalog.config.keep_versions)] if v not in used]
            let_go = set(unused)
            for gate in gates:
                let_go &= set(gate(name, unused))
        with catalog._lock:
            older = catalog._older.get(name)
            if older is None:
                return []
            stale = list(older)[: max(0, len(older) - catalog.config.keep_versions)]
            dropped = [v for v in stale if v not in used and (not gates or v in let_go)]
            specs = [older.pop(version) for version in dropped]
            for version in dropped:
                catalog._parsed.pop((name, version), None)
            if not older:
                del catalog._older[name]
            if dropped:
                catalog.generation += 1
        if dropped:
            for watcher in list(self.watchers):
                watcher(name, specs)
        return dropped
