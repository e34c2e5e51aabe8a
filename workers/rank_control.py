"""What the controller calls on one TP rank, whoever hosts it: the worker actor (``workers/actor.py``) or
an engine's own process attached through ``workers/attach.py`` (lifecycle steps 4 and 7).

``WorkerControl`` composes the rank's ``WorkerCache``, its ``CommandGate`` and its ``Outbox``: adapter
registrations replayed by the controller, commands, the full residency report a (re)started controller
rebuilds from, and the cache's counters. Plain Python; the hosts only forward to it.
"""

from __future__ import annotations

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.vocab import ApplyResult, Command
from workers.cache import WorkerCache
from workers.commands import CommandGate
from workers.outbox import Outbox


class WorkerControl:
    """One rank's control surface; ``replica`` and the cache's config say which rank it is."""

    def __init__(self, replica: str, catalog: AdapterCatalog, cache: WorkerCache, outbox: Outbox) -> None:
        self.replica, self.catalog, self.cache, self.outbox = replica, catalog, cache, outbox
        self.gate = CommandGate(cache, outbox.push)
        self.paths: dict[str, str] = {}  # adapter -> the path it was registered from (reported to the controller)

    def register_adapter(self, name: str, path: str) -> str:
        version = self.catalog.register(name, path).version
        self.paths[name] = path
        return version

    def unregister_adapter(self, name: str) -> bool:
        """Forget ``name`` (the controller drained it first); False if it was not registered here."""
        self.paths.pop(name, None)
        if name not in self.catalog:
            return False
        self.catalog.unregister(name)
        return True

    def apply(self, commands: list[Command]) -> ApplyResult:
        return self.gate.apply(commands)

    def describe(self, node: str) -> dict[str, object]:
        """Who this rank is and everything it holds: the controller rebuilds from this."""
        seq = self.outbox.seq  # first: every delta up to it is reflected in the residency read after it
        config = self.cache.config
        return {"replica": self.replica, "rank": config.tp_rank, "tp": config.tp, "model": self.catalog.shape.name,
                "incarnation": self.outbox.incarnation, "seq": seq, "node": node,
                "slots": config.num_slots, "host_bytes": config.host.host_bytes, "adapters": dict(self.paths),
                "epoch": self.gate.epoch,
                "residency": [(r["adapter"], r["version"], r["state"], r["refs"]) for r in self.cache.residency()]}

    def stats(self) -> dict[str, object]:
        return {**self.cache.stats(), "epoch": self.gate.epoch, "commands_accepted": self.gate.accepted,
                "commands_rejected": self.gate.rejected}
