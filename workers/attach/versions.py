"""One version per request on every rank: the replica's view of adapter versions (invariant 1).

Re-registering an adapter reaches a replica's TP ranks one at a time, and each rank's catalog names its
own current version; so the engine never lets a rank pick a version. Every round each rank reports, per
adapter of the engine (``names``), one row of int64 codes; the element-wise minimum over the ranks (the
one all-reduce of the readiness exchange) tells rank 0 whether the ranks agree:

  FAILED        -1 if a load this rank started for the adapter failed (not for lack of room), else 0
  CUR, -CUR     the code of the version its catalog calls current (0: not registered here; ``PENDING``: not
                registered here yet, a name rank 0 added at run time whose registration is on its way here)
  RDY, -RDY     the code of a version READY here: the current one if it is, else the newest other
  STEP          -1 if this rank could not hold the adapter in the last step, else 0
  ISS           the code of the current version if it is READY here or its copy issued (its read done;
                ``WorkerCache.issued_keys``), else 0: where the ranks agree on the current version, the minimum
                is that code only if every rank has it so (one column: each rank's value is its CUR or 0);
                rules that read LOADING (``pipelined``) admit a request then, and serve it that version

A current version loadable from a trainer's image only (a device push's whose node copy has not landed:
``device_versions.image_only``) that is neither READY nor issued here is reported ``PENDING``, as a registration on its
way: a request may not be served it until its image load is issued (an acquire could not load it on demand; measured on
one H100, two requests of a worked example failed so at a trainer's first push, bench/reports/issue-44.md), and gets
the older version if that is READY on every rank.

Rank 0 then admits each request with one ``adapter@version`` (``serve``), which every rank acquires
exactly. A version is served to new requests only when it is READY on every rank; until the re-registered
(current) version is, new requests get the old one if that is READY everywhere, and the new one is
prefetched. A request keeps its version to its end: its rank holds the old slot until it is released.

A request may name one version, ``A@VERSION`` (issue 44 item 3; the engine's submit turns a tag into its version:
``lora_cache.adapters.refs``): such a name has a row of its own, whose CUR is that version's code if this rank's
catalog keeps it (loadable) and whose RDY and ISS follow that version only, so its requests are admitted at
exactly that version once it is READY on every rank, whatever the adapter's current version.

The names grow at run time (``RankVersions.append``): rank 0 adds the names its catalog registered since, in
the round's broadcast plan (``StepPlan.names``), and every rank appends them, in that order, before the next
exchange. On a rank whose catalog has not taken a new name's registration yet the name reports ``PENDING``
(the ranks disagree: its requests wait, as for a re-registration on its way); once a rank has had the name,
its absence there is an unregistration (0: FAILED).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.device_versions import image_only
from lora_cache.adapters.refs import versions_named
from lora_cache.errors import NotFoundError
from lora_cache.vocab import AdapterKey
from workers.lru import BoundedLRU


class Readiness(IntEnum):
    """An adapter's state on the replica: the minimum over its ranks."""

    FAILED = -1  # its load failed on some rank
    NOT_READY = 0  # not resident, or still loading, on some rank
    LOADING = 1  # on every rank READY or its copy issued (its read done) and due before a step's last layer
    READY = 2  # READY (and held for the engine) on every rank


FAILED, CUR, CUR_NEG, RDY, RDY_NEG, STEP, ISS = range(7)
COLUMNS = 7
PENDING = 1 << 62  # CUR of a name not registered on this rank yet (above every version code: never agreed on)


def version_code(version: str) -> int:
    """A non-zero int64 code of a version string (56 bits of its hash: distinct versions of one adapter
    collide with odds of about 2**-56)."""
    return int.from_bytes(hashlib.blake2b(version.encode(), digest_size=7).digest(), "little") + 1


class AdapterVersions(NamedTuple):
    """What the replica does with one adapter now."""

    serve: str | None  # the version new requests get: READY on every rank, else the agreed current one;
    # None: none (the ranks' catalogs disagree, a registration on its way, and none is READY everywhere)
    current: str | None  # the version every rank's catalog calls current (None: they disagree)


class RankVersions:
    """One rank's report (``rows``); it also remembers which version each code stands for (``codes``)."""

    def __init__(self, catalog: AdapterCatalog, names: Sequence[str]) -> None:
        self.catalog = catalog
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.named: list[str] = []  # the rows of named versions (``A@VERSION``), in exchange order: kept here so that
        # rank 0's round (``NamedRows.dropped``) reads these few, not every name of the exchange
        self._seen = np.zeros(0, dtype=bool)  # per name: registered here at some point (else PENDING)
        self._cur = np.zeros(0, dtype=np.int64)
        self._image = np.zeros(0, dtype=bool)  # per name: its current (or named) version loadable from an image only
        self._code_of: dict[str, int] = {}  # version -> code (cached: hashing per round costs)
        self.codes: dict[int, str] = {}  # code -> version, of the versions this rank knows
        self.append(names)
        self._seen[:] = True  # ``names``: absent here means unregistered (FAILED); appended ones start PENDING

    def append(self, names: Sequence[str]) -> None:
        """Add ``names`` to the exchange, after those it has (every rank the same names in the same order, at
        the same round: the caller's broadcast); names it has already are an error (the ranks would diverge).
        Each reports ``PENDING`` here until this rank's catalog has it, then as the others."""
        if dup := sorted({n for n in names if n in self.index or list(names).count(n) > 1}):
            raise ValueError(f"names {dup[:8]} are in the version exchange already (or given twice); append only "
                             "names rank 0 found new")
        self.names = [*self.names, *names]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.named = [*self.named, *(n for n in names if "@" in n)]
        self._seen = np.concatenate([self._seen, np.zeros(len(names), dtype=bool)])
        self._cur = np.concatenate([self._cur, np.zeros(len(names), dtype=np.int64)])
        self._image = np.concatenate([self._image, np.zeros(len(names), dtype=bool)])
        self._generation = -1  # the catalog generation ``_cur`` was computed at (-1: recompute)

    def drop(self, names: Sequence[str]) -> None:
        """Remove the rows of ``names`` (named versions no request uses any more: ``workers.engine.engine.NamedRows``),
        every rank the same names at the same round, as ``append``; a name it lacks is an error (the ranks would
        diverge). A later request naming one appends its row again."""
        if not names:
            return
        if missing := sorted(n for n in names if n not in self.index):
            raise ValueError(f"names {missing[:8]} are not in the version exchange; drop only rows rank 0 found idle")
        gone = set(names)
        keep = np.array([n not in gone for n in self.names], dtype=bool)
        self.names = [n for n in self.names if n not in gone]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.named = [n for n in self.named if n not in gone]
        self._seen, self._cur, self._image = self._seen[keep], self._cur[keep], self._image[keep]
        self._generation = -1

    def named_versions(self, name: str) -> set[str]:
        """The versions of ``name`` the named rows (``A@VERSION``) name: what a rank's catalog keeps past
        ``keep_versions`` for the requests that named them (``RankEngine``'s catalog user). Safe from any thread:
        ``named`` is replaced whole on a change, never mutated."""
        return versions_named(self.named, name)

    def rows(self, ready: Iterable[AdapterKey], failed_loads: Iterable[str] = (),
             failed_steps: Iterable[str] = (), issued: Iterable[AdapterKey] = ()) -> torch.Tensor:
        """This rank's report: [len(names), COLUMNS] int64 (``ready``: the versions READY here; ``issued``:
        those LOADING with every copy issued)."""
        self._refresh()
        out = np.zeros((len(self.names), COLUMNS), dtype=np.int64)
        cur = self._cur
        rdy = np.zeros_like(cur)
        iss = np.zeros_like(cur)
        for key in ready:
            code = self._code(key.version)
            if (j := self.index.get(f"{key.name}@{key.version}")) is not None:
                rdy[j] = code  # a row naming this very version
            i = self.index.get(key.name)
            if i is None:
                continue
            if rdy[i] != cur[i] and (code == cur[i] or code > rdy[i]):  # the current version wins
                rdy[i] = code
        for key in issued:
            for i in (self.index.get(key.name), self.index.get(f"{key.name}@{key.version}")):
                if i is not None and self._code(key.version) == cur[i]:
                    iss[i] = cur[i]
        iss = np.where((rdy == cur) & (cur > 0), cur, iss)  # READY counts as issued (some rank may lag)
        cur = np.where(self._image & (iss == 0), PENDING, cur)  # loadable from its image only: not servable yet
        out[:, CUR], out[:, CUR_NEG], out[:, RDY], out[:, RDY_NEG] = cur, -cur, rdy, -rdy
        out[:, ISS] = iss
        out[[self.index[n] for n in failed_loads if n in self.index], FAILED] = -1
        out[[self.index[n] for n in failed_steps if n in self.index], STEP] = -1
        return torch.from_numpy(out)

    def _code(self, version: str) -> int:
        code = self._code_of.get(version)
        if code is None:
            code = self._code_of[version] = version_code(version)
            self.codes[code] = version
        return code

    def _refresh(self) -> None:
        """Recompute the current versions' codes when the catalog changed (a registration)."""
        generation = self.catalog.generation
        if generation == self._generation:
            return
        self._code_of, self.codes = {}, {}  # bounded: what the catalog keeps, plus resident versions
        for i, name in enumerate(self.names):
            base, _, pinned = name.partition("@")  # "A@VERSION": a row of that version alone
            try:
                versions = self.catalog.versions(base)
            except NotFoundError:  # unregistered here, or (never here yet) its registration on its way
                versions = []
            if pinned and pinned not in versions:  # not (or no longer) kept here, or its registration on its way
                versions = []
            if not versions:
                self._cur[i] = 0 if self._seen[i] else PENDING
                self._image[i] = False
                continue
            self._seen[i] = True
            for version in versions:
                self._code(version)
            code = self._code(pinned or versions[-1])
            if code != self._cur[i] or self._image[i]:  # a new current version, or one that may have landed since
                self._image[i] = image_only(self.catalog, base, pinned or versions[-1])
            self._cur[i] = code
        self._generation = generation


class ReducedVersions:
    """Rank 0's reading of the ranks' reports reduced into one (``reduce_min``, the all-reduce): readiness,
    versions and last step's failures per adapter."""

    def __init__(self, reduced: torch.Tensor, names: Sequence[str], codes: Mapping[int, str]) -> None:
        a = reduced.numpy()
        self.names, self.codes = names, codes
        self.cur = a[:, CUR]
        agreed = (a[:, CUR] == -a[:, CUR_NEG]) & (a[:, CUR] > 0)
        self.ready = (a[:, RDY] == -a[:, RDY_NEG]) & (a[:, RDY] > 0)
        self.rdy = a[:, RDY]
        self.agreed = agreed
        gone = a[:, CUR] == 0  # unregistered on some rank: no new use
        failed = (a[:, FAILED] < 0) & ~self.ready  # a version READY everywhere is served despite a failed upgrade
        # the current version READY or its copy issued on every rank (served: ``decode`` gives the current one)
        loading = agreed & (a[:, ISS] == a[:, CUR]) & ~self.ready
        self.state = np.where(gone | failed, int(Readiness.FAILED),
                              np.where(self.ready, int(Readiness.READY),
                                       np.where(loading, int(Readiness.LOADING), int(Readiness.NOT_READY))))
        self.step_failed = a[:, STEP] < 0

    def readiness(self) -> dict[str, Readiness]:
        """The adapters with a state other than NOT_READY (the scheduler's default)."""
        return {self.names[int(i)]: Readiness(int(self.state[i])) for i in np.flatnonzero(self.state)}

    def versions(self) -> Mapping[str, AdapterVersions]:
        """name -> ``AdapterVersions``, decoded when asked (the scheduler asks only for its requests')."""
        return _Versions(self)

    def step_failures(self) -> set[str]:
        return {self.names[int(i)] for i in np.flatnonzero(self.step_failed)}

    def decode(self, i: int) -> AdapterVersions:
        current = self.codes.get(int(self.cur[i])) if self.agreed[i] else None
        serve = self.codes.get(int(self.rdy[i])) if self.ready[i] else current
        return AdapterVersions(serve, current)


class _Versions(Mapping[str, AdapterVersions]):
    def __init__(self, view: ReducedVersions) -> None:
        self._view = view
        self._index = {n: i for i, n in enumerate(view.names)}

    def __getitem__(self, name: str) -> AdapterVersions:
        i = self._index.get(name)
        if i is None:  # a name added this round (``StepPlan.names``): in the exchange from the next round on
            return AdapterVersions(None, None)
        return self._view.decode(i)

    def __iter__(self) -> Iterator[str]:
        return iter(self._view.names)

    def __len__(self) -> int:
        return len(self._view.names)


def reduce_min(reports: Sequence[torch.Tensor]) -> torch.Tensor:
    """What the all-reduce (MIN) makes of the ranks' reports: for callers that hold every rank in one
    process (tests, the simulator)."""
    out = reports[0].clone()
    for r in reports[1:]:
        torch.minimum(out, r, out=out)
    return out


class VersionExchange:
    """An attached rank's side of the exchange (``Attachment.version_rows`` / ``agree``): a ``RankVersions`` per
    list of names the engine asks about, kept in the order first asked (engines ask for few: bounded, the oldest
    list dropped first)."""

    def __init__(self, catalog: AdapterCatalog) -> None:
        self.catalog = catalog
        self._tables: BoundedLRU[tuple[str, ...], RankVersions] = BoundedLRU(64)  # per name list: its code tables

    def tables(self, names: Sequence[str]) -> RankVersions:
        return self._tables.get_or_create(tuple(names), lambda: RankVersions(self.catalog, names), refresh=False)

    def rows(self, names: Sequence[str], ready: Iterable[AdapterKey], failed_loads: Sequence[str] = (),
             failed_steps: Sequence[str] = ()) -> torch.Tensor:
        return self.tables(names).rows(ready, failed_loads, failed_steps)

    def agree(self, reduced: torch.Tensor | Sequence[torch.Tensor],
              names: Sequence[str]) -> dict[str, AdapterKey | None]:
        if not isinstance(reduced, torch.Tensor):
            reduced = reduce_min(list(reduced))
        versions = ReducedVersions(reduced, names, self.tables(names).codes).versions()
        return {n: None if (v := versions[n].serve) is None else AdapterKey(n, v) for n in names}
