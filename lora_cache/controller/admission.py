"""What the controller believes of a rank's report (lifecycle step 7): the trust boundary of residency.

The readiness index (what Lookup, Watch and Route advertise) takes a rank's word that it holds
``adapter@version`` only for a version the controller registered (current or kept), or one the rank was
known to hold already (a version replaced or unregistered since drains), and no more of them than its
slots. Anything else is refused and counted (``refused_reports``, ``recent_refusals`` in ``status``).
``ControllerCore`` asks ``ReportAdmission`` for each delta (``admits``) and each full report (``admitted``).
"""

from __future__ import annotations

from collections import deque

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.controller.readiness import RankState, ReadinessIndex
from lora_cache.planner import FleetView
from lora_cache.vocab import WorkerId


class ReportAdmission:
    """Which residency claims reach the readiness index; the refused ones counted."""

    def __init__(self, catalog: AdapterCatalog, view: FleetView, readiness: ReadinessIndex) -> None:
        self.catalog, self.view, self.readiness = catalog, view, readiness
        self.refused_reports = 0  # residency a rank claimed and the controller did not believe (``admits``)
        self.recent_refusals: deque[str] = deque(maxlen=20)

    def admits(self, worker: WorkerId, adapter: str, version: str) -> bool:
        """Whether the readiness index takes a rank's word that it holds ``adapter@version`` (the module's
        rule); the planner still counts the slot as taken (of a registered name), so a stale version is
        evicted."""
        held = self.readiness.holdings(worker.replica, worker.rank)
        if (adapter, version) in held:
            return True
        known = adapter in self.catalog and version in self.catalog.versions(adapter)
        why = None if known else f"{adapter}@{version} is not a registered version"
        slots = self.view.capacity(str(worker)).slots
        if why is None and len(held) >= slots:
            why = f"{adapter}@{version} would be more than its {slots} slots hold (one adapter each)"
        if why is None:
            return True
        self.refused_reports += 1
        self.recent_refusals.append(f"{worker}: {why}")
        return False

    def admitted(self, worker: WorkerId, entries: list[tuple[str, str, str, int]],
                 before: dict[tuple[str, str], RankState]) -> list[tuple[str, str, str, int]]:
        """A full report's entries the controller believes (``admits``: registered versions, at most one per
        slot; what the rank was known to hold first)."""
        slots, out = self.view.capacity(str(worker)).slots, list[tuple[str, str, str, int]]()
        for a, v, s, refs in sorted(entries, key=lambda e: (e[0], e[1]) not in before):
            if (a, v) in before or (a in self.catalog and v in self.catalog.versions(a) and len(out) < slots):
                out.append((a, v, s, refs))
            else:
                self.refused_reports += 1
                self.recent_refusals.append(f"{worker}: full report: {a}@{v} not registered, or beyond its "
                                            f"{slots} slots")
        return out
