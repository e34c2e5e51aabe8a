"""Reads split over several reader threads (issue 30): exactly the single reader's bytes for every shape and TP
rank, chunks published in order and whole, a failed part failing only its read, nothing written after a read
gave its buffer back, and the plan covering every slice once for the Llama shapes' layouts (no file)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import workers.reads.shard as reader_module
import workers.reads.threads as read_pool_module
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.chunks import chunk_plan
from lora_cache.adapters.peft import AdapterSpec, LoraModule, peft_key
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import ShardEntry, shard_layout
from lora_cache.adapters.synth import write_adapter
from lora_cache.errors import AdapterFormatError, ConfigError
from lora_cache.vocab import AdapterKey
from workers.reads.plan import FileTensor, contiguous, plan_tasks, task_bytes_for
from workers.reads.shard import HOW, read_shard, read_slices
from workers.reads.threads import ReadPool, auto_readers, ranks_on_host, run_in_order
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostTier

BF16, F32 = torch.bfloat16, torch.float32
MiB = 1 << 20


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, ReadPool]]:
    made = {n: ReadPool(n) for n in (1, 2, 3, 8)}
    yield made
    for pool in made.values():
        pool.close()


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory: pytest.TempPathFactory) -> AdapterSpec:
    """A Llama-3.1-8B-shaped adapter of rank 2 (10 MB): the real layouts, row-parallel column slices included."""
    root = tmp_path_factory.mktemp("llama8b")
    gen = torch.Generator().manual_seed(3)
    write_adapter(root / "a", SHAPES["llama-3.1-8b"], 2, 4.0, list(MODULE_ORDER), BF16, gen)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="llama-3.1-8b", max_rank=2))
    return catalog.register("a", root / "a")


def read(spec: AdapterSpec, model: str, tp: int, rank: int, dtype: torch.dtype, pool: ReadPool | None,
         chunk_bytes: int = 0, verify: str = "sample", how: str = "preadv") -> tuple[torch.Tensor, list[int]]:
    """The shard read by ``pool`` (None: the single reader), chunk by chunk, and the chunk counts published."""
    shape = SHAPES[model]
    lay = shard_layout(spec, shape, tp, rank, dtype)
    plan = chunk_plan(lay.entries, lay.numel, shape.num_layers, dtype.itemsize, chunk_bytes)
    dest = torch.full((lay.numel,), float("nan"), dtype=dtype)
    published: list[int] = []
    assert spec.source is not None
    read_slices(spec.source, lay.entries, dest, "", verify, plan.entry_spans, published.append, pool, how)
    return dest, published


@pytest.mark.parametrize("readers", [1, 2, 8])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_shards_read_in_parallel_equal_the_single_reader(
    llama8b: AdapterSpec, pools: dict[int, ReadPool], tp: int, readers: int
) -> None:
    """Every TP rank of the 8B layout (column slices of row-parallel lora_A, row blocks of column-parallel lora_B),
    bf16 straight into the buffer (a column slice by one read over its rows, or one per row, or the mapped
    file's copies) and converted to fp32 through scratch: the same bytes as the single reader's."""
    for rank in range(tp):
        for dtype in (BF16, F32):
            want, chunks = read(llama8b, "llama-3.1-8b", tp, rank, dtype, None, chunk_bytes=MiB // 4)
            for how in HOW:
                got, published = read(llama8b, "llama-3.1-8b", tp, rank, dtype, pools[readers], MiB // 4, how=how)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (tp, rank, dtype, how)
                assert published == chunks == list(range(1, len(chunks) + 1)) and len(chunks) > 2


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_shards_of_mixed_ranks_read_in_parallel_equal_the_single_reader(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    pools: dict[int, ReadPool], tp: int
) -> None:
    paths = tiny_adapters(count=3, rank="8,16,4")
    catalog = make_catalog(paths[0].parent)
    for path in paths:
        spec = catalog.get(path.name)
        for rank in range(tp):
            for dtype in (BF16, F32):
                want, _ = read(spec, "tiny", tp, rank, dtype, None)
                for n in (2, 3):
                    got, _ = read(spec, "tiny", tp, rank, dtype, pools[n])
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (path.name, rank, dtype, n)


def test_chunks_are_published_in_order_and_whole(llama8b: AdapterSpec, pools: dict[int, ReadPool]) -> None:
    """When chunk k is published, chunks 0..k are in the buffer entire (their copies may start)."""
    shape = SHAPES["llama-3.1-8b"]
    lay = shard_layout(llama8b, shape, 4, 3, BF16)
    plan = chunk_plan(lay.entries, lay.numel, shape.num_layers, 2, 0)  # a chunk per layer: 32
    want, _ = read(llama8b, "llama-3.1-8b", 4, 3, BF16, None)
    dest = torch.full((lay.numel,), float("nan"), dtype=BF16)
    seen: list[int] = []

    def on_chunk(k: int) -> None:
        stop = plan.chunks[k - 1].stop
        assert torch.equal(dest[:stop].view(torch.uint8), want[:stop].view(torch.uint8)), f"chunk {k} not whole"
        seen.append(k)

    read_shard(llama8b, lay, dest, "content", plan.entry_spans, on_chunk, pools[8])
    assert seen == list(range(1, 33))


# -- failures -----------------------------------------------------------------------------------------------


def test_a_failed_task_fails_the_read_only_after_every_started_task_ended(pools: dict[int, ReadPool]) -> None:
    """A task that raises fails the read; tasks not started are skipped; the call returns (raising) only once
    no task of it runs, so no thread writes into a buffer the caller has given back."""
    pool = ReadPool(2)
    started, release, failed = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    returned = threading.Event()

    def slow() -> None:
        started.set()
        assert release.wait(timeout=10)
        ran.append("slow")

    def fail() -> None:
        assert started.wait(timeout=10)
        failed.set()
        raise OSError("a part failed")

    errors: list[BaseException] = []

    def call() -> None:
        try:
            run_in_order(pool, [[slow, fail], [lambda: ran.append("later")]], lambda k: ran.append(f"done {k}"))
        except BaseException as e:
            errors.append(e)
        returned.set()

    caller = threading.Thread(target=call)
    caller.start()
    assert failed.wait(timeout=10)
    assert not returned.wait(timeout=0.2)  # the slow task still runs: the call must not have returned
    release.set()
    caller.join(timeout=10)
    assert returned.is_set() and [str(e) for e in errors] == ["a part failed"]
    assert ran == ["slow"]  # the later chunk's task was skipped, no chunk was published
    run_in_order(pool, [[lambda: ran.append("next")]], lambda k: None)  # the threads live on
    assert ran[-1] == "next"
    pool.close()


def test_a_reader_thread_that_fails_fails_only_its_read(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    monkeypatch: pytest.MonkeyPatch, file_slices: Callable
) -> None:
    """One part of a read raises: that read fails with the file named, the host tier is as it was, and the next
    read (the same threads) succeeds with the file's bytes."""
    paths = tiny_adapters(count=2, rank="16")
    catalog = make_catalog(paths[0].parent)
    tier = HostTier(HostTierConfig(host_bytes=MiB, read_threads=2, read_parallel=4, pin=False, reads="thread"))
    real, calls, lock = reader_module._run_task, [0], threading.Lock()

    def first_fails(*args: Any) -> None:
        with lock:
            calls[0] += 1
            mine = calls[0]
        if mine == 1:  # the first part: no chunk was published, so nothing may be copying from the entry
            raise OSError("injected: the disk said no")
        real(*args)

    try:
        first = catalog.get(paths[0].name)
        lay = shard_layout(first, SHAPES["tiny"], 1, 0, F32)
        tier.fetch(first, lay, chunks=chunk_plan(lay.entries, lay.numel, 2, 4, 0).entry_spans)[0].result(timeout=30)
        tier.release(AdapterKey(first.name, first.version))
        before = (list(tier._entries), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read)
        monkeypatch.setattr(reader_module, "_run_task", first_fails)
        spec = catalog.get(paths[1].name)
        lay = shard_layout(spec, SHAPES["tiny"], 1, 0, F32)
        spans = chunk_plan(lay.entries, lay.numel, 2, 4, 0).entry_spans
        future, hit = tier.fetch(spec, lay, chunks=spans)
        with pytest.raises(AdapterFormatError, match="injected: the disk said no") as e:
            future.result(timeout=30)
        assert not hit and str(spec.weights) in str(e.value)
        assert (list(tier._entries), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read) == before
        tier.check_integrity()
        monkeypatch.setattr(reader_module, "_run_task", real)
        entry = tier.fetch(spec, lay, chunks=spans)[0].result(timeout=30)
        for e in lay.entries:
            want = file_slices(spec, lay)[(e.layer, e.module, e.ab)]
            assert torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape), want), e.key
        tier.release(AdapterKey(spec.name, spec.version))
        tier.check_integrity()
    finally:
        tier.close()


# -- the plan over the real shapes' layouts (no file) ------------------------------------------------------


def synthetic(model: str, rank: int) -> tuple[AdapterSpec, dict[str, FileTensor]]:
    """A spec of every module at ``rank`` and where its tensors would be in a safetensors file (keys sorted,
    packed, after an odd-sized header)."""
    shape = SHAPES[model]
    modules = tuple(LoraModule(layer, m, rank, 2.0) for layer in range(shape.num_layers) for m in MODULE_ORDER)
    spec = AdapterSpec("x", Path("/nonexistent"), None, modules, "bfloat16", "v", 0)  # type: ignore[arg-type]
    shapes = {}
    for layer in range(shape.num_layers):
        for m in MODULE_ORDER:
            d_in, d_out = shape.dims(m)
            shapes[peft_key(layer, m, "A")], shapes[peft_key(layer, m, "B")] = (rank, d_in), (d_out, rank)
    index, at = {}, 8 + 4093
    for key in sorted(shapes):
        index[key] = FileTensor(BF16, shapes[key], at)
        at += shapes[key][0] * shapes[key][1] * 2
    return spec, index


def segments(e: ShardEntry, t: FileTensor) -> list[tuple[int, int, int]]:
    """(buffer byte, file byte, bytes) of ``e``'s slice of ``t``: one for a contiguous slice, else one per row."""
    size, cols = t.dtype.itemsize, t.shape[-1]
    width = e.shape[1] * size
    if contiguous(e, t):
        return [(e.offset * size, t.start + (e.rows.start * cols + e.cols.start) * size, e.numel * size)]
    return [(e.offset * size + i * width, t.start + ((e.rows.start + i) * cols + e.cols.start) * size, width)
            for i in range(e.shape[0])]


def merged(segs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for at, start, n in sorted(segs):
        if out and out[-1][0] + out[-1][2] == at and out[-1][1] + out[-1][2] == start:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((at, start, n))
    return out


@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-3.1-70b"])
@pytest.mark.parametrize("rank", [16, 64])
def test_the_plan_reads_every_slice_once_for_the_llama_layouts(model: str, rank: int) -> None:
    """Every TP rank of the real shapes: the plan's positioned reads map exactly the layout's slices (file byte ->
    buffer byte, each once), contiguous slices are runs, only row-parallel lora_A column slices are strided,
    and tasks keep the layout's order at about the size asked."""
    spec, index = synthetic(model, rank)
    shape = SHAPES[model]
    for tp in (1, 2, 4, 8):
        for k in sorted({0, tp - 1}):
            lay = shard_layout(spec, shape, tp, k, BF16)
            plan = chunk_plan(lay.entries, lay.numel, shape.num_layers, 2)
            want: list[tuple[int, int, int]] = []
            got: list[tuple[int, int, int]] = []
            for span in plan.entry_spans:
                part = lay.entries[span]
                size = task_bytes_for(sum(e.numel * 2 for e in part), 8)
                tasks = plan_tasks(index, part, BF16, size)
                assert sum(t.nbytes for t in tasks) == sum(e.numel * 2 for e in part)
                assert all(t.nbytes < size + 8 * MiB for t in tasks)
                firsts = [min([r.at for r in t.runs] + [s.at for s in t.strided]) for t in tasks]
                assert firsts == sorted(firsts)  # the layout's order: chunk k's bytes before chunk k+1's
                for t in tasks:
                    assert not t.converts  # the file's dtype: nothing to convert
                    got += [(r.at, r.start, r.nbytes) for r in t.runs]
                    got += [(s.at + i * s.width, s.start + i * s.stride, s.width) for s in t.strided
                            for i in range(s.rows)]
                    assert all(s.rows <= rank and s.stride > s.width and tp > 1 for s in t.strided)
                want += [s for e in part for s in segments(e, index[e.key])]
            assert merged(got) == merged(want), (model, rank, tp, k)


# -- the config -----------------------------------------------------------------------------------------------


def test_read_parallel_config_and_its_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"must be 0 \(auto.*or 1\.\.64 reader threads per read, got 65"):
        HostTierConfig(read_parallel=65)
    with pytest.raises(ConfigError, match="got -1; 1 reads in one thread"):
        HostTierConfig(read_parallel=-1)
    assert [auto_readers(c, r) for c, r in ((64, 4), (16, 4), (2, 1), (2, 4), (256, 8), (0, 1))] == [8, 4, 2, 1, 8, 1]
    assert HostTierConfig(read_parallel=3).readers(4) == 3
    gpus = tmp_path / "gpus"
    for i in range(4):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
    monkeypatch.setattr(read_pool_module, "GPU_DIR", gpus)
    assert (ranks_on_host(1), ranks_on_host(8)) == (4, 8)
    monkeypatch.setattr(read_pool_module, "GPU_DIR", tmp_path / "none")
    assert ranks_on_host(2) >= 2
    assert json.dumps(HostTierConfig().read_parallel) == "0"
