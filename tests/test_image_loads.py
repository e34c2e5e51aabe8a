"""A rank's slot filled from a pushed image in device memory (``WorkerCache.load_image``, issue 44 item 5): the slot
holds what a load from the version's file puts there, byte for byte, at every TP rank and slot dtype; READY only once
the shard is proven finite, and a batch that asks for it meanwhile waits for that proof; a non-finite image fails its
load and leaves nothing half-loaded; an image that is not the version's is refused before any slot is taken.

On the CPU the image is a host tensor and the gather runs as its torch twin (``workers.kernels.gather``); the ``gpu``
variant runs the kernel on the rank's copy stream after the trainer's event."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.errors import AdapterFormatError, NonFiniteWeightsError
from lora_cache.vocab import AdapterKey, Delta, ReadinessRecord
from tests.worker_queries import slots_in, use_streams
from workers.cache import WorkerCache, WorkerConfig
from workers.control.images import TrainerImages
from workers.gpu.copies import LoadFailed
from workers.gpu.slots import SlotPhase
from workers.gpu.streams import CpuStreams
from workers.kernels.gather import gather, gather_plan
from workers.staging.host_config import HostTierConfig

HAS_CUDA = torch.cuda.is_available()
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


@pytest.fixture
def catalog(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    return make_catalog(tiny_adapters(count=4, rank="8,16")[0].parent)


def image_of(spec: AdapterSpec, device: str = "cpu") -> tuple[torch.Tensor, bytes]:
    """The version's safetensors file as one uint8 buffer (what the trainer's pushed buffer holds) and its head."""
    raw = spec.weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone().to(device), raw[:8 + n]


def slot_bytes(cache: WorkerCache, name: str, version: str) -> bytes:
    with cache.book.lock:
        slot = cache.book.table.lookup(AdapterKey(name, version))
        assert slot is not None and slot.state is SlotPhase.READY, f"{name}@{version} is not READY here"
    return bytes(cache.shard(slot.index).cpu().contiguous().view(torch.uint8).numpy())


def with_nan(image: torch.Tensor, head: bytes) -> torch.Tensor:
    """``image`` with its first tensor's first element a NaN (bf16: 0x7fc0), the header unchanged."""
    bad = image.clone()
    bad[len(head):len(head) + 2] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)
    return bad


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_slot_filled_from_the_image_holds_what_a_load_from_the_file_puts_there(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], tp: int, dtype: str) -> None:
    names = catalog.names()[:2]
    for rank in range(tp):
        pushed = make_cache(catalog, dtype=dtype, tp=tp, tp_rank=rank)
        loaded = make_cache(catalog, dtype=dtype, tp=tp, tp_rank=rank)
        deltas: list[Delta] = []
        pushed.on_change = deltas.append
        for name in names:
            spec = catalog.get(name)
            image, head = image_of(spec)
            record = pushed.load_image(name, spec.version, image, head).result(timeout=30)
            loaded.prefetch(name).result(timeout=30)
            assert (record.adapter, record.version, record.tp_rank) == (name, spec.version, rank)
            assert slot_bytes(pushed, name, spec.version) == slot_bytes(loaded, name, spec.version), (
                f"TP {tp} rank {rank} {dtype}: {name}'s slot from the image differs from the file's load")
            assert not pushed.host.contains(AdapterKey(name, spec.version)), "an image's load touched the host tier"
        assert [(d.adapter, d.state) for d in deltas] == [(n, s) for n in names for s in ("loading", "ready")]
        stats = pushed.counters
        assert (stats.image_loads, stats.loads, stats.load_failures, stats.bytes_host_to_gpu) == (2, 2, 0, 0)
        assert stats.bytes_from_images == sum(pushed.layout_of(n).nbytes for n in names)


def test_a_resident_version_is_not_loaded_again_from_an_image(catalog: AdapterCatalog,
                                                              make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog)
    name = catalog.names()[0]
    spec = catalog.get(name)
    image, head = image_of(spec)
    first = cache.load_image(name, spec.version, image, head)
    first.result(timeout=30)
    assert cache.load_image(name, spec.version, image, head) is first
    assert cache.counters.image_loads == 1


def test_a_trainers_next_version_of_the_same_shapes_reuses_the_read_plan(
        tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
        make_cache: Callable[..., WorkerCache], tmp_path: Path) -> None:
    first = tiny_adapters(count=1, rank="8", root=tmp_path / "v1", seed=1)[0]
    second = tiny_adapters(count=1, rank="8", root=tmp_path / "v2", seed=2)[0]
    catalog = make_catalog(tmp_path, register=False)
    cache = make_cache(catalog)
    for directory in (first, second):  # two versions of one name, as a trainer's steps
        spec = catalog.register("a", directory)
        image, head = image_of(spec)
        cache.load_image("a", spec.version, image, head).result(timeout=30)
    assert len(cache.image_reads._plans) == 1
    loaded = make_cache(catalog)
    loaded.prefetch("a").result(timeout=30)
    assert slot_bytes(cache, "a", spec.version) == slot_bytes(loaded, "a", spec.version)


def test_a_non_finite_image_fails_its_load_and_the_rank_keeps_what_it_held(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog, num_slots=3)
    held, pushed = catalog.names()[:2]
    cache.prefetch(held).result(timeout=30)
    before = slot_bytes(cache, held, catalog.current(held))
    spec = catalog.get(pushed)
    image, head = image_of(spec)
    deltas: list[Delta] = []
    cache.on_change = deltas.append
    with pytest.raises(NonFiniteWeightsError, match=r"lora_A.*NaN|NaN.*lora_A|non-finite|NaN"):
        cache.load_image(pushed, spec.version, with_nan(image, head), head).result(timeout=30)
    assert [(d.adapter, d.state) for d in deltas] == [(pushed, "loading"), (pushed, "failed")]
    assert cache.residency() == [r for r in cache.residency() if r["adapter"] == held]
    assert slots_in(cache, SlotPhase.LOADING) == 0 and slots_in(cache, SlotPhase.READY) == 1
    assert slot_bytes(cache, held, catalog.current(held)) == before
    assert cache.counters.load_failures == 1
    cache.load_image(pushed, spec.version, image, head).result(timeout=30)  # nothing half-loaded stands in its way
    assert slots_in(cache, SlotPhase.READY) == 2


def test_huge_but_finite_weights_load_though_their_total_is_past_float32(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """The device fill proves a shard by its float32 total (``finite.total_finite``); a total past float32's range
    from finite weights is looked at element by element and loads."""
    cache = make_cache(catalog)
    spec = catalog.get(catalog.names()[0])
    image, head = image_of(spec)
    huge = image.clone()
    huge[len(head):].view(torch.int16).fill_(0x7F7F)  # bfloat16 ~3.39e38: finite, its sum is not
    cache.load_image(spec.name, spec.version, huge, head).result(timeout=30)
    assert slots_in(cache, SlotPhase.READY) == 1 and cache.counters.load_failures == 0


def test_an_image_that_is_not_the_versions_is_refused_before_any_slot_is_taken(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog)
    one, other = catalog.names()[:2]
    spec = catalog.get(one)
    image, head = image_of(spec)
    foreign, foreign_head = image_of(catalog.get(other))
    deltas: list[Delta] = []
    cache.on_change = deltas.append
    cases: list[tuple[Any, Any, str]] = [
        (foreign, foreign_head, "not this version's file"),  # another adapter's image
        (image[:-2], head, "not this version's file"),  # cut short
        (image.view(torch.int16), head, "1-D uint8"),  # not bytes
    ]
    for bad, bad_head, says in cases:
        with pytest.raises(AdapterFormatError, match=says) as e:
            cache.load_image(one, spec.version, bad, bad_head)
        assert one in str(e.value) and spec.version in str(e.value)
    assert deltas == [] and cache.residency() == [] and cache.counters.image_loads == 0


@pytest.mark.parametrize("finite", [True, False])
def test_a_batch_that_asks_for_an_image_load_in_flight_runs_only_on_a_proven_shard(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], finite: bool) -> None:
    """The copy stream is deferred: the gather has not run when the batch asks; the batch must not get the slot's
    last event before the shard is READY (or, for a NaN, must fail), whatever order the threads run in."""
    cache = make_cache(catalog)
    streams = CpuStreams(cache.device, deferred=True)
    use_streams(cache, streams)
    name = catalog.names()[0]
    spec = catalog.get(name)
    image, head = image_of(spec)
    load = cache.load_image(name, spec.version, image if finite else with_nan(image, head), head)
    assert not load.done()  # issued on the copy stream, not run
    outcome: list[Any] = []
    asked = threading.Barrier(2)

    def batch() -> None:
        asked.wait()
        try:
            held = cache.acquire([AdapterKey(name, spec.version)])
            outcome.append(("held", load.done() and load.exception() is None, held))
        except LoadFailed as e:
            outcome.append(("failed", load.done() and load.exception() is not None, e))

    thread = threading.Thread(target=batch)
    thread.start()
    asked.wait()
    thread.join(timeout=30)
    assert not thread.is_alive()
    kind, proven_first, result = outcome[0]
    assert proven_first, f"the batch got {kind} before the image's load was READY or failed"
    if finite:
        assert kind == "held"
        cache.release(result)
    else:
        assert kind == "failed" and isinstance(result.__cause__, NonFiniteWeightsError)
        assert slots_in(cache, SlotPhase.LOADING) == 0 and cache.residency() == []


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_a_slot_filled_from_the_trainers_image_after_its_event_holds_the_files_shard(
        catalog: AdapterCatalog, tp: int) -> None:
    """On the GPU: the trainer writes its image on its own stream and records an event; each rank's gather runs on
    its copy stream after that event (no host sync between), and its slot equals the file load's; a NaN is caught."""
    spec, other = catalog.get(catalog.names()[1]), catalog.get(catalog.names()[2])
    image, head = image_of(spec, "cuda")
    staged = image.clone()
    bad, bad_head = image_of(other, "cuda")
    for rank in range(tp):
        pushed, loaded = (WorkerCache(WorkerConfig(num_slots=3, tp=tp, tp_rank=rank, device="cuda",
                                                   host=HostTierConfig(host_bytes=1 << 20, pin=False)), catalog)
                          for _ in range(2))
        try:
            trainer = torch.cuda.Stream()
            image.zero_()
            torch.cuda.synchronize()
            with torch.cuda.stream(trainer):
                torch.cuda._sleep(20_000_000)  # the trainer still writing when the rank's load is issued
                image.copy_(staged)
                written = torch.cuda.Event()
                written.record()
            pushed.load_image(spec.name, spec.version, image, head, after=written).result(timeout=60)
            loaded.prefetch(spec.name).result(timeout=60)
            assert slot_bytes(pushed, spec.name, spec.version) == slot_bytes(loaded, spec.name, spec.version)
            whole_nan = bad.clone()
            whole_nan[len(bad_head):].view(torch.int16).fill_(0x7FC0)
            with pytest.raises(NonFiniteWeightsError):
                pushed.load_image(other.name, other.version, whole_nan, bad_head).result(timeout=60)
            assert slots_in(pushed, SlotPhase.LOADING) == 0 and slots_in(pushed, SlotPhase.READY) == 1
        finally:
            pushed.close()
            loaded.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_a_gpu_rank_compiles_the_gather_when_it_starts() -> None:
    """A trainer's first push does not wait for Triton's compiler: the rank's ``TrainerImages`` compiled the gather
    for every word on a thread at its start, and a gather of a plan never seen runs without compiling again."""
    images = TrainerImages(torch.device("cuda", 0))
    images.warming.join(timeout=300)
    assert images.warm_s is not None and images.warm_s > 0, "the gather was not compiled at the rank's start"
    src = torch.arange(4096, dtype=torch.int64, device="cuda").view(torch.uint8)
    dst = torch.zeros_like(src)
    plan = gather_plan([(8, 16, 1024), (2048, 4000, 64)])
    gather(dst, src, plan)
    torch.cuda.synchronize()
    assert torch.equal(dst[16:1040], src[8:1032]) and torch.equal(dst[4000:4064], src[2048:2112])


@pytest.mark.parametrize("finite", [True, False])
def test_a_load_settled_by_its_caller_is_ready_or_failed_when_the_call_returns_and_delivered_once(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], finite: bool) -> None:
    """``settle_s`` (a device push's rank waits for its load anyway): the call makes the load READY itself once its
    gather completed (here at once: the CPU's copies run as issued), reported once, as the watcher would have; a NaN
    fails it the same way; the slot's bytes are the file's."""
    ready: list[ReadinessRecord] = []
    cache, loaded = make_cache(catalog, on_ready=ready.append), make_cache(catalog)
    deltas: list[Delta] = []
    cache.on_change = deltas.append
    name = catalog.names()[0]
    spec = catalog.get(name)
    image, head = image_of(spec)
    load = cache.load_image(name, spec.version, image if finite else with_nan(image, head), head, settle_s=5.0)
    assert load.done(), "a settled load returned before it was READY or failed"
    if finite:
        loaded.prefetch(name).result(timeout=30)
        assert slot_bytes(cache, name, spec.version) == slot_bytes(loaded, name, spec.version)
        assert [r.version for r in ready] == [spec.version] and cache.counters.loads == 1
        assert [d.state for d in deltas if d.state == "ready"] == ["ready"]
    else:
        assert isinstance(load.exception(), NonFiniteWeightsError) and ready == []
        assert slots_in(cache, SlotPhase.LOADING) == 0 and cache.residency() == []
    assert not cache.load_path.watcher._pending  # nothing left for the watcher to deliver again


def test_a_load_not_done_within_its_settle_time_is_left_to_the_watcher_and_delivered_once(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """The gather has not run within ``settle_s`` (a deferred copy stream: a trainer's stream still busy): the call
    returns with the load in flight, and the watcher makes it READY once the copy runs, once."""
    ready: list[ReadinessRecord] = []
    cache = make_cache(catalog, on_ready=ready.append)
    streams = CpuStreams(cache.device, deferred=True)
    use_streams(cache, streams)
    name = catalog.names()[1]
    spec = catalog.get(name)
    image, head = image_of(spec)
    load = cache.load_image(name, spec.version, image, head, settle_s=0.01)
    assert not load.done()
    streams.run_copies()
    assert load.result(timeout=30).version == spec.version
    assert [r.version for r in ready] == [spec.version]


def test_the_caller_and_the_watcher_racing_for_one_completed_load_deliver_it_once(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """``CompletionWatcher.settle`` against the watcher's own poll of the same completed load, the two released at
    one barrier, many times: exactly one of them delivers it (its callback runs once)."""
    from workers.gpu.copies import CompletionWatcher
    from workers.gpu.streams import HostEvent

    streams = CpuStreams(torch.device("cpu"))
    for _ in range(200):
        calls: list[object] = []
        watcher = CompletionWatcher(streams, calls.append, poll_s=1e-6, max_poll_s=1e-6)
        start = threading.Barrier(2)
        load = types.SimpleNamespace(ready_event=HostEvent(done=False), copy_due=0.0, key="k", mark=lambda _: None)
        watcher.add(load)  # type: ignore[arg-type]
        settled: list[bool] = []
        caller = threading.Thread(target=_settle_at, args=(start, watcher, load, settled))
        caller.start()
        start.wait()
        load.ready_event.done = True
        caller.join(timeout=30)
        watcher.close()
        assert calls == [load] and settled == [True], f"delivered {len(calls)} times"


def _settle_at(start: threading.Barrier, watcher: Any, load: Any, settled: list[bool]) -> None:
    start.wait()
    settled.append(watcher.settle(load, 1.0))


def test_a_cpu_rank_makes_no_fill_graph_and_its_loads_flags_are_its_own(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """``FillGraphs`` (``workers.reads.fill_graph``) on the CPU: no graph (the launches it saves are a GPU's), so the
    CPU rank fills as before; each load gets its own flag, and an unpinned one is not kept for reuse. (The graph path
    itself, and the reuse of pinned flags, are the ``gpu`` tests' in ``tests/test_device_pushes.py``.)"""
    cache = make_cache(catalog)
    name = catalog.names()[0]
    spec = catalog.get(name)
    image, head = image_of(spec)
    read = cache.image_reads.read(spec, cache.layout_of(name), head, image)
    dest = torch.empty(read.layout.numel, dtype=read.layout.dtype)
    assert cache.fill_graphs.get(read, image, dest) is None
    first, second = cache.fill_graphs.flag(False), cache.fill_graphs.flag(False)
    assert first is not second and not first.is_pinned()
    cache.fill_graphs.give(first)
    assert cache.fill_graphs.flag(False) is not first
    cache.load_image(name, spec.version, image, head).result(timeout=30)
    assert cache.fill_graphs.captures == 0
