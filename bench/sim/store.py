"""The storage models of ``--store`` in simulated time (``bench.store``): what a host-tier miss's read costs.

- ``page-cache``: no store object; a read holds one of the rank's reader threads for the calibration's
  ``disk_s(nbytes)`` (``disk_fixed_ms + nbytes / disk_gbps``, each thread at its own bandwidth), as before;
- ``device``: one device for the fleet's host (the benchmark's machine): a read waits ``device_fixed_ms``, then
  moves its bytes over a ``SharedLink`` of ``device_gbps``, shared equally by every read in flight on any rank
  (processor sharing: two reads at once take twice as long as one), then costs the reader its page-cache read
  (``disk_s``: the calls, checks and copies a read makes wherever its bytes come from);
- ``s3``: the node's disk tier (every adapter fetched once per node, whole, single flight, never evicted: the
  disk tier's 64 GiB default holds a benchmark's catalog) in front of a ``SharedLink`` of the store's bandwidth,
  each fetch waiting the store's latency before its first byte; after the fetch (or at once if the copy is on
  disk) the shard is read from the local copy at page-cache cost (``disk_s``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from bench.sim.calibration import GB, Calibration
from bench.sim.events import Loop, Signal
from bench.store import StoreModel


class SharedLink:
    """Transfers sharing ``bytes_per_s`` equally (processor sharing), each after a wait of ``fixed_s``."""

    def __init__(self, loop: Loop, bytes_per_s: float, fixed_s: float) -> None:
        self.loop, self.rate, self.fixed_s = loop, bytes_per_s, fixed_s
        self.active: list[list[object]] = []  # [remaining bytes, done]
        self.last = 0.0
        self.gen = 0  # the scheduled completion that is current (older ones are stale)
        self.busy_s = 0.0  # simulated time with a transfer on the link
        self.moved = 0

    def start(self, nbytes: int, done: Callable[[], None]) -> None:
        self.loop.after(self.fixed_s, self._join, nbytes, done)

    def _advance(self) -> None:
        now = self.loop.now
        if self.active:
            per = (now - self.last) * self.rate / len(self.active)
            for a in self.active:
                a[0] = float(a[0]) - per  # type: ignore[arg-type]
            self.busy_s += now - self.last
        self.last = now

    def _join(self, nbytes: int, done: Callable[[], None]) -> None:
        self.moved += nbytes
        if math.isinf(self.rate) or nbytes <= 0:
            done()
            return
        self._advance()
        self.active.append([float(nbytes), done])
        self._schedule()

    def _schedule(self) -> None:
        self.gen += 1
        if self.active:
            least = min(float(a[0]) for a in self.active)  # type: ignore[arg-type]
            self.loop.after(max(0.0, least) * len(self.active) / self.rate, self._tick, self.gen)

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
                 object_bytes: Mapping[str, int]) -> None:
        self.model, self.loop, self.calibration, self.object_bytes = model, loop, calibration, object_bytes
        if model.kind == "device":
            self.link = SharedLink(loop, calibration.device_gbps * GB, calibration.device_fixed_ms / 1e3)
        elif model.kind == "s3":
            self.link = SharedLink(loop, model.mbps * 1e6, model.latency_ms / 1e3)
        else:
            raise ValueError(f"no simulated store for {model.kind!r} (page-cache reads are the host tier's own)")
        self.on_disk: dict[str, Signal] = {}  # s3: the node's disk tier (fetched, or being fetched)
        self.fetches = 0

    def read(self, name: str, nbytes: int, done: Callable[[], None]) -> None:
        if self.model.kind == "device":  # the bytes from the device, then the reader's own work on them
            local = self.calibration.disk_s(nbytes)
            self.link.start(nbytes, lambda: self.loop.after(local, done))
            return
        copy = self.on_disk.get(name)
        if copy is None:
            copy = self.on_disk[name] = Signal()
            self.fetches += 1
            self.link.start(self.object_bytes[name], lambda: copy.fire(self.loop.now))
        local = self.calibration.disk_s(nbytes)
        copy.then(lambda _: self.loop.after(local, done))

    def stats(self) -> dict[str, float]:
        return {"store_fetches": self.fetches, "store_bytes": self.link.moved, "store_busy_s": self.link.busy_s}
