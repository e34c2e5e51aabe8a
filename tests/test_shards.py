"""TP shard specs and packed layouts: slices rebuild the file, alignment, no padding, shard-only reads."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import AdapterSpec, LoraModule, peft_key
from lora_cache.adapters.shapes import MODULE_ORDER, MODULES, SHAPES, ModelShape, Parallel
from lora_cache.adapters.shards import ALIGN_BYTES, ShardLayout, max_shard_numel, shard_layout, split
from lora_cache.errors import AdapterChangedError, AdapterFormatError, ConfigError, ShardError
from workers.reads.shard import read_shard

TINY = SHAPES["tiny"]
BF16 = torch.bfloat16
TPS = (1, 2, 4)


@pytest.fixture
def catalog(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]
) -> AdapterCatalog:
    paths = tiny_adapters(count=3, rank="8,16,4")
    return make_catalog(paths[0].parent)


def full_tensors(spec: AdapterSpec) -> dict[str, torch.Tensor]:
    with safe_open(str(spec.weights), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable


def packed(spec: AdapterSpec, layout: ShardLayout) -> tuple[torch.Tensor, int]:
    """The rank's shard as read_shard packs it (padding left NaN), and the bytes it read."""
    dest = torch.full((layout.numel + 64,), float("nan"), dtype=layout.dtype)
    return dest, read_shard(spec, layout, dest)


def matrix(buf: torch.Tensor, layout: ShardLayout, layer: int, module: str, ab: str) -> torch.Tensor:
    e = layout.entry(layer, module, ab)
    return buf[e.offset : e.offset + e.numel].view(e.shape)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", ["adapter-000", "adapter-001", "adapter-002"])
def test_union_of_rank_slices_reconstructs_every_tensor(catalog: AdapterCatalog, tp: int, name: str) -> None:
    spec = catalog.get(name)
    full = full_tensors(spec)
    layouts = [shard_layout(spec, TINY, tp, k, BF16) for k in range(tp)]
    bufs = [packed(spec, lay)[0] for lay in layouts]
    for m in spec.modules:
        parallel = MODULES[m.module][1]
        for ab in "AB":
            parts = [matrix(buf, lay, m.layer, m.module, ab) for buf, lay in zip(bufs, layouts, strict=True)]
            want = full[peft_key(m.layer, m.module, ab)]
            if (parallel, ab) == (Parallel.COLUMN, "B"):  # rows of lora_B [out, r]
                assert all(p.shape == (want.shape[0] // tp, m.rank) for p in parts)
                assert torch.equal(torch.cat(parts, dim=0), want)
            elif (parallel, ab) == (Parallel.ROW, "A"):  # columns of lora_A [r, in]
                assert all(p.shape == (m.rank, want.shape[1] // tp) for p in parts)
                assert torch.equal(torch.cat(parts, dim=1), want)
            else:  # held whole, identical on every rank
                assert all(torch.equal(p, want) for p in parts)
    for buf, lay in zip(bufs, layouts, strict=True):
        covered = torch.zeros(buf.numel(), dtype=torch.bool)
        for e in lay.entries:
            covered[e.offset : e.offset + e.numel] = True
        assert not buf[covered].isnan().any()  # every entry was written...
        assert buf[~covered].isnan().all()  # ...and nothing else (padding and the tail untouched)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offsets_aligned_ordered_and_disjoint(catalog: AdapterCatalog, tp: int, dtype: torch.dtype) -> None:
    spec = catalog.get("adapter-001")
    for k in range(tp):
        lay = shard_layout(spec, TINY, tp, k, dtype)
        assert (lay.adapter, lay.version, lay.tp, lay.rank, lay.dtype) == (
            spec.name,
            spec.version,
            tp,
            k,
            dtype,
        )
        assert [(e.layer, e.module, e.ab) for e in lay.entries] == [
            (m.layer, m.module, ab) for m in spec.modules for ab in "AB"
        ]  # (layer, module, A then B)
        assert [e.key for e in lay.entries] == [peft_key(e.layer, e.module, e.ab) for e in lay.entries]
        for e, nxt in zip(lay.entries, lay.entries[1:], strict=False):
            assert e.offset * dtype.itemsize % ALIGN_BYTES == 0
            assert e.offset + e.numel <= nxt.offset  # no overlap
            assert nxt.offset - (e.offset + e.numel) < ALIGN_BYTES // dtype.itemsize  # padding only to align
        last = lay.entries[-1]
        assert last.offset + last.numel <= lay.numel and lay.numel * dtype.itemsize % ALIGN_BYTES == 0
        assert lay.nbytes == lay.numel * dtype.itemsize
        assert all(e.shape == (e.rows.stop - e.rows.start, e.cols.stop - e.cols.start) for e in lay.entries)


def test_mixed_ranks_are_not_padded(catalog: AdapterCatalog) -> None:
    r8, r16, r4 = (catalog.get(f"adapter-00{i}") for i in range(3))
    assert (r8.max_rank, r16.max_rank, r4.max_rank) == (8, 16, 4)
    for tp in TPS:
        n4, n8, n16 = (shard_layout(s, TINY, tp, 0, BF16).numel for s in (r4, r8, r16))
        assert n4 < n8 < n16
        assert n16 == max_shard_numel(TINY, tp, 16, BF16)  # a full rank-16 adapter fills a max_rank-16 slot
        assert n8 == max_shard_numel(TINY, tp, 8, BF16)
        assert n8 < max_shard_numel(TINY, tp, 16, BF16)


def test_adapters_of_one_rank_pattern_share_one_packed_layout(catalog: AdapterCatalog) -> None:
    """A layout is built once per (modules, ranks) pattern: a demand load of a new adapter builds none."""
    r8 = catalog.get("adapter-000")
    twin = dataclasses.replace(r8, name="twin", version="v2")
    for tp in TPS:
        for k in range(tp):
            a, b = shard_layout(r8, TINY, tp, k, BF16), shard_layout(twin, TINY, tp, k, BF16)
            assert a.entries is b.entries and a.numel == b.numel
            assert (b.adapter, b.version, b.modules) == ("twin", "v2", r8.modules)
    other = shard_layout(catalog.get("adapter-001"), TINY, 2, 0, BF16)
    assert other.entries is not shard_layout(r8, TINY, 2, 0, BF16).entries  # rank 16, not 8


@pytest.mark.parametrize("tp", (1, 2))
def test_unaligned_and_other_dtype_files_read_exactly(
    tmp_path: Path, tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog], tp: int
) -> None:
    """An fp32 file read into a bf16 slot is converted; a header padded by one byte (every tensor then
    starts off its element alignment) reads the same values."""
    src = tiny_adapters(count=1, rank="8", dtype="float32")[0]
    data = (src / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    shutil.copytree(src, src.parent / "shifted")
    (src.parent / "shifted" / "adapter_model.safetensors").write_bytes(
        (n + 1).to_bytes(8, "little") + data[8 : 8 + n] + b" " + data[8 + n :])
    catalog = make_catalog(src.parent)
    for name in (src.name, "shifted"):
        spec = catalog.get(name)
        full = full_tensors(spec)
        for k in range(tp):
            lay = shard_layout(spec, TINY, tp, k, BF16)
            buf, read = packed(spec, lay)
            assert read == sum(e.numel for e in lay.entries) * 4  # fp32 bytes of this rank's slices only
            for e in lay.entries:
                want = full[e.key][e.rows, e.cols].to(BF16)
                assert torch.equal(buf[e.offset : e.offset + e.numel].view(e.shape), want), (name, e.key)


def test_per_module_ranks_follow_the_spec(
    tmp_path: Path, peft_writer: Callable[..., Path], tensors_for: Callable[..., dict], make_catalog: Callable
) -> None:
    ranks = {(0, "q_proj"): 4, (1, "down_proj"): 12}
    peft_writer(
        tmp_path / "mixed",
        tensors_for(rank=ranks),
        r=8,
        rank_pattern={"model.layers.0.self_attn.q_proj": 4, "layers.1.mlp.down_proj": 12},
    )
    spec = make_catalog(tmp_path).get("mixed")
    lay = shard_layout(spec, TINY, 2, 1, BF16)
    assert lay.entry(0, "q_proj", "A").shape == (4, 64) and lay.entry(0, "q_proj", "B").shape == (32, 4)
    assert lay.entry(1, "down_proj", "A").shape == (12, 64) and lay.entry(1, "down_proj", "B").shape == (
        64,
        12,
    )
    assert lay.entry(0, "k_proj", "B").shape == (16, 8)
    buf, _ = packed(spec, lay)
    full = full_tensors(spec)
    assert torch.equal(matrix(buf, lay, 1, "down_proj", "A"), full[peft_key(1, "down_proj", "A")][:, 64:])


@pytest.mark.parametrize("tp", TPS)
def test_shard_bytes_over_ranks_match_the_file(catalog: AdapterCatalog, tp: int) -> None:
    for spec in map(catalog.get, catalog.names()):
        full = full_tensors(spec)
        tensor_bytes = sum(t.numel() * t.element_size() for t in full.values())
        assert tensor_bytes < spec.file_bytes < tensor_bytes + 8192  # the file: tensors plus a small header
        whole = sum(
            full[peft_key(m.layer, m.module, ab)].numel() * 2
            for m in spec.modules
            for ab in "AB"
            if ab == ("A" if MODULES[m.module][1] is Parallel.COLUMN else "B")
        )
        layouts = [shard_layout(spec, TINY, tp, k, BF16) for k in range(tp)]
        payload = sum(e.numel * 2 for lay in layouts for e in lay.entries)
        assert payload == tensor_bytes + (tp - 1) * whole  # split matrices once, whole ones on every rank
        padding = sum(lay.nbytes for lay in layouts) - payload
        assert 0 <= padding < tp * len(layouts[0].entries) * ALIGN_BYTES


@pytest.mark.parametrize("tp", [2, 4])
def test_read_shard_reads_only_its_slices(catalog: AdapterCatalog, tp: int) -> None:
    spec = catalog.get("adapter-001")
    tensor_bytes = sum(t.numel() * t.element_size() for t in full_tensors(spec).values())
    reads = []
    for k in range(tp):
        lay = shard_layout(spec, TINY, tp, k, BF16)
        _, nbytes = packed(spec, lay)
        assert nbytes == sum(e.numel for e in lay.entries) * 2  # exactly its slices...
        assert nbytes < tensor_bytes < spec.file_bytes  # ...which is less than the file
        reads.append(nbytes)
    assert len(set(reads)) == 1  # every rank reads the same amount
    _, whole = packed(spec, shard_layout(spec, TINY, 1, 0, BF16))
    assert whole == tensor_bytes


def test_read_shard_converts_to_the_slot_dtype(
    tmp_path: Path, peft_writer: Callable[..., Path], tensors_for: Callable[..., dict], make_catalog: Callable
) -> None:
    peft_writer(tmp_path / "f32", tensors_for(dtype=torch.float32))
    spec = make_catalog(tmp_path).get("f32")
    lay = shard_layout(spec, TINY, 2, 0, BF16)
    buf, nbytes = packed(spec, lay)
    assert nbytes == sum(e.numel for e in lay.entries) * 4  # bytes of the file's float32 slices
    want = full_tensors(spec)[peft_key(0, "o_proj", "A")][:, :32].to(BF16)
    assert torch.equal(matrix(buf, lay, 0, "o_proj", "A"), want)


def test_read_shard_of_a_changed_file(catalog: AdapterCatalog) -> None:
    spec = catalog.get("adapter-000")
    lay = shard_layout(spec, TINY, 2, 1, BF16)
    data = spec.weights.read_bytes()
    spec.weights.write_bytes(data + b"\0" * 16)
    with pytest.raises(AdapterFormatError) as e:
        packed(spec, lay)
    msg = str(e.value)
    assert "changed size" in msg and spec.version in msg and f"{len(data)} -> {len(data) + 16}" in msg
    assert "register it again" in msg
    spec.weights.write_bytes(data[:100] + bytes(len(data) - 100))  # same size, header destroyed
    with pytest.raises(AdapterChangedError) as e:
        packed(spec, lay)
    assert "written in place" in str(e.value) and spec.version in str(e.value) and "register it again" in str(e.value)
    spec.weights.unlink()
    with pytest.raises(AdapterFormatError, match="is gone"):
        packed(spec, lay)


def test_tp_that_does_not_divide_names_the_module(catalog: AdapterCatalog) -> None:
    spec = catalog.get("adapter-000")
    with pytest.raises(ShardError) as e:
        shard_layout(spec, TINY, 3, 0, BF16)
    msg = str(e.value)
    assert "layer 0 q_proj.lora_B (column-parallel)" in msg and "size 64" in msg and "TP size 3" in msg
    assert "use a TP size that divides 64" in msg
    with pytest.raises(ShardError, match=r"q_proj\.lora_B"):
        max_shard_numel(TINY, 3, 16, BF16)


def test_row_parallel_shard_error(
    tmp_path: Path, peft_writer: Callable[..., Path], tensors_for: Callable[..., dict], make_catalog: Callable
) -> None:
    peft_writer(tmp_path / "down", tensors_for(modules=("down_proj",)), target_modules=["down_proj"])
    spec = make_catalog(tmp_path).get("down")
    with pytest.raises(ShardError) as e:
        shard_layout(spec, TINY, 3, 0, BF16)
    assert "layer 0 down_proj.lora_A (row-parallel)" in str(e.value) and "size 128" in str(e.value)
    assert shard_layout(spec, TINY, 8, 7, BF16).entry(1, "down_proj", "A").cols == slice(112, 128)


def test_invalid_tp_rank(catalog: AdapterCatalog) -> None:
    spec = catalog.get("adapter-000")
    for tp, k in ((2, 2), (2, -1), (0, 0)):
        with pytest.raises(ConfigError) as e:
            shard_layout(spec, TINY, tp, k, BF16)
        assert f"TP rank {k} of size {tp} is invalid" in str(e.value)


def test_layout_entry_lookup(catalog: AdapterCatalog) -> None:
    spec = catalog.get("adapter-000")
    lay = shard_layout(spec, TINY, 1, 0, BF16)
    with pytest.raises(KeyError, match=r"no gate_proj\.lora_A in layer 5"):
        lay.entry(5, "gate_proj", "A")


def test_split_table() -> None:
    assert [split(12, 3, k, "x") for k in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    with pytest.raises(ShardError, match="thing: size 10 does not divide by TP size 4"):
        split(10, 4, 0, "thing")


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b"])
def test_real_model_layouts(name: str) -> None:
    """Layouts of real shapes from a synthetic spec (no file): sizes divide by TP 1..8 and sum correctly."""
    shape: ModelShape = SHAPES[name]
    modules = tuple(LoraModule(layer, m, 16, 2.0) for layer in range(shape.num_layers) for m in MODULE_ORDER)
    spec = AdapterSpec("x", Path("/nonexistent"), None, modules, "bfloat16", "v", 0)  # type: ignore[arg-type]
    whole = shard_layout(spec, shape, 1, 0, BF16)
    assert whole.numel == max_shard_numel(shape, 1, 16, BF16)
    per_layer = sum(16 * (d_in + d_out) for d_in, d_out in map(shape.dims, MODULE_ORDER))
    assert whole.numel == per_layer * shape.num_layers  # real sizes are multiples of 64: no padding
    for tp in (2, 4, 8):
        lays = [shard_layout(spec, shape, tp, k, BF16) for k in (0, tp - 1)]
        assert lays[0].numel == lays[1].numel == max_shard_numel(shape, tp, 16, BF16) < whole.numel


def test_a_ranks_new_version_of_a_pattern_takes_its_entries_and_plan_as_fresh_ones_would_be(
        catalog: AdapterCatalog) -> None:
    """``RankShards`` (a pushed version's load, issue 44 item 5): a new version of a module pattern a rank has laid out
    before gets the layout ``shard_layout`` makes for it (its own name and version, the pattern's entries) and the
    chunk plan ``chunk_plan`` makes, without recomputing either; another pattern gets its own; a spec equal to a kept
    one but not it is laid out again (identity, not equality, keys the cache)."""
    from lora_cache.adapters.chunks import chunk_plan
    from workers.cache import RankShards

    r8, r16 = catalog.get("adapter-000"), catalog.get("adapter-001")
    for tp in TPS:
        shards = RankShards(catalog, tp, tp - 1, BF16, 1 << 12)
        first = shards.layout(r8)
        for version in ("v2", "v3"):
            pushed = dataclasses.replace(r8, name="pushed", version=version)
            layout, fresh = shards.layout(pushed), shard_layout(pushed, TINY, tp, tp - 1, BF16)
            assert layout == fresh and layout.entries is first.entries, (tp, version)
            assert (layout.adapter, layout.version) == ("pushed", version)
            assert shards.plan(pushed) == chunk_plan(fresh.entries, fresh.numel, TINY.num_layers, 2, 1 << 12)
            assert shards.plan(pushed) is shards.plan(r8)  # one plan per pattern
            assert shards.layout(pushed) is layout  # kept for the spec
        other = shards.layout(r16)
        assert other == shard_layout(r16, TINY, tp, tp - 1, BF16) and other.entries is not first.entries
        again = dataclasses.replace(r8)  # equal, not the same object
        assert shards.layout(again) == first and shards.layout(again) is not first
