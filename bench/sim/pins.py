"""The engine's pins on one simulated rank's READY slots (lifecycle step 9): ``acquire_ready`` in simulated time.

A split of ``SimWorker`` (worker.py) along its seam: the worker loads and evicts; these are the references
the engine's rounds (``pin``: the overlap rule's pins, released when the next round pins) and the requests
arriving mid-round (``pin_arrival``, released by ``unpin_arrivals`` once a round takes over) hold on slots
already READY, so no load placed meanwhile evicts them. Each pin is a reference in the real
``workers.gpu.slots.SlotTable`` and marks its load used (prefetch accuracy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from lora_cache.vocab import AdapterKey
from workers.gpu.slots import SlotPhase, SlotTable


class Used(Protocol):
    used: bool  # a request ran on it (``SimLoad.used``)


class SimPins:
    """The pins the engine holds on one rank: the round's, by adapter; the arrivals', by slot."""

    def __init__(self, table: SlotTable, loads: Mapping[int, Used], keys: Mapping[str, AdapterKey],
                 max_batch: int) -> None:
        self.table, self.loads, self.keys, self.max_batch = table, loads, keys, max_batch  # the worker's own
        self._pinned: dict[str, int] = {}  # the engine's pins (acquire_ready): adapter -> slot
        self._arrival_pins: list[int] = []  # slots pinned for requests that arrived since the last round

    def pin(self, wanted: Sequence[str]) -> list[str]:
        """``acquire_ready`` then release of the previous pins: hold the wanted adapters READY here."""
        new: dict[str, int] = {}
        for name in dict.fromkeys(wanted):
            if len(new) == self.max_batch:
                break
            slot = self.table.lookup(self.keys[name])
            if slot is not None and slot.state is SlotPhase.READY:
                new[name] = slot.index
        for name, index in new.items():
            if name not in self._pinned:
                self.table.incref(index)
            self.loads[index].used = True
        for name, index in self._pinned.items():
            if name not in new:
                self.table.decref(index)
        self._pinned = new
        return list(new)

    def pin_arrival(self, name: str) -> bool:
        """A request for ``name`` arrived mid-round: hold its slot if it is READY here (``acquire_ready`` of
        one adapter, as the engine's feed does), so no load placed before the next round evicts it.
        Whether it was READY (pinned); ``unpin_arrivals`` lets go of every such pin."""
        slot = self.table.lookup(self.keys[name])
        if slot is None or slot.state is not SlotPhase.READY:
            return False
        self.table.incref(slot.index)
        self.loads[slot.index].used = True
        self._arrival_pins.append(slot.index)
        return True

    def unpin_arrivals(self) -> None:
        """The round took over (its own pins hold what it wants): release the arrivals' pins."""
        pins, self._arrival_pins = self._arrival_pins, []
        for index in pins:
            self.table.decref(index)
