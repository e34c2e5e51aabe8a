"""The worker as a Ray actor: a thin shell around WorkerCache + CommandGate, one per GPU (TP rank).

Residency changes are pushed to the controller in batches by a flusher thread (step 7); a full
residency report is answered on demand (``describe``), which is how a restarted controller rebuilds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import ray

from lora_cache.catalog import AdapterCatalog, CatalogConfig
from lora_cache.controller import CONTROLLER_NAME, NAMESPACE
from lora_cache.planner import Command
from workers.cache import WorkerCache, WorkerConfig
from workers.commands import ApplyResult, CommandGate, Delta

log = logging.getLogger(__name__)


class Outbox:
    """Deltas waiting to be pushed to the controller; a thread flushes them every ``flush_s``."""

    def __init__(self, name: str, flush_s: float, max_pending: int = 100_000) -> None:
        self.name, self.flush_s, self.max_pending = name, flush_s, max_pending
        self._cond = threading.Condition()  # protects _pending and _closed
        self._pending: list[tuple[str, str, str]] = []
        self._closed = False
        self._controller: Any = None
        threading.Thread(target=self._run, name="lora-outbox", daemon=True).start()

    def push(self, delta: Delta) -> None:
        with self._cond:
            if len(self._pending) < self.max_pending:  # bounded: a full report rebuilds the rest
                self._pending.append((delta.adapter, delta.version, delta.state))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                batch, self._pending = self._pending, []
            self._send(batch)
            with self._cond:
                self._cond.wait(self.flush_s)  # gather the next batch

    def _send(self, batch: list[tuple[str, str, str]]) -> None:
        try:
            if self._controller is None:
                self._controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
            self._controller.report.remote(self.name, batch)
        except Exception as e:  # no controller yet: it rebuilds from describe() when it starts
            log.info("readiness for %d adapters not pushed (%s)", len(batch), e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


@ray.remote(max_restarts=-1)
class WorkerActor:
    def __init__(self, name: str, replica: str, config: WorkerConfig, catalog: CatalogConfig,
                 flush_s: float = 0.005) -> None:
        self.name, self.replica, self.config = name, replica, config
        self.catalog = AdapterCatalog(catalog)
        self.cache = WorkerCache(config, self.catalog)
        self.outbox = Outbox(name, flush_s)
        self.gate = CommandGate(self.cache, self.outbox.push)
        self.paths: dict[str, str] = {}
        # A restarted worker holds nothing: say so, so the controller forgets its predecessor. ValueError:
        # no controller yet (it adopts this worker from describe() when it starts).
        with contextlib.suppress(ValueError):
            ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE).worker_started.remote(name)

    def register_adapter(self, name: str, path: str) -> str:
        version = self.catalog.register(name, path).version
        self.paths[name] = path
        return version

    def apply(self, commands: list[Command]) -> ApplyResult:
        return self.gate.apply(commands)

    def describe(self) -> dict[str, object]:
        """Who this worker is and everything it holds: the controller rebuilds from this."""
        return {"replica": self.replica, "rank": self.config.tp_rank, "tp": self.config.tp,
                "node": ray.get_runtime_context().get_node_id(),
                "slots": self.config.num_slots, "adapters": dict(self.paths), "epoch": self.gate.epoch,
                "residency": [(r["adapter"], r["version"], r["state"], r["refs"]) for r in self.cache.residency()]}

    def step(self, adapters: list[str]) -> list[int]:
        """An engine step's cache calls (acquire, then release): the slots the batch ran on."""
        batch = self.cache.acquire(adapters)
        self.cache.release(batch)
        return list(batch.slots)

    def stats(self) -> dict[str, object]:
        return {**self.cache.stats(), "epoch": self.gate.epoch, "commands_accepted": self.gate.accepted,
                "commands_rejected": self.gate.rejected}

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.outbox.close()
        self.cache.close()
