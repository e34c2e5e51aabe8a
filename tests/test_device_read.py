"""A rank's shard read from a safetensors image in device memory (``workers.reads.device``) by one gather launch
(``workers.kernels.gather``): the same bytes in the same places as the file read, every TP rank, conversions
included; a NaN named; bad plans and buffers refused before anything is copied.

On a CPU-only machine the gather kernel runs in Triton's interpreter (built here as in ``test_kernels``); the
``gpu`` variants run it compiled, on a side stream after an event, as a rank does."""

from __future__ import annotations

import torch

from tests.interpreted import build_for_interpreter

HAS_CUDA = torch.cuda.is_available()


if not HAS_CUDA:
    build_for_interpreter(["workers.kernels.gather"], ["workers.reads.device"])

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import workers.kernels.gather as gather_module  # noqa: E402
import workers.reads.device as device_module  # noqa: E402
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import AdapterSpec  # noqa: E402
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES, ModelShape  # noqa: E402
from lora_cache.adapters.shards import shard_layout  # noqa: E402
from lora_cache.adapters.synth import write_adapter  # noqa: E402
from lora_cache.errors import AdapterFormatError, NonFiniteWeightsError  # noqa: E402
from workers.kernels.gather import GatherError, gather_plan, gather_reference  # noqa: E402
from workers.reads.shard import read_slices  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
INTERPRETED = pytest.mark.skipif(HAS_CUDA, reason="CPU variant: the Triton interpreter runs on CPU-only machines")
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=ON_GPU)]
SMALL = SHAPES["tiny"]  # 2 layers, hidden 64, intermediate 128: splits at TP 1, 2 and 4


@pytest.fixture(scope="module", autouse=True)
def interpret() -> Iterator[None]:
    """This module's gathers on CPU tensors run the kernel through the interpreter (unless a test says otherwise)."""
    with pytest.MonkeyPatch.context() as patch:
        if not HAS_CUDA:
            patch.setenv("TRITON_INTERPRET", "1")
        yield


def adapter(root: Path, shape: ModelShape, rank: int, dtype: torch.dtype, seed: int = 3) -> AdapterSpec:
    write_adapter(root / "a", shape, rank, 4.0, list(MODULE_ORDER), dtype, torch.Generator().manual_seed(seed))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=shape.name, max_rank=rank))
    return catalog.register("a", root / "a")


def image_of(spec: AdapterSpec, device: str) -> torch.Tensor:
    """The adapter's safetensors file as one uint8 buffer on ``device``: what a trainer's pushed buffer holds."""
    raw = bytearray(spec.weights.read_bytes())
    return torch.frombuffer(raw, dtype=torch.uint8).clone().to(device)


def file_read(spec: AdapterSpec, shape: ModelShape, tp: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    lay = shard_layout(spec, shape, tp, rank, dtype)
    dest = torch.full((lay.numel,), float("nan"), dtype=dtype)
    assert spec.source is not None
    read_slices(spec.source, lay.entries, dest, "", "sample")
    return dest


def index_of(image: torch.Tensor) -> dict[str, Any]:
    """Where each tensor is in ``image``, from its first bytes (the header, for these small adapters)."""
    return device_module.image_index(bytes(image[:64 << 10].cpu().numpy()), image.numel())


def plan_read(image: torch.Tensor, lay: Any) -> device_module.DeviceRead:
    return device_module.device_read(index_of(image), lay, image.numel())


def image_read(spec: AdapterSpec, shape: ModelShape, tp: int, rank: int, dtype: torch.dtype,
               image: torch.Tensor) -> tuple[torch.Tensor, device_module.DeviceRead, torch.Tensor]:
    lay = shard_layout(spec, shape, tp, rank, dtype)
    read = plan_read(image, lay)
    dest = torch.full((lay.numel + 5,), float("nan"), dtype=dtype, device=image.device)  # a slot larger than its shard
    if image.is_cuda:
        ready = torch.cuda.Event()
        ready.record()  # the trainer's event: the image is written
        side = torch.cuda.Stream(image.device)
        done, flag = device_module.read_image(read, image, dest, after=ready, stream=side)
        done.synchronize()
    else:
        _, flag = device_module.read_image(read, image, dest)
    return dest, read, flag


# -- the gather itself ---------------------------------------------------------------------------------------


def test_a_plan_merges_adjacent_segments_and_takes_the_widest_word() -> None:
    plan = gather_plan([(64, 0, 8), (72, 8, 16), (200, 24, 8)])
    assert plan.segments == ((64, 0, 24), (200, 24, 8)) and plan.word == 8
    assert (plan.src_end, plan.dst_end, plan.nbytes) == (208, 32, 32)
    assert gather_plan([(2, 0, 6)]).word == 2 and gather_plan([(1, 0, 8)]).word == 1
    assert gather_plan([(0, 0, 40)], chunk_bytes=16).rows(8) == [(0, 0, 2), (2, 2, 2), (4, 4, 1)]


def test_a_plan_that_writes_a_byte_twice_or_names_no_range_is_refused() -> None:
    with pytest.raises(GatherError, match=r"both write destination bytes 4\.\.7"):
        gather_plan([(0, 0, 8), (100, 4, 8)])
    for bad in ((-1, 0, 4), (0, -8, 4), (0, 0, 0)):
        with pytest.raises(GatherError, match=rf"segment \({bad[0]}, {bad[1]}, {bad[2]}\).*not a range"):
            gather_plan([bad])
    with pytest.raises(GatherError, match="chunk_bytes=12"):
        gather_plan([(0, 0, 8)], chunk_bytes=12)


def test_buffers_a_plan_does_not_fit_are_refused_before_anything_is_copied() -> None:
    plan = gather_plan([(0, 0, 64)])
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(GatherError, match="destination holds 32 bytes but its plan reaches byte 64"):
        gather_module.gather(dst, src, plan)
    with pytest.raises(GatherError, match=r"source is torch\.float32"):
        gather_module.gather(torch.zeros(64, dtype=torch.uint8), src.float(), plan)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[tuple[int, int, int]], int, int, int]:
    """Segments that write disjoint destination ranges (some adjacent, some with gaps), of any alignment."""
    align = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 12))
    segs, at = [], draw(st.integers(0, 3)) * align
    for _ in range(n):
        size = draw(st.integers(1, 300)) * align
        src = draw(st.integers(0, 600)) * align
        segs.append((src, at, size))
        at += size + draw(st.sampled_from([0, 0, align, 5 * align]))
    shift = draw(st.sampled_from([0, align, 8]))  # the buffers' own offsets within their allocations
    return segs, max(s + k for s, _, k in segs), at, shift


@pytest.mark.parametrize("device", DEVICES)
@settings(deadline=None, max_examples=40)  # the interpreter runs each program in Python
@given(case=layouts(), chunk=st.sampled_from([8, 64, 4096]))
def test_the_kernel_writes_what_its_twin_writes_and_nothing_else(device: str,
                                                                 case: Any, chunk: int) -> None:
    """Any plan, any word width the offsets and the buffers' addresses allow, rows cut at any chunk: the kernel's
    destination equals the twin's byte for byte, and bytes no segment names keep their value."""
    assert device == "cuda" or gather_module.interpreting()  # the kernel runs, not the twin
    segs, src_end, dst_end, shift = case
    plan = gather_plan(segs, chunk_bytes=chunk)
    gen = torch.Generator().manual_seed(len(segs) * 7 + shift)
    src = torch.randint(0, 256, (src_end + shift + 8,), dtype=torch.uint8, generator=gen).to(device)[shift:]
    base = torch.full((dst_end + shift + 8,), 0xA5, dtype=torch.uint8, device=device)
    got, want = base.clone()[shift:], base.clone()[shift:]
    gather_module.gather(got, src, plan)
    gather_reference(want, src, plan)
    assert torch.equal(got.cpu(), want.cpu())
    named = torch.zeros(want.numel(), dtype=torch.bool)
    for _, d, n in segs:
        named[d:d + n] = True
    assert bool((want.cpu()[~named] == 0xA5).all())


# -- a shard out of an image ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> AdapterSpec:
    return adapter(tmp_path_factory.mktemp("small"), SMALL, 8, BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_reads_from_the_image_what_it_reads_from_the_file(small: AdapterSpec,
                                                                     device: str, tp: int) -> None:
    """Column slices of row-parallel lora_A (a segment per row), row blocks of lora_B, whole matrices; into the
    slot's bf16 (one gather) and converted to fp32 (torch, entry by entry): the file read's bytes exactly, the
    slot's bytes past the shard untouched, and the shard proven finite."""
    image = image_of(small, device)
    for rank in range(tp):
        for dtype in (BF16, F32):
            want = file_read(small, SMALL, tp, rank, dtype)
            got, read, flag = image_read(small, SMALL, tp, rank, dtype, image)
            assert torch.equal(got[:want.numel()].cpu().view(torch.uint8), want.view(torch.uint8)), (tp, rank, dtype)
            assert bool(got[want.numel():].isnan().all())
            assert bool(flag)
            device_module.finite_or_raise(read, got, flag)
            assert (len(read.converts) == 0) == (dtype == BF16)


def test_the_8b_layouts_plan_every_slice_from_the_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Llama-3.1-8B layout at TP 2 (rank 2, 10 MB), read by the twin on the CPU: the file read's bytes; only
    row-parallel lora_A column slices are cut into rows, and the plan's bytes are the shard's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors outside the interpreter: the twin
    spec = adapter(tmp_path, SHAPES["llama-3.1-8b"], 2, BF16)
    image = image_of(spec, "cpu")
    for rank in range(2):
        want = file_read(spec, SHAPES["llama-3.1-8b"], 2, rank, BF16)
        got, read, _ = image_read(spec, SHAPES["llama-3.1-8b"], 2, rank, BF16, image)
        assert torch.equal(got[:want.numel()].view(torch.uint8), want.view(torch.uint8))
        assert read.gather.nbytes == want.numel() * 2
        strided_rows = sum(e.shape[0] for e in read.layout.entries
                           if e.ab == "A" and e.module in ("o_proj", "down_proj"))
        assert len(read.gather.segments) <= 32 * 7 * 2 + strided_rows


def test_a_nan_in_the_image_is_named_after_the_copy(tmp_path: Path) -> None:
    spec = adapter(tmp_path, SMALL, 8, BF16)
    image = image_of(spec, "cpu")
    lay = shard_layout(spec, SMALL, 2, 1, BF16)
    tensors = index_of(image)
    e = lay.entry(1, "down_proj", "A")  # a column slice: the NaN sits in rank 1's half of row 3
    t = tensors[e.key]
    at = t.start + (3 * t.shape[1] + e.cols.start + 5) * 2
    image[at:at + 2] = torch.tensor([float("nan")], dtype=BF16).view(torch.uint8)
    read = device_module.device_read(tensors, lay, image.numel())
    dest = torch.zeros(lay.numel, dtype=BF16)
    _, flag = device_module.read_image(read, image, dest)
    assert not bool(flag)
    with pytest.raises(NonFiniteWeightsError, match=r"base_model.*layers\.1\.mlp\.down_proj\.lora_A.*1 NaN.*\[3, 5\]"):
        device_module.finite_or_raise(read, dest, flag)


def test_an_image_that_does_not_hold_the_layout_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    spec = adapter(tmp_path, SMALL, 8, BF16)
    lay = shard_layout(spec, SMALL, 2, 0, BF16)
    partial = tmp_path / "partial.safetensors"
    save_file({"x": torch.zeros(4, 4)}, str(partial))
    raw = partial.read_bytes()
    with pytest.raises(AdapterFormatError, match=r"has no tensor 'base_model.*lora_A.*push every module"):
        device_module.device_read(device_module.image_index(raw, len(raw)), lay, len(raw))
    image = image_of(spec, "cpu")
    read = plan_read(image, lay)
    with pytest.raises(AdapterFormatError, match=f"not the {image.numel()} bytes"):
        device_module.read_image(read, image[:-8], torch.zeros(lay.numel, dtype=BF16))
    with pytest.raises(AdapterFormatError, match=r"give a 1-D torch\.bfloat16 buffer"):
        device_module.read_image(read, image, torch.zeros(lay.numel, dtype=F32))
    with pytest.raises(AdapterFormatError, match="header length"):
        device_module.image_index(bytes(image[:4].numpy()), image.numel())


# -- the trainer's side: its tensors as one image on their device ---------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
def test_a_trainers_image_is_the_file_and_every_rank_reads_its_shard_from_it(small: AdapterSpec, device: str) -> None:
    """The trainer's tensors laid out on their device (``device_image``) are the safetensors file's bytes (what a
    push writes), and a rank reads from that image what it reads from the file; a second push of the same shapes
    writes the same buffer in place (the ranks' handles stay open), a buffer of another size is refused."""
    from safetensors.torch import load_file

    from lora_cache.adapters.serialize import device_image, safetensors_bytes

    tensors = {k: v.to(device) for k, v in load_file(str(small.weights)).items()}
    image = device_image(tensors, {"format": "pt"})
    assert image.device.type == device
    assert bytes(image.cpu().numpy()) == bytes(safetensors_bytes(tensors, {"format": "pt"}))
    assert bytes(image.cpu().numpy()) == small.weights.read_bytes()  # safetensors' own file of these tensors
    for rank in range(2):
        want = file_read(small, SMALL, 2, rank, BF16)
        got, _, flag = image_read(small, SMALL, 2, rank, BF16, image)
        assert torch.equal(got[:want.numel()].cpu().view(torch.uint8), want.view(torch.uint8)) and bool(flag)
    stepped = {k: v * 2 for k, v in tensors.items()}  # the trainer's next step: same shapes, new values
    again = device_image(stepped, {"format": "pt"}, out=image)
    assert again.data_ptr() == image.data_ptr()
    assert bytes(again.cpu().numpy()) == bytes(safetensors_bytes(stepped, {"format": "pt"}))
    with pytest.raises(AdapterFormatError, match=r"image buffer given is torch\.uint8 \(\d+,\).*pass out=None"):
        device_image(stepped, {"format": "pt"}, out=image[:-8])
    with pytest.raises(AdapterFormatError, match="at least one tensor"):
        device_image({})
