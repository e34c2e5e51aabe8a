"""Model shapes: the named table, Hugging Face config.json reading, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_cache.adapters.shapes import (
    MODULE_ORDER,
    MODULES,
    SHAPES,
    ModelShape,
    Parallel,
    from_hf_config,
    resolve_model,
)
from lora_cache.errors import ConfigError

LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def test_named_shapes_table() -> None:
    assert set(SHAPES) == {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "tiny"}
    assert all(name == shape.name for name, shape in SHAPES.items())
    tiny = SHAPES["tiny"]
    assert (tiny.num_layers, tiny.hidden_size, tiny.intermediate_size) == (2, 64, 128)
    assert {m: tiny.dims(m) for m in MODULE_ORDER} == {
        "q_proj": (64, 64),
        "k_proj": (64, 32),
        "v_proj": (64, 32),
        "o_proj": (64, 64),
        "gate_proj": (64, 128),
        "up_proj": (64, 128),
        "down_proj": (128, 64),
    }
    llama = SHAPES["llama-3.1-8b"]
    assert llama.dims("k_proj") == (4096, 1024)  # 8 KV heads x 128
    assert llama.dims("down_proj") == (14336, 4096)
    assert SHAPES["llama-3.1-70b"].dims("q_proj") == (8192, 8192)
    assert SHAPES["qwen2.5-7b"].dims("v_proj") == (3584, 512)


def test_parallel_table_matches_the_architecture() -> None:
    column = {m for m, (_, p) in MODULES.items() if p is Parallel.COLUMN}
    row = {m for m, (_, p) in MODULES.items() if p is Parallel.ROW}
    assert column == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert row == {"o_proj", "down_proj"}
    assert {m: MODULES[m][0] for m in MODULE_ORDER} == {
        "q_proj": "self_attn",
        "k_proj": "self_attn",
        "v_proj": "self_attn",
        "o_proj": "self_attn",
        "gate_proj": "mlp",
        "up_proj": "mlp",
        "down_proj": "mlp",
    }


def test_dims_of_unknown_module_names_it() -> None:
    with pytest.raises(ConfigError) as e:
        SHAPES["tiny"].dims("fc1")
    assert "'fc1'" in str(e.value) and "'tiny'" in str(e.value) and "q_proj" in str(e.value)


def test_resolve_named_and_passthrough() -> None:
    assert resolve_model("tiny") is SHAPES["tiny"]
    assert resolve_model("LLAMA-3.1-8B") is SHAPES["llama-3.1-8b"]
    shape = ModelShape("custom", 1, 8, 16, 2, 1, 4)
    assert resolve_model(shape) is shape


def test_unknown_model_lists_the_choices() -> None:
    with pytest.raises(ConfigError) as e:
        resolve_model("gpt-5")
    msg = str(e.value)
    assert "'gpt-5'" in msg and "tiny" in msg and "llama-3.1-8b" in msg and "config.json" in msg


def test_hf_config_json(tmp_path: Path) -> None:
    path = tmp_path / "Meta-Llama-3.1-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_8B_CONFIG))
    shape = resolve_model(str(path))
    named = SHAPES["llama-3.1-8b"]
    assert shape.name == "Meta-Llama-3.1-8B"
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(shape, field) == getattr(named, field), field
    assert all(shape.dims(m) == named.dims(m) for m in MODULE_ORDER)
    assert resolve_model(str(path.parent)) == shape  # a model directory works too
    assert from_hf_config(path) == shape


def test_hf_config_defaults_and_explicit_head_dim(tmp_path: Path) -> None:
    cfg = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "_name_or_path": "org/tiny-mha",
    }
    (tmp_path / "a.json").write_text(json.dumps(cfg))
    shape = from_hf_config(tmp_path / "a.json")
    assert shape.name == "org/tiny-mha"
    assert shape.num_kv_heads == 4 and shape.head_dim == 16  # MHA: kv heads default to heads
    assert shape.dims("k_proj") == (64, 64)
    cfg.update(num_key_value_heads=2, head_dim=32)  # e.g. Gemma/Qwen3: head_dim != hidden / heads
    (tmp_path / "b.json").write_text(json.dumps(cfg))
    shape = from_hf_config(tmp_path / "b.json")
    assert (
        shape.dims("q_proj") == (64, 128)
        and shape.dims("k_proj") == (64, 64)
        and shape.dims("o_proj") == (128, 64)
    )


def test_hf_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_model(str(tmp_path / "nope" / "config.json"))
    assert "does not exist" in str(e.value) and "nope" in str(e.value) and "config.json" in str(e.value)


def test_hf_config_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError) as e:
        resolve_model(str(path))
    assert "not valid JSON" in str(e.value) and str(path) in str(e.value)


def test_hf_config_missing_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError) as e:
        resolve_model(str(path))
    msg = str(e.value)
    assert "num_hidden_layers" in msg and "intermediate_size" in msg and "decoder-only" in msg


@pytest.mark.parametrize(("field", "value"), [("num_layers", 0), ("hidden_size", -1), ("head_dim", 2.5),
                                             ("num_layers", True), ("num_layers", 10**9)])
def test_model_shape_rejects_bad_sizes(field: str, value: object) -> None:
    kw = {
        "num_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        field: value,
    }
    with pytest.raises(ConfigError) as e:
        ModelShape("bad", **kw)  # type: ignore[arg-type]
    assert field in str(e.value) and repr(value) in str(e.value) and "positive integer" in str(e.value)


def test_model_shape_rejects_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(ConfigError) as e:
        ModelShape("bad", 2, 64, 128, 6, 4, 16)
    assert "num_heads (6)" in str(e.value) and "num_kv_heads (4)" in str(e.value)
