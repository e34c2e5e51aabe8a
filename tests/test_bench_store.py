"""Issue 42 item 2: ``--store`` (page-cache, device, s3 behind a throttling proxy) on both engines, the worker's
``drop_page_cache``, the simulator's store costs, and the warm-up before the measured window."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import workers.staging.host_tier as host_tier_module
from bench.config import BenchConfig
from bench.policies import BENCH_POLICIES
from bench.sim.calibration import Calibration
from bench.sim.events import Loop
from bench.sim.host_tier import SimHostTier
from bench.sim.store import SharedLink, SimStore, fit_store
from bench.store import Dropped, Proxy, StoreModel, cached_pages, drop_all_pages, parse_store
from bench.warmup import auto_warmup, split_run, warm_workload
from bench.workloads import WorkloadSpec
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.shapes import SHAPES
from lora_cache.adapters.shards import shard_layout
from lora_cache.errors import ConfigError
from lora_cache.vocab import AdapterKey
from workers.reads.shard import read_shard
from workers.staging.disk_tier import FETCH_ORDERS, DiskTierConfig
from workers.staging.host_tier import HostTier, HostTierConfig

ROOT = Path(__file__).resolve().parents[1]


# -- the option ----------------------------------------------------------------------------------------------
def test_store_values_parse() -> None:
    assert parse_store("page-cache") == StoreModel("page-cache")
    assert parse_store("device") == StoreModel("device")
    assert parse_store("s3:200MBps,30ms") == StoreModel("s3", 200.0, 30.0)
    assert parse_store("s3:1.5GBps,5ms") == StoreModel("s3", 1500.0, 5.0)
    assert parse_store("s3:80MB/s,0ms") == StoreModel("s3", 80.0, 0.0)
    assert BenchConfig().store == "page-cache" and BenchConfig().warmup_requests == -1


@pytest.mark.parametrize("value, names", [
    ("s3:fast", "s3:BANDWIDTH,LATENCY"), ("s3:200,30ms", "bandwidth '200'"), ("s3:200MBps,30", "latency '30'"),
    ("nfs", "not a storage model"), ("s3:0MBps,1ms", "> 0 MB/s")])
def test_bad_store_values_name_the_option_the_value_and_the_fix(value: str, names: str) -> None:
    with pytest.raises(ConfigError) as e:
        BenchConfig(store=value)
    text = str(e.value)
    assert "--store" in text and repr(value) in text and names in text and "s3:200MBps,30ms" in text


def test_bad_store_on_the_command_line_exits_2_with_the_message() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--engine", "sim", "--store", "s3:fast"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--store 's3:fast'" in proc.stderr and "e.g. --store s3:200MBps,30ms" in proc.stderr


def test_bad_warmup_is_refused() -> None:
    with pytest.raises(ConfigError, match="--warmup-requests -2"):
        BenchConfig(warmup_requests=-2)


def test_a_bad_disk_tier_size_is_refused_naming_the_option_on_both_engines() -> None:
    from bench.sim.fleet import SimConfig

    with pytest.raises(ConfigError, match=r"--disk-bytes 0: give the node's disk tier in bytes, >= 1 \(default"):
        BenchConfig(disk_bytes=0)
    with pytest.raises(ConfigError, match=r"disk_bytes is 0\.5; give the node's disk tier in bytes"):
        SimConfig(disk_bytes=0.5)  # type: ignore[arg-type]


# -- the benchmark's drop before each policy's run ----------------------------------------------------------------
def test_drop_all_pages_leaves_no_page_of_files_just_written_in_the_page_cache(tmp_path: Path) -> None:
    """The device store's promise: every read of a policy's run comes from the device. A fresh machine makes the
    adapters right before the first run, and a dirty page is not dropped by ``POSIX_FADV_DONTNEED``: without the
    write first, a quarter of such a file's pages stayed cached on this machine's ext4 while the rest were being
    written back, so the first policy's reads were neither the page cache's nor the quiet device's."""
    files = [tmp_path / "a" / "adapter_model.safetensors", tmp_path / "b" / "adapter_model.safetensors"]
    for i, f in enumerate(files):
        f.parent.mkdir()
        f.write_bytes(os.urandom((16 << 20) + 4096 * i))  # dirty: nothing has written it to the device yet
    pages = sum(cached_pages(f)[1] for f in files)
    if sum(cached_pages(f)[0] for f in files) == 0:
        pytest.skip(f"the file system under {tmp_path} did not cache what was just written")
    dropped = drop_all_pages(tmp_path)
    if dropped.cached == pages:
        pytest.skip(f"the file system under {tmp_path} keeps its pages whatever is asked (tmpfs)")
    assert dropped == Dropped(files=2, cached=0, pages=pages)
    assert all(cached_pages(f)[0] == 0 for f in files)
    assert dropped.describe() == f"dropped the pages of 2 adapter files (0 of {pages} pages still cached)"
    assert [f.read_bytes()[:8] for f in files]  # still readable: dropped from memory, not lost


def _advise_dontneed(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_adapters_the_benchmark_makes_are_on_the_device_before_any_policy_runs(tmp_path: Path) -> None:
    """What ``ensure_adapters`` made is written back before it returns: a page drop with no write of its own then
    leaves none of their pages cached, since only a dirty page stays. Without the write every page stayed here."""
    from bench.run import ensure_adapters

    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(1 << 16))
    os.sync()
    _advise_dontneed(probe)
    if cached_pages(probe)[0]:
        pytest.skip(f"the file system under {tmp_path} keeps its pages whatever is asked (tmpfs)")
    root = tmp_path / "adapters"
    ensure_adapters(root, "tiny", "8", [f"adapter-{i:03d}" for i in range(3)])
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.stat().st_size]
    assert len(files) >= 6  # each adapter's config and weights
    for f in files:
        _advise_dontneed(f)
    assert sum(cached_pages(f)[0] for f in files) == 0, "pages of the adapters just made were still dirty"


# -- the worker's drop_page_cache ---------------------------------------------------------------------------------
@pytest.fixture
def catalog(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    paths = tiny_adapters(count=2, rank="8")
    return make_catalog(paths[0].parent)


@pytest.mark.parametrize("reads", ["thread", "process"])
@pytest.mark.parametrize("drop", [True, False])
def test_a_read_with_drop_page_cache_drops_that_files_pages(catalog: AdapterCatalog, monkeypatch: pytest.MonkeyPatch,
                                                            reads: str, drop: bool) -> None:
    dropped: list[str] = []
    monkeypatch.setattr(host_tier_module, "drop_pages", lambda spec: dropped.append(spec.source.path))
    tier = HostTier(HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False, reads=reads, drop_page_cache=drop))
    try:
        spec = catalog.get(catalog.names()[0])
        layout = shard_layout(spec, SHAPES["tiny"], 1, 0, torch.float32)
        future, hit = tier.fetch(spec, layout)
        assert not hit
        future.result(timeout=120)
        _, hit = tier.fetch(spec, layout)  # a hit reads nothing, drops nothing
        assert hit
    finally:
        tier.close()  # waits for the drops: they run after the read is served
    assert dropped == ([spec.source.path] if drop else [])


@pytest.mark.parametrize("reads", ["thread", "process"])
def test_a_read_is_served_before_its_pages_are_dropped(catalog: AdapterCatalog, monkeypatch: pytest.MonkeyPatch,
                                                       reads: str) -> None:
    """Dropping a rank-64 8B file's pages took 9-10 ms on this machine (35-45 ms on the GPU hosts), and each load's
    READY waited for it: the drop now runs after the entry is served, on a thread of its own, and never fails the
    read. Pinned by a drop that cannot end until the read's result has been seen."""
    served, dropping = threading.Event(), threading.Event()
    dropped: list[str] = []

    def drop(spec: Any) -> None:
        dropping.set()
        assert served.wait(60), "the read's result waited for its page drop"
        dropped.append(spec.source.path)

    monkeypatch.setattr(host_tier_module, "drop_pages", drop)
    tier = HostTier(HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False, reads=reads, drop_page_cache=True))
    try:
        spec = catalog.get(catalog.names()[0])
        layout = shard_layout(spec, SHAPES["tiny"], 1, 0, torch.float32)
        future, hit = tier.fetch(spec, layout)
        entry = future.result(timeout=120)  # served while its drop has not ended
        served.set()
        assert not hit and entry.whole and entry.bytes_read > 0 and not dropped
        assert tier.fetch(spec, layout)[1]  # staged whole: a hit
        want = torch.empty(layout.numel, dtype=torch.float32)
        read_shard(spec, layout, want)
        assert torch.equal(entry.tensor, want)  # its bytes are the file's, whatever the drop does after
    finally:
        tier.close()
    assert dropping.is_set() and dropped == [spec.source.path]


def test_drop_pages_advises_dontneed_on_the_file(catalog: AdapterCatalog, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, a: (calls.append((fd, o, n, a)), real(fd, o, n, a)))
    host_tier_module.drop_pages(catalog.get(catalog.names()[0]))
    assert len(calls) == 1 and calls[0][1:] == (0, 0, os.POSIX_FADV_DONTNEED)


def test_ask_ahead_asks_for_a_cold_file_whole_and_is_cold_tells_it_from_a_cached_one(
        catalog: AdapterCatalog, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = catalog.get(catalog.names()[0])
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, a: (calls.append((o, n, a)), real(fd, o, n, a)))
    Path(spec.source.path).read_bytes()
    assert host_tier_module.is_cold(spec) is False  # just read: in the page cache
    host_tier_module.drop_pages(spec)
    calls.clear()
    host_tier_module.ask_ahead(spec)
    assert calls == [(0, 0, os.POSIX_FADV_WILLNEED)]  # the whole file
    gone = SimpleNamespace(source=spec.source._replace(path=str(Path(spec.source.path) / "x")))
    assert host_tier_module.is_cold(gone) is False  # a missing file: neither raises, the read says what is wrong
    host_tier_module.ask_ahead(gone)


@pytest.mark.parametrize("reads", ["thread", "process"])
def test_read_ahead_changes_no_byte_of_a_read_and_counts_what_it_asked(catalog: AdapterCatalog, reads: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spec = catalog.get(catalog.names()[1])
    layout = shard_layout(spec, SHAPES["tiny"], 1, 0, torch.float32)
    told: list[bool] = []  # what each read's dispatch found (a probe of its own would start the page's readahead)
    real = host_tier_module.is_cold
    monkeypatch.setattr(host_tier_module, "is_cold", lambda s: told.append(real(s)) or told[-1])
    staged = {}
    for ahead in (False, True):
        host_tier_module.drop_pages(spec)  # a file system that keeps its pages (tmpfs, pages not yet written) is warm
        told.clear()
        tier = HostTier(HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False, reads=reads,
                                       drop_page_cache=True, read_ahead=ahead))
        try:
            future, hit = tier.fetch(spec, layout)
            assert not hit
            staged[ahead] = future.result(timeout=120).tensor.clone()
        finally:
            tier.close()  # waits for the ask ahead too
        assert len(told) == ahead and tier.asked_ahead == sum(told)  # asked once per cold read, only when on
    assert torch.equal(staged[False], staged[True])


def test_the_store_option_reaches_the_workers_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import bench.real as real

    seen: dict[str, Any] = {}

    def start(serve: Any, catalog: Any, planner: Any, worker: Any, router: Any = None) -> Any:
        seen["worker"], seen["router"] = worker, router
        raise RuntimeError("stop here")

    monkeypatch.setattr(real, "start", start)
    monkeypatch.setattr(real, "_refuse_running_service", lambda: None)
    workload = warm_workload(WorkloadSpec(requests=4), ["a-000", "a-001"], 0, 1, 1)[0]
    for store, drop, disk in (("page-cache", False, ""), ("device", True, ""), ("s3:100MBps,5ms", False, "global")):
        config = real.RealConfig(store=store, disk_root=str(tmp_path))
        with pytest.raises(RuntimeError, match="stop here"):
            real.run_policy(config, BENCH_POLICIES["global"], "/nowhere", ["a-000", "a-001"], workload)
        assert seen["worker"].host.drop_page_cache is drop
        if disk:
            assert seen["worker"].disk.disk_cache == str(tmp_path / disk) and seen["worker"].disk.fetch_part_bytes == 0
        assert seen["router"].join_over == 1.0  # the controller's routing advice as a service's default
    # --join-over (issue 42) reaches the controller's routing advice on the real engine too
    with pytest.raises(RuntimeError, match="stop here"):
        real.run_policy(real.RealConfig(join_over=2.0), BENCH_POLICIES["global"], "/nowhere", ["a-000", "a-001"],
                        workload)
    assert seen["router"].join_over == 2.0
    # --disk-bytes sizes each policy's disk tier on the real engine as in the simulator
    with pytest.raises(RuntimeError, match="stop here"):
        real.run_policy(real.RealConfig(store="s3:100MBps,5ms", disk_root=str(tmp_path), disk_bytes=12 << 30),
                        BENCH_POLICIES["global"], "/nowhere", ["a-000", "a-001"], workload)
    assert seen["worker"].disk.disk_cache_bytes == 12 << 30


# -- the proxy ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def sender(payload: bytes) -> Iterator[int]:
    """A TCP server that answers each request line with ``payload``."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = srv.accept()
                with conn:
                    conn.recv(100)
                    conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


def fetch(port: int, nbytes: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"GET\n")
        got = bytearray()
        while len(got) < nbytes:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        return bytes(got)


def test_the_proxy_is_a_process_that_delivers_every_byte_at_its_bandwidth_after_its_latency() -> None:
    payload = bytes(range(256)) * (8 << 10)  # 2 MiB
    with sender(payload) as port, Proxy(f"127.0.0.1:{port}", mbps=4.0, latency_ms=200.0) as proxy:
        assert proxy.proc.pid != 0 and proxy.proc.poll() is None  # its own process
        t0 = time.perf_counter()
        got = fetch(proxy.port, len(payload))
        took = time.perf_counter() - t0
    assert got == payload
    assert took >= 0.2 + 0.8 * (len(payload) / 4e6)  # latency, then N / B (less the bucket's burst): a lower bound


def test_the_proxys_bandwidth_is_shared_by_every_connection() -> None:
    payload = b"x" * (1 << 20)
    with sender(payload) as port, Proxy(f"127.0.0.1:{port}", mbps=4.0, latency_ms=0.0) as proxy:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=fetch, args=(proxy.port, len(payload))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        took = time.perf_counter() - t0
    assert took >= 0.8 * (2 * len(payload) / 4e6)


# -- the simulator's store costs ---------------------------------------------------------------------------------
def test_a_shared_link_shares_its_bandwidth() -> None:
    loop = Loop()
    link = SharedLink(loop, 1e6, 0.01)
    done: dict[str, float] = {}
    link.start(1_000_000, lambda: done.setdefault("alone", loop.now))
    loop.run(lambda: False)
    assert done["alone"] == pytest.approx(1.01)
    loop = Loop()
    link = SharedLink(loop, 1e6, 0.0)
    for name in ("a", "b"):
        link.start(1_000_000, lambda name=name: done.setdefault(name, loop.now))
    loop.run(lambda: False)
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(2.0)  # each at half the bandwidth


@pytest.mark.parametrize("order", FETCH_ORDERS)
def test_the_nodes_demand_fetches_move_one_at_a_time_the_one_that_ends_soonest_alone_first(order: str) -> None:
    """The simulated ``NodeFetches`` (``fetch_order`` "soonest"): of the demand fetches whose bytes come, one moves
    at a time, the one that would end soonest alone (its first byte's time plus its bytes at the link's rate), then
    the one placed first; a smaller one that comes later passes at once if it would end sooner (the one it passes
    waits, its bytes so far kept), and waits if it comes after the larger would have ended. "shared": processor
    sharing."""
    loop = Loop()
    calib = Calibration(disk_fixed_ms=1.0, disk_gbps=10.0)
    sizes = {"big": 40_000_000, "big2": 40_000_000, "small": 10_000_000, "late": 10_000_000}
    store = SimStore(parse_store("s3:100MBps,0ms"), loop, calib, sizes, fetch_order=order)
    copies = {"big": store.fetch("big"), "big2": store.fetch("big2")}  # alone: both to 0.4
    loop.at(0.1, lambda: copies.setdefault("small", store.fetch("small")))  # alone: to 0.2, ahead of both
    loop.at(0.45, lambda: copies.setdefault("late", store.fetch("late")))  # alone: to 0.55, behind both
    loop.run(lambda: len(copies) == 4 and all(c is not None and c.done for c in copies.values()))
    done = {name: c.time for name, c in copies.items() if c is not None}
    if order == "soonest":  # big to 0.1 (10 MB); small to 0.2; big's 30 MB to 0.5; big2 to 0.9; late to 1.0
        assert done == pytest.approx({"big": 0.5, "small": 0.2, "big2": 0.9, "late": 1.0})
    else:  # two share to 0.1, three to 0.4 (small in), two to 0.45, three to 0.75 (late in), two to 1.0
        assert done == pytest.approx({"small": 0.4, "late": 0.75, "big": 1.0, "big2": 1.0})


def test_a_bad_fetch_order_is_refused_naming_it_and_the_choices() -> None:
    from bench.sim.fleet import SimConfig

    with pytest.raises(ConfigError, match=r"--fetch-order 'fifo': give one of soonest, shared"):
        BenchConfig(fetch_order="fifo")
    with pytest.raises(ConfigError, match=r"fetch_order is 'fifo'; give one of soonest, shared"):
        SimConfig(fetch_order="fifo")
    with pytest.raises(ConfigError, match=r"fetch_order is 'fifo'; give one of soonest, shared"):
        DiskTierConfig(fetch_order="fifo")


def read_times(store: str, reads: int, nbytes: int = 50_000_000) -> list[float]:
    """When each of ``reads`` misses started at once on one rank's host tier are staged."""
    loop = Loop()
    calib = Calibration(disk_fixed_ms=1.0, disk_gbps=10.0, device_gbps=1.0)
    model = parse_store(store)
    sim_store = None if model.kind == "page-cache" else SimStore(model, loop, calib,
                                                                 {f"a{i}": nbytes * 2 for i in range(reads)})
    tier = SimHostTier(loop, calib, 1 << 40, 8, sim_store)
    entries = [tier.fetch(AdapterKey(f"a{i}", "v"), nbytes)[0] for i in range(reads)]
    loop.run(lambda: all(e.staged.done for e in entries))
    return [e.staged.time for e in entries]


def test_device_reads_are_slower_than_page_cache_reads_and_concurrent_ones_share_the_device() -> None:
    (page,) = read_times("page-cache", 1)
    (device,) = read_times("device", 1)
    assert device > page
    assert device == pytest.approx(0.05)  # 50 MB at 1 GB/s: the reader's copies ride on the transfer, not after it
    together = read_times("device", 4)
    assert min(together) > 3 * 0.05  # four reads at once share the device's 1 GB/s
    assert max(read_times("page-cache", 4)) == pytest.approx(page)  # each page-cache reader at its own speed


def test_s3_fetches_once_per_node_after_the_latency_then_reads_the_local_copy() -> None:
    loop = Loop()
    calib = Calibration(disk_fixed_ms=1.0, disk_gbps=10.0)
    store = SimStore(parse_store("s3:100MBps,30ms"), loop, calib, {"a": 10_000_000})
    tiers = [SimHostTier(loop, calib, 1 << 30, 4, store) for _ in range(2)]  # two ranks of one node
    entries = [t.fetch(AdapterKey("a", "v"), 5_000_000)[0] for t in tiers]
    loop.run(lambda: all(e.staged.done for e in entries))
    assert store.fetches == 1
    for e in entries:
        assert e.staged.time == pytest.approx(0.03 + 0.1 + 0.001 + 0.0005)


@pytest.mark.parametrize("order", FETCH_ORDERS)
def test_a_disk_warm_fetch_yields_the_store_to_demand_until_a_demand_joins_it(order: str) -> None:
    """The simulated ``DiskTier.stage(busy=...)``: a background (disk warm) fetch moves only while no demand fetch
    does; a demand read of the object it is fetching makes it foreground (then, in order, it takes its turn behind
    the demand fetch that came first)."""
    loop = Loop()
    calib = Calibration(disk_fixed_ms=1.0, disk_gbps=10.0)
    store = SimStore(parse_store("s3:100MBps,0ms"), loop, calib, {n: 10_000_000 for n in ("warm", "hot", "late", "x")},
                     fetch_order=order)
    warm = store.fetch("warm", background=True)
    assert warm is not None
    hot: list[float] = []
    loop.at(0.05, lambda: store.read("hot", 5_000_000, lambda: hot.append(loop.now)))  # demand, half-way through
    loop.run(lambda: bool(hot) and warm.done)
    assert hot[0] == pytest.approx(0.05 + 0.1 + 0.0015)  # the whole link: the warm fetch yielded at once
    assert warm.time == pytest.approx(0.05 + 0.1 + 0.05)  # then went on: its half left
    t0 = loop.now
    late = store.fetch("late", background=True)
    assert late is not None
    demand: list[float] = []
    store.read("x", 5_000_000, lambda: demand.append(loop.now))  # a demand fetch: the warm one yields...
    loop.at(t0 + 0.05, lambda: store.read("late", 5_000_000, lambda: None))  # ...until a demand joins it
    loop.run(lambda: bool(demand) and late.done)
    # shared: half its bytes alone, half sharing with the joined one; in order: alone (it came first)
    assert demand[0] == pytest.approx(t0 + (0.15 if order == "shared" else 0.1) + 0.0015)
    assert late.time == pytest.approx(t0 + 0.2) and store.fetches == 4


@pytest.mark.parametrize("order", FETCH_ORDERS)
def test_a_host_warm_reads_fetch_yields_the_store_to_demand_until_a_load_joins_it(order: str) -> None:
    """The simulated ``DemandMarks.yields``: a warm stage's host read of an object not on the node's disk fetches it
    in the background (it moves only while no demand fetch does); a load that joins the warm read's entry makes
    the fetch a foreground one, and the entry a demand read for the node's other ranks."""
    loop = Loop()
    calib = Calibration(disk_fixed_ms=1.0, disk_gbps=10.0)
    store = SimStore(parse_store("s3:100MBps,0ms"), loop, calib, {n: 10_000_000 for n in ("warm", "hot", "late", "x")},
                     fetch_order=order)
    rank0, rank1 = SimHostTier(loop, calib, 1 << 30, 4, store), SimHostTier(loop, calib, 1 << 30, 4, store)
    warm, _ = rank0.fetch(AdapterKey("warm", "v"), 1_000_000, count=False, speculative=True)
    hot: list[float] = []
    loop.at(0.05, lambda: rank1.fetch(AdapterKey("hot", "v"), 1_000_000)[0].staged.then(lambda _: hot.append(loop.now)))
    loop.run(lambda: bool(hot) and warm.staged.done)
    assert hot[0] == pytest.approx(0.05 + 0.1 + 0.001 + 0.0001)  # the whole store: the warm fetch yielded at once
    assert warm.staged.time == pytest.approx(0.05 + 0.1 + 0.05 + 0.001 + 0.0001)  # then went on: its half left
    t0 = loop.now
    late, _ = rank0.fetch(AdapterKey("late", "v"), 1_000_000, count=False, speculative=True)
    x, _ = rank1.fetch(AdapterKey("x", "v"), 1_000_000)  # a demand fetch: the warm one yields...
    loop.at(t0 + 0.05, lambda: rank0.fetch(AdapterKey("late", "v"), 1_000_000))  # ...until a load joins its entry
    loop.run(lambda: x.staged.done and late.staged.done)
    assert not late.speculative and rank0.demand_reading() is False  # a demand read once joined (now over)
    # shared: half its bytes alone, half sharing with the joined one; in order: alone (it came first)
    assert x.staged.time == pytest.approx(t0 + (0.15 if order == "shared" else 0.1) + 0.0011)
    assert late.staged.time == pytest.approx(t0 + 0.2 + 0.0011) and store.fetches == 4


def test_the_simulated_disk_tier_evicts_the_copy_used_longest_ago_that_no_read_holds() -> None:
    """``--disk-bytes`` below the catalog: a fetch that does not fit evicts copies LRU by bytes, as ``DiskTier`` does;
    a copy a read holds (from its ask to its local read's end) or one being fetched is never evicted; a copy
    evicted is fetched again on its next read; where every copy is held the fetch goes over, counted."""
    loop = Loop()
    calib = Calibration(disk_fixed_ms=1.0, disk_gbps=10.0)
    store = SimStore(parse_store("s3:100MBps,0ms"), loop, calib, {n: 10_000_000 for n in "abcd"}, disk_bytes=25_000_000)

    def read(name: str) -> None:
        done: list[float] = []
        store.read(name, 1_000_000, lambda: done.append(loop.now))
        loop.run(lambda: bool(done))

    read("a")
    read("b")
    read("a")  # a hit: "b" is now the copy used longest ago
    assert (store.fetches, store.evictions, store.disk_used) == (2, 0, 20_000_000)
    read("c")  # 30 MB would not fit 25: "b" goes, not "a"
    assert set(store.on_disk) == {"a", "c"} and store.evictions == 1 and store.disk_used == 20_000_000
    read("b")  # fetched again, evicting "a" (used before "c")
    assert set(store.on_disk) == {"c", "b"} and (store.fetches, store.evictions) == (4, 2)
    # a held copy stays: a read of "c" asked (its fetch done, its local read not yet) while "d" is fetched
    held: list[float] = []
    store.read("c", 1_000_000, lambda: held.append(loop.now))
    late: list[float] = []
    store.read("d", 1_000_000, lambda: late.append(loop.now))
    assert "c" in store.on_disk and "b" not in store.on_disk  # "b" was free to go, "c" was held
    loop.run(lambda: bool(held) and bool(late))
    # every copy held: a fetch goes over the bytes, counted, and nothing held is evicted
    waits = [[] for _ in range(3)]  # type: list[list[float]]
    for name, w in zip("abc", waits):
        store.read(name, 1_000_000, lambda w=w: w.append(loop.now))
    assert store.disk_over >= 1 and {"a", "b", "c"} <= set(store.on_disk)
    loop.run(lambda: all(waits))
    assert store.stats()["disk_over"] == store.disk_over and store.stats()["disk_evictions"] == store.evictions


@pytest.mark.parametrize("saturated", [True, False])
def test_a_simulated_host_eviction_makes_the_disk_copy_most_recent_while_demand_saturates_the_store(
        saturated: bool) -> None:
    """``DiskTier.let_go`` in the simulator: while the rank's demand reads waited for the store ``victim_share`` of
    the last minute, a shard the host tier evicts makes its disk copy the most recent, so the disk keeps it over a
    copy read from the disk later; once the store has been idle (the share decayed) the disk's LRU is by reads."""
    loop = Loop()
    calib = Calibration(disk_fixed_ms=1.0, disk_gbps=10.0)
    mb = 1_000_000
    store = SimStore(parse_store("s3:1MBps,0ms"), loop, calib, {n: 60 * mb for n in "abc"}, disk_bytes=150 * mb)
    tier = SimHostTier(loop, calib, 2 * mb, 4, store)  # two shards of 1 MB
    assert tier.victim_share == DiskTierConfig().victim_share == 0.3

    def read(name: str) -> None:
        key = AdapterKey(name, "v1")
        entry, _ = tier.fetch(key, mb)
        loop.run(lambda: entry.staged.done)
        tier.release(key)

    read("a")  # 60 s waiting for the store each: the share is 1 - 1/e, then more
    read("b")
    assert tier.store_share.share() > 0.8 and set(store.on_disk) == {"a", "b"}
    if not saturated:  # five idle minutes: the share decays below victim_share
        loop.at(loop.now + 300.0, lambda: None)
        loop.run(lambda: False)
        assert tier.store_share.share() < 0.01
    read("c")  # the host tier lets go of "a" (its oldest) for it, then the disk of one copy
    assert AdapterKey("a", "v1") not in tier.entries
    assert set(store.on_disk) == ({"a", "c"} if saturated else {"b", "c"})
    assert tier.store_share.share() > (0.3 if saturated else 0.0)


def test_disk_warming_fills_the_node_with_the_store_adapters_ahead_of_demand(tmp_path: Path) -> None:
    """``global`` on the s3 model (the fitted simulator): its disk warm stages fetch the catalog with the store's
    idle bandwidth, so the measured window reads fewer adapters from the store than ``queue`` and its mean is
    lower."""
    import json

    proc = subprocess.run([sys.executable, "-m", "bench.run", "--engine", "sim", "--model", "llama-3.1-8b",
                           "--adapter-ranks", "16,64", "--scenario", "zipf", "--num-adapters", "40", "--no-plots",
                           "--host-bytes", str(1 << 30), "--policies", "queue,global", "--warmup-requests", "300",
                           "--requests", "100", "--arrivals", "poisson:4", "--store", "s3:500MBps,30ms",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads((tmp_path / "results.json").read_text())["figures"]
    assert figures["global"]["mean_ttft_ms"] < figures["queue"]["mean_ttft_ms"]
    assert figures["global"]["disk_ready_ms_p99"] < figures["queue"]["disk_ready_ms_p99"]


def test_a_fitted_device_read_takes_as_long_as_the_logged_one() -> None:
    """Round trip: a device fitted from a run's reads (the worker's whole ``disk_ms``) and simulated reads them in
    their logged time, whatever page-cache read cost the calibration holds (the reader's work is in the read)."""
    nbytes = 300_000_000
    loads = [{"host_hit": False, "t_s": 10.0 * i + 0.2, "ready_ms": 200.0, "disk_ms": 180.0, "nbytes": nbytes,
              "adapter": f"a{i}"} for i in range(3)]
    calib = fit_store(Calibration(disk_fixed_ms=30.0, disk_gbps=1.5), [loads], parse_store("device"))
    loop = Loop()
    tier = SimHostTier(loop, calib, 1 << 40, 4, SimStore(parse_store("device"), loop, calib, {"a": nbytes}))
    entry, _ = tier.fetch(AdapterKey("a", "v"), nbytes)
    loop.run(lambda: entry.staged.done)
    assert entry.staged.time == pytest.approx(0.180)


def test_a_slowed_device_read_holds_the_link_longer() -> None:
    """The reads' noise (``device_slowdown``, drawn by ``--noise``) stretches a device read's transfer; the link
    still counts the bytes the read moved."""
    loop = Loop()
    link = SharedLink(loop, 1e6, 0.0)
    done: dict[str, float] = {}
    link.start(1_000_000, lambda: done.setdefault("slow", loop.now), slowdown=2.0)
    loop.run(lambda: False)
    assert done["slow"] == pytest.approx(2.0) and link.moved == 1_000_000


def test_fit_store_device_bandwidth_from_busy_time() -> None:
    loads = [{"host_hit": False, "t_s": 1.0, "ready_ms": 1000.0, "disk_ms": 1000.0, "nbytes": 500_000_000,
              "adapter": "a"},
             {"host_hit": False, "t_s": 1.0, "ready_ms": 1000.0, "disk_ms": 1000.0, "nbytes": 500_000_000,
              "adapter": "b"}]
    fitted = fit_store(Calibration(), [loads], parse_store("device"))
    assert fitted.device_gbps == pytest.approx(1.0)


# -- the warm-up ----------------------------------------------------------------------------------------------
def test_auto_warmup_fills_every_replicas_slots() -> None:
    spec = WorkloadSpec(requests=100, arrivals="poisson:10", popularity="uniform")
    names = spec.adapter_names(4)
    n = auto_warmup(spec, names, replicas=2, slots=4)
    workload, _ = warm_workload(spec, names, -1, 2, 4)
    assert workload.warmup == n and len(workload.requests) == 100 + n
    seen: list[set[str]] = [set(), set()]
    for i, r in enumerate(workload.requests[:n]):
        seen[i % 2].add(r.adapter)
    assert all(len(s) >= 4 for s in seen)
    assert workload.describe()["requests"] == 100 and workload.describe()["warmup_requests"] == n


def test_measured_figures_exclude_the_warmup(tmp_path: Path) -> None:
    from bench.run import run

    bench = BenchConfig(engine="sim", policies="ondemand,global", quick=True, scenario="quick", model="tiny",
                        replicas=2, slots=4, max_adapters=2, host_bytes=2 << 30, warmup_requests=20,
                        out=str(tmp_path), plots=False, store="device")
    spec = WorkloadSpec(requests=30, arrivals="poisson:20", popularity="zipf:1.5", random_input_len=64,
                        random_output_len=8)
    doc = run(bench, spec)
    assert doc["config"]["workload"]["requests"] == 30 and doc["config"]["workload"]["warmup_requests"] == 20
    for policy, figs in doc["figures"].items():
        assert figs["completed"] == 30, policy
        assert sorted(r["rid"] for r in doc["requests"][policy]) == list(range(20, 50))
        assert doc["cold_start"][policy]["completed"] == 20
        assert figs["loads"] == len(doc["loads"][policy])
    assert "cold start (the warm-up's 20 requests" in doc["table"] and "store: device" in doc["table"]
    assert "GiB per rank, the same for every policy" in doc["table"]


def test_a_paged_run_at_equal_bytes_gets_the_slots_catalog_and_warm_up(tmp_path: Path) -> None:
    """Issue 43: ``--slots 32 --page-rank 16 --pool-pages 32`` holds the bytes of 8 slots of rank 64; the benchmark
    draws the catalog and the auto warm-up of those 8 slots, so the measured windows compare (with its 32 rows
    they were 4x the adapters and a warm-up until 32 were seen)."""
    from bench.run import run

    common = dict(engine="sim", policies="queue", quick=True, model="llama-3.1-8b", adapter_ranks="16,64",
                  replicas=1, max_adapters=4, host_bytes=4 << 30, warmup_requests=-1, plots=False)
    spec = WorkloadSpec(requests=40, arrivals="poisson:8", popularity="zipf:1.0", random_input_len=64,
                        random_output_len=8)
    slots = run(BenchConfig(slots=8, out=str(tmp_path / "slots"), **common), spec)  # type: ignore[arg-type]
    paged = BenchConfig(slots=32, page_rank=16, pool_pages=32, out=str(tmp_path / "paged"), **common)  # type: ignore[arg-type]
    assert paged.byte_slots() == 8 and BenchConfig(slots=8).byte_slots() == 8
    doc = run(paged, spec)
    for key in ("adapters", "warmup_requests"):
        assert doc["config"]["workload"][key] == slots["config"]["workload"][key], key
    assert doc["figures"]["queue"]["completed"] == 40


def test_split_run_counters_come_from_the_snapshot() -> None:
    from bench.figures import PolicyRun
    from workers.engine.timings import RequestRecord

    fields = {f.name for f in dataclasses.fields(RequestRecord)} if dataclasses.is_dataclass(RequestRecord) else set()
    if not fields:
        pytest.skip("RequestRecord is not a dataclass here")
    recs = []
    for rid in range(6):
        kw = {f: None for f in fields}
        kw.update(rid=rid, arrival_s=float(rid))
        recs.append(RequestRecord(**kw))
    ranks = [{"replica": "r", "rank": 0, "evictions": 5, "host_hits": 7}]
    mid = [{"replica": "r", "rank": 0, "evictions": 2, "host_hits": 3}]
    loads = [{"t_s": 1.0, "replica": "r", "rank": 0, "nbytes": 10}, {"t_s": 4.0, "replica": "r", "rank": 0,
                                                                       "nbytes": 20}]
    run = PolicyRun("ondemand", "sim", recs, ranks, loads, ranks_at_warmup=mid)
    measured, cold = split_run(run, 3)
    assert [r.rid for r in measured.records] == [3, 4, 5] and [r.rid for r in cold.records] == [0, 1, 2]
    assert measured.ranks[0]["evictions"] == 3 and measured.ranks[0]["host_hits"] == 4
    assert (measured.ranks[0]["loads"], measured.ranks[0]["bytes_host_to_gpu"]) == (1, 20)
    assert cold.ranks[0]["evictions"] == 2 and (cold.ranks[0]["loads"], cold.ranks[0]["bytes_host_to_gpu"]) == (1, 10)


# -- one quick real-engine run per storage model (Ray, CPU) ----------------------------------------------------------
@pytest.mark.ray
@pytest.mark.parametrize("store", ["device", "s3:50MBps,20ms"])
def test_a_quick_real_run_per_storage_model(store: str, tmp_path: Path) -> None:
    import json

    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--policies", "ondemand,global",
                           "--requests", "16", "--warmup-requests", "8", "--store", store, "--out", str(tmp_path),
                           "--no-plots"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["store"]["kind"] == parse_store(store).kind
    for policy in ("ondemand", "global"):
        assert doc["figures"][policy]["completed"] == 16 and doc["cold_start"][policy]["completed"] == 8
    assert "cold start" in proc.stdout and "store: " in proc.stdout
    if store == "device":  # each policy's drop is recorded; the first, which no worker's read can overlap (the
        # adapters were just made: written back, then dropped), leaves none cached (tmpfs: none can be dropped)
        first, then = (doc["config"]["dropped"][p] for p in ("ondemand", "global"))
        assert first["files"] > 0 and first["cached"] in (0, first["pages"]), first
        assert then["files"] == first["files"] and then["pages"] == first["pages"], then
        assert proc.stderr.count("store: dropped the pages of") == 2
