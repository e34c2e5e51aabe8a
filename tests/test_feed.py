"""Requests into a running replica (workers/engine/feed.py): the Feed's contract, the streaming scheduler,
and a TP 1 engine on the CPU serving a stream submitted while it runs (no Ray)."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_cache.adapters.files import FileIdentity, settled_at
from lora_cache.adapters.synth import SynthConfig, make_adapters, make_named_adapters
from lora_cache.errors import AdapterFormatError, CapacityError, ConfigError, NotFoundError, ResolveTimeoutError
from tests.waiting import wait_for
from workers.cache import WorkerCache
from workers.engine import ADMISSION, EngineConfig, Request, run_engine
from workers.engine.catalog import load_catalog
from workers.engine.engine import EngineResult, Hooks, serve_rank
from workers.engine.feed import Feed
from workers.engine.hosted import HostedEngine, Rendezvous
from workers.engine.rank import RankEngine
from workers.engine.scheduler import IDLE_WAIT_S, PREFILL, STOP, WAIT, Scheduler
from workers.engine.tp import Comm, spawn
from workers.staging.host_config import HostTierConfig

ADAPTERS = [f"adapter-{i:03d}" for i in range(3)]


def test_feed_hands_over_submissions_wakes_the_loop_and_returns_finished_ids() -> None:
    feed = Feed()
    arrival = feed.arrival()
    assert not arrival.done() and feed.take() == ([], False)
    feed.submit([Request(0, "a", 2, 1)])
    assert arrival.done() and feed.arrival() is arrival  # the loop's wait ends; it stays done until taken
    assert feed.take() == ([Request(0, "a", 2, 1)], False)
    assert not feed.arrival().done()  # a fresh one after the take
    feed.done([0])
    assert feed.finished(0.0) == [0] and feed.finished(0.0) == []
    feed.close()
    assert feed.arrival().done() and feed.take() == ([], True)
    with pytest.raises(ConfigError, match=r"requests \[1\] submitted after the end of the stream"):
        feed.submit([Request(1, "a", 2, 1)])
    feed.done([3])
    feed.stop()
    assert feed.finished(5.0) == [3] and feed.finished(5.0) is None  # what is left, then the end


def test_a_finished_poll_is_woken_by_done_and_by_stop() -> None:
    feed = Feed()
    with ThreadPoolExecutor(1) as pool:
        polling = pool.submit(feed.finished, 60.0)
        feed.done([7, 8])
        assert polling.result(timeout=10) == [7, 8]
        polling = pool.submit(feed.finished, 60.0)
        feed.stop()
        assert polling.result(timeout=10) is None


def config(root: Path | None = None, **kw: object) -> EngineConfig:
    base: dict[str, object] = dict(adapters=str(root) if root else "", model="tiny", device="cpu", num_slots=3,
                                   max_adapters=2, max_running=4, max_prefill_tokens=24, max_seq_len=32,
                                   host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False))
    return EngineConfig(**(base | kw))  # type: ignore[arg-type]


def test_a_streaming_scheduler_waits_for_submissions_and_stops_only_after_the_end() -> None:
    s = Scheduler(config(), ADMISSION["ondemand"](), [], streaming=True)
    plan = s.plan(0.0, {})
    assert (plan.kind, plan.timeout_s, plan.streaming) == (WAIT, IDLE_WAIT_S, True)  # nothing here: idle
    s.add([Request(1, None, 4, 1, arrival_s=0.5), Request(0, None, 4, 1, arrival_s=0.2)])
    assert s.plan(0.1, {}).timeout_s == pytest.approx(0.1)  # until the earlier arrival
    late = s.plan(0.9, {})  # both delivered late: admitted now, their records keep their arrivals
    assert late.kind == PREFILL and [it.rid for it in late.items] == [0, 1]
    s.finish_step(late, 1.0, 0.0)
    assert s.take_finished() == [0, 1] and s.take_finished() == []
    assert [(r.arrival_s, r.prefill_s) for r in s.records()] == [(0.2, 0.9), (0.5, 0.9)]
    assert s.plan(1.1, {}).kind == WAIT  # the stream is open
    with pytest.raises(ConfigError, match="request 1 was submitted twice"):
        s.add([Request(1, None, 4, 1)])
    s.end()
    assert s.plan(1.2, {}).kind == STOP
    with pytest.raises(ConfigError, match="not streaming"):
        s.add([Request(2, None, 4, 1)])


def test_streaming_is_open_loop_only() -> None:
    with pytest.raises(ConfigError, match="open-loop arrivals only"):
        Scheduler(config(), ADMISSION["ondemand"](), [], inflight=2, streaming=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("feed-adapters")
    make_adapters(root, SynthConfig(model="tiny", count=len(ADAPTERS), rank="8"))
    return root


def test_an_engine_serves_requests_submitted_while_it_runs(adapters: Path) -> None:
    """The stream in two parts, the second delivered after its arrivals (late): every request served once,
    none before its delivery, TTFT from its arrival; the same outputs as the requests given up front; the
    finished ids come back exactly once each, then the end."""
    cfg = config(adapters, admission="ondemand", record_outputs=True)
    requests = [Request(rid, ADAPTERS[rid % 3] if rid % 4 else None, 3 + rid % 4, 1 + rid % 3,
                        0.01 * rid if rid < 6 else 0.001 * rid) for rid in range(10)]  # the second part: due early
    feed = Feed()
    start_wall = time.time() + 0.3
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(serve_rank, cfg, ADMISSION["ondemand"](), (), Comm(), None, Hooks(start_wall, feed=feed))
        feed.submit(requests[:6])
        finished: list[int] = []
        while len(finished) < 6:  # the first part is served while the stream stays open
            finished += feed.finished(30.0) or []
        delivered = time.time() - start_wall
        feed.submit(requests[6:])
        feed.close()
        while (rids := feed.finished(30.0)) is not None:
            finished += rids
        result = run.result(timeout=120)
    assert sorted(finished) == list(range(10))
    records = {r.rid: r for r in result.records}
    assert sorted(records) == list(range(10)) and all(r.ok for r in records.values())
    # the run's own clock (steps and received_s alike): the late part reached the feed after the first part's last
    # token, and was admitted only then; the test's wall clock only bounds it loosely (a wall clock may be slewed or
    # stepped during a run: once, on a loaded machine, received_s read 0.5 ms before the test's own delivery time)
    first_done = max(records[r.rid].token_s[-1] for r in requests[:6])
    for r in requests[6:]:
        rec = records[r.rid]
        assert rec.prefill_s is not None and rec.received_s is not None
        assert rec.arrival_s == r.arrival_s < first_done < rec.received_s <= rec.prefill_s  # admitted when it got there
        assert rec.token_s[0] - rec.arrival_s > rec.received_s - r.arrival_s  # TTFT counts the delivery's delay
        assert abs(rec.received_s - delivered) < 1.0  # the same moment on both clocks, roughly
    assert all(records[r.rid].received_s is not None for r in requests[:6])
    upfront = {r.rid: r for r in run_engine(cfg, requests).records}
    assert all(r.received_s is None for r in upfront.values())  # given up front: no submission to log
    for rid, rec in records.items():
        assert rec.outputs is not None
        torch.testing.assert_close(rec.outputs, upfront[rid].outputs, rtol=1e-4, atol=1e-4)


def test_idle_named_rows_leave_the_running_exchange_and_come_back_when_named_again(
        adapters: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 item 3: a request naming one version (``A@VERSION``) adds a row to the version exchange; once no
    request names it (none kept idle here), the loop drops it, and a later request naming it adds it again and runs
    at exactly that version: the exchange does not grow with every version ever named."""
    import workers.engine.engine as engine_module
    from workers.attach.versions import RankVersions

    monkeypatch.setattr(engine_module, "NAMED_ROWS_IDLE", 0)
    drops: list[tuple[str, ...]] = []
    drop = RankVersions.drop
    monkeypatch.setattr(RankVersions, "drop", lambda self, names: (drops.append(tuple(names)) if names else None,
                                                                   drop(self, names))[1])
    cfg = config(adapters, admission="ondemand")
    version = load_catalog(cfg).get(ADAPTERS[0]).version
    named = f"{ADAPTERS[0]}@{version}"
    waves = [[Request(rid, named, 3, 2, 0.0) for rid in range(2)],
             [Request(rid, ADAPTERS[1], 3, 2, 0.0) for rid in range(2, 6)],
             [Request(rid, named, 3, 2, 0.0) for rid in range(6, 8)]]
    feed = Feed()
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(serve_rank, cfg, ADMISSION["ondemand"](), (), Comm(), None, Hooks(time.time(), feed=feed))
        done: list[int] = []
        for wave in waves:
            feed.submit([r._replace(arrival_s=0.0) for r in wave])
            while len(done) < wave[-1].rid + 1:
                done += feed.finished(30.0) or []
            if wave is waves[1]:
                wait_for(lambda: (named,) in drops, "the idle named row dropped", timeout=30)
        feed.close()
        while feed.finished(30.0) is not None:
            pass
        result = run.result(timeout=120)
    records = {r.rid: r for r in result.records}
    assert sorted(records) == list(range(8)) and all(r.ok for r in records.values()), records
    assert all(records[rid].version == version for rid in (0, 1, 6, 7)), "a named request ran at another version"
    assert drops.count((named,)) >= 1


def test_a_request_for_an_adapter_the_engine_does_not_serve_fails_alone_and_the_run_goes_on(adapters: Path) -> None:
    """An adapter the catalog never registered: the request fails with an error naming it and the fix, and the
    run serves the requests before and after it (it once raised KeyError in the loop, ending the run: every
    later request hung)."""
    cfg = config(adapters, admission="ondemand")
    feed = Feed()
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(serve_rank, cfg, ADMISSION["ondemand"](), (), Comm(), None, Hooks(time.time(), feed=feed))
        feed.submit([Request(0, ADAPTERS[0], 3, 1), Request(1, "adapter-late", 3, 1)])
        finished: list[int] = []
        while len(finished) < 2:
            rids = feed.finished(30.0)
            assert rids is not None, "the run ended"  # (the KeyError once ended it here)
            finished += rids
        feed.submit([Request(2, ADAPTERS[1], 3, 1)])  # the run is still serving
        feed.close()
        while (rids := feed.finished(30.0)) is not None:
            finished += rids
        result = run.result(timeout=120)
    assert sorted(finished) == [0, 1, 2]
    records = {r.rid: r for r in result.records}
    assert records[0].ok and records[2].ok and not records[1].ok
    error = records[1].error
    assert error is not None and "'adapter-late' is not registered in this replica's catalog" in error
    assert "register it first" in error and records[1].prefill_s is None


def test_a_run_that_fails_ends_the_finished_polls(adapters: Path) -> None:
    feed = Feed()
    feed.submit([Request(0, ADAPTERS[0], 3, 1)])
    done = threading.Event()

    def broken(queue: list[tuple[str, float]]) -> None:
        raise RuntimeError("the queue report failed")

    def poll() -> None:
        while feed.finished(30.0) is not None:
            pass
        done.set()

    threading.Thread(target=poll, daemon=True).start()
    with pytest.raises(Exception):  # noqa: B017 -- whatever the engine raises, the feed stops
        serve_rank(config(adapters), ADMISSION["ondemand"](), (), Comm(), None,
                   Hooks(time.time(), on_queue=broken, feed=feed))
    assert done.wait(30)


# -- adapters registered while the engine runs ---------------------------------------------------------------
LATE = ["late-a", "late-b"]  # under ROOT/later: inside the catalog's root, not registered at build


@pytest.fixture(scope="module")
def late_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("late-adapters")
    make_adapters(root, SynthConfig(model="tiny", count=len(ADAPTERS), rank="8"))
    make_named_adapters(root / "later", SynthConfig(model="tiny", rank="8"), LATE)
    # Settled files only: one registered within RACY_NS of its last change gets a content version, later an
    # identity one (lora_cache/adapters/files.py), so the test's own fresh catalog (``load_catalog`` below) named
    # the same bytes by another version than the engine's early registration did (CI, 2026-11-29).
    files = [p for p in root.rglob("*") if p.is_file()]
    wait_for(lambda: all(settled_at(FileIdentity.of(p.stat()), time.time_ns()) for p in files),
             "the late adapters' files settled (identity versions)", 10)
    return root


def _finish(feed: Feed, done: list[int], rids: set[int]) -> None:
    while not rids <= set(done):
        got = feed.finished(30.0)
        assert got is not None, f"the run ended before requests {sorted(rids - set(done))} finished"
        done += got


def _flag(path: Path, stop: threading.Event) -> bool:
    """Wait (polling; across processes) until ``path`` exists; False if the run ended first."""
    while not path.exists():
        if stop.wait(0.01):
            return False
    return True


def _late_rank(cfg: EngineConfig, flags: Path, comm: Comm) -> tuple[EngineResult, list[int]]:
    """One rank of a streaming run in which adapters are registered after the engine was built. Rank 0 (the
    feed) registers ``late-a`` at once, rank 1 only after rank 0 saw the requests it can serve anyway served
    (its registration on its way); ``late-b`` the other way round (rank 1 first). Returns rank 0's result and
    the requests finished before rank 1 took ``late-a``."""
    engine = RankEngine(cfg, comm)
    engine.warm_up()
    later = Path(cfg.adapters) / "later"
    feed = Feed() if comm.rank == 0 else None
    stop = threading.Event()
    early: list[int] = []

    def drive() -> None:  # rank 0: the router and the controller's registrations here
        assert feed is not None
        done: list[int] = []
        feed.submit([Request(0, ADAPTERS[0], 3, 2)])
        _finish(feed, done, {0})  # the engine runs
        engine.catalog.register("late-a", later / "late-a")
        feed.submit([Request(1, "late-a", 3, 2), Request(2, "late-a", 5, 1), Request(3, "never-registered", 3, 1),
                     Request(4, ADAPTERS[1], 3, 1)])
        _finish(feed, done, {3, 4})
        early.extend(done)
        (flags / "a").touch()  # rank 1 registers late-a now
        _finish(feed, done, {1, 2})
        (flags / "b").touch()  # rank 1 registers late-b first, then this rank
        if comm.world > 1:
            assert _flag(flags / "b-registered", stop)
        engine.catalog.register("late-b", later / "late-b")
        feed.submit([Request(5, "late-b", 4, 2), Request(6, "late-a", 3, 1), Request(7, ADAPTERS[2], 3, 1)])
        _finish(feed, done, {5, 6, 7})
        feed.close()

    def follow() -> None:  # rank 1: the controller's registrations reach it later (or earlier)
        if _flag(flags / "a", stop):
            engine.catalog.register("late-a", later / "late-a")
        if _flag(flags / "b", stop):
            engine.catalog.register("late-b", later / "late-b")
            (flags / "b-registered").touch()

    result = _serve_beside(cfg, comm, engine, feed, drive if comm.rank == 0 else follow, stop)
    return result, early


def _serve_beside(cfg: EngineConfig, comm: Comm, engine: RankEngine, feed: Feed | None,
                  helper: Callable[[], None], stop: threading.Event) -> EngineResult:
    """Serve a streaming run on this rank with ``helper`` running beside it on a thread (the router and the
    controller's registrations); ``stop`` is set once the run is over."""
    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    try:
        return serve_rank(cfg, ADMISSION[cfg.admission](), (), comm, engine, Hooks(feed=feed))
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.parametrize("tp,admission", [(1, "ondemand"), (2, "overlap")])
def test_adapters_registered_while_the_engine_runs_are_served_with_their_own_weights(
        late_root: Path, tmp_path: Path, tp: int, admission: str) -> None:
    """Adapters registered after the engine was built are served, on every rank at the version registered (the
    step audit) and with their own weights (the outputs of a run that had them from the start); a request for
    one waits while a rank's registration is on its way (never runs without it there); a second new name later
    grows the exchange again; a name never registered fails alone and the run goes on. (Before: the late
    adapters' requests failed as unknown to the engine.)"""
    cfg = config(late_root, tp=tp, admission=admission, record_outputs=True, audit_steps=True)
    if tp == 1:
        result, early = _late_rank(cfg, tmp_path, Comm())
    else:
        result, early = spawn(functools.partial(_late_rank, cfg, tmp_path), tp, "cpu")
    records = {r.rid: r for r in result.records}
    assert sorted(records) == list(range(8))
    late = [1, 2, 5, 6]
    for rid in set(records) - {3}:
        assert records[rid].ok, records[rid].error
    never = records[3]
    assert not never.ok and never.prefill_s is None and never.error is not None
    assert "'never-registered' is not registered in this replica's catalog" in never.error
    if tp > 1:  # rank 1 lacked late-a: its requests waited (the others were served meanwhile)
        assert {3, 4} <= set(early) and not set(early) & {1, 2}
    registered = load_catalog(config(late_root / "later"))
    for rid in late:
        rec = records[rid]
        assert rec.version == registered.current(rec.adapter or "")
        for rank in result.ranks:  # every rank computed it with exactly that version, never another's
            keys = {key for audit in rank.audit for r, key in zip(audit.rids, audit.keys) if r == rid}
            assert keys == {f"{rec.adapter}@{rec.version}"}, (rank.rank, rid, keys)
    assert len(result.ranks) == tp
    reference = {r.rid: r for r in run_engine(config(late_root / "later", record_outputs=True),
                                              [Request(rid, records[rid].adapter, records[rid].input_len,
                                                       records[rid].output_len) for rid in late]).records}
    for rid in late:
        assert records[rid].outputs is not None and reference[rid].outputs is not None
        torch.testing.assert_close(records[rid].outputs, reference[rid].outputs, rtol=1e-4, atol=1e-4)


@contextlib.contextmanager
def hosted_engine(root: Path, **kwargs: Any) -> Iterator[tuple[HostedEngine, WorkerCache, EngineConfig]]:
    """A ``HostedEngine`` built over a ``RankEngine``'s catalog and cache (what a worker lends it), closed after."""
    cfg = config(root)
    engine = RankEngine(cfg, Comm())
    cache = engine.cache
    assert isinstance(cache, WorkerCache)
    hosted = HostedEngine(cache, **kwargs)
    try:
        hosted.build(cfg, Rendezvous("127.0.0.1", 0, 1), 0)
        assert hosted.feed is not None
        yield hosted, cache, cfg
    finally:
        if hosted.engine is not None:
            hosted.engine.close()
        hosted.close()
        engine.close()


def test_a_hosted_engine_takes_submits_for_what_its_catalog_has_at_the_call(late_root: Path) -> None:
    """The race of a submit with a registration, defined: ``HostedEngine.submit`` checks rank 0's catalog at the
    call. Not registered yet: refused with ``NotFoundError`` naming it and the fix, nothing of the call submitted
    (the caller registers first, or retries once its registration returned); registered by then, before or after
    the engine was built: accepted (the loop adds the name to its version exchange; ``_take`` reads the catalog
    after taking the requests, so the name is there). (Before: refused until the replica restarted.)"""
    with hosted_engine(late_root) as (hosted, cache, cfg):
        with pytest.raises(NotFoundError, match=r"requests \[1\]: adapter 'late-a' is not registered in this replica"):
            hosted.submit([Request(0, ADAPTERS[0], 3, 1), Request(1, "late-a", 3, 1)])
        assert hosted.feed.take() == ([], False)  # nothing of the refused call
        cache.catalog.register("late-a", Path(cfg.adapters) / "later" / "late-a")
        hosted.submit([Request(1, "late-a", 3, 1)])
        assert [r.rid for r in hosted.feed.take()[0]] == [1]


def test_a_submit_resolving_a_new_name_holds_up_no_other_and_the_end_of_stream_waits_for_it(late_root: Path) -> None:
    """Submits run side by side (the worker actor takes ``SUBMITS`` at once): while one waits for a new name's
    resolution, a submit of a registered adapter goes straight into the feed; ``end_stream`` called meanwhile waits
    for the resolving submit, so its requests go in before the end of the stream; a submit after it is refused,
    naming its requests. (Before: submits ran one at a time, so the second waited up to ``resolve_s``.)"""
    asked, release = threading.Event(), threading.Event()

    with contextlib.ExitStack() as stack:
        def resolve(name: str, timeout_s: float) -> str:  # the controller: registers it on this rank, after a while
            asked.set()
            assert release.wait(30), "the test never released the resolution"
            return cache.catalog.register(name, late_root / "later" / name).version

        hosted, cache, _ = stack.enter_context(hosted_engine(late_root, resolve=resolve))
        feed = hosted.feed
        assert feed is not None
        pool = stack.enter_context(ThreadPoolExecutor(3))
        slow = pool.submit(hosted.submit, [Request(1, "late-b", 3, 1)])
        assert asked.wait(10), "the first submit never asked for its name"
        pool.submit(hosted.submit, [Request(2, ADAPTERS[0], 3, 1)]).result(timeout=10)  # not behind the first
        assert [r.rid for r in feed.take()[0]] == [2] and not slow.done()
        ended = pool.submit(hosted.end_stream)
        wait_for(lambda: feed._closing, "end_stream began")
        assert not ended.done(), "the end of the stream overtook a submit begun before it"
        with pytest.raises(ConfigError, match=r"requests \[3\] submitted after the end of the stream"):
            hosted.submit([Request(3, ADAPTERS[0], 3, 1)])
        release.set()
        slow.result(timeout=10)
        ended.result(timeout=10)
        assert feed.take() == ([Request(1, "late-b", 3, 1)], True)  # in, then the end


def test_a_hosted_engine_submit_whose_resolved_name_never_reaches_the_rank_times_out_and_submits_nothing(
        late_root: Path) -> None:
    """The controller answered a resolution (here: a version that no registration call brings to this rank, as
    when the rank restarts meanwhile): the submit waits ``resolve_s`` at most, then refuses the whole call with
    ``ResolveTimeoutError`` naming its requests, the version and the rank; nothing of it is submitted. A refusal
    from the controller keeps its own class (``refusal``). The real resolution, through the controller:
    tests/test_ray_versions.py::test_the_hosted_engine_serves_a_name_registered_by_nobody_once_it_resolves_it."""
    asked: list[str] = []

    def resolve(name: str, timeout_s: float) -> str:
        asked.append(name)
        if name == "late-b":
            raise CapacityError("over the controller's --resolve-parallel")
        return "v-never-arrives"

    with hosted_engine(late_root, resolve=resolve, resolve_s=0.3) as (hosted, _, _):
        t0 = time.monotonic()
        with pytest.raises(ResolveTimeoutError, match=r"requests \[1, 2\] .*'late-a'.*v-never-arrives.*rank 0"):
            hosted.submit([Request(0, ADAPTERS[0], 3, 1), Request(1, "late-a", 3, 1), Request(2, "late-a", 4, 1)])
        assert 0.3 <= time.monotonic() - t0 < 5 and asked == ["late-a"]  # one resolution per name
        with pytest.raises(CapacityError, match=r"requests \[3\] .*--resolve-parallel"):
            hosted.submit([Request(3, "late-b", 3, 1)])
        assert hosted.feed.take() == ([], False)  # nothing of either refused call


def test_a_hosted_engine_submit_pins_each_reference_to_its_exact_version_or_refuses_the_whole_call(
        late_root: Path) -> None:
    """``HostedEngine.submit`` turns ``A@VERSION`` and ``A@TAG`` into the exact version (``engine.pinned_refs``),
    after resolving names. A malformed reference is refused before any name is resolved (so its unknown name is not
    the error); one naming a version the catalog does not keep is refused with ``NotFoundError``; either names the
    request and submits nothing of the call. The Ray twins: tests/test_ray_push.py, tests/test_ray_versions.py."""
    with hosted_engine(late_root) as (hosted, cache, _):
        with pytest.raises(AdapterFormatError, match=r"^request 1 \(nothing of this call was submitted\): .*'late-a@'"):
            hosted.submit([Request(0, ADAPTERS[0], 3, 1), Request(1, "late-a@", 3, 1)])
        with pytest.raises(NotFoundError, match=r"^request 2 \(nothing of this call was submitted\): adapter "
                                                r"'adapter-000' has no version or pushed tag 'zzz' kept"):
            hosted.submit([Request(0, ADAPTERS[0], 3, 1), Request(2, f"{ADAPTERS[0]}@zzz", 3, 1)])
        assert hosted.feed.take() == ([], False)  # nothing of either refused call
        version = cache.catalog.current(ADAPTERS[0])
        hosted.submit([Request(3, f"{ADAPTERS[0]}@{version}", 3, 1), Request(4, ADAPTERS[1], 3, 1)])
        assert [r.adapter for r in hosted.feed.take()[0]] == [f"{ADAPTERS[0]}@{version}", ADAPTERS[1]]


OLDER = 6  # versions of "ver": v0 named by a request, then 5 more registered (past the default keep_versions, 4)


@pytest.fixture(scope="module")
def versions_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ADAPTERS, and ``versions/ver-vN``: one adapter's versions (different weights), not registered at build."""
    from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
    from lora_cache.adapters.synth import write_adapter

    root = tmp_path_factory.mktemp("named-versions")
    make_adapters(root, SynthConfig(model="tiny", count=len(ADAPTERS), rank="8"))
    for n in range(OLDER):
        write_adapter(root / "versions" / f"ver-v{n}", SHAPES["tiny"], 8, 16.0, list(MODULE_ORDER), torch.float32,
                      torch.Generator().manual_seed(1000 + n))
    files = [p for p in root.rglob("*") if p.is_file()]
    wait_for(lambda: all(settled_at(FileIdentity.of(p.stat()), time.time_ns()) for p in files),
             "the versions' files settled (identity versions)", 10)
    return root


def _named_rank(cfg: EngineConfig, comm: Comm) -> tuple[EngineResult, str, list[str]]:
    """One rank of a streaming run in which a request pinned to ``ver``'s older version v0 waits (its arrival is
    later) while every rank registers newer versions past ``keep_versions``, each once its own exchange has the
    request's row. Returns rank 0's result, v0, and this rank's versions of ``ver`` after its registrations."""
    engine = RankEngine(cfg, comm)
    engine.warm_up()
    versions = Path(cfg.adapters) / "versions"
    v0 = engine.catalog.register("ver", versions / "ver-v0").version
    engine.catalog.register("ver", versions / "ver-v1")  # v1 current, v0 older (within the bound)
    feed = Feed() if comm.rank == 0 else None
    stop = threading.Event()
    after: list[str] = []

    def register_once_named() -> None:  # on every rank: the controller's registrations, once the row is here
        while f"ver@{v0}" not in engine.versions.named:
            if stop.wait(0.005):
                return
        for n in range(2, OLDER):
            engine.catalog.register("ver", versions / f"ver-v{n}")
        after.extend(engine.catalog.versions("ver"))
        if feed is not None:
            done: list[int] = []
            _finish(feed, done, {0, 1})
            feed.close()

    if feed is not None:  # the router: the request on v0 arrives 1.5 s into the run (not admitted, not loaded yet)
        feed.submit([Request(0, ADAPTERS[0], 3, 2), Request(1, f"ver@{v0}", 3, 2, arrival_s=1.5)])
    return _serve_beside(cfg, comm, engine, feed, register_once_named, stop), v0, after


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_pinned_to_an_older_version_outlives_the_registrations_past_the_bound(
        versions_root: Path, tp: int) -> None:
    """Issue 44 item 3: a request admitted on ``ver@v0`` while v0 is an older version waits (here for its arrival;
    in service for a lane or a load); meanwhile every rank registers newer versions until v0 is past
    ``keep_versions`` with no slot holding it. The request's row of the version exchange keeps v0 on every rank, so
    it is served on v0 everywhere (the step audit); before, each rank's registration retired v0 and the request
    failed. (TP 2: each rank registers once its own exchange has the row, as the round that brings it ends.)"""
    cfg = config(versions_root, tp=tp, admission="ondemand", audit_steps=True)
    result, v0, after = _named_rank(cfg, Comm()) if tp == 1 else spawn(functools.partial(_named_rank, cfg), tp, "cpu")
    assert v0 in after and len(after) == OLDER, f"rank 0 retired v0 under its request: {after}"
    _served_on(result, v0)


def _served_on(result: EngineResult, v0: str) -> None:
    """Requests 0 and 1 were served, request 1 on ``ver@v0`` on every rank (the step audit), never another version."""
    records = {r.rid: r for r in result.records}
    assert records[0].ok and records[1].ok, records[1].error
    assert records[1].version == v0
    for rank in result.ranks:
        keys = {key for audit in rank.audit for r, key in zip(audit.rids, audit.keys) if r == 1}
        assert keys == {f"ver@{v0}"}, (rank.rank, keys)


def _behind_rank(cfg: EngineConfig, flag: Path, comm: Comm) -> tuple[EngineResult, str]:
    """One rank of a streaming run at TP 2 in which the registrations that put ``ver``'s v0 past ``keep_versions``
    reach rank 1 first; only then (``flag``) does rank 0 accept a request pinned to v0, which its own catalog still
    keeps, and take the registrations once the request's row is in its exchange. Returns rank 0's result and v0."""
    engine = RankEngine(cfg, comm)
    engine.warm_up()
    versions = Path(cfg.adapters) / "versions"
    v0 = engine.catalog.register("ver", versions / "ver-v0").version
    engine.catalog.register("ver", versions / "ver-v1")
    feed = Feed() if comm.rank == 0 else None
    stop = threading.Event()

    def registrations() -> None:  # the controller's, one rank at a time
        if feed is None:
            for n in range(2, OLDER):
                engine.catalog.register("ver", versions / f"ver-v{n}")
            flag.write_text(" ".join(engine.catalog.versions("ver")))
            return
        if not _flag(flag, stop):
            return
        feed.submit([Request(1, f"ver@{v0}", 3, 2)])  # accepted: rank 0's catalog keeps v0
        while f"ver@{v0}" not in engine.versions.named:
            if stop.wait(0.005):
                return
        for n in range(2, OLDER):
            engine.catalog.register("ver", versions / f"ver-v{n}")
        done: list[int] = []
        _finish(feed, done, {0, 1})
        feed.close()

    if feed is not None:
        feed.submit([Request(0, ADAPTERS[0], 3, 2)])
    return _serve_beside(cfg, comm, engine, feed, registrations, stop), v0


def test_a_request_rank_0_admits_on_a_version_another_rank_saw_pass_the_bound_is_served_on_it(
        versions_root: Path, tmp_path: Path) -> None:
    """Issue 44 item 3 at TP 2, registrations reaching the ranks one at a time: rank 1 takes five newer versions of
    ``ver`` first (v0 past ``keep_versions`` there, no slot holding it), then rank 0, which still keeps v0, accepts a
    request pinned to it. Rank 1 keeps v0 on rank 0's word (``workers.engine.releases``), so the request is served
    on v0 on both ranks (the step audit). Before, rank 1 retired v0 at its own registration and the request failed
    there."""
    cfg = config(versions_root, tp=2, admission="ondemand", audit_steps=True)
    flag = tmp_path / "rank1-registered"
    result, v0 = spawn(functools.partial(_behind_rank, cfg, flag), 2, "cpu")
    assert v0 in flag.read_text().split(), "rank 1 held v0 past its bound, for rank 0's word"
    _served_on(result, v0)
