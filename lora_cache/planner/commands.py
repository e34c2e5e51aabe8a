"""What the planner sends to each TP worker (lifecycle step 4), and the plan that groups it.

Commands are idempotent and carry the planner's epoch, so a worker can drop commands from an older
controller (invariants 6 and 7). A worker applies its evicts before its prefetches, and loads
prefetches in priority order (0 first). Every rank of a replica is planned from the same target, so
one adapter has the same priority on every rank; each rank loads only its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Load `adapter@version` into a slot of this worker; lower `priority` first."""

    adapter: str
    version: str
    priority: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Evict:
    """Free the slot that holds `adapter@version` (never one in use: the planner checks)."""

    adapter: str
    version: str
    epoch: int


Command = Prefetch | Evict


class WorkerCommands(NamedTuple):
    """One worker's share of a plan: evicts first, then prefetches by priority."""

    worker: str
    replica: str
    evicts: tuple[Evict, ...]
    prefetches: tuple[Prefetch, ...]

    @property
    def commands(self) -> tuple[Command, ...]:
        return self.evicts + self.prefetches


class Plan(NamedTuple):
    """The result of one planning pass: which replicas were (re)planned and every worker's commands.

    `workers` lists only workers with at least one command, by replica then rank.
    """

    epoch: int
    replicas: tuple[str, ...]
    workers: tuple[WorkerCommands, ...]

    @property
    def is_empty(self) -> bool:
        return not self.workers

    def for_worker(self, worker: str) -> WorkerCommands | None:
        return next((w for w in self.workers if w.worker == worker), None)

    def commands(self) -> list[tuple[str, Command]]:
        """(worker, command) pairs in send order."""
        return [(w.worker, c) for w in self.workers for c in w.commands]
