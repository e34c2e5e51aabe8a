"""``HostTierConfig.direct_reads`` (issue 42): a miss whose file is out of the page cache has its runs read by
``O_DIRECT`` (``workers.reads.positioned.read_runs_direct``) through an aligned bounce buffer. It must stage exactly
the bytes a page-cache read stages, at every TP rank and in reader threads or processes; leave the file's pages
out of the page cache; fall back to the page cache where the file system refuses ``O_DIRECT``; and fail a file
cut short while it is read as any read does, leaving the tier as it was."""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import workers.staging.host_tier as host_tier_module
from bench.store import cached_pages
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.files import RACY_NS
from lora_cache.adapters.shapes import SHAPES
from lora_cache.adapters.shards import ShardLayout, shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.errors import AdapterChangedError, ConfigError
from tests.pages import direct_refused
from workers.reads import positioned
from workers.reads import shard as shard_module
from workers.reads.plan import Run
from workers.reads.positioned import FileShrank, read_runs, read_runs_direct
from workers.reads.shard import drop_pages, read_shard
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostTier

BF16 = torch.bfloat16  # the files' dtype: a shard of it is read as runs (another dtype would be conversions)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    why = direct_refused(tmp_path)
    if why:
        pytest.skip(why)
    return tmp_path


def tier(reads: str, direct: str = "on", host_bytes: int = 1 << 20) -> HostTier:
    """A tier reading on its threads ("thread"), in one reader process per read ("process"), or split over three
    ("split": each part decides nothing itself; the tier decided the read's way at dispatch)."""
    if reads == "split":
        return HostTier(HostTierConfig(host_bytes=host_bytes, read_threads=3, read_parallel=3, read_split=3, pin=False,
                                       reads="process", direct_reads=direct))
    return HostTier(HostTierConfig(host_bytes=host_bytes, read_threads=2, read_parallel=3, pin=False, reads=reads,
                                   direct_reads=direct))


def expected(spec: Any, lay: ShardLayout) -> torch.Tensor:
    want = torch.zeros(lay.numel, dtype=lay.dtype)
    read_shard(spec, lay, want)  # positioned reads through the page cache
    return want


def reads_right(catalog: AdapterCatalog, names: list[str]) -> None:
    """Each of ``names`` read by a direct-reads tier on threads stages the shard a page-cache read does."""
    t = tier("thread")
    try:
        for name in names:
            spec = catalog.get(name)
            lay = shard_layout(spec, SHAPES["tiny"], 1, 0, BF16)
            assert torch.equal(t.fetch(spec, lay)[0].result(timeout=60).tensor, expected(spec, lay))
    finally:
        t.close()


def test_read_runs_direct_puts_every_run_where_a_positioned_read_does(direct_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs at unaligned offsets, some close enough to share one read, some far apart, one longer than a read's
    span, one ending at the file's unaligned end: each lands where ``read_runs`` puts it; a run past the end raises
    ``FileShrank``."""
    monkeypatch.setattr(positioned, "DIRECT_SPAN", 64 << 10)
    monkeypatch.setattr(positioned, "DIRECT_GAP", 8 << 10)
    size = 1_000_003
    data = random.Random(7).randbytes(size)
    path = direct_dir / "f.bin"
    path.write_bytes(data)
    rng = random.Random(11)
    runs, at = [], 0
    for start, nbytes in [(1, 5), (4093, 10), (5000, 3000), (9001, 100), (30_000, 200_000), (400_000, 17),
                          (400_100, 4096), (size - 12_345, 12_345)] + [(rng.randrange(500_000, 900_000),
                                                                        rng.randrange(1, 9000)) for _ in range(20)]:
        runs.append(Run(start, at, nbytes))
        at += nbytes + rng.randrange(0, 3)
    rng.shuffle(runs)
    want = torch.zeros(at, dtype=torch.uint8)
    got = torch.zeros(at, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        read_runs(fd, memoryview(want.numpy()), runs)  # type: ignore[arg-type]
        read_runs_direct(dfd, got, runs)
        assert torch.equal(got, want)
        for run in runs:
            assert bytes(got[run.at : run.at + run.nbytes].numpy()) == data[run.start : run.start + run.nbytes]
        with pytest.raises(FileShrank):
            read_runs_direct(dfd, got, [Run(size - 10, 0, 11)])
    finally:
        os.close(fd)
        os.close(dfd)


@pytest.mark.parametrize("reads", ["thread", "process"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_direct_read_stages_the_bytes_a_page_cache_read_does(direct_dir: Path, make_catalog: Callable[..., Any],
                                                               reads: str, tp: int) -> None:
    """At every rank of TP 1 and 2 (runs and column slices), a cold file read with ``direct_reads`` stages the
    same shard as a positioned read through the page cache, and counts the same bytes."""
    paths = make_adapters(direct_dir / "ad", SynthConfig(model="tiny", count=2, rank="16", seed=3))
    catalog: AdapterCatalog = make_catalog(paths[0].parent)
    spec = catalog.get(catalog.names()[0])
    for rank in range(tp):
        lay = shard_layout(spec, SHAPES["tiny"], tp, rank, BF16)
        want = expected(spec, lay)
        drop_pages(spec)
        t = tier(reads)
        try:
            entry = t.fetch(spec, lay)[0].result(timeout=120)
            assert torch.equal(entry.tensor, want)
            assert entry.bytes_read == sum(e.numel for e in lay.entries) * 2
            t.check_integrity()
        finally:
            t.close()


@pytest.fixture(scope="module")
def settled_8b(tmp_path_factory: pytest.TempPathFactory) -> AdapterCatalog:
    """A 42 MB 8B rank-8 adapter registered once its racy window is over (``lora_cache.adapters.files.RACY_NS``):
    a version registered within it has every block checked by reads through the page cache, as it should."""
    root = tmp_path_factory.mktemp("settled")
    why = direct_refused(root)
    if why:
        pytest.skip(why)
    paths = make_adapters(root / "ad", SynthConfig(model="llama-3.1-8b", count=1, rank="8", seed=5))
    weights = paths[0] / "adapter_model.safetensors"
    with open(weights, "rb") as f:
        os.fsync(f.fileno())  # written back: POSIX_FADV_DONTNEED drops only clean pages
    wait = RACY_NS / 1e9 - (time.time() - weights.stat().st_ctime)
    if wait > 0:
        time.sleep(wait + 0.05)  # the clock passing a fixed window, not a race: nothing else runs meanwhile
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root / "ad"),), model="llama-3.1-8b", max_rank=8))
    catalog.register_dir(root / "ad")
    assert not catalog.get(catalog.names()[0]).source.racy  # type: ignore[union-attr]
    return catalog


@pytest.mark.parametrize("reads", ["thread", "process", "split"])
def test_a_direct_read_leaves_a_cold_file_out_of_the_page_cache(settled_8b: AdapterCatalog, reads: str) -> None:
    """A 42 MB 8B rank-8 file, its pages dropped: a read through the page cache leaves all of it there, a direct
    read almost none (its header's and one sampled block's reads, and their readahead); both stage the same
    bytes. A read split over three reader processes reads every part directly: each part used to ask for itself
    whether the file was cold, and the first one's question (a read of the middle page) could warm it for the
    others. A file already in the page cache is read through it (nothing is gained by going around it)."""
    spec = settled_8b.get(settled_8b.names()[0])
    weights = Path(str(spec.weights))
    lay = shard_layout(spec, SHAPES["llama-3.1-8b"], 1, 0, BF16)
    shards = {}
    for direct in ("off", "on"):
        drop_pages(spec)
        if cached_pages(weights)[0]:
            pytest.skip(f"{weights}: its pages stay in the page cache after POSIX_FADV_DONTNEED here")
        t = tier(reads, direct, host_bytes=lay.nbytes + (8 << 20))
        try:
            shards[direct] = t.fetch(spec, lay)[0].result(timeout=300).tensor.clone()
        finally:
            t.close()
        held, pages = cached_pages(weights)
        if direct == "on":
            assert held < pages // 10, f"a direct read left {held} of {pages} pages in the page cache"
        else:  # the measure tells them apart (the kernel may reclaim a few pages of a loaded machine meanwhile)
            assert held > pages * 9 // 10, f"a page-cache read left only {held} of {pages} pages in the page cache"
    assert torch.equal(shards["on"], shards["off"])
    if reads == "thread":  # a warm file: no O_DIRECT open at all (seen in this process only)
        opened: list[int] = []
        real_open = os.open

        def spy(path: Any, flags: int, *args: Any, **kw: Any) -> int:
            opened.append(flags)
            return real_open(path, flags, *args, **kw)

        weights.read_bytes()  # in the page cache whole
        t = tier(reads, "on", host_bytes=lay.nbytes + (8 << 20))
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(os, "open", spy)
                got = t.fetch(spec, lay)[0].result(timeout=300).tensor
            assert torch.equal(got, shards["off"])
        finally:
            t.close()
        assert opened and not any(f & os.O_DIRECT for f in opened)


def test_a_file_system_that_refuses_o_direct_is_read_through_the_page_cache(
        tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """tmpfs refuses ``O_DIRECT`` (EINVAL): the read goes through the page cache, stages the same bytes, and says
    so once per file system."""
    paths = tiny_adapters(count=2, rank="16")
    catalog: AdapterCatalog = make_catalog(paths[0].parent)
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(shard_module.os, "open", refusing)
    monkeypatch.setattr(host_tier_module, "is_cold", lambda spec: True)  # as if out of the page cache
    monkeypatch.setattr(shard_module, "_NO_DIRECT", set())
    caplog.set_level(logging.INFO, logger=shard_module.__name__)
    reads_right(catalog, catalog.names()[:2])
    told = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(told) == 1 and "through the page cache" in told[0].getMessage()


@pytest.mark.parametrize("change", ["truncate", "append"])
def test_a_file_changed_during_a_direct_read_fails_it_and_leaves_the_tier_as_it_was(
        direct_dir: Path, make_catalog: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """The file is cut short (or grown) after it was opened and proven, before its first run is read by
    ``O_DIRECT``: the read fails with ``AdapterChangedError``, nothing of it is staged, and the repaired file is then
    read whole and right."""
    paths = make_adapters(direct_dir / "ad", SynthConfig(model="tiny", count=1, rank="16", seed=9))
    catalog: AdapterCatalog = make_catalog(paths[0].parent)
    spec = catalog.get(catalog.names()[0])
    weights = Path(str(spec.weights))
    pristine = weights.read_bytes()
    lay = shard_layout(spec, SHAPES["tiny"], 1, 0, BF16)
    want = expected(spec, lay)
    real = positioned.read_runs_direct
    done: list[bool] = []

    def changed_first(dfd: int, dest: torch.Tensor, runs: Any) -> None:
        if not done:
            done.append(True)
            with open(weights, "r+b") as f:
                if change == "truncate":
                    f.truncate(len(pristine) // 2)
                else:
                    f.seek(0, os.SEEK_END)
                    f.write(b"\0" * 4096)
        real(dfd, dest, runs)

    monkeypatch.setattr(positioned, "read_runs_direct", changed_first)
    monkeypatch.setattr(host_tier_module, "is_cold", lambda spec: True)
    t = tier("thread")
    try:
        before = (list(t._entries), list(t.arena._free), dict(t.arena._used), t.bytes_read)
        with pytest.raises(AdapterChangedError, match=str(weights)):
            t.fetch(spec, lay)[0].result(timeout=60)
        assert done and (list(t._entries), list(t.arena._free), dict(t.arena._used), t.bytes_read) == before
        t.check_integrity()
        tmp = weights.with_suffix(".restore")
        tmp.write_bytes(pristine)
        os.replace(tmp, weights)  # the registered bytes back, a new identity
        assert torch.equal(t.fetch(spec, lay)[0].result(timeout=60).tensor, want)
    finally:
        t.close()


def test_read_ahead_and_direct_reads_together_are_refused() -> None:
    for mode in ("on", "auto"):
        with pytest.raises(ConfigError, match=f"read_ahead is on and direct_reads is '{mode}'"):
            HostTierConfig(read_ahead=True, direct_reads=mode)


def test_the_benchmark_refuses_read_ahead_with_direct_reads_before_it_starts() -> None:
    """``bench.run --read-ahead`` (the A/B of the cold reads' ways in bench/gpu/issue42.sh, DIRECT=ahead) goes with
    ``--direct-reads off`` only, refused with the fix named before any adapter is made."""
    from bench.config import BenchConfig

    assert BenchConfig(read_ahead=True).read_ahead
    for mode in ("on", "auto"):
        with pytest.raises(ConfigError, match=f"--read-ahead with --direct-reads {mode}.*give --direct-reads off"):
            BenchConfig(read_ahead=True, direct_reads=mode)


def test_direct_reads_takes_its_three_settings_and_its_first_form() -> None:
    """off, on and auto; True and False (the setting's first form, a flag) are on and off; anything else is refused
    with the choices named."""
    assert [HostTierConfig(direct_reads=m).direct_reads for m in ("off", "on", "auto")] == ["off", "on", "auto"]
    assert HostTierConfig(direct_reads=True).direct_reads == "on"  # type: ignore[arg-type]
    assert HostTierConfig(direct_reads=False).direct_reads == "off"  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="direct_reads 'yes' is not one of off, on, auto"):
        HostTierConfig(direct_reads="yes")


def test_a_direct_read_the_device_refuses_is_read_again_through_the_page_cache(
        direct_dir: Path, make_catalog: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A device whose logical block is larger than 4 KiB refuses the aligned reads themselves (EINVAL), after the
    open succeeded: each refused task's runs are read again through the page cache, the shard is right, and it is
    told once, not as a corrupt file."""
    paths = make_adapters(direct_dir / "ad", SynthConfig(model="tiny", count=2, rank="16", seed=4))
    catalog: AdapterCatalog = make_catalog(paths[0].parent)
    refused: list[int] = []

    def refusing(dfd: int, dest: torch.Tensor, runs: Any) -> None:
        refused.append(dfd)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(positioned, "read_runs_direct", refusing)
    monkeypatch.setattr(positioned, "_REFUSED", [])
    monkeypatch.setattr(host_tier_module, "is_cold", lambda spec: True)
    caplog.set_level(logging.WARNING, logger=positioned.__name__)
    reads_right(catalog, catalog.names())
    told = [r for r in caplog.records if "O_DIRECT reads were refused" in r.getMessage()]
    assert refused and len(told) == 1


@pytest.mark.parametrize(("how", "way"), [({}, ""), ({"direct_reads": "on"}, "direct"),
                                          ({"read_ahead": True}, "ahead"), ({"direct_reads": "auto"}, "preadv")])
def test_a_loads_record_names_the_way_its_cold_read_went(direct_dir: Path, make_catalog: Callable[..., Any],
                                                         monkeypatch: pytest.MonkeyPatch, how: dict[str, Any],
                                                         way: str) -> None:
    """A host-tier miss of a file found cold: its READY record's ``read_way`` is the way its read went (a demand load
    of an "auto" tier that has chosen nothing goes through the page cache); off (and no ``read_ahead``), nothing is
    decided, so none is named; a host hit names none either. The bench's load log carries it
    (``bench.real``), so a run tells which way each miss read; the cache's stats count the tier's cold reads by
    way."""
    import lora_cache.runtime.metrics as metrics_module
    from workers.cache import WorkerCache, WorkerConfig
    from workers.counters import COLD_WAYS

    paths = make_adapters(direct_dir / "ad", SynthConfig(model="tiny", count=1, rank="16", seed=6))
    catalog: AdapterCatalog = make_catalog(paths[0].parent)
    monkeypatch.setattr(host_tier_module, "is_cold", lambda spec: True)
    cache = WorkerCache(WorkerConfig(num_slots=1, device="cpu", chunk_bytes=0, dtype="bfloat16",
                                     host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False,
                                                         tiers="inclusive", **how)), catalog)
    try:
        name = catalog.names()[0]
        first = cache.prefetch(name).result(timeout=60)
        assert (first.host_hit, first.read_way) == (False, way)
        assert cache.evict(name)
        again = cache.prefetch(name).result(timeout=60)  # the host tier kept its copy (inclusive tiers)
        assert (again.host_hit, again.read_way) == (True, "")
        stats = cache.stats()  # the tier's cold reads by way (demand and warm alike): the one miss, if it went one
        assert {w: stats[f"cold_{w}"] for w in COLD_WAYS} == {w: int(w == way) for w in COLD_WAYS}
        assert {f"cold_{w}" for w in COLD_WAYS} <= set(metrics_module._COUNTERS)  # exported as lora_cache_cold_reads
        # what auto measured, per file system and size class (`bench.run` keeps it in each rank's stats): the one
        # demand read, timed through the page cache while nothing is chosen; the other settings time nothing
        ways = stats["read_ways"]
        assert isinstance(ways, dict)
        if how.get("direct_reads") == "auto":
            (measured,) = ways.values()
            assert measured["preadv"]["timed"] == 1 and measured["preadv"]["GBps"] > 0 and measured["chosen"] is None
            assert measured["direct"] == measured["ahead"] == {"GBps": None, "timed": 0}
        else:
            assert ways == {}
        cache.check_integrity()
    finally:
        cache.close()
