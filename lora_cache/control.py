"""The controller's core, plain Python: catalog + planner + readiness index (lifecycle steps 2-4, 7-8).

The Ray actor in ``controller.py`` only forwards to this class and sends what it returns. Every input
is checked here first, so a bad report or hint is a clear error and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lora_cache.catalog import AdapterCatalog, CatalogConfig
from lora_cache.errors import ConfigError, NotFoundError
from lora_cache.planner import (
    AdapterInfo,
    Command,
    Hint,
    Planner,
    PlannerConfig,
    QueueEntry,
    ReplicaSpec,
    ResidencyEntry,
    SlotState,
)
from lora_cache.readiness import RankState, ReadinessEvent, ReadinessIndex
from lora_cache.shards import shard_layout


class WorkerId(NamedTuple):
    replica: str
    rank: int

    def __str__(self) -> str:
        return f"{self.replica}/{self.rank}"


@dataclass(frozen=True)
class ControllerConfig:
    """The controller: its catalog, its planner and how it batches."""

    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)


_STATE = {"loading": (RankState.LOADING, SlotState.LOADING), "ready": (RankState.READY, SlotState.READY)}


class ControllerCore:
    """What the controller knows and decides; no Ray, no clocks (``now`` is passed in)."""

    def __init__(self, config: ControllerConfig, epoch: int) -> None:
        self.config, self.epoch = config, epoch
        self.catalog = AdapterCatalog(config.catalog)
        self.planner = Planner(config.planner, epoch)
        self.readiness = ReadinessIndex()
        self.paths: dict[str, str] = {}  # adapter -> registered path, replayed to new workers
        self.commands_sent = 0

    # -- adapters and topology ------------------------------------------------------------------
    def register_adapter(self, name: str, path: str) -> str:
        spec = self.catalog.register(name, path)
        layout = shard_layout(spec, self.catalog.shape, 1, 0, torch.bfloat16)
        self.planner.register_adapter(AdapterInfo(name, spec.version, layout.nbytes))
        self.paths[name] = path
        return spec.version

    def add_replica(self, replica: str, tp: int, slots: int) -> list[WorkerId]:
        """Idempotent: a replica already adopted from its workers' reports is kept as it is."""
        workers = [WorkerId(replica, k) for k in range(tp)]
        if replica in self.planner.replicas():
            if self.planner.workers(replica) != tuple(map(str, workers)):
                raise ConfigError(f"replica {replica!r} already exists with workers "
                                  f"{self.planner.workers(replica)}; remove it before changing its TP size")
            return workers
        self.planner.add_replica(ReplicaSpec(replica, tuple(map(str, workers)), slots))
        self.readiness.add_replica(replica, tp)
        return workers

    def worker_lost(self, worker: WorkerId) -> list[ReadinessEvent]:
        """A worker died or restarted empty: drop what it held, the replica is replanned."""
        self.check_worker(worker)
        self.planner.report_residency(str(worker), [])
        return self.readiness.drop_rank(worker.replica, worker.rank)

    # -- inputs (steps 1-3) ---------------------------------------------------------------------
    def report_queue(self, replica: str, adapters: Iterable[tuple[str, float]], now: float) -> None:
        entries = [QueueEntry(a, t) for a, t in adapters]
        self.check_replica(replica)
        for e in entries:
            self.check_adapter(e.adapter)
        self.planner.report_queue(replica, entries, now)

    def hint(self, hint_id: str, adapter: str, replica: str, expected_s: float, now: float) -> bool:
        self.check_replica(replica)
        self.check_adapter(adapter)
        return self.planner.add_hint(Hint(hint_id, adapter, replica, expected_s), now)

    def cancel_hint(self, hint_id: str, now: float) -> bool:
        return self.planner.cancel_hint(hint_id, now)

    def worker_report(self, worker: WorkerId, deltas: Iterable[tuple[str, str, str]]) -> list[ReadinessEvent]:
        """(adapter, version, state) changes from one worker; returns replica-level events (step 8)."""
        self.check_worker(worker)
        events: list[ReadinessEvent] = []
        for adapter, version, state in deltas:
            rank_state, slot_state = _STATE.get(state, (None, None))
            if slot_state is None:
                self.planner.drop_residency(str(worker), adapter, version)
            else:
                self.planner.update_residency(str(worker), ResidencyEntry(adapter, version, slot_state))
            events += self.readiness.report(worker.replica, worker.rank, adapter, version, rank_state)
        return events

    def rebuild_worker(self, worker: WorkerId, entries: Iterable[tuple[str, str, str, int]]) -> list[ReadinessEvent]:
        """A full residency report (controller restart): replaces what was known of the worker."""
        entries = list(entries)
        self.planner.report_residency(str(worker), [
            ResidencyEntry(a, v, SlotState.IN_USE if refs else _STATE[s][1], refs) for a, v, s, refs in entries])
        events = self.readiness.drop_rank(worker.replica, worker.rank)
        for a, v, s, _ in entries:
            events += self.readiness.report(worker.replica, worker.rank, a, v, _STATE[s][0])
        return events

    # -- decisions (steps 3-4) ------------------------------------------------------------------
    def plan(self, now: float, full: bool = False) -> dict[WorkerId, list[Command]]:
        plan = self.planner.plan_all(now) if full else self.planner.plan(now)
        out: dict[WorkerId, list[Command]] = {}
        for w in plan.workers:
            replica, rank = w.worker.rsplit("/", 1)
            out[WorkerId(replica, int(rank))] = list(w.commands)
            self.commands_sent += len(w.commands)
        return out

    def status(self) -> dict[str, object]:
        return {"epoch": self.epoch, "adapters": len(self.catalog), "replicas": list(self.planner.replicas()),
                "readiness": self.readiness.counts(), "commands_sent": self.commands_sent,
                "queue_depths": {r: len(self.planner.queue(r)) for r in self.planner.replicas()}}

    # -- checks -------------------------------------------------------------------------------------
    def check_replica(self, replica: str) -> None:
        if replica not in self.planner.replicas():
            raise NotFoundError(f"replica {replica!r} is not known; known replicas: {list(self.planner.replicas())}")

    def check_adapter(self, adapter: str) -> None:
        if adapter not in self.catalog:
            raise NotFoundError(f"adapter {adapter!r} is not registered; register it first "
                                "(lora-cache register NAME PATH)")

    def check_worker(self, worker: WorkerId) -> None:
        self.check_replica(worker.replica)
        if str(worker) not in self.planner.workers(worker.replica):
            raise NotFoundError(f"worker {worker} is not part of replica {worker.replica!r}")

    def check_integrity(self) -> None:
        self.planner.check_integrity()
        self.readiness.check_integrity()
