"""The plan that groups what the planner sends to each TP worker (lifecycle step 4): the commands
themselves (``Prefetch``, ``Evict``, ``Stage``) are words both floors share, in ``lora_cache.vocab``.
"""

from __future__ import annotations

from typing import NamedTuple

from lora_cache.vocab import Command, Evict, Prefetch, Stage


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
