"""A TP replica's older versions retire on rank 0's word (lifecycle step 0 on the ranks; issue 44 item 3).

Registrations reach a replica's ranks one at a time, and rank 0 alone admits requests: a request pinned to an
older version ``A@v0`` is accepted while rank 0's catalog keeps v0, and the other ranks hear of it only in the round
that gives its version a row of the exchange. So a rank k > 0 whose catalog retired v0 on its own (a registration
that reached it first, or one between rank 0's take and that round) could not load the request's version, and
the request failed there. Now only rank 0's catalog retires by its own bound and users; each of its trims is
sent to every rank in the round's plan (``StepPlan.retired``), and the others' catalogs retire an unused version
past the bound only once rank 0 has (their ``Retirement`` gate). Rank 0 never admits a version its catalog
retired, so what it sends is safe everywhere. A version rank 0 never retires (it never had it) is held on the
others at most ``HELD_MAX`` versions past the bound, oldest going first.

It also holds the rank's other tie to its catalog's retirement: the versions the exchange's named rows name stay
loadable while a row names them (``named``: ``RankVersions.named_versions``, on every rank).
"""

from __future__ import annotations

import threading

from lora_cache.adapters.catalog import AdapterCatalog, Registered
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.refs import split_unchecked
from lora_cache.adapters.retirement import InUse
from lora_cache.errors import NotFoundError

HELD_MAX = 64  # unused versions past the bound a rank k > 0 holds for rank 0's word, per name
RETIRED_MAX = 4096  # rank 0's retirements kept for the next plan (an engine built but not serving: the oldest go;
# the other ranks then hold those until HELD_MAX)


class Releases:
    """One rank's side (the module's docstring): rank 0 ``take``s what its catalog retired since the last round;
    every other rank ``release``s it from the plan. A single rank (TP 1) neither watches nor gates."""

    def __init__(self, catalog: AdapterCatalog, rank: int, world: int, named: InUse) -> None:
        self.catalog, self.rank, self.named = catalog, rank, named
        catalog.use(named)
        self._lock = threading.Lock()  # trims run on registration threads, rounds on the engine's
        self._retired: list[str] = []  # rank 0: ``NAME@VERSION`` its catalog retired, not yet sent
        # rank k: name -> versions rank 0 retired that this catalog has (dropped here as it retires them: ``_gone``)
        self._released: dict[str, set[str]] = {}
        if world > 1 and rank == 0:
            catalog.retirement.watch(self._watched)
        elif world > 1:
            catalog.retirement.gate(self._gate)
            catalog.retirement.watch(self._gone)

    def _gone(self, name: str, specs: list[AdapterSpec | Registered]) -> None:
        """Rank k > 0: versions its catalog retired need no word any more."""
        with self._lock:
            if kept := self._released.get(name, set()) - {s.version for s in specs}:
                self._released[name] = kept
            else:
                self._released.pop(name, None)

    def _watched(self, name: str, specs: list[AdapterSpec | Registered]) -> None:
        with self._lock:
            self._retired += [f"{name}@{s.version}" for s in specs]
            del self._retired[:-RETIRED_MAX]

    def _gate(self, name: str, unused: list[str]) -> set[str]:
        with self._lock:
            released = self._released.get(name, set())
        return {v for i, v in enumerate(unused) if v in released or i < len(unused) - HELD_MAX}

    def take(self) -> tuple[str, ...]:
        """Rank 0: the versions its catalog retired since the last call, for the round's plan."""
        with self._lock:
            out, self._retired = tuple(self._retired), []
        return out

    def release(self, retired: tuple[str, ...]) -> None:
        """Rank k > 0: rank 0 retired these (the round's plan): retire them here too unless a use here keeps them."""
        if self.rank == 0 or not retired:
            return
        names: dict[str, set[str]] = {}
        for ref in retired:
            name, version = split_unchecked(ref)
            names.setdefault(name, set()).add(version)
        for name in sorted(names):
            try:  # a version this catalog lacks (never had, or gone) needs no word
                have = names[name] & set(self.catalog.versions(name))
            except NotFoundError:  # unregistered meanwhile: every version went
                continue
            with self._lock:
                self._released.setdefault(name, set()).update(have)
            self.catalog.trim(name)

    def close(self) -> None:
        self.catalog.unuse(self.named)
        self.catalog.retirement.unwatch(self._watched)
        self.catalog.retirement.unwatch(self._gone)
        self.catalog.retirement.ungate(self._gate)
