"""Device pushes' versions before and after their node copy lands (issue 44 item 5; CPU, no Ray): a version registered
from the trainer's declared image only (``device_versions``), taken by a rank from the image alone and never by a host
read, then landed under the same id, in place, whether it is still current or a newer version came meanwhile; the
planner never loads it and keeps it where it is held until it lands; the durable catalog never saves it; a relayed
registration carries it. The Ray path (a trainer's ``DevicePusher`` to a TP 2 replica) is tests/test_ray_push.py."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load

from lora_cache.adapters import pushed
from lora_cache.adapters.ahead import MAX_AHEAD
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.device_source import DeviceSource
from lora_cache.adapters.device_versions import (
    as_copy_of,
    committed,
    device_known,
    device_spec,
    host_readable,
    landed_known,
)
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec, KnownVersion
from lora_cache.adapters.pushed import PushArea, check_head, digest
from lora_cache.adapters.serialize import ImageLayout, image_and_head
from lora_cache.api import relay_codec
from lora_cache.controller.catalog_store import CatalogSnapshots, decode, entry_json
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.controller.device_pushes import AHEAD_LAND_TIMES, DevicePushes
from lora_cache.controller.fanout import RankAnswers, Sent
from lora_cache.controller.pushes import Pushes
from lora_cache.controller.registrations import Registrar
from lora_cache.errors import (
    AdapterChangedError,
    AdapterFormatError,
    AdapterPathError,
    ConflictError,
    NonFiniteWeightsError,
    NotFoundError,
)
from lora_cache.planner import (
    AdapterInfo,
    Planner,
    PlannerConfig,
    QueueEntry,
    ReplicaSpec,
    ResidencyEntry,
    SlotState,
)
from lora_cache.routing.advice import ready_s, residence
from lora_cache.routing.clock import LoadClock
from lora_cache.routing.ranking import Residence
from lora_cache.vocab import AdapterKey, WorkerId
from tests.test_image_loads import slot_bytes
from tests.test_registrations import Links
from workers.cache import WorkerCache, WorkerConfig
from workers.control.outbox import Outbox
from workers.control.rank import WorkerControl
from workers.staging.host_config import HostTierConfig

SERVICE = "svc"


class Push(NamedTuple):
    config: bytes
    tensors: dict[str, torch.Tensor]
    image: torch.Tensor
    head: bytes


@pytest.fixture
def source(tiny_adapters: Callable[..., list[Path]]) -> Path:
    return tiny_adapters(count=1, rank="8")[0]


def declared(source: Path, scale: float = 1.0) -> Push:
    """What a trainer declares and holds: the config, its tensors (scaled: another step's), their image and head."""
    tensors = {k: (v.float() * scale).to(v.dtype) for k, v in load((source / WEIGHTS_FILE).read_bytes()).items()}
    image, head = image_and_head(tensors, {"format": "pt"})
    return Push((source / CONFIG_FILE).read_bytes(), tensors, image, head)


def catalog_at(tmp_path: Path, push: str = "push") -> AdapterCatalog:
    """A catalog over the tiny adapters' root (``tiny_adapters``) and the push area ``tmp_path / push``."""
    roots = (str(tmp_path / "adapters"),)
    return AdapterCatalog(CatalogConfig(adapter_roots=roots, model="tiny", max_rank=16, push_dir=str(tmp_path / push)))


def area_of(catalog: AdapterCatalog) -> PushArea:
    return PushArea(catalog.push_root, SERVICE, 1 << 30)


def register_device(catalog: AdapterCatalog, push: Push, name: str, tag: str) -> KnownVersion:
    """The controller's step 1 on ``catalog``: checked, versioned, registered device-only."""
    check_head(name, push.config, push.head, push.image.numel(), catalog.shape, catalog.config.max_rank)
    known = device_known(name, tag, push.config, push.head, push.image.numel())
    catalog.add(catalog.read(name, str(area_of(catalog).path(name, tag)), known))
    return known


def land(catalog: AdapterCatalog, push: Push, name: str, tag: str, known: KnownVersion) -> KnownVersion:
    """The controller's step 2: the node copy written, hashed, proven as the image declared, promoted in place."""
    written, _ = area_of(catalog).write(name, tag, push.config, push.image.numpy())
    landed = landed_known(digest(push.config, push.image.numpy()), written, known)
    assert catalog.promote(catalog.read(name, str(written), landed))
    return landed


def test_a_device_version_is_built_from_what_it_carries_and_each_push_has_its_own_id(source: Path,
                                                                                     tmp_path: Path) -> None:
    catalog = catalog_at(tmp_path)
    push = declared(source)
    known = register_device(catalog, push, "a", "7")
    spec = catalog.get("a")
    assert spec.device_only and spec.version == known.version and spec.source is None
    assert spec.device == DeviceSource("7", push.image.numel(), len(push.head), known.source.header_crc)  # type: ignore[union-attr]
    from_file = catalog.read("b", str(source))
    assert (spec.modules, spec.dtype, spec.config, spec.file_bytes) == (
        from_file.modules, from_file.dtype, from_file.config, from_file.file_bytes)
    assert spec.known is not None and spec.known.source == spec.device and spec.known.meta
    again = device_known("a", "7", push.config, push.head, push.image.numel())
    assert again.version != known.version, "two device pushes shared an id: one's slots could serve the other's bytes"
    assert not (area_of(catalog).path("a", "7")).exists(), "a device version wrote a file before it landed"


def test_a_declaration_parsed_once_builds_each_later_spec_as_a_fresh_parse_would(source: Path,
                                                                                 tmp_path: Path) -> None:
    """``head_spec`` keeps the parse and checks of a (config, header): a later push under another name, tag and
    model limit is still its own spec, equal to a fresh parse's; another header is parsed, not taken from the last."""
    catalog = catalog_at(tmp_path)
    push = declared(source)
    first = register_device(catalog, push, "a", "7")
    pushed._HEAD_PARTS.clear()
    fresh = device_spec("b", tmp_path / "b" / "8", catalog.shape, 16, first._replace(version="v8"))
    again = device_spec("b", tmp_path / "b" / "8", catalog.shape, 16, first._replace(version="v8"))
    assert again == fresh and (again.name, again.path, again.version) == ("b", tmp_path / "b" / "8", "v8")
    assert catalog.get("a").version == first.version and catalog.get("a").name == "a"
    other = next(d for d in (torch.float32, torch.float16) if d != fresh_dtype(fresh))
    image, head = image_and_head({k: v.to(other) for k, v in push.tensors.items()}, {"format": "pt"})
    spec = check_head("c", push.config, head, image.numel(), catalog.shape, 64)
    assert spec.dtype != fresh.dtype and spec.modules == fresh.modules and spec.name == "c"
    with pytest.raises(AdapterFormatError, match="rank"):  # the model's rank limit is part of what was checked
        check_head("c", push.config, push.head, push.image.numel(), catalog.shape, 4)


def fresh_dtype(spec: AdapterSpec) -> torch.dtype:
    return getattr(torch, spec.dtype)


def test_a_device_version_is_refused_where_its_declaration_is_wrong(source: Path, tmp_path: Path) -> None:
    catalog = catalog_at(tmp_path)
    push = declared(source)
    shape, rank = catalog.shape, catalog.config.max_rank
    wrong = dict(push.tensors)
    key = next(k for k in wrong if "lora_A" in k)
    wrong[key] = torch.zeros(3, wrong[key].shape[1], dtype=wrong[key].dtype)
    image, head = image_and_head(wrong, {"format": "pt"})
    with pytest.raises(AdapterFormatError, match=key.split(".lora_A")[0].rsplit(".", 1)[-1]):
        check_head("a", push.config, head, image.numel(), shape, rank)
    with pytest.raises(AdapterFormatError, match="not readable safetensors"):
        check_head("a", push.config, push.head, push.image.numel() - 64, shape, rank)
    with pytest.raises(AdapterFormatError, match="not safetensors"):
        check_head("a", push.config, push.head[:20], push.image.numel(), shape, rank)
    with pytest.raises(AdapterFormatError, match="not safetensors"):
        check_head("a", push.config, push.head, len(push.head) - 8, shape, rank)
    known = device_known("a", "7", push.config, push.head, push.image.numel())
    with pytest.raises(AdapterPathError, match="push root"):
        catalog.read("a", str(tmp_path / "elsewhere" / "a" / "7"), known)
    forged = known._replace(config_digest="0" * 16)
    with pytest.raises(AdapterChangedError, match="carried config and header"):
        catalog.read("a", str(area_of(catalog).path("a", "7")), forged)
    assert "a" not in catalog


def test_a_device_version_loads_from_its_image_only_until_it_lands_then_from_its_file(
        source: Path, tmp_path: Path, make_cache: Callable[..., WorkerCache]) -> None:
    """Invariant 1 on both paths: the slot filled from the image equals the landed file's load, byte for byte; before
    it lands, no host read is tried (refused by name); an image that is not the declared one is refused."""
    catalog = catalog_at(tmp_path)
    push = declared(source, 1.5)
    known = register_device(catalog, push, "a", "7")
    version = known.version
    cache = make_cache(catalog)
    with pytest.raises(ConflictError, match="node copy has not landed"):
        cache.prefetch("a")
    with pytest.raises(ConflictError, match="node copy has not landed"):
        cache.stage("a")
    other = declared(source, 2.5)
    with pytest.raises(AdapterFormatError, match="not the image this device version was pushed as"):
        cache.load_image("a", version, other.image, other.head[:-8] + b"        ")
    cache.load_image("a", version, push.image, push.head).result(timeout=30)
    assert cache.prefetch("a").result(timeout=30).version == version, "a READY device version refused an acquire"
    from_image = slot(cache, "a", version)
    land(catalog, push, "a", "7", known)
    assert not catalog.get("a").device_only and catalog.get("a").version == version
    assert cache.evict("a", version)
    assert cache.prefetch("a").result(timeout=30).version == version
    assert slot(cache, "a", version) == from_image, "the landed file's load differs from the image's"
    assert cache.counters.image_loads == 1 and cache.counters.loads == 2


def slot(cache: WorkerCache, name: str, version: str) -> bytes:
    return slot_bytes(cache, name, version)


def test_a_landing_replaces_the_version_where_it_is_and_changes_no_current_version(source: Path,
                                                                                    tmp_path: Path) -> None:
    catalog = catalog_at(tmp_path)
    first, second = declared(source, 1.5), declared(source, 2.0)
    known1 = register_device(catalog, first, "a", "1")
    known2 = register_device(catalog, second, "a", "2")  # a newer step came before the first landed
    assert catalog.versions("a") == [known1.version, known2.version]
    land(catalog, first, "a", "1", known1)
    assert catalog.current("a") == known2.version and catalog.get("a").device_only
    older = catalog.get("a", known1.version)
    assert not older.device_only and older.source is not None and older.source.version == known1.version
    land(catalog, second, "a", "2", known2)
    assert catalog.current("a") == known2.version and not catalog.get("a").device_only
    gone = catalog.get("a")
    assert not catalog.promote(AdapterSpec(gone.name, gone.path, gone.config, gone.modules, gone.dtype, "f" * 16,
                                           gone.file_bytes)), "a version the catalog does not keep was promoted"


def test_a_landing_of_other_bytes_than_declared_is_refused(source: Path, tmp_path: Path) -> None:
    catalog = catalog_at(tmp_path)
    push, wider = declared(source, 1.5), declared(source, 1.5)
    known = register_device(catalog, push, "a", "7")
    wider_tensors = {k: torch.cat([v, v]) if "lora_B" in k else v for k, v in wider.tensors.items()}
    image, _ = image_and_head(wider_tensors, {"format": "pt"})
    written, _ = area_of(catalog).write("a", "7", push.config, image.numpy())
    with pytest.raises(AdapterChangedError, match="not the image pushed"):
        landed_known(digest(push.config, image.numpy()), written, known)
    assert catalog.get("a").device_only


def test_a_copy_on_another_node_is_proven_by_its_blocks_under_the_device_id(source: Path, tmp_path: Path) -> None:
    catalog = catalog_at(tmp_path)
    push = declared(source, 1.5)
    known = register_device(catalog, push, "a", "7")
    landed = land(catalog, push, "a", "7", known)
    there = PushArea(tmp_path / "node2", SERVICE, 1 << 30)
    copy, _ = there.write("a", "7", push.config, push.image.numpy())
    proven = as_copy_of(digest(push.config, push.image.numpy()), copy, landed)
    assert proven is not None and proven.version == known.version and proven.source.version == known.version  # type: ignore[union-attr]
    other = declared(source, 3.0)
    bad, _ = PushArea(tmp_path / "node3", SERVICE, 1 << 30).write("a", "7", push.config, other.image.numpy())
    assert as_copy_of(digest(push.config, other.image.numpy()), bad, landed) is None


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Callable[[], WorkerControl]]:
    """``ranks()``: a rank's control surface over its own empty catalog (the push area shared, as on one node)."""
    made: list[tuple[Outbox, WorkerCache]] = []

    def make() -> WorkerControl:
        catalog = catalog_at(tmp_path)
        cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", host=HostTierConfig(host_bytes=1 << 20,
                                                                                         pin=False)), catalog)
        outbox = Outbox("r/0", flush_s=60.0, send=lambda *_: None)
        made.append((outbox, cache))
        return WorkerControl("r", catalog, cache, outbox)

    try:
        yield make
    finally:
        for outbox, cache in made:
            outbox.close()
            cache.close()


def test_a_rank_takes_the_landing_as_a_registration_of_the_same_id_in_place(
        source: Path, tmp_path: Path, ranks: Callable[[], WorkerControl]) -> None:
    """As the controller sends them (``submit_registrations``): the device version, a newer one, then the first's
    landing, over the relay's wire form too (an engine's own process): the current version stays the newer one. A
    rank that never took the device version (restarted since) takes the landing of an older version, then the
    current one's registration that follows it (``DevicePushes.land``), and ends at the same current version."""
    control = ranks()
    controller = catalog_at(tmp_path)
    first, second = declared(source, 1.5), declared(source, 2.0)
    known1, known2 = register_device(controller, first, "a", "1"), register_device(controller, second, "a", "2")
    area = area_of(controller)
    wire = [relay_codec.from_known(relay_codec.known(k)) for k in (known1, known2)]
    assert wire == [known1, known2]
    assert control.register_adapter("a", str(area.path("a", "1")), wire[0]) == known1.version
    assert control.register_adapter("a", str(area.path("a", "2")), wire[1]) == known2.version
    landed = land(controller, first, "a", "1", known1)
    assert relay_codec.from_known(relay_codec.known(landed)) == landed
    assert control.register_adapter("a", str(area.path("a", "1")), landed) == known1.version
    rank = control.catalog
    assert rank.current("a") == known2.version and rank.get("a").device_only
    assert not rank.get("a", known1.version).device_only
    assert control.cache.prefetch("a", known1.version).result(timeout=30).version == known1.version
    assert control.register_adapter("a", str(area.path("a", "2")), known2) == known2.version  # again: no change
    assert rank.current("a") == known2.version and rank.versions("a") == [known1.version, known2.version]
    fresh = ranks()
    assert [v for v, _ in fresh.register_adapters([("a", str(area.path("a", "1")), landed),
                                                   ("a", str(area.path("a", "2")), known2)])] == [known1.version,
                                                                                                  known2.version]
    assert fresh.catalog.current("a") == known2.version and fresh.catalog.versions("a") == rank.versions("a")
    assert fresh.cache.prefetch("a", known1.version).result(timeout=30).version == known1.version


def test_a_doorbell_push_waits_for_its_registration_and_fails_at_once_where_the_rank_refused_it(
        source: Path, tmp_path: Path, ranks: Callable[[], WorkerControl]) -> None:
    """The controller answers a device push once it sent the ranks the registration (``answered=False``), so a
    trainer's doorbell may reach a rank first: the rank's load waits for it (``await_version``), and goes on once it
    is registered; one this rank refused fails at once, naming why, waiting or not; one that never comes is refused
    after the wait, naming the version."""
    control = ranks()
    controller = catalog_at(tmp_path)
    area = area_of(controller)
    good = register_device(controller, declared(source, 1.5), "a", "1")
    forged = register_device(controller, declared(source, 2.0), "a", "2")._replace(config_digest="0" * 16)
    with pytest.raises(NotFoundError, match=r"a@.* is not registered on rank r/0: its registration did not come"):
        control.await_version("a", good.version, 0.0)
    waiting = threading.Event()
    wait = control.arrived.wait

    def marked(timeout: float | None = None) -> bool:
        waiting.set()
        return wait(timeout)

    control.arrived.wait = marked  # type: ignore[method-assign]
    outcomes: list[BaseException | None] = []

    def doorbell(version: str) -> None:
        try:
            control.await_version("a", version, 60.0)
            outcomes.append(None)
        except BaseException as e:
            outcomes.append(e)

    for known in (good, forged):
        waiting.clear()
        waiter = threading.Thread(target=doorbell, args=(known.version,))
        waiter.start()
        assert waiting.wait(30)  # the rank's load is waiting for the registration: then it comes
        answers = control.register_adapters([("a", str(area.path("a", known.source.tag)), known)])  # type: ignore
        waiter.join(30)
        assert not waiter.is_alive()
        assert bool(answers[0][0]) == (known is good), answers
    assert outcomes[0] is None and control.catalog.get("a", good.version).device_only
    assert isinstance(outcomes[1], NotFoundError) and "refused it (AdapterChangedError" in str(outcomes[1])
    waiting.clear()
    with pytest.raises(NotFoundError, match="refused it"):  # known refused: no wait
        control.await_version("a", forged.version, 60.0)
    assert not waiting.is_set()


def test_the_durable_catalog_saves_no_device_only_version(source: Path, tmp_path: Path) -> None:
    catalog = catalog_at(tmp_path)
    push = declared(source, 1.5)
    catalog.register("a", str(source))
    before = catalog.current("a")
    known = register_device(catalog, push, "a", "7")
    current, older = catalog.entry("a")
    saved = entry_json("a", str(current.path), current, older)
    assert saved is not None and [v["v"] for v in (k for _, k in json.loads(saved)[1])] == [before]
    snapshots = CatalogSnapshots()
    first = decode(snapshots.take(catalog, {}))
    assert [e.current.known.version for e in first] == [before]
    land(catalog, push, "a", "7", known)
    landed = decode(snapshots.take(catalog, {}))  # its entry changed though its versions did not
    assert [(e.current.known.version, [o.known.version for o in e.older]) for e in landed] == [
        (known.version, [before])]
    alone = catalog_at(tmp_path, "push2")
    register_device(alone, push, "b", "1")
    current, older = alone.entry("b")
    assert entry_json("b", str(current.path), current, older) is None


def test_host_readable_names_the_version_and_the_fix(source: Path, tmp_path: Path) -> None:
    catalog = catalog_at(tmp_path)
    known = register_device(catalog, declared(source), "a", "7")
    with pytest.raises(ConflictError, match=f"a@{known.version} is a device push \\(tag 7\\)"):
        host_readable(catalog.get("a"))


def planner_with(device_only: bool) -> Planner:
    spec = ReplicaSpec("r0", ("r0/w0",), 2)
    planner = Planner(PlannerConfig(policy="global", warm_host_share=0.0, linger_s=0.0), 1,
                      [AdapterInfo("a", "v1", 100), AdapterInfo("b", "v1", 100)], [spec])
    planner.plan(0.0)
    planner.register_adapter(AdapterInfo("a", "d2", 100, device_only=device_only))
    return planner


def commands(planner: Planner, now: float) -> tuple[list[str], list[str]]:
    plan = planner.plan(now)
    mine = plan.for_worker("r0/w0")
    if mine is None:
        return [], []
    return ([f"{c.adapter}@{c.version}" for c in mine.prefetches],
            sorted(f"{c.adapter}@{c.version}" for c in mine.evicts))


def test_the_planner_never_loads_a_device_version_and_keeps_it_where_held_until_it_lands() -> None:
    planner = planner_with(device_only=True)
    planner.report_queue("r0", [QueueEntry("a", 0.0)], 1.0)
    assert commands(planner, 1.0)[0] == [], "the planner commanded a load of a version no file holds yet"
    # held where the trainer pushed it (READY by its push), then not wanted any more: kept, never evicted
    planner.report_residency("r0/w0", [ResidencyEntry("a", "d2", SlotState.READY, 0)])
    planner.report_queue("r0", [QueueEntry("b", 0.0)], 2.0)
    planner.register_adapter(AdapterInfo("a", "d3", 100, device_only=True))  # a newer step; d2 is older now
    planner.report_queue("r0", [QueueEntry("b", 0.0), QueueEntry("b", 0.1)], 3.0)
    _, evicts = commands(planner, 3.0)
    assert "a@d2" not in evicts, "a device version's only copy was evicted before it landed"
    planner.register_adapter(AdapterInfo("a", "d2", 100, device_only=True))  # registered again (d3 given up)
    assert planner.view.adapter("a").version == "d2" and planner.view.device_only(AdapterKey("a", "d2"))
    planner.register_adapter(AdapterInfo("a", "d3", 100, device_only=True))
    planner.register_adapter(AdapterInfo("a", "d2", 100))  # d2 landed (an older version): evictable as any
    assert planner.view.adapter("a").version == "d3", "an older version's landing changed the current version"
    assert not planner.view.device_only(AdapterKey("a", "d2")) and planner.view.device_only(AdapterKey("a", "d3"))
    planner.report_queue("r0", [QueueEntry("b", 0.0)], 4.0)
    planner.plan(4.0)
    planner.register_adapter(AdapterInfo("a", "d3", 100))  # the current one landed: loadable
    planner.report_queue("r0", [QueueEntry("a", 0.0)], 5.0)
    prefetches, _ = commands(planner, 5.0)
    assert prefetches == ["a@d3"]
    planner.check_integrity()


def test_a_trainers_image_buffer_is_the_safetensors_file_of_its_tensors(source: Path) -> None:
    push = declared(source)
    raw = (source / WEIGHTS_FILE).read_bytes()
    pushed, saved = load(bytes(push.image.numpy())), load(raw)
    assert pushed.keys() == saved.keys() and all(torch.equal(pushed[k], saved[k]) for k in saved)
    assert bytes(push.image[:len(push.head)].numpy()) == push.head


def test_a_trainers_next_push_into_its_kept_layout_is_the_image_a_fresh_layout_makes(source: Path) -> None:
    """``ImageLayout``: the next step's tensors copied into the buffer's kept places give the very bytes of a
    fresh image of them; tensors of another name set, shape, dtype or device do not fit (a new image instead), and
    nothing is written then."""
    first, second = declared(source, 1.5), declared(source, 2.5)
    layout = ImageLayout(first.tensors, first.image, first.head)
    ordered = layout.fits(second.tensors)
    assert ordered is not None
    layout.write(ordered)
    assert torch.equal(first.image, second.image), "the kept layout wrote other bytes than a fresh image"
    before = first.image.clone()
    name = next(iter(second.tensors))
    t = second.tensors[name]
    for other in ({**second.tensors, name: t.reshape(1, -1)}, {**second.tensors, name: t.to(torch.float64)},
                  {k: v for k, v in second.tensors.items() if k != name}, {**second.tensors, "extra": t},
                  {**second.tensors, name: t.to("meta")}):
        assert layout.fits(other) is None
    assert torch.equal(first.image, before)


def test_a_trainer_that_trains_in_the_buffer_pushes_with_no_copy(source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DevicePusher.views``' tensors (``ImageLayout.views``), or parameters whose data they are, written in place:
    the image is then the fresh image of the step's tensors, and their push copies nothing."""
    first, third = declared(source, 1.5), declared(source, 3.5)
    layout = ImageLayout(first.tensors, first.image, first.head)
    views = dict(zip(layout.names, layout.views, strict=True))
    for name, view in views.items():  # the trainer's step, in place
        view.copy_(third.tensors[name])
    params = {}
    for name, view in views.items():
        params[name] = torch.nn.Parameter(torch.empty(0, dtype=view.dtype), requires_grad=False)
        params[name].data = view
    copies: list[int] = []
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a: copies.append(1))
    for tensors in (views, params):
        ordered = layout.fits(tensors)
        assert ordered is not None
        layout.write(ordered)
    assert copies == [] and torch.equal(first.image, third.image)
    layout.write(layout.fits(third.tensors) or [])  # other tensors than the views: copied
    assert copies == [1]


class Controller(NamedTuple):
    core: ControllerCore
    devices: DevicePushes
    links: Links


def controller(tmp_path: Path, land_s: float = 60.0, links: Links | None = None,
               plan: Callable[[], Any] | None = None) -> Controller:
    """The controller's plain parts (core, registrar, pushes; the workers as the registrar sees them: ``Links``)."""
    catalog = CatalogConfig(adapter_roots=(str(tmp_path / "adapters"),), model="tiny", max_rank=16,
                            push_dir=str(tmp_path / "push"), push_land_s=land_s)
    core = ControllerCore(ControllerConfig(catalog=catalog), epoch=1)
    links = links or Links([])

    async def planned() -> None:
        pass

    plan = plan or planned

    registrar = Registrar(core, links, set(), plan)  # type: ignore[arg-type]
    return Controller(core, DevicePushes(Pushes(core, registrar, SERVICE)), links)


class Unanswered(Links):
    """Workers that were sent registrations and have not answered yet (until ``answer`` is set)."""

    def __init__(self) -> None:
        super().__init__([])
        self.answer = asyncio.Event()

    async def registered(self, sent: Sent) -> list[RankAnswers]:
        await self.answer.wait()
        return await super().registered(sent)


def test_a_device_push_is_answered_once_the_ranks_were_sent_its_registration(source: Path, tmp_path: Path) -> None:
    """The trainer rings its ranks once the controller holds the version and sent it to every rank: their
    answers (logged) and the plan come after, not on the push's path (each rank waits for the registration itself:
    the test above)."""
    links, planned = Unanswered(), []

    async def plan() -> None:
        planned.append(1)

    ctl = controller(tmp_path, links=links, plan=plan)
    push = declared(source, 1.5)

    async def pushed() -> tuple[Any, int, int]:
        done = await asyncio.wait_for(ctl.devices.push("a", 3, push.config, push.head, push.image.numel()), 30)
        before = links.outstanding  # the ranks' answers not yet in
        links.answer.set()
        for _ in range(100):  # the answers and the plan, in the background: they finish (no sleep)
            if not ctl.devices.registrar.background:
                break
            await asyncio.wait(set(ctl.devices.registrar.background), timeout=30)
        return done, before, links.outstanding

    done, before, outstanding = asyncio.run(pushed())
    assert ctl.core.catalog.get("a").version == done.version and done.rank_pending == ()
    assert [(n, k.version) for n, _, k in links.sent[-1]] == [("a", done.version)]  # type: ignore[union-attr]
    assert before == 1 and planned == [1] and outstanding == 0


def test_one_of_two_pushes_of_a_tag_at_once_is_refused_and_a_push_lands_in_place(source: Path,
                                                                                  tmp_path: Path) -> None:
    ctl = controller(tmp_path)
    push = declared(source, 1.5)

    async def both() -> list[Any]:
        return await asyncio.gather(*(ctl.devices.push("a", 7, push.config, push.head, push.image.numel())
                                      for _ in range(2)), return_exceptions=True)

    outcomes = asyncio.run(both())
    pushed = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(pushed) == 1 and len(refused) == 1 and isinstance(refused[0], ConflictError), outcomes
    version = pushed[0].version
    assert ctl.core.catalog.get("a").device_only and AdapterKey("a", version) in ctl.core.planner._fleet.device_only
    other = declared(source, 2.5)
    cut = other.image[:-64].numpy()  # not the image declared: refused, nothing changed
    with pytest.raises(AdapterChangedError, match="not the image pushed"):
        asyncio.run(ctl.devices.land("a", version, push.config, cut.tobytes()))
    assert ctl.core.catalog.get("a").device_only and not (ctl.devices.pushes.area.path("a", "7")).exists()
    landed = asyncio.run(ctl.devices.land("a", version, push.config, push.image.numpy()))
    assert landed.version == version and landed.content != version
    spec = ctl.core.catalog.get("a")
    assert not spec.device_only and spec.version == version
    assert AdapterKey("a", version) not in ctl.core.planner._fleet.device_only
    name, _, known = ctl.links.sent[-1][0]
    assert (name, known.version) == ("a", version) and known.source.version == version  # type: ignore[union-attr]
    with pytest.raises(NotFoundError, match="waiting for its node copy"):
        asyncio.run(ctl.devices.land("a", version, push.config, push.image.numpy()))


def test_a_push_never_landed_gives_way_to_the_version_before_it(source: Path, tmp_path: Path) -> None:
    ctl = controller(tmp_path, land_s=1.0)
    (before,) = asyncio.run(ctl.devices.registrar.register([("a", str(source))]))
    push = declared(source, 1.5)
    version = asyncio.run(ctl.devices.push("a", 7, push.config, push.head, push.image.numel())).version
    assert ctl.core.catalog.current("a") == version
    assert asyncio.run(ctl.devices.expire(time.monotonic())) == []  # not yet
    assert asyncio.run(ctl.devices.expire(time.monotonic() + 2.0)) == ["a"]
    assert ctl.core.catalog.current("a") == before.version
    assert AdapterKey("a", version) not in ctl.core.planner._fleet.device_only, "a given-up push stays unevictable"
    with pytest.raises(NotFoundError, match="given up"):
        asyncio.run(ctl.devices.land("a", version, push.config, push.image.numpy()))
    refused = asyncio.run(ctl.devices.push("a", 8, push.config, push.head, push.image.numel())).version
    assert asyncio.run(ctl.devices.withdraw("a", refused)) and ctl.core.catalog.current("a") == before.version
    assert not asyncio.run(ctl.devices.withdraw("a", refused)), "withdrawn twice"
    alone = asyncio.run(ctl.devices.push("b", 1, push.config, push.head, push.image.numel())).version
    assert asyncio.run(ctl.devices.expire(time.monotonic() + 2.0)) == ["b"]
    assert ctl.core.catalog.current("b") == alone, "a new name's only version went with its trainer"
    # an unregistered name's pushes waiting to land go with it: its tag is free again once registered anew
    again = asyncio.run(ctl.devices.push("c", 1, push.config, push.head, push.image.numel())).version
    ctl.core.unregister_adapter("c", 0.0)
    ctl.devices.forget("c")
    with pytest.raises(NotFoundError, match="waiting for its node copy"):
        asyncio.run(ctl.devices.land("c", again, push.config, push.image.numpy()))
    assert asyncio.run(ctl.devices.push("c", 1, push.config, push.head, push.image.numel())).version != again


def test_route_never_expects_a_device_version_ready_where_it_was_not_pushed() -> None:
    """Routing's expected time to READY (``advice.ready_s``): 0 where the trainer's replica holds it, inf on any other
    replica until it lands (nothing can read it there), then the measured load time as for any version."""
    specs = [ReplicaSpec(f"r{r}", (f"r{r}/w0",), 2) for r in range(2)]
    planner = Planner(PlannerConfig(policy="global"), 1, [AdapterInfo("a", "v1", 100)], specs)
    planner.register_adapter(AdapterInfo("a", "d2", 100, device_only=True))
    planner.update_residency("r0/w0", ResidencyEntry("a", "d2", SlotState.READY, 0))
    key, clock = AdapterKey("a", "d2"), LoadClock()
    where = {r: residence(planner.view, r, key) for r in ("r0", "r1")}
    assert where == {"r0": Residence.READY, "r1": Residence.COLD}
    assert [ready_s(planner.view, r, key, where[r], clock) for r in ("r0", "r1")] == [0.0, math.inf]
    planner.register_adapter(AdapterInfo("a", "d2", 100))  # landed
    assert 0 < ready_s(planner.view, "r1", key, Residence.COLD, clock) < math.inf


def test_a_version_registered_ahead_is_current_nowhere_until_its_commit(source: Path, tmp_path: Path) -> None:
    """``DevicePushes.reserve``: checked and given its id as a push's, held by the controller's catalog and sent to
    every rank with ``DeviceSource.ahead``, current nowhere, the planner keeping it where a rank loads it and a
    rank's READY of it believed; its tag held (a push or a second reservation of it refused). ``commit`` makes it
    current (sent without the flag), and its node copy then lands as any device push's; it is committed once. A push
    of its tag registered now gives it up."""
    ctl = controller(tmp_path)
    (before,) = asyncio.run(ctl.devices.registrar.register([("a", str(source))]))
    push = declared(source, 1.5)
    size = push.image.numel()
    with pytest.raises(NotFoundError, match="push its first version"):
        asyncio.run(ctl.devices.reserve("new", 1, push.config, push.head, size))
    ahead = asyncio.run(ctl.devices.reserve("a", 8, push.config, push.head, size))
    catalog, version = ctl.core.catalog, ahead.version
    assert (ahead.previous, catalog.current("a"), catalog.versions("a")) == (before.version, before.version,
                                                                           [before.version])
    assert catalog.get("a", version).device_only and catalog.ahead.has("a", version)
    name, _, sent = ctl.links.sent[-1][0]
    assert (name, sent.version, sent.source.ahead) == ("a", version, True)  # type: ignore[union-attr]
    assert AdapterKey("a", version) in ctl.core.planner._fleet.device_only
    assert ctl.core.planner.view.adapter("a").version == before.version, "the planner's current version moved"
    ctl.core.add_replica("r", 1, 2)
    assert ctl.core.admission.admits(WorkerId("r", 0), "a", version, acquired=True), "a rank's READY refused"
    with pytest.raises(ConflictError, match="tagged '8' already"):
        asyncio.run(ctl.devices.reserve("a", 8, push.config, push.head, size))
    with pytest.raises(NotFoundError, match="registered ahead and never committed"):
        asyncio.run(ctl.devices.land("a", version, push.config, push.image.numpy()))
    done = asyncio.run(ctl.devices.commit("a", version))
    assert (done.version, done.previous, catalog.current("a")) == (version, before.version, version)
    assert not catalog.ahead.has("a", version) and catalog.versions("a") == [before.version, version]
    name, _, sent = ctl.links.sent[-1][0]
    assert (name, sent.version, sent.source.ahead) == ("a", version, False)  # type: ignore[union-attr]
    with pytest.raises(NotFoundError, match="waiting for its commit"):
        asyncio.run(ctl.devices.commit("a", version))
    landed = asyncio.run(ctl.devices.land("a", version, push.config, push.image.numpy()))
    assert landed.version == version and not catalog.get("a").device_only
    # a guess, never a claim: a push of its tag registered now, from a device buffer or by value, gives it up
    later = declared(source, 2.5)
    for tag, by_value in ((9, False), (10, True)):
        guess = asyncio.run(ctl.devices.reserve("a", tag, push.config, push.head, size)).version
        done = asyncio.run(ctl.devices.pushes.push("a", tag, later.config, later.image.numpy().tobytes())
                           if by_value else ctl.devices.push("a", tag, push.config, push.head, size))
        assert catalog.current("a") == done.version != guess and not catalog.ahead.has("a", guess)
        with pytest.raises(NotFoundError, match="given up"):
            asyncio.run(ctl.devices.commit("a", guess))


def test_a_version_registered_ahead_and_never_committed_is_given_up_leaving_the_current_one(
        source: Path, tmp_path: Path) -> None:
    """Given up after ``AHEAD_LAND_TIMES`` x ``push_land_s`` (not after ``push_land_s``: a trainer's step may be long),
    or at once when withdrawn; a withdrawal while its commit is being registered (a rank refused the image the
    trainer rang it with) leaves the version before it current and the commit refused."""
    ctl = controller(tmp_path, land_s=1.0)
    (before,) = asyncio.run(ctl.devices.registrar.register([("a", str(source))]))
    push = declared(source, 1.5)
    size, catalog = push.image.numel(), ctl.core.catalog
    version = asyncio.run(ctl.devices.reserve("a", 8, push.config, push.head, size)).version
    assert asyncio.run(ctl.devices.expire(time.monotonic() + 2.0)) == []
    assert asyncio.run(ctl.devices.expire(time.monotonic() + AHEAD_LAND_TIMES + 1.0)) == ["a"]
    assert not catalog.ahead.has("a", version) and catalog.current("a") == before.version
    assert AdapterKey("a", version) not in ctl.core.planner._fleet.device_only
    with pytest.raises(NotFoundError, match="given up"):
        asyncio.run(ctl.devices.commit("a", version))
    again = asyncio.run(ctl.devices.reserve("a", 8, push.config, push.head, size)).version  # the tag is free again

    async def refused_while_committed() -> list[Any]:
        return await asyncio.gather(ctl.devices.commit("a", again), ctl.devices.withdraw("a", again),
                                    return_exceptions=True)

    commit, withdrew = asyncio.run(refused_while_committed())
    assert withdrew is True and isinstance(commit, NotFoundError) and "withdrawn" in str(commit), (commit, withdrew)
    assert catalog.current("a") == before.version and (("a", again) not in ctl.devices.pending)
    assert AdapterKey("a", again) not in ctl.core.planner._fleet.device_only


def test_a_rank_holds_a_version_registered_ahead_loadable_and_not_current_until_its_commit(
        source: Path, tmp_path: Path, ranks: Callable[[], WorkerControl]) -> None:
    """Invariant 1 for a version registered ahead: a rank loads it from the image by its exact version while the
    name's current version stays the one before (what an unversioned request gets); the commit makes it current with
    the slot filled from the image unchanged; over the relay's wire too. A name holds at most ``MAX_AHEAD`` (the
    oldest let go), and one of an unregistered name is refused by the rank, naming the fix."""
    control = ranks()
    assert control.register_adapter("a", str(source)) == (base := control.catalog.current("a"))
    controller_catalog = catalog_at(tmp_path)
    push = declared(source, 1.5)
    path = str(area_of(controller_catalog).path("a", "1"))
    known = device_known("a", "1", push.config, push.head, push.image.numel(), ahead=True)
    wire = relay_codec.from_known(relay_codec.known(known))
    assert wire == known and wire.source.ahead  # type: ignore[union-attr]
    assert control.register_adapter("a", path, wire) == known.version
    rank = control.catalog
    assert rank.current("a") == base and rank.versions("a") == [base] and rank.get("a", known.version).device_only
    cache = control.cache
    cache.load_image("a", known.version, push.image, push.head).result(timeout=30)
    assert cache.prefetch("a").result(timeout=30).version == base, "an unversioned acquire took the version ahead"
    filled = slot(cache, "a", known.version)
    now = committed(known)
    assert control.register_adapter("a", path, relay_codec.from_known(relay_codec.known(now))) == known.version
    assert rank.current("a") == known.version and rank.versions("a") == [base, known.version]
    assert not rank.ahead.has("a", known.version)
    assert cache.prefetch("a").result(timeout=30).version == known.version
    assert slot(cache, "a", known.version) == filled and cache.counters.image_loads == 1
    many = [device_known("a", str(t), push.config, push.head, push.image.numel(), ahead=True) for t in (2, 3, 4)]
    for k in many:
        control.register_adapter("a", str(area_of(controller_catalog).path("a", k.source.tag)), k)  # type: ignore
    assert [rank.ahead.has("a", k.version) for k in many] == [False, True, True] and MAX_AHEAD == 2
    with pytest.raises(NotFoundError, match="re-registered"):
        rank.get("a", many[0].version)
    stray = device_known("b", "1", push.config, push.head, push.image.numel(), ahead=True)
    ((version, why),) = control.register_adapters([("b", str(area_of(controller_catalog).path("b", "1")), stray)])
    assert version == "" and "push its first version" in why and "b" not in rank


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "launches"])
def test_gpu_versions_pushed_through_one_buffer_by_its_fill_graph_each_land_as_their_own_bytes(
        source: Path, tmp_path: Path, tp: int, graph: bool) -> None:
    """``workers.reads.fill_graph`` (invariant 1): the graph a rank captures at a buffer's first push into a slot reads
    the buffer when it runs and writes only that slot. Versions written into one buffer one after another (the
    trainer's stream still writing when the load is issued, ordered by its event), more than the rank's slots, each
    fill their slot with their own bytes, equal to their landed file's load; a NaN written into it fails that
    version's load; slots are reused, a capture per slot at most (later loads replay); by the watcher and by the
    caller's settle. At the end every version still resident holds its own bytes still (no graph wrote into a slot
    it was not loading). The same by launches (a shard over ``FillGraphs.max_bytes``), with the loads' pinned flags
    kept and reused."""
    catalog = catalog_at(tmp_path)
    trainer = torch.cuda.Stream()
    buffer: torch.Tensor | None = None
    for rank in range(tp):
        config = WorkerConfig(num_slots=4, tp=tp, tp_rank=rank, device="cuda",
                              host=HostTierConfig(host_bytes=1 << 24, pin=False))
        cache, check = WorkerCache(config, catalog), WorkerCache(config, catalog)
        if not graph:
            cache.fill_graphs.max_bytes = 0
        expected: dict[str, bytes] = {}  # each loaded version's landed file's load
        try:
            for step, scale in enumerate((1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5)):
                push, tag = declared(source, scale), f"{rank}-{step}"
                staged = push.image.cuda()
                if buffer is None:
                    buffer = torch.zeros_like(staged)
                if step == 3:  # every element a NaN (bf16 0x7fc0): in every rank's slices
                    staged[len(push.head):].view(torch.int16).fill_(0x7FC0)
                torch.cuda.synchronize()
                with torch.cuda.stream(trainer):
                    torch.cuda._sleep(20_000_000)  # still writing when the rank's fill is issued
                    buffer.copy_(staged)
                    written = torch.cuda.Event()
                    written.record()
                known = register_device(catalog, push, "a", tag)
                load = cache.load_image("a", known.version, buffer, push.head, after=written,
                                        settle_s=5.0 if step % 2 else 0.0)
                if step == 3:
                    with pytest.raises(NonFiniteWeightsError):
                        load.result(timeout=60)
                    continue
                load.result(timeout=60)
                land(catalog, push, "a", tag, known)
                check.prefetch("a").result(timeout=60)
                expected[known.version] = slot(check, "a", known.version)
                assert slot(cache, "a", known.version) == expected[known.version], (
                    f"TP {tp} rank {rank} step {step}: the graph's fill differs from the landed file's load")
            with cache.book.lock:
                resident = [v for v in expected if cache.book.table.lookup(AdapterKey("a", v)) is not None]
            assert len(resident) >= 2
            for version in resident:
                assert slot(cache, "a", version) == expected[version], f"TP {tp} rank {rank}: {version} was overwritten"
            assert cache.counters.image_loads == 7  # six READY in four slots: slots were reused
            assert (0 < cache.fill_graphs.captures <= 4) if graph else cache.fill_graphs.captures == 0
            assert len(cache.fill_graphs._flags) == 1  # each load's flag given back once read, taken by the next
        finally:
            cache.close()
            check.close()
