"""One version per request on every rank (invariant 1), on the CPU: re-registration under traffic.

Two TP ranks, each with its own catalog (re-registration reaches them one at a time) and its own
``WorkerCache``, run by the engine's own parts: each rank's report (``RankVersions``), the all-reduce
(``reduce_min``), rank 0's ``ReducedVersions`` and ``Scheduler``. A hypothesis state machine re-registers
adapters on one rank at a time, evicts, and runs rounds; every step it checks that all ranks computed each
item with the same version, the version the request was admitted with, and that the slot held that
version's bytes (a digest of the rank's shard read from the version's own files). Versions also arrive as device
pushes (issue 44 item 5): registered device-only on one rank at a time, taken by a rank from the trainer's image
only, their node copy landed later on each rank under the same id; a rank that cannot load one (no file yet) never
serves another version's bytes under its id.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.device_versions import committed, device_known, landed_known
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, KnownVersion, content_version, read_adapter
from lora_cache.adapters.pushed import PushArea, digest
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import write_adapter
from lora_cache.errors import ConfigError, LoraCacheError, NotFoundError
from lora_cache.vocab import AdapterKey
from workers.attach.versions import (
    COLUMNS,
    CUR,
    CUR_NEG,
    FAILED,
    RDY,
    RDY_NEG,
    STEP,
    AdapterVersions,
    RankVersions,
    Readiness,
    ReducedVersions,
    reduce_min,
    version_code,
)
from workers.cache import WorkerCache, WorkerConfig
from workers.engine.admission import ADMISSION
from workers.engine.config import EngineConfig
from workers.engine.engine import NamedRows
from workers.engine.rank import RankEngine, slot_digest
from workers.engine.scheduler import PREFILL, STOP, WAIT, Item, Scheduler, StepPlan, _Live
from workers.engine.tp import Comm
from workers.engine.workload import Request
from workers.reads.shard import read_shard
from workers.staging.host_config import HostTierConfig

TINY = SHAPES["tiny"]
NAMES = ("a", "b", "c")
VERSIONS = 3  # directories per name: name-v0, name-v1, name-v2 (different weights)
TP = 2


def make_versions(root: Path) -> None:
    for n, name in enumerate(NAMES):
        for v in range(VERSIONS):
            write_adapter(root / f"{name}-v{v}", TINY, 8 if v % 2 else 16, 16.0, list(MODULE_ORDER), torch.float32,
                          torch.Generator().manual_seed(100 * n + v))


def test_version_codes_are_nonzero_and_distinct() -> None:
    codes = {version_code(f"{i:016x}") for i in range(10_000)}
    assert len(codes) == 10_000 and min(codes) > 0 and max(codes) < 2**63


def test_the_catalog_keeps_older_versions_only_from_their_own_files(tmp_path: Path) -> None:
    make_versions(tmp_path)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16, keep_versions=1))
    v0 = catalog.register("a", tmp_path / "a-v0").version
    v1 = catalog.register("a", tmp_path / "a-v1").version
    assert catalog.get("a", v0).path.name == "a-v0" and catalog.versions("a") == [v0, v1]
    v2 = catalog.register("a", tmp_path / "a-v2").version
    assert catalog.versions("a") == [v1, v2]  # keep_versions=1: v0 is no longer loadable
    with pytest.raises(NotFoundError, match="keep_versions"):
        catalog.get("a", v0)
    shutil.copytree(tmp_path / "a-v0", tmp_path / "a-v2", dirs_exist_ok=True)  # rewritten in place
    assert catalog.register("a", tmp_path / "a-v2").version == v0
    assert catalog.versions("a") == [v1, v0], "the rewritten directory's old version (v2) is gone"
    generation = catalog.generation
    catalog.unregister("a")
    assert catalog.generation == generation + 1
    with pytest.raises(NotFoundError):
        catalog.get("a", v1)


def test_an_older_version_in_use_outlives_the_bound_and_retires_once_its_use_ends(tmp_path: Path) -> None:
    """Retirement by use (issue 44 item 3): past ``keep_versions``, a version some user holds stays loadable; a
    ``trim`` after its use ended retires it; the newest ``keep_versions`` older ones stay whatever their use; a
    version rewritten in place goes at once (its bytes are gone); a user that leaves keeps nothing."""
    make_versions(tmp_path)
    for n in range(3, 5):
        shutil.copytree(tmp_path / f"a-v{n % 3}", tmp_path / f"a-v{n}")
        (tmp_path / f"a-v{n}" / "adapter_config.json").write_text(
            (tmp_path / f"a-v{n}" / "adapter_config.json").read_text().replace("{", f'{{"x": {n}, ', 1))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16, keep_versions=1))
    held: set[str] = set()

    def in_use(name: str) -> set[str]:
        return held if name == "a" else set()

    catalog.use(in_use)
    v = [catalog.register("a", tmp_path / f"a-v{n}").version for n in range(2)]
    held.add(v[0])  # a rank's slot holds v0 (a request admitted on it)
    v += [catalog.register("a", tmp_path / f"a-v{n}").version for n in range(2, 5)]
    assert len(set(v)) == 5
    assert catalog.versions("a") == [v[0], v[3], v[4]], "v0 in use, v3 the one kept by the bound, v4 current"
    assert catalog.get("a", v[0]).version == v[0]
    assert catalog.trim("a") == [] and catalog.versions("a") == [v[0], v[3], v[4]], "still in use: kept"
    held.clear()
    generation = catalog.generation
    assert catalog.trim("a") == [v[0]] and catalog.versions("a") == [v[3], v[4]]
    assert catalog.generation == generation + 1 and catalog.trim("a") == []
    with pytest.raises(NotFoundError, match="keep_versions"):
        catalog.get("a", v[0])
    held.add(v[3])
    catalog.register("a", tmp_path / "a-v4")  # the same version again: nothing moves
    assert catalog.versions("a") == [v[3], v[4]]
    shutil.copytree(tmp_path / "a-v0", tmp_path / "a-v3", dirs_exist_ok=True)  # v3's files rewritten in place
    (tmp_path / "a-v3" / "adapter_config.json").write_text((tmp_path / "a-v0" / "adapter_config.json").read_text())
    assert catalog.register("a", tmp_path / "a-v3").version == v[0]
    assert catalog.versions("a") == [v[4], v[0]], "v3's bytes are gone even though it was in use"
    held.add(v[4])
    catalog.unuse(in_use)
    catalog.unuse(in_use)  # twice: nothing
    catalog.register("a", tmp_path / "a-v1")
    assert catalog.versions("a") == [v[0], v[1]], "v4 was held by a user that left: retired by the bound"


def view_of(*ranks: dict[str, tuple[str | None, str | None]], failed: str = "", step: str = "") -> ReducedVersions:
    """The replica view of ranks that each name, per adapter, (current version, READY version); an adapter a
    rank does not name is not registered there."""
    names = ("a", "b")
    reports = []
    for k, rank in enumerate(ranks):
        codes = np.zeros((len(names), COLUMNS), dtype=np.int64)
        for i, name in enumerate(names):
            cur, rdy = (version_code(v) if v else 0 for v in rank.get(name, (None, None)))
            codes[i, [CUR, CUR_NEG, RDY, RDY_NEG]] = cur, -cur, rdy, -rdy
            codes[i, FAILED] = -(k == 0 and name == failed)
            codes[i, STEP] = -(k == 1 and name == step)
        reports.append(torch.from_numpy(codes))
    known = {version_code(v): v for v in ("v0", "v1", "v2")}
    return ReducedVersions(reduce_min(reports), names, known)


def test_loading_means_the_current_version_ready_or_its_copy_issued_on_every_rank(tmp_path: Path) -> None:
    """What ``pipelined`` admits on (issue 31): LOADING only where every rank has the current version READY or
    its copy issued (``WorkerCache.issued_keys``), and the version served is that one; a rank still reading,
    or copying an older version, keeps the adapter NOT_READY."""
    make_versions(tmp_path)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16))
    old = AdapterKey("a", catalog.register("a", tmp_path / "a-v0").version)
    new = AdapterKey("a", catalog.register("a", tmp_path / "a-v1").version)
    catalog.register("b", tmp_path / "b-v0")
    ranks = [RankVersions(catalog, ("a", "b")) for _ in range(TP)]

    def view(ready: list[set[AdapterKey]], issued: list[set[AdapterKey]]) -> ReducedVersions:
        rows = [r.rows(ready[k], (), (), issued[k]) for k, r in enumerate(ranks)]
        return ReducedVersions(reduce_min(rows), ("a", "b"), ranks[0].codes)

    copying = view([set(), {new}], [{new}, set()])  # READY on rank 1, its copy issued on rank 0
    assert copying.readiness() == {"a": Readiness.LOADING} and copying.versions()["a"].serve == new.version
    assert view([set(), set()], [{new}, set()]).readiness() == {}  # rank 1 still reading it
    assert view([set(), set()], [{old}, {old}]).readiness() == {}  # an older version's copy: not the current
    assert view([{new}, {new}], [set(), set()]).readiness() == {"a": Readiness.READY}
    assert view([{new}, {new}], [set(), set()]).readiness() == view([{new}, {new}], [{new}, {new}]).readiness()


def test_a_device_version_loadable_from_its_image_only_is_served_to_no_request_until_its_image_load_is_issued(
        tmp_path: Path) -> None:
    """A device push's version, current on every rank but its node copy not landed (``image_only``), cannot be loaded
    on demand: a request admitted on it failed at its step (measured on one H100 at a trainer's first push,
    bench/reports/issue-44.md). Until its image load is issued or READY on every rank the replica serves the older
    version where that is READY everywhere, else nothing (its requests wait, as for a registration on its way); then
    it; once landed, the current version is served on demand again."""
    make_versions(tmp_path)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16,
                                           push_dir=str(tmp_path / "pushed")))
    area = PushArea(tmp_path / "pushed", "svc", 1 << 30)
    old = AdapterKey("a", catalog.register("a", tmp_path / "a-v0").version)
    catalog.register("b", tmp_path / "b-v0")
    raw = (tmp_path / "a-v1" / WEIGHTS_FILE).read_bytes()
    known = device_known("a", "1", (tmp_path / "a-v1" / CONFIG_FILE).read_bytes(),
                         raw[:8 + int.from_bytes(raw[:8], "little")], len(raw))
    catalog.add(catalog.read("a", str(area.path("a", "1")), known))
    new = AdapterKey("a", known.version)
    assert catalog.current("a") == new.version and catalog.get("a").device_only
    ranks = [RankVersions(catalog, ("a", "b")) for _ in range(TP)]

    def view(ready: list[set[AdapterKey]], issued: list[set[AdapterKey]] | None = None) -> ReducedVersions:
        rows = [r.rows(ready[k], (), (), (issued or [set()] * TP)[k]) for k, r in enumerate(ranks)]
        return ReducedVersions(reduce_min(rows), ("a", "b"), ranks[0].codes)

    older_ready = view([{old}, {old}])
    assert older_ready.versions()["a"].serve == old.version and older_ready.readiness() == {"a": Readiness.READY}
    nothing = view([set(), set()])  # no version READY everywhere: before, the image-only one was served on demand
    assert nothing.versions()["a"].serve is None and nothing.readiness() == {}
    assert view([set(), {new}]).versions()["a"].serve is None  # READY on one rank only
    loading = view([set(), {new}], [{new}, set()])  # READY on one, its image load issued on the other
    assert loading.versions()["a"] == AdapterVersions(new.version, new.version)
    assert loading.readiness() == {"a": Readiness.LOADING}
    assert view([{new}, {new}]).versions()["a"].serve == new.version
    written, _ = area.write("a", "1", (tmp_path / "a-v1" / CONFIG_FILE).read_bytes(), np.frombuffer(raw, np.uint8))
    assert catalog.promote(catalog.read("a", str(written), landed_known(
        digest((tmp_path / "a-v1" / CONFIG_FILE).read_bytes(), np.frombuffer(raw, np.uint8)), written, known)))
    assert not catalog.get("a").device_only
    assert view([set(), set()]).versions()["a"] == AdapterVersions(new.version, new.version)  # on demand again


def test_a_name_added_at_run_time_waits_for_every_rank_then_serves_its_one_version(tmp_path: Path) -> None:
    """The exchange grows (``RankVersions.append``, every rank at one round): a name not registered yet on a rank
    is PENDING there, so the replica waits for it (NOT_READY, no version), never FAILED; once every rank has it,
    its one version; a rank that had it and lost it (unregistered) fails it, as for names known at build. A name
    added this round has no version until the next exchange (its requests wait a round)."""
    make_versions(tmp_path)
    catalogs = [AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16))
                for _ in range(TP)]
    for catalog in catalogs:
        catalog.register("a", tmp_path / "a-v0")
    ranks = [RankVersions(catalog, ("a",)) for catalog in catalogs]

    def view() -> ReducedVersions:
        rows = [r.rows(set()) for r in ranks]
        assert all(r.names == ranks[0].names for r in ranks)
        return ReducedVersions(reduce_min(rows), ranks[0].names, ranks[0].codes)

    assert view().versions()["b"] == AdapterVersions(None, None)  # not in the exchange (yet)
    b = catalogs[0].register("b", tmp_path / "b-v0").version  # rank 0 has it; rank 1's registration on its way
    for r in ranks:
        r.append(["b"])
    with pytest.raises(ValueError, match="in the version exchange already"):
        ranks[0].append(["b"])
    waiting = view()
    assert waiting.readiness() == {} and waiting.versions()["b"] == AdapterVersions(None, None)
    catalogs[1].register("b", tmp_path / "b-v0")
    agreed = view()
    assert agreed.readiness() == {} and agreed.versions()["b"] == AdapterVersions(b, b)
    key = AdapterKey("b", b)
    rows = [r.rows({key}) for r in ranks]
    assert ReducedVersions(reduce_min(rows), ranks[0].names, ranks[0].codes).readiness() == {"b": Readiness.READY}
    catalogs[1].unregister("b")  # had it, lost it: no new use
    assert view().readiness() == {"b": Readiness.FAILED}


def test_a_request_whose_ranks_agree_on_no_version_fails_alone_after_agree_timeout(tmp_path: Path) -> None:
    """A registration that reached rank 0 only (its requests wait: PENDING on rank 1) does not hold the stream
    for ever: after ``agree_timeout_s`` of waiting, the request fails alone with an error naming the adapter and
    the fix; one whose registration reaches every rank in time is admitted at that version."""
    make_versions(tmp_path)
    catalogs = [AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16))
                for _ in range(TP)]
    ranks = [RankVersions(catalog, ()) for catalog in catalogs]
    b = catalogs[0].register("b", tmp_path / "b-v0").version
    catalogs[0].register("c", tmp_path / "c-v0")
    for r in ranks:
        r.append(["b", "c"])
    config = EngineConfig(model="tiny", device="cpu", num_slots=3, max_adapters=2, max_running=3, max_seq_len=32,
                          max_prefill_tokens=24, agree_timeout_s=5.0)
    scheduler = Scheduler(config, ADMISSION["ondemand"](), [Request(0, "b", 3, 1), Request(1, "c", 3, 1)])

    def plan(now: float) -> tuple[str, tuple[int, ...]]:
        view = ReducedVersions(reduce_min([r.rows(set()) for r in ranks]), ranks[0].names, ranks[0].codes)
        p = scheduler.plan(now, view.readiness(), view.versions())
        scheduler.finish_step(p, now, 0.0)  # one output token: done at its prefill
        return p.kind, tuple(it.rid for it in p.items)

    assert plan(0.0) == (WAIT, ())
    assert plan(4.0) == (WAIT, ()) and scheduler.take_finished() == []
    catalogs[1].register("b", tmp_path / "b-v0")  # reaches rank 1 in time; c never does
    assert plan(4.5) == (PREFILL, (0,)) and scheduler.live[0].version == b
    assert plan(5.0) == (STOP, ())  # c waited 5 s: it fails alone, and the run can end
    assert scheduler.take_finished() == [0, 1]
    error = scheduler.live[1].error
    assert error is not None and "'c': the TP ranks' catalogs agreed on no version of it for 5 s" in error
    with pytest.raises(ConfigError, match="agree_timeout_s must be >= 0"):
        EngineConfig(model="tiny", device="cpu", agree_timeout_s=-1)


def test_the_replica_serves_a_version_only_when_every_rank_agrees() -> None:
    both = view_of({"a": ("v1", "v1"), "b": ("v0", None)}, {"a": ("v1", "v1"), "b": ("v0", None)})
    assert both.readiness() == {"a": Readiness.READY}
    assert both.versions()["a"] == AdapterVersions("v1", "v1")
    assert both.versions()["b"] == AdapterVersions("v0", "v0"), "cold: served at the agreed current version"
    # rank 1 has the new version current and READY, rank 0 not yet: the old one, READY on both, is served
    moving = view_of({"a": ("v0", "v0")}, {"a": ("v1", "v1")})
    assert "a" not in moving.readiness() and moving.versions()["a"] == AdapterVersions(None, None)
    upgrading = view_of({"a": ("v1", "v0")}, {"a": ("v1", "v0")})
    assert upgrading.readiness()["a"] is Readiness.READY
    assert upgrading.versions()["a"] == AdapterVersions("v0", "v1")
    failed = view_of({"a": ("v1", None)}, {"a": ("v1", "v1")}, failed="a", step="b")
    assert failed.readiness()["a"] is Readiness.FAILED and failed.step_failures() == {"b"}
    upgrade_failed = view_of({"a": ("v1", "v0")}, {"a": ("v1", "v0")}, failed="a")
    assert upgrade_failed.readiness()["a"] is Readiness.READY, "a version READY everywhere is still served"
    gone = view_of({"a": ("v1", "v1")}, {})  # unregistered on rank 1 (b: on both)
    assert gone.readiness() == {"a": Readiness.FAILED, "b": Readiness.FAILED}


class VersionsMachine(RuleBasedStateMachine):
    """Rounds of a two-rank replica while adapters are re-registered one rank at a time."""

    admission = "ondemand"
    record = staticmethod(event)  # hypothesis' event counter (a test outside hypothesis sets its own)

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lora-cache-versions-"))
        make_versions(self.root)
        config = CatalogConfig(adapter_roots=(str(self.root),), model="tiny", max_rank=16, keep_versions=1,
                               push_dir=str(self.root / "pushed"))
        self.area = PushArea(self.root / "pushed", "svc", 1 << 30)
        self.pushed: dict[tuple[str, int], KnownVersion] = {}  # a device push of name-v{i}: its version, one per draw
        self.aheads: set[tuple[str, int]] = set()  # those registered ahead of their push (``DeviceSource.ahead``)
        self.committed: set[tuple[str, int]] = set()  # of those, the ones whose commit came (to some rank)
        self.landed: dict[tuple[str, int], KnownVersion] = {}  # its node copy's proof, once written
        self.catalogs = [AdapterCatalog(config) for _ in range(TP)]
        for catalog in self.catalogs:
            for name in NAMES:
                catalog.register(name, self.root / f"{name}-v0")
        self.caches = [WorkerCache(WorkerConfig(num_slots=3, tp=TP, tp_rank=k, dtype="float32", device="cpu",
                                                host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False)),
                                   self.catalogs[k]) for k in range(TP)]
        self.reports = [RankVersions(self.catalogs[k], NAMES) for k in range(TP)]
        engine = EngineConfig(model="tiny", device="cpu", num_slots=3, max_adapters=2, max_running=3,
                              max_prefill_tokens=16, max_seq_len=16, max_rank=16, admission=self.admission)
        self.scheduler = Scheduler(engine, ADMISSION[self.admission](), [])
        self.pins: list = [None] * TP
        self.step_failed: list[set[str]] = [set() for _ in range(TP)]
        self.expected: dict[tuple[AdapterKey, int], str] = {}  # (version, rank) -> digest of its shard
        self.admitted: dict[int, str] = {}  # rid -> the version it was admitted with
        self.named: dict[int, str] = {}  # rid -> the version its request named (``A@VERSION``)
        self.dirs = {AdapterKey(n, content_version(self.root / f"{n}-v{i}")): self.root / f"{n}-v{i}"
                     for n in NAMES for i in range(VERSIONS)}
        self.now, self.rid, self.steps, self.checked = 0.0, 0, 0, 0
        self.plan = self.scheduler.plan(0.0, {}, None)

    def teardown(self) -> None:
        for k, cache in enumerate(self.caches):
            if self.pins[k] is not None:
                cache.release(self.pins[k])
            cache.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- inputs ------------------------------------------------------------------------------------------
    @rule(name=st.sampled_from(NAMES), length=st.integers(1, 4), out=st.integers(1, 4))
    def arrive(self, name: str, length: int, out: int) -> None:
        request = Request(self.rid, name, length, out, self.now)
        self.scheduler.live[request.rid] = _Live(request)
        self.scheduler.pending.append(request)
        self.rid += 1

    @rule(name=st.sampled_from(NAMES), pick=st.integers(0, VERSIONS), length=st.integers(1, 4),
          out=st.integers(1, 4))
    def arrive_named(self, name: str, pick: int, length: int, out: int) -> None:
        """A request naming one version (``A@VERSION``, issue 44 item 3), one rank 0's catalog keeps (the submit
        resolves it there): a row of its own in the exchange, appended on every rank as the engine's take does."""
        versions = self.catalogs[0].versions(name)
        ref = f"{name}@{versions[pick % len(versions)]}"
        if ref not in self.reports[0].index:
            for report in self.reports:
                report.append([ref])
        self.named[self.rid] = versions[pick % len(versions)]
        self.arrive(ref, length, out)

    @rule()
    def drop_idle_rows(self) -> None:
        """Rank 0 drops every named row no request uses (``NamedRows`` keeping none idle, the harshest), every rank
        the same rows at the same round, as the engine's loop does with its plan's ``dropped``."""
        dropped = NamedRows(keep=0).dropped(self.reports[0].named, self.scheduler.named_in_use())
        for report in self.reports:
            report.drop(dropped)
        if dropped:
            self.record("idle named rows dropped")

    @rule(name=st.sampled_from(NAMES), version=st.integers(0, VERSIONS - 1), rank=st.integers(0, TP - 1))
    def reregister(self, name: str, version: int, rank: int) -> None:
        """Registration reaches one rank now, the other later (or never, until drawn)."""
        self.catalogs[rank].register(name, self.root / f"{name}-v{version}")

    @rule(name=st.sampled_from(NAMES), version=st.integers(0, VERSIONS - 1), rank=st.integers(0, TP - 1),
          ring=st.booleans(), ahead=st.booleans())
    def push_device(self, name: str, version: int, rank: int, ring: bool, ahead: bool = False) -> None:
        """A trainer's device push of ``name-v{version}``'s bytes (``DevicePushes.push``): its id minted once, then
        registered device-only on one rank now (the other later, or never), and (``ring``) that rank takes its shard
        from the image (its doorbell). A host load of it is refused there until it lands. ``ahead`` (at its first
        draw): registered ahead of its push (``DevicePushes.reserve``), held by exact version and current nowhere
        until its commit (``commit``)."""
        key = (name, version)
        if key not in self.pushed:
            directory = self.root / f"{name}-v{version}"
            raw = (directory / WEIGHTS_FILE).read_bytes()
            head = raw[:8 + int.from_bytes(raw[:8], "little")]
            self.pushed[key] = known = device_known(name, f"t{version}", (directory / CONFIG_FILE).read_bytes(),
                                                    head, len(raw), ahead)
            self.dirs[AdapterKey(name, known.version)] = directory
            if ahead:
                self.aheads.add(key)
        waiting = key in self.aheads and key not in self.committed  # registered ahead, not yet committed
        known = self.landed.get(key, committed(self.pushed[key]) if key in self.committed else self.pushed[key])
        catalog, path = self.catalogs[rank], str(self.area.path(name, f"t{version}"))
        try:
            current = catalog.get(name, known.version)
        except NotFoundError:
            current = None
        if current is None and waiting:
            if name not in catalog:
                return  # a version is registered ahead of a registered name's next push only
            before = catalog.current(name)
            catalog.ahead.reserve(catalog.read(name, path, known))
            assert catalog.current(name) == before, "a version registered ahead became current"
            self.record("a device push registered ahead")
        elif current is None:
            catalog.add(catalog.read(name, path, known))
        elif current.device_only and key in self.landed:  # its landing (``WorkerControl._land``)
            catalog.promote(catalog.read(name, path, known))
        if ring and catalog.get(name, known.version).device_only:
            raw = (self.dirs[AdapterKey(name, known.version)] / WEIGHTS_FILE).read_bytes()
            image = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self.caches[rank].load_image(name, known.version, image, raw[:8 + int.from_bytes(raw[:8], "little")])
            self.caches[rank].settle()
            self.record("a device push taken from the image")

    @rule(name=st.sampled_from(NAMES), version=st.integers(0, VERSIONS - 1), rank=st.integers(0, TP - 1))
    def commit(self, name: str, version: int, rank: int) -> None:
        """The commit of a device push registered ahead (``DevicePushes.commit``): the same version registered again
        without the flag, one rank at a time, current there (``WorkerControl._land``); a rank that never had it
        registered ahead takes it as a registration."""
        key = (name, version)
        if key not in self.aheads or key in self.landed:
            return
        self.committed.add(key)
        known = committed(self.pushed[key])
        catalog = self.catalogs[rank]
        try:
            if catalog.current(name) == known.version:
                return
        except NotFoundError:
            pass
        catalog.add(catalog.read(name, str(self.area.path(name, f"t{version}")), known))
        assert catalog.current(name) == known.version and not catalog.ahead.has(name, known.version)
        self.record("a device push committed")

    @rule(name=st.sampled_from(NAMES), version=st.integers(0, VERSIONS - 1), rank=st.integers(0, TP - 1))
    def land(self, name: str, version: int, rank: int) -> None:
        """The node copy of a device push lands (``DevicePushes.land``): written and proven once, then promoted on one
        rank at a time, in place (the current version unchanged); one registered ahead only once committed."""
        key = (name, version)
        if key not in self.pushed or (key in self.aheads and key not in self.committed):
            return
        if key not in self.landed:
            directory = self.root / f"{name}-v{version}"
            config, raw = (directory / CONFIG_FILE).read_bytes(), (directory / WEIGHTS_FILE).read_bytes()
            written, _ = self.area.write(name, f"t{version}", config, raw)
            self.landed[key] = landed_known(digest(config, raw), written, self.pushed[key])
        catalog = self.catalogs[rank]
        try:
            held = catalog.get(name, self.pushed[key].version)
        except NotFoundError:
            return  # retired here (or never registered on this rank): nothing to land
        if held.device_only:
            before = catalog.current(name)
            assert catalog.promote(catalog.read(name, str(self.area.path(name, f"t{version}")), self.landed[key]))
            assert catalog.current(name) == before, "a landing changed the current version"
            self.record("a device push landed")

    @rule(name=st.sampled_from(NAMES), rank=st.integers(0, TP - 1))
    def evict(self, name: str, rank: int) -> None:
        """LRU pressure: every idle version of ``name`` leaves the rank (its old ones may not come back)."""
        for r in self.caches[rank].residency():
            if r["adapter"] == name:
                self.caches[rank].evict(name, str(r["version"]))

    # -- one round of the engine ------------------------------------------------------------------------------
    @rule()
    def rounds(self) -> None:
        """A few rounds back to back (steps outnumber the other inputs, as in an engine)."""
        for _ in range(3):
            self.round()

    @rule(window=st.booleans())
    def round(self, window: bool = False) -> None:
        self.now += 0.01
        for k, cache in enumerate(self.caches):  # RankEngine.readiness: pin the wanted, report (fenced)
            pinned = cache.acquire_ready(self.plan.wanted)
            if self.pins[k] is not None:
                cache.release(self.pins[k])
            self.pins[k] = pinned
        reports = [self.reports[k].rows(self.caches[k].ready_keys(fence=True), (), self.step_failed[k])
                   for k in range(TP)]
        if window:  # the controller's evictions between the report and the step: nothing offered leaves
            for cache in self.caches:
                for r in cache.residency():
                    assert not cache.evict(str(r["adapter"]), str(r["version"])), f"{r} left under the fence"
            self.record("evictions between the report and the step")
        self.step_failed = [set() for _ in range(TP)]
        view = ReducedVersions(reduce_min(reports), self.reports[0].names, self.reports[0].codes)
        if failed := view.step_failures():
            self.scheduler.fail_step(failed)
            self.record("a rank could not hold a version: its requests failed")
        self.plan = plan = self.scheduler.plan(self.now, view.readiness(), view.versions())
        self.record(f"plan {plan.kind}")
        if plan.kind in (WAIT, STOP):
            for cache in self.caches:
                cache.unfence()
                self._prefetch(cache, plan.prefetch)
                cache.settle()
            return
        self._step(plan, view)

    def _step(self, plan, view: ReducedVersions) -> None:
        named = [it.ref for it in plan.items if it.ref is not None]
        for k, cache in enumerate(self.caches):  # RankEngine.execute: pin the plan's wanted, then lift the fence
            pinned = cache.acquire_ready(plan.wanted)
            if self.pins[k] is not None:
                cache.release(self.pins[k])
            self.pins[k] = pinned
            cache.unfence()
        batches = [cache.acquire(named + list(plan.hold), partial=True) for cache in self.caches]
        for it in plan.items:
            if it.adapter is None:
                continue
            assert isinstance(it.ref, AdapterKey), "every item names one exact version"
            if plan.kind == PREFILL:
                assert it.rid not in self.admitted
                self.admitted[it.rid] = it.version
                v = view.versions()[it.adapter]
                if view.readiness().get(it.adapter) is Readiness.READY:  # served: READY on every rank
                    assert v.serve == it.version
                self.record("admitted at the current version" if v.current == it.version else
                      "admitted at an older version (the current one not READY everywhere)"
                      if v.current is not None else "admitted while the ranks' catalogs disagree")
            assert self.admitted[it.rid] == it.version, "a request changed version mid-flight"
            if it.rid in self.named:
                assert it.ref == AdapterKey(it.adapter.partition("@")[0], self.named[it.rid]), "not the version named"
                self.record("a request naming its version ran")
            held = []
            for k, batch in enumerate(batches):
                slot = dict(zip(batch.adapters, batch.slots))[it.ref]
                key = dict(zip(batch.adapters, batch.keys))[it.ref]
                if slot < 0:
                    self.step_failed[k].add(it.adapter)
                    continue
                assert key == it.ref, f"rank {k} computed {it.ref} with {key}"
                got = slot_digest(self.caches[k].shard(slot))  # the shard's own elements, from its first page
                assert got == self._expected(key, k), f"rank {k} slot {slot} does not hold {key}'s bytes"
                held.append(k)
                self.checked += 1
            self.record(f"item held on {len(held)} of {TP} ranks")
        for cache, batch in zip(self.caches, batches):
            self._prefetch(cache, plan.prefetch)
            cache.release(batch)
            cache.settle()
        self.scheduler.finish_step(plan, self.now, 0.0)
        self.steps += 1

    def _prefetch(self, cache: WorkerCache, refs: tuple) -> None:
        """As ``RankEngine._prefetch``: a load this rank cannot start (a version it does not know; a device push's
        not landed here) fails alone, and the round goes on."""
        for ref in refs:
            try:
                cache.prefetch(ref.name, ref.version) if isinstance(ref, AdapterKey) else cache.prefetch(ref)
            except NotFoundError:
                self.record("prefetch of a version this rank does not know")
            except LoraCacheError:
                self.record("prefetch of a device push not landed here: refused")

    def _expected(self, key: AdapterKey, rank: int) -> str:
        """The digest of ``rank``'s shard of exactly ``key``, read from that version's own files."""
        if (key, rank) not in self.expected:
            spec = read_adapter(key.name, self.dirs[key], TINY, 16)
            # a device push's id is minted, not its content's hash: its bytes are its directory's by construction
            assert spec.version == key.version or (key.name, key.version) in {
                (n, k.version) for (n, _), k in self.pushed.items()}
            layout = shard_layout(spec, TINY, TP, rank, torch.float32)
            staged = torch.empty(layout.numel, dtype=layout.dtype)
            read_shard(spec, layout, staged)
            self.expected[(key, rank)] = slot_digest(staged)
        return self.expected[(key, rank)]

    # -- invariants -----------------------------------------------------------------------------------------
    @invariant()
    def caches_are_consistent(self) -> None:
        for cache in self.caches:
            cache.check_integrity()

    @invariant()
    def a_version_in_a_slot_stays_loadable_and_only_those_outlive_the_bound(self) -> None:
        """Retirement by use (issue 44 item 3): every version a slot of a rank holds is loadable from that rank's
        catalog; of the older versions past ``keep_versions`` (1 here), each is one a slot holds."""
        for cache, catalog in zip(self.caches, self.catalogs):
            held = {(str(r["adapter"]), str(r["version"])) for r in cache.residency()}
            for name, version in held:
                assert catalog.get(name, version).version == version, f"{name}@{version} is held but not loadable"
            for name in NAMES:
                older = catalog.versions(name)[:-1]
                for version in older[: max(0, len(older) - 1)]:
                    assert (name, version) in held, f"{name}@{version} is past keep_versions and held by no slot"

    @invariant()
    def the_named_rows_are_those_of_the_exchange_in_its_order(self) -> None:
        """``RankVersions.named`` (what ``NamedRows`` reads, not every name) follows the appends and drops."""
        for report in self.reports:
            assert report.named == [n for n in report.names if "@" in n]

    @invariant()
    def failed_requests_never_report_tokens_as_ok(self) -> None:
        for record in self.scheduler.records():
            if record.error is not None:
                assert not record.ok


class OverlapVersionsMachine(VersionsMachine):
    admission = "overlap"


TestVersionsOnDemand = VersionsMachine.TestCase
TestVersionsOnDemand.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestVersionsOverlap = OverlapVersionsMachine.TestCase
TestVersionsOverlap.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_a_rank_that_cannot_hold_the_admitted_version_fails_the_request_never_uses_another() -> None:
    """Rank 1 learns of two re-registrations (keep_versions=1: the admitted version is past the bound, loadable
    only while a slot there holds it) and loses the admitted version's slot between two steps (forced): the
    version retires, its next step holds nothing for the request (slot -1, never the current version), and the
    request fails at the next round."""
    m = VersionsMachine()

    def no_event(_: str) -> None:  # outside hypothesis: no event counter
        return None

    m.record = no_event  # type: ignore[method-assign,assignment]
    try:
        m.arrive("a", 2, 3)
        m.round()
        assert m.plan.kind == PREFILL
        (admitted,) = [it.ref for it in m.plan.items]
        assert isinstance(admitted, AdapterKey)
        m.reregister("a", 1, rank=1)
        m.reregister("a", 2, rank=1)
        # past keep_versions, the admitted version stays loadable while a slot here holds it (retired by use) ...
        assert m.catalogs[1].get("a", admitted.version).version == admitted.version
        m.evict("a", rank=1)
        assert all(r["adapter"] != "a" for r in m.caches[1].residency())
        with pytest.raises(NotFoundError):  # ... and retires once no slot does
            m.catalogs[1].get("a", admitted.version)
        m.round()  # a decode step: rank 1 holds nothing for the request
        assert m.plan.kind != PREFILL and m.step_failed[1] == {"a"} and not m.step_failed[0]
        assert all(r["version"] != m.catalogs[1].get("a").version for r in m.caches[1].residency()
                   if r["adapter"] == "a"), "rank 1 loaded its current version instead"
        m.round()
        (record,) = m.scheduler.records()
        assert record.error is not None and "could not be held on every TP rank" in record.error and not record.ok
        assert record.version == admitted.version and not m.scheduler.running
    finally:
        m.teardown()


def test_what_a_rank_reports_ready_stays_until_the_round_holds_it_so_an_admitted_older_version_never_retires(
        tmp_path: Path) -> None:
    """The window between a rank's report and its step (the Ray push test's one failure): ``a``'s older version
    v0, past ``keep_versions`` (loadable only while a slot holds it), is READY and offered for admission; the
    controller's evict of it, or a load that needs its room, comes before the step. Under the report's fence the
    evict is refused and the load waits; the step holds v0 for the request admitted on it (no rank failure), and
    once the round holds what it runs the load takes the other idle slot. Without the fence the evict frees v0's
    slot, v0 retires, and the request fails on this rank."""
    make_versions(tmp_path)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16, keep_versions=1))
    v0 = catalog.register("a", tmp_path / "a-v0").version
    for name in ("b", "c"):
        catalog.register(name, tmp_path / f"{name}-v0")
    cache = WorkerCache(WorkerConfig(num_slots=2, dtype="float32", device="cpu", max_batch=8,
                                     host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False)), catalog)
    config = EngineConfig(model="tiny", device="cpu", num_slots=2, max_adapters=2, max_running=3,
                          max_prefill_tokens=16, max_seq_len=16, max_rank=16, audit_steps=True)
    engine = RankEngine(config, Comm(), cache=cache)
    try:
        cache.prefetch("a").result(timeout=30)
        cache.prefetch("b").result(timeout=30)
        for n in (1, 2):
            catalog.register("a", tmp_path / f"a-v{n}")
        assert catalog.get("a", v0).version == v0, "past the bound, held by a slot: loadable"
        engine.readiness(())  # the report: v0 READY here
        assert not cache.evict("a", v0), "the controller's evict in the window is refused"
        load = cache.prefetch("c")  # needs a slot: waits for the fence, takes neither a@v0 nor b
        assert not load.done() and catalog.get("a", v0).version == v0
        admitted = AdapterKey("a", v0)
        engine.execute(StepPlan(PREFILL, (Item(0, "a", 0, 0, 3, v0),), (), (), (admitted,)))
        assert [step.keys for step in engine.stats.audit] == [(str(admitted),)], "the step held v0"
        assert load.result(timeout=30) is not None and AdapterKey("c", catalog.current("c")) in cache.ready_keys()
        assert admitted in cache.ready_keys() and "b" not in cache.ready_names(), "the load took b's idle slot"
        assert engine.readiness((admitted,))[0] is not None
        assert engine._step_failed == set() and not cache.evict("a", v0), "pinned while its request runs"
    finally:
        engine.close()
        cache.close()


def test_a_version_a_waiting_request_or_a_hint_names_is_kept_and_prefetched_then_retires(tmp_path: Path) -> None:
    """Issue 44 item 3: a queued request (``A@VERSION`` in the engine's queue report) or a hint naming an older
    version keeps it loadable past ``keep_versions`` and has it prefetched on that replica; once nothing names it,
    the next retirement round retires it. A version not kept only drops its own queue entry; a hint naming one is
    rejected alone."""
    import asyncio

    from lora_cache.controller.core import ControllerConfig, ControllerCore
    from lora_cache.controller.pushes import Pushes
    from lora_cache.planner import PlannerConfig, QueueEntry

    make_versions(tmp_path / "src")
    catalog = CatalogConfig(adapter_roots=(str(tmp_path / "src"),), model="tiny", max_rank=16, keep_versions=1,
                            push_dir=str(tmp_path / "pushes"))
    core = ControllerCore(ControllerConfig(catalog=catalog, planner=PlannerConfig(policy="queue")), epoch=3)
    core.add_replica("r0", tp=TP, slots=3)
    v = [core.register_adapter("a", str(tmp_path / "src" / "a-v0")),
         core.register_adapter("a", str(tmp_path / "src" / "a-v1"))]
    core.register_adapter("b", str(tmp_path / "src" / "b-v0"))
    core.report_queue("r0", [(f"a@{v[0]}", 1.0), ("b", 1.1), ("a@0000000000000000", 1.2)], now=1.2)
    assert core.planner.view.queue("r0") == (QueueEntry("a", 1.0, v[0]), QueueEntry("b", 1.1))
    outcome, = core.hint_batches([[("h1", f"a@{v[0]}", "r0", 5.0), ("h2", "a@nope", "r0", 5.0)]], now=1.2)
    assert outcome.accepted == 1 and [r.index for r in outcome.rejections] == [1]
    assert "'nope'" in str(outcome.rejections[0].error)
    v.append(core.register_adapter("a", str(tmp_path / "src" / "a-v2")))
    assert core.catalog.versions("a") == v, "v0 is past keep_versions 1 but a waiting request names it: kept"
    plan = core.planner.plan(1.3)
    got = {(c.adapter, c.version) for w in core.planner.view.workers("r0") if (cmd := plan.for_worker(w))
           for c in cmd.prefetches}
    assert ("a", v[0]) in got and ("b", core.catalog.get("b").version) in got, got
    pushes = Pushes(core, None, "svc")  # type: ignore[arg-type]
    assert asyncio.run(pushes.retire_released()) == [] and core.catalog.versions("a") == v, "named: kept"
    core.report_queue("r0", [("b", 1.1)], now=1.4)  # the named request was admitted and finished
    assert core.cancel_hint("h1", now=1.4)
    assert asyncio.run(pushes.retire_released()) == ["a"] and core.catalog.versions("a") == v[1:]
    assert core.named == set()
    core.check_integrity()


def test_idle_named_rows_leave_the_exchange_least_recently_used_first(tmp_path: Path) -> None:
    """Issue 44 item 3: every version a request names gets a row of the version exchange; rows no pending, waiting
    or running request names go once more than ``keep`` are idle, least recently used first, on every rank at
    once; the other rows keep their reports; a later request naming one appends it again."""
    make_versions(tmp_path)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16))
    v = [catalog.register("a", tmp_path / f"a-v{i}").version for i in range(VERSIONS)]
    catalog.register("b", tmp_path / "b-v0")
    report = RankVersions(catalog, ("a", "b"))
    named = [f"a@{x}" for x in v]
    report.append(named)
    rows = NamedRows(keep=1)
    assert rows.dropped(report.named, set(named)) == ()  # all in use
    assert rows.dropped(report.named, {named[2]}) == (named[0],), "two idle, one kept: the first to go"
    report.drop((named[0],))
    assert report.names == ["a", "b", named[1], named[2]] and report.index[named[2]] == 3
    assert report.named == [named[1], named[2]], "the named rows, kept apart in the exchange's order"
    got = report.rows([AdapterKey("a", v[2]), AdapterKey("a", v[1])]).numpy()
    assert got[report.index[named[1]], RDY] == version_code(v[1])
    assert got[report.index[named[2]], RDY] == version_code(v[2])
    assert got[report.index["a"], RDY] == version_code(v[2]), "the name's own row still says its current version"
    assert rows.dropped(report.named, set()) == (named[1],) and rows.last == {named[2]: rows.round - 1}
    report.drop((named[1],))
    with pytest.raises(ValueError, match="not in the version exchange"):
        report.drop((named[1],))
    report.append([named[0]])  # named again: a row of its own again
    assert report.names[-1] == named[0] and report.named == [named[2], named[0]]


def test_an_older_version_a_submitted_or_waiting_request_names_outlives_registrations_until_its_row_goes(
        tmp_path: Path) -> None:
    """Issue 44 item 3, the window between a submit and the load: a request pinned to ``a@v0`` (v0 past
    ``keep_versions`` once a newer version registers, no slot holding it yet) keeps v0 in the rank's catalog while it
    waits in the feed and then while a row of the version exchange names it (waiting for a lane or a load, on every
    rank: the rows come from rank 0's plan); once the row goes, v0 retires. Before, the registration retired v0 at
    once on a rank no slot of which held it, and the request, accepted, failed there."""
    from workers.engine.hosted import HostedEngine, Rendezvous

    make_versions(tmp_path)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16, keep_versions=1))
    v = [catalog.register("a", tmp_path / f"a-v{n}").version for n in range(2)]
    catalog.register("b", tmp_path / "b-v0")
    cache = WorkerCache(WorkerConfig(num_slots=2, dtype="float32", device="cpu", max_batch=8,
                                     host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False)), catalog)
    config = EngineConfig(model="tiny", device="cpu", num_slots=2, max_adapters=2, max_running=3,
                          max_prefill_tokens=16, max_seq_len=16, max_rank=16)
    hosted = HostedEngine(cache)
    users = len(catalog.retirement.users)
    try:
        hosted.build(config, Rendezvous("127.0.0.1", 0, 1), 0)
        engine, feed = hosted.engine, hosted.feed
        assert engine is not None and feed is not None
        hosted.submit([Request(1, f"a@{v[0]}", 3, 1), Request(2, "b", 3, 1)])
        v.append(catalog.register("a", tmp_path / "a-v2").version)  # v0 is now past the bound; no slot holds it
        assert catalog.versions("a") == v, "a submitted request names v0: kept"
        taken, _ = feed.take()
        assert [r.adapter for r in taken] == [f"a@{v[0]}", "b"]
        engine.add_names((f"a@{v[0]}",))  # the loop's take: a row of the exchange names v0 (every rank's plan)
        catalog.trim("a")
        assert catalog.versions("a") == v, "the row names v0: kept while its request waits for a lane or a load"
        assert cache.prefetch("a", v[0]).result(timeout=30).version == v[0], "and loadable"
        assert cache.evict("a", v[0])
        assert catalog.versions("a") == v, "its slot let go of it: the row still keeps it"
        engine.add_names((), dropped=(f"a@{v[0]}",))  # no request names it any more: the row goes, v0 retires
        assert catalog.versions("a") == v[1:] and catalog.current("a") == v[2]
        with pytest.raises(NotFoundError):
            catalog.get("a", v[0])
    finally:
        if hosted.engine is not None:
            hosted.engine.close()
        hosted.close()
        left = len(catalog.retirement.users)
        cache.close()
    assert left == users, "the engine and its feed stop naming versions once closed"


def test_a_rank_past_zero_retires_an_older_version_only_on_rank_0s_word(tmp_path: Path) -> None:
    """Issue 44 item 3, registrations reaching a TP replica's ranks one at a time: rank 0 alone admits requests, and
    accepts ``a@v0`` while its own catalog keeps v0. So rank 1's catalog, which took the registrations that put v0
    past ``keep_versions`` first, keeps v0 (loadable) until rank 0's catalog retires it and the round's plan says so
    (``Releases``); then it goes there too, unless a use of rank 1's own still names it. Rank 0's trims are what it
    sends, each once. Before, rank 1 retired v0 at its own registration, and a request rank 0 then admitted on v0
    failed on rank 1 (tests/test_feed.py runs it whole at TP 2)."""
    from workers.engine.releases import HELD_MAX, Releases

    make_versions(tmp_path)
    cat0, cat1 = (AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16,
                                               keep_versions=1)) for _ in range(2))
    held_here: set[str] = set()  # rank 1's own use (a slot holding a version)
    rank0, rank1 = Releases(cat0, 0, 2, lambda name: ()), Releases(cat1, 1, 2, lambda name: held_here)
    solo = Releases(AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16)), 0, 1,
                    lambda name: ())
    try:
        assert not solo.catalog.retirement.gates and not solo.catalog.retirement.watchers, "TP 1: no word to wait for"
        v = [cat1.register("a", tmp_path / f"a-v{n}").version for n in range(VERSIONS)]
        assert cat1.versions("a") == v, "rank 1 ran ahead: it holds what rank 0 has not retired"
        assert [cat0.register("a", tmp_path / f"a-v{n}").version for n in range(2)] == v[:2]
        assert rank0.take() == (), "rank 0 keeps v0 (within its bound): nothing to send; a request may take v0"
        assert cat1.get("a", v[0]).version == v[0], "rank 1 can load it for such a request"
        for n in range(2, VERSIONS):
            cat0.register("a", tmp_path / f"a-v{n}")
        retired = rank0.take()
        assert retired == tuple(f"a@{x}" for x in v[:-2]) and rank0.take() == (), "each of rank 0's trims, once"
        held_here.add(v[0])
        rank1.release(retired)
        assert cat1.versions("a") == [v[0], *v[-2:]], "released: gone from rank 1 but for its own use's"
        held_here.clear()
        cat1.trim("a")
        assert cat1.versions("a") == v[-2:], "its use over: rank 0 had said so already"
        assert rank1._released == {}, "nothing left to hold once gone"
    finally:
        for r in (rank0, rank1, solo):
            r.close()
    assert not cat0.retirement.watchers and not cat1.retirement.gates and not cat1.retirement.users, "closed"
    stale = [f"x{n}" for n in range(HELD_MAX + 6)]  # versions rank 0 never retires (it never had them): bounded
    assert rank1._gate("a", stale) == set(stale[:6]), "past HELD_MAX unused versions, the oldest go without a word"
