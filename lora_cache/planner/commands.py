"""The plan that groups what the planner sends to each TP worker (lifecycle step 4): the commands
themselves (``Prefetch``, ``Evict``, ``Stage``, ``Ranking``) are words both floors share, in ``lora_cache.vocab``.
"""

from __future__ import annotations

from typing import NamedTuple

from lora_cache.vocab import Command, Evict, Prefetch, Ranking, Stage


class WorkerCommands(NamedTuple):
    """One worker's share of a plan: evicts first, then prefetches by priority, then stages, then a new ranking of
    the fleet's adapters for its host tier's eviction order, if any."""

    worker: str
    replica: str
    evicts: tuple[Evict, ...]
    prefetches: tuple[Prefetch, ...]
    stages: tuple[Stage, ...] = ()
    ranking: Ranking | None = None

    @property
    def commands(self) -> tuple[Command, ...]:
        tail: tuple[Command, ...] = () if self.ranking is None else (self.ranking,)
        return self.evicts + self.prefetches + self.stages + tail


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
