"""Controller state across a restart, the plain core (issue 19, item 5): hints, queue reports and
popularity exported from one planner and restored into a fresh one (CPU, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lora_cache.controller.snapshots import DurableConfig, Snapshots, decode, encode
from lora_cache.errors import ConfigError
from lora_cache.planner import Hint, Planner
from lora_cache.vocab import AdapterKey
from tests.planner_queries import dirty_replicas, needed_adapters, popularity
from tests.test_planner import make, prefetched, queue


def fill(planner: Planner) -> None:
    planner.add_hint(Hint("near", "a3", "r0", 1.5), 1.0)
    planner.add_hint(Hint("far", "a4", "r1", 500.0), 1.0)
    queue(planner, "r0", "a1", "a2", now=1.0)
    planner.record_request("a5", "r1", 1.0, weight=7)


def restarted(planner: Planner, now: float, **config: Any) -> tuple[Planner, Any]:
    fresh = make(replicas=2, **config)
    return fresh, fresh.restore_state(decode(encode(planner, DurableConfig())), now)


def test_hints_queues_and_popularity_come_back_and_nothing_is_counted_twice() -> None:
    before = make(replicas=2)
    fill(before)
    after, restored = restarted(before, 2.0)
    assert restored == restored._replace(hints=2, queues=1, skipped=0)  # type: ignore[attr-defined]
    for replica in ("r0", "r1"):
        assert after.view.hints(replica) == before.view.hints(replica)
        assert after.view.queue(replica) == before.view.queue(replica)
        for adapter in ("a1", "a2", "a3", "a4", "a5"):
            assert popularity(after, adapter, 2.0, replica) == pytest.approx(popularity(before, adapter, 2.0, replica))
    assert popularity(after, "a5", 2.0) == pytest.approx(popularity(before, "a5", 2.0))
    after.check_integrity()
    plan = after.plan(2.0)  # the restored needs are planned at once, like before the restart
    assert prefetched(plan, "r0/w0") == ["a1", "a2"]
    assert needed_adapters(after, "r0") == ("a1", "a2", "a3") and staged_or_held(after, plan, "r0", "a3")
    queue(after, "r0", "a1", "a2", now=2.5)  # the engine re-reports the same queue: no new arrivals
    assert popularity(after, "a1", 2.5) == pytest.approx(popularity(before, "a1", 2.5))


def staged_or_held(planner: Planner, plan: object, replica: str, adapter: str) -> bool:
    commands = plan.for_worker(f"{replica}/w0")  # type: ignore[attr-defined]
    return any(c.adapter == adapter for c in commands.stages + commands.prefetches) or \
        AdapterKey(adapter, "v1") in planner.view.residency(f"{replica}/w0")


def test_a_far_hint_restored_still_turns_near_on_time() -> None:
    before = make(replicas=2, slots=1, tp=1)
    before.add_hint(Hint("far", "a4", "r1", 10.0), 1.0)
    after, _ = restarted(before, 2.0, slots=1, tp=1)
    after.plan(2.0)
    after.advance(8.0)
    assert "r1" in dirty_replicas(after)
    after.check_integrity()


def test_unknown_names_stale_hints_and_fresher_queues_are_skipped() -> None:
    before = make(replicas=2, adapters=9)
    fill(before)
    before.add_hint(Hint("gone", "a8", "r0", 1.2), 1.0)
    before.add_hint(Hint("old", "a2", "r0", -40.0), 1.0)  # expired by the time of the restore
    after = make(replicas=1, adapters=8)  # r1 and a8 are gone
    queue(after, "r0", "a7", now=1.5)  # the engine re-reported before the restore: it wins
    before.advance(1.0)
    restored = after.restore_state(decode(encode(before, DurableConfig())), 20.0)
    assert restored.hints == 1 and restored.queues == 0 and restored.skipped >= 4
    assert [h.hint_id for h in after.view.hints("r0")] == ["near"]  # "far" was for r1, "gone" for a8
    assert after.view.queue("r0")[0].adapter == "a7"
    after.check_integrity()


def test_restore_into_a_planner_whose_clock_already_moved_rescales_counts() -> None:
    before = make(replicas=2, half_life_s=10.0)
    before.record_request("a5", "r0", 1.0, weight=8)
    after = make(replicas=2, half_life_s=10.0)
    after.record_request("a6", "r0", 21.0)  # its own landmark is 21.0
    after.restore_state(decode(encode(before, DurableConfig())), 21.0)
    assert popularity(after, "a5", 21.0) == pytest.approx(2.0)  # 8 halved twice
    assert popularity(after, "a6", 21.0) == pytest.approx(1.0)
    after.check_integrity()


def test_snapshots_are_bounded_throttled_and_skipped_when_unchanged() -> None:
    planner = make(replicas=2, adapters=60)
    for i in range(60):
        planner.record_request(f"a{i}", "r0", 1.0, weight=i + 1)
    planner.add_hint(Hint("h", "a1", "r0", 1.5), 1.0)
    small = DurableConfig(max_bytes=1024)
    data = encode(planner, small)
    state = json.loads(data)
    assert len(data) <= 1024 and state["hints"] == [["h", "a1", "r0", 1.5]]
    assert 0 < len(state["popularity"]["fleet"]) < 60 and "a59" in state["popularity"]["fleet"]  # the top kept
    snaps = Snapshots(DurableConfig(period_s=1.0))
    first = snaps.take(planner, 10.0)
    assert first is not None
    snaps.written(first)
    planner.add_hint(Hint("h2", "a2", "r0", 1.5), 1.0)
    assert snaps.take(planner, 10.5) is None  # too soon
    second = snaps.take(planner, 11.0)
    assert second is not None and second != first
    snaps.written(second)
    assert snaps.take(planner, 12.0) is None and snaps.writes == 2  # unchanged


@pytest.mark.parametrize(("field", "value", "words"), [
    ("period_s", 0, "period_s is 0; give a positive number of seconds"),
    ("period_s", float("nan"), "period_s is nan"),
    ("max_bytes", 10, "max_bytes is 10; give an int >= 1024"),
    ("max_counts", True, "max_counts is True"),
    ("key", "", "key is empty"),
])
def test_durable_config_is_validated(field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        DurableConfig(**{field: value})  # type: ignore[arg-type]


def test_a_snapshot_of_another_format_is_refused() -> None:
    planner = make()
    with pytest.raises(ValueError, match="format 0, this controller reads 1"):
        planner.restore_state({"format": 0, "hints": [], "queues": {}, "popularity": {}}, 1.0)
    with pytest.raises(ValueError, match="not an object"):
        decode(b"[1, 2]")


# -- the catalog (issue 29, item 4) ----------------------------------------------------------------------------


def _catalog_world(tmp_path: Path) -> tuple[Any, Path]:
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.adapters.synth import SynthConfig, make_adapters
    from lora_cache.controller.core import ControllerConfig, ControllerCore

    make_adapters(tmp_path, SynthConfig(model="tiny", count=3, rank="8"))
    config = ControllerConfig(catalog=CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=8))
    return lambda: ControllerCore(config, epoch=1), tmp_path


def _settled(core: Any) -> None:
    """Every spec as a registration made 2 s after its file's last change would hold it (not racy)."""
    from lora_cache.adapters.files import RACY_NS
    from lora_cache.adapters.peft import AdapterSpec

    def settled(spec: AdapterSpec) -> AdapterSpec:
        assert spec.source is not None
        source = spec.source._replace(registered_ns=spec.source.identity.ctime_ns + 2 * RACY_NS)
        return AdapterSpec(**{**spec.__dict__, "source": source})

    for spec, older in core.catalog.entries():
        core.catalog.add(settled(spec))
        for kept in older:
            core.catalog.keep(settled(kept))  # the same version: replaced in its place


def test_the_catalog_comes_back_from_its_snapshot_proven_changed_or_refused(tmp_path: Path, monkeypatch) -> None:
    import shutil

    import lora_cache.adapters.peft as peft_module
    from lora_cache.adapters.peft import WEIGHTS_FILE
    from lora_cache.controller import catalog_store

    fresh, root = _catalog_world(tmp_path)
    before = fresh()
    for name in ("adapter-000", "adapter-001", "adapter-002"):
        before.register_adapter(name, name)  # relative paths: taken from the first root, kept as given
    shutil.copytree(root / "adapter-002", root / "alt")
    old = before.catalog.get("adapter-000").version
    before.register_adapter("adapter-000", "alt")  # adapter-000's first version stays kept (its own files)
    _settled(before)
    snaps = catalog_store.CatalogSnapshots()
    data = snaps.take(before.catalog, dict(before.paths))
    saved = catalog_store.decode(data)
    assert [e.name for e in saved] == ["adapter-000", "adapter-001", "adapter-002"]
    assert saved[0].current.path == "alt" and [v.known.version for v in saved[0].older] == [old]

    hashed: list[str] = []
    real = peft_module.digest_weights
    monkeypatch.setattr(peft_module, "digest_weights", lambda fd, ident, what, *a: hashed.append(what.parent.name)
                        or real(fd, ident, what, *a))
    after = fresh()
    restored = catalog_store.read_saved(after, saved)
    catalog_store.apply(after, restored)
    assert hashed == [], "a file proven the one hashed was hashed again"
    assert (restored.unchanged, restored.rehashed, restored.changed, restored.refused, restored.dropped) == \
        (3, 0, 0, 0, 0)
    for name in ("adapter-000", "adapter-001", "adapter-002"):
        assert after.catalog.versions(name) == before.catalog.versions(name) and after.paths[name] == before.paths[name]

    (root / "adapter-001" / WEIGHTS_FILE).write_bytes((root / "adapter-000" / WEIGHTS_FILE).read_bytes())
    shutil.rmtree(root / "adapter-002")
    (root / "adapter-000" / WEIGHTS_FILE).write_bytes((root / "alt" / WEIGHTS_FILE).read_bytes())
    again = fresh()
    restored = catalog_store.read_saved(again, saved)
    catalog_store.apply(again, restored)
    assert (restored.changed, restored.refused, restored.dropped) == (1, 1, 1)
    assert again.catalog.get("adapter-001").version == old, "the changed file came back under an old version"
    assert "adapter-002" not in again.catalog
    assert again.catalog.versions("adapter-000") == [before.catalog.get("adapter-000").version], \
        "an older version whose bytes are gone came back"


def test_a_catalog_snapshot_re_encodes_only_what_changed_and_a_write_covers_the_calls_behind_it(
        tmp_path: Path) -> None:
    import asyncio

    from lora_cache.controller import catalog_store
    from lora_cache.controller.snapshots import DurableState

    fresh, _ = _catalog_world(tmp_path)
    core = fresh()
    core.register_adapter("adapter-000", "adapter-000")
    state = DurableState(DurableConfig(), "test")
    puts: list[bytes] = []

    class Store:
        fail = False

        def get(self) -> bytes | None:
            return puts[-1] if puts else None

        def put(self, data: bytes) -> None:
            if self.fail:
                raise ConnectionError("GCS unreachable")
            puts.append(data)

    store = Store()
    state.catalog_store = store  # type: ignore[assignment]
    encoded: list[str] = []
    real = catalog_store.entry_json

    def counted(name: str, *args: Any) -> Any:
        encoded.append(name)
        return real(name, *args)

    async def scenario() -> None:
        catalog_store.entry_json = counted  # type: ignore[assignment]
        try:
            await state.save_catalog(core)
            assert len(puts) == 1 and encoded == ["adapter-000"]
            core.register_adapter("adapter-001", "adapter-001")
            core.register_adapter("adapter-002", "adapter-002")
            await asyncio.gather(state.save_catalog(core), state.save_catalog(core), state.save_catalog(core))
            assert len(puts) == 2 and encoded == ["adapter-000", "adapter-001", "adapter-002"]
            await state.save_catalog(core)
            assert len(puts) == 2, "nothing changed: nothing written"
            store.fail = True
            core.unregister_adapter("adapter-001", 1.0)
            await state.save_catalog(core)  # logged, not raised
            store.fail = False
            await state.save_catalog(core)  # the next chance writes it
            assert len(puts) == 3 and [e.name for e in catalog_store.decode(puts[-1])] == ["adapter-000",
                                                                                             "adapter-002"]
            restored = fresh()
            await state.restore_catalog(restored)
            assert restored.catalog.names() == ["adapter-000", "adapter-002"]
            assert state.catalog_restored["entries"] == 2
        finally:
            catalog_store.entry_json = real  # type: ignore[assignment]

    asyncio.run(scenario())


def test_an_unreadable_catalog_snapshot_starts_from_the_workers_reports(tmp_path: Path, caplog) -> None:
    import asyncio

    from lora_cache.controller.snapshots import DurableState

    fresh, _ = _catalog_world(tmp_path)
    state = DurableState(DurableConfig(), "test")

    class Store:
        def get(self) -> bytes:
            return b"not zlib"

    state.catalog_store = Store()  # type: ignore[assignment]
    core = fresh()
    asyncio.run(state.restore_catalog(core))
    assert core.catalog.names() == [] and "could not read the catalog's snapshot" in caplog.text


def test_catalog_key_must_be_its_own() -> None:
    with pytest.raises(ConfigError, match="catalog_key is 'controller-state/v1'; give a GCS key of its own"):
        DurableConfig(catalog_key="controller-state/v1")


def test_the_catalog_copy_is_written_beside_the_gcs_and_restored_when_the_gcs_has_none(tmp_path: Path) -> None:
    """Issue 46 item 5: every catalog snapshot is also written to the copy off the cluster (replaced atomically);
    a controller whose GCS holds none (a new cluster) restores the copy; a location the controller may not reach
    (a relative path) is refused before anything starts."""
    import asyncio

    from lora_cache.controller.catalog_copy import CatalogCopy
    from lora_cache.controller.snapshots import DurableState

    fresh, _ = _catalog_world(tmp_path / "adapters")
    copy = tmp_path / "copy"

    class Gcs:
        def __init__(self) -> None:
            self.data: bytes | None = None

        def get(self) -> bytes | None:
            return self.data

        def put(self, data: bytes) -> None:
            self.data = data

    core = fresh()
    core.register_adapter("adapter-000", "adapter-000")
    core.register_adapter("adapter-001", "adapter-001")
    state = DurableState(DurableConfig(catalog_copy=str(copy)), "svc-a")
    state.catalog_store = Gcs()  # type: ignore[assignment]
    asyncio.run(state.save_catalog(core))
    written = (copy / "svc-a" / "catalog.v1").read_bytes()
    assert written == state.catalog_store.data and not list((copy / "svc-a").glob(".*part"))
    new = DurableState(DurableConfig(catalog_copy=str(copy)), "svc-a")
    new.catalog_store = Gcs()  # type: ignore[assignment]  # the new cluster's GCS: empty
    restored = fresh()
    asyncio.run(new.restore_catalog(restored))
    assert restored.catalog.names() == ["adapter-000", "adapter-001"] and new.catalog_restored["from_copy"] == 1
    assert CatalogCopy(str(copy), "svc-b").get() is None, "another service's copy is its own"
    with pytest.raises(ConfigError, match="catalog copy 'rel/dir' is not an absolute directory nor s3://"):
        DurableConfig(catalog_copy="rel/dir")


def test_a_restored_planner_reads_the_request_rates_of_the_one_it_replaced() -> None:
    """``Popularity.observed_per_second`` (the rate by which a hot adapter gets its extra homes, homes.py) reads a
    count over the time it was kept. A restarted controller's counts began at its restart, so the restored counts
    of the minutes before were read over the seconds since: 2 requests/s read as 37. They are read over the window
    they were kept for, whether the new planner had counted a request of its own before the restore or not."""
    before = make(replicas=2)
    for i in range(40):
        before.record_request("a5", "r0", 1.0 + 0.5 * i)
    for own in (False, True):
        after = make(replicas=2, start=20.5)  # a new controller's clock: the restart is its first time
        if own:
            after.record_request("a6", "r1", 20.5)
        after.restore_state(decode(encode(before, DurableConfig())), 21.0)
        for planner in (before, after):
            planner.record_request("a5", "r0", 21.0)
        rates = [p._popularity.observed_per_second(21.0, 1.0) * p._popularity.fleet.get("a5") for p in (before, after)]
        assert 1.5 < rates[0] < 2.5 and rates[1] == pytest.approx(rates[0]), (own, rates)
        after.check_integrity()
