"""Which loads the controller has a reason to believe a rank holds (issue 46 item 1; lifecycle steps 4, 7, 9).

A load reaches a rank two ways: the controller commands it (``Prefetch``, step 4), or the rank's engine starts
it with ``acquire`` for a request's adapter that missed (step 9), and says so in the load's "loading" and
"ready" deltas (``Delta.acquired``). ``Claims`` keeps, per rank, the versions each way vouches for: the
prefetches the plan sent it, the acquired loads it reported (``ReportAdmission`` admits those within its
slots), and, once, what a controller restart found the rank holding (``adopted``). A rank's READY for anything
else is refused (``admission.py``). An entry vouches for its version on that rank until the rank's incarnation
ends (a restart starts empty) or its replica leaves, not for one load only: a rank's "gone" for an evicted load
can reach the controller after a newer command of the same version was sent (deltas and commands cross), and
would end that command's claim. A rank lost and heard from again keeps its entries (the same process, its
slots intact). Bounded: ``PER_SLOT`` entries per slot per rank, the least recently vouched dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from lora_cache.vocab import Command, Prefetch, WorkerId

PER_SLOT = 4  # entries per slot a rank may have vouched for at once (prefetches still waiting for room count)
MIN_ENTRIES = 16

Key = tuple[str, str]  # (adapter, version)


class Claims:
    """Per rank, the adapter versions the controller has a reason to believe it loads: how each came
    ("commanded", "acquired", "adopted")."""

    def __init__(self) -> None:
        self.vouched: dict[WorkerId, OrderedDict[Key, str]] = {}  # per rank, oldest first

    def commanded(self, worker: WorkerId, commands: Iterable[Command], slots: int) -> None:
        """The plan sent ``worker`` these commands: its prefetches vouch for their versions."""
        for c in commands:
            if isinstance(c, Prefetch):
                self.add(worker, (c.adapter, c.version), "commanded", slots)

    def add(self, worker: WorkerId, key: Key, how: str, slots: int) -> None:
        book = self.vouched.setdefault(worker, OrderedDict())
        book[key] = how
        book.move_to_end(key)
        while len(book) > max(MIN_ENTRIES, PER_SLOT * slots):
            book.popitem(last=False)

    def how(self, worker: WorkerId, key: Key) -> str | None:
        """How ``worker``'s load of ``key`` came, or None: nothing vouches for it."""
        book = self.vouched.get(worker)
        return None if book is None else book.get(key)

    def forget(self, worker: WorkerId) -> None:
        """A new incarnation of the rank (it starts empty), or the rank left the fleet."""
        self.vouched.pop(worker, None)

    def forget_replica(self, replica: str) -> None:
        for w in [w for w in self.vouched if w.replica == replica]:
            del self.vouched[w]

    def check_integrity(self, slots: Callable[[WorkerId], int]) -> None:
        """Every rank's entries within its bound (``slots``: a rank's slot count)."""
        for worker, book in self.vouched.items():
            assert len(book) <= max(MIN_ENTRIES, PER_SLOT * slots(worker)), f"{worker}: {len(book)} claims"
            assert set(book.values()) <= {"commanded", "acquired", "adopted"}, f"{worker}: {set(book.values())}"

    def counts(self) -> dict[str, int]:
        """How many vouched loads each way, fleet-wide (``status``)."""
        out: dict[str, int] = {}
        for book in self.vouched.values():
            for how in book.values():
                out[how] = out.get(how, 0) + 1
        return out
