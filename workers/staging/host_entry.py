"""A staged shard of the host tier (``workers.staging.host_tier``): its block of the arena, its references, and the
fetchers told of its chunks as a read (or a write-back: exclusive tiers) puts them in place; and a fetch waiting for
room. Split from ``host_tier.py`` along its seam: what one entry is, apart from how the tier keeps them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lora_cache.adapters.objects import StoreSource
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardLayout
from lora_cache.errors import NotFoundError
from lora_cache.vocab import AdapterKey
from workers.reads.finite import check_finite
from workers.staging.arena import Block
from workers.staging.read_ways import Ticket

log = logging.getLogger(__name__)
ChunkListener = Callable[["HostEntry", int], None]  # told how many chunks of an entry are staged so far


@dataclass
class HostEntry:
    key: AdapterKey
    layout: ShardLayout
    block: Block
    tensor: torch.Tensor  # 1-D view of the arena, layout.dtype, layout.numel elements
    ready: Future[HostEntry]
    refs: int = 0
    read_ms: float = 0.0
    bytes_read: int = 0
    chunks: tuple[slice, ...] = ()  # ranges of layout.entries read one after another (empty: one chunk)
    staged: int = 0  # chunks in place so far
    checked: int = 0  # chunks proven finite so far (``progress``, on the read's one publishing thread)
    blind: int = 0  # references of fetches told of no chunk (no ``on_chunk``): a failed read drops them itself
    dropped: bool = False  # out of the index (its adapter unregistered): never served again, freed once let go
    whole: bool = False  # its "staged" change was queued: its leaving is reported too
    listeners: list[ChunkListener] = field(default_factory=list)  # fetchers told of each chunk, until done
    lock: threading.Lock = field(default_factory=threading.Lock)  # protects staged and listeners
    marks: list[tuple[str, float]] = field(default_factory=list)  # (phase, perf_counter) of its read (probes)
    speculative: bool = False  # read by a warm stage: no demand-read marker for the node (``node_reads``)
    joined: bool = False  # a load joined a warm stage's read: its store fetch yields no more (``DemandMarks.yields``)
    store: StoreSource | None = None  # its adapter's store object: its node disk copy is touched when it is evicted
    protected: bool = False  # let go of after every idle unprotected entry (``workers.staging.eviction``)
    touched: float = 0.0  # time.monotonic() of its read's start, its last fetch or its write-back (eviction order)
    node_mark: str = ""  # its demand-read marker while it is read ("" for none); under ``lock``
    read_over: bool = False  # its read ended (no marker may be left for it any more); under ``lock``
    ticket: Ticket | None = None  # ``direct_reads`` auto: what its read was sent with, to time its way by
    way: str = ""  # the way its read of a local file found cold went (direct | preadv | ahead: ``read_ways.WAYS``),
    # decided once at dispatch for every reader; "" where ``direct_reads`` is off without ``read_ahead``, its file was
    # warm, or it is a store object

    @property
    def how(self) -> str:
        """How its read moves its bytes (``workers.reads.shard.HOW``): "direct" (its runs by ``O_DIRECT``) where its
        way is, else "preadv" (``ahead`` too: the file is asked for whole beside the read)."""
        return "direct" if self.way == "direct" else "preadv"

    @property
    def num_chunks(self) -> int:
        return max(1, len(self.chunks))

    def listen(self, on_chunk: ChunkListener) -> None:
        """Tell ``on_chunk`` how many chunks are staged now (if any) and as more land."""
        with self.lock:
            staged = self.staged
            if staged < self.num_chunks:
                self.listeners.append(on_chunk)
        if staged:
            tell(on_chunk, self, staged)

    def progress(self, count: int) -> None:
        """The read has put the first ``count`` chunks in place (reader thread): each new one is proven finite
        (``workers.reads.finite``) before anyone is told of it; ``NonFiniteWeightsError`` fails the read."""
        for k in range(self.checked, min(count, self.num_chunks)):
            check_finite(str(self.key), self.layout, self.tensor,
                         self.layout.entries[self.chunks[k] if self.chunks else slice(None)])
            self.checked = k + 1
        with self.lock:
            self.staged = max(self.staged, count)
            listeners = list(self.listeners)
            if self.staged >= self.num_chunks:
                self.listeners.clear()
        for on_chunk in listeners:
            tell(on_chunk, self, count)

    def forget(self) -> None:
        """A failed read: nobody is told of more chunks (the entry's future carries the error)."""
        with self.lock:
            self.listeners.clear()


@dataclass(eq=False)
class Wait:
    """A fetch waiting for host room (no block yet): its entry is made when it is admitted."""

    spec: AdapterSpec
    layout: ShardLayout
    chunks: tuple[slice, ...]
    ready: Future[HostEntry] = field(default_factory=Future)  # becomes the entry's ``ready``
    refs: int = 1
    blind: int = 0  # as ``HostEntry.blind``
    listeners: list[ChunkListener] = field(default_factory=list)


def chunk_listener(on_chunk: Callable[[HostEntry, int, bool], None], hit: bool) -> ChunkListener:
    return lambda entry, count: on_chunk(entry, count, hit)


def unregistered(key: AdapterKey) -> NotFoundError:
    return NotFoundError(f"adapter {key.name} was unregistered while its shard {key} was read or waited for host "
                         "room; nothing of it is served: register it again to load it")


def tell(on_chunk: ChunkListener, entry: HostEntry, count: int) -> None:
    try:
        on_chunk(entry, count)
    except Exception:  # a broken listener must not fail the read that other fetchers share
        log.exception("chunk listener of %s failed", entry.key)
