"""Every residency change of a worker cache reaches the controller as exactly one delta, in order,
whoever made it: a command, an engine's on-demand load, or the LRU eviction such a load makes."""

from __future__ import annotations

import contextlib
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.errors import CapacityError, LoraCacheError
from lora_cache.vocab import AdapterKey, Delta, Evict, Prefetch, WorkerId, delta_row
from workers.cache import WorkerCache
from workers.control.commands import CommandGate

A, B, C, D = (f"adapter-{i:03d}" for i in range(4))


class Deltas:
    """A thread-safe ``on_change`` / ``push`` that keeps every delta: the slots' in ``items``, the host tier's
    ("staged", "unstaged": a separate line of changes) in ``host``."""

    def __init__(self) -> None:
        self.items: list[Delta] = []
        self.host: list[Delta] = []
        self._lock = threading.Lock()

    def __call__(self, delta: Delta) -> None:
        with self._lock:
            (self.host if delta.state in ("staged", "unstaged") else self.items).append(delta)

    def drain(self) -> list[Delta]:
        """The deltas so far, oldest first; forgets them."""
        with self._lock:
            out, self.items = self.items, []
        return out

    def take(self) -> list[tuple[str, str]]:
        """(adapter, state) of the deltas so far, oldest first; forgets them."""
        return [(d.adapter, d.state) for d in self.drain()]


@pytest.fixture
def catalog(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    return make_catalog(tiny_adapters(count=6, rank="8,16")[0].parent)


@pytest.fixture
def reported(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> Iterator[tuple[WorkerCache, Deltas]]:
    """A 2-slot CPU cache whose changes go to a ``Deltas``."""
    deltas = Deltas()
    cache = make_cache(catalog, num_slots=2)
    cache.on_change = deltas
    yield cache, deltas


def engine_step(cache: WorkerCache, names: list[str]) -> None:
    cache.release(cache.acquire(names))
    cache.settle()


def replay(deltas: list[tuple[str, str]]) -> dict[str, str]:
    """What the deltas add up to (adapter -> loading | ready), checking each adapter's transitions."""
    state: dict[str, str] = {}
    allowed = {None: {"loading", "failed", "no_room"}, "loading": {"ready"}, "ready": {"gone"}}  # no restates here
    for adapter, new in deltas:
        assert new in allowed[state.get(adapter)], f"{adapter}: {state.get(adapter)} -> {new} in {deltas}"
        if new in ("gone", "failed", "no_room"):
            state.pop(adapter, None)
        else:
            state[adapter] = new
    return state


def residency(cache: WorkerCache) -> dict[str, str]:
    return {str(r["adapter"]): str(r["state"]) for r in cache.residency()}


def test_an_engine_load_reports_loading_then_ready_and_its_lru_eviction_gone(reported) -> None:
    cache, deltas = reported
    engine_step(cache, [A])
    engine_step(cache, [B])
    assert deltas.take() == [(A, "loading"), (A, "ready"), (B, "loading"), (B, "ready")]
    engine_step(cache, [C])  # a miss with both slots READY and idle: the LRU one (A) is evicted for it
    assert deltas.take() == [(A, "gone"), (C, "loading"), (C, "ready")]
    engine_step(cache, [B, C])  # hits change nothing
    assert deltas.take() == []
    assert cache.stats()["demand_loads"] == 3 and cache.stats()["evictions"] == 1
    cache.check_integrity()


def test_the_ready_delta_carries_the_record_and_arrives_before_the_future(reported) -> None:
    cache, deltas = reported
    record = cache.prefetch(A).result(timeout=10)  # an engine's own prefetch (overlap's first use)
    assert [(d.adapter, d.state) for d in deltas.items] == [(A, "loading"), (A, "ready")]
    ready = deltas.items[-1]
    assert ready.record == record and ready.version == record.version and ready.error == ""


def test_the_host_tier_reports_each_shard_read_in_and_dropped_in_order(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    make_cache: Callable[..., WorkerCache],
) -> None:
    """What the host tier holds reaches ``on_change`` as its own line of deltas: "staged" once a read put a shard
    there whole (a load's read, a stage), "unstaged" when its LRU drops it for room; per adapter they alternate,
    starting with "staged", carry the version read, and add up to what the tier holds (``HostTier.contents``)."""
    catalog = make_catalog(tiny_adapters(count=24, rank="16")[0].parent)  # 24 shards of 64 KiB: a 1 MiB tier holds 16
    names = sorted(catalog.names())
    deltas = Deltas()
    cache = make_cache(catalog, num_slots=2, host_bytes=1 << 20)
    cache.on_change = deltas
    for name in names:  # loads (read, copied, READY), evicted: their shards stay in the tier until its LRU drops them
        cache.prefetch(name).result(timeout=10)
        cache.evict(name)
    for name in names[:4]:  # stages: reads with no slot (the oldest were dropped: read again)
        staged = cache.stage(name)
        if staged is not None:
            staged.result(timeout=10)
    cache.settle()
    held: set[str] = set()
    for d in deltas.host:
        assert (d.state == "staged") == (d.adapter not in held), f"{d.adapter}: {d.state} out of turn in {deltas.host}"
        held.symmetric_difference_update({d.adapter})
        assert d.version == catalog.get(d.adapter).version
    assert held == {k.name for k in cache.host.contents()}
    assert sum(d.state == "unstaged" for d in deltas.host) >= len(names) - 16, "the LRU dropped shards unreported"
    assert all(d.state in ("loading", "ready", "gone") for d in deltas.items), "a host change among the slots'"
    cache.check_integrity()


def test_the_outbox_sends_a_ready_delta_with_its_store_read_seconds() -> None:
    """The warming gate's sample: a READY row carries its load's store read (``disk_ms``) in seconds; other rows 0."""
    from lora_cache.vocab import ReadinessRecord
    from workers.control.outbox import Outbox

    sent: list[list] = []
    done = threading.Event()

    def send(name: str, incarnation: int, batch: list) -> None:
        sent.append(batch)
        if sum(len(b) for b in sent) >= 2:
            done.set()

    outbox = Outbox("w", 0.001, send=send)
    try:
        record = ReadinessRecord(A, "v1", 0, 0, disk_ms=250.0, h2d_ms=1.0, ready_ms=260.0, nbytes=10, host_hit=False)
        outbox.push(Delta(A, "v1", "loading"))
        outbox.push(Delta(A, "v1", "ready", record))
        assert done.wait(10), "the outbox did not send"
    finally:
        outbox.close()
    rows = [row for batch in sent for row in batch]
    assert rows == [(1, A, "v1", "loading", "", 0.0, False), (2, A, "v1", "ready", "", 0.25, False)]


def test_a_prefetch_that_finds_every_slot_in_use_reports_no_room_once(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    deltas = Deltas()
    cache = make_cache(catalog, num_slots=1)
    cache.on_change = deltas
    held = cache.acquire([A])
    cache.settle()
    with pytest.raises(CapacityError):
        cache.prefetch(B).result(timeout=10)
    assert deltas.take() == [(A, "loading"), (A, "ready"), (B, "no_room")]  # not there, and not a failure
    cache.release(held)
    cache.check_integrity()


def test_a_broken_consumer_does_not_break_loads(reported, caplog: pytest.LogCaptureFixture) -> None:
    cache, _ = reported

    def broken(delta: Delta) -> None:
        raise RuntimeError("controller gone")

    cache.on_change = broken
    engine_step(cache, [A, B])
    assert residency(cache) == {A: "ready", B: "ready"}
    assert "residency change" in caplog.text


def test_concurrent_engines_and_evicts_report_changes_in_order(reported) -> None:
    """Threads acquire, prefetch and evict at once: each adapter's deltas follow its transitions, and
    all of them add up to the residency the cache reports."""
    cache, deltas = reported
    names = [A, B, C, D]
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait()
        try:
            for _ in range(60):
                op, name = rng.random(), rng.choice(names)
                if op < 0.5:
                    with contextlib.suppress(CapacityError):  # every slot held by the other threads' batches
                        cache.release(cache.acquire([name]))
                elif op < 0.8:
                    cache.prefetch(name)
                else:
                    cache.evict(name)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    cache.settle()
    assert not errors and not any(t.is_alive() for t in threads)
    taken = deltas.take()
    assert replay(taken) == residency(cache)
    assert {"loading", "ready", "gone"} <= {state for _, state in taken}
    cache.check_integrity()


# -- the command gate: no delta twice -------------------------------------------------------------------
@pytest.mark.parametrize("wiring", ["actor", "gate"])
def test_commanded_prefetch_and_evict_report_each_change_once(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], wiring: str
) -> None:
    """``actor``: the cache reports to the outbox itself (WorkerActor); ``gate``: a cache built without
    ``on_change`` reports through the gate's ``push``. Either way one delta per change."""
    deltas = Deltas()
    cache = make_cache(catalog, num_slots=2)
    if wiring == "actor":
        cache.on_change = deltas
    gate = CommandGate(cache, deltas)
    assert cache.on_change is deltas
    v = {n: catalog.get(n).version for n in (A, B, C)}
    result = gate.apply([Prefetch(A, v[A], 0, epoch=1)])
    cache.settle()
    result = gate.apply([Prefetch(B, v[B], 0, epoch=1), Prefetch(A, v[A], 0, epoch=1)])  # A again: idempotent
    cache.settle()
    assert result.accepted == 2 and not result.errors
    assert deltas.take() == [(A, "loading"), (A, "ready"), (B, "loading"), (B, "ready")]
    gate.apply([Evict(A, v[A], epoch=1), Evict(A, v[A], epoch=1), Prefetch(C, v[C], 0, epoch=1)])
    cache.settle()
    assert deltas.take() == [(A, "gone"), (C, "loading"), (C, "ready")]
    engine_step(cache, [A])  # the engine's own load, through the same path: B was least recently used
    assert deltas.take() == [(B, "gone"), (A, "loading"), (A, "ready")]
    cache.check_integrity()


def test_refused_and_failed_prefetches_report_failed_once(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    deltas = Deltas()
    cache = make_cache(catalog, num_slots=2)
    gate = CommandGate(cache, deltas)
    # refused before any load started (unknown): the gate says so, the cache has nothing to say
    result = gate.apply([Prefetch("ghost", "v1", 0, epoch=1)])
    assert result.accepted == 0 and "ghost" in result.errors[0]
    assert deltas.take() == [("ghost", "failed")]
    # started, then the read failed: the cache says so, the gate adds nothing
    root = catalog.roots.roots[0]
    shutil.copytree(root / D, root / "bad")
    bad = catalog.register("bad", "bad")
    bad.weights.write_bytes(bad.weights.read_bytes()[:100])
    gate.apply([Prefetch("bad", bad.version, 0, epoch=1)])
    cache.settle()
    (failed,) = deltas.items
    assert (failed.adapter, failed.state) == ("bad", "failed") and "changed size" in failed.error
    cache.check_integrity()


def test_a_refused_evict_restates_the_adapter_in_order(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    """The controller assumes an evict done: if the adapter is in use or loading, the gate says what it is,
    once; an evict of an absent adapter says nothing (nothing changed, and the controller is right)."""
    deltas = Deltas()
    cache = make_cache(catalog, num_slots=2)
    gate = CommandGate(cache, deltas)
    v = {n: catalog.get(n).version for n in (A, B)}
    held = cache.acquire([A])
    cache.settle()
    deltas.take()
    result = gate.apply([Evict(A, v[A], epoch=1), Evict(B, v[B], epoch=1)])
    assert result.accepted == 2 and not result.errors
    assert [(d.adapter, d.state) for d in deltas.items] == [(A, "in_use")]
    deltas.take()
    cache.release(held)
    gate.apply([Evict(A, v[A], epoch=1)])  # idle now: evicted
    assert deltas.take() == [(A, "gone")]
    cache.restate(B, v[B])  # absent
    assert deltas.take() == []
    cache.prefetch(B).result(timeout=10)
    cache.restate(B, v[B])
    assert deltas.take() == [(B, "loading"), (B, "ready"), (B, "ready")]


# -- the controller's view --------------------------------------------------------------------------------
def one_worker_core(catalog: AdapterCatalog) -> tuple[ControllerCore, WorkerId]:
    """A controller core with adapters A, B, C and one TP-1 replica of two slots."""
    core = ControllerCore(ControllerConfig(catalog=catalog.config), epoch=1)
    for name in (A, B, C):
        core.register_adapter(name, str(catalog.get(name).path))
    core.add_replica("r0", tp=1, slots=2)
    return core, WorkerId("r0", 0)


def deliver(core: ControllerCore, wid: WorkerId, deltas: Deltas) -> None:
    """The worker's deltas so far, reported to the controller as its outbox would."""
    core.worker_report(wid, [delta_row(0, d)[1:] for d in deltas.drain()], now=1.0)


def test_the_controller_sees_engine_loads_without_a_resync(
    catalog: AdapterCatalog, reported: tuple[WorkerCache, Deltas]
) -> None:
    """Deltas of engine loads and LRU evictions bring the controller's view to what a full report says:
    a resync afterwards changes nothing."""
    core, wid = one_worker_core(catalog)
    cache, deltas = reported
    for name in (A, B, C):  # C evicts A
        engine_step(cache, [name])
        deliver(core, wid, deltas)
    assert core.readiness.lookup(A).ready == () and core.readiness.lookup(C).ready == ("r0",)
    held = core.planner._fleet.residency[str(wid)]
    assert {k.name for k in held} == {B, C}
    full = [(str(r["adapter"]), str(r["version"]), str(r["state"]), int(r["refs"]))  # type: ignore[call-overload]
            for r in cache.residency()]
    assert core.sync_worker(wid, full) == []  # nothing new to publish
    assert {k.name for k in core.planner._fleet.residency[str(wid)]} == {B, C}
    assert AdapterKey(C, catalog.get(C).version) in held
    core.check_integrity()


def test_a_refused_evict_keeps_the_adapter_pinned_in_the_planner(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    """The planner evicts an adapter a batch still holds: the worker refuses and restates it "in_use", so
    the planner counts it pinned and does not evict it again. (Before, it counted the slot free until the
    resync, and each prefetch into it evicted another adapter it wanted, which it then reloaded.)"""
    core, wid = one_worker_core(catalog)
    deltas = Deltas()
    cache = make_cache(catalog, num_slots=2)
    gate = CommandGate(cache, deltas)
    held = cache.acquire([A])  # an engine's batch, not yet released
    cache.settle()
    deliver(core, wid, deltas)
    core.report_queue("r0", [(B, 0.0), (C, 0.5)], now=1.0)
    plan = core.plan(now=1.0)[wid]
    key_a = AdapterKey(A, catalog.get(A).version)
    assert Evict(A, key_a.version, epoch=1) in plan
    gate.apply(plan)
    cache.settle()
    assert (A, "in_use") in [(d.adapter, d.state) for d in deltas.items]
    deliver(core, wid, deltas)
    assert core.planner._fleet.residency[str(wid)][key_a].pinned
    assert core.readiness.lookup(A).ready == ("r0",)
    assert not any(c.adapter == A for c in core.plan(now=1.1).get(wid, []))
    cache.release(held)
    core.check_integrity()


def test_prefetch_raises_only_when_no_load_started(reported) -> None:
    cache, deltas = reported
    with pytest.raises(LoraCacheError, match="not registered"):
        cache.prefetch("ghost")
    assert deltas.take() == []


def test_a_loads_deltas_within_the_linger_go_as_one_batch_and_a_bad_linger_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Outbox.linger_s`` (``LINGER_S``): a load's "loading" and READY pushed within it go in one batch, in order, so
    one Ray call follows a device push's answer instead of one during its launches; 0 sends each at once. A bad
    ``LORA_CACHE_OUTBOX_LINGER_S`` is refused naming it and the fix (``preflight.check_environment`` too)."""
    from lora_cache.app.preflight import check_environment
    from lora_cache.errors import ConfigError
    from workers.control.outbox import LINGER_ENV, LINGER_S, Outbox, linger_env

    for linger, batches in ((1.0, 1), (0.0, 2)):
        sent: list[list] = []
        first, both, go = threading.Event(), threading.Event(), threading.Event()

        def send(name: str, incarnation: int, batch: list, sent: list[list] = sent, first: threading.Event = first,
                 both: threading.Event = both, go: threading.Event = go) -> None:
            sent.append(batch)
            first.set()
            if sum(len(b) for b in sent) >= 2:
                both.set()
            go.wait(10)  # the first batch's send held until the second delta was pushed: no race on the count

        outbox = Outbox("w", 0.0, send=send, linger_s=linger)
        try:
            outbox.push(Delta(A, "v1", "loading"))
            if linger == 0.0:
                assert first.wait(10), "an outbox with no linger did not send its first delta"
            else:  # pushed well within the linger (1 s)
                assert not first.is_set(), "the first delta went before its linger was over"
            outbox.push(Delta(A, "v1", "ready"))
            go.set()
            assert both.wait(10), "the outbox did not send both deltas"
        finally:
            outbox.close()
        assert [[row[3] for row in b] for b in sent] == ([["loading", "ready"]] if batches == 1
                                                          else [["loading"], ["ready"]]), (linger, sent)
    monkeypatch.delenv(LINGER_ENV, raising=False)
    assert linger_env() == LINGER_S
    monkeypatch.setenv(LINGER_ENV, "0")
    assert linger_env() == 0.0
    for bad in ("soon", "-1", "5"):
        monkeypatch.setenv(LINGER_ENV, bad)
        with pytest.raises(ConfigError, match=f"{LINGER_ENV}=.*0 to 1"):
            check_environment()
