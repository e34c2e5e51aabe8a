"""PEFT adapters on disk: reading, rank/alpha/scaling, versions, and a clear error for every bad input."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec, content_version, peft_key, read_adapter
from lora_cache.adapters.roots import AdapterRoots
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.errors import (
    AdapterError,
    AdapterFormatError,
    AdapterPathError,
    ConfigError,
    NotFoundError,
    UnsupportedAdapterError,
)

TINY = SHAPES["tiny"]
Writer = Callable[..., Path]
Tensors = Callable[..., dict[str, torch.Tensor]]


def read(directory: Path, max_rank: int = 16) -> AdapterSpec:
    return read_adapter(directory.name, directory, TINY, max_rank)


def error_of(directory: Path, kind: type[Exception] = AdapterFormatError, max_rank: int = 16) -> str:
    with pytest.raises(kind) as e:
        read(directory, max_rank)
    assert isinstance(e.value, AdapterError)
    return str(e.value)


# -- reading good adapters ------------------------------------------------------------------------------


def test_reads_make_adapters_output(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]
) -> None:
    paths = tiny_adapters(count=3, rank="8,16")
    catalog = make_catalog(paths[0].parent)
    assert catalog.names() == ["adapter-000", "adapter-001", "adapter-002"]
    for path, rank in zip(paths, (8, 16, 8), strict=True):
        spec = catalog.get(path.name)
        assert spec.path == path.resolve() and spec.weights == path.resolve() / WEIGHTS_FILE
        assert spec.config.r == rank and spec.max_rank == rank and spec.config.lora_alpha == 32.0
        assert spec.dtype == "bfloat16"
        assert spec.file_bytes == (path / WEIGHTS_FILE).stat().st_size
        assert [(m.layer, m.module) for m in spec.modules] == [
            (la, mo) for la in range(2) for mo in MODULE_ORDER
        ]
        assert all(m.rank == rank and m.scaling == pytest.approx(32.0 / rank) for m in spec.modules)
        assert len(spec.version) == 16 and int(spec.version, 16) >= 0
        assert spec.version == content_version(path)
    assert len({catalog.get(n).version for n in catalog.names()}) == 3  # different random weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_float_dtypes(
    tmp_path: Path, peft_writer: Writer, tensors_for: Tensors, dtype: torch.dtype
) -> None:
    spec = read(peft_writer(tmp_path / "a", tensors_for(dtype=dtype)))
    assert spec.dtype == str(dtype).removeprefix("torch.")


def test_rslora_scaling(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    spec = read(peft_writer(tmp_path / "a", tensors_for(rank=16), r=16, lora_alpha=32, use_rslora=True))
    assert spec.config.use_rslora
    assert all(m.scaling == pytest.approx(32 / math.sqrt(16)) for m in spec.modules)  # 8, not alpha/r = 2


def test_lora_alpha_defaults_to_peft_default(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    directory = peft_writer(tmp_path / "a", tensors=tensors_for(rank=16), r=16)
    raw = json.loads((directory / CONFIG_FILE).read_text())
    del raw["lora_alpha"]
    (directory / CONFIG_FILE).write_text(json.dumps(raw))
    assert {m.scaling for m in read(directory).modules} == {8 / 16}  # PEFT's LoraConfig.lora_alpha is 8


def test_target_modules_match_dotted_suffixes_like_peft(tmp_path: Path, peft_writer: Writer) -> None:
    directory = peft_writer(tmp_path / "a")
    raw = json.loads((directory / CONFIG_FILE).read_text())
    raw["target_modules"] = [f"{block}.{m}" for block, m in (("self_attn", "q_proj"), ("self_attn", "k_proj"),
                             ("self_attn", "v_proj"), ("self_attn", "o_proj"), ("mlp", "gate_proj"),
                             ("mlp", "up_proj"), ("mlp", "down_proj"))]
    (directory / CONFIG_FILE).write_text(json.dumps(raw))
    assert len(read(directory).modules) > 0


def test_rank_and_alpha_patterns_per_module(
    tmp_path: Path, peft_writer: Writer, tensors_for: Tensors
) -> None:
    ranks = {(layer, "q_proj"): 4 for layer in range(2)} | {(1, "down_proj"): 12}
    tensors = tensors_for(rank=ranks)  # every other module keeps r = 8
    spec = read(
        peft_writer(
            tmp_path / "a",
            tensors,
            r=8,
            lora_alpha=16,
            rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 12},
            alpha_pattern={"v_proj": 24, "layers.1.mlp.down_proj": 6},
        )
    )
    got = {(m.layer, m.module): (m.rank, m.scaling) for m in spec.modules}
    for layer in range(2):
        assert got[(layer, "q_proj")] == (4, pytest.approx(16 / 4))
        assert got[(layer, "v_proj")] == (8, pytest.approx(24 / 8))
        assert got[(layer, "k_proj")] == (8, pytest.approx(16 / 8))
    assert got[(0, "down_proj")] == (8, pytest.approx(16 / 8))
    assert got[(1, "down_proj")] == (12, pytest.approx(6 / 12))
    assert spec.max_rank == 12
    # with rsLoRA the per-module alpha and rank combine as alpha / sqrt(rank)
    spec = read(
        peft_writer(
            tmp_path / "b",
            tensors,
            r=8,
            lora_alpha=16,
            use_rslora=True,
            rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 12},
            alpha_pattern={"v_proj": 24, "layers.1.mlp.down_proj": 6},
        )
    )
    got = {(m.layer, m.module): m.scaling for m in spec.modules}
    assert got[(0, "q_proj")] == pytest.approx(16 / 2) and got[(1, "down_proj")] == pytest.approx(
        6 / math.sqrt(12)
    )


def test_rank_pattern_disagreeing_with_tensors_is_an_error(tmp_path: Path, peft_writer: Writer) -> None:
    directory = peft_writer(tmp_path / "a", r=8, rank_pattern={"q_proj": 4})  # tensors are all rank 8
    msg = error_of(directory)
    assert (
        "layer 0 q_proj lora_A has shape [8, 64], expected [4, 64]" in msg and "rank 4 from the config" in msg
    )


def test_target_modules_list_subset(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    targets = ["v_proj", "q_proj"]
    spec = read(
        peft_writer(tmp_path / "a", tensors_for(modules=("q_proj", "v_proj")), target_modules=targets)
    )
    assert spec.config.target_modules == ("q_proj", "v_proj")
    assert [(m.layer, m.module) for m in spec.modules] == [
        (0, "q_proj"),
        (0, "v_proj"),
        (1, "q_proj"),
        (1, "v_proj"),
    ]
    # full module paths are accepted in the list too
    spec = read(
        peft_writer(
            tmp_path / "b",
            tensors_for(modules=("o_proj",), layers=(1,)),
            target_modules=["model.layers.1.self_attn.o_proj"],
        )
    )
    assert [(m.layer, m.module) for m in spec.modules] == [(1, "o_proj")]


def test_target_modules_regex(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    regex = r".*\.layers\.0\.self_attn\.(q_proj|v_proj)"
    spec = read(
        peft_writer(
            tmp_path / "a", tensors_for(modules=("q_proj", "v_proj"), layers=(0,)), target_modules=regex
        )
    )
    assert spec.config.target_modules == regex
    assert [(m.layer, m.module) for m in spec.modules] == [(0, "q_proj"), (0, "v_proj")]
    # tensors for layer 1 contradict the regex: the config and the weights disagree
    directory = peft_writer(tmp_path / "b", tensors_for(modules=("q_proj", "v_proj")), target_modules=regex)
    msg = error_of(directory)
    assert "layer 1 q_proj" in msg and "target_modules=" in msg and "excludes it" in msg


def test_target_modules_list_excluding_tensors(tmp_path: Path, peft_writer: Writer) -> None:
    msg = error_of(peft_writer(tmp_path / "a", target_modules=["q_proj"]))
    assert (
        "k_proj" in msg and "target_modules=('q_proj',)" in msg and "config and the weights disagree" in msg
    )


def test_fan_in_fan_out_is_read_and_ignored(tmp_path: Path, peft_writer: Writer) -> None:
    plain = read(peft_writer(tmp_path / "a"))
    flagged = read(peft_writer(tmp_path / "b", fan_in_fan_out=True))
    assert flagged.config.fan_in_fan_out and flagged.modules == plain.modules


def test_content_version_stable_and_content_sensitive(
    tmp_path: Path, peft_writer: Writer, tensors_for: Tensors
) -> None:
    tensors = tensors_for(seed=3)
    a = peft_writer(tmp_path / "a", tensors)
    v = read(a).version
    assert read(a).version == v == content_version(a)  # stable across reads
    assert read(peft_writer(tmp_path / "same", tensors)).version == v  # same content elsewhere: same version
    changed = dict(tensors)
    key = peft_key(1, "down_proj", "B")
    changed[key] = changed[key].clone()
    changed[key][0, 0] += 1
    save_file(changed, str(a / WEIGHTS_FILE))
    v2 = read(a).version
    assert v2 != v  # one changed weight: a new version
    peft_writer(a, changed, lora_alpha=17)
    assert read(a).version not in (v, v2)  # the config is part of the content
    peft_writer(a, tensors)
    assert read(a).version == v  # back to the original content


# -- bad adapters: the error class, the thing, the value and the fix ------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    msg = error_of(tmp_path / "nope")
    assert str(tmp_path / "nope") in msg and "does not exist" in msg


def test_missing_adapter_config(tmp_path: Path, peft_writer: Writer) -> None:
    directory = peft_writer(tmp_path / "a")
    (directory / CONFIG_FILE).unlink()
    msg = error_of(directory)
    assert str(directory / CONFIG_FILE) in msg and "is missing" in msg and "save_pretrained" in msg


@pytest.mark.parametrize("text", ['{"r": 8,', "", "\xff\xfe"])
def test_invalid_json(tmp_path: Path, peft_writer: Writer, text: str) -> None:
    directory = peft_writer(tmp_path / "a")
    (directory / CONFIG_FILE).write_bytes(text.encode("latin-1"))
    msg = error_of(directory)
    assert CONFIG_FILE in msg and "not valid JSON" in msg and "re-save" in msg


def test_json_not_an_object(tmp_path: Path, peft_writer: Writer) -> None:
    directory = peft_writer(tmp_path / "a")
    (directory / CONFIG_FILE).write_text("[8]")
    assert "must hold a JSON object, got list" in error_of(directory)


@pytest.mark.parametrize("r", [None, 0, -4, "8", 8.0, True])
def test_bad_r(tmp_path: Path, peft_writer: Writer, r: object) -> None:
    directory = peft_writer(tmp_path / "a", r=r)
    if r is None:
        raw = json.loads((directory / CONFIG_FILE).read_text())
        del raw["r"]
        (directory / CONFIG_FILE).write_text(json.dumps(raw))
    msg = error_of(directory)
    assert "'r' must be a positive integer" in msg and f"got {r!r}" in msg and CONFIG_FILE in msg


@pytest.mark.parametrize("alpha", [0, -1, "16", False, math.nan, math.inf, -math.inf, 10**400])
def test_bad_lora_alpha(tmp_path: Path, peft_writer: Writer, alpha: object) -> None:
    """NaN and Infinity (JSON extensions Python reads) were accepted before issue 35; 10**400 overflowed a float."""
    msg = error_of(peft_writer(tmp_path / "a", lora_alpha=alpha))
    assert "'lora_alpha' must be a finite positive number" in msg and f"got {alpha!r}"[:40] in msg


@pytest.mark.parametrize("targets", [[], "", None, 7, [1, 2], ["q_proj", None], [""], ["q_proj"] * 5000])
def test_bad_target_modules(tmp_path: Path, peft_writer: Writer, targets: object) -> None:
    """A list of ints raised TypeError (INTERNAL over gRPC) before issue 35."""
    msg = error_of(peft_writer(tmp_path / "a", target_modules=targets))
    assert "'target_modules' must be a non-empty list or regex" in msg and f"got {targets!r}"[:40] in msg
    assert len(msg) < 600  # a huge value is clipped, not echoed


@pytest.mark.parametrize("pattern", [{"q_proj": 0}, {"q_proj": "4"}, {"q_proj": 8.5}, {"q_proj": math.inf},
                                     {"q_proj": True}, {"q_proj": 10**6}])
def test_bad_rank_pattern_value(tmp_path: Path, peft_writer: Writer, pattern: dict[str, object]) -> None:
    """8.5 was accepted (and read as rank 8) and Infinity raised OverflowError before issue 35."""
    msg = error_of(peft_writer(tmp_path / "a", rank_pattern=pattern))
    assert "rank_pattern['q_proj'] must be a positive integer" in msg and f"got {pattern['q_proj']!r}" in msg


@pytest.mark.parametrize("pattern", [["q_proj"], "q_proj", 4])
def test_bad_rank_pattern(tmp_path: Path, peft_writer: Writer, pattern: object) -> None:
    msg = error_of(peft_writer(tmp_path / "a", rank_pattern=pattern))
    assert "'rank_pattern' must map module patterns to positive numbers" in msg and repr(pattern) in msg


@pytest.mark.parametrize("pattern", [{"v_proj": 0}, {"v_proj": math.nan}, {"v_proj": "2"}])
def test_bad_alpha_pattern_value(tmp_path: Path, peft_writer: Writer, pattern: dict[str, object]) -> None:
    msg = error_of(peft_writer(tmp_path / "a", alpha_pattern=pattern))
    assert "alpha_pattern['v_proj'] must be a finite positive number" in msg


@pytest.mark.parametrize("field", ["use_rslora", "fan_in_fan_out"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, []])
def test_flags_must_be_booleans(tmp_path: Path, peft_writer: Writer, field: str, value: object) -> None:
    """``use_rslora: "false"`` was read as true (bool("false")) before issue 35: the scaling silently wrong."""
    msg = error_of(peft_writer(tmp_path / "a", **{field: value}))
    assert f"'{field}' must be true or false" in msg and f"got {value!r}" in msg


def test_a_null_flag_is_false_as_in_peft(tmp_path: Path, peft_writer: Writer) -> None:
    spec = read(peft_writer(tmp_path / "a", use_rslora=None, fan_in_fan_out=None))
    assert not spec.config.use_rslora and not spec.config.fan_in_fan_out


@pytest.mark.parametrize("raw", ["[" * 100_000 + "]" * 100_000, '{"r": ' + "1" * 5000 + "}", '{"r": 8, "x": "\\ud800"}',
                                 b"\xff\xfe{}"])
def test_hostile_json_is_a_format_error(tmp_path: Path, peft_writer: Writer, raw: str | bytes) -> None:
    """100,000 nested arrays (RecursionError) and a 5,000-digit number (ValueError) were INTERNAL before issue 35."""
    directory = peft_writer(tmp_path / "a")
    path = directory / CONFIG_FILE
    path.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    msg = error_of(directory)
    assert CONFIG_FILE in msg and ("not valid JSON" in msg or "must" in msg) and len(msg) < 600


@pytest.mark.parametrize("base", [7, ["tiny"], "x" * 5000])
def test_bad_base_model(tmp_path: Path, peft_writer: Writer, base: object) -> None:
    msg = error_of(peft_writer(tmp_path / "a", base_model_name_or_path=base))
    assert "'base_model_name_or_path' must be a string" in msg and len(msg) < 600


def test_rank_above_max_rank(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    directory = peft_writer(tmp_path / "a", tensors_for(rank=16), r=16)
    msg = error_of(directory, max_rank=8)
    assert (
        "rank 16, above the configured maximum 8" in msg and "--max-rank" in msg and "layer 0 q_proj" in msg
    )
    assert read(directory, max_rank=16).max_rank == 16


@pytest.mark.parametrize(
    "key", ["base_model.model.lm_head.lora_A.weight", "base_model.model.model.embed_tokens.lora_embedding_A"]
)
def test_key_outside_the_decoder_layers(
    tmp_path: Path, peft_writer: Writer, tensors_for: Tensors, key: str
) -> None:
    tensors = tensors_for() | {key: torch.zeros(8, 64, dtype=torch.bfloat16)}
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert f"unexpected tensor {key!r}" in msg and peft_key(0, "q_proj", "A") in msg


def test_module_the_model_lacks(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    key = "base_model.model.model.layers.0.mlp.fc1.lora_A.weight"
    tensors = tensors_for() | {key: torch.zeros(8, 64, dtype=torch.bfloat16)}
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert repr(key) in msg and "module 'fc1'" in msg and "tiny lacks" in msg and "q_proj" in msg
    # a known module under the wrong block is just as foreign
    key = "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight"
    tensors = tensors_for() | {key: torch.zeros(8, 64, dtype=torch.bfloat16)}
    assert "module 'q_proj', which tiny lacks" in error_of(peft_writer(tmp_path / "b", tensors))


@pytest.mark.parametrize(
    ("key", "shape", "label", "want"),
    [
        (peft_key(0, "q_proj", "A"), (8, 63), "lora_A", [8, 64]),
        (peft_key(1, "k_proj", "B"), (64, 8), "lora_B", [32, 8]),
        (peft_key(1, "down_proj", "A"), (8, 64), "lora_A", [8, 128]),
        (peft_key(0, "up_proj", "B"), (128,), "lora_B", [128, 8]),
    ],
)
def test_wrong_tensor_shape(
    tmp_path: Path,
    peft_writer: Writer,
    tensors_for: Tensors,
    key: str,
    shape: tuple[int, ...],
    label: str,
    want: list[int],
) -> None:
    tensors = tensors_for()
    tensors[key] = torch.zeros(shape, dtype=torch.bfloat16)
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert f"{label} has shape {list(shape)}, expected {want}" in msg and "tiny sizes" in msg


@pytest.mark.parametrize("missing", ["A", "B"])
def test_missing_lora_a_or_b(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors, missing: str) -> None:
    tensors = tensors_for()
    key = peft_key(1, "v_proj", missing)
    del tensors[key]
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert f"layer 1 v_proj has no lora_{missing} tensor" in msg and repr(key) in msg
    assert "both lora_A and lora_B" in msg


@pytest.mark.parametrize(
    ("key", "shape"),
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", (64,)),  # DoRA
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.weight", (64,)),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", (64,)),  # lora_bias=True
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", (64, 64)),
    ],
)
def test_unexpected_keys(
    tmp_path: Path, peft_writer: Writer, tensors_for: Tensors, key: str, shape: tuple[int, ...]
) -> None:
    tensors = tensors_for() | {key: torch.zeros(shape, dtype=torch.bfloat16)}
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert f"unexpected tensor {key!r}" in msg and "only PEFT LoRA keys" in msg


@pytest.mark.parametrize("rename", [lambda k: k.replace(".weight", ".default.weight"),
                                    lambda k: k.replace("layers.1.", "layers.01."),
                                    lambda k: k.replace("layers.1.", "layers.\u0661.")],  # an Arabic-Indic one
                         ids=["adapter-name", "leading-zero", "unicode-digit"])
def test_keys_not_in_peft_saved_form_are_refused(
    tmp_path: Path, peft_writer: Writer, tensors_for: Tensors, rename: Callable[[str], str]
) -> None:
    """Before issue 35 these were accepted (the key's layer or adapter segment read loosely) and every load then
    failed: the reader looks tensors up by PEFT's saved key. Now the validator accepts only keys a read finds."""
    tensors = {rename(k): v for k, v in tensors_for().items()}
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert WEIGHTS_FILE in msg and ("adapter name ('default')" in msg or "PEFT's form" in msg
                                    or "unexpected tensor" in msg)


def test_truncated_safetensors(tmp_path: Path, peft_writer: Writer) -> None:
    directory = peft_writer(tmp_path / "a")
    weights = directory / WEIGHTS_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    msg = error_of(directory)
    assert str(weights) in msg and "not a readable safetensors file" in msg and "truncated or corrupt" in msg
    assert "re-copy" in msg


@pytest.mark.parametrize("size", [0, 7, 4096])
def test_corrupt_safetensors(tmp_path: Path, peft_writer: Writer, size: int) -> None:
    directory = peft_writer(tmp_path / "a")
    (directory / WEIGHTS_FILE).write_bytes(os.urandom(size))
    msg = error_of(directory)
    assert "not a readable safetensors file" in msg and "truncated or corrupt" in msg


def test_no_lora_tensors(tmp_path: Path, peft_writer: Writer) -> None:
    assert "holds no LoRA tensors" in error_of(peft_writer(tmp_path / "a", {}))


def test_pickle_only_adapter(tmp_path: Path, peft_writer: Writer) -> None:
    directory = peft_writer(tmp_path / "a")
    (directory / WEIGHTS_FILE).rename(directory / "adapter_model.bin")
    msg = error_of(directory, AdapterPathError)
    assert "pickle weights ['adapter_model.bin']" in msg and "arbitrary code" in msg
    assert "adapter_model.safetensors" in msg and "safe_serialization=True" in msg


def test_missing_weights(tmp_path: Path, peft_writer: Writer) -> None:
    directory = peft_writer(tmp_path / "a")
    (directory / WEIGHTS_FILE).unlink()
    msg = error_of(directory)
    assert str(directory / WEIGHTS_FILE) in msg and "is missing" in msg and "safe_serialization=True" in msg


def test_use_dora(tmp_path: Path, peft_writer: Writer) -> None:
    msg = error_of(peft_writer(tmp_path / "a", use_dora=True), UnsupportedAdapterError)
    assert "use_dora is true" in msg and "DoRA" in msg and "retrain as LoRA" in msg


def test_modules_to_save(tmp_path: Path, peft_writer: Writer) -> None:
    msg = error_of(peft_writer(tmp_path / "a", modules_to_save=["lm_head"]), UnsupportedAdapterError)
    assert "modules_to_save=['lm_head']" in msg and "not supported" in msg and "without them" in msg


@pytest.mark.parametrize("peft_type", ["IA3", "LOHA", "PROMPT_TUNING"])
def test_peft_type_not_lora(tmp_path: Path, peft_writer: Writer, peft_type: str) -> None:
    msg = error_of(peft_writer(tmp_path / "a", peft_type=peft_type), UnsupportedAdapterError)
    assert f"peft_type is {peft_type!r}" in msg and "only LORA" in msg


def test_layer_beyond_the_model(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    tensors = tensors_for()
    tensors[peft_key(2, "q_proj", "A")] = torch.zeros(8, 64, dtype=torch.bfloat16)
    tensors[peft_key(2, "q_proj", "B")] = torch.zeros(64, 8, dtype=torch.bfloat16)
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert "layer 2" in msg and "tiny has 2 layers" in msg and "another model" in msg


def test_mixed_dtypes(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    tensors = tensors_for()
    key = peft_key(0, "k_proj", "B")
    tensors[key] = tensors[key].float()
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert "mix dtypes ['BF16', 'F32']" in msg and "one dtype" in msg


def test_integer_dtype(tmp_path: Path, peft_writer: Writer, tensors_for: Tensors) -> None:
    tensors = tensors_for()
    key = peft_key(0, "k_proj", "A")
    tensors[key] = tensors[key].to(torch.int32)
    msg = error_of(peft_writer(tmp_path / "a", tensors))
    assert repr(key) in msg and "dtype I32" in msg and "F16, BF16 or F32" in msg


# -- adapter roots and the catalog ------------------------------------------------------------------------


@pytest.fixture
def two_roots(tmp_path: Path, peft_writer: Writer) -> tuple[AdapterCatalog, Path, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    peft_writer(root / "good")
    peft_writer(outside / "evil")
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=16))
    return catalog, root.resolve(), outside.resolve()


def test_catalog_registers_under_a_root(two_roots: tuple[AdapterCatalog, Path, Path]) -> None:
    catalog, root, _ = two_roots
    assert catalog.register("good", "good").path == root / "good"  # relative: from the first root
    assert catalog.register("good-abs", root / "good").version == catalog.get("good").version


def test_absolute_path_outside_the_roots(two_roots: tuple[AdapterCatalog, Path, Path]) -> None:
    catalog, root, outside = two_roots
    with pytest.raises(AdapterPathError) as e:
        catalog.register("evil", outside / "evil")
    msg = str(e.value)
    assert str(outside / "evil") in msg and "outside the adapter roots" in msg and str(root) in msg
    assert "add one" in msg and "evil" not in catalog


def test_dotdot_path(two_roots: tuple[AdapterCatalog, Path, Path]) -> None:
    catalog, root, _ = two_roots
    for path in ("../outside/evil", root / ".." / "outside" / "evil", "good/../good"):
        with pytest.raises(AdapterPathError) as e:
            catalog.register("evil", path)
        assert "contains '..'" in str(e.value) and str(path) in str(e.value)
    assert len(catalog) == 0


def test_symlink_inside_a_root_pointing_outside(two_roots: tuple[AdapterCatalog, Path, Path]) -> None:
    catalog, root, outside = two_roots
    (root / "link").symlink_to(outside / "evil", target_is_directory=True)
    with pytest.raises(AdapterPathError) as e:
        catalog.register("link", "link")
    assert f"resolves to {outside / 'evil'}" in str(e.value) and "outside the adapter roots" in str(e.value)
    (root / "good-link").symlink_to(
        root / "good", target_is_directory=True
    )  # a link that stays inside is fine
    assert catalog.register("good-link", "good-link").path == root / "good"


def test_roots_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"adapter roots are empty.*--adapter-root"):
        AdapterRoots(())
    with pytest.raises(ConfigError) as e:
        AdapterRoots((tmp_path / "missing",))
    assert str(tmp_path / "missing") in str(e.value) and "not a directory" in str(e.value)
    with pytest.raises(ConfigError, match=r"max_rank must be in 1\.\.1024, got 0"):
        CatalogConfig(adapter_roots=(str(tmp_path),), max_rank=0)


@pytest.mark.parametrize("name", ["", "-lead", "a/b", "x" * 129, "sp ace"])
def test_bad_adapter_names(two_roots: tuple[AdapterCatalog, Path, Path], name: str) -> None:
    catalog = two_roots[0]
    with pytest.raises(AdapterFormatError) as e:
        catalog.register(name, "good")
    assert f"adapter name {name!r} is invalid" in str(e.value)


def test_catalog_lookup_errors(two_roots: tuple[AdapterCatalog, Path, Path], peft_writer: Writer) -> None:
    catalog, root, _ = two_roots
    old = catalog.register("good", "good")
    with pytest.raises(NotFoundError) as e:
        catalog.get("nope")
    assert (
        str(e.value) == "adapter 'nope' is not registered; register it first (lora-cache register NAME PATH)"
    )
    with pytest.raises(NotFoundError):
        catalog.unregister("nope")
    peft_writer(root / "good", lora_alpha=20)  # new content under the same name
    new = catalog.register("good", "good")
    assert new.version != old.version and catalog.get("good") == new
    with pytest.raises(NotFoundError) as e:
        catalog.get("good", old.version)
    assert old.version in str(e.value) and new.version in str(e.value) and "re-registered" in str(e.value)
    assert catalog.unregister("good") == new and "good" not in catalog


def test_failed_register_keeps_the_current_version(two_roots: tuple[AdapterCatalog, Path, Path]) -> None:
    catalog, root, _ = two_roots
    good = catalog.register("good", "good")
    (root / "good" / WEIGHTS_FILE).write_bytes(b"garbage")
    with pytest.raises(AdapterFormatError):
        catalog.register("good", "good")
    assert catalog.get("good") == good
