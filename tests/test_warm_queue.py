"""A rank's warm stages (workers/staging/warming.py): one at a time, never while another read is in flight,
within the operator's rate limit; and through the command gate into a real host tier."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from lora_cache.vocab import AdapterKey, Stage
from tests.waiting import wait_for
from workers.control.commands import CommandGate
from workers.staging.warming import WarmQueue


class Reads:
    """Stand-in store reads the test completes by hand: each start returns a future the test resolves."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.futures: dict[str, Future[Any]] = {}
        self.busy = threading.Event()  # another (demand) read is in flight
        self.lock = threading.Lock()

    def start(self, name: str, version: str) -> Future[Any]:
        with self.lock:
            self.started.append(name)
            self.futures[name] = Future()
            return self.futures[name]


def queue(reads: Reads, **kw: Any) -> WarmQueue:
    return WarmQueue(reads.start, reads.busy.is_set, lambda n, v: 100, poll_s=0.001, **kw)


def test_warm_stages_go_one_at_a_time_in_the_order_sent() -> None:
    reads = Reads()
    q = queue(reads)
    try:
        for name in ("a", "b", "c", "a"):  # a repeat while queued is not queued twice
            q.offer(name, "v1")
        wait_for(lambda: reads.started == ["a"], what="the first warm read")
        assert q.pending() == 3
        reads.futures["a"].set_result(None)
        wait_for(lambda: reads.started == ["a", "b"], what="the second, once the first ended")
        reads.futures["b"].set_result(None)
        wait_for(lambda: reads.started == ["a", "b", "c"], what="the third")
        reads.futures["c"].set_result(None)
        wait_for(lambda: q.pending() == 0, what="the queue drained")
        q.check_integrity()
    finally:
        q.close()


def test_no_warm_read_starts_while_another_read_is_in_flight() -> None:
    reads = Reads()
    reads.busy.set()  # a load's read is in flight
    q = queue(reads)
    try:
        q.offer("a", "v1")
        polled = threading.Event()
        original = reads.busy.is_set

        def busy() -> bool:
            polled.set()
            return original()
        q._busy = busy  # count the driver's looks
        assert polled.wait(5.0)
        polled.clear()
        assert polled.wait(5.0), "the driver looked again while busy"
        assert reads.started == [], "a warm read started beside a demand read"
        reads.busy.clear()
        wait_for(lambda: reads.started == ["a"], what="the warm read once the store is idle")
    finally:
        q.close()


def test_the_rate_limit_paces_warm_reads_by_their_bytes() -> None:
    reads = Reads()
    now = [0.0]
    q = WarmQueue(reads.start, lambda: False, lambda n, v: 300, rate_bytes_per_s=100.0, poll_s=0.001,
                  clock=lambda: now[0])
    try:
        q.offer("a", "v1")
        q.offer("b", "v1")
        wait_for(lambda: reads.started == ["a"], what="the first read (a full bucket)")
        reads.futures["a"].set_result(None)  # 300 bytes taken from 100: 200 in debt
        wait_for(lambda: q._reading is None, what="the first read's end")
        now[0] = 1.0  # 100 bytes later: still in debt
        assert reads.started == ["a"]
        now[0] = 2.5  # out of debt
        wait_for(lambda: reads.started == ["a", "b"], what="the second read once the bucket refilled")
    finally:
        q.close()


def test_the_queue_is_bounded_oldest_dropped() -> None:
    reads = Reads()
    reads.busy.set()
    q = queue(reads, max_queued=2)
    try:
        for name in ("a", "b", "c"):
            q.offer(name, "v1")
        assert q.pending() == 2 and q.dropped == 1
        q.check_integrity()
    finally:
        q.close()


def test_a_speculative_stage_through_the_gate_lands_in_the_host_tier(
        tmp_path: Path, tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., Any],
        make_cache: Callable[..., Any]) -> None:
    paths = tiny_adapters(count=2)
    cache = make_cache(make_catalog(paths[0].parent))
    gate = CommandGate(cache, lambda delta: None)
    try:
        version = cache.catalog.current(paths[0].name)
        result = gate.apply([Stage(paths[0].name, version, 0, 1, speculative=True)])
        assert result.accepted == 1
        wait_for(lambda: cache.host.contains(AdapterKey(paths[0].name, version)), what="the warm shard staged")
        assert not cache.ready_keys(), "a warm stage takes no GPU slot"
        cache.check_integrity()
    finally:
        gate.close()
