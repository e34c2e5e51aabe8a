"""NaN/Inf weights are refused as a shard is read (issue 46 item 4): the load fails naming the adapter, the tensor and
the fix, no chunk holding one is published (so none is copied to a GPU), and the cache is left as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import AdapterSpec, peft_key
from lora_cache.adapters.shapes import SHAPES
from lora_cache.adapters.shards import ShardEntry, ShardLayout, shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.errors import NonFiniteWeightsError
from lora_cache.vocab import AdapterKey
from tests.waiting import wait_for
from workers.cache import WorkerCache, WorkerConfig
from workers.reads.finite import ROW, all_finite, check_finite
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostEntry, HostTier

TINY = SHAPES["tiny"]
GOOD, NAN, INF, GOOD2 = "adapter-000", "adapter-001", "adapter-002", "adapter-003"
BAD = {NAN: (1, "o_proj", "B", float("nan")), INF: (0, "q_proj", "A", float("inf"))}  # layer 1: the second chunk


def poison(path: Path, layer: int, module: str, ab: str, value: float) -> str:
    """Set one weight of ``path``'s adapter to ``value``, written back with safetensors; the tensor's key."""
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = peft_key(layer, module, ab)
    tensors[key][1, 2] = value
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return key


@pytest.fixture
def catalog(tmp_path: Path, make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    paths = make_adapters(tmp_path / "adapters", SynthConfig(model="tiny", count=4, rank="8"))
    for name, bad in BAD.items():
        poison(next(p for p in paths if p.name == name), *bad)
    return make_catalog(tmp_path / "adapters")  # registration reads config + header only: it takes them


@contextlib.contextmanager
def open_cache(catalog: AdapterCatalog, reads: str, dtype: str = "float32") -> Iterator[WorkerCache]:
    """A CPU cache, a chunk per layer (the tiny model's two), reading on threads or in reader processes."""
    cache = WorkerCache(WorkerConfig(num_slots=3, device="cpu", dtype=dtype, chunk_bytes=0,
                                     host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False, reads=reads)),
                        catalog)
    try:
        assert cache.host.reads == reads
        if reads == "process":  # reader processes up first: a bound, not a timing (they start slowly on a 2-core CI)
            wait_for(lambda: all(p.warm() for p in cache.host._reader._all),  # type: ignore[union-attr]
                     "the reader processes to start", 120)
        yield cache
    finally:
        cache.close()


def state(cache: WorkerCache) -> tuple[object, ...]:
    cache.settle()
    return (cache.residency(), cache.host.contents(), cache.host.arena.used_bytes, list(cache.host.arena._free),
            len(cache.host._orphans))


def slot_of(cache: WorkerCache, name: str) -> int:
    return next(int(r["slot"]) for r in cache.residency() if r["adapter"] == name)  # type: ignore[call-overload]


def assert_holds_file(cache: WorkerCache, spec: AdapterSpec, slot: int) -> None:
    full = load_file(str(spec.weights))
    layout = cache.layout_of(spec.name)
    for e in layout.entries:
        assert torch.equal(cache.slot_view(slot, layout, e.layer, e.module, e.ab), full[e.key][e.rows, e.cols].float())


@pytest.mark.parametrize("reads", ["thread", "process"])
def test_a_nan_or_inf_weight_fails_the_load_and_leaves_the_cache_as_it_was(catalog: AdapterCatalog,
                                                                            reads: str) -> None:
    with open_cache(catalog, reads) as cache:
        cache.prefetch(GOOD).result(timeout=120)
        before = state(cache)
        for name, (layer, module, ab, value) in BAD.items():
            with pytest.raises(NonFiniteWeightsError) as e:
                cache.prefetch(name).result(timeout=120)
            message = str(e.value)
            assert f"adapter {name}@{catalog.get(name).version}" in message
            assert peft_key(layer, module, ab) in message and f"layer {layer} {module}.lora_{ab}" in message
            assert ("1 NaN and 0 Inf" if value != value else "0 NaN and 1 Inf") in message
            assert "at [1, 2]" in message and "Re-export the adapter" in message
            assert state(cache) == before  # no slot, no host entry, no byte held; a failed load changes nothing
            cache.check_integrity()
            with pytest.raises(NonFiniteWeightsError):  # a stage (no slot) is refused the same way, and holds nothing
                stage = cache.stage(name)
                assert stage is not None
                stage.result(timeout=120)
            assert state(cache) == before
            cache.check_integrity()
        cache.prefetch(GOOD2).result(timeout=120)  # a good adapter beside them still loads, bytes as in its file
        assert {r["adapter"]: r["state"] for r in cache.residency()} == {GOOD: "ready", GOOD2: "ready"}
        assert_holds_file(cache, catalog.get(GOOD2), slot_of(cache, GOOD2))
        assert cache.stats()["load_failures"] == 2
        cache.check_integrity()


def test_no_chunk_holding_a_nan_is_published(catalog: AdapterCatalog) -> None:
    """The NaN is in layer 1 (the second chunk): the first chunk is told to the fetcher, the second never is."""
    tier = HostTier(HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False, reads="thread"))
    try:
        spec = catalog.get(NAN)
        layout = shard_layout(spec, TINY, 1, 0, torch.float32)
        per_layer = len(layout.entries) // TINY.num_layers
        told: list[int] = []

        def on_chunk(entry: HostEntry, count: int, hit: bool) -> None:
            told.append(count)

        future, _ = tier.fetch(spec, layout, chunks=[slice(0, per_layer), slice(per_layer, 2 * per_layer)],
                               on_chunk=on_chunk)
        with pytest.raises(NonFiniteWeightsError, match=r"layer 1 o_proj\.lora_B"):
            future.result(timeout=60)
        assert told == [1]  # the first chunk (finite) only
        assert tier._orphans  # its first chunk may be on its way to a GPU: held until the fetcher lets go
        tier.release_failed(tier._orphans[0])
        assert tier.arena.used_bytes == 0 and not tier.contains(AdapterKey(spec.name, spec.version))
        tier.check_integrity()
    finally:
        tier.close()


def test_a_float32_weight_beyond_float16s_range_is_refused_in_a_float16_slot(tmp_path: Path,
                                                                            make_catalog: Callable) -> None:
    paths = make_adapters(tmp_path / "adapters", SynthConfig(model="tiny", count=2, rank="8", dtype="float32"))
    poison(paths[1], 0, "v_proj", "B", 1e6)  # finite in the file, Inf as float16
    catalog = make_catalog(tmp_path / "adapters")
    with open_cache(catalog, "thread", dtype="float16") as cache:
        cache.prefetch(paths[0].name).result(timeout=60)
        with pytest.raises(NonFiniteWeightsError, match=r"v_proj.lora_B.*as float16\) holds 0 NaN and 1 Inf.*beyond "
                                                        "float16's range"):
            cache.prefetch(paths[1].name).result(timeout=60)
        assert [r["adapter"] for r in cache.residency()] == [paths[0].name]
        cache.check_integrity()


def test_all_finite_is_exact_where_partial_sums_overflow_or_padding_is_not() -> None:
    big = torch.full((ROW * 3 + 5,), 60000.0, dtype=torch.float16)  # every row's sum overflows float16
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = big.clone()
        t[ROW * 3 + 4] = bad  # in the tail past the last whole row
        assert not all_finite(t)
    # two entries with padding between them that holds a NaN (left from an earlier shard): not a weight, so it passes
    entries = [ShardEntry(0, "q_proj", "A", "a", slice(0, 2), slice(0, 4), (2, 4), 0),
               ShardEntry(0, "q_proj", "B", "b", slice(0, 4), slice(0, 2), (4, 2), 16)]
    dest = torch.zeros(24, dtype=torch.bfloat16)
    dest[10] = float("nan")
    spec_layout = ShardLayout("x", "v", 1, 0, torch.bfloat16, (), (), 24)  # for the message's dtype and TP rank
    check_finite("x@v", spec_layout, dest, entries)
    dest[17] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match=r"x@v: tensor b .*\[4, 2\].* 0 NaN and 1 Inf .*at \[0, 1\]"):
        check_finite("x@v", spec_layout, dest, entries)



def test_a_large_span_is_proven_in_pieces_on_the_pool_as_exactly_as_on_one_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch runs one intra-op thread (a worker actor), a span over 2 pieces is checked on the pool: the
    same answer as one thread for a NaN or Inf in any piece, the first, the last and a short tail."""
    import workers.reads.finite as finite

    monkeypatch.setattr(finite, "CHECK_THREADS", 4)
    monkeypatch.setattr(finite, "PIECE_BYTES", 4 * ROW * 2)  # 4 rows of bf16 a piece
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = torch.ones(4 * ROW * 5 + 7, dtype=torch.bfloat16)  # 5 pieces and a tail
        assert finite.all_finite(t)
        for at in (0, 4 * ROW - 1, 4 * ROW, 2 * 4 * ROW + 3, t.numel() - 1):
            for bad in (float("nan"), float("inf"), float("-inf")):
                t[at] = bad
                assert not finite.all_finite(t) and not finite.one_finite(t), (at, bad)
                t[at] = 1.0
        assert finite.all_finite(t)
    finally:
        torch.set_num_threads(threads)
