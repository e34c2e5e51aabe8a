"""Registration off the controller's event loop (lifecycle step 0; issue 29).

Reading an adapter (its config and header validated, the weights hashed into its version: ~130 ms for an
8B adapter on this CPU) runs on a thread; what it found is applied to the core on the loop, so ``status``,
lookups, routing and hints are answered meanwhile. Each name's registrations and unregistrations apply
in the order the calls arrived (``Turns``), whatever order their reads finish in: the last call wins, as
when the actor ran them one at a time. A read that fails changes nothing.

A batch (``register_adapters``, the ``RegisterAdapters`` RPC, ``serve --adapters DIR``) checks every item
before reading any; reads them one after another on a thread (object-store adapters ``store_reads`` at a time:
their reads are round trips, not work), in chunks of at most ``CHUNK_ITEMS`` adapters or ``CHUNK_BYTES`` of files
(``STORE_CHUNK_ITEMS`` store adapters); applies each chunk as it comes; and hands it at once to every worker with the
versions as hashed here (``KnownVersion``), so that a rank on this machine takes each one without reading its
weights again. Once more than ``MAX_SENT`` chunks wait for the workers' answers, the oldest is awaited first,
so a worker's ping never waits behind more than ``MAX_SENT + 1``. One plan follows the batch; an item that
fails gets its own error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from lora_cache.adapters.catalog import check_name
from lora_cache.adapters.objects import is_store_url
from lora_cache.adapters.peft import AdapterSpec, KnownVersion
from lora_cache.controller.core import ControllerCore
from lora_cache.controller.fanout import Sent, WorkerFanout
from lora_cache.errors import AdapterFormatError, ConflictError, LoraCacheError

log = logging.getLogger(__name__)

CHUNK_ITEMS = 64  # adapters read, applied and sent to the workers together
CHUNK_BYTES = 256 << 20  # ... or fewer, once their files add up to this (a rank that must hash them takes ~0.3 s)
STORE_CHUNK_ITEMS = 256  # object-store adapters read together: metadata only, ``store_reads`` at a time
YIELD_S = 1.0  # the longest a gated store read waits for requests' reads (a steady stream of them never starves it)
MAX_SENT = 2  # chunks sent to the workers and not yet answered, before the oldest is awaited


class Registered(NamedTuple):
    """What became of one item: registered (``version``, and the one it replaced), or not (``error``)."""

    name: str
    version: str = ""  # "" when not registered
    previous: str = ""  # the version it replaced; "" if the name was new
    error: LoraCacheError | None = None  # why not: its name is as it was before the call
    rank_errors: tuple[str, ...] = ()  # ranks that refused the version (it is registered; their loads fail)
    # ranks that did not answer in time (restarting, or dead): it is registered (the durable catalog has it) and they
    # are given it when they are adopted again or restart; not an error
    rank_pending: tuple[str, ...] = ()


class Turns:
    """Each name's turn to change the catalog, in the order the calls arrived.

    ``take(name)`` runs when a call arrives (no await before it); the call then ``await``\\ s ``wait()`` before it
    changes ``name`` and calls ``done()`` after, which lets the next call of that name go on. Plain asyncio."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Future[None]] = {}  # name -> the latest call's turn (until it is done)

    def take(self, name: str) -> Turn:
        ahead = self._last.get(name)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last[name] = mine
        return Turn(self, name, ahead, mine)

    def _release(self, turn: Turn) -> None:
        """``turn`` is over; the next call of its name goes on once every call ahead of it is over too (a call
        that gives its turn up early, cancelled or failed, never lets a later one overtake an earlier one)."""
        if turn.ahead is not None and not turn.ahead.done():
            turn.ahead.add_done_callback(lambda _: self._release(turn._replace(ahead=None)))
            return
        if not turn.mine.done():
            turn.mine.set_result(None)
        if self._last.get(turn.name) is turn.mine:
            del self._last[turn.name]

    def __len__(self) -> int:
        return len(self._last)


class Turn(NamedTuple):
    turns: Turns
    name: str
    ahead: asyncio.Future[None] | None  # the turn of the call of this name that arrived before, if any
    mine: asyncio.Future[None]

    async def wait(self) -> None:
        if self.ahead is not None:
            await asyncio.shield(self.ahead)  # a cancelled waiter must not cancel the turn ahead of it

    def done(self) -> None:
        self.turns._release(self)


class Item(NamedTuple):
    at: int  # its place in the call's items
    name: str
    path: str
    turn: Turn
    known: KnownVersion | None = None  # hashed already (a push's): taken if the file proves it


class Read(NamedTuple):
    item: Item
    spec: AdapterSpec | None
    error: LoraCacheError | None


class Registrar:
    """The actor's registrations: reads on a thread, changes on the loop in each name's order, the workers told.

    ``draining``: names being unregistered (their registration is refused); ``plan``: the actor's plan-and-send."""

    def __init__(self, core: ControllerCore, fanout: WorkerFanout, draining: set[str],
                 plan: Callable[[], Awaitable[None]]) -> None:
        self.core, self.fanout, self.draining, self.plan = core, fanout, draining, plan
        self.turns = Turns()
        self.background: set[asyncio.Future[Any]] = set()  # ``_later``'s work until done

    async def register(self, items: list[tuple[str, str]], known: Mapping[str, KnownVersion] | None = None,
                       store_reads: int = 0, gate: threading.Event | None = None,
                       answered: bool = True) -> list[Registered]:
        """Register every (name, path), each by itself; one plan after. Answers in the items' order. ``known``: by
        path, a version hashed already (a push's, from its bytes in memory), taken if the file opened proves it
        is the file it was hashed for (``peft.proves``; else the file is hashed here). ``store_reads``: object-store
        items read at once (0: the catalog's ``store_reads``; the background registration leaves some to requests);
        ``gate``: each store read waits (up to ``YIELD_S``) while it is closed (the background registration's reads
        yield to a request's). ``answered`` False: it returns once the workers were sent the registrations, their
        answers (logged) and the plan after coming in the background (a device push: the ranks it rings wait for
        the registration themselves; ``rank_errors`` and ``rank_pending`` are then empty)."""
        results: list[Registered | None] = [None] * len(items)
        todo: list[Item] = []
        seen: dict[str, int] = {}
        for i, (name, path) in enumerate(items):  # every item checked (and its turn taken) before any read
            try:
                check_item(name, path, seen.get(name))
            except LoraCacheError as e:
                results[i] = Registered(str(name), error=e)
                continue
            seen[name] = i
            todo.append(Item(i, name, path, self.turns.take(name), (known or {}).get(path)))
        try:
            await self._register(todo, results, store_reads, gate, answered)
        finally:
            for item in todo:
                item.turn.done()  # on any exit: a later call of the name never waits forever
        if todo and answered:
            await self.plan()
        elif todo:
            self._later(self.plan())
        return [r or Registered(items[i][0], error=_lost(items[i][0])) for i, r in enumerate(results)]

    def _later(self, work: Awaitable[Any]) -> None:
        """``work`` in the background, held until done (the loop keeps only a weak reference to a task)."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _register(self, todo: list[Item], results: list[Registered | None], store_reads: int = 0,
                        gate: threading.Event | None = None, answered: bool = True) -> None:
        sent: deque[tuple[list[Item], Sent]] = deque()
        async for chunk in _read(self.core, todo, store_reads, gate):
            for read in chunk:
                await read.item.turn.wait()
            applied = [read.item for read in chunk if self._apply(read, results)]
            if applied:  # no await between the changes and this submission: see WorkerFanout.submit_registrations
                entries = [(it.name, it.path, self.core.catalog.get(it.name).known) for it in applied]
                submitted = self.fanout.submit_registrations(entries)
                if answered:
                    sent.append((applied, submitted))
                else:  # the answers only logged (``WorkerFanout.registered``)
                    self._later(self.fanout.registered(submitted))
            for read in chunk:
                read.item.turn.done()
            while len(sent) > MAX_SENT:
                await self._answered(*sent.popleft(), results)
        while sent:
            await self._answered(*sent.popleft(), results)

    def _apply(self, read: Read, results: list[Registered | None]) -> bool:
        """Make one read adapter current, on the loop; False (and its error recorded) if it is not."""
        name = read.item.name
        try:
            if read.error is not None:
                raise read.error
            assert read.spec is not None
            if name in self.draining:
                raise ConflictError(f"adapter {name!r} is being unregistered (waiting for in-use references to "
                                    "drain); register it again once UnregisterAdapter has returned")
            previous = self.core.catalog.get(name).version if name in self.core.catalog else ""
            version = self.core.add_adapter(read.spec, read.item.path)
        except LoraCacheError as e:
            results[read.item.at] = Registered(name, error=e)
            return False
        results[read.item.at] = Registered(name, version, previous)
        return True

    async def _answered(self, items: list[Item], sent: Sent, results: list[Registered | None]) -> None:
        for item, ranks in zip(items, await self.fanout.registered(sent)):
            if ranks.refused or ranks.pending:
                results[item.at] = results[item.at]._replace(  # type: ignore[union-attr]
                    rank_errors=tuple(ranks.refused), rank_pending=tuple(ranks.pending))


def check_item(name: object, path: object, first: int | None) -> None:
    """A bad item is refused before anything is read: its name, its path, a name given twice."""
    check_name(name)  # type: ignore[arg-type]
    if not isinstance(path, str) or not path:
        raise AdapterFormatError(f"adapter {name!r}: path {path!r} is empty or not a string; give the adapter's "
                                 "directory under an adapter root")
    if first is not None:
        raise AdapterFormatError(f"adapter {name!r} is named again in this batch (first as item {first}); name "
                                 "each adapter once per call")


def _lost(name: str) -> LoraCacheError:  # never expected: every item gets a result or its error
    return LoraCacheError(f"adapter {name!r} was not registered (the call ended early); register it again")


async def _read(core: ControllerCore, todo: list[Item], store_reads: int = 0,
                gate: threading.Event | None = None) -> AsyncIterator[list[Read]]:
    """The items read on a thread in chunks, the next chunk read while the caller applies this one."""
    pending = deque(todo)
    stores = any(is_store_url(item.path) for item in todo)
    reads = store_reads or core.catalog.config.store_reads
    pool = ThreadPoolExecutor(reads, "lora-cache-store-reads") if stores else None
    try:
        ahead = asyncio.ensure_future(asyncio.to_thread(_read_chunk, core, pending, pool, gate)) if pending else None
        while ahead is not None:
            chunk = await ahead
            ahead = (asyncio.ensure_future(asyncio.to_thread(_read_chunk, core, pending, pool, gate)) if pending
                     else None)
            yield chunk
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _read_chunk(core: ControllerCore, pending: deque[Item], pool: ThreadPoolExecutor | None = None,
                gate: threading.Event | None = None) -> list[Read]:
    """Items taken from ``pending`` and read (on a thread: nothing changes) until a chunk is full; a run of
    object-store items is read on ``pool``, in the items' order, each after ``gate`` opens (or ``YIELD_S``)."""
    if pool is not None and pending and is_store_url(pending[0].path):
        run: list[Item] = []
        while pending and len(run) < STORE_CHUNK_ITEMS and is_store_url(pending[0].path):
            run.append(pending.popleft())

        def gated(item: Item) -> Read:
            if gate is not None:
                gate.wait(YIELD_S)
            return _read_one(core, item)

        return list(pool.map(gated, run))
    chunk: list[Read] = []
    size = 0
    while pending and len(chunk) < CHUNK_ITEMS and size < CHUNK_BYTES:
        if pool is not None and is_store_url(pending[0].path):
            break  # the next run of store items: read together, in the next chunk
        read = _read_one(core, pending.popleft())
        chunk.append(read)
        size += read.spec.file_bytes if read.spec is not None else 0
        time.sleep(0)  # let the event loop have the GIL between adapters: a status call waits for one at most
    return chunk


def _read_one(core: ControllerCore, item: Item) -> Read:
    """One item read: its spec, or its own error (nothing changes)."""
    try:  # the current version's proof: the same file again (re-registered unchanged) is not hashed again
        return Read(item, core.read_adapter(item.name, item.path, item.known or core.catalog.known(item.name)), None)
    except LoraCacheError as e:
        return Read(item, None, e)
    except OSError as e:  # an unreadable directory or file: the item's own error, as any bad file
        return Read(item, None, AdapterFormatError(f"adapter {item.name!r}: {item.path} could not be read ({e}); "
                                                   "check the path and its permissions"))
