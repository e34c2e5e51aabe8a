"""Request-time resolution (issue 44 item 4): an unregistered name under an adapter root registered on demand, one
lookup per name however many requests wait, a deadline, caps, and typed errors. The real ``ControllerCore`` and
``Registrar`` over real PEFT directories, and the real S3-compatible server (moto's server mode, its own process)
behind a counting proxy for the store root."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.probes.s3_local import ThrottleProxy
from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.controller.registrations import Registrar
from lora_cache.controller.resolver import Resolver
from lora_cache.errors import (
    AdapterFormatError,
    CapacityError,
    LoraCacheError,
    NotFoundError,
    ResolveTimeoutError,
)
from tests.s3_server import S3Server, set_env
from tests.test_registrations import Links

BUCKET = "resolve-bkt"


def resolver_for(config: CatalogConfig, hold: asyncio.Event | None = None) -> tuple[ControllerCore, Resolver]:
    """A core, its registrar, and a resolver registering through it (held at ``hold`` until it is set)."""
    core = ControllerCore(ControllerConfig(catalog=config), epoch=1)

    async def plan() -> None:
        pass

    registrar = Registrar(core, Links([]), set(), plan)  # type: ignore[arg-type]

    async def register(name: str, path: str) -> tuple[str, LoraCacheError | None]:
        if hold is not None:
            await hold.wait()
        (done,) = await registrar.register([(name, path)])
        return done.version, done.error

    return core, Resolver(core.catalog, register)


@pytest.fixture
def root(tiny_adapters: Callable[..., list[Path]], tmp_path: Path) -> Path:
    tiny_adapters(3, root=tmp_path / "root")
    return tmp_path / "root"


def test_a_name_under_a_root_registers_on_demand_once(root: Path) -> None:
    core, resolver = resolver_for(CatalogConfig(adapter_roots=(str(root),), model="tiny"))

    async def scenario() -> list[str]:
        return await asyncio.gather(*(resolver.resolve("adapter-001") for _ in range(100)))

    versions = asyncio.run(scenario())
    assert set(versions) == {core.catalog.get("adapter-001").version}
    assert core.paths["adapter-001"] == str(root / "adapter-001") and "adapter-000" not in core.catalog
    assert resolver.stats()["lookups"] == 1 and resolver.stats()["resolved"] == 1
    assert asyncio.run(resolver.resolve("adapter-001")) == versions[0]  # registered now: no lookup
    assert resolver.stats()["lookups"] == 1


def test_refusals_are_typed_and_name_the_fix(root: Path, tmp_path: Path) -> None:
    config = CatalogConfig(adapter_roots=(str(root),), model="tiny")
    _, resolver = resolver_for(config)
    with pytest.raises(NotFoundError, match=r"'ghost' is not registered; register it first .* under none of the roots"):
        asyncio.run(resolver.resolve("ghost"))
    with pytest.raises(AdapterFormatError, match=r"adapter name '\.\./x' is invalid"):
        asyncio.run(resolver.resolve("../x"))
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterFormatError) as bad:  # under a root but bad: its own error, not "not found"
        asyncio.run(resolver.resolve("broken"))
    assert not isinstance(bad.value, NotFoundError) and "broken" in str(bad.value)
    _, off = resolver_for(dataclasses.replace(config, resolve_s=0))
    with pytest.raises(NotFoundError, match=r"is not registered; .*off \(--resolve-s 0\)"):
        asyncio.run(off.resolve("adapter-000"))


def test_caps_and_the_deadline(root: Path) -> None:
    config = CatalogConfig(adapter_roots=(str(root),), model="tiny", resolve_parallel=1, resolve_s=0.2)
    hold = asyncio.Event()
    core, resolver = resolver_for(config, hold)

    async def scenario() -> None:
        first = asyncio.create_task(resolver.resolve("adapter-000"))
        await asyncio.sleep(0)  # its flight started and is held before registering
        with pytest.raises(CapacityError, match=r"\(--resolve-parallel 1\): over capacity; retry shortly"):
            await resolver.resolve("adapter-001")
        with pytest.raises(ResolveTimeoutError, match=r"did not end within --resolve-s 0.2 s \(it goes on"):
            await first
        hold.set()
        while "adapter-000" not in core.catalog:  # the flight went on after the request gave up
            await asyncio.sleep(0.01)
        assert await resolver.resolve("adapter-000") == core.catalog.get("adapter-000").version

    asyncio.run(asyncio.wait_for(scenario(), 30))
    one = core.catalog.get("adapter-000").file_bytes
    _, capped = resolver_for(dataclasses.replace(config, resolve_bytes=one, resolve_s=10))
    assert asyncio.run(capped.resolve("adapter-000"))
    with pytest.raises(CapacityError, match=rf"hold {one} bytes \(--resolve-bytes {one}\): over capacity"):
        asyncio.run(capped.resolve("adapter-001"))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as srv:
        srv.client().create_bucket(Bucket=BUCKET)
        yield srv


def test_a_thousand_requests_for_one_name_ask_the_store_once(
    s3: S3Server, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 requests for one unknown name under a store prefix: one lookup (two requests: its config and its
    weights' header); 1,000 more for a name under no root: one request (its config's 404), then none at all while
    the miss is remembered."""
    set_env(monkeypatch, s3.env)
    s3.upload_dir(BUCKET, "tenants/adapter-002", root / "adapter-002")
    with ThrottleProxy(s3.url, rate=1e9, burst=10**9) as proxy:  # admits all: it counts
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        core, resolver = resolver_for(CatalogConfig(adapter_roots=(f"s3://{BUCKET}/tenants",), model="tiny"))

        async def many(name: str) -> list[object]:
            return await asyncio.gather(*(resolver.resolve(name) for _ in range(1000)), return_exceptions=True)

        found = asyncio.run(many("adapter-002"))
        assert set(found) == {core.catalog.get("adapter-002").version} and proxy.passed == 2, proxy.passed
        missing = asyncio.run(many("ghost")) + asyncio.run(many("ghost"))
        assert all(isinstance(e, NotFoundError) for e in missing) and proxy.passed == 3, proxy.passed


def test_a_hint_for_a_name_under_a_root_is_taken_once_it_resolves_and_one_found_nowhere_is_dropped(root: Path) -> None:
    """Issue 44 item 4: ``Hint`` resolved nothing: a hint for a new tenant's adapter was rejected NOT_FOUND, so a
    router that hints before it routes got nothing prefetched. Now such a hint (a known replica, a name nobody
    registered, a root may hold) is answered as ignored, not taken yet, and hinted again once the name resolves in
    the background (prefetched then); a name under no root is rejected as before (or, looked up in the background,
    dropped and counted); a hint to an unknown replica stays rejected."""
    from lora_cache.controller.resolver import unregistered_hints

    core, resolver = resolver_for(CatalogConfig(adapter_roots=(str(root),), model="tiny"))
    core.add_replica("r0", tp=1, slots=2)
    batch = [("h1", "adapter-001", "r0", 5.0), ("h2", "adapter-001@v9", "r0", 5.0), ("h3", "ghost", "r0", 5.0),
             ("h4", "adapter-002", "nowhere", 5.0)]

    async def scenario() -> None:
        outcomes = core.hint_batches([batch], now=1.0)
        (outcome,), waiting = unregistered_hints([batch], outcomes, core.catalog, core.planner.view.replicas(),
                                                 resolver.may_find)
        assert (outcome.accepted, outcome.ignored) == (0, 2) and [r.index for r in outcome.rejections] == [2, 3]
        assert "'ghost' is not registered" in str(outcome.rejections[0].error), "under no root: rejected as before"
        assert sorted(waiting) == ["adapter-001"] and len(waiting["adapter-001"]) == 2
        waiting["ghost"] = [("h5", "ghost", "r0", 5.0)]  # a name a store root might have held: looked up, not found
        taken: list[int] = []
        for name, hints in waiting.items():
            async def again(hints: list = hints) -> None:
                taken.extend(o.accepted for o in core.hint_batches([hints], now=2.0))

            resolver.later(name, again)
        while resolver.stats()["hints_waiting"]:
            await asyncio.sleep(0.01)
        assert taken == [1], "adapter-001's plain hint taken; its hint naming a version not kept rejected alone"
        assert "adapter-001" in core.catalog and "ghost" not in core.catalog
        assert resolver.stats()["hints_dropped"] == 1 and resolver.lookups == 2
        assert [h.adapter for h in core.planner.view.hints("r0")] == ["adapter-001"]
        assert resolver.may_find("adapter-002")
        resolver.forgot("adapter-002")  # an operator unregistered it: a hint does not bring it back
        assert not resolver.may_find("adapter-002") and not resolver.may_find("ghost")

    asyncio.run(scenario())
    core.check_integrity()
