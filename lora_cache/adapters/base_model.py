"""Which base model a directory of adapters was trained on: ``serve``'s model when ``--model`` is left out.

The directory may be an object-store prefix (``s3://BUCKET/PREFIX``): its adapters' configs are read from the
store (``store.adapter_bases``), and the choice and its errors are the same as for a local directory.

PEFT writes the base model into every ``adapter_config.json`` (``base_model_name_or_path``). It names a
shape we know when it is one of ``shapes.SHAPES`` or a Hugging Face id of one (``meta-llama/Llama-3.1-8B``,
``Qwen/Qwen2.5-7B-Instruct``: the organisation, a ``Meta-`` prefix and an ``-Instruct`` suffix are
dropped), or when it is a readable ``config.json`` (or a directory holding one). The shapes are
compared, not the names: a config.json of Llama-3.1-8B agrees with ``llama-3.1-8b``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lora_cache.adapters.objects import StoreUrl, is_store_url
from lora_cache.adapters.shapes import SHAPES, ModelShape, from_hf_config, resolve_model
from lora_cache.errors import ConfigError

STORE_TIMEOUT_S = 20.0  # each store call's deadline, retries included (CatalogConfig.store_timeout_s's default)
_SUFFIXES = re.compile(r"-(instruct|chat|hf|base)$")


def shape_of_base(name: str) -> ModelShape | None:
    """The shape ``base_model_name_or_path`` names, or None when it names none we can read."""
    if not name:
        return None
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = _SUFFIXES.sub("", key.removeprefix("meta-"))
    if key in SHAPES:
        return SHAPES[key]
    path = Path(name).expanduser()
    if (path / "config.json").is_file() or (path.suffix == ".json" and path.is_file()):
        try:
            return from_hf_config(path)
        except ConfigError:
            return None
    return None


def adapter_bases(directory: str | Path, only: str = "", timeout_s: float = STORE_TIMEOUT_S) -> dict[str, str]:
    """``{adapter directory name: base_model_name_or_path}`` of every adapter directly under ``directory``
    (of the one named ``only``, if given); a store prefix's are read with ``timeout_s`` per request."""
    if is_store_url(str(directory)):
        from lora_cache.adapters import store  # deferred: boto3, paid only by a process that uses a store

        return store.adapter_bases(StoreUrl.parse(str(directory)), timeout_s, only)
    bases: dict[str, str] = {}
    if not Path(directory).is_dir():
        return bases
    for d in sorted(Path(directory).iterdir()):
        if only and d.name != only:
            continue
        config = d / "adapter_config.json"
        if not config.is_file():
            continue
        try:
            base = json.loads(config.read_text()).get("base_model_name_or_path") or ""
        except (OSError, ValueError, AttributeError, RecursionError):
            base = ""  # a broken config is the catalog's to report, with its own message, when it registers
        bases[d.name] = str(base)
    return bases


def choose_model(model: str, adapters: str | Path | None, only: str = "", timeout_s: float = STORE_TIMEOUT_S,
                 bases: dict[str, str] | None = None) -> str:
    """The model to serve: ``model`` if given (checked against the adapters' base), else the adapters' base.
    ``adapters``: a directory or a store prefix (read with ``timeout_s`` per request).

    Raises ConfigError naming ``--model`` when the adapters' known bases disagree with each other or with
    ``model``, or when ``model`` is empty and the adapters name no base model we can read.
    """
    if bases is None:  # ``bases``: the adapters' as ``adapter_bases`` read them already (not read again)
        bases = adapter_bases(adapters, only, timeout_s) if adapters else {}
    known = {a: s for a, b in bases.items() if (s := shape_of_base(b)) is not None}
    if model:
        shape = resolve_model(model)
        for adapter, base_shape in known.items():
            if _dims(base_shape) != _dims(shape):
                raise ConfigError(
                    f"adapter {adapter!r} was trained on {bases[adapter]!r}, whose shape differs from --model "
                    f"{model!r}; pass --model {base_shape.name if base_shape.name in SHAPES else bases[adapter]} "
                    "(or leave --model out to take it from the adapters)")
        return model
    shapes = {_dims(s): s for s in known.values()}
    if len(shapes) > 1:
        listed = ", ".join(f"{a}: {bases[a]!r}" for a in sorted(known))
        raise ConfigError(f"the adapters under {adapters} were trained on different base models ({listed}); "
                          "serve them from one base: pass --model NAME and an --adapters directory of its adapters")
    if not shapes:
        where = (f"the adapters under {adapters} name no base model we know ({sorted(set(bases.values()))})"
                 if bases else "no adapters to take it from")
        raise ConfigError(f"which base model to serve? {where}: pass --model with one of {sorted(SHAPES)} or "
                          "the path of the base model's config.json")
    (dims,) = shapes
    named = [name for name, s in SHAPES.items() if _dims(s) == dims]
    if named:
        return named[0]
    return next(bases[a] for a, s in known.items() if _dims(s) == dims)  # the config.json the adapters name


def _dims(shape: ModelShape) -> tuple[int, ...]:
    return (shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads,
            shape.head_dim)
