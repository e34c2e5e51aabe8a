"""Registration retries by request id (issue 46 item 3a), on the plain core ``RequestIds`` (asyncio, no Ray): an id
answered before is answered the same and registers nothing; a retry racing its original waits for it; an id used
for another name or path is refused naming both; a failure is not kept; answers survive encode/load (a restart)."""

from __future__ import annotations

import asyncio

import pytest

from lora_cache.controller.registrations import Registered
from lora_cache.controller.request_ids import Item, RequestIds
from lora_cache.errors import AdapterFormatError, ConflictError


class Catalog:
    """Registers by path: each call makes a new version of the name (so a second registration would show)."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str]]] = []
        self.versions: dict[str, int] = {}
        self.gate: asyncio.Event | None = None  # set: registrations wait for it
        self.entered = asyncio.Event()
        self.fail: set[str] = set()

    async def register(self, items: list[tuple[str, str]]) -> list[Registered]:
        self.calls.append(items)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        out = []
        for name, path in items:
            if path in self.fail:
                out.append(Registered(name, error=AdapterFormatError(f"{path} is broken")))
                continue
            previous = self.versions.get(name)
            self.versions[name] = (previous or 0) + 1
            out.append(Registered(name, f"v{self.versions[name]}", f"v{previous}" if previous else ""))
        return out


def test_a_retry_by_its_id_gets_the_first_answer_and_registers_nothing() -> None:
    async def scenario() -> None:
        ids, catalog = RequestIds(), Catalog()
        (first,) = await ids.run([Item("a", "/a", "req-1")], catalog.register)
        (other,) = await ids.run([Item("a", "/a", "req-2")], catalog.register)  # another registration meanwhile
        (retry,) = await ids.run([Item("a", "/a", "req-1")], catalog.register)
        assert (first.version, first.previous) == ("v1", "") and (other.version, other.previous) == ("v2", "v1")
        assert (retry.version, retry.previous, retry.error) == ("v1", "", None)  # not v3: nothing overwritten
        assert len(catalog.calls) == 2 and ids.repeats == 1
        (plain,) = await ids.run([Item("a", "/a", "")], catalog.register)  # no id: it registers
        assert plain.version == "v3" and len(ids) == 2

    asyncio.run(scenario())


def test_an_id_used_for_another_adapter_is_refused_naming_both() -> None:
    async def scenario() -> None:
        ids, catalog = RequestIds(), Catalog()
        await ids.run([Item("a", "/a", "req-1")], catalog.register)
        (refused, fine) = await ids.run([Item("b", "/b", "req-1"), Item("c", "/c", "req-3")], catalog.register)
        assert isinstance(refused.error, ConflictError) and fine.version == "v1"
        assert "request id 'req-1' was used for adapter 'a' at '/a'; this call names adapter 'b' at '/b'" in str(
            refused.error)
        assert catalog.calls[-1] == [("c", "/c")] and "b" not in catalog.versions

    asyncio.run(scenario())


def test_a_retry_racing_its_original_waits_for_it_and_one_registration_runs() -> None:
    """The original is held inside its registration (a gate, not a sleep) while the retry arrives, and the same id
    twice in one batch, too."""

    async def scenario() -> None:
        ids, catalog = RequestIds(), Catalog()
        catalog.gate = asyncio.Event()
        original = asyncio.ensure_future(ids.run([Item("a", "/a", "req-1")], catalog.register))
        await catalog.entered.wait()
        retry = asyncio.ensure_future(ids.run([Item("a", "/a", "req-1"), Item("a", "/a", "req-1")],
                                              catalog.register))
        await asyncio.sleep(0)  # the retry has claimed nothing new: it waits on the original's future
        assert len(catalog.calls) == 1
        catalog.gate.set()
        (first,), again = await original, await retry
        assert [r.version for r in again] == [first.version, first.version] == ["v1", "v1"]
        assert len(catalog.calls) == 1 and catalog.versions == {"a": 1}

    asyncio.run(scenario())


def test_a_failed_registration_is_not_kept_and_its_retry_registers() -> None:
    async def scenario() -> None:
        ids, catalog = RequestIds(), Catalog()
        catalog.fail.add("/a")
        (failed,) = await ids.run([Item("a", "/a", "req-1")], catalog.register)
        assert isinstance(failed.error, AdapterFormatError) and len(ids) == 0
        catalog.fail.clear()  # the files were fixed
        (retry,) = await ids.run([Item("a", "/a", "req-1")], catalog.register)
        assert retry.error is None and retry.version == "v1" and len(catalog.calls) == 2

    asyncio.run(scenario())


def test_a_registration_that_raised_ends_its_id_and_the_next_call_registers() -> None:
    async def scenario() -> None:
        ids = RequestIds()

        async def broken(items: list[tuple[str, str]]) -> list[Registered]:
            raise RuntimeError("the controller's registrar broke")

        with pytest.raises(RuntimeError):
            await ids.run([Item("a", "/a", "req-1")], broken)
        catalog = Catalog()
        (retry,) = await ids.run([Item("a", "/a", "req-1")], catalog.register)
        assert retry.version == "v1"

    asyncio.run(scenario())


def test_answers_survive_a_restart_bounded_by_count_and_bytes() -> None:
    async def scenario() -> None:
        ids, catalog = RequestIds(kept=3), Catalog()
        for k in range(5):
            await ids.run([Item(f"a{k}", f"/a{k}", f"req-{k}")], catalog.register)
        assert len(ids) == 3  # the oldest two dropped
        successor = RequestIds(kept=3)
        await successor.run([Item("z", "/z", "req-z")], catalog.register)  # its own, before the restore
        assert successor.load(ids.encode()) == 3
        (retry,) = await successor.run([Item("a4", "/a4", "req-4")], catalog.register)
        assert retry.version == "v1" and successor.repeats == 1
        (mine,) = await successor.run([Item("z", "/z", "req-z")], catalog.register)
        assert mine.version == "v1"  # its own answer kept over the predecessor's oldest
        newest = RequestIds()
        assert newest.load(ids.encode(max_bytes=60)) == 1  # the byte bound leaves the oldest out, keeps the newest
        (kept,) = await newest.run([Item("a4", "/a4", "req-4")], catalog.register)
        assert kept.version == "v1" and newest.repeats == 1
        with pytest.raises(ValueError, match="format 9"):
            RequestIds().load(b'{"format": 9, "answers": []}')

    asyncio.run(scenario())
