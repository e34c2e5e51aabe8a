"""A readiness subscriber never loses events silently (issue 19, item 5): falling behind the bounded event
log, a cursor from before a controller restart or a foreign cursor gets a resync (the ready set now and
the cursor to resume from), through the core, the gRPC stream, the Python client and `lora-cache watch`."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lora_cache.api.client import LoraCacheClient, ReadinessEvent, Resync
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.app.client_cli import add_client_commands
from lora_cache.controller.readiness import EventsLost, RankState, ReadinessIndex, WatchBatch

READY, LOADING = RankState.READY, RankState.LOADING


def test_a_subscriber_behind_the_log_gets_a_resync_with_the_ready_set_then_events_again() -> None:
    idx = ReadinessIndex(max_events=3)
    idx.add_replica("r0", 1)
    cursor = idx.last_seq
    for i in range(5):
        idx.report("r0", 0, f"a{i}", "v1", READY)
    idx.report("r0", 0, "a0", "v1", None)
    batch = idx.read(cursor)
    assert batch.events == [] and batch.resync is not None
    assert batch.resync.resume_after == idx.last_seq == 6 and batch.resync.lost_after == 0
    assert batch.resync.ready == tuple(("r0", f"a{i}", "v1") for i in range(1, 5))
    assert "fell behind" in batch.resync.reason and "last 3 events" in batch.resync.reason
    assert idx.read(3) == WatchBatch([e for e in idx.events_after(3)])  # still kept: no resync
    idx.report("r0", 0, "a9", "v1", READY)
    assert [e.adapter for e in idx.read(batch.resync.resume_after).events] == ["a9"]
    idx.check_integrity()


def test_restart_and_foreign_cursors_resync_and_cursor_zero_replays_this_controller() -> None:
    idx = ReadinessIndex(start_seq=1000)  # a restarted controller: its epoch starts the sequence
    idx.add_replica("r0", 2)
    idx.report("r0", 0, "a", "v1", READY)
    idx.report("r0", 1, "a", "v1", READY)
    assert [e.seq for e in idx.read(0).events] == [1001]
    restart = idx.read(400).resync
    assert restart is not None and "before the controller restarted" in restart.reason
    assert restart.ready == (("r0", "a", "v1"),) and restart.resume_after == 1001
    foreign = idx.read(5000).resync
    assert foreign is not None and "past the newest event" in foreign.reason
    filtered = idx.read(400, adapter="b").resync
    assert filtered is not None and filtered.ready == ()


def test_readers_that_cannot_resync_get_a_classified_error() -> None:
    idx = ReadinessIndex(max_events=1)
    idx.add_replica("r0", 1)
    idx.report("r0", 0, "a", "v1", READY)
    idx.report("r0", 0, "b", "v1", READY)
    resync = idx.read(0).resync
    assert resync is not None
    error = EventsLost(resync)
    assert "readiness events after 0 are gone" in str(error) and "resume after 2" in str(error)


class SubscriberMachine(RuleBasedStateMachine):
    """Reports change readiness while a subscriber reads at its own pace (in pages of `limit`); the view
    it rebuilds from events and resyncs always matches the index once it has caught up: no silent gap."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = ReadinessIndex(max_events=4, start_seq=100)
        self.idx.add_replica("r0", 2)
        self.idx.add_replica("r1", 1)
        self.cursor = 0
        self.view: set[tuple[str, str, str]] = set()
        self.resyncs = 0

    @rule(replica=st.sampled_from(["r0", "r1"]), rank=st.integers(0, 1), adapter=st.sampled_from("abc"),
          version=st.sampled_from(["v1", "v2"]), state=st.sampled_from([READY, LOADING, None]))
    def report(self, replica: str, rank: int, adapter: str, version: str, state: RankState | None) -> None:
        if replica == "r1" and rank == 1:
            return
        self.idx.report(replica, rank, adapter, version, state)

    @rule(limit=st.integers(1, 3))
    def read(self, limit: int) -> None:
        self._read(limit)

    @invariant()
    def caught_up_view_is_the_truth(self) -> None:
        while self._read(1000):
            pass
        truth = set(self.idx.read(10**9).resync.ready)  # type: ignore[union-attr]  # foreign: the full state
        assert self.view == truth, f"subscriber sees {sorted(self.view)}, the index {sorted(truth)}"
        self.idx.check_integrity()

    def _read(self, limit: int) -> bool:
        batch = self.idx.read(self.cursor, limit=limit)
        if batch.resync is not None:
            self.view, self.cursor = set(batch.resync.ready), batch.resync.resume_after
            self.resyncs += 1
            return True
        for e in batch.events:
            assert e.seq == self.cursor + 1 or self.cursor == 0, f"event {e.seq} after cursor {self.cursor}: a gap"
            (self.view.add if e.ready else self.view.discard)((e.replica, e.adapter, e.version))
            self.cursor = e.seq
        return bool(batch.events)


TestSubscriber = SubscriberMachine.TestCase
TestSubscriber.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


# -- over gRPC: the gateway, the client and the CLI -------------------------------------------------------
class _Remote:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class IndexController:
    """The controller's two watch calls over a real ReadinessIndex (the actor's long-poll minus Ray)."""

    def __init__(self, idx: ReadinessIndex) -> None:
        self.idx, self.lock = idx, threading.Lock()  # lock: the index is written by the test thread
        self.begin_watch = _Remote(self._begin_watch)
        self.poll_events = _Remote(self._poll_events)
        self.hint_batches = _Remote(self._hint_batches)  # the gateway's ingest needs one; no hint is sent here

    async def _hint_batches(self, batches: list[Any]) -> list[Any]:
        raise AssertionError(f"no hints expected, got {batches}")

    async def _begin_watch(self, replica: str | None, adapter: str | None) -> int:
        return self.idx.last_seq

    async def _poll_events(self, after: int, replica: str | None, adapter: str | None, timeout_s: float) -> WatchBatch:
        for _ in range(max(1, int(timeout_s / 0.01))):  # read once at least, as the actor does
            with self.lock:
                batch = self.idx.read(after, replica, adapter)
            if batch.events or batch.resync:
                return batch
            await asyncio.sleep(0.01)  # stands in for the actor's condition variable
        return WatchBatch([])


def test_watch_stream_client_and_cli_deliver_a_resync(capsys: pytest.CaptureFixture[str]) -> None:
    idx = ReadinessIndex(max_events=2, start_seq=50)
    idx.add_replica("replica-0", 1)
    for name in ("x", "y", "z"):
        idx.report("replica-0", 0, name, "v1", READY)  # seq 51..53; 51 is dropped from the log
    ctl = IndexController(idx)
    gw = start_gateway_thread(GatewayConfig(grpc_port=0), ctl)
    try:
        with LoraCacheClient(gw.target) as lc:
            stream = lc.watch(replica="replica-0", after_seq=50)
            first = next(stream)
            assert isinstance(first, Resync) and first.seq == 53 and first.lost_after == 50
            assert first.ready == tuple(("replica-0", n, "v1") for n in "xyz") and "fell behind" in first.reason
            with ctl.lock:
                idx.report("replica-0", 0, "x", "v1", None)
            after = next(stream)
            assert after == ReadinessEvent(54, "replica-0", "x", "v1", False)
            stream.close()  # type: ignore[attr-defined]  # a generator: closing cancels the RPC
            assert next(lc.watch(after_seq=53)) == after  # a kept cursor: plain events, no resync
        parser = argparse.ArgumentParser()
        add_client_commands(parser.add_subparsers(dest="command", required=True))
        ns = parser.parse_args(["watch", "--after-seq", "10", "--count", "1", "--server", gw.target])
        assert ns.func(ns) == 0
        out = capsys.readouterr().out
        assert out.startswith('{"resync": {"seq": 54, "lost_after": 10') and "before the controller restarted" in out
    finally:
        gw.stop()
