"""Applying the controller's commands on a worker (lifecycle step 4), plain Python.

Every command carries the controller's epoch; a worker remembers the newest epoch it has seen and
rejects older ones (invariant 6). Commands are idempotent: a repeated prefetch returns the load in
flight, a repeated evict of an absent adapter does nothing (invariant 7).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import NamedTuple

from lora_cache.errors import LoraCacheError
from lora_cache.planner import Command, Evict, Prefetch
from workers.cache import WorkerCache
from workers.loader import ReadinessRecord


class ApplyResult(NamedTuple):
    accepted: int
    rejected_stale: int  # from an older controller epoch
    errors: tuple[str, ...]  # commands that named something this worker cannot load, with why


class Delta(NamedTuple):
    """A change of this worker's residency, pushed to the controller (step 7)."""

    adapter: str
    version: str
    state: str  # "loading" | "ready" | "gone" | "failed"
    record: ReadinessRecord | None = None
    error: str = ""


class CommandGate:
    """Epoch check + idempotent application of commands to a WorkerCache."""

    def __init__(self, cache: WorkerCache, push: Callable[[Delta], None]) -> None:
        self.cache, self.push = cache, push
        self.epoch = 0
        self._lock = threading.Lock()  # protects epoch and the counters
        self.accepted = self.rejected = 0

    def apply(self, commands: Iterable[Command]) -> ApplyResult:
        accepted = rejected = 0
        errors: list[str] = []
        for command in commands:
            with self._lock:
                if command.epoch < self.epoch:
                    rejected += 1
                    continue
                self.epoch = command.epoch
            try:
                self._apply_one(command)
                accepted += 1
            except LoraCacheError as e:  # a bad command costs that command only
                errors.append(f"{type(command).__name__} {command.adapter}@{command.version}: {e}")
                if isinstance(command, Prefetch):  # the controller assumed it loading: say it is not
                    self.push(Delta(command.adapter, command.version, "failed", error=str(e)))
        with self._lock:
            self.accepted += accepted
            self.rejected += rejected
        return ApplyResult(accepted, rejected, tuple(errors))

    def _apply_one(self, command: Command) -> None:
        if isinstance(command, Evict):
            if self.cache.evict(command.adapter, command.version):
                self.push(Delta(command.adapter, command.version, "gone"))
            return
        assert isinstance(command, Prefetch)
        future = self.cache.prefetch(command.adapter, command.version)
        if not future.done():
            self.push(Delta(command.adapter, command.version, "loading"))
        future.add_done_callback(functools.partial(self._on_done, command))

    def _on_done(self, command: Prefetch, future: Future[ReadinessRecord]) -> None:
        error = future.exception()
        if error is None:
            self.push(Delta(command.adapter, command.version, "ready", future.result()))
        else:
            self.push(Delta(command.adapter, command.version, "failed", error=str(error)))
