"""Demand reads seen across the node's processes (workers/staging/node_reads.py): a rank's warm stages wait while
another rank's demand read is in flight on the store they share, and never for a process that is gone."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lora_cache.vocab import AdapterKey, Stage
from tests.waiting import wait_for
from workers.control.commands import CommandGate
from workers.staging.node_reads import (
    FETCHES_DIR,
    MAX_READ_S,
    RATE_FILE,
    RATE_PRIOR,
    DemandMarks,
    NodeFetches,
    NodeReads,
    StoreShare,
    started,
)

HOLDER = """
import sys
from pathlib import Path
from workers.staging.node_reads import NodeReads
reads = NodeReads(Path(sys.argv[1]))
print(reads.mark(), flush=True)
sys.stdin.readline()  # held until the test kills it
"""


def me(tag: str) -> str:
    """An identity of this (live) process of its own."""
    return f"{os.getpid()}-{started(os.getpid())}.{tag}"


def gone(other: NodeReads, reads_dir: Path) -> None:
    """The read's marker goes with its read: once the reading thread is done with it. That is after the load's
    result, which its last chunk's copy may give first (chunks are copied as they arrive): the CI machine, loaded,
    showed the marker still there at the result (2026-11-29). Bounded, never a sleep."""
    wait_for(lambda: other.busy() == 0 and not [p for p in reads_dir.iterdir() if p.name != FETCHES_DIR],
             "the marker to go with its read", 10)


@pytest.fixture
def reads_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "reads"
    monkeypatch.setenv("LORA_CACHE_READS_DIR", str(path))  # what a HostTier made in the test marks in
    return path


@pytest.fixture
def holder(reads_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process of the node with a demand read in flight (its marker written before this yields)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(reads_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip(), "the holder wrote no marker"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_demand_read_of_another_process_counts_until_it_ends(reads_dir: Path) -> None:
    mine, other = NodeReads(reads_dir, ident=me("a")), NodeReads(reads_dir, ident=me("b"))
    name = mine.mark()
    assert name and mine.busy() == 0, "its own reads are its host tier's business"
    assert other.busy() == 1
    mine.unmark(name)
    mine.unmark(name)  # idempotent
    assert other.busy() == 0


def test_a_killed_process_s_marker_neither_counts_nor_stays(reads_dir: Path,
                                                          holder: subprocess.Popen[str]) -> None:
    """A rank SIGKILLed mid-read leaves its marker behind: it must not stop the node's warm stages for good."""
    ours = NodeReads(reads_dir)
    assert ours.busy() == 1, "a live process's read in flight"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert ours.busy() == 0
    assert list(reads_dir.iterdir()) == [], "the dead process's marker is removed"


def test_a_marker_older_than_any_read_is_a_leftover(reads_dir: Path) -> None:
    """A process that hangs (or a PID that is the marker's own but stuck) holds the node's warm stages for
    ``MAX_READ_S`` at most."""
    NodeReads(reads_dir, ident=me("a")).mark()
    later = NodeReads(reads_dir, ident=me("b"), clock=lambda: time.time() + MAX_READ_S + 1)
    assert later.busy() == 0 and list(reads_dir.iterdir()) == []


FETCH_HOLDER = """
import sys
from pathlib import Path
from workers.staging.node_reads import NodeFetches
print(NodeFetches(Path(sys.argv[1])).enter(1), flush=True)  # one byte, now: ahead of any fetch entered later
sys.stdin.readline()  # held until the test kills it
"""


def test_the_nodes_demand_fetches_take_the_store_soonest_end_alone_first(reads_dir: Path) -> None:
    """``NodeFetches`` (issue 42, a store slower than demand): a fetch waits while a live one of the node comes before
    it, of any process, its own too: one that would end sooner had it the store alone (its first byte's time plus its
    bytes at the store's rate), or as soon and placed first. A smaller object's fetch that comes later passes a
    larger one's only by the difference of their times alone: one that comes after the larger would have ended
    waits behind it (no large fetch waits for ever). One that ended holds nothing; '' (no marker) never waits. The
    markers sit in the reads directory's ``FETCHES_DIR``, which no demand-read count takes for a marker."""
    path, now = reads_dir / FETCHES_DIR, [1000.0]
    a = NodeFetches(path, ident=me("a"), clock=lambda: now[0])
    b = NodeFetches(path, ident=me("b"), clock=lambda: now[0])
    assert a.rate == b.rate == 200e6
    big = a.enter(400_000_000)  # alone: 2 s, to 1002
    now[0] += 0.5
    small = b.enter(100_000_000)  # to 1001: ahead
    same = a.enter(300_000_000)  # to 1002 as well, placed later: behind ``big``
    now[0] += 1.6
    late = b.enter(10_000_000)  # to 1002.15: after the big one would have ended alone, it waits behind it
    assert all((big, small, same, late))
    assert a.ahead(big) and not b.ahead(small) and a.ahead(same) and b.ahead(late)
    b.leave(small)
    assert not a.ahead(big), "the sooner fetch ended: the next in the order moves"
    assert a.ahead(same) and b.ahead(late), "a fetch that would end as soon, placed first, comes first (its own too)"
    a.leave(big)
    a.leave(big)  # idempotent
    assert not a.ahead(same) and b.ahead(late) and not a.ahead("")
    assert NodeReads(reads_dir, ident=me("c")).busy() == 0, "the fetches' directory is not a demand read"
    a.leave(same)
    assert not b.ahead(late)
    b.leave(late)
    assert list(path.iterdir()) == []
    b.moved(100_000_000, 1.0)  # a fetch moved alone at 100 MB/s: the rate halves toward it
    assert b.rate == pytest.approx(150e6)
    b.moved(1_000, 1.0)  # too little to time
    assert b.rate == pytest.approx(150e6)


RATE_MEASURER = """
import sys
from pathlib import Path
from workers.staging.node_reads import NodeFetches
fetches = NodeFetches(Path(sys.argv[1]))
fetches.leave(fetches.enter(1))  # a fetch made the directory
fetches.moved(100_000_000, 1.0)  # and moved alone at 100 MB/s
print(fetches.rate, flush=True)
"""


def test_the_stores_rate_one_rank_measured_orders_every_ranks_fetches(reads_dir: Path) -> None:
    """Two ranks of a node count the same fetch's end alike: the rate a fetch that moved alone measured in one process
    (another rank's) orders the next fetch of every process (``RATE_FILE``), not ``RATE_PRIOR`` until each process has
    measured its own; each measure folds into the node's. A reading that is not a rate leaves each process's last."""
    path, now = reads_dir / FETCHES_DIR, [1000.0]
    mine = NodeFetches(path, ident=me("a"), clock=lambda: now[0])
    assert mine.node_rate() == RATE_PRIOR, "no fetch of the node measured one yet"
    other = subprocess.run([sys.executable, "-c", RATE_MEASURER, str(path)], capture_output=True, text=True,
                           check=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert float(other.stdout) == 150e6  # the prior halved toward 100 MB/s
    name = mine.enter(300_000_000)
    assert int(name.split("-")[0]) == 1_002_000_000_000, "2 s at the node's 150 MB/s (1.5 s at this process's prior)"
    mine.leave(name)
    mine.moved(300_000_000, 1.0)  # folds into the node's: 150 -> 225 MB/s
    third = NodeFetches(path, ident=me("c"), clock=lambda: now[0])
    assert mine.rate == third.node_rate() == 225e6
    assert sorted(p.name for p in path.iterdir()) == [RATE_FILE], "no marker or half-written reading left"
    for junk in ("", "fast", "inf", "-1"):
        (path / RATE_FILE).write_text(junk)
        assert third.node_rate() == 225e6, junk
    third.leave(third.enter(1))
    third.moved(1_000, 1.0)
    assert (path / RATE_FILE).read_text() == "-1", "too little to time"


def test_a_dead_or_hung_fetch_holds_no_other_fetch(reads_dir: Path) -> None:
    """A rank SIGKILLed mid-fetch leaves its marker: it must not hold the node's fetches behind it for good; a marker
    older than ``MAX_READ_S`` (a hung process) is a leftover too. Both are removed."""
    path = reads_dir / FETCHES_DIR
    proc = subprocess.Popen([sys.executable, "-c", FETCH_HOLDER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip(), "the holder entered no fetch"
        mine = NodeFetches(path, ident=me("a"))
        name = mine.enter(2)
        assert mine.ahead(name), "a live process's fetch that ends sooner comes first"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert not mine.ahead(name) and [p.name for p in path.iterdir()] == [name], "the dead one's marker is removed"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    hung = NodeFetches(path, ident=me("b"), clock=lambda: time.time() - 1).enter(1)  # ahead of ``name``
    assert hung and mine.ahead(name), "a live process's fetch that ends sooner comes first"
    later = NodeFetches(path, ident=me("c"), clock=lambda: time.time() + MAX_READ_S + 1)
    assert not later.ahead(name) and [p.name for p in path.iterdir()] == [name]


def test_a_directory_that_cannot_be_written_costs_the_yield_only(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    reads = NodeReads(blocker / "reads")  # below a file: never a directory
    assert reads.mark() == "" and reads.busy() == 0
    reads.unmark("")
    fetches = NodeFetches(blocker / "reads" / FETCHES_DIR)  # the fetches share the store, never stop
    assert fetches.enter(1) == "" and not fetches.ahead("")
    fetches.leave("")
    assert "give the directory write access" in caplog.text


@dataclasses.dataclass
class _Entry:
    """A host-tier entry as the marks see it (``Marked``)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    node_mark: str = ""
    read_over: bool = False
    joined: bool = False


def test_a_warm_read_yields_to_demand_here_or_on_the_node_until_a_load_joins_it_never_while_crowded(
        tmp_path: Path) -> None:
    """``DemandMarks.yields``: a warm read's store fetch yields while this tier or another process of the node has a
    demand read, even one whose marker could not be written; not while a read of this tier waits for a reader
    thread (the warm read may hold the one it needs); never again once a load joined it."""
    marks = DemandMarks(NodeReads(tmp_path / "reads", ident=me("a")))
    other = NodeReads(tmp_path / "reads", ident=me("b"))
    warm, demand = _Entry(), _Entry()
    crowded = threading.Event()
    busy = marks.yields(warm, crowded.is_set)
    assert not busy(), "no demand read: the warm read runs on"
    marks.mark(demand)
    assert demand.node_mark and busy(), "this tier's demand read"
    crowded.set()
    assert not busy(), "a read of this tier waits for a thread"
    crowded.clear()
    marks.unmark(demand)
    assert not busy()
    name = other.mark()
    assert busy(), "another process's demand read on the node"
    marks.join(warm)
    assert warm.joined and warm.node_mark and not busy(), "a load joined: it yields no more"
    other.unmark(name)
    marks.unmark(warm)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unmarked = DemandMarks(NodeReads(blocker / "reads", ident=me("c")))  # markers cannot be written
    lone, load = _Entry(), _Entry()
    unmarked.mark(load)
    assert load.node_mark == "" and unmarked.yields(lone, lambda: False)(), "its own demand counts unmarked"
    unmarked.unmark(load)
    assert not unmarked.yields(lone, lambda: False)()


def test_a_load_s_read_is_marked_while_it_runs_and_a_warm_stage_s_is_not(
        reads_dir: Path, gated_reads: tuple[threading.Event, list[str]], tiny_adapters: Callable[..., list[Path]],
        make_catalog: Callable[..., Any], make_cache: Callable[..., Any]) -> None:
    paths = tiny_adapters(count=2)
    cache = make_cache(make_catalog(paths[0].parent))
    other = NodeReads(reads_dir, ident=me("other"))
    with cache.host.demand.speculative():
        warm = cache.stage(paths[1].name)
    load = cache.prefetch(paths[0].name)
    assert other.busy() == 1, "the load's read is the node's one demand read in flight (the warm one is not)"
    gated_reads[0].set()
    load.result(timeout=60)
    assert warm is not None
    warm.result(timeout=60)
    gone(other, reads_dir)
    cache.check_integrity()


def test_a_load_that_joins_a_warm_read_in_flight_marks_it(
        reads_dir: Path, gated_reads: tuple[threading.Event, list[str]], tiny_adapters: Callable[..., list[Path]],
        make_catalog: Callable[..., Any], make_cache: Callable[..., Any]) -> None:
    """Single flight: a load of a shard a warm stage is reading waits for that read, so the node's other ranks
    must yield to it from then on (and the marker still goes with the read)."""
    paths = tiny_adapters(count=1)
    cache = make_cache(make_catalog(paths[0].parent))
    other = NodeReads(reads_dir, ident=me("other"))
    with cache.host.demand.speculative():
        warm = cache.stage(paths[0].name)
    assert warm is not None and other.busy() == 0
    load = cache.prefetch(paths[0].name)
    assert other.busy() == 1, "the warm read now serves a load"
    gated_reads[0].set()
    load.result(timeout=60)
    gone(other, reads_dir)
    cache.check_integrity()


def test_a_failed_read_leaves_no_marker(reads_dir: Path, tiny_adapters: Callable[..., list[Path]],
                                        make_catalog: Callable[..., Any], make_cache: Callable[..., Any]) -> None:
    paths = tiny_adapters(count=1)
    cache = make_cache(make_catalog(paths[0].parent))
    weights = paths[0] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])  # truncated after registration: the read fails
    with pytest.raises(Exception):  # noqa: B017 - which error is the read's business; the marker is this test's
        cache.prefetch(paths[0].name).result(timeout=60)
    gone(NodeReads(reads_dir, ident=me("other")), reads_dir)
    cache.check_integrity()


def test_a_warm_stage_waits_while_another_rank_s_demand_read_is_in_flight(
        reads_dir: Path, holder: subprocess.Popen[str], tiny_adapters: Callable[..., list[Path]],
        make_catalog: Callable[..., Any], make_cache: Callable[..., Any]) -> None:
    """The rule the simulator's two replicas on one device needed (bench/reports/issue-42.md, "the warm set's
    value"): no warm read starts while another process on the node reads for a waiting request."""
    paths = tiny_adapters(count=1)
    cache = make_cache(make_catalog(paths[0].parent))
    gate = CommandGate(cache, lambda delta: None)
    key = AdapterKey(paths[0].name, cache.catalog.current(paths[0].name))
    try:
        assert gate.apply([Stage(key.name, key.version, 0, 1, speculative=True)]).accepted == 1
        warm = gate.warm_queue()
        held = warm.held
        wait_for(lambda: warm.held > held + 2, what="the warm stage looked again and was held back")
        assert warm.pending() == 1
        assert not cache.host.contains(key) and cache.host.reading() == 0
        holder.send_signal(signal.SIGKILL)  # its read is over (the process with it)
        holder.wait(timeout=30)
        wait_for(lambda: cache.host.contains(key), what="the warm stage read once the node's demand read ended")
    finally:
        gate.close()


def test_the_store_share_is_the_decayed_share_of_time_a_demand_read_waited_for_the_store() -> None:
    """``StoreShare``: an exponentially weighted share over ``tau_s`` of the time with at least one demand read
    waiting (overlapping waits count once), what ``DiskTier.let_go`` compares with ``victim_share``."""
    now = [0.0]
    share = StoreShare(tau_s=60.0, clock=lambda: now[0])
    assert share.share() == 0.0
    with share.waiting():
        now[0] = 60.0
        assert share.share() == pytest.approx(1 - math.exp(-1))  # read while waiting: the wait so far counts
        with share.waiting():  # a second wait at once adds nothing
            now[0] = 120.0
    assert share.share() == pytest.approx(1 - math.exp(-2))
    now[0] = 180.0  # a minute idle: it decays
    assert share.share() == pytest.approx((1 - math.exp(-2)) * math.exp(-1))
    share.add(1)
    share.add(-1)  # a wait of no time adds nothing
    assert share.share() == pytest.approx((1 - math.exp(-2)) * math.exp(-1))
    # the share is 0.318 now: past 0.3, not 0.4; a threshold of 1 is never past
    assert share.past(0.3) and not share.past(0.4) and share.past(0.0) and not share.past(1.0)
    with share.waiting():
        now[0] = 10_000.0  # waiting all the time: the share reaches 1, and 1 still means never
        assert share.share() == pytest.approx(1.0) and not share.past(1.0)
