"""An engine's step beside the control plane's commands (issue 32, seventh round; bench/RESULTS.md).

A step on a READY adapter is never held by a load or a stage of another adapter in flight on the same rank: the
planner's prefetches and stages run beside the engine's steps, and nothing they hold (a read, a staged shard waiting
for its copy) is a lock the step's ``acquire``/``release`` needs. Each case holds the other adapter's command at a
fault point (a barrier), runs a step's cache calls from another thread, and requires them to finish while the
command is still held there; then it goes on and lands. (On the Serve benchmark a hit's step spent 1.4-1.5 ms
neither computing nor on the run queue under both routings; ours' misses 2.5 ms, bench/RESULTS.md.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from lora_cache.adapters.catalog import AdapterCatalog
from tests.waiting import wait_for
from workers import faults
from workers.cache import WorkerCache, WorkerConfig
from workers.staging.host_config import HostTierConfig

CASES = [("prefetch", "mid_read"), ("prefetch", "before_copy"), ("stage", "mid_read")]


@pytest.mark.parametrize(("command", "point"), CASES)
def test_a_step_on_a_ready_adapter_is_not_held_by_another_adapters_load_in_flight(
    command: str, point: str, tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]
) -> None:
    paths = tiny_adapters(count=2, rank="16")
    catalog = make_catalog(paths[0].parent)
    ready, other = catalog.names()[:2]
    host = HostTierConfig(host_bytes=1 << 20, read_threads=2, read_parallel=1, pin=False, reads="thread")
    cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", dtype="float32", host=host), catalog)
    arrived, go_on = threading.Event(), threading.Event()

    def hold(_: Any) -> None:  # on the loading thread, at the fault point
        arrived.set()
        go_on.wait(120)

    started: list[Future[Any] | None] = []
    try:
        cache.prefetch(ready).result(timeout=60)
        faults.arm(point, other, hold)
        # the controller's command, from a thread of its own (as the attached rank's serve thread runs it)
        issue = threading.Thread(
            target=lambda: started.append(cache.prefetch(other) if command == "prefetch" else cache.stage(other))
        )
        issue.start()
        wait_for(arrived.is_set, f"the {command} of {other} held at {point}", timeout=60)

        stepped = threading.Event()

        def step() -> None:  # what the engine's step does with the cache: acquire, (kernels), release
            batch = cache.acquire([ready])
            assert batch.slots[0] >= 0
            cache.release(batch)
            pin = cache.acquire_ready([ready])
            assert pin is not None
            cache.release(pin)
            assert ready in cache.ready_names()
            stepped.set()

        threading.Thread(target=step, daemon=True).start()
        wait_for(
            stepped.is_set,
            f"a step on READY {ready} while the {command} of {other} is held at {point}",
            timeout=60,
        )
        assert not go_on.is_set() and other not in cache.ready_names()  # the other load was in flight throughout
        go_on.set()
        issue.join(60)
        future = started[0]
        assert future is not None
        future.result(timeout=60)
        if command == "prefetch":
            assert cache.ready_names() == {ready, other}
        cache.check_integrity()
    finally:
        go_on.set()
        faults._armed.pop((point, other), None)
        cache.close()
