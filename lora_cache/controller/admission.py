"""What the controller believes of a rank's report (lifecycle step 7): the trust boundary of residency.

The readiness index (what Lookup, Watch and Route advertise) and the planner take a rank's word that it holds
``adapter@version`` only if (a) the version is registered (current or kept), (b) a reason to believe the load
exists: the controller commanded it to that rank, or the rank reported it started by its engine's ``acquire``
(``Delta.acquired``), or a controller restart found the rank holding it (once, at adoption: ``claims.py``), and
(c) no more of them than its slots; or the rank was known to hold it already (a version replaced or
unregistered since drains). Anything else is refused and counted (``refused_reports``, ``recent_refusals`` in
``status``). ``ControllerCore`` asks ``ReportAdmission`` for each delta (``admits``) and each full report
(``admitted``). What this does and does not prove: docs/decisions.md, "What a rank's word is worth".
"""

from __future__ import annotations

from collections import deque

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.controller.claims import Claims
from lora_cache.controller.readiness import RankState, ReadinessIndex
from lora_cache.planner import FleetView
from lora_cache.vocab import WorkerId

# one slot of a full report: (adapter, version, state, refs[, acquired]) (``describe()["residency"]``)
ResidencyRow = tuple[str, str, str, int] | tuple[str, str, str, int, bool]


class ReportAdmission:
    """Which residency claims reach the readiness index and the planner; the refused ones counted."""

    def __init__(self, catalog: AdapterCatalog, view: FleetView, readiness: ReadinessIndex) -> None:
        self.catalog, self.view, self.readiness = catalog, view, readiness
        self.claims = Claims()  # per rank, the loads commanded, acquired or adopted
        self.refused_reports = 0  # residency a rank claimed and the controller did not believe
        self.recent_refusals: deque[str] = deque(maxlen=20)

    def admits(self, worker: WorkerId, adapter: str, version: str, acquired: bool = False) -> bool:
        """Whether the controller takes a rank's word that it holds (or loads) ``adapter@version`` (the module's
        rule); ``acquired``: the rank says its engine's acquire started the load."""
        held = self.readiness.holdings(worker.replica, worker.rank)
        if (adapter, version) in held:
            return True
        slots = self.view.capacity(str(worker)).slots
        why = self._why_not(worker, adapter, version, acquired)
        if why is None and len(held) >= slots:
            why = f"{adapter}@{version} would be more than its {slots} slots hold (one adapter each)"
        if why is None:
            if acquired and self.claims.how(worker, (adapter, version)) is None:
                self.claims.add(worker, (adapter, version), "acquired", slots)
            return True
        self.refuse(worker, why)
        return False

    def _why_not(self, worker: WorkerId, adapter: str, version: str, vouched: bool) -> str | None:
        """Why a claim of ``adapter@version`` is not believed (None: it is); ``vouched``: the claim brings its
        own reason (an acquire's marker, a restart's adoption)."""
        if adapter not in self.catalog or (version not in self.catalog.versions(adapter)
                                           and not self.catalog.ahead.has(adapter, version)):
            return f"{adapter}@{version} is not a registered version"
        if vouched or self.claims.how(worker, (adapter, version)) is not None:
            return None
        return (f"{adapter}@{version}: the controller never commanded that load to this rank and the rank did not "
                "report it started by acquire; a rank's engine reports its own loads with Delta.acquired (an engine "
                "older than issue 46 does not: upgrade it)")

    def refuse(self, worker: WorkerId, why: str) -> None:
        self.refused_reports += 1
        self.recent_refusals.append(f"{worker}: {why}")

    def admitted(self, worker: WorkerId, rows: list[ResidencyRow], before: dict[tuple[str, str], RankState],
                 adopting: bool = False) -> list[tuple[str, str, str, int]]:
        """A full report's entries (adapter, version, state, refs[, acquired]) the controller believes: what the
        rank was known to hold first, then registered versions with a reason (``claims``; ``acquired``: the
        rank's acquire started the load; ``adopting``: a controller restart's adoption, which vouches for every
        registered version it finds, once), at most one per slot."""
        entries = [(r[0], r[1], r[2], r[3]) for r in rows]
        acquired = {(r[0], r[1]) for r in rows if len(r) > 4 and r[4] is True}
        slots, out = self.view.capacity(str(worker)).slots, list[tuple[str, str, str, int]]()
        for a, v, s, refs in sorted(entries, key=lambda e: (e[0], e[1]) not in before):
            why = None if (a, v) in before else self._why_not(worker, a, v, adopting or (a, v) in acquired)
            if why is None and (a, v) not in before and len(out) >= slots:
                why = f"{a}@{v} is beyond its {slots} slots"
            if why is not None:
                self.refuse(worker, f"full report: {why}")
                continue
            if (adopting or (a, v) in acquired) and self.claims.how(worker, (a, v)) is None:
                self.claims.add(worker, (a, v), "acquired" if (a, v) in acquired else "adopted", slots)
            out.append((a, v, s, refs))
        return out
