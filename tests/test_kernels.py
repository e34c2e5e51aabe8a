"""The LoRA kernels (SGMV, BGMV) against an fp32 oracle built from the adapters' own weights.

On a CPU-only machine the Triton kernels run in Triton's interpreter (fp32 and fp16, small shapes);
on a GPU machine the same tests run compiled on the GPU (``gpu`` marker), bf16 included, with a
CUDA-graph replay test. The oracle never reads the pool or the metadata: it computes from the full
weights, so it checks the packed layout, the metadata and the kernels together.
"""

from __future__ import annotations

import torch

from tests.interpreted import build_for_interpreter

HAS_CUDA = torch.cuda.is_available()


if not HAS_CUDA:
    build_for_interpreter(("workers.kernels.bgmv", "workers.kernels.sgmv"))

import dataclasses  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import AdapterConfig, AdapterSpec, LoraModule  # noqa: E402
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES, ModelShape  # noqa: E402
from lora_cache.adapters.shards import shard_layout  # noqa: E402
from workers.cache import WorkerCache, WorkerConfig  # noqa: E402
from workers.kernels import BatchMeta, SlotMeta, lora_apply, lora_apply_ref, shard_dims  # noqa: E402
from workers.kernels.tuning import tuned  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

SHAPE = ModelShape("kernel-test", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                   head_dim=16)
QKV = ("q_proj", "k_proj", "v_proj")
LAYER = 1  # not layer 0, so per-layer offsets matter
MIXED_RANKS = (8, 12, 16, 24, 40, 64, 128, 4)  # 12, 40 and 4 are not multiples of 8 or 16: the unaligned paths

INTERPRETED = pytest.mark.skipif(HAS_CUDA, reason="CPU variant: the Triton interpreter runs on CPU-only machines")
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
CPU, CUDA = pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=ON_GPU)
APPLIES: tuple[Callable[..., None], ...] = (lora_apply, lora_apply_ref)  # the kernels and their torch twin
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}  # x max(1, |expected|)


def dev_dtypes(cpu: Sequence[torch.dtype], cuda: Sequence[torch.dtype]) -> list[Any]:
    """(device, dtype) parameters: interpreted on the CPU, compiled (gpu marker) on CUDA."""
    return ([pytest.param("cpu", d, marks=INTERPRETED, id=f"cpu-{str(d)[6:]}") for d in cpu]
            + [pytest.param("cuda", d, marks=ON_GPU, id=f"cuda-{str(d)[6:]}") for d in cuda])


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """This module's tests launch the Triton kernels on CPU tensors through the interpreter."""
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# -- adapters as plain weights, and a pool + SlotMeta holding them ---------------------------------
class Adapter(NamedTuple):
    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> full A [r, in], B [out, r]


def make_adapter(name: str, ranks: dict[str, int], shape: ModelShape, gen: torch.Generator) -> Adapter:
    """Random weights for ``ranks`` (module -> rank; a missing module is not adapted), every layer."""
    modules, weights = [], {}
    for layer in range(shape.num_layers):
        for module in MODULE_ORDER:
            if module not in ranks:
                continue
            r, (d_in, d_out) = ranks[module], shape.dims(module)
            scale = float(torch.empty(()).uniform_(0.5, 2.0, generator=gen))
            modules.append(LoraModule(layer, module, r, scale))
            weights[(layer, module)] = (torch.randn(r, d_in, generator=gen) / d_in**0.5,
                                        torch.randn(d_out, r, generator=gen) / r**0.5)
    config = AdapterConfig(r=max(ranks.values()), lora_alpha=1.0, target_modules=tuple(ranks))
    return Adapter(AdapterSpec(name, Path(name), config, tuple(modules), "float32", f"v-{name}", 0), weights)


class Pool(NamedTuple):
    pool: torch.Tensor
    meta: SlotMeta
    adapters: list[Adapter]  # adapter of each slot


def make_pool(adapters: list[Adapter], shape: ModelShape, tp: int, tp_rank: int, dtype: torch.dtype,
              device: str) -> Pool:
    """Each adapter's shard packed into its own slot exactly as a load would, and its SlotMeta row.

    Everything else in the pool (alignment padding, the unused tail) is NaN: a kernel that reads outside
    its matrices poisons its output and fails the test."""
    layouts = [shard_layout(a.spec, shape, tp, tp_rank, dtype) for a in adapters]
    pool = torch.full((len(adapters), max(lay.numel for lay in layouts)), float("nan"), dtype=dtype, device=device)
    max_rank = max(m.rank for a in adapters for m in a.spec.modules)  # as a catalog's max_rank would be
    meta = SlotMeta(len(adapters), shape.num_layers, MODULE_ORDER, torch.device(device), max_rank=max_rank,
                    dims=shard_dims(shape, tp), slot_numel=pool.shape[1])
    for slot, (adapter, layout) in enumerate(zip(adapters, layouts)):
        for e in layout.entries:
            full = adapter.weights[(e.layer, e.module)]["AB".index(e.ab)]
            pool[slot, e.offset : e.offset + e.numel] = full[e.rows, e.cols].reshape(-1).to(dtype)
        meta.write(slot, layout, adapter.spec)
    return Pool(pool, meta, adapters)


def oracle(y0: torch.Tensor, x: torch.Tensor, adapters: list[Adapter], token_slots: Sequence[int],
           modules: Sequence[str], dtype: torch.dtype, shape: ModelShape = SHAPE) -> torch.Tensor:
    """``y0 + sum_m scale * (x @ A^T) @ B^T`` per token in float64, from the full weights rounded to ``dtype``."""
    out, x = y0.double().cpu(), x.double().cpu()
    col = 0
    for module in modules:
        width = shape.dims(module)[1]
        for t, s in enumerate(token_slots):
            adapter = adapters[s] if s >= 0 else None
            if adapter is None or (LAYER, module) not in adapter.weights:
                continue
            a, b = (w.to(dtype).double() for w in adapter.weights[(LAYER, module)])
            scale = next(m.scaling for m in adapter.spec.modules if (m.layer, m.module) == (LAYER, module))
            out[t, col : col + width] += scale * (x[t] @ a.T) @ b.T
        col += width
    return out.float()


# -- batches: adapter mixes and the two ways of describing them ---------------------------------------
def mix_slots(mix: str, tokens: int, num_slots: int, seed: int) -> list[int]:
    """Slot of each token: identical (one adapter), distinct (one each), uniform (with -1), zipf (alpha 1.5)."""
    rng = np.random.default_rng(seed)
    if mix == "identical":
        return [num_slots - 1] * tokens
    if mix == "distinct":
        return list(rng.permutation(tokens))
    if mix == "uniform":
        return rng.integers(-1, num_slots, tokens).tolist()
    return (np.minimum(rng.zipf(1.5, tokens), num_slots) - 1).tolist()


def fill_batch(batch: BatchMeta, mode: str, token_slots: list[int]) -> list[int]:
    """``set_tokens`` (bgmv) as given, or ``set_segments`` (sgmv) after grouping tokens by slot.

    Returns the token order the batch describes."""
    if mode == "bgmv":
        batch.set_tokens(token_slots)
        return token_slots
    grouped = sorted(token_slots)
    starts = [0, *(i for i in range(1, len(grouped)) if grouped[i] != grouped[i - 1])]
    lens = np.diff([*starts, len(grouped)]).tolist()
    batch.set_segments(lens, [grouped[i] for i in starts])
    return grouped


def ranks_for(slot: int, ranks: str, modules: Sequence[str] = MODULE_ORDER) -> dict[str, int]:
    """Per-module ranks of slot ``slot``: one rank for all, or mixed (per slot and module, some modules absent)."""
    if ranks != "mixed":
        return dict.fromkeys(modules, int(ranks))
    out = {m: MIXED_RANKS[(slot + MODULE_ORDER.index(m)) % len(MIXED_RANKS)] for m in modules}
    if slot % 5 == 3 and len(out) > 1:
        del out[modules[-1]]  # an adapter without this module: rank 0 in its SlotMeta row
    return out


def run_case(device: str, dtype: torch.dtype, mode: str, tokens: int, mix: str, ranks: str = "mixed",
             modules: Sequence[str] = QKV, seed: int = 0, chunk: int | None = None, setter: str | None = None) -> None:
    """Kernel and reference against the oracle; tokens without an adapter stay bit-identical.

    ``chunk``: BatchMeta's decode tile size (default: by batch size); ``setter``: fill the batch the
    way the other kernel's engine would ("sgmv": segments, "bgmv": per token; default: ``mode``'s)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = tokens if mix == "distinct" else 8
    adapters = [make_adapter(f"a{s}", ranks_for(s, ranks, modules), SHAPE, gen) for s in range(num_slots)]
    pool = make_pool(adapters, SHAPE, 1, 0, dtype, device)
    batch = BatchMeta(256, 256, torch.device(device), num_slots=num_slots, chunk_tokens=chunk)
    order = fill_batch(batch, setter or mode, mix_slots(mix, tokens, num_slots, seed))
    d_in, width = SHAPE.dims(modules[0])[0], sum(SHAPE.dims(m)[1] for m in modules)
    x = torch.randn(tokens, d_in, generator=gen).to(dtype).to(device)
    y0 = torch.randn(tokens, width, generator=gen).to(dtype).to(device)
    want = oracle(y0, x, adapters, order, modules, dtype)
    for apply in APPLIES:
        y = y0.clone()
        apply(x, y, pool.pool, pool.meta, batch, LAYER, modules, mode)
        assert_close(y, want, dtype, f"{apply.__name__} {mode} {mix} T={tokens}")
        untouched = torch.tensor([s < 0 for s in order], device=device)
        assert torch.equal(y[untouched], y0[untouched]), "tokens without an adapter must be left as they are"


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = (got.float().cpu() - want).abs()
    bound = TOL[dtype] * want.abs().clamp(min=1.0)
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{what}: |error| {err.flatten()[worst]:.3g} above {bound.flatten()[worst]:.3g}"
                                        f" at flat index {worst} (max error {err.max():.3g})")


# -- the matrix: batch sizes x adapter mixes x kernels, then dtypes and ranks -----------------------------
@pytest.mark.parametrize("mix", ["identical", "distinct", "uniform", "zipf"])
@pytest.mark.parametrize("tokens", [1, 3, 7, 133])
@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
@pytest.mark.parametrize(("device", "dtype"), dev_dtypes([torch.float32], [torch.float32, torch.bfloat16]))
def test_mixes_match_oracle(device: str, dtype: torch.dtype, mode: str, tokens: int, mix: str) -> None:
    run_case(device, dtype, mode, tokens, mix)


@pytest.mark.parametrize("tokens", [7, 133])
@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
@pytest.mark.parametrize(("device", "dtype"), dev_dtypes([torch.float16], [torch.float16, torch.bfloat16]))
def test_half_dtypes_match_oracle(device: str, dtype: torch.dtype, mode: str, tokens: int) -> None:
    run_case(device, dtype, mode, tokens, "zipf", seed=1)


@pytest.mark.parametrize("ranks", ["8", "16", "32", "64", "128", "mixed"])
@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
@pytest.mark.parametrize(("device", "dtype"), dev_dtypes([torch.float32], [torch.bfloat16]))
def test_ranks_match_oracle(device: str, dtype: torch.dtype, mode: str, ranks: str) -> None:
    run_case(device, dtype, mode, 7, "uniform", ranks=ranks, seed=2)


@pytest.mark.parametrize("modules", [("o_proj",), ("gate_proj", "up_proj"), ("down_proj",), ("v_proj", "q_proj")])
@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_every_module_group(device: str, mode: str, modules: tuple[str, ...]) -> None:
    run_case(device, torch.float32, mode, 9, "uniform", modules=modules, seed=3)


# -- grouped decode: a slot's run of tokens spans several tiles, partial tiles, unadapted tokens between --
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("mix", ["identical", "uniform", "zipf"])
@pytest.mark.parametrize(("device", "dtype"), dev_dtypes([torch.float32], [torch.float32, torch.bfloat16]))
def test_decode_tiles_match_oracle(device: str, dtype: torch.dtype, mix: str, chunk: int) -> None:
    run_case(device, dtype, "bgmv", 75, mix, chunk=chunk, seed=9)


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_decode_k_splits_match_oracle(device: str, reduce: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """K split into 4 (forced on the CPU): the shrink's last split sums them, or each expand program does."""
    from workers.kernels import tuning

    monkeypatch.setattr(tuning, "_sms", lambda device: 100)  # the interpreter has no SMs: no splits otherwise
    with tuned("bgmv", block_k=16, reduce=reduce):
        run_case(device, torch.float32, "bgmv", 75, "uniform", chunk=16, seed=13)
        run_case(device, torch.float32, "bgmv", 20, "identical", seed=14)


@pytest.mark.parametrize(("device", "dtype"), dev_dtypes([torch.float32], [torch.bfloat16]))
def test_either_kernel_reads_either_setter(device: str, dtype: torch.dtype) -> None:
    run_case(device, dtype, "bgmv", 40, "zipf", setter="sgmv", seed=10)  # segments, then grouped decode tiles
    run_case(device, dtype, "sgmv", 40, "zipf", setter="bgmv", seed=10)


@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_repeated_and_unaligned_calls_match_oracle(device: str, mode: str) -> None:
    """Later calls of a plan launch the compiled kernel directly (GPU); unaligned views go through Triton."""
    gen = torch.Generator().manual_seed(12)
    adapters = [make_adapter(f"a{s}", ranks_for(s, "mixed"), SHAPE, gen) for s in range(4)]
    pool = make_pool(adapters, SHAPE, 1, 0, torch.float32, device)
    batch = BatchMeta(32, 32, torch.device(device), num_slots=4)
    order = fill_batch(batch, mode, mix_slots("uniform", 21, 4, 12))
    store = torch.randn(21 * 64 + 1, generator=gen).to(device)
    aligned, unaligned = store[:-1].view(21, 64), store[1:].view(21, 64)  # the second starts 4 bytes in
    y0 = torch.randn(21, 128, generator=gen).to(device)
    for x in (aligned, unaligned, aligned, unaligned, aligned):
        y = y0.clone()
        lora_apply(x, y, pool.pool, pool.meta, batch, LAYER, QKV, mode)
        want = oracle(y0, x, adapters, order, QKV, torch.float32)
        assert_close(y, want, torch.float32, f"{mode} at pointer offset {x.data_ptr() % 16}")


# -- tensor parallelism: two ranks' shards combine to the TP 1 result ------------------------------------
@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_tp2_shards_combine_to_tp1(device: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(4)
    adapters = [make_adapter(f"a{s}", ranks_for(s, "mixed"), SHAPE, gen) for s in range(4)]
    token_slots = [0, 0, 1, 3, -1, 2, 2, 1, 0]
    pools = [make_pool(adapters, SHAPE, tp, k, torch.float32, device) for tp, k in ((1, 0), (2, 0), (2, 1))]
    batch = BatchMeta(16, 16, torch.device(device))
    order = fill_batch(batch, mode, token_slots)
    for modules in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):  # column-parallel: concatenate
        x = torch.randn(len(order), SHAPE.hidden_size, generator=gen).to(device)
        full, parts = _apply(pools[0], x, batch, modules, mode), [_apply(p, x, batch, modules, mode) for p in pools[1:]]
        torch.testing.assert_close(_concat_columns(parts, modules), full, atol=1e-4, rtol=1e-4)
    for module in ("o_proj", "down_proj"):  # row-parallel: each rank's input slice, partial sums added
        d_in = SHAPE.dims(module)[0]
        x = torch.randn(len(order), d_in, generator=gen).to(device)
        full = _apply(pools[0], x, batch, (module,), mode)
        halves = [_apply(p, x[:, k * d_in // 2 : (k + 1) * d_in // 2].contiguous(), batch, (module,), mode)
                  for k, p in enumerate(pools[1:])]
        torch.testing.assert_close(halves[0] + halves[1], full, atol=1e-4, rtol=1e-4)


def _apply(pool: Pool, x: torch.Tensor, batch: BatchMeta, modules: Sequence[str], mode: str) -> torch.Tensor:
    width = sum(pool.meta.dims[m][1] for m in modules)
    y = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
    lora_apply(x, y, pool.pool, pool.meta, batch, LAYER, modules, mode)
    return y


def _concat_columns(parts: list[torch.Tensor], modules: Sequence[str]) -> torch.Tensor:
    """Column-parallel outputs of the ranks, module by module, side by side as TP 1 lays them out."""
    out, col = [], 0
    for m in modules:
        width = SHAPE.dims(m)[1] // len(parts)
        out += [p[:, col : col + width] for p in parts]
        col += width
    return torch.cat(out, dim=1)


# -- metadata: layout, in-place refills, the worker cache's rows -------------------------------------------
def test_batch_meta_segments_and_tokens() -> None:
    batch = BatchMeta(16, 4, torch.device("cpu"), num_slots=8)
    batch.set_segments([3, 0, 2], [5, 1, -1])
    assert (batch.mode, batch.num_tokens, batch.num_segments) == ("sgmv", 5, 3)
    assert batch.token_slot[:5].tolist() == [5, 5, 5, -1, -1]
    assert batch.seg_start[:4].tolist() == [0, 3, 3, 5] and batch.seg_slot[:3].tolist() == [5, 1, -1]
    buffer = batch.token_slot.data_ptr()
    batch.set_tokens([2, -1, 7])
    assert (batch.mode, batch.num_tokens, batch.max_slot) == ("bgmv", 3, 7)
    assert batch.token_slot[:3].tolist() == [2, -1, 7] and batch.token_slot.data_ptr() == buffer  # in place


def test_batch_meta_groups_tokens_by_slot_into_tiles() -> None:
    batch = BatchMeta(64, 4, torch.device("cpu"), num_slots=8, chunk_tokens=16)
    slots = [3, -1, 1] + [5] * 35 + [1, -1, 3]
    batch.set_tokens(slots)
    tiles = batch.chunks[: batch.num_chunks].tolist()
    perm = batch.token_perm[: len(slots) - 2].tolist()
    assert [slots[t] for t in perm] == sorted(s for s in slots if s >= 0)  # grouped by slot, no unadapted token
    assert perm[:4] == [2, 38, 0, 40]  # token order kept within a slot
    assert tiles == [[0, 2, 1], [2, 2, 3], [4, 16, 5], [20, 16, 5], [36, 3, 5]]  # (first, tokens, slot)
    assert batch.num_chunks <= batch.chunk_grid(8) <= batch.max_chunks  # the launch bound covers every tile
    buffers = (batch.chunks.data_ptr(), batch.token_perm.data_ptr())
    batch.set_tokens([-1, 6, 6])  # a smaller batch: the tiles of the last one must not linger
    assert batch.chunks[:, 1].tolist() == [2] + [0] * (batch.max_chunks - 1)
    assert (batch.chunks.data_ptr(), batch.token_perm.data_ptr()) == buffers  # filled in place
    batch.set_tokens([-1, -1])  # nothing adapted: no tiles at all
    assert batch.num_chunks == 0 and not batch.chunks[:, 1].any()
    with pytest.raises(ValueError, match=r"chunk_tokens must be a power of two >= 16"):
        BatchMeta(8, 4, torch.device("cpu"), chunk_tokens=24)


def test_set_tokens_is_host_work_and_one_copy() -> None:
    """No host sync (CUDA-graph safe): set_tokens never reads a device tensor, its one torch op is the copy."""
    batch = BatchMeta(64, 8, torch.device("cpu"), num_slots=8)
    batch.set_tokens([0, 1])  # warm: the ring's numpy views exist

    class Record(torch.overrides.TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, bool]] = []

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.calls.append((getattr(func, "__name__", str(func)), bool(args) and args[0] is batch._dev))
            return func(*args, **(kwargs or {}))

    with Record() as record:
        batch.set_tokens([5, -1, 2, 5, 5, 7, 2])
    assert record.calls == [("copy_", True)], record.calls  # one copy into the device buffer, nothing read back


def test_launch_does_not_depend_on_the_mix(small: Any) -> None:
    """One launch plan per batch size: refilled metadata of any mix replays the same grid (CUDA graphs)."""
    pool, _, x, y = small
    batch = BatchMeta(8, 4, torch.device("cpu"), num_slots=4)
    for slots in ([0, 0, 0, 0, 0], [0, 1, 2, 3, -1], [-1, -1, -1, -1, -1], [3, 3, 1, 1, 3]):
        batch.set_tokens(slots)
        for apply in APPLIES:
            y_mix = y.clone()
            apply(x, y_mix, pool.pool, pool.meta, batch, LAYER, QKV)
            want = oracle(y, x, pool.adapters, slots, QKV, torch.float32)
            assert_close(y_mix, want, torch.float32, f"{apply.__name__} {slots}")
    assert len(pool.meta.plans) == 1  # the four mixes shared one plan: same grid, block sizes, arguments


def test_kernel_call_dispatches_once_then_launches_the_compiled_kernel() -> None:
    """Triton's dispatcher for the first aligned call (it compiles), its compiled kernel for later ones."""
    from workers.kernels.launch import KernelCall

    calls: list[tuple[Any, ...]] = []

    class Compiled:  # what kernel[grid](...) returns on a GPU
        run = None

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            return lambda *args: calls.append(("direct", grid, args[1:]))

    class Kernel:
        @staticmethod
        def fn(t: Any, n: Any, a: Any, B: Any) -> None: ...  # the parameters KernelCall orders the tail by

        def __getitem__(self, grid: Any) -> Callable[..., Compiled]:
            return lambda *args, **options: calls.append(("dispatch", grid, args[1:], options)) or Compiled()

    call = KernelCall(Kernel(), (2, 1, 1), 2, {"B": 16, "a": 5}, {"num_warps": 4})
    t = torch.zeros(8)
    for tensor, n in ((t, 3), (t, 4), (t[1:], 5), (t, 6)):  # t[1:] starts 4 bytes in: not 16-byte aligned
        call(tensor, n)
    assert calls == [("dispatch", (2, 1, 1), (3, 5, 16), {"num_warps": 4}), ("direct", (2, 1, 1), (4, 5, 16)),
                     ("dispatch", (2, 1, 1), (5, 5, 16), {"num_warps": 4}), ("direct", (2, 1, 1), (6, 5, 16))]
    with pytest.raises(TypeError, match=r"do not match its parameters"):
        KernelCall(Kernel(), (1, 1, 1), 2, {"a": 5}, {})


def test_cached_plans_still_refuse_bad_calls(small: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full check runs once per signature; what changes between calls is still checked on every call."""
    from workers.kernels import args

    pool, batch, x, y = small
    checks, check_launch = [], args.check_launch

    def counted(*call: Any) -> args.Launch:
        checks.append(call[5])  # the layer
        return check_launch(*call)

    monkeypatch.setattr(args, "check_launch", counted)
    for layer in (0, 1, 1, 0):
        lora_apply(x, y, pool.pool, pool.meta, batch, layer, QKV)
    assert checks == [0], "one full check for four calls of one signature"
    monkeypatch.undo()
    with pytest.raises(IndexError, match=r"layer 2 is out of range"):
        lora_apply(x, y, pool.pool, pool.meta, batch, 2, QKV)
    batch.set_tokens([0, 1, 9, 3, -1])  # the same sizes, a slot out of range for the pool
    with pytest.raises(IndexError, match=r"slot 9, out of range for 4 slots"):
        lora_apply(x, y, pool.pool, pool.meta, batch, LAYER, QKV)
    batch.set_tokens([0, 1, 2, 3, -1])
    with pytest.raises(TypeError, match=r"share one dtype"):  # another signature: checked in full
        lora_apply(x.half(), y, pool.pool, pool.meta, batch, LAYER, QKV)
    qkv_only = make_adapter("qkv", dict.fromkeys(QKV, 16), SHAPE, torch.Generator().manual_seed(11))
    for slot in range(4):
        pool.meta.clear(slot)
    pool.meta.write(0, shard_layout(qkv_only.spec, SHAPE, 1, 0, torch.float32), qkv_only.spec)
    short_pool = pool.pool[:, : pool.meta.max_numel]  # enough for what is written now
    lora_apply(x, y, short_pool, pool.meta, batch, LAYER, QKV)
    full = pool.adapters[1]  # all seven modules: a larger shard, so plans validated for short_pool are dropped
    pool.meta.write(1, shard_layout(full.spec, SHAPE, 1, 0, torch.float32), full.spec)
    with pytest.raises(ValueError, match=r"a written shard needs"):
        lora_apply(x, y, short_pool, pool.meta, batch, LAYER, QKV)



def test_slot_meta_rows_follow_layouts() -> None:
    gen = torch.Generator().manual_seed(5)
    adapters = [make_adapter(f"a{s}", ranks_for(s, "mixed"), SHAPE, gen) for s in range(4)]
    pool = make_pool(adapters, SHAPE, 2, 1, torch.bfloat16, "cpu")
    for slot, adapter in enumerate(adapters):
        layout = shard_layout(adapter.spec, SHAPE, 2, 1, torch.bfloat16)
        for layer in range(SHAPE.num_layers):
            for module in MODULE_ORDER:
                i = (slot, layer, pool.meta.module_index(module))
                m = next((m for m in adapter.spec.modules if (m.layer, m.module) == (layer, module)), None)
                if m is None:
                    assert pool.meta.rank[i] == 0
                    continue
                assert int(pool.meta.rank[i]) == m.rank
                assert float(pool.meta.scale[i]) == torch.tensor(m.scaling, dtype=torch.float32).item()
                assert pool.meta.a_off[i] == layout.entry(layer, module, "A").offset
                assert pool.meta.b_off[i] == layout.entry(layer, module, "B").offset
    pool.meta.clear(2)
    assert not pool.meta.rank[2].any() and pool.meta.rank[1].any()


def test_worker_cache_writes_slot_meta_with_each_load(tmp_path: Path, tiny_adapters: Any,
                                                      make_catalog: Any, make_cache: Any) -> None:
    catalog = make_catalog(tiny_adapters(count=3, rank="8,16")[0].parent)
    cache = make_cache(catalog, num_slots=2, tp=2, tp_rank=1)
    names = catalog.names()
    for name in [*names, names[0]]:  # the third load reuses a slot: its row is overwritten
        slot = cache.prefetch(name).result(timeout=30).slot
        layout, spec = cache.layout_of(name), catalog.get(name)
        base = cache.book.table.slots[slot].first_page * cache.page_numel  # the pool's offsets: from its pages' start
        assert torch.equal(cache.shard(slot), cache.pool[slot, base : base + layout.numel])
        for m in spec.modules:
            i = (slot, m.layer, cache.meta.module_index(m.module))
            assert int(cache.meta.rank[i]) == m.rank
            assert float(cache.meta.scale[i]) == torch.tensor(m.scaling, dtype=torch.float32).item()
            assert cache.meta.a_off[i] == base + layout.entry(m.layer, m.module, "A").offset
            assert cache.meta.b_off[i] == base + layout.entry(m.layer, m.module, "B").offset
    assert cache.meta.dims == shard_dims(SHAPES["tiny"], 2)
    cache.check_integrity()


# -- bad input: a clear error naming the thing, never a crash or garbage --------------------------------
@pytest.fixture
def small() -> tuple[Pool, BatchMeta, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(6)
    pool = make_pool([make_adapter(f"a{s}", ranks_for(s, "16"), SHAPE, gen) for s in range(4)], SHAPE, 1, 0,
                     torch.float32, "cpu")
    batch = BatchMeta(8, 4, torch.device("cpu"))
    batch.set_tokens([0, 1, 2, 3, -1])
    return pool, batch, torch.randn(5, 64), torch.zeros(5, 128)


BAD_CALLS: dict[str, tuple[Any, type[Exception], str]] = {
    "x dtype": (lambda p, b, x, y: (x.half(), y, p.pool), TypeError, r"share one dtype"),
    "int dtype": (lambda p, b, x, y: (x.long(), y, p.pool), TypeError, r"x has dtype torch.int64"),
    "x columns": (lambda p, b, x, y: (x[:, :48], y, p.pool), ValueError, r"x has 48 columns.*64 input features"),
    "y columns": (lambda p, b, x, y: (x, y[:, :100], p.pool), ValueError, r"y has 100 columns.*= 128"),
    "x rows": (lambda p, b, x, y: (x[:4], y[:4], p.pool), ValueError, r"x has 4 rows.*5 tokens"),
    "x 1-D": (lambda p, b, x, y: (x[0], y, p.pool), ValueError, r"x must be 2-D"),
    "x non-contiguous": (lambda p, b, x, y: (torch.randn(64, 5).t(), y, p.pool), ValueError, r"x has column stride"),
    "pool slots": (lambda p, b, x, y: (x, y, p.pool[:3]), ValueError, r"pool has 3 slots but SlotMeta describes 4"),
    "pool too small": (lambda p, b, x, y: (x, y, p.pool[:, :100]), ValueError, r"a written shard needs"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_tensors_are_refused(small: Any, case: str) -> None:
    pool, batch, x, y = small
    make, error, match = BAD_CALLS[case]
    args = make(pool, batch, x, y)
    for apply in APPLIES:
        with pytest.raises(error, match=match):
            apply(*args, pool.meta, batch, LAYER, QKV)


def test_bad_arguments_are_refused(small: Any) -> None:
    pool, batch, x, y = small
    call = (x, y, pool.pool, pool.meta)
    with pytest.raises(IndexError, match=r"layer 2 is out of range"):
        lora_apply(*call, batch, 2, QKV)
    with pytest.raises(KeyError, match=r"module 'qq_proj'"):
        lora_apply(*call, batch, LAYER, ("qq_proj", "k_proj", "v_proj"))
    with pytest.raises(ValueError, match=r"different input sizes"):
        lora_apply(x, torch.zeros(5, 128), pool.pool, pool.meta, batch, LAYER, ("q_proj", "down_proj"))
    with pytest.raises(ValueError, match=r"1..4 module names"):
        lora_apply(*call, batch, LAYER, "q_proj")
    for apply in APPLIES:
        with pytest.raises(ValueError, match=r"mode must be"):
            apply(*call, batch, LAYER, QKV, mode="fast")
    with pytest.raises(ValueError, match=r"BatchMeta is empty"):
        lora_apply(*call, BatchMeta(8, 4, torch.device("cpu")), LAYER, QKV)
    batch.set_tokens([0, 1, 9, 3, -1])  # slot 9 of a 4-slot pool
    with pytest.raises(IndexError, match=r"slot 9, out of range for 4 slots"):
        lora_apply(*call, batch, LAYER, QKV)


def test_bad_batches_are_refused() -> None:
    batch = BatchMeta(4, 2, torch.device("cpu"), num_slots=4)
    with pytest.raises(ValueError, match=r"5 tokens; .*max_tokens"):
        batch.set_tokens([0] * 5)
    with pytest.raises(ValueError, match=r"3 segments given; .*max_segments"):
        batch.set_segments([1, 1, 1], [0, 1, 2])
    with pytest.raises(IndexError, match=r"slot index 4 is out of range"):
        batch.set_tokens([0, 4])
    with pytest.raises(IndexError, match=r"slot index -2 is invalid"):
        batch.set_segments([1, 1], [0, -2])
    with pytest.raises(ValueError, match=r"seg_lens has 2 entries but seg_slots has 1"):
        batch.set_segments([1, 1], [0])
    with pytest.raises(ValueError, match=r"seg_lens must be >= 0"):
        batch.set_segments([2, -1], [0, 1])
    with pytest.raises(ValueError, match=r"token_slots must be a flat sequence of integers"):
        batch.set_tokens([0.5, 1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"batch has 0 tokens"):
        batch.set_segments([0], [1])
    assert batch.mode is None  # nothing was published by the refused calls


def test_bad_slot_meta_writes_are_refused() -> None:
    gen = torch.Generator().manual_seed(7)
    adapter = make_adapter("big", dict.fromkeys(QKV, 64), SHAPE, gen)
    layout = shard_layout(adapter.spec, SHAPE, 1, 0, torch.float32)
    meta = SlotMeta(2, SHAPE.num_layers, MODULE_ORDER, torch.device("cpu"), max_rank=32)
    with pytest.raises(ValueError, match=r"rank 64; the kernels are set up for ranks 1..32"):
        meta.write(0, layout, adapter.spec)
    with pytest.raises(IndexError, match=r"slot 2 is out of range"):
        meta.write(2, layout, adapter.spec)
    meta = SlotMeta(2, SHAPE.num_layers, MODULE_ORDER, torch.device("cpu"), dims=shard_dims(SHAPE, 2))
    with pytest.raises(ValueError, match=r"q_proj shard is \(in, out\) = \(64, 64\), but this SlotMeta serves"):
        meta.write(0, layout, adapter.spec)
    other = make_adapter("other", {"q_proj": 8}, SHAPE, gen)
    with pytest.raises(ValueError, match=r"the spec is for other@v-other"):
        meta.write(0, layout, other.spec)
    assert not meta.rank.any()  # refused writes leave the rows as they were


def test_cpu_tensors_without_interpreter_use_the_reference(small: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, batch, x, y = small
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # lora_apply decides per call
    want = y.clone()
    lora_apply_ref(x, want, pool.pool, pool.meta, batch, LAYER, QKV)
    lora_apply(x, y, pool.pool, pool.meta, batch, LAYER, QKV)
    assert torch.equal(y, want) and not torch.equal(y, torch.zeros_like(y))


# -- CUDA graphs and host syncs --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("mode", "block_k"), [("sgmv", None), ("bgmv", None), ("bgmv", 16)])
def test_cuda_graph_replay_equals_eager_with_refilled_metadata(mode: str, block_k: int | None) -> None:
    """block_k 16: the K splits (4) are summed by the shrink's last split, its counters reset for every replay."""
    with tuned("bgmv", **({} if block_k is None else {"block_k": block_k})):
        _graph_replay_case(mode)


def _graph_replay_case(mode: str) -> None:
    gen = torch.Generator().manual_seed(8)
    tokens, num_slots = 48, 6
    adapters = [make_adapter(f"a{s}", ranks_for(s, "mixed"), SHAPE, gen) for s in range(num_slots)]
    pool = make_pool(adapters, SHAPE, 1, 0, torch.bfloat16, "cuda")
    batch = BatchMeta(tokens, tokens, torch.device("cuda"), num_slots=num_slots)
    x = torch.randn(tokens, 64, generator=gen).to("cuda", torch.bfloat16)
    y0 = torch.randn(tokens, 128, generator=gen).to("cuda", torch.bfloat16)
    y = y0.clone()
    mixes = [mix_slots(mix, tokens, num_slots, seed) for seed, mix in enumerate(["uniform", "zipf", "identical"])]
    fill_batch(batch, mode, mixes[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        lora_apply(x, y, pool.pool, pool.meta, batch, LAYER, QKV, mode)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(x, y, pool.pool, pool.meta, batch, LAYER, QKV, mode)
    for slots in mixes:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # refilling the metadata and replaying never syncs the host
        try:
            order = fill_batch(batch, mode, slots)
            y.copy_(y0)
            graph.replay()
            eager = y0.clone()
            lora_apply(x, eager, pool.pool, pool.meta, batch, LAYER, QKV, mode)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(y, eager), "graph replay differs from eager"
        assert_close(y, oracle(y0, x, adapters, order, QKV, torch.bfloat16), torch.bfloat16, f"graph {mode}")


# -- PEFT: the kernels reproduce a real PEFT model's LoRA delta, at TP 1 and TP 2 ------------------------
@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    """Two adapters saved by PEFT's save_pretrained on a tiny Llama, and PEFT's own deltas for fixed inputs.

    Returns (root, {adapter: {"x": {in features: input}, "delta": {(layer, module): output delta}}})."""
    import peft
    import transformers

    tiny = SHAPES["tiny"]
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers,
                                      intermediate_size=tiny.intermediate_size, num_attention_heads=tiny.num_heads,
                                      num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.head_dim)
    root, seen = tmp_path_factory.mktemp("peft"), {}
    lora = {"peft-a": dict(r=8, lora_alpha=16, rank_pattern={"q_proj": 16, "down_proj": 4}),
            "peft-b": dict(r=12, lora_alpha=8, use_rslora=True, alpha_pattern={"v_proj": 32})}
    for seed, (name, kw) in enumerate(lora.items()):
        torch.manual_seed(seed)
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                    peft.LoraConfig(target_modules=list(MODULE_ORDER), lora_dropout=0.0, **kw))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:  # PEFT starts B at zero: a delta of zero would prove nothing
                    p.normal_(0.0, 0.2)
        model.save_pretrained(str(root / name))
        seen[name] = _peft_deltas(model, tiny, seed)
    return root, seen


def _peft_deltas(model: Any, shape: ModelShape, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 + seed)
    xs = {d_in: torch.randn(8, d_in, generator=gen) for d_in in sorted({shape.dims(m)[0] for m in MODULE_ORDER})}
    deltas = {}
    with torch.no_grad():
        for layer, block in enumerate(model.base_model.model.model.layers):
            for m in MODULE_ORDER:
                lin = getattr(block.self_attn if m in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, m)
                x = xs[shape.dims(m)[0]]  # one input per size: fused modules read the same x
                deltas[(layer, m)] = lin(x) - lin.base_layer(x)
    return {"x": xs, "delta": deltas}


@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_peft_equivalence(peft_adapters: Any, device: str, tp: int, mode: str) -> None:
    root, seen = peft_adapters
    saved = json.loads((root / "peft-a" / "adapter_config.json").read_text())
    assert saved["rank_pattern"] == {"q_proj": 16, "down_proj": 4}  # what PEFT wrote is what we read
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=16))
    catalog.register_dir(root)
    host = HostTierConfig(host_bytes=8 << 20, read_threads=1, pin=device == "cuda")
    caches = [WorkerCache(WorkerConfig(num_slots=2, tp=tp, tp_rank=k, dtype="float32", device=device, host=host),
                          catalog) for k in range(tp)]
    try:
        slots = {name: [c.prefetch(name).result(timeout=60).slot for c in caches] for name in seen}
        token_adapters = ["peft-a", "peft-a", None, "peft-b", "peft-b", "peft-a"]
        for layer in range(SHAPES["tiny"].num_layers):
            for group in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
                got = _tp_delta(caches, slots, token_adapters, seen, layer, group, mode, device)
                want = _peft_rows(seen, token_adapters, layer, group)
                err = (got - want).abs().max()
                assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"layer {layer} {group} TP {tp}: {err:.3g}"
    finally:
        for c in caches:
            c.close()


def _token_inputs(seen: dict[str, Any], token_adapters: list[str | None], d_in: int) -> torch.Tensor:
    """Token i's input is row i of its adapter's fixed input (any row for tokens without an adapter)."""
    return torch.stack([seen[a or "peft-a"]["x"][d_in][i] for i, a in enumerate(token_adapters)])


def _peft_rows(seen: dict[str, Any], token_adapters: list[str | None], layer: int,
               group: Sequence[str]) -> torch.Tensor:
    cols = []
    for m in group:
        width = SHAPES["tiny"].dims(m)[1]
        cols.append(torch.stack([seen[a]["delta"][(layer, m)][i] if a else torch.zeros(width)
                                 for i, a in enumerate(token_adapters)]))
    return torch.cat(cols, dim=1)


def _tp_delta(caches: list[WorkerCache], slots: dict[str, list[int]], token_adapters: list[str | None],
              seen: dict[str, Any], layer: int, group: Sequence[str], mode: str, device: str) -> torch.Tensor:
    """Each rank's lora_apply on its shard, combined as an engine would: concatenated or summed."""
    x = _token_inputs(seen, token_adapters, SHAPES["tiny"].dims(group[0])[0]).to(device)
    row_parallel = group[0] in ("o_proj", "down_proj")
    outs = []
    for k, cache in enumerate(caches):
        batch = BatchMeta(16, 16, torch.device(device), num_slots=cache.config.num_slots)
        token_slots = [slots[a][k] if a else -1 for a in token_adapters]
        if mode == "sgmv":  # segments = runs of one slot, in token order
            starts = [i for i in range(len(token_slots)) if i == 0 or token_slots[i] != token_slots[i - 1]]
            batch.set_segments(np.diff([*starts, len(token_slots)]).tolist(), [token_slots[i] for i in starts])
        else:
            batch.set_tokens(token_slots)
        part = x.chunk(len(caches), dim=1)[k].contiguous() if row_parallel else x
        y = torch.zeros(len(token_adapters), sum(cache.meta.dims[m][1] for m in group), device=device)
        lora_apply(part, y, cache.pool, cache.meta, batch, layer, group, mode)
        outs.append(y.cpu())
    if row_parallel:
        return torch.stack(outs).sum(0)
    widths = [SHAPES["tiny"].dims(m)[1] // len(caches) for m in group]
    return torch.cat([o.split(widths, dim=1)[i] for i in range(len(group)) for o in outs], dim=1)


def test_dataclass_knobs_are_frozen() -> None:
    from workers.kernels.tuning import KNOBS

    with pytest.raises(dataclasses.FrozenInstanceError):
        KNOBS["bgmv"].block_k = 1  # type: ignore[misc]
    default = KNOBS["bgmv"].block_k  # type: ignore[union-attr]
    with tuned("bgmv", block_k=default // 2):
        assert KNOBS["bgmv"].block_k == default // 2  # type: ignore[union-attr]
    assert KNOBS["bgmv"].block_k == default  # type: ignore[union-attr]
