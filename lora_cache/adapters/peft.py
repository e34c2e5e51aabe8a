"""PEFT LoRA adapters on disk: ``adapter_config.json`` + ``adapter_model.safetensors`` (lifecycle step 5).

Reading an adapter validates it completely from the config and the safetensors header: every tensor's
key, dtype and shape against the model shape, ranks against the configured maximum. Each file is opened
once, confined to the adapter roots and refused unless a regular file (``lora_cache.adapters.files``), and read
once: the version is a hash of exactly those bytes, and the spec carries what every later read checks
(the file's identity, CRCs of its header and blocks), so a read never returns other bytes under it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from safetensors import safe_open

from lora_cache.adapters.files import (
    MAX_CONFIG_BYTES,
    OpenFile,
    WeightsSource,
    digest_weights,
    header_matches,
    open_adapter_file,
    read_exact,
    unchanged_since_open,
)
from lora_cache.adapters.roots import PICKLE_SUFFIXES, AdapterRoots
from lora_cache.adapters.shapes import MODULES, ModelShape
from lora_cache.errors import AdapterChangedError, AdapterFormatError, AdapterPathError, UnsupportedAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def peft_key(layer: int, module: str, ab: str) -> str:
    """PEFT's saved key for one LoRA matrix (``ab`` is "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{MODULES[module][0]}.{module}.lora_{ab}.weight"


def module_path(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{MODULES[module][0]}.{module}"


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json that decide how the adapter is served."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    fan_in_fan_out: bool = False
    base_model: str | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: Path) -> AdapterConfig:
        if raw.get("peft_type", "LORA") != "LORA":
            raise UnsupportedAdapterError(f"{where}: peft_type is {raw['peft_type']!r}; only LORA adapters are served")
        if raw.get("use_dora"):
            raise UnsupportedAdapterError(f"{where}: use_dora is true; DoRA adapters are not supported "
                                          "(their magnitude vectors need the base weight); merge or retrain as LoRA")
        if raw.get("modules_to_save"):
            raise UnsupportedAdapterError(f"{where}: modules_to_save={raw['modules_to_save']!r} is not supported "
                                          "(fully fine-tuned modules are not LoRA); save the adapter without them")
        r, alpha = raw.get("r"), raw.get("lora_alpha", 8)  # PEFT's default lora_alpha is 8
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise AdapterFormatError(f"{where}: 'r' must be a positive integer, got {r!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise AdapterFormatError(f"{where}: 'lora_alpha' must be a positive number, got {alpha!r}")
        targets = raw.get("target_modules")
        if not targets or not isinstance(targets, (list, str)):
            raise AdapterFormatError(f"{where}: 'target_modules' must be a non-empty list or regex, got {targets!r}")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=_pattern(raw.get("rank_pattern"), int, where, "rank_pattern"),
            alpha_pattern=_pattern(raw.get("alpha_pattern"), float, where, "alpha_pattern"),
            fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
            base_model=raw.get("base_model_name_or_path"),
        )

    def rank_alpha(self, layer: int, module: str) -> tuple[int, float]:
        """(rank, alpha) of one module, resolved through rank_pattern / alpha_pattern like PEFT does."""
        path = module_path(layer, module)
        rank = _match(self.rank_pattern, path, self.r)
        alpha = _match(self.alpha_pattern, path, self.lora_alpha)
        return int(rank), float(alpha)

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, module: str, layer: int) -> bool:
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_path(layer, module)) is not None
        path = module_path(layer, module)  # like PEFT: a name matches itself or any dotted suffix of the path
        return any(path == t or path.endswith("." + t) for t in self.target_modules)


def _pattern(raw: Any, kind: type, where: Path, name: str) -> tuple[tuple[str, Any], ...]:
    if raw in (None, {}):
        return ()
    if not isinstance(raw, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in raw.values()):
        raise AdapterFormatError(f"{where}: {name!r} must map module patterns to positive numbers, got {raw!r}")
    return tuple((k, kind(v)) for k, v in raw.items())


def _match(pattern: tuple[tuple[str, Any], ...], path: str, default: Any) -> Any:
    for key, value in pattern:  # PEFT: the first key matching the end of the module path wins
        if re.fullmatch(rf"(.*\.)?(?:{key})", path):
            return value
    return default


class LoraModule(NamedTuple):
    """One adapted module of one layer: its rank, scaling and the two keys in the file."""

    layer: int
    module: str
    rank: int
    scaling: float


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: where it is, what it adapts, its dtype and content version."""

    name: str
    path: Path  # the adapter directory (resolved, under a root)
    config: AdapterConfig
    modules: tuple[LoraModule, ...]  # sorted by (layer, module order)
    dtype: str  # torch dtype name of the tensors in the file
    version: str
    file_bytes: int
    source: WeightsSource | None = None  # what reads check; None for specs not read from disk (simulators)

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def read_adapter(name: str, directory: Path, shape: ModelShape, max_rank: int,
                 roots: AdapterRoots | None = None) -> AdapterSpec:
    """Validate a PEFT adapter directory against ``shape`` from its config and safetensors header.

    Its files must resolve under ``roots`` (by default the directory itself)."""
    if not directory.is_dir():
        raise AdapterFormatError(f"adapter directory {directory} does not exist; check the path")
    roots = roots or AdapterRoots((directory,))
    config_bytes = _read_config_bytes(roots, directory)
    config = _parse_config(config_bytes, directory / CONFIG_FILE)
    weights = _weights_file(directory)
    registered_ns = time.time_ns()  # before the open: the earliest moment, for the racy check
    with open_adapter_file(roots, weights, f"{weights} is missing; save the adapter with safe_serialization=True") as f:
        header_bytes = _header_bytes(f, weights)
        digest = hashlib.blake2b(config_bytes, digest_size=8)
        header_crc, block_crcs = digest_weights(f.fd, f.identity, weights, digest, header_bytes)
        unchanged_since_open(f.fd, weights, f.identity)  # the bytes hashed are the file's, as opened
        header = _read_header(Path(f"/proc/self/fd/{f.fd}"), weights)  # the file this fd holds, not the path's
        unchanged_since_open(f.fd, weights, f.identity)
        if not header_matches(f.fd, header_bytes, header_crc):  # validated another header than the one hashed
            raise AdapterChangedError(f"{weights} changed while it was being registered (its header); wait until "
                                      "it is written completely and register it again")
    modules = _validate(header, config, shape, max_rank, weights)
    dtypes = {dtype for dtype, _ in header.values()}
    if len(dtypes) != 1:
        raise AdapterFormatError(f"{weights}: tensors mix dtypes {sorted(dtypes)}; save the adapter in one dtype")
    version = digest.hexdigest()
    source = WeightsSource(str(f.real), version, f.identity, header_bytes, header_crc, block_crcs, registered_ns)
    return AdapterSpec(name, directory, config, modules, FLOAT_DTYPES[dtypes.pop()], version, f.identity.size,
                       source)


def _read_config_bytes(roots: AdapterRoots, directory: Path) -> bytes:
    where = directory / CONFIG_FILE
    with open_adapter_file(roots, where, f"{where} is missing; a PEFT adapter directory holds adapter_config.json "
                             "(written by save_pretrained or `lora-cache make-adapters`)") as f:
        data = read_exact(f.fd, f.identity, where, MAX_CONFIG_BYTES)
        unchanged_since_open(f.fd, where, f.identity)
    return data


def _parse_config(data: bytes, where: Path) -> AdapterConfig:
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterFormatError(f"{where} is not valid JSON ({e}); re-save the adapter") from e
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{where} must hold a JSON object, got {type(raw).__name__}")
    return AdapterConfig.from_json(raw, where)


def _weights_file(directory: Path) -> Path:
    weights = directory / WEIGHTS_FILE
    if weights.exists() or weights.is_symlink():  # whatever it is: the open says if it may be read
        return weights
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterPathError(f"{directory} holds only pickle weights {pickles}: refused, because unpickling can "
                               "run arbitrary code; convert to adapter_model.safetensors (save_pretrained with "
                               "safe_serialization=True)")
    raise AdapterFormatError(f"{weights} is missing; save the adapter with safe_serialization=True")


def _header_bytes(f: OpenFile, weights: Path) -> int:
    """8 + the safetensors header's length, if it fits the file (else the file is not safetensors)."""
    head = os.pread(f.fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= f.identity.size - 8:
        raise AdapterFormatError(f"{weights} is not a readable safetensors file (its header length {n} does not "
                                 f"fit its {f.identity.size} bytes); it may be truncated or corrupt: re-copy or "
                                 "re-save it")
    return 8 + n


def _read_header(opened: Path, weights: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (safetensors dtype, shape) of the file at ``opened``, named ``weights`` in errors, without reading
    tensor data. Truncation is caught here."""
    try:
        with safe_open(str(opened), framework="pt") as f:
            header = {}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                sl = f.get_slice(key)
                header[key] = (sl.get_dtype(), tuple(sl.get_shape()))
    except Exception as e:  # safetensors raises its own SafetensorError / OSError kinds
        raise AdapterFormatError(f"{weights} is not a readable safetensors file ({e}); it may be truncated or "
                                 "corrupt: re-copy or re-save it") from e
    return header


def _validate(header: dict[str, tuple[str, tuple[int, ...]]], config: AdapterConfig, shape: ModelShape,
              max_rank: int, weights: Path) -> tuple[LoraModule, ...]:
    found: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, (dtype, dims) in header.items():
        m = KEY_RE.match(key)
        if m is None:
            raise AdapterFormatError(f"{weights}: unexpected tensor {key!r}; only PEFT LoRA keys like "
                                     f"{peft_key(0, 'q_proj', 'A')!r} are served")
        layer, module = int(m["layer"]), m["module"]
        if module not in MODULES or MODULES[module][0] != m["block"]:
            raise AdapterFormatError(f"{weights}: {key!r} targets module {module!r}, which {shape.name} lacks; "
                                     f"supported modules: {list(MODULES)}")
        if layer >= shape.num_layers:
            raise AdapterFormatError(f"{weights}: {key!r} is for layer {layer}, but {shape.name} has "
                                     f"{shape.num_layers} layers; is this adapter for another model?")
        if dtype not in FLOAT_DTYPES:
            raise AdapterFormatError(f"{weights}: {key!r} has dtype {dtype}; LoRA weights must be F16, BF16 or F32")
        found.setdefault((layer, module), {})[m["ab"]] = dims
    if not found:
        raise AdapterFormatError(f"{weights} holds no LoRA tensors")
    return tuple(_check_module(layer, module, ab, config, shape, max_rank, weights)
                 for (layer, module), ab in sorted(found.items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))))


def _order(module: str) -> int:
    return list(MODULES).index(module)


def _check_module(layer: int, module: str, ab: dict[str, tuple[int, ...]], config: AdapterConfig,
                  shape: ModelShape, max_rank: int, weights: Path) -> LoraModule:
    where = f"{weights}: layer {layer} {module}"
    for missing in sorted({"A", "B"} - set(ab)):  # report the first missing one
        raise AdapterFormatError(f"{where} has no lora_{missing} tensor ({peft_key(layer, module, missing)!r}); "
                                 "every adapted module needs both lora_A and lora_B")
    if not config.targets(module, layer):
        raise AdapterFormatError(f"{where} has tensors but target_modules={config.target_modules!r} excludes it; "
                                 "the config and the weights disagree")
    rank, alpha = config.rank_alpha(layer, module)
    d_in, d_out = shape.dims(module)
    for label, got, want in (("lora_A", ab["A"], (rank, d_in)), ("lora_B", ab["B"], (d_out, rank))):
        if got != want:
            raise AdapterFormatError(f"{where} {label} has shape {list(got)}, expected {list(want)} "
                                     f"(rank {rank} from the config, {shape.name} sizes)")
    if rank > max_rank:
        raise AdapterFormatError(f"{where} has rank {rank}, above the configured maximum {max_rank}; "
                                 "raise --max-rank (slots grow with it) or use a lower-rank adapter")
    return LoraModule(layer, module, rank, config.scaling(rank, alpha))


def content_version(directory: Path) -> str:
    """A short hash of adapter_config.json and the weights: the adapter's version (as ``read_adapter`` finds it,
    confined to the directory)."""
    roots = AdapterRoots((directory,))
    digest = hashlib.blake2b(_read_config_bytes(roots, directory), digest_size=8)
    weights = directory / WEIGHTS_FILE
    with open_adapter_file(roots, weights, f"{weights} is missing") as f:
        digest_weights(f.fd, f.identity, weights, digest, 0)
    return digest.hexdigest()
