"""The storage models of ``--store`` in simulated time (``bench.store``): what a host-tier miss's read costs.

- ``page-cache``: no store object; a read holds one of the rank's reader threads for the calibration's
  ``disk_s(nbytes)`` (``disk_fixed_ms + nbytes / disk_gbps``, each thread at its own bandwidth), as before;
- ``device``: one device for the fleet's host (the benchmark's machine): a read waits ``device_fixed_ms``, then
  moves its bytes over a ``SharedLink`` of ``device_gbps``, shared equally by every read in flight on any rank
  (processor sharing: two reads at once take twice as long as one), and is done. Nothing is added for the
  reader's own work: its split positioned reads (``os.preadv`` straight into the pinned arena, several at once)
  copy each part as the device delivers it, so the read takes the device's time, and ``fit_store`` fits
  the link from the reads' whole logged time (``disk_ms``). Adding a page-cache read (``disk_s``) after the
  link counted every read twice: on the H200 device runs of 2026-11-28 the simulated misses took 359 ms for
  273 MB against the real 174 ms for 270 MB, and the real reads replayed through the link alone take
  0.99-1.05x their logged time in sum (those that overlapped another read 0.96-1.14x);
- ``s3``: the node's disk tier (every adapter fetched whole, single flight per node) in front of a ``SharedLink``
  of the store's bandwidth, each fetch waiting the store's latency before its first byte; after the fetch (or at
  once if the copy is on disk) the shard is read from the local copy at page-cache cost (``disk_s``). The tier
  holds ``disk_bytes`` (``--disk-bytes``; the service's 64 GiB default holds a benchmark's catalog of 100): a
  fetch that does not fit evicts the copies used longest ago that no read holds (a read holds its copy from its
  ask until its local read ends; a fetch in flight is not evicted), as ``DiskTier`` evicts by its proofs' mtimes;
  where every copy is held the fetch goes ahead over the bytes (counted: ``disk_over``; the real tier refuses it).
  With ``fetch_order`` "soonest" (the default, ``DiskTierConfig.fetch_order``) one demand fetch moves at a time, the
  one that would end soonest alone first (its first byte's time plus its bytes at the link's rate: ``SharedLink``'s
  ``ordered``), as ``NodeFetches`` orders the real ones (at the rate their fetches measured); "shared": all at once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bench.sim.calibration import GB, Calibration
from bench.sim.events import Loop, Signal
from bench.store import StoreModel
from workers.staging.disk_tier import DiskTierConfig


class SharedLink:
    """Transfers sharing ``bytes_per_s`` equally (processor sharing), each after a wait of ``fixed_s``. A background
    transfer moves only while no foreground one does (it yields the link at once); ``promote`` makes it foreground.
    ``ordered`` (``DiskTierConfig.fetch_order`` "soonest", ``NodeFetches``): one foreground transfer moves at a time,
    the one that would end soonest alone first: the time it became a foreground transfer with bytes coming, plus its
    bytes at the link's rate (then the one placed first)."""

    def __init__(self, loop: Loop, bytes_per_s: float, fixed_s: float, ordered: bool = False) -> None:
        self.loop, self.rate, self.fixed_s, self.ordered = loop, bytes_per_s, fixed_s, ordered
        # the transfers moving: [remaining bytes, done, background, (bytes, -1) until placed, then (end alone, turn)]
        self.active: list[list[object]] = []
        self._turns = itertools.count()
        self.last = 0.0
        self.gen = 0  # the scheduled completion that is current (older ones are stale)
        self.busy_s = 0.0  # simulated time with a transfer on the link
        self.moved = 0

    def start(self, nbytes: int, done: Callable[[], None], slowdown: float = 1.0,
              background: bool = False) -> list[object]:
        """Move ``nbytes``, then call ``done``; ``slowdown``: the transfer takes that many times its share's time
        (it holds the link for ``nbytes * slowdown`` bytes' worth; ``moved`` counts ``nbytes``). The transfer's
        record, for ``promote``."""
        self.moved += nbytes
        transfer: list[object] = [float(nbytes * slowdown), done, background, (nbytes, -1)]
        self.loop.after(self.fixed_s, self._join, transfer)
        return transfer

    def promote(self, transfer: list[object]) -> None:
        """A background ``transfer`` moves as a foreground one from now (a demand joined it), even if it is still
        waiting for its first byte."""
        self._advance()
        transfer[2] = False
        if any(a is transfer for a in self.active):  # its bytes come: its turn from now (else at its first, ``_join``)
            self._place(transfer)
        self._schedule()

    def _place(self, transfer: list[object]) -> None:
        place: tuple[float, int] = transfer[3]  # type: ignore[assignment]
        transfer[3] = (self.loop.now + place[0] / self.rate, next(self._turns))

    def _moving(self) -> list[list[object]]:
        fore = [a for a in self.active if not a[2]]
        if self.ordered and fore:
            return [min(fore, key=lambda a: a[3])]  # type: ignore[arg-type, return-value]
        return fore or self.active

    def _advance(self) -> None:
        now = self.loop.now
        if self.active:
            moving = self._moving()
            per = (now - self.last) * self.rate / len(moving)
            for a in moving:
                a[0] = float(a[0]) - per  # type: ignore[arg-type]
            self.busy_s += now - self.last
        self.last = now

    def _join(self, transfer: list[object]) -> None:
        if math.isinf(self.rate) or float(transfer[0]) <= 0:  # type: ignore[arg-type]
            transfer[1]()  # type: ignore[operator]
            return
        self._advance()
        if not transfer[2]:
            self._place(transfer)
        self.active.append(transfer)
        self._schedule()

    def _schedule(self) -> None:
        self.gen += 1
        if self.active:
            moving = self._moving()
            least = min(float(a[0]) for a in moving)  # type: ignore[arg-type]
            self.loop.after(max(0.0, least) * len(moving) / self.rate, self._tick, self.gen)

    def _tick(self, gen: int) -> None:
        if gen != self.gen:
            return
        self._advance()
        finished = [a for a in self.active if float(a[0]) <= 1e-6 * max(1.0, self.rate)]  # type: ignore[arg-type]
        self.active = [a for a in self.active if a not in finished]
        self._schedule()
        for a in finished:
            a[1]()  # type: ignore[operator]


class SimStore:
    """One storage model for the fleet's host: ``read(name, nbytes, done)`` calls ``done`` when a rank's shard
    of ``name`` (``nbytes``) is in its host tier. ``object_bytes``: each adapter's whole file (s3 fetches)."""

    def __init__(self, model: StoreModel, loop: Loop, calibration: Calibration,
                 object_bytes: Mapping[str, int], disk_bytes: int | None = None,
                 fetch_order: str = DiskTierConfig.fetch_order) -> None:
        self.model, self.loop, self.calibration, self.object_bytes = model, loop, calibration, object_bytes
        self.disk_bytes = disk_bytes  # s3: the node's disk tier (None: unbounded)
        if model.kind == "device":
            self.link = SharedLink(loop, calibration.device_gbps * GB, calibration.device_fixed_ms / 1e3)
        elif model.kind == "s3":
            self.link = SharedLink(loop, model.mbps * 1e6, model.latency_ms / 1e3, fetch_order == "soonest")
        else:
            raise ValueError(f"no simulated store for {model.kind!r} (page-cache reads are the host tier's own)")
        self.on_disk: dict[str, Signal] = {}  # s3: the node's disk tier (fetched, or being fetched)
        self.disk_used = 0  # bytes of on_disk's copies, fetched or being fetched
        self._used_at: OrderedDict[str, None] = OrderedDict()  # fetched copies, the one used longest ago first
        self._held: Counter[str] = Counter()  # reads of a copy from their ask until their local read ends
        self._background: dict[str, list[object]] = {}  # disk warm fetches in flight: their transfers
        self.tiers: list[Any] = []  # the host tiers that read from it (``SimHostTier``: the node's ranks)
        self.fetches = self.evictions = self.disk_over = 0

    def read(self, name: str, nbytes: int, done: Callable[[], None], background: bool = False) -> None:
        """``background``: a warm stage's read, whose fetch (if the copy is not on disk) yields the store to demand
        fetches until a demand joins it (``promote``), as ``DemandMarks.yields`` makes the real one."""
        if self.model.kind == "device":  # the reader's copies ride on the device's transfer (module docstring)
            self.link.start(nbytes, done, self.calibration.device_slowdown())
            return
        self._held[name] += 1  # before the fetch: its room-making never evicts the copy this read asks for
        copy = self.fetch(name, background)
        assert copy is not None
        local = self.calibration.disk_s(nbytes)
        copy.then(lambda _: self.loop.after(local, functools.partial(self._read, name, done)))

    def _read(self, name: str, done: Callable[[], None]) -> None:
        self._held[name] -= 1
        if not self._held[name]:
            del self._held[name]
        self._used(name)
        done()

    def _used(self, name: str) -> None:
        if name in self.on_disk and self.on_disk[name].done:
            self._used_at[name] = None
            self._used_at.move_to_end(name)

    def touch(self, name: str) -> None:
        """A host tier let go of ``name`` while demand saturates the store: its copy here, if fetched, becomes the
        most recent (``DiskTier.let_go``)."""
        self._used(name)

    def _make_room(self, nbytes: int) -> None:
        """Evict the fetched copies used longest ago that no read holds until ``nbytes`` more fit (the module's
        docstring); where none can go, the fetch goes over the tier's bytes (``disk_over``)."""
        if self.disk_bytes is None:
            return
        for name in list(self._used_at):
            if self.disk_used + nbytes <= self.disk_bytes:
                return
            if self._held[name]:
                continue
            del self._used_at[name], self.on_disk[name]
            self.disk_used -= self.object_bytes[name]
            self.evictions += 1
        if self.disk_used + nbytes > self.disk_bytes:
            self.disk_over += 1

    def fetch(self, name: str, background: bool = False) -> Signal | None:
        """s3: ``name``'s object in the node's disk tier (fired once there; the fetch in flight, or a new one):
        ``DiskTier.held``'s single flight; ``background``: a disk warm stage's fetch, which yields the store to
        demand fetches until a demand joins it. None for a store with no disk tier."""
        if self.model.kind != "s3":
            return None
        copy = self.on_disk.get(name)
        if copy is None:
            self._make_room(self.object_bytes[name])
            copy = self.on_disk[name] = Signal()
            self.disk_used += self.object_bytes[name]
            self.fetches += 1
            transfer = self.link.start(self.object_bytes[name], functools.partial(self._fetched, name, copy),
                                       background=background)
            if background:
                self._background[name] = transfer
        elif not background and name in self._background:
            self.link.promote(self._background.pop(name))
        elif copy.done:  # a warm stage of a copy on disk counts as a use, as ``DiskTier._proof`` touches its proof
            self._used(name)
        return copy

    def promote(self, name: str) -> None:
        """A demand joined the warm read fetching ``name`` (on another path than ``fetch``): its fetch in flight, if
        a background one, moves as a foreground one from now."""
        if name in self._background:
            self.link.promote(self._background.pop(name))

    def _fetched(self, name: str, copy: Signal) -> None:
        self._background.pop(name, None)
        copy.fire(self.loop.now)
        self._used(name)

    def stats(self) -> dict[str, float]:
        return {"store_fetches": self.fetches, "store_bytes": self.link.moved, "store_busy_s": self.link.busy_s,
                "disk_evictions": self.evictions, "disk_over": self.disk_over}


def _read_spans(loads: Sequence[Mapping[str, Any]]) -> list[tuple[float, float, Mapping[str, Any]]]:
    """Each host-tier miss's read as (start, end) on its run's clock: from its load's start (READY ``t_s`` less
    ``ready_ms``) for ``disk_ms``."""
    out = []
    for ld in loads:
        if ld.get("host_hit", True) or ld.get("disk_ms") is None:
            continue
        start = float(ld["t_s"]) - float(ld["ready_ms"]) / 1e3
        out.append((start, start + float(ld["disk_ms"]) / 1e3, ld))
    return sorted(out, key=lambda x: x[0])


def fit_store(calib: Calibration, runs: Sequence[Sequence[Mapping[str, Any]]], model: StoreModel,
              info: dict[str, Any] | None = None) -> Calibration:
    """``calib`` with the store's costs fitted from real runs' load logs (``runs``: each policy's, on its own
    clock). ``device``: ``device_gbps`` is the bytes the misses read over the time any of them was reading (the
    device's delivered bandwidth while busy, the reader's own work included: it overlaps the transfer),
    ``device_fixed_ms`` 0; ``disk_*`` are not used by a device read. ``s3``: the store's latency and bandwidth are the
    proxy's, as stated; the local read after a fetch (``disk_*``) is fitted from the misses that found the copy on
    disk: every miss after an adapter's first in that run, and any faster than the store could have sent it."""
    from bench.sim.calibration import _fit_rate

    info = info if info is not None else {}
    if model.kind == "device":
        moved = busy = 0.0
        for loads in runs:
            end = -math.inf
            for a, b, ld in _read_spans(loads):
                moved += float(ld["nbytes"])
                busy += max(0.0, b - max(a, end))
                end = max(end, b)
        if moved and busy > 0:
            info["device"] = {"bytes": moved, "busy_s": busy}
            return dataclasses.replace(calib, device_gbps=moved / busy / GB, device_fixed_ms=0.0)
        return calib
    if model.kind == "s3":
        local = []
        for loads in runs:
            seen: set[str] = set()
            for _, _, ld in _read_spans(loads):
                # a read faster than the store could have sent its bytes found the copy on disk (a warm stage's
                # fetch, or one before the log began: with disk warming few reads are an adapter's second)
                fetch_ms = model.latency_ms + float(ld["nbytes"]) / (model.mbps * 1e3)
                if ld.get("adapter") in seen or float(ld["disk_ms"]) < 0.8 * fetch_ms:
                    local.append(ld)
                seen.add(str(ld.get("adapter")))
        if len(local) >= 2:
            fixed, gbps = _fit_rate(np.array([ld["nbytes"] for ld in local], dtype=np.float64),
                                    np.array([ld["disk_ms"] for ld in local], dtype=np.float64), "disk", info)
            return dataclasses.replace(calib, disk_fixed_ms=fixed, disk_gbps=gbps)
    return calib
