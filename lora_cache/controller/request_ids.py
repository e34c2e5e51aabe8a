"""Registration retries by the client's request id (lifecycle step 0; issue 46 item 3a).

A client that lost a registration's answer (a deadline, a gateway or controller restart) cannot tell whether it
was applied. Registering again was safe for the catalog (an unchanged file is proven the same version) but not for
the answer: the retry's ``previous`` was the version itself, and a registration of the name between the two was
overwritten. With a request id the retry registers nothing: ``RequestIds.run`` answers an id it answered before,
for the same name and path, with that answer; waits for one still running (a retry racing its original, or the same
id twice in one batch); and refuses the id with another name or path (``ConflictError`` naming both). Only
registrations that succeeded are kept: a failed one is tried again by its retry (its files may have been fixed).

The answers of the last ``KEPT`` ids are kept, oldest dropped first, and saved with the catalog (``encode`` /
``load``; ``DurableState.save_answers``), so a retry after a controller restart gets the same answer. Plain asyncio.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from lora_cache.controller.registrations import Registered
from lora_cache.errors import ConflictError

KEPT = 4096  # answered ids kept: far more than the retries of a registration burst in flight
MAX_SAVED_BYTES = 2 << 20  # the saved answers at most (long paths): the oldest beyond it are not saved
FORMAT = 1


class Answer(NamedTuple):
    """A registration that succeeded, as it was answered."""

    name: str
    path: str
    version: str
    previous: str


class Item(NamedTuple):
    name: str
    path: str
    request_id: str  # "" for none


Register = Callable[[list[tuple[str, str]]], Awaitable[list[Registered]]]


class RequestIds:
    """The answers of recent request ids, and the registrations in flight under one."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._answers: OrderedDict[str, Answer] = OrderedDict()
        self._running: dict[str, tuple[str, str, asyncio.Future[Registered]]] = {}
        self.generation = 0  # changes with every answer kept (the durable state saves when it moved)
        self.repeats = 0  # calls answered from a kept answer or a registration in flight (status)

    async def run(self, items: Sequence[Item], register: Register) -> list[Registered]:
        """Register ``items`` through ``register`` (a list of (name, path); answers in order), except those whose
        request id was answered before or is in flight; answers in the items' order."""
        results: list[Registered | None] = [None] * len(items)
        fresh: list[int] = []
        waits: dict[int, asyncio.Future[Registered]] = {}
        for i, item in enumerate(items):  # no await in this loop: ids are claimed before any other call runs
            if not item.request_id:
                fresh.append(i)
                continue
            try:
                found = self._find(item)
            except ConflictError as e:
                results[i] = Registered(item.name, error=e)
                continue
            if isinstance(found, Answer):
                results[i] = Registered(item.name, found.version, found.previous)
                self.repeats += 1
            elif found is not None:
                waits[i] = found
            else:
                future: asyncio.Future[Registered] = asyncio.get_running_loop().create_future()
                self._running[item.request_id] = (item.name, item.path, future)
                fresh.append(i)
        try:
            done = await register([(items[i].name, items[i].path) for i in fresh]) if fresh else []
        except BaseException as e:
            for i in fresh:
                self._end(items[i], None, e)
            raise
        for i, registered in zip(fresh, done):
            results[i] = registered
            self._end(items[i], registered, None)
        for i, future in waits.items():
            results[i] = await asyncio.shield(future)
            self.repeats += 1
        assert all(r is not None for r in results), "an item without an answer"  # register answers every item
        return results  # type: ignore[return-value]

    def _find(self, item: Item) -> Answer | asyncio.Future[Registered] | None:
        """The kept answer or the running registration of ``item``'s id (None: neither); ConflictError if the id
        was used for another name or path."""
        rid = item.request_id
        found: Answer | asyncio.Future[Registered]
        if (answer := self._answers.get(rid)) is not None:
            self._answers.move_to_end(rid)  # a retried id stays a while longer
            name, path, found = answer.name, answer.path, answer
        elif (running := self._running.get(rid)) is not None:
            name, path, found = running
        else:
            return None
        if (name, path) != (item.name, item.path):
            raise ConflictError(f"request id {rid[:128]!r} was used for adapter {name!r} at {path!r}; this call names "
                                f"adapter {item.name!r} at {item.path!r}: give each registration an id of its own")
        return found

    def _end(self, item: Item, registered: Registered | None, error: BaseException | None) -> None:
        if not item.request_id or (running := self._running.pop(item.request_id, None)) is None:
            return
        future = running[2]
        if registered is not None:
            future.set_result(registered)
            if registered.error is None:
                self._keep(item.request_id, Answer(item.name, item.path, registered.version, registered.previous))
        else:
            future.set_exception(error if isinstance(error, Exception) else ConflictError(
                f"the registration of adapter {item.name!r} under request id {item.request_id!r} was cancelled; "
                "register it again"))
            future.exception()  # retrieved here: a future nobody waits for must not log "never retrieved"

    def _keep(self, rid: str, answer: Answer) -> None:
        self._answers[rid] = answer
        self._answers.move_to_end(rid)
        while len(self._answers) > self.kept:
            self._answers.popitem(last=False)
        self.generation += 1

    def __len__(self) -> int:
        return len(self._answers)

    # -- across a controller restart -------------------------------------------------------------------
    def encode(self, max_bytes: int = MAX_SAVED_BYTES) -> bytes:
        """The answers, oldest first; the oldest left out once their encoding passes ``max_bytes``."""
        rows: list[str] = []
        size = 0
        for rid, answer in reversed(self._answers.items()):
            row = json.dumps([rid, *answer])
            size += len(row) + 1
            if size > max_bytes:
                break
            rows.append(row)
        return f'{{"format": {FORMAT}, "answers": [{", ".join(reversed(rows))}]}}'.encode()

    def load(self, data: bytes) -> int:
        """Take the answers a predecessor saved (oldest first), behind none of this controller's own; how many."""
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"request-id answers of format {doc.get('format') if isinstance(doc, dict) else doc!r}; "
                             f"this controller reads format {FORMAT}")
        mine, self._answers = self._answers, OrderedDict()
        for rid, name, path, version, previous in doc["answers"]:
            self._answers[str(rid)] = Answer(str(name), str(path), str(version), str(previous))
        for rid, answer in mine.items():
            self._keep(rid, answer)
        while len(self._answers) > self.kept:
            self._answers.popitem(last=False)
        return len(self._answers)
