"""The background registration's order and bookkeeping on the CPU (``lora_cache/controller/backlog.py``): listed
adapters registered in batches in the listing's order, a name no longer wanted when its batch comes skipped (registered
on demand meanwhile, or unregistered), each refusal counted and the rest registered. The whole path on Ray against an
S3 server: ``tests/test_ray_backlog.py``."""

from __future__ import annotations

import asyncio

from lora_cache.controller.backlog import Backlog
from lora_cache.controller.registrations import Registered
from lora_cache.errors import AdapterFormatError


def test_batches_in_listing_order_skip_names_no_longer_wanted_and_count_refusals() -> None:
    async def run() -> tuple[Backlog, list[list[str]], list[int]]:
        registered: set[str] = set()
        unregistered = {"a-04"}  # an operator's unregistration since the listing
        chunks: list[list[str]] = []
        waiting: list[int] = []
        first_batch_in = asyncio.Event()
        release = asyncio.Event()

        async def register(items: list[tuple[str, str]]) -> list[Registered]:
            chunks.append([name for name, _ in items])
            waiting.append(backlog.stats()["waiting"])
            first_batch_in.set()
            await release.wait()  # the first batch is in flight while a request registers a-07 on demand
            out = []
            for name, path in items:
                if name == "a-09":
                    out.append(Registered(name, error=AdapterFormatError(f"{path}: not an adapter")))
                else:
                    registered.add(name)
                    out.append(Registered(name, version="v1"))
            return out

        backlog = Backlog(register, lambda name: name not in registered and name not in unregistered, batch=4)
        items = [(f"a-{k:02d}", f"s3://b/p/a-{k:02d}") for k in range(10)]
        assert backlog.add(items) == 10
        await first_batch_in.wait()
        registered.add("a-07")  # registered on demand before its batch came
        release.set()
        assert backlog.task is not None
        await backlog.task
        return backlog, chunks, waiting

    backlog, chunks, waiting = asyncio.run(run())
    # batches of 4 in order; a-04 (unregistered) and a-07 (registered meanwhile) skipped when their batch came
    assert chunks == [["a-00", "a-01", "a-02", "a-03"], ["a-05", "a-06", "a-08", "a-09"]]
    assert waiting == [10, 4]  # the batch in flight counts as waiting
    assert backlog.stats() == {"waiting": 0, "registered": 7, "skipped": 2, "failed": 1}


def test_a_batch_whose_call_fails_is_counted_and_the_next_goes_on() -> None:
    async def run() -> Backlog:
        calls = 0

        async def register(items: list[tuple[str, str]]) -> list[Registered]:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise ConnectionError("the actor's call failed")
            return [Registered(name, version="v1") for name, _ in items]

        backlog = Backlog(register, lambda name: True, batch=2)
        backlog.add([("a", "/x/a"), ("b", "/x/b"), ("c", "/x/c")])
        assert backlog.task is not None
        await backlog.task
        backlog.add([("d", "/x/d")])  # a later add starts it again
        assert backlog.task is not None
        await backlog.task
        return backlog

    assert asyncio.run(run()).stats() == {"waiting": 0, "registered": 2, "skipped": 0, "failed": 2}


def test_a_requests_registration_holds_the_backlogs_reads_unless_its_name_is_in_the_batch_being_read() -> None:
    async def run() -> list[bool]:
        seen: list[bool] = []
        inside = asyncio.Event()
        release = asyncio.Event()

        async def register(items: list[tuple[str, str]]) -> list[Registered]:
            inside.set()
            await release.wait()
            return [Registered(name, version="v1") for name, _ in items]

        backlog = Backlog(register, lambda name: True, batch=2)
        seen.append(backlog.gate.is_set())  # open: nothing asked
        backlog.add([("a", "/x/a"), ("b", "/x/b"), ("c", "/x/c")])
        await inside.wait()  # the batch (a, b) is being read
        async with backlog.yielding("c"), backlog.yielding("z"):  # two requests' registrations at once
            seen.append(backlog.gate.is_set())  # closed: the backlog starts no read meanwhile
        seen.append(backlog.gate.is_set())  # open again once both ended
        async with backlog.yielding("a"):  # a is in the batch being read: the request waits for it, reads go on
            seen.append(backlog.gate.is_set())
        release.set()
        assert backlog.task is not None
        await backlog.task
        return seen

    assert asyncio.run(run()) == [True, False, True, True]


def test_what_is_left_is_the_batch_being_read_then_the_queue_and_an_unregistered_name_leaves_it() -> None:
    async def run() -> tuple[list[tuple[str, str]], list[tuple[str, str]], bool, bool]:
        inside, release = asyncio.Event(), asyncio.Event()

        async def register(items: list[tuple[str, str]]) -> list[Registered]:
            inside.set()
            await release.wait()
            return [Registered(name, version="v1") for name, _ in items]

        backlog = Backlog(register, lambda name: True, batch=2)
        backlog.add([(n, f"/x/{n}") for n in "abcde"])
        await inside.wait()
        left = backlog.left()  # what a restart would go on with now
        removed, absent = backlog.forget("d"), backlog.forget("zz")
        after = backlog.left()
        release.set()
        assert backlog.task is not None
        await backlog.task
        return left, after, removed, absent

    left, after, removed, absent = asyncio.run(run())
    assert [n for n, _ in left] == list("abcde") and [n for n, _ in after] == list("abce")
    assert removed and not absent
