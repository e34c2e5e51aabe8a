"""Adapters from an S3-compatible object store (issue 29): registration reads metadata only, the disk tier
fetches a version once per node and proves every read, and every bad input is a clear error that leaves the
caches as they were. Against a real server (moto's server mode, its own process on 127.0.0.1:
``tests/s3_server.py``), never an in-process mock.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from bench.probes.s3_local import LatencyProxy, ThrottleProxy
from lora_cache.adapters.base_model import adapter_bases, choose_model
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.objects import StoreUrl
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec
from lora_cache.adapters.store import ATTEMPTS, client, list_adapters
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api import relay_codec
from lora_cache.app.cli import inspect_adapter, main
from lora_cache.app.client_cli import register_items
from lora_cache.controller import catalog_store
from lora_cache.controller.catalog_store import known_from, known_json
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.errors import (
    AdapterChangedError,
    AdapterFormatError,
    AdapterPathError,
    AdapterStoreError,
    CapacityError,
    ConfigError,
)
from lora_cache.runtime.cliargs import shell_path
from lora_cache.runtime.ports import free_port
from lora_cache.vocab import NAMESPACE, AdapterKey, Stage
from tests.s3_server import S3Server, set_env
from tests.waiting import wait_for
from workers.cache import WorkerCache, WorkerConfig
from workers.control.outbox import Outbox
from workers.control.rank import WorkerControl
from workers.staging import disk_tier, fetch_pace
from workers.staging.disk_tier import DiskTier, DiskTierConfig
from workers.staging.host_config import HostTierConfig
from workers.staging.node_reads import NodeFetches, NodeReads, StoreShare, started

BUCKET = "adapters-bkt"
BIG_RANK = 512  # float32 tiny-shaped at this rank: 4 MiB, four 1 MiB parts


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server(record=True) as srv:
        srv.client().create_bucket(Bucket=BUCKET)
        yield srv


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters on disk, the source of what the tests upload: small ones and one of four 1 MiB parts."""
    root = tmp_path_factory.mktemp("local")
    small = make_adapters(root / "small", SynthConfig(model="tiny", count=3, rank="8,16"))
    big = make_adapters(
        root / "big", SynthConfig(model="tiny", count=1, rank=str(BIG_RANK), dtype="float32", prefix="big")
    )
    return {d.name: d for d in (*small, *big)}


@pytest.fixture
def store(
    server: S3Server, local: dict[str, Path], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> tuple[S3Server, str]:
    """A fresh prefix holding every local adapter, and this process's AWS_* variables pointing at the server."""
    set_env(monkeypatch, server.env)
    prefix = f"t/{request.node.name.replace('[', '-').replace(']', '')}"
    for name, d in local.items():
        server.upload_dir(BUCKET, f"{prefix}/{name}", d)
    return server, f"s3://{BUCKET}/{prefix}"


def catalog_for(root: str, max_rank: int = BIG_RANK, timeout_s: float = 20.0) -> AdapterCatalog:
    return AdapterCatalog(
        CatalogConfig(adapter_roots=(root,), model="tiny", max_rank=max_rank, store_timeout_s=timeout_s)
    )


@pytest.fixture
def cache_for(tmp_path: Path) -> Iterator[Callable[..., WorkerCache]]:
    caches: list[WorkerCache] = []

    def make(
        catalog: AdapterCatalog, disk: Path | None = None, service: str = NAMESPACE, **disk_kw: Any
    ) -> WorkerCache:
        config = WorkerConfig(
            num_slots=2,
            device="cpu",
            host=HostTierConfig(host_bytes=16 << 20, read_threads=2, pin=False),
            disk=DiskTierConfig(disk_cache=str(disk or tmp_path / "disk"), **disk_kw),
        )
        caches.append(WorkerCache(config, catalog, service=service))
        return caches[-1]

    yield make
    for c in caches:
        c.close()


def file_slices(weights: Path, cache: WorkerCache, name: str) -> dict[tuple[int, str, str], torch.Tensor]:
    layout = cache.layout_of(name)
    with safe_open(str(weights), framework="pt") as f:
        return {(e.layer, e.module, e.ab): f.get_slice(e.key)[e.rows, e.cols].to(layout.dtype) for e in layout.entries}


def assert_serves(cache: WorkerCache, name: str, weights: Path) -> None:
    """The slot of ``name`` holds exactly the slices of ``weights`` (the bytes of the version registered)."""
    slot = next(r["slot"] for r in cache.residency() if r["adapter"] == name and r["state"] == "ready")
    layout = cache.layout_of(name)
    for (layer, module, ab), want in file_slices(weights, cache, name).items():
        assert torch.equal(cache.slot_view(slot, layout, layer, module, ab), want), (name, layer, module, ab)  # type: ignore[arg-type]


def disk_files(directory: Path) -> list[str]:
    """What the disk tier holds: copies, proofs and parts (not its lock files)."""
    return (
        sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != ".lock") if directory.exists() else []
    )


def replace_object(server: S3Server, spec: AdapterSpec, data: bytes) -> None:
    assert spec.store is not None
    server.client().put_object(Bucket=spec.store.bucket, Key=spec.store.key, Body=data)


# -- registration: metadata only, clear errors --------------------------------------------------------------


def test_registration_reads_only_metadata_and_versions_by_store_identity(
    store: tuple[S3Server, str], local: dict[str, Path]
) -> None:
    server, root = store
    catalog = catalog_for(root)
    specs = {s.name: s for s in catalog.register_dir(root)}
    assert sorted(specs) == sorted(local)
    spec = specs["adapter-000"]
    assert spec.store is not None and spec.source is None  # nothing local until a read fetches it
    assert spec.store.size == (local["adapter-000"] / WEIGHTS_FILE).stat().st_size
    assert str(spec.path) == f"{root}/adapter-000"
    # the same object registered again is the same version; a replaced one (even with equal bytes under a new
    # ETag-less re-upload of other content) is a new version
    assert catalog.read("adapter-000", f"{root}/adapter-000", spec.known).store is spec.store
    replace_object(server, spec, (local["adapter-002"] / WEIGHTS_FILE).read_bytes())
    again = catalog.read("adapter-000", f"{root}/adapter-000", spec.known)
    assert again.version != spec.version


def test_registration_refuses_bad_locations_naming_bucket_and_key(store: tuple[S3Server, str]) -> None:
    server, root = store
    catalog = catalog_for(f"s3://{BUCKET}")
    with pytest.raises(AdapterPathError, match="bucket 'no-such-bkt' does not exist"):
        catalog_for("s3://no-such-bkt/x").register("a", "s3://no-such-bkt/x/a")
    with pytest.raises(AdapterFormatError, match=f"{root}/missing/adapter_config.json does not exist"):
        catalog.register("missing", f"{root}/missing")
    with pytest.raises(AdapterPathError, match="outside the object-store adapter roots"):
        catalog_for(f"{root}/adapter-000").register("adapter-001", f"{root}/adapter-001")
    server.client().delete_object(Bucket=BUCKET, Key=f"{root.split('/', 3)[3]}/adapter-001/{WEIGHTS_FILE}")
    with pytest.raises(AdapterFormatError, match=f"adapter-001/{WEIGHTS_FILE} does not exist"):
        catalog.register("adapter-001", f"{root}/adapter-001")
    assert len(catalog) == 0  # nothing half-registered


def test_wrong_credentials_are_refused_with_the_fix(
    store: tuple[S3Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, root = store
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    catalog = catalog_for(root)
    refused = r"refused the credentials \(SignatureDoesNotMatch\).*AWS_ACCESS_KEY_ID"
    with pytest.raises(AdapterStoreError, match=refused):
        catalog.register("adapter-000", f"{root}/adapter-000")
    assert len(catalog) == 0


def test_a_truncated_object_is_refused_at_registration(store: tuple[S3Server, str], local: dict[str, Path]) -> None:
    server, root = store
    data = (local["adapter-000"] / WEIGHTS_FILE).read_bytes()
    key = f"{root.split('/', 3)[3]}/adapter-000/{WEIGHTS_FILE}"
    server.client().put_object(Bucket=BUCKET, Key=key, Body=data[: len(data) - 100])
    with pytest.raises(AdapterFormatError, match=f"adapter-000/{WEIGHTS_FILE} is not a readable safetensors.*upload"):
        catalog_for(root).register("adapter-000", f"{root}/adapter-000")


def test_registration_asks_the_store_two_requests_per_adapter_and_refuses_an_empty_object(
    store: tuple[S3Server, str], local: dict[str, Path]
) -> None:
    """Issue 44 item 6: a registration's requests are the config's GET and one ranged GET of the weights (its answer
    carries the identity and the header: no HEAD); the version is the one a HEAD and a GET gave before (a
    snapshot's versions stay valid). An empty weights object is refused, naming it."""
    server, root = store
    prefix = root.split("/", 3)[3]
    server.forget_requests()
    spec = catalog_for(root).register("adapter-001", f"{root}/adapter-001")
    asked = [(m, path.partition("?")[0]) for m, path in server.requests()]
    assert asked == [("GET", f"{BUCKET}/{prefix}/adapter-001/{CONFIG_FILE}"),
                     ("GET", f"{BUCKET}/{prefix}/adapter-001/{WEIGHTS_FILE}")], asked
    head = server.client().head_object(Bucket=BUCKET, Key=f"{prefix}/adapter-001/{WEIGHTS_FILE}")
    assert spec.store is not None and (spec.store.etag, spec.store.size) == (head["ETag"], head["ContentLength"])
    weights = f"{prefix}/adapter-003/{WEIGHTS_FILE}"  # a header longer than the first range: one more ranged GET
    header = json.dumps({"pad": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "__metadata__": {"pad": "x" * (80 << 10)}}).encode()
    server.client().put_object(Bucket=BUCKET, Key=f"{prefix}/adapter-003/{CONFIG_FILE}",
                               Body=(local["adapter-000"] / CONFIG_FILE).read_bytes())
    server.client().put_object(Bucket=BUCKET, Key=weights, Body=len(header).to_bytes(8, "little") + header + bytes(4))
    server.forget_requests()
    with pytest.raises(AdapterFormatError):  # read whole (no tensor an adapter needs), then refused by the catalog
        catalog_for(root).register("adapter-003", f"{root}/adapter-003")
    ranges = [path for m, path in server.requests() if path.partition("?")[0] == f"{BUCKET}/{weights}"]
    assert len(ranges) == 2, f"a long header takes one more ranged GET: {server.requests()}"
    server.client().put_object(Bucket=BUCKET, Key=f"{prefix}/adapter-002/{WEIGHTS_FILE}", Body=b"")
    with pytest.raises(AdapterFormatError, match=f"adapter-002/{WEIGHTS_FILE} is not a readable safetensors file"):
        catalog_for(root).register("adapter-002", f"{root}/adapter-002")


def test_a_batch_of_store_adapters_is_read_store_reads_at_a_time_in_order_each_error_its_own(
    store: tuple[S3Server, str], local: dict[str, Path]
) -> None:
    """Issue 44 item 6: the registrar reads a batch's store adapters ``store_reads`` at a time (their reads are round
    trips): with 4 reads held at their start, all 4 are in flight at once, the 5th waits for a free one; answers come
    in the items' order, the missing prefix's error its own, every other item registered and sent to the workers."""
    import asyncio

    from lora_cache.controller.registrations import Registrar
    from tests.test_registrations import Held, Links

    server, root = store
    prefix = root.split("/", 3)[3]
    for i in range(4, 12):  # more adapters under the prefix: copies of one, each its own object (own version)
        server.upload_dir(BUCKET, f"{prefix}/copy-{i:02d}", local["adapter-000"])
    items = [(f"copy-{i:02d}", f"{root}/copy-{i:02d}") for i in range(4, 12)]
    items.insert(3, ("missing", f"{root}/missing"))
    config = CatalogConfig(adapter_roots=(root,), model="tiny", max_rank=BIG_RANK, store_reads=4)
    core = ControllerCore(ControllerConfig(catalog=config), epoch=1)
    log: list[str] = []
    links = Links(log)

    async def plan() -> None:
        log.append("plan")

    held = Held(core)
    first = [name for name, _ in items if name != "missing"][:4]
    for name in first:
        held.hold(name)

    async def scenario() -> list:
        registering = asyncio.create_task(Registrar(core, links, set(), plan).register(items))
        for name in first:  # all four reads in flight together (a one-at-a-time read would stop at the first)
            await held.until_arrived(name)
        assert not registering.done() and len(core.catalog) == 0
        for name in first:
            held.release[name].set()
        return await registering

    done = asyncio.run(scenario())
    assert [d.name for d in done] == [name for name, _ in items]
    assert [d.name for d in done if d.error is not None] == ["missing"]
    assert "missing/adapter_config.json does not exist" in str(done[3].error)
    assert sorted(core.catalog.names()) == sorted(name for name, _ in items if name != "missing")
    assert log[-1] == "plan" and len([e for e in log if e.startswith("submit")]) == len(items) - 1


def test_a_throttling_store_is_backed_off_from_and_every_adapter_registers(
    store: tuple[S3Server, str], local: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 6: a store asked too fast answers 503 SlowDown. With botocore's one retry, a batch read
    ``store_reads`` at a time failed adapter after adapter; now the client's window of requests in flight halves at
    a throttle and each throttled request is asked again after a jittered backoff, within the call's deadline:
    every adapter registers."""
    import asyncio

    from lora_cache.adapters.store import client
    from lora_cache.controller.registrations import Registrar
    from tests.test_registrations import Links

    server, root = store
    prefix = root.split("/", 3)[3]
    for i in range(40):
        server.upload_dir(BUCKET, f"{prefix}/copy-{i:02d}", local["adapter-000"])
    items = [(f"copy-{i:02d}", f"{root}/copy-{i:02d}") for i in range(40)]
    config = CatalogConfig(adapter_roots=(root,), model="tiny", max_rank=BIG_RANK, store_reads=32, store_timeout_s=20)

    async def plan() -> None:
        pass

    # at most 4 at once: 32 reads started together are throttled however slowly this machine runs them
    with ThrottleProxy(server.url, rate=40, burst=8, concurrent=4) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # a client (and a window) of its own
        core = ControllerCore(ControllerConfig(catalog=config), epoch=1)
        done = asyncio.run(Registrar(core, Links([]), set(), plan).register(items))
        pace = client(config.store_timeout_s).lora_cache_pace.stats()
    assert [str(d.error) for d in done if d.error is not None] == [], "a throttled adapter failed to register"
    assert sorted(core.catalog.names()) == sorted(name for name, _ in items)
    assert proxy.throttled > 0 and pace["throttles"] > 0 and pace["cuts"] > 0, (proxy.throttled, pace)
    assert pace["window"] < 32, f"the window did not narrow: {pace}"


def test_the_catalog_copy_lives_under_a_store_prefix_per_service(store: tuple[S3Server, str]) -> None:
    """Issue 46 item 5: ``--catalog-copy s3://...`` keeps the catalog's snapshot beside the adapters, one object per
    service, replaced by one PUT; none yet reads as none."""
    from lora_cache.controller.catalog_copy import CatalogCopy

    _, root = store
    a, b = CatalogCopy(f"{root}/catalogs", "svc-a"), CatalogCopy(f"{root}/catalogs", "svc-b")
    assert a.get() is None and a.where() == f"{root}/catalogs/svc-a/catalog.v1"
    a.put(b"one")
    a.put(b"two")
    assert a.get() == b"two" and b.get() is None


def test_a_store_version_survives_the_catalog_snapshot(store: tuple[S3Server, str]) -> None:
    _, root = store
    spec = catalog_for(root).register("adapter-000", f"{root}/adapter-000")
    assert spec.known is not None and spec.known.meta
    back = known_from(known_json(spec.known))
    assert back == spec.known  # the carried config and header are kept with the identity
    assert catalog_for(root).read("adapter-000", f"{root}/adapter-000", back).version == spec.version


def test_a_restored_controller_asks_the_store_nothing_it_had(store: tuple[S3Server, str]) -> None:
    """The snapshot keeps each store version's metadata (each distinct blob once): a restore builds every spec
    from it with no request to the store, and carries the same metadata to the ranks as before."""
    server, root = store
    config = ControllerConfig(catalog=CatalogConfig(adapter_roots=(root,), model="tiny", max_rank=BIG_RANK))
    core = ControllerCore(config, epoch=1)
    specs = core.catalog.register_dir(root)
    paths = {s.name: str(s.path) for s in specs}
    snapshots = catalog_store.CatalogSnapshots()
    data = snapshots.take(core.catalog, paths)
    blobs = json.loads(zlib.decompress(data))["metas"]
    assert 0 < len(blobs) <= len({s.known.meta for s in specs if s.known is not None})
    server.forget_requests()
    restored = catalog_store.read_saved(ControllerCore(config, epoch=2), catalog_store.decode(data))
    assert server.requests() == []  # not one request: metadata, identities and versions all from the snapshot
    assert restored.refused == 0 and restored.unchanged == len(specs)
    back = {spec.name: spec for spec, _, _ in restored.entries}
    for s in specs:
        assert (back[s.name].version, back[s.name].store, back[s.name].modules, back[s.name].known) == (
            s.version,
            s.store,
            s.modules,
            s.known,
        )


def test_a_rank_takes_a_store_registration_without_asking_the_store(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    """A version is established once (the controller's read) and carried to the ranks with the command: a rank
    takes it from the carried config and header, with no request to the store; its first fetch still proves the
    bytes (an object replaced since is refused)."""
    server, root = store
    controller = catalog_for(root)
    specs = controller.register_dir(root)
    knowns = [
        (s.name, str(s.path), relay_codec.from_registration(relay_codec.registration(s.name, str(s.path), s.known))[2])
        for s in specs
    ]  # as the gRPC relay carries them to an attached rank (Ray carries them as they are)
    assert [k for _, _, k in knowns] == [s.known for s in specs]
    assert all(k is not None and 0 < len(k.meta) < 4096 for _, _, k in knowns)
    server.forget_requests()
    rank = catalog_for(root)
    cache = cache_for(rank)
    outbox = Outbox("replica-0/0", flush_s=60.0, send=lambda *_: None)  # no controller here: nothing to Ray
    control = WorkerControl("replica-0", rank, cache, outbox)
    assert all(not why for _, why in control.register_adapters(knowns))
    assert server.requests() == []  # not one request to the store from the rank
    assert control.taken == len(specs) and control.hashed == 0
    for s in specs:
        mine = rank.get(s.name)
        assert (mine.version, mine.store, mine.modules, mine.config, mine.dtype) == (
            s.version,
            s.store,
            s.modules,
            s.config,
            s.dtype,
        )
        assert mine.store_meta == b""  # the rank keeps the identity, not the header
    # the registering process itself asks the store again (a re-registration must see a replaced object) ...
    spec = controller.get("adapter-000")
    replace_object(server, spec, (local["adapter-002"] / WEIGHTS_FILE).read_bytes())  # same size, other bytes
    assert controller.read("adapter-000", str(spec.path), spec.known).version != spec.version
    # ... and the rank's first fetch proves the version it took: the replaced object is refused
    with pytest.raises(AdapterChangedError, match="was replaced in the store"):
        cache.prefetch("adapter-000").result(timeout=30)
    assert disk_files(tmp_path / "disk" / NAMESPACE) == []
    cache.prefetch("adapter-001").result(timeout=30)
    assert_serves(cache, "adapter-001", local["adapter-001"] / WEIGHTS_FILE)
    # carried metadata that is not the version's own is refused, never taken
    other = controller.get("adapter-001").known
    assert other is not None and spec.known is not None
    with pytest.raises(AdapterChangedError, match="carried config and header are not those of version"):
        rank.read("adapter-000", str(spec.path), spec.known._replace(meta=other.meta), carried=True)
    outbox.close()


def test_register_dir_lists_the_adapter_prefixes_under_a_store_prefix(store: tuple[S3Server, str]) -> None:
    _, root = store
    items = register_items([], root)
    assert items == [
        (name, f"{root}/{name}") for name in sorted(("adapter-000", "adapter-001", "adapter-002", "big-000"))
    ]
    assert register_items(["x=/somewhere"], root) == [("x", "/somewhere"), *(items or [])]
    with pytest.raises(SystemExit, match=f"--dir s3://{BUCKET}/nothing-here: .*holds no adapter"):
        register_items([], f"s3://{BUCKET}/nothing-here")


# -- the base model from a store prefix, as from a directory (issue 45 item 3) --------------------------------


def test_serve_takes_the_base_model_from_a_store_prefix_as_from_a_directory(
    store: tuple[S3Server, str], local: dict[str, Path], tmp_path: Path
) -> None:
    """``serve --adapters s3://...`` without ``--model``: the adapters' ``base_model_name_or_path``, read from
    their configs in the store, chooses the model exactly as for a directory, with the same errors."""
    server, root = store
    assert adapter_bases(root) == {name: "tiny" for name in local}
    assert adapter_bases(root, only="adapter-001") == {"adapter-001": "tiny"} and adapter_bases(root, "nope") == {}
    directory = tmp_path / "here"
    for name, d in local.items():
        (directory / name).mkdir(parents=True)
        (directory / name / CONFIG_FILE).write_bytes((d / CONFIG_FILE).read_bytes())
    for model in ("", "tiny"):
        assert choose_model(model, root) == choose_model(model, directory) == "tiny"
    for where in (root, directory):
        with pytest.raises(ConfigError, match=r"trained on 'tiny'.*differs from --model 'llama-3.1-8b'; pass --model"):
            choose_model("llama-3.1-8b", where)
    config = json.loads((local["adapter-001"] / CONFIG_FILE).read_text())
    other = json.dumps({**config, "base_model_name_or_path": "meta-llama/Llama-3.1-8B"})
    server.client().put_object(Bucket=BUCKET, Key=(StoreUrl.parse(root) / "adapter-001" / CONFIG_FILE).key, Body=other)
    (directory / "adapter-001" / CONFIG_FILE).write_text(other)
    for where in (root, directory):  # adapters of two bases: the same refusal, naming the odd one
        with pytest.raises(ConfigError, match=r"different base models .*adapter-001: 'meta-llama/Llama-3.1-8B'"):
            choose_model("", where)
    server.client().put_object(Bucket=BUCKET, Key=(StoreUrl.parse(root) / "adapter-002" / CONFIG_FILE).key, Body=b"{")
    assert adapter_bases(root)["adapter-002"] == ""  # a broken config is registration's to report, not this
    from lora_cache.adapters import store as store_module

    server.forget_requests()
    with pytest.MonkeyPatch.context() as patch:  # a large catalog: the first BASE_SAMPLE adapters' configs only
        patch.setattr(store_module, "BASE_SAMPLE", 2)
        assert list(adapter_bases(root)) == ["adapter-000", "adapter-001"]
    assert [m for m, _ in server.requests()] == ["GET"] * 3, "one listing and two configs"
    with pytest.raises(AdapterPathError, match="bucket 'no-such-bkt' does not exist"):
        choose_model("", "s3://no-such-bkt/adapters")
    with pytest.raises(AdapterFormatError, match="holds no adapter"):
        choose_model("", f"s3://{BUCKET}/nothing-here")


def test_inspect_reads_a_store_adapter_as_it_reads_a_directory(
    store: tuple[S3Server, str], local: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``inspect s3://BUCKET/PREFIX/NAME``: the same figures as the local copy's (the version is the store's
    identity, the path its URL), reading the config and the header only, never the weights."""
    server, root = store
    here = inspect_adapter(str(local["adapter-001"]), "", 2, 64)
    server.forget_requests()
    assert main(["inspect", f"{root}/adapter-001", "--tp", "2", "--max-rank", "64", "--json"]) == 0
    there = json.loads(capsys.readouterr().out)
    assert there["path"] == f"{root}/adapter-001" and there["model"] == "tiny"
    same = [k for k in here if k not in ("path", "version")]
    assert {k: there[k] for k in same} == {k: here[k] for k in same}
    weights = f"{BUCKET}/{(StoreUrl.parse(root) / 'adapter-001' / WEIGHTS_FILE).key}"
    gets = [m for m, path in server.requests() if path.partition("?")[0] == weights and m == "GET"]
    assert gets == ["GET"], f"the weights were read beyond the header's range: {server.requests()}"
    with pytest.raises(ConfigError, match=f"names a bucket, not an adapter: give s3://{BUCKET}/PREFIX/NAME"):
        inspect_adapter(f"s3://{BUCKET}", "", 1, 64)
    with pytest.raises(AdapterFormatError, match=r"nothing/adapter_config\.json does not exist"):
        inspect_adapter(f"{root}/nothing", "", 1, 64)


# -- reads through the disk tier ----------------------------------------------------------------------------


def test_a_load_fetches_once_per_node_and_serves_the_registered_bytes(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    _, root = store
    catalog = catalog_for(root)
    catalog.register_dir(root)
    rank0, rank1 = cache_for(catalog), cache_for(catalog)  # two ranks of one node: one disk tier directory
    for cache in (rank0, rank1):
        cache.prefetch("adapter-001").result(timeout=30)
        assert_serves(cache, "adapter-001", local["adapter-001"] / WEIGHTS_FILE)
    assert rank0.stats()["disk_fetches"] + rank1.stats()["disk_fetches"] == 1
    assert rank1.stats()["disk_hits"] == 1
    rank0.prefetch("big-000").result(timeout=30)  # several parts
    assert_serves(rank0, "big-000", local["big-000"] / WEIGHTS_FILE)
    assert not [f for f in disk_files(tmp_path / "disk" / NAMESPACE) if ".part." in f]
    rank0.check_integrity()


def test_stage_fetches_into_the_disk_tier_ahead_of_need(
    store: tuple[S3Server, str], cache_for: Callable[..., WorkerCache]
) -> None:
    _, root = store
    catalog = catalog_for(root)
    spec = catalog.register("adapter-002", f"{root}/adapter-002")
    cache = cache_for(catalog)
    cache.stage("adapter-002")
    assert spec.store is not None
    wait_for(lambda: cache.disk.contains(spec.store), "adapter-002 in the disk tier")  # type: ignore[arg-type]


def test_a_disk_warm_stage_fetches_the_object_into_the_disk_tier_only(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    """The planner's ``Stage(disk=True)`` (a disk warm stage): the store adapter's object lands in the node's disk
    tier and nothing in the host tier or a slot; a later load reads the disk copy (no second fetch) and serves the
    registered bytes. A host warm stage of a key queued for the disk makes it a host one. A disk stage of an object
    replaced in the store since it was registered is refused, counted, and leaves nothing behind."""
    from workers.control.commands import CommandGate

    server, root = store
    catalog = catalog_for(root)
    specs = {n: catalog.register(n, f"{root}/{n}") for n in ("adapter-000", "adapter-001", "adapter-002")}
    cache = cache_for(catalog)
    gate = CommandGate(cache, lambda delta: None)
    v = {n: s.version for n, s in specs.items()}
    gate.apply([Stage("adapter-001", v["adapter-001"], 0, 0, speculative=True, disk=True)])
    wait_for(lambda: cache.disk.contains(specs["adapter-001"].store), "adapter-001 in the disk tier")  # type: ignore[arg-type]
    wait_for(lambda: gate.warm_queue().pending() == 0, "the disk stage done")
    assert cache.host.contents() == [] and cache.residency() == [], "a disk stage reads nothing into the host tier"
    assert cache.disk.stats()["disk_fetches"] == 1
    cache.prefetch("adapter-001").result(timeout=30)
    assert cache.disk.stats()["disk_fetches"] == 1 and cache.disk.stats()["disk_hits"] >= 1, "the load read the copy"
    assert_serves(cache, "adapter-001", local["adapter-001"] / WEIGHTS_FILE)
    replace_object(server, specs["adapter-000"], (local["adapter-002"] / WEIGHTS_FILE).read_bytes())
    gate.apply([Stage("adapter-000", v["adapter-000"], 0, 1, speculative=True, disk=True)])
    wait_for(lambda: cache.disk.stats()["disk_stage_failures"] == 1, "the replaced object's stage refused")
    wait_for(lambda: gate.warm_queue().pending() == 0, "the disk stage done")
    assert not cache.disk.contains(specs["adapter-000"].store)  # type: ignore[arg-type]
    assert not [f for f in disk_files(tmp_path / "disk" / NAMESPACE) if "part" in f], "nothing half-fetched kept"
    gate.apply([Stage("adapter-002", v["adapter-002"], 0, 2, speculative=True, disk=True),
                Stage("adapter-002", v["adapter-002"], 1, 2, speculative=True)])  # the host's own warm stage
    wait_for(lambda: any(k.name == "adapter-002" for k in cache.host.contents()), "adapter-002 read into the host")
    gate.close()
    cache.check_integrity()


def yielding_cache(store: tuple[S3Server, str], cache_for: Callable[..., WorkerCache],
                   monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerCache, AdapterSpec, AdapterSpec]:
    """A cache over the store whose warm fetches yield for as long as a demand lasts, and two adapters registered:
    one of four 1 MiB blocks (a pause before each) and a small one."""
    monkeypatch.setattr(fetch_pace, "YIELD_MAX_S", 120.0)
    _, root = store
    catalog = catalog_for(root)
    big = catalog.register("big-000", f"{root}/big-000")
    small = catalog.register("adapter-000", f"{root}/adapter-000")
    return cache_for(catalog), big, small


def test_a_disk_warm_stages_fetch_yields_the_store_to_demand_until_a_read_joins_it(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative reads yield the store at once (issue 42 item 3): while a demand read is on the node, a disk warm
    stage's fetch takes nothing more from the store; a read that needs that very object joins the fetch, which then
    yields no more (no read waits behind a paused fetch of its own adapter); with no demand it runs straight on."""
    import threading

    cache, big, small = yielding_cache(store, cache_for, monkeypatch)
    demand = threading.Event()
    demand.set()
    staged = cache.disk.stage(big, demand.is_set)
    assert staged is not None
    wait_for(lambda: cache.disk.pace.yields == 1, "the warm fetch yielding to the demand read")
    assert not staged.done() and not cache.disk.contains(big.store)  # type: ignore[arg-type]
    joined: list[bool] = []

    def read() -> None:  # a load of the same adapter: its read waits for the fetch and promotes it
        with cache.disk.held(big) as local_spec:
            joined.append(local_spec.source is not None)

    reader = threading.Thread(target=read)
    reader.start()
    staged.result(timeout=60)  # the demand still on: the fetch ran on once the read joined it
    reader.join(timeout=60)
    assert joined == [True] and cache.disk.stats()["disk_fetches"] == 1
    demand.clear()
    again = cache.disk.stage(small, demand.is_set)
    assert again is not None
    again.result(timeout=60)
    assert cache.disk.contains(small.store) and cache.disk.pace.yields == 1  # type: ignore[arg-type]
    cache.prefetch("big-000").result(timeout=30)
    assert_serves(cache, "big-000", local["big-000"] / WEIGHTS_FILE)
    cache.check_integrity()


def test_a_host_warm_stages_fetch_yields_the_store_to_demand_until_a_load_joins_it(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative reads yield the store at once (issue 42 item 3), a host warm stage's too: while another process
    on the node has a demand read, a warm stage's read of a store adapter not on the node's disk fetches nothing
    more of its object; a load of that adapter joins the read, which then yields no more though the demand is still
    on, and the slot serves the registered bytes; with no demand a warm read runs straight on."""
    cache, big, small = yielding_cache(store, cache_for, monkeypatch)
    node = cache.host.demand.node
    other = NodeReads(node.path, ident=f"{os.getpid()}-{started(os.getpid())}.other-rank")
    marker = other.mark()  # another rank's load reading on this node
    assert marker and node.busy() == 1
    with cache.host.demand.speculative():
        warm = cache.stage("big-000")
    assert warm is not None
    wait_for(lambda: cache.disk.stats()["disk_yields"] >= 1, "the warm fetch yielding to the other rank's demand")
    assert not warm.done() and not cache.disk.contains(big.store)  # type: ignore[arg-type]
    cache.prefetch("big-000").result(timeout=60)  # joins the warm read: it runs on, the other demand still on
    warm.result(timeout=5)
    assert cache.disk.stats()["disk_fetches"] == 1 and node.busy() == 1
    assert_serves(cache, "big-000", local["big-000"] / WEIGHTS_FILE)
    other.unmark(marker)
    yields = cache.disk.pace.yields
    with cache.host.demand.speculative():
        again = cache.stage("adapter-000")
    assert again is not None
    again.result(timeout=60)
    assert cache.disk.contains(small.store) and cache.disk.pace.yields == yields  # type: ignore[arg-type]
    cache.check_integrity()


def _store_share_cache(store: tuple[S3Server, str], tmp_path: Path, prefix: str, count: int, num_slots: int,
                       disk_objects: float = 0.0) -> tuple[list[Path], list[AdapterSpec], WorkerCache, list[float]]:
    """``count`` tiny adapters of ``prefix`` in the S3 server, registered, and a CPU cache whose host tier holds two
    of their shards, not three (its disk tier ``disk_objects`` objects, if given), its ``StoreShare`` on the returned
    clock (``now[0]``): the rank's time waiting for the store, set by the test."""
    server, root = store
    dirs = make_adapters(tmp_path / prefix, SynthConfig(model="tiny", count=count, rank="128", dtype="float32",
                                                           prefix=prefix))
    for d in dirs:
        server.upload_dir(BUCKET, f"{root.removeprefix(f's3://{BUCKET}/')}/{d.name}", d)
    catalog = catalog_for(root, max_rank=128)
    specs = [catalog.register(d.name, f"{root}/{d.name}") for d in dirs]
    config = WorkerConfig(num_slots=num_slots, device="cpu", host=HostTierConfig(host_bytes=1 << 20, pin=False),
                          disk=DiskTierConfig(disk_cache=str(tmp_path / "disk")))
    probe = WorkerCache(config, catalog)
    shard = max(probe.layout_of(s.name).nbytes for s in specs)
    probe.close()
    host = HostTierConfig(host_bytes=max(1 << 20, 2 * shard + shard // 2), pin=False)
    disk = config.disk
    if disk_objects:
        disk = dataclasses.replace(disk, disk_cache_bytes=int(disk_objects * max(s.file_bytes for s in specs)))
    cache = WorkerCache(dataclasses.replace(config, host=host, disk=disk), catalog)
    now = [0.0]
    cache.disk.store_share = StoreShare(clock=lambda: now[0])
    return dirs, specs, cache, now


@pytest.mark.parametrize("saturated", [True, False])
def test_a_copy_the_host_tier_lets_go_of_becomes_the_disk_tiers_most_recent_while_demand_saturates_the_store(
    store: tuple[S3Server, str], tmp_path: Path, saturated: bool
) -> None:
    """While the rank's demand reads wait for the store ``victim_share`` of the last minute (the store saturated),
    the disk tier is a victim cache of the node's memory: when a host tier evicts a store adapter's shard, its disk
    copy becomes the most recent, so the disk keeps it over a copy read from here more lately (a hot adapter is
    served from memory and never read from the disk: by its reads alone the LRU lets it go first). With the store
    not saturated the LRU is by reads alone. The kept copy still proves its version and serves the registered bytes."""
    dirs, specs, cache, now = _store_share_cache(store, tmp_path, "mid", 3, num_slots=2, disk_objects=2.5)
    try:
        proofs = [cache.disk.dir / f"{disk_tier.entry_name(s.store)}.crc" for s in specs]  # type: ignore[arg-type]
        for i in (0, 1):  # warm stages: no disk stage of their own beside the host read (``WorkerCache.stage``)
            with cache.host.demand.speculative():
                staged = cache.stage(dirs[i].name)
            assert staged is not None
            staged.result(timeout=30)
            os.utime(proofs[i], (time.time() - 20 + 10 * i,) * 2)  # mid-000 read from the disk longest ago
        if saturated:  # a demand read waited for the store the last minute: 1 - 1/e of it, past victim_share 0.3
            with cache.disk.store_share.waiting():
                now[0] += 60.0
        assert cache.disk.store_share.share() == pytest.approx(0.632 if saturated else 0.0, abs=1e-3)
        with cache.host.demand.speculative():  # the host tier lets go of mid-000 for it, then the disk of one copy
            staged = cache.stage(dirs[2].name)
        assert staged is not None
        staged.result(timeout=30)
        assert cache.stats()["disk_touches"] == int(saturated)
        assert [p.exists() for p in proofs] == [saturated, not saturated, True]
        keys = [AdapterKey(s.name, s.version) for s in specs]
        assert not cache.host.contains(keys[0]) and cache.host.contains(keys[2])
        kept = 0 if saturated else 1
        fetches = cache.stats()["disk_fetches"]
        cache.prefetch(dirs[kept].name).result(timeout=30)  # from the kept copy: no fetch, the registered bytes
        assert cache.stats()["disk_fetches"] == fetches == 3
        assert_serves(cache, dirs[kept].name, dirs[kept] / WEIGHTS_FILE)
        cache.check_integrity()
    finally:
        cache.close()


def test_a_shard_written_back_from_a_slot_keeps_its_store_object_so_its_eviction_touches_the_disk_copy(
    store: tuple[S3Server, str], tmp_path: Path
) -> None:
    """Exclusive tiers: a slot's shard written back into the host tier carries its store object (``SlotLoad.store``
    into ``HostTier.write_back``), so when the host tier evicts that entry while demand saturates the store its disk
    copy becomes the most recent, as for a staged entry; the copy still serves the registered bytes."""
    dirs, specs, cache, now = _store_share_cache(store, tmp_path, "wb", 4, num_slots=1)
    assert cache.config.host.tiers == "exclusive"
    try:
        keys = [AdapterKey(s.name, s.version) for s in specs]
        proofs = [cache.disk.dir / f"{disk_tier.entry_name(s.store)}.crc" for s in specs]  # type: ignore[arg-type]
        cache.prefetch(dirs[0].name).result(timeout=30)  # into the one slot; its host copy let go once READY
        cache.prefetch(dirs[1].name).result(timeout=30)  # takes the slot: wb-000's shard is written back
        wait_for(lambda: cache.host.contains(keys[0]), "wb-000's shard written back into the host tier")
        assert cache.stats()["disk_fetches"] == 2
        old = time.time() - 100
        os.utime(proofs[0], (old, old))
        with cache.disk.store_share.waiting():  # demand waited for the store the last minute: past victim_share
            now[0] += 60.0
        assert cache.disk.store_share.past(cache.config.disk.victim_share)
        for i in (2, 3):  # warm stages fill the tier: the written-back wb-000, least recently used, goes
            with cache.host.demand.speculative():
                staged = cache.stage(dirs[i].name)
            assert staged is not None
            staged.result(timeout=30)
        assert not cache.host.contains(keys[0])
        assert cache.stats()["disk_touches"] == 1
        assert proofs[0].stat().st_mtime > old + 50  # the written-back entry's copy is the disk's most recent now
        cache.prefetch(dirs[0].name).result(timeout=30)  # from that copy: no fetch, the registered bytes
        assert cache.stats()["disk_fetches"] == 4
        assert_serves(cache, dirs[0].name, dirs[0] / WEIGHTS_FILE)
        cache.check_integrity()
    finally:
        cache.close()


@pytest.mark.parametrize("order", ["soonest", "shared"])
def test_a_demand_fetch_waits_its_turn_behind_one_that_ends_sooner_never_one_that_ends_later(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache],
    monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """The node's demand fetches take the store one at a time, the one that would end soonest alone first (issue 42:
    a burst of cold adapters shared the store and ended late all together): while another rank's fetch that ends
    sooner moves, a demand fetch reads nothing more of its object (a far larger one's fetch, also in flight, does not
    hold it); once that one ends it runs on, its copy proven and served, and the store's rate it measured is what
    the order counts from then on. ``fetch_order="shared"``: nothing holds it. Its marker goes with it."""
    import threading

    monkeypatch.setattr(fetch_pace, "YIELD_MAX_S", 120.0)  # a pause lasts until the smaller fetch ends
    _, root = store
    catalog = catalog_for(root)
    big = catalog.register("big-000", f"{root}/big-000")
    cache = cache_for(catalog, fetch_order=order)
    assert big.store is not None
    path = NodeFetches().path
    other = NodeFetches(path, ident=f"{os.getpid()}-{started(os.getpid())}.other-rank")
    smaller, larger = other.enter(1), other.enter(big.store.size * 2000)  # ends at once; in 40 s (at 200 MB/s)
    fetched = threading.Event()

    def demand() -> None:
        with cache.disk.held(big):
            fetched.set()

    reader = threading.Thread(target=demand)
    reader.start()
    try:
        if order == "soonest":
            wait_for(lambda: cache.disk.stats()["disk_turns"] >= 1, "the fetch waiting for the smaller one")
            assert not fetched.is_set() and not cache.disk.contains(big.store)
            other.leave(smaller)
        reader.join(timeout=60)
        assert fetched.is_set() and cache.disk.stats()["disk_fetches"] == 1
        assert cache.disk.stats()["disk_turns"] == (1 if order == "soonest" else 0)
        left = [larger] if order == "soonest" else sorted([smaller, larger])
        assert sorted(p.name for p in path.iterdir()) == left, "the fetch's own marker went with it"
    finally:
        other.leave(smaller)
        other.leave(larger)
        reader.join(timeout=60)
    cache.prefetch("big-000").result(timeout=30)
    assert_serves(cache, "big-000", local["big-000"] / WEIGHTS_FILE)
    cache.check_integrity()


def test_a_warm_fetch_yields_no_more_once_another_process_of_the_node_waits_for_its_object(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A demand marker says that a read runs on the node, not which object it waits for: a rank's read of the very
    object another rank's warm fetch is fetching (its file lock keeps the read out) says so (``awaiting``), and the
    fetch runs on at once, though demand reads stay on the node; the reader then finds the copy, fetched once."""
    import threading

    cache, big, _ = yielding_cache(store, cache_for, monkeypatch)
    staged = cache.disk.stage(big, lambda: True)  # the node is busy for as long as the test runs
    assert staged is not None
    wait_for(lambda: cache.disk.pace.yields == 1, "the warm fetch yielding")
    other = DiskTier(DiskTierConfig(disk_cache=str(tmp_path / "disk")))  # another rank's tier: its own file locks
    read: list[str] = []

    def demand() -> None:
        with other.held(big) as local_spec:
            read.append(str(local_spec.source.path))  # type: ignore[union-attr]

    reader = threading.Thread(target=demand)
    reader.start()
    staged.result(timeout=60)  # without the signal each of its four blocks would wait YIELD_MAX_S (120 s)
    reader.join(timeout=60)
    assert read and cache.disk.stats()["disk_fetches"] == 1 and other.stats()["disk_fetches"] == 0
    assert other.stats()["disk_hits"] == 1 and cache.disk.pace.yielded_s < 60
    cache.prefetch("big-000").result(timeout=30)
    assert_serves(cache, "big-000", local["big-000"] / WEIGHTS_FILE)
    other.close()
    cache.check_integrity()


def test_an_object_replaced_after_registration_is_refused_and_nothing_is_kept(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    server, root = store
    catalog = catalog_for(root)
    spec = catalog.register("adapter-000", f"{root}/adapter-000")
    replace_object(server, spec, (local["adapter-002"] / WEIGHTS_FILE).read_bytes())  # same size, other bytes
    cache = cache_for(catalog)
    with pytest.raises(
        AdapterChangedError,
        match=f"{spec.store.url} was replaced in the store since it was "  # type: ignore[union-attr]
        f"registered as version {spec.version}",
    ):
        cache.prefetch("adapter-000").result(timeout=30)
    assert disk_files(tmp_path / "disk" / NAMESPACE) == []
    assert cache.residency() == [] and cache.host.arena.used_bytes == 0
    cache.check_integrity()


def fetch_hook(monkeypatch: pytest.MonkeyPatch, after_first_part: Callable[[], None]) -> None:
    """Run ``after_first_part`` once the first part of a fetch is written (what happens to the store then is
    real: the server's object replaced, the server stopped or killed)."""
    real = disk_tier.fetch_object

    def hooked(s3: Any, source: Any, fd: int, parallel: int, part_bytes: int, on_part: Any = None,
               pause: Any = None) -> Any:
        return real(s3, source, fd, parallel, part_bytes, lambda k: after_first_part() if k == 0 else None, pause)

    monkeypatch.setattr(disk_tier, "fetch_object", hooked)


def test_an_object_replaced_mid_fetch_is_never_served_nor_mixed(
    store: tuple[S3Server, str],
    local: dict[str, Path],
    cache_for: Callable[..., WorkerCache],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, root = store
    catalog = catalog_for(root)
    spec = catalog.register("big-000", f"{root}/big-000")
    assert spec.store is not None and spec.store.size > 3 << 20
    original = (local["big-000"] / WEIGHTS_FILE).read_bytes()
    changed = bytearray(original)
    changed[-4:] = b"\x00" * 4  # a new upload whose first part is the same bytes: only a version check sees it
    fetch_hook(monkeypatch, lambda: replace_object(server, spec, bytes(changed)))
    cache = cache_for(catalog, fetch_parallel=1, fetch_part_bytes=1 << 20)
    with pytest.raises(AdapterChangedError, match="was replaced in the store"):
        cache.prefetch("big-000").result(timeout=30)
    assert disk_files(tmp_path / "disk" / NAMESPACE) == []  # not a byte of the mixed file is kept
    assert cache.residency() == [] and cache.host.arena.used_bytes == 0
    mine = f"-{os.getpid()}-{started(os.getpid())}-"
    assert not [p for p in NodeFetches().path.glob("*") if mine in p.name], "the failed fetch left its turn behind"
    # the new object, registered again, is a new version and serves its own bytes
    monkeypatch.undo()
    set_env(monkeypatch, server.env)
    catalog.register("big-000", f"{root}/big-000")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / WEIGHTS_FILE).write_bytes(changed)
    cache.prefetch("big-000").result(timeout=30)
    assert_serves(cache, "big-000", tmp_path / "new" / WEIGHTS_FILE)


def test_a_tampered_disk_copy_is_never_served(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    _, root = store
    catalog = catalog_for(root)
    catalog.register("adapter-001", f"{root}/adapter-001")
    first = cache_for(catalog)
    first.prefetch("adapter-001").result(timeout=30)
    copy = next(p for p in (tmp_path / "disk" / NAMESPACE).iterdir() if p.suffix == ".safetensors")
    st = copy.stat()
    data = bytearray(copy.read_bytes())
    data[-3:] = b"\x00\x00\x00"
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and mtime: only ctime and the bytes differ
    second = cache_for(catalog)  # another rank of the node, reading the copy the first one fetched
    second.prefetch("adapter-001").result(timeout=30)
    assert_serves(second, "adapter-001", local["adapter-001"] / WEIGHTS_FILE)
    assert second.stats()["disk_fetches"] == 1  # the changed copy dropped and fetched again


def test_a_copy_whose_bytes_differ_from_its_proof_is_refused_then_fetched_again(
    store: tuple[S3Server, str], local: dict[str, Path], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    """A copy torn by a crash keeps its identity (copies are not fsync'ed): its read is refused by the block
    check (a fresh copy is checked in full), the copy is dropped, and the next load fetches it again."""
    _, root = store
    catalog = catalog_for(root)
    catalog.register("adapter-001", f"{root}/adapter-001")
    cache_for(catalog).prefetch("adapter-001").result(timeout=30)
    proof = next(p for p in (tmp_path / "disk" / NAMESPACE).iterdir() if p.suffix == ".crc")
    saved = json.loads(proof.read_text())
    crcs = bytearray(base64.b64decode(saved["b"]))
    crcs[0] ^= 0xFF  # the data file untouched (same identity), its bytes no longer what the proof says
    proof.write_text(json.dumps({**saved, "b": base64.b64encode(bytes(crcs)).decode()}))
    other = cache_for(catalog)  # another rank of the node
    with pytest.raises(AdapterChangedError, match="are not the ones registered"):
        other.prefetch("adapter-001").result(timeout=30)
    assert not [f for f in disk_files(tmp_path / "disk" / NAMESPACE) if f.endswith((".safetensors", ".crc"))]
    other.prefetch("adapter-001").result(timeout=30)
    assert_serves(other, "adapter-001", local["adapter-001"] / WEIGHTS_FILE)
    assert other.stats()["disk_fetches"] == 1


def test_a_full_disk_tier_refuses_before_fetching(
    store: tuple[S3Server, str], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    _, root = store
    catalog = catalog_for(root)
    small, big = catalog.register("adapter-000", f"{root}/adapter-000"), catalog.register("big-000", f"{root}/big-000")
    cache = cache_for(catalog, disk_cache_bytes=2 << 20)
    with pytest.raises(CapacityError, match=r"big-000.*more than the whole disk tier .*raise --disk-cache-bytes"):
        cache.prefetch("big-000").result(timeout=30)
    assert disk_files(tmp_path / "disk" / NAMESPACE) == []
    # room held by a read in progress is not taken: a second tier of the node cannot evict it
    tier = DiskTier(DiskTierConfig(disk_cache=str(tmp_path / "d2"), disk_cache_bytes=1 << 16))  # one small copy
    other = catalog.register("adapter-002", f"{root}/adapter-002")
    with (
        tier.held(small),
        pytest.raises(CapacityError, match="held by reads and fetches in progress"),
        tier.held(other),
    ):
        pass
    with tier.held(other) as spec:  # once let go, the older copy is evicted for it
        assert spec.source is not None and Path(spec.source.path).exists()
    assert tier.evictions == 1
    assert big.file_bytes > 2 << 20 and 2 * small.file_bytes > 1 << 16 > small.file_bytes


def test_two_services_on_one_node_never_evict_each_others_disk_copies(
    store: tuple[S3Server, str], cache_for: Callable[..., WorkerCache], tmp_path: Path
) -> None:
    """Issue 46: services on one node shared one disk-tier directory, so one service's cap evicted another's
    copies. Each has its own now, under the same --disk-cache; a service's ranks still share theirs, and its cap."""
    _, root = store
    catalog = catalog_for(root)
    names = ("adapter-000", "adapter-001", "adapter-002")
    sizes = [catalog.register(name, f"{root}/{name}").file_bytes for name in names]
    one_copy = max(max(sizes), 1 << 16)  # holds any one copy, not two
    assert 2 * min(sizes) > one_copy, sizes
    a = cache_for(catalog, disk_cache_bytes=one_copy, service="svc-a")
    b = cache_for(catalog, disk_cache_bytes=one_copy, service="svc-b")
    assert (a.disk.dir, b.disk.dir) == (tmp_path / "disk" / "svc-a", tmp_path / "disk" / "svc-b")
    a.prefetch("adapter-000").result(timeout=30)
    held_by_a = disk_files(a.disk.dir)
    assert any(f.endswith(".safetensors") for f in held_by_a), held_by_a
    b.prefetch("adapter-001").result(timeout=30)
    b.prefetch("adapter-002").result(timeout=30)  # b's cap is full: b evicts its own older copy, never a's
    assert b.disk.evictions == 1 and a.disk.evictions == 0
    assert disk_files(a.disk.dir) == held_by_a
    a_again = cache_for(catalog, disk_cache_bytes=one_copy, service="svc-a")  # another rank of service a
    a_again.prefetch("adapter-001").result(timeout=30)
    assert a_again.disk.evictions == 1 and not set(held_by_a) & set(disk_files(a.disk.dir)), "a's ranks share a cap"
    with pytest.raises(ConfigError, match="not a service name"):
        DiskTierConfig(disk_cache=str(tmp_path / "disk")).directory("../svc-b")


def test_the_store_timeout_is_a_deadline_for_the_whole_call(
    store: tuple[S3Server, str], local: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore's timeouts are per attempt and its ``max_attempts`` counts retries: a stalled store failed a 1 s call
    after ~3 s (three tries), a 3 s one after ~9 s. A real proxy in front of the real server holds every request
    once stalled."""
    server, prefix = store
    url = StoreUrl.parse(prefix)
    with LatencyProxy(server.url, latency_s=0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # a client of its own (the endpoint is part of its key)
        # the calls around the stalled one get room: their deadline is not what is tested (on the loaded CI machine the
        # call after the stall once spent 1 s before its read, fresh connection and all: stop 51's third run)
        assert [n for n, _ in list_adapters(url, timeout_s=10.0)] == sorted(local), "a normal call through the proxy"
        client(1.0)  # the stalled call's client made before its clock starts, as the 1 s call above made it before
        proxy.latency_s, sent = 30.0, proxy.chunks  # every request from now on stalls
        start = time.monotonic()
        with pytest.raises(AdapterStoreError) as info:
            list_adapters(url, timeout_s=1.0)
        took = time.monotonic() - start
        assert 0.9 < took < 1.5, f"a 1 s store timeout failed the call after {took:.2f} s"
        assert proxy.chunks - sent == 1, "a request was retried past the call's deadline"
        message = str(info.value)
        assert f"{prefix}/: the store at {proxy.url} did not answer or broke off" in message, message
        assert "retries included, has --store-timeout-s 1 s); check that it is up" in message, message
        assert message.endswith("or raise --store-timeout-s"), message
        proxy.latency_s = 0.0
        assert [n for n, _ in list_adapters(url, timeout_s=10.0)] == sorted(local), "the store answers again"


def test_a_refused_connection_is_still_retried_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The deadline bounds retries, it does not remove them: a fast failure (nothing listens) is tried twice."""
    set_env(monkeypatch, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "k",
                          "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"})
    caplog.set_level(logging.DEBUG, logger="botocore.endpoint")
    start = time.monotonic()
    with pytest.raises(AdapterStoreError, match=r"did not answer or broke off .*EndpointConnectionError"):
        list_adapters(StoreUrl.parse("s3://bkt-none/p"), timeout_s=5.0)
    assert time.monotonic() - start < 5.0
    assert sum(r.getMessage().startswith("Sending http request") for r in caplog.records) == ATTEMPTS


def test_a_stalled_server_times_out_and_a_dead_one_fails_cleanly(
    local: dict[str, Path], cache_for: Callable[..., WorkerCache], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with S3Server() as own:  # its own server: this test stops and kills it
        set_env(monkeypatch, own.env)
        own.client().create_bucket(Bucket=BUCKET)
        own.upload_dir(BUCKET, "a/adapter-000", local["adapter-000"])
        own.upload_dir(BUCKET, "a/big-000", local["big-000"])
        catalog = catalog_for(f"s3://{BUCKET}/a", timeout_s=1.0)
        catalog.register_dir(f"s3://{BUCKET}/a")
        cache = cache_for(catalog, fetch_parallel=1, fetch_part_bytes=1 << 20)
        own.pause()
        try:
            with pytest.raises(
                AdapterStoreError,
                match=r"adapter-000/adapter_model.safetensors: the store at .* did "
                r"not answer.*raise --store-timeout-s",
            ):
                cache.prefetch("adapter-000").result(timeout=60)
        finally:
            own.resume()
        assert disk_files(tmp_path / "disk" / NAMESPACE) == []
        cache.prefetch("adapter-000").result(timeout=30)  # the server is back: the same load works
        assert_serves(cache, "adapter-000", local["adapter-000"] / WEIGHTS_FILE)
        fetch_hook(monkeypatch, own.kill)  # dies after the first part of four
        with pytest.raises(
            AdapterStoreError,
            match=r"big-000/adapter_model\.safetensors: the store at .* did not "
            r"answer or broke off",
        ):
            cache.prefetch("big-000").result(timeout=60)
        assert [f for f in disk_files(tmp_path / "disk" / NAMESPACE) if "big" in f or ".part." in f] == []
        assert [r["adapter"] for r in cache.residency()] == ["adapter-000"]
        cache.check_integrity()


def test_store_urls_parse_and_nest() -> None:
    url = StoreUrl.parse("s3://bkt-1/a/b/")
    assert (url.bucket, url.key, str(url / "x")) == ("bkt-1", "a/b", "s3://bkt-1/a/b/x")
    assert (url / "x").under(url) and not StoreUrl.parse("s3://bkt-1/a/bc").under(url)
    with pytest.raises(AdapterPathError, match="no valid bucket"):
        StoreUrl.parse("s3:///key")
    assert dataclasses.replace(CatalogConfig(adapter_roots=("s3://bkt/p",))).adapter_roots == ("s3://bkt/p",)
    assert shell_path("s3://bkt/p") == "s3://bkt/p"  # an option's URL is not made a path of this machine


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_bad_victim_share_is_refused_naming_it_and_the_range(share: float) -> None:
    with pytest.raises(ConfigError, match=r"victim_share is .*; give a share in \[0, 1\], e.g. 0.3 \(1: never\)"):
        DiskTierConfig(victim_share=share)
