"""Pushes from a trainer's memory on the CPU (issue 44 item 2): the check before anything is kept, the push area's
whole-or-nothing writes, tags, cap and retirement, a pushed directory's content version, and the gateway's
gathering of a ``PushAdapter`` stream (a stream cut short reaches nobody)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from lora_cache.adapters import peft
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.header import parse_header
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, content_version
from lora_cache.adapters.pushed import PushArea, check_push, check_tag, content_tag
from lora_cache.adapters.refs import base_name, split_ref, split_unchecked, version_of, versions_named
from lora_cache.adapters.shapes import resolve_model
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api import client_values as msg
from lora_cache.api.push_stream import gather
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.validate import RequestError, adapter_ref
from lora_cache.errors import AdapterFormatError, CapacityError, ConfigError, ConflictError, NotFoundError

TINY = resolve_model("tiny")


@pytest.fixture(scope="module")
def pushed_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A tiny rank-8 adapter's tensors and PEFT config, as a trainer holds them."""
    (directory,) = make_adapters(tmp_path_factory.mktemp("src"), SynthConfig(model="tiny", count=1, rank="8"))
    tensors = load((directory / WEIGHTS_FILE).read_bytes())
    return tensors, json.loads((directory / CONFIG_FILE).read_text())


def payload(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[bytes, bytes]:
    return msg.push_payload(tensors, config)


def test_a_good_push_passes_the_check_with_its_modules(pushed_pair: Any) -> None:
    tensors, config = pushed_pair
    spec = check_push("a", *payload(tensors, config), TINY, max_rank=16)
    assert len(spec.modules) * 2 == len(tensors) and spec.max_rank == 8


@pytest.mark.parametrize("spoil, fragment", [
    ("shape", "shape"),
    ("dtype", "dtype"),
    ("layer", "layer 999"),
    ("module", "fancy_proj"),
    ("rank", "rank"),
    ("not-safetensors", "safetensors"),
    ("config", "config"),
])
def test_a_bad_push_is_refused_naming_what_is_wrong(pushed_pair: Any, spoil: str, fragment: str) -> None:
    tensors, config = dict(pushed_pair[0]), dict(pushed_pair[1])
    key = next(k for k in sorted(tensors) if k.endswith("lora_A.weight"))
    max_rank = 16
    if spoil == "shape":
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1, dtype=tensors[key].dtype)
    elif spoil == "dtype":
        tensors[key] = tensors[key].to(torch.float32)
    elif spoil == "layer":
        tensors[key.replace("layers.0.", "layers.999.")] = tensors.pop(key)
    elif spoil == "module":
        key = next(k for k in sorted(tensors) if "down_proj" in k)
        tensors[key.replace("down_proj", "fancy_proj")] = tensors.pop(key)
    elif spoil == "rank":
        max_rank = 4
    config_bytes, weights = payload(tensors, config)
    if spoil == "not-safetensors":
        weights = b"\x10" + b"\0" * 7 + b"not json"
    if spoil == "config":
        config_bytes = b"{not json"
    with pytest.raises(AdapterFormatError) as e:
        check_push("a", config_bytes, weights, TINY, max_rank)
    assert fragment in str(e.value).lower(), str(e.value)


def test_tags_are_checked_and_a_content_tag_follows_the_bytes() -> None:
    assert check_tag(8) == "8" and check_tag("step-8") == "step-8"
    for bad in ("", "../x", "a b", -1, True, "x" * 65):
        with pytest.raises(ConfigError, match="tag"):
            check_tag(bad)
    assert content_tag(b"c", b"w1") == content_tag(b"c", b"w1") != content_tag(b"c", b"w2")


def test_the_area_writes_whole_refuses_a_reused_tag_and_retires(tmp_path: Path, pushed_pair: Any) -> None:
    area = PushArea(tmp_path, "svc", max_bytes=1 << 30)
    config_bytes, weights = payload(*pushed_pair)
    path, new = area.write("a", "1", config_bytes, weights)
    assert new and path == tmp_path / "svc" / "a" / "1"
    assert (path / WEIGHTS_FILE).read_bytes() == weights and (path / CONFIG_FILE).read_bytes() == config_bytes
    assert area.write("a", "1", config_bytes, weights) == (path, False)  # the same bytes again: the same version
    other = bytearray(weights)
    other[-1] ^= 1
    with pytest.raises(ConflictError, match="new tag"):
        area.write("a", "1", config_bytes, bytes(other))
    second, _ = area.write("a", "2", config_bytes, bytes(other))
    assert area.used() == 2 * len(weights)
    assert area.retire("a", {second}) == ["1"] and not path.exists() and second.is_dir()
    assert area.retire("a", set()) == ["2"] and not (tmp_path / "svc" / "a").exists()
    assert PushArea(tmp_path, "other", 1 << 30).used() == 0  # another service's area is its own


def test_a_push_hashed_from_memory_is_the_version_its_file_hashes_to_and_is_taken_only_while_it_is_that_file(
        tmp_path: Path, pushed_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pushed.digest`` (the push hashed from its bytes while they are written) gives what registration hashing the
    written file gives: the content version, the header's CRC, every block's CRC. Its ``known`` lets the file's
    registration skip reading the weights, and only while the file is the one written: a file changed after it
    is hashed again, under its new content's version."""
    from lora_cache.adapters.pushed import digest

    tensors, config = pushed_pair
    tensors = {k: v.repeat(40, 1) if "lora_A" in k else v.repeat(1, 40) for k, v in tensors.items()}  # > 1 block
    config = {**config, "r": 8 * 40}
    area = PushArea(tmp_path, "svc", max_bytes=1 << 30)
    config_bytes, weights = payload(tensors, config)
    content = digest(config_bytes, weights)
    assert f"c{content.version}" == content_tag(config_bytes, weights)
    path, _ = area.write("a", "1", config_bytes, weights)
    roots = peft.AdapterRoots((tmp_path,))
    hashed = peft.read_adapter("a", path, TINY, 1024, roots, sealed=True)
    assert hashed.source is not None and len(hashed.source.block_crcs) > 1
    assert (content.version, content.header_bytes, content.header_crc, content.block_crcs) == \
        (hashed.version, hashed.source.header_bytes, hashed.source.header_crc, hashed.source.block_crcs)
    known = content.known(path)

    def unread(*_: Any) -> Any:
        raise AssertionError("the weights were read back")

    with monkeypatch.context() as m:
        m.setattr(peft, "digest_weights", unread)
        taken = peft.read_adapter("a", path, TINY, 1024, roots, known, sealed=True)
    assert taken.version == hashed.version and not taken.source.racy  # type: ignore[union-attr]
    other = bytearray(weights)
    other[-1] ^= 1
    (path / WEIGHTS_FILE).write_bytes(bytes(other))  # not how the area writes: a file changed after the push
    changed = peft.read_adapter("a", path, TINY, 1024, roots, known, sealed=True)
    assert changed.version not in (known.version, "") and changed.version == digest(config_bytes, other).version


def test_a_write_cut_midway_leaves_nothing(tmp_path: Path, pushed_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    area = PushArea(tmp_path, "svc", max_bytes=1 << 30)

    def cut(*_: Any) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "rename", cut)
    with pytest.raises(OSError):
        area.write("a", "1", *payload(*pushed_pair))
    assert list((tmp_path / "svc" / "a").iterdir()) == []


def test_a_push_over_the_cap_is_refused_before_it_is_written(tmp_path: Path, pushed_pair: Any) -> None:
    config_bytes, weights = payload(*pushed_pair)
    area = PushArea(tmp_path, "svc", max_bytes=len(weights) + 10)
    area.write("a", "1", config_bytes, weights)
    with pytest.raises(CapacityError, match="push_bytes"):
        area.write("b", "1", config_bytes, weights)
    assert not (tmp_path / "svc" / "b" / "1").exists()


def test_a_pushed_directory_takes_a_content_version_even_where_files_take_identity(
        tmp_path: Path, pushed_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``local_versions='identity'`` a settled file's version comes from its stat; a pushed version's
    always from its bytes (another node's copy must prove the same version)."""
    monkeypatch.setattr(peft, "settled_at", lambda *_: True)  # every file settled: identity would apply
    (tmp_path / "roots").mkdir()
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path / "roots"),), model="tiny", max_rank=16,
                                           push_dir=str(tmp_path / "push")))
    area = PushArea(catalog.config.push_root(), "svc", 1 << 30)
    path, _ = area.write("a", "1", *payload(*pushed_pair))
    spec = catalog.register("a", str(path))
    assert spec.version == content_version(path)
    assert spec.source is not None and not spec.source.racy  # sealed: every rank takes it on its identity at once
    assert set(catalog.paths("a").values()) == {path.resolve()}
    shutil.copytree(path, tmp_path / "roots" / "b")  # the same files under an adapter root: an identity version
    assert catalog.register("b", str(tmp_path / "roots" / "b")).version != spec.version


def test_the_client_payload_takes_gpu_or_cpu_tensors_and_peft_configs(pushed_pair: Any) -> None:
    tensors, config = pushed_pair

    class LoraConfig:  # PEFT's config object: to_dict(), sets for target_modules
        def to_dict(self) -> dict[str, Any]:
            return {**config, "target_modules": set(config["target_modules"])}

    config_bytes, weights = msg.push_payload(tensors, LoraConfig())
    assert json.loads(config_bytes)["target_modules"] == sorted(config["target_modules"])
    assert load(bytes(weights)).keys() == tensors.keys()
    # one dtype (an adapter's): the bytes safetensors writes, so a pushed version's content hash is as it was
    assert bytes(weights) == save(tensors, metadata={"format": "pt"})
    assert msg.push_payload(save(tensors), config)[1] == save(tensors)
    with pytest.raises(msg.ClientError, match="dict"):
        msg.push_payload([], config)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8,
                                            torch.bool, torch.float8_e4m3fn]),
                          st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6))
def test_the_one_pass_payload_is_the_safetensors_of_its_tensors(specs: list[tuple[torch.dtype, list[int]]]) -> None:
    """``safetensors_bytes`` (the push's payload, one copy per tensor) is a safetensors file the format's own loader
    reads back to the same tensors, bit for bit, whatever the dtypes and shapes (empty and 0-d ones too), with the
    tensors ``safetensors.torch.save`` would list, and the same bytes each time (a pushed version's content hash);
    a dtype the format lacks is refused, naming the tensor."""
    from lora_cache.adapters.serialize import safetensors_bytes

    g = torch.Generator().manual_seed(len(specs))
    tensors = {f"t{i}.weight": (torch.randn(shape, generator=g) * 4).to(dtype)
               for i, (dtype, shape) in enumerate(specs)}
    tensors["strided.weight"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    out = safetensors_bytes(tensors, {"format": "pt"})
    back = load(bytes(out))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))
    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    saved = save(contiguous, metadata={"format": "pt"})  # the same header (the data may lie in another order)
    n, m = int.from_bytes(bytes(out[:8]), "little"), int.from_bytes(saved[:8], "little")
    assert parse_header(bytes(out[8:8 + n]), len(out)) == parse_header(saved[8:8 + m], len(saved))
    assert bytes(safetensors_bytes(tensors, {"format": "pt"})) == bytes(out)  # the same tensors, the same version
    with pytest.raises(AdapterFormatError, match=r"tensor bad\.weight has dtype torch\.complex64"):
        safetensors_bytes({"bad.weight": torch.zeros(2, dtype=torch.complex64)})


def _device_tensors(device: str) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes on ``device`` (one not contiguous, one empty, one 0-d)."""
    g = torch.Generator().manual_seed(7)
    tensors = {f"m{i:02d}.lora_A.weight": torch.randn(16, 40 + i, generator=g).to(torch.bfloat16) for i in range(12)}
    tensors |= {"n.bias": torch.randn(5, generator=g).to(torch.float16), "o.steps": torch.tensor(3),
                "p.empty": torch.zeros(0, 4), "q.mask": torch.tensor([True, False, True]),
                "r.strided": torch.arange(24, dtype=torch.float32).reshape(4, 6).t()}
    return {k: v.to(device) for k, v in tensors.items()}


def test_device_tensors_are_gathered_in_runs_of_one_device_back_to_back_within_the_limit() -> None:
    """``device_runs`` cuts the file's off-CPU tensors where the device changes, where a tensor elsewhere lies
    between two, and past the gather's limit (a tensor larger than it alone); ``copy_run`` puts a run's bytes where
    the header says (here on CPU tensors: the same code gathers a GPU's), or each tensor by itself where the gather
    finds no memory."""
    from lora_cache.adapters import serialize
    from lora_cache.adapters.serialize import copy_run, device_runs

    t = [torch.full((n,), i, dtype=torch.uint8) for i, n in enumerate([4, 4, 8, 20, 4, 4])]
    at = [0, 4, 8, 16, 36, 40, 44]
    placed = [(x, at[i], at[i + 1]) for i, x in enumerate(t)]
    runs = device_runs(placed[:2] + placed[3:], limit=16)  # placed[2] lies elsewhere (another device, the CPU)
    assert [[p[1] for p in run] for run in runs] == [[0, 4], [16], [36, 40]]
    assert [[p[1] for p in run] for run in device_runs(placed, limit=1 << 20)] == [[0, 4, 8, 16, 36, 40]]
    data = torch.zeros(44, dtype=torch.uint8).numpy()
    for run in runs:
        copy_run(data, run)
    assert data.tolist() == [0] * 4 + [1] * 4 + [0] * 8 + [3] * 20 + [4] * 4 + [5] * 4
    # a device with no room for the gather: each tensor of the run crosses by itself, to the same bytes
    def full(pieces: list[torch.Tensor]) -> torch.Tensor:
        raise torch.OutOfMemoryError("out of memory (the test's)")

    again = torch.zeros(44, dtype=torch.uint8).numpy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serialize.torch, "cat", full)
        for run in runs:
            copy_run(again, run)
    assert again.tolist() == data.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("small", [True, False])
def test_a_trainers_gpu_tensors_become_the_bytes_of_their_cpu_copies(small: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A push of GPU tensors (gathered on the device in runs, through pinned stages to the host) is byte for byte
    the payload of the same tensors on the CPU and what ``safetensors.torch.save`` writes of them, with a CPU tensor
    among them; with runs, stages and the threads' pieces cut small (64, 100 and 48 bytes: a tensor in many stages,
    a stage in pieces, each stage used again) or as they are; and with no device memory for the gather."""
    from lora_cache.adapters import serialize

    if small:
        for knob, value in (("GATHER_BYTES", 64), ("STAGE_BYTES", 100), ("PASS_BYTES", 48)):
            monkeypatch.setattr(serialize, knob, value)
    on_cpu = _device_tensors("cpu")
    mixed = _device_tensors("cuda") | {"m05.lora_A.weight": on_cpu["m05.lora_A.weight"]}
    out = serialize.safetensors_bytes(mixed, {"format": "pt"})
    assert bytes(out) == bytes(serialize.safetensors_bytes(on_cpu, {"format": "pt"}))
    cat = torch.cat

    def full(pieces: list[torch.Tensor]) -> torch.Tensor:  # a trainer's GPU with no room for the gather
        if pieces[0].is_cuda:
            raise torch.OutOfMemoryError("CUDA out of memory (the test's)")
        return cat(pieces)

    monkeypatch.setattr(serialize.torch, "cat", full)
    assert bytes(serialize.safetensors_bytes(mixed, {"format": "pt"})) == bytes(out)  # each tensor by itself
    back = load(bytes(out))
    assert all(torch.equal(back[k].view(torch.uint8), v.contiguous().view(torch.uint8)) if v.dim() else
               torch.equal(back[k], v) for k, v in on_cpu.items())


async def _stream(messages: list[Any]) -> AsyncIterator[Any]:
    for m in messages:
        yield m


def test_the_gateway_gathers_a_stream_and_refuses_one_cut_short_or_overlong(pushed_pair: Any) -> None:
    config_bytes, weights = payload(*pushed_pair)
    messages = list(msg.push_messages("a", 7, config_bytes, weights, chunk_bytes=1000))
    body = asyncio.run(gather(_stream(messages), max_bytes=1 << 30))
    assert (body.name, body.tag, body.config, bytes(body.weights)) == ("a", "7", config_bytes, weights)
    with pytest.raises(RequestError, match="ended after"):
        asyncio.run(gather(_stream(messages[:-1]), max_bytes=1 << 30))
    with pytest.raises(RequestError, match="more than"):
        asyncio.run(gather(_stream([*messages, pb.PushAdapterRequest(weights=b"x")]), max_bytes=1 << 30))
    with pytest.raises(RequestError, match="max_push_bytes"):
        asyncio.run(gather(_stream(messages), max_bytes=len(weights) - 1))
    with pytest.raises(RequestError, match="only the first"):
        asyncio.run(gather(_stream([messages[0], pb.PushAdapterRequest(name="b", weights=b"x")]), 1 << 30))
    with pytest.raises(RequestError, match="config_json"):
        asyncio.run(gather(_stream([pb.PushAdapterRequest(name="a", total_bytes=100)]), 1 << 30))
    with pytest.raises(RequestError, match="empty"):
        asyncio.run(gather(_stream([]), 1 << 30))


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 250_000])
@pytest.mark.parametrize("chunk", [1000, 200_000])
def test_a_push_on_the_wire_is_protobufs_bytes_and_the_gateway_takes_its_weights_in_place(size: int,
                                                                                         chunk: int) -> None:
    """The client's wire form of a push (``push_wire``, no message object per chunk) is byte for byte protobuf's
    serialization of ``push_messages``, lengths of one to three varint bytes included; the gateway takes each later
    message's weights in place (``parse_request``) and gathers the same push; a body in any other layout is decoded
    as protobuf would (another encoder may add fields), and one that is not a message is refused."""
    from lora_cache.api.push_stream import Weights, parse_request

    weights = bytes(range(256)) * (size // 256) + bytes(size % 256)
    wire = list(msg.push_wire("a", 7, b'{"r": 8}', weights, chunk_bytes=chunk))
    assert wire == [m.SerializeToString() for m in msg.push_messages("a", 7, b'{"r": 8}', weights, chunk_bytes=chunk)]
    parsed = [parse_request(raw) for raw in wire]
    assert isinstance(parsed[0], pb.PushAdapterRequest) and all(isinstance(m, Weights) for m in parsed[1:])
    assert [bytes(m.weights) for m in parsed] == [m.weights for m in map(pb.PushAdapterRequest.FromString, wire)]
    if size > 8:  # a push's weights hold at least a safetensors header's length
        body = asyncio.run(gather(_stream(parsed), max_bytes=1 << 30))
        assert (body.name, body.tag, body.config, bytes(body.weights)) == ("a", "7", b'{"r": 8}', weights)
    other = msg.weights_wire(memoryview(b"xyz")) + b"\x20\x03"  # weights, then a field more (total_bytes 3)
    assert parse_request(other) == pb.PushAdapterRequest(weights=b"xyz", total_bytes=3)
    for broken in (b"\x2a\x05abc", b"\x2a\x80"):  # a length past the body's end; a varint cut short
        with pytest.raises(RequestError, match="not a valid"):
            parse_request(broken)


def test_a_reference_names_a_kept_version_by_version_or_by_its_pushed_tag(tmp_path: Path, pushed_pair: Any) -> None:
    """``NAME@REF`` (issue 44 item 3): an exact version the catalog keeps, or the tag a kept version was pushed
    under; a version no longer kept, an unknown tag or name, or a malformed reference is a clear error."""
    (tmp_path / "roots").mkdir()
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path / "roots"),), model="tiny", max_rank=16,
                                           keep_versions=1, push_dir=str(tmp_path / "push")))
    area = PushArea(catalog.config.push_root(), "svc", 1 << 30)
    tensors, config = pushed_pair
    versions = []
    for step in (7, 8, 9):
        path, _ = area.write("a", str(step), *payload({k: v * step for k, v in tensors.items()}, config))
        versions.append(catalog.register("a", str(path)).version)
    assert split_ref("a") == ("a", None) and split_ref("a@7") == ("a", "7")
    assert version_of(catalog, "a", "9") == versions[2] == catalog.current("a")
    assert version_of(catalog, "a", "8") == versions[1] and version_of(catalog, "a", versions[1]) == versions[1]
    with pytest.raises(NotFoundError, match=r"no version or pushed tag '7' kept.*tags \['8', '9'\]"):
        version_of(catalog, "a", "7")  # past keep_versions (1) and held by no user: retired
    with pytest.raises(NotFoundError, match="not registered"):
        version_of(catalog, "b", "1")
    shutil.copytree(tmp_path / "push", tmp_path / "roots" / "c")  # a directory named 9 under a root is no tag
    catalog.register("c", str(next((tmp_path / "roots" / "c").glob("*/a/9"))))
    with pytest.raises(NotFoundError, match="tags \\[\\]"):
        version_of(catalog, "c", "9")
    for bad in ("a@", "a@../x", "bad name@1", "@1", "a@b@c"):
        with pytest.raises(AdapterFormatError):
            split_ref(bad)
        assert split_unchecked(bad) == tuple(bad.partition("@")[::2])  # the unchecked twins never raise: a path
        assert base_name(bad) == bad.partition("@")[0]  # that checks later (or never) keeps its own behaviour
    assert split_unchecked("a") == ("a", "") and split_unchecked("a@7") == ("a", "7") and base_name("a@7") == "a"
    # what a holder of pinned references keeps: only the exact name's, never a bare name, an empty ref or another's
    assert versions_named(["a@1", "a", "b@2", None, "a@", "ab@3", "a@x"], "a") == {"1", "x"}
    with pytest.raises(RequestError, match="NAME@VERSION"):
        adapter_ref("adapter", "a@")
    assert adapter_ref("adapter", "a@7") == "a@7"


def test_a_retire_while_a_push_is_registered_keeps_its_directory(tmp_path: Path, pushed_pair: Any) -> None:
    """Between a push's write and its registration, a retire of its name (another push's, or a health round's
    ``retire_released``) took the directory the catalog was about to name, and the ranks found it gone (seen in
    the push traffic test under load). A push's directory is kept from before its write until it is registered or
    refused; one the catalog refused goes. The read of the registration is held at its start (a real ``Registrar`` and
    ``ControllerCore``; the workers are the registration tests' fake links), the retire runs there."""
    from lora_cache.controller.core import ControllerConfig, ControllerCore
    from lora_cache.controller.pushes import Pushes
    from lora_cache.controller.registrations import Registrar
    from tests.test_registrations import Held, Links

    tensors, config = pushed_pair
    core = ControllerCore(ControllerConfig(catalog=CatalogConfig(model="tiny", max_rank=16,
                                                                 adapter_roots=(str(tmp_path),),
                                                                 push_dir=str(tmp_path / "push"))), epoch=1)
    held = Held(core)
    links = Links([])

    async def plan() -> None:
        pass

    draining: set[str] = set()
    pushes = Pushes(core, Registrar(core, links, draining, plan), "svc")  # type: ignore[arg-type]

    async def scenario() -> None:
        first = await pushes.push("a", 1, *payload(tensors, config))
        held.hold("a")
        second = asyncio.ensure_future(pushes.push("a", 2, *payload(scaled(tensors), config)))
        await held.until_arrived("a")  # written, its registration's read not started
        directory = pushes.area.path("a", "2")
        assert directory.is_dir()
        assert await asyncio.to_thread(pushes.area.retire, "a", pushes.kept("a")) == []  # what a retire takes
        assert directory.is_dir()
        held.release["a"].set()
        done = await second
        assert done.version != first.version and core.catalog.get("a").version == done.version
        assert directory.is_dir() and not pushes.unregistered
        draining.add("a")  # a push the catalog refuses (its name being unregistered): its directory goes
        with pytest.raises(ConflictError, match="being unregistered"):
            await pushes.push("a", 3, *payload(scaled(tensors, 3.0), config))
        assert not pushes.area.path("a", "3").exists() and not pushes.unregistered

    asyncio.run(scenario())


def scaled(tensors: dict[str, torch.Tensor], by: float = 2.0) -> dict[str, torch.Tensor]:
    return {k: (v.float() * by).to(v.dtype) for k, v in tensors.items()}


def test_the_wire_probe_streams_both_forms_whole() -> None:
    """``bench.probes.push_wire`` pushes the same weights through both forms to a real gRPC server, each gathered
    whole (its figures are the two forms' times)."""
    from bench.probes.push_wire import measure

    result = measure((3 << 20) + 5, 1)
    assert result["bytes"] == (3 << 20) + 5 and set(result["median_ms"]) == {"messages", "wire"}
    assert all(len(v) == 1 and v[0] > 0 for v in result["ms"].values())


def test_a_retired_pushed_version_lingers_and_a_request_reported_after_its_retirement_keeps_it(
        tmp_path: Path, pushed_pair: Any) -> None:
    """Issue 44 item 3, the controller's window: an engine's rank 0 accepts ``a@TAG`` while its own catalog keeps that
    version, and the controller hears of the request only in the engine's next queue report. A push that put the
    version past ``keep_versions`` meanwhile retired it at the controller, and its directory went at once, so the
    request failed on every rank. Now the directory lingers ``LINGER_ROUNDS`` health rounds; a queue report naming
    the version (by tag or version) keeps it again, as the oldest older version, for as long as it is named; then it
    retires and its directory goes. One never named goes after the rounds, not before. (A real ``Registrar`` and
    ``ControllerCore``; the workers are the registration tests' fake links.)"""
    from lora_cache.controller.core import ControllerConfig, ControllerCore
    from lora_cache.controller.pushes import LINGER_ROUNDS, Pushes
    from lora_cache.controller.registrations import Registrar
    from tests.test_registrations import Links

    tensors, config = pushed_pair
    core = ControllerCore(ControllerConfig(catalog=CatalogConfig(model="tiny", max_rank=16, keep_versions=1,
                                                                 adapter_roots=(str(tmp_path),),
                                                                 push_dir=str(tmp_path / "push"))), epoch=1)
    core.add_replica("r0", tp=1, slots=2)

    async def plan() -> None:
        pass

    pushes = Pushes(core, Registrar(core, Links([]), set(), plan), "svc")  # type: ignore[arg-type]

    async def rounds(n: int) -> None:
        for _ in range(n):
            await pushes.retire_released()

    async def scenario() -> None:
        v = [(await pushes.push("a", step, *payload(scaled(tensors, 1.0 + step), config))).version
             for step in range(1, 4)]
        one, two = pushes.area.path("a", "1"), pushes.area.path("a", "2")
        assert core.catalog.versions("a") == v[1:], "v1 is past keep_versions 1 with no use: retired"
        assert one.is_dir() and set(pushes.lingering["a"]) == {v[0]}, "its directory lingers"
        core.report_queue("r0", [("a@1", 1.0)], now=1.0)  # the request rank 0 accepted before the push of 3
        assert core.catalog.versions("a") == v and core.planner.view.queue("r0")[0].version == v[0], "kept again"
        assert not pushes.lingering.get("a")
        await rounds(LINGER_ROUNDS + 1)
        assert core.catalog.versions("a") == v and one.is_dir(), "named by a waiting request: kept"
        core.report_queue("r0", [], now=2.0)  # served and gone
        await rounds(1)
        assert core.catalog.versions("a") == v[1:] and one.is_dir(), "retired again; its directory lingers"
        await rounds(LINGER_ROUNDS - 1)
        assert one.is_dir(), "not before the rounds"
        await rounds(1)
        assert not one.exists() and not pushes.lingering, "then it goes"
        await pushes.push("a", 4, *payload(scaled(tensors, 5.0), config))  # v2 retired: never named
        await rounds(LINGER_ROUNDS - 1)
        assert two.is_dir()
        await rounds(1)
        assert not two.exists() and pushes.area.path("a", "3").is_dir() and pushes.area.path("a", "4").is_dir()
        core.report_queue("r0", [("a@2", 3.0)], now=3.0)  # too late: dropped alone, as before
        assert core.planner.view.queue("r0") == ()
        await pushes.push("a", 5, *payload(scaled(tensors, 6.0), config))  # v3 lingers
        assert pushes.area.path("a", "3").is_dir()
        pushes.area.max_bytes = pushes.area.used()  # no room for another: the lingering one makes it
        await pushes.push("a", 6, *payload(scaled(tensors, 7.0), config))  # and v4 lingers after it
        assert sorted(p.name for p in (pushes.area.dir / "a").iterdir()) == ["4", "5", "6"]
        assert [spec.path.name for spec, _ in pushes.lingering["a"].values()] == ["4"]
        core.check_integrity()

    asyncio.run(scenario())
