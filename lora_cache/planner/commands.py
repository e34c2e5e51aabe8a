"""What the planner sends to each TP worker (lifecycle step 4), and the plan that groups it.

Commands are idempotent and carry the planner's epoch, so a worker can drop commands from an older
controller (invariants 6 and 7). A worker applies its evicts before its prefetches, loads prefetches
in priority order (0 first), and stages last. Every rank of a replica is planned from the same target, so
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


@dataclass(frozen=True, slots=True)
class Stage:
    """Read `adapter@version`'s shard into this worker's pinned host tier, with no GPU slot (step 5 alone).

    For a needed (queued or hinted) adapter that found no GPU room: when a slot frees, its load is one
    host-to-GPU copy instead of a disk read and a copy. A staged shard is an ordinary host-tier entry
    (LRU, evictable), so a stage never changes what the planner counts as resident."""

    adapter: str
    version: str
    priority: int
    epoch: int


Command = Prefetch | Evict | Stage


class WorkerCommands(NamedTuple):
    """One worker's share of a plan: evicts first, then prefetches by priority, then stages."""

    worker: str
    replica: str
    evicts: tuple[Evict, ...]
    prefetches: tuple[Prefetch, ...]
    stages: tuple[Stage, ...] = ()

    @property
    def commands(self) -> tuple[Command, ...]:
        return self.evicts + self.prefetches + self.stages


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
