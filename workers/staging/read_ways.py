"""Which way a cold read of a local adapter file goes where ``HostTierConfig.direct_reads`` is "auto" (issue 42):
through the page cache (positioned reads, ``preadv``), the same with the file asked for ahead (``ahead``), or around
the page cache (``O_DIRECT`` through an aligned bounce buffer, ``direct``), chosen per file system and size class from
the host tier's own reads of each way.

No way is fastest on every device. On this project's CPU host a rank-64 8B shard read 0.84-1.10 of the device's best
reference by ``O_DIRECT`` against 0.73-0.84 through the page cache; on an H100 host's disk ``O_DIRECT`` read 0.64 of its
best, the page cache 0.88 and the page cache asked ahead 1.11 (bench/reports/issue-42.md). A warm file is always read
through the page cache (``is_cold`` decides first). So the tier measures instead of assuming:

1. While a (file system, size class) has fewer than ``explore`` reads timed each way, its cold reads sent to explore
   (point 3) take the ways in turn: ``direct``, ``preadv``, and ``ahead`` (through the page cache with the whole
   file asked for at the read's start, ``POSIX_FADV_WILLNEED``: ``HostTierConfig.read_ahead``'s way).
2. Then each goes the way whose median rate over its newest ``KEPT`` reads is highest, and every ``recheck``-th read
   sent to explore goes another way (each in turn), so that a device whose behaviour changes (a busier neighbour, a
   new volume) is followed.
3. A read is timed only where it ran alone in its tier (no other read started or running while it ran): a shared
   device's rate says nothing of either way. Only a warm stage's read that starts alone is sent to explore or
   recheck: a read a request waits for never pays for trying a way (on an H100 host's disk ``O_DIRECT`` read at half
   the page cache's rate, and a service that explored with demand reads lost 1.2x its mean TTFT and 1.7x its p99).
   A demand read goes the chosen way, or through the page cache while its class explores (what ``off`` does), and is
   timed like any other where it ran alone. A tier with no warm stages never leaves the page cache.
4. A file system that refused ``O_DIRECT`` (the read fell back to the page cache: ``workers.reads.shard._direct``)
   is read the other two ways from then on.

The size class is the shard's bytes rounded up to a power of two: a rank-16 and a rank-64 shard of one model are
two classes (a small read pays its fixed costs over fewer bytes), and the rates of one class compare like with like.
Plain Python: the times are given, never read; one lock, since reads end on several reader threads.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from lora_cache.adapters.peft import AdapterSpec
from workers.counters import COLD_WAYS

if TYPE_CHECKING:
    from workers.staging.host_entry import HostEntry

log = logging.getLogger(__name__)

WAYS = COLD_WAYS  # the ways of a cold read, in the order a class explores them (``WorkerCache.stats`` counts each)
SAID = {"direct": "by O_DIRECT", "preadv": "through the page cache",
        "ahead": "through the page cache, the file asked for whole as its read starts"}
EXPLORE = 3  # reads of each way timed before a class chooses
RECHECK = 32  # then every RECHECK-th read of the class goes a way not chosen (each in turn)
KEPT = 8  # the newest rates kept per way and class


class Ticket(NamedTuple):
    """What a cold read of an "auto" tier was sent with: its file system, size class and way, and how many reads the
    tier had dispatched when it was (``HostTier``: one dispatched after it means it did not run alone)."""

    dev: int
    size: int
    way: str
    dispatched: int


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a power of two, as its exponent."""
    return max(0, nbytes - 1).bit_length()


def device_of(spec: AdapterSpec) -> int | None:
    """The file system (``st_dev``) of ``spec``'s weights file, or None where it has none or cannot be told (the read
    itself then says what is wrong)."""
    path = spec.source.path if spec.source is not None else None
    if path is None:
        return None
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


class ReadWays:
    """The cold reads' ways by (file system, size class) and what each way measured (this module's docstring)."""

    def __init__(self, explore: int = EXPLORE, recheck: int = RECHECK) -> None:
        if explore < 1 or recheck < 2:
            raise ValueError(f"ReadWays: explore is {explore} and recheck {recheck}; give explore >= 1 (reads of each "
                             "way timed before a choice) and recheck >= 2 (every recheck-th read tries another way)")
        self.explore, self.recheck = explore, recheck
        self._lock = threading.Lock()
        self._rates: dict[tuple[int, int], dict[str, deque[float]]] = {}  # (dev, class) -> way -> bytes/s
        self._sent: dict[tuple[int, int], int] = {}  # (dev, class) -> reads sent a way
        self.refused: set[int] = set()  # file systems that refused O_DIRECT: the other ways only from then on

    def way(self, dev: int, nbytes: int) -> str:
        """The way the next cold read of ``nbytes`` on file system ``dev`` goes (points 1, 2 and 4)."""
        key = (dev, size_class(nbytes))
        with self._lock:
            ways = self._ways(dev)
            rates = self._rates.setdefault(key, {w: deque(maxlen=KEPT) for w in WAYS})
            sent = self._sent[key] = self._sent.get(key, 0) + 1
            short = [w for w in ways if len(rates[w]) < self.explore]
            if short:  # in turn while each is short; the last short one alone once the others have their reads
                turn = ways[(sent - 1) % len(ways)]
                return turn if turn in short else short[0]
            best = _best(rates, ways)
            if sent % self.recheck:
                return best
            others = [w for w in ways if w != best]
            return others[(sent // self.recheck) % len(others)]

    def timed(self, ticket: Ticket, nbytes: int, seconds: float, direct: bool) -> None:
        """A read sent with ``ticket`` moved ``nbytes`` in ``seconds`` alone; ``direct``: whether its runs went by
        ``O_DIRECT`` (a read sent that way that did not fell back: its file system is ``refused``)."""
        with self._lock:
            if ticket.way == "direct" and not direct:
                self.refused.add(ticket.dev)
                return
            if nbytes <= 0 or seconds <= 0:
                return
            ways = self._ways(ticket.dev)
            rates = self._rates.setdefault((ticket.dev, ticket.size), {w: deque(maxlen=KEPT) for w in WAYS})
            before = _best(rates, ways) if _explored(rates, ways, self.explore) else None
            rates[ticket.way].append(nbytes / seconds)
            after = _best(rates, ways) if _explored(rates, ways, self.explore) else None
            medians = ", ".join(f"{w} {statistics.median(rates[w]) / 1e9:.2f} GB/s" for w in ways if rates[w])
        if after is not None and after != before:  # what an operator reads to see what auto chose, and its changes
            log.info("cold reads of shards up to %d MB on file system %d now go %s (medians: %s)",
                     (1 << ticket.size) >> 20, ticket.dev, SAID[after], medians)

    def chosen(self, dev: int, nbytes: int) -> str | None:
        """The way a class chose (None while it explores)."""
        with self._lock:
            ways = self._ways(dev)
            rates = self._rates.get((dev, size_class(nbytes)))
            if rates is None or not _explored(rates, ways, self.explore):
                return None
            return _best(rates, ways)

    def report(self) -> dict[str, dict[str, object]]:
        """Per "dev:class": each way's median GB/s and reads timed, and the way chosen (None while exploring)."""
        with self._lock:
            out: dict[str, dict[str, object]] = {}
            for (dev, size), rates in sorted(self._rates.items()):
                ways = self._ways(dev)
                out[f"{dev}:{size}"] = {
                    **{w: {"GBps": statistics.median(r) / 1e9 if r else None, "timed": len(r)}
                       for w, r in rates.items()},
                    "chosen": _best(rates, ways) if _explored(rates, ways, self.explore) else None}
            return out

    def _ways(self, dev: int) -> tuple[str, ...]:
        """The ways open on ``dev`` (caller holds the lock): all but ``direct`` where it refused ``O_DIRECT``."""
        return tuple(w for w in WAYS if w != "direct") if dev in self.refused else WAYS


class ColdReads:
    """The host tier's side of "auto": each read counted as it is dispatched, each cold local file's read sent the way
    ``ways`` gives (``send``), and a read that ran alone timed as a rate of its way once it ends (``ended``)."""

    def __init__(self, reading: Callable[[], int], ways: ReadWays | None = None) -> None:
        """``reading``: the tier's reads in flight or waiting for room (``HostTier.reading``), the new one included."""
        self.ways = ways or ReadWays()
        self._reading = reading
        self._lock = threading.Lock()
        self._dispatched = 0  # reads dispatched so far: one sent while another runs means neither ran alone
        self.went: dict[str, int] = dict.fromkeys(WAYS, 0)  # cold reads by the way each went (``WorkerCache.stats``)

    def dispatched(self) -> int:
        """Count a read being dispatched (every read, cold or not, auto or not); its number."""
        with self._lock:
            self._dispatched += 1
            return self._dispatched

    def send(self, spec: AdapterSpec, entry: HostEntry, number: int, mode: str, ahead: bool = False) -> bool:
        """Set the way of ``entry``'s read (the ``number``-th dispatched; its file found cold; ``entry.way`` tells it,
        for its load's record); True where the file is to be asked for whole ahead (the caller does:
        ``workers.reads.shard.ask_ahead``): always where ``read_ahead`` (``ahead``) is on. By ``O_DIRECT`` where
        ``direct_reads`` (``mode``) is on. Where it is auto (the module's point 3), a warm stage's read that starts
        alone goes the way ``ways`` gives (to explore, recheck or follow the choice); any other read goes the way
        chosen, or through the page cache while its class explores. One that starts alone gets its ticket (it is
        timed if it also ends alone); one that starts beside another cannot be timed. A file system that cannot be
        told: the page cache."""
        way = self._way(spec, entry, number, mode, ahead)
        entry.way = way
        with self._lock:
            self.went[way] += 1
        return way == "ahead"

    def _way(self, spec: AdapterSpec, entry: HostEntry, number: int, mode: str, ahead: bool) -> str:
        """``send``'s choice (giving ``entry`` its ticket where it starts alone under auto)."""
        if ahead or mode == "on":
            return "ahead" if ahead else "direct"
        dev = device_of(spec)
        if dev is None:
            return "preadv"
        nbytes = entry.layout.nbytes
        alone = self._reading() == 1  # another read in flight: neither is timed
        way = self.ways.way(dev, nbytes) if alone and entry.speculative else self.ways.chosen(dev, nbytes) or "preadv"
        if alone:
            entry.ticket = Ticket(dev, size_class(nbytes), way, number)
        return way

    def ended(self, entry: HostEntry) -> None:
        """``entry``'s read ended well: one sent with a ticket (it started alone) that no other read was dispatched
        after is a rate of its way (whether it really went by ``O_DIRECT`` is in its marks: the open, and no run that
        the device refused). Warm stages count too: a local file's warm read yields to nothing midway (only a store
        fetch does)."""
        ticket = entry.ticket
        if ticket is None:
            return
        with self._lock:
            if ticket.dispatched != self._dispatched:
                return
        phases = {p for p, _ in entry.marks}
        self.ways.timed(ticket, entry.bytes_read, entry.read_ms / 1e3,
                        "direct" in phases and "direct refused" not in phases)


def _explored(rates: dict[str, deque[float]], ways: tuple[str, ...], explore: int) -> bool:
    return all(len(rates[w]) >= explore for w in ways)


def _best(rates: dict[str, deque[float]], ways: tuple[str, ...]) -> str:
    """The way of the highest median rate (the earlier in ``WAYS`` on a tie)."""
    return max(ways, key=lambda w: (statistics.median(rates[w]), -WAYS.index(w)))
