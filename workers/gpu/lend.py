"""A pool that breathes (issue 43 item 3): one rank's adapter pool lends whole pages to its engine and takes them back.

An engine (or the operator) asks for bytes back; ``PoolLender.give_back`` lends that many whole pages: free ones
first, then those of idle adapters, least recently used first, the ones the engine needs soon (``keep``) last
(``SlotTable.lend``). It never takes a page a loading or in-use adapter holds, so it never blocks or drops a running
batch; a request for more than is free or idle is refused, naming what holds the rest, and nothing changes. The
evicted adapters are reported "gone" (written back first under exclusive tiers), then the rank's new capacity
("capacity", ``lora_cache.vocab.capacity_delta``), in one ordered stream, so the controller plans within the bytes
the pool has left. The engine's compute stream waits, on the GPU, for the last batch that read each lent page and
for the write-backs copying it out (``Lease.wait``): no host sync. ``take_back`` returns pages; the first load
into them waits for the engine's last use of them (its compute stream's position then, or the event it gives).

The pool's address never changes (the kernels' CUDA graphs captured it): the pages lent are views of it that the
engine may use as its own (a paged KV cache's blocks, a scratch buffer) until it gives them back.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from lora_cache.errors import ConfigError
from workers.gpu.book import SlotBook
from workers.gpu.loads import LoadPath
from workers.gpu.streams import CpuStreams
from workers.staging.host_tier import HostTier


@dataclass(frozen=True)
class Lease:
    """Pages of the adapter pool lent to the engine: ``views`` are their elements (one flat view per page, in
    ``pages``' order); ``after``: the events the engine's writes must follow (``wait`` enqueues them)."""

    pages: tuple[int, ...]
    page_bytes: int
    views: tuple[torch.Tensor, ...]
    after: tuple[Any, ...]
    evicted: tuple[str, ...]  # name@version of each adapter evicted for it, oldest first

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.page_bytes


class PoolLender:
    """Lends a rank's pool pages to its engine and takes them back (``WorkerCache.lender``)."""

    def __init__(self, book: SlotBook, load_path: LoadPath, host: HostTier, streams: CpuStreams, flat: torch.Tensor,
                 page_numel: int) -> None:
        self.book, self.load_path, self.host, self.streams = book, load_path, host, streams
        self.flat, self.page_numel = flat, page_numel
        self.page_bytes = page_numel * flat.element_size()

    def capacity_bytes(self) -> int:
        """The pool's bytes for adapters now: every page not lent."""
        with self.book.lock:
            return self._capacity()

    def give_back(self, nbytes: int, keep: Collection[str] = ()) -> Lease:
        """Lend at least ``nbytes`` of the pool (whole pages) to the engine; ``keep``: adapter names needed soon,
        evicted last. Raises ``SlotsBusyError`` (nothing changed) if the free and idle pages fall short."""
        if nbytes < 1:
            raise ConfigError(f"give_back({nbytes}): ask for at least one byte (a page is {self.page_bytes} bytes)")
        count = -(-nbytes // self.page_bytes)
        book = self.book
        with book.lock:
            keys = {s.key for s in book.table.slots if s.key is not None and s.key.name in keep}
            pages, evicted = book.table.lend(count, keys)
            for gone in evicted:  # oldest first, each copied out before the engine may write its pages
                self.load_path.vacate(gone.slot)
            book.prune(self.streams.done)
            after = book.lent_after(pages, self.page_numel)
            book.resized(self._capacity(), self.page_bytes)
        book.report()
        self.host.report()
        views = tuple(self.flat[p * self.page_numel : (p + 1) * self.page_numel] for p in pages)
        return Lease(pages, self.page_bytes, views, after, tuple(f"{g.key.name}@{g.key.version}" for g in evicted))

    def wait(self, lease: Lease) -> None:
        """The compute stream waits (on the GPU) until the lent pages are the engine's to write."""
        for event in lease.after:
            self.streams.compute_wait(event)

    def take_back(self, lease: Lease, last_use: Any = None) -> None:
        """The engine returns ``lease``'s pages. ``last_use``: the event of its last use of them (None: the
        compute stream's position now); the first load into them waits for it (invariant 2). A lease taken back
        twice, or pages never lent, are refused, naming them, and nothing changes."""
        book = self.book
        with book.lock:
            book.table.reclaim(lease.pages)
            event = last_use if last_use is not None else self.streams.record_compute(label=("lent", lease.pages[0]))
            for p in lease.pages:
                book.last_use[p] = event
            book.resized(self._capacity(), self.page_bytes)
        book.report()
        if book.on_room is not None:  # loads waiting for a run may fit now
            book.on_room()

    def _capacity(self) -> int:
        return (self.book.table.num_pages - self.book.table.lent_pages()) * self.page_bytes
