"""PEFT LoRA adapters on disk: ``adapter_config.json`` + ``adapter_model.safetensors`` (lifecycle step 5).

Reading an adapter validates it completely from the config and the safetensors header: every tensor's
key, dtype and shape against the model shape, ranks against the configured maximum. Each file is opened
once, confined to the adapter roots and refused unless a regular file (``lora_cache.adapters.files``), and read
once: the version is a hash of exactly those bytes, and the spec carries what every later read checks
(the file's identity, CRCs of its header and blocks), so a read never returns other bytes under it.

A version is hashed once (lifecycle step 0): the process that hashed it hands the others a ``KnownVersion``,
and ``read_adapter(..., known=)`` takes it without reading the weights when its own open proves the file is the
one hashed: the same machine (boot), the same real path and identity (device, inode, size, mtime, ctime), not
racy (changed at least ``RACY_NS`` before it was hashed, so any later write shows in stat), and the same config
bytes and header. Anything else (another node's copy, a changed file) is hashed again, as before.

The safetensors header itself (its length, its JSON, the format's own checks) is ``header.py``'s; what it
must hold for a PEFT adapter (keys, modules, shapes against the model) is checked here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from lora_cache.adapters import patterns
from lora_cache.adapters.device_source import DeviceSource
from lora_cache.adapters.files import (
    HOST,
    MAX_CONFIG_BYTES,
    RACY_NS,
    BlockCrcs,
    OpenFile,
    WeightsSource,
    digest_weights,
    header_matches,
    identity_version,
    open_adapter_file,
    read_exact,
    settled_at,
    unchanged_since_open,
)
from lora_cache.adapters.header import header_size, read_header, show
from lora_cache.adapters.header import parse_tensors as parse_tensors  # re-exported: workers/reader.py's import
from lora_cache.adapters.objects import StoreSource, StoreUrl
from lora_cache.adapters.roots import PICKLE_SUFFIXES, AdapterRoots
from lora_cache.adapters.shapes import MODULES, ModelShape
from lora_cache.errors import AdapterChangedError, AdapterFormatError, AdapterPathError, UnsupportedAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_RE = re.compile(  # ASCII: a Unicode digit is no layer number
    r"base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?P<adapter>\.[\w-]+)?\.weight", re.ASCII)
MAX_LAYER_DIGITS = 6
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
    def from_json(cls, raw: dict[str, Any], where: Path | StoreUrl) -> AdapterConfig:
        """The served fields of a parsed adapter_config.json, each checked: a bad one is an ``AdapterFormatError``
        naming the field, its value (clipped) and the fix. Patterns are parsed here, matched at validation."""
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise UnsupportedAdapterError(f"{where}: peft_type is {show(peft_type)}; only LORA adapters are served")
        if raw.get("use_dora"):
            raise UnsupportedAdapterError(f"{where}: use_dora is true; DoRA adapters are not supported "
                                          "(their magnitude vectors need the base weight); merge or retrain as LoRA")
        if raw.get("modules_to_save"):
            raise UnsupportedAdapterError(f"{where}: modules_to_save={show(raw['modules_to_save'])} is not "
                                          "supported (fully fine-tuned modules are not LoRA); save the adapter "
                                          "without them")
        base = raw.get("base_model_name_or_path")
        if base is not None and not (isinstance(base, str) and len(base) <= MAX_NAME_CHARS):
            raise AdapterFormatError(f"{where}: 'base_model_name_or_path' must be a string of at most "
                                     f"{MAX_NAME_CHARS} characters (the base model's name or path), got {show(base)}")
        return cls(
            r=_rank(raw.get("r"), where, "'r'"),
            lora_alpha=_positive(raw.get("lora_alpha", 8), where, "'lora_alpha'"),  # PEFT's default is 8
            target_modules=_targets(raw.get("target_modules"), where),
            use_rslora=_flag(raw, "use_rslora", where),
            rank_pattern=_pattern(raw.get("rank_pattern"), where, "rank_pattern", _rank),
            alpha_pattern=_pattern(raw.get("alpha_pattern"), where, "alpha_pattern", _positive),
            fan_in_fan_out=_flag(raw, "fan_in_fan_out", where),
            base_model=base,
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
        path = module_path(layer, module)
        if isinstance(self.target_modules, str):  # PEFT: re.fullmatch, here in bounded time (patterns.py)
            return patterns.compiled((self.target_modules,), patterns.FULL).first(path) is not None
        return any(path == t or path.endswith("." + t) for t in self.target_modules)  # a name or a dotted suffix


MAX_RANK_VALUE = 1 << 16  # no LoRA rank is larger than a model's hidden size
MAX_TARGETS = 4096  # names in a target_modules list
MAX_NAME_CHARS = 4096  # a target module name, a base model's name or path


def _rank(value: Any, where: Path | StoreUrl, field: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_RANK_VALUE:
        raise AdapterFormatError(f"{where}: {field} must be a positive integer (a LoRA rank, at most "
                                 f"{MAX_RANK_VALUE}), got {show(value)}; write it as an integer such as 16")
    return value


def _positive(value: Any, where: Path | StoreUrl, field: str) -> float:
    number = float(value) if type(value) in (int, float) and abs(value) < 1e300 else math.nan
    if not (math.isfinite(number) and number > 0):
        raise AdapterFormatError(f"{where}: {field} must be a finite positive number, got {show(value)}; PEFT "
                                 "writes lora_alpha as a number such as 16 or 32")
    return number


def _flag(raw: dict[str, Any], field: str, where: Path | StoreUrl) -> bool:
    value = raw.get(field)
    if value is not None and type(value) is not bool:
        raise AdapterFormatError(f"{where}: {field!r} must be true or false (a JSON boolean), got {show(value)}; "
                                 "a string such as \"false\" would read as true")
    return bool(value)


def _targets(targets: Any, where: Path | StoreUrl) -> tuple[str, ...] | str:
    if isinstance(targets, str) and targets:
        try:
            patterns.compiled((targets,), patterns.FULL)
        except patterns.PatternError as e:
            raise AdapterFormatError(f"{where}: 'target_modules' regex {e}") from None
        return targets
    if isinstance(targets, list) and targets and len(targets) <= MAX_TARGETS and all(
            isinstance(t, str) and 0 < len(t) <= MAX_NAME_CHARS for t in targets):
        return tuple(sorted(set(targets)))
    raise AdapterFormatError(f"{where}: 'target_modules' must be a non-empty list or regex: a regex string, or a "
                             f"list of at most {MAX_TARGETS} module names (strings such as \"q_proj\"), got "
                             f"{show(targets)}")


def _pattern(raw: Any, where: Path | StoreUrl, name: str, check: Any) -> tuple[tuple[str, Any], ...]:
    """A rank_pattern / alpha_pattern: module pattern -> a value ``check`` accepts, the keys parsed as PEFT
    matches them (``patterns.PeftKeys``)."""
    if raw in (None, {}):
        return ()
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{where}: {name!r} must map module patterns to positive numbers, got {show(raw)}")
    out = tuple((key, check(value, where, f"{name}[{show(key)}]")) for key, value in raw.items())
    try:
        patterns.peft_keys(tuple(k for k, _ in out))
    except patterns.PatternError as e:
        raise AdapterFormatError(f"{where}: {name!r} {e}; its keys are regexes PEFT matches against the end of "
                                 "each module's path") from None
    return out


def _match(pattern: tuple[tuple[str, Any], ...], path: str, default: Any) -> Any:
    if not pattern:
        return default
    at = patterns.peft_keys(tuple(k for k, _ in pattern)).first(path)  # PEFT: the first key that matches wins
    return default if at is None else pattern[at][1]


class LoraModule(NamedTuple):
    """One adapted module of one layer: its rank, scaling and the two keys in the file."""

    layer: int
    module: str
    rank: int
    scaling: float


class KnownVersion(NamedTuple):
    """A version as the process that hashed it established it: what lets another process on the same machine
    take the same file under it without reading the weights (``read_adapter(..., known=)``)."""

    version: str
    config_digest: str  # blake2b-8 of adapter_config.json's bytes, hex
    host: str  # the boot of the machine that hashed it (``files.HOST``); "" proves nothing
    source: WeightsSource | StoreSource | DeviceSource  # the weights file as hashed (real path, identity, header
    # and block CRCs), the store object as registered (ETag, size, header CRC: ``objects.StoreSource``), or a
    # trainer's device image before its node copy (``device_source``)
    meta: bytes = b""  # a store or device version's config and safetensors header as registered
    # (``objects.pack_meta``): a rank builds the spec from them without asking the store; b"" otherwise (the rank
    # reads them itself)


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: where it is, what it adapts, its dtype and content version."""

    name: str
    path: Path | StoreUrl  # the adapter directory (resolved, under a root), or its prefix in an object store
    config: AdapterConfig
    modules: tuple[LoraModule, ...]  # sorted by (layer, module order)
    dtype: str  # torch dtype name of the tensors in the file
    version: str
    file_bytes: int
    source: WeightsSource | None = None  # what reads check; None for specs not read from disk (simulators)
    config_digest: str = ""  # blake2b-8 of the config's bytes (hex); "" for specs not read from disk
    store: StoreSource | None = None  # the weights object, for an adapter in an object store (``source`` is None
    # until the disk tier holds a proven copy: ``workers.staging.disk_tier``)
    store_meta: bytes = b""  # the registering process's ``KnownVersion.meta`` (compressed config and header)
    # for the ranks; a rank's own spec keeps none; a device-only version's too (``device_source``)
    device: DeviceSource | None = None  # a version pushed from a trainer's device buffer, until its node copy lands

    @property
    def device_only(self) -> bool:
        """Held only in a trainer's device buffer (and the slots filled from it): no file to read yet."""
        return self.device is not None and self.source is None

    @property
    def weights(self) -> Path | StoreUrl:
        return self.path / WEIGHTS_FILE

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def known(self) -> KnownVersion | None:
        """What another process needs to take this version without hashing (None: not read from disk)."""
        if self.store is not None:
            return KnownVersion(self.version, self.config_digest, "", self.store, self.store_meta)
        if self.device is not None and self.source is None:
            return KnownVersion(self.version, self.config_digest, "", self.device, self.store_meta)
        if self.source is None:
            return None
        return KnownVersion(self.version, self.config_digest, HOST, self.source)


def read_adapter(name: str, directory: Path, shape: ModelShape, max_rank: int,
                 roots: AdapterRoots | None = None, known: KnownVersion | None = None,
                 identity: bool = False, sealed: bool = False) -> AdapterSpec:
    """Validate a PEFT adapter directory against ``shape`` from its config and safetensors header.

    Its files must resolve under ``roots`` (by default the directory itself). ``known``: the version another
    process established, taken without reading the weights if this open proves it is the same file (``proves``);
    otherwise, with ``identity`` and a settled file (its last change ``RACY_NS`` or more ago), the version comes
    from the file's identity, config and header (``files.identity_version``: the weights are not read, the
    first read pins their content); else the weights are hashed here. Either way the spec has whatever version
    this process found (the caller compares). ``sealed``: the file is written once, whole, and never again (the
    push area's, ``pushed.PushArea``): no later write can share its timestamp tick, so it is not racy however
    recently it was written (its hashed version is proven by its identity at once, on every rank)."""
    if not directory.is_dir():
        raise AdapterFormatError(f"adapter directory {directory} does not exist; check the path")
    roots = roots or AdapterRoots((directory,))
    config_bytes = _read_config_bytes(roots, directory)
    config = parse_config(config_bytes, directory / CONFIG_FILE)
    config_digest = hashlib.blake2b(config_bytes, digest_size=8).hexdigest()
    weights = _weights_file(directory)
    registered_ns = time.time_ns()  # before the open: the earliest moment, for the racy check
    with open_adapter_file(roots, weights, f"{weights} is missing; save the adapter with safe_serialization=True") as f:
        header_bytes = header_size(f, weights)
        if known is not None and isinstance(known.source, WeightsSource) and proves(known, f, header_bytes,
                                                                                    config_digest):
            source = known.source  # the same bytes as hashed there: nothing more to read
        elif identity and settled_at(f.identity, registered_ns) and not _hashed_here(known, f):
            # stat shows any later write: no bytes read (a file last versioned by its content is hashed again, so
            # that unchanged bytes keep their version: a racy registration read again once settled, a restore)
            head = os.pread(f.fd, header_bytes, 0)
            source = WeightsSource(str(f.real), identity_version(f.real, f.identity, config_bytes, head), f.identity,
                                   header_bytes, zlib.crc32(head), BlockCrcs(b""), registered_ns)
        else:
            version, header_crc, block_crcs = digest_weights(f.fd, f.identity, weights, config_bytes, header_bytes)
            unchanged_since_open(f.fd, weights, f.identity)  # the bytes hashed are the file's, as opened
            if sealed:  # its racy window is over by construction (the docstring): registered as if after it
                registered_ns = max(registered_ns, f.identity.ctime_ns + RACY_NS)
            source = WeightsSource(str(f.real), version, f.identity, header_bytes, header_crc, block_crcs,
                                   registered_ns)
        header = read_header(f.fd, header_bytes, f.identity.size, weights)  # the file this fd holds, not the path's
        unchanged_since_open(f.fd, weights, f.identity)
        if not header_matches(f.fd, header_bytes, source.header_crc):  # validated another header than the one hashed
            raise AdapterChangedError(f"{weights} changed while it was being registered (its header); wait until "
                                      "it is written completely and register it again")
    return built_spec(name, directory, config, header, shape, max_rank, source.version, f.identity.size, source,
                      config_digest)


def _hashed_here(known: KnownVersion | None, f: OpenFile) -> bool:
    """Whether ``known`` is a content version (every block hashed) of this very path: its bytes, if unchanged,
    must keep that version rather than take an identity one."""
    return (known is not None and isinstance(known.source, WeightsSource) and known.source.path == str(f.real)
            and known.source.pinned)


def built_spec(name: str, path: Path | StoreUrl, config: AdapterConfig,
               header: dict[str, tuple[str, tuple[int, ...]]], shape: ModelShape, max_rank: int, version: str,
               size: int, source: WeightsSource | None, config_digest: str,
               store: StoreSource | None = None) -> AdapterSpec:
    """The spec of an adapter whose config and header were read (from disk, or from an object store): its
    modules validated against ``shape`` and ``max_rank``, one dtype for all its tensors."""
    weights = path / WEIGHTS_FILE
    modules = _validate(header, config, shape, max_rank, weights)
    dtypes = {dtype for dtype, _ in header.values()}
    if len(dtypes) != 1:
        raise AdapterFormatError(f"{weights}: tensors mix dtypes {sorted(dtypes)}; save the adapter in one dtype")
    return AdapterSpec(name, path, _interned(config), _interned(modules), FLOAT_DTYPES[dtypes.pop()], version,
                       size, source, config_digest, store)


def proves(known: KnownVersion, f: OpenFile, header_bytes: int, config_digest: str) -> bool:
    """Whether ``f`` (as this process opened it) is the very file ``known`` hashed, so its bytes are the ones
    hashed: the same machine's boot, real path and identity, settled before it was hashed (a write after the
    hash must have changed the identity), and the same config bytes and safetensors header."""
    source = known.source
    if not isinstance(source, WeightsSource):  # a store version: proven by the store (If-Match), not a file
        return False
    return (bool(known.host) and known.host == HOST and source.path == str(f.real) and source.identity == f.identity
            and not source.racy and known.config_digest == config_digest and source.header_bytes == header_bytes
            and header_matches(f.fd, header_bytes, source.header_crc))


_INTERNED: dict[Any, Any] = {}  # equal configs and module tables shared by every spec (an 8B table: ~18 KiB)
MAX_INTERNED = 4096  # distinct ones kept; beyond, each spec keeps its own


def _interned(value: Any) -> Any:
    shared = _INTERNED.get(value)
    if shared is not None:
        return shared
    if len(_INTERNED) < MAX_INTERNED:
        _INTERNED[value] = value
    return value


def config_digest(roots: AdapterRoots, directory: Path) -> str:
    """blake2b-8 (hex) of the adapter's config bytes, as ``KnownVersion.config_digest`` has it."""
    return hashlib.blake2b(_read_config_bytes(roots, directory), digest_size=8).hexdigest()


def _read_config_bytes(roots: AdapterRoots, directory: Path) -> bytes:
    where = directory / CONFIG_FILE
    with open_adapter_file(roots, where, f"{where} is missing; a PEFT adapter directory holds adapter_config.json "
                             "(written by save_pretrained or `lora-cache make-adapters`)") as f:
        data = read_exact(f.fd, f.identity, where, MAX_CONFIG_BYTES)
        unchanged_since_open(f.fd, where, f.identity)
    return data


def parse_config(data: bytes, where: Path | StoreUrl) -> AdapterConfig:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a 5,000-digit number, nesting too deep
        raise AdapterFormatError(f"{where} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); re-save the "
                                 "adapter (save_pretrained writes it)") from e
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


_VALIDATED: dict[tuple[Any, ...], tuple[LoraModule, ...]] = {}  # alike adapters (shape, rank, targets)
MAX_VALIDATED = 256


def _validate(header: dict[str, tuple[str, tuple[int, ...]]], config: AdapterConfig, shape: ModelShape,
              max_rank: int, weights: Path | StoreUrl) -> tuple[LoraModule, ...]:
    """``_check_header``, remembered for headers and configs seen before (only those that passed: an error
    names its file). A thousand adapters of one shape and rank are validated once."""
    key = (tuple(sorted(header.items())), config, shape, max_rank)
    modules = _VALIDATED.get(key)
    if modules is None:
        modules = _check_header(header, config, shape, max_rank, weights)
        if len(_VALIDATED) >= MAX_VALIDATED:
            _VALIDATED.clear()  # a new mix of shapes: start over (bounded, and cheap to fill again)
        _VALIDATED[key] = modules
    return modules


def _check_header(header: dict[str, tuple[str, tuple[int, ...]]], config: AdapterConfig, shape: ModelShape,
                  max_rank: int, weights: Path | StoreUrl) -> tuple[LoraModule, ...]:
    found: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, (dtype, dims) in header.items():
        m = KEY_RE.fullmatch(key)
        if m is None:
            raise AdapterFormatError(f"{weights}: unexpected tensor {show(key)}; only PEFT LoRA keys like "
                                     f"{peft_key(0, 'q_proj', 'A')!r} are served")
        if m["adapter"]:
            raise AdapterFormatError(f"{weights}: tensor {show(key)} carries an adapter name ({m['adapter'][1:]!r}) "
                                     f"before '.weight'; PEFT's save_pretrained leaves it out and reads go by "
                                     f"the saved keys: re-save with save_pretrained, or rename the keys without it")
        if len(m["layer"]) > MAX_LAYER_DIGITS or m["layer"] != str(int(m["layer"])):
            raise AdapterFormatError(f"{weights}: tensor {show(key)} has layer number {show(m['layer'])}, not "
                                     "PEFT's form (no leading zeros); re-save the adapter with save_pretrained")
        layer, module = int(m["layer"]), m["module"]
        if module not in MODULES or MODULES[module][0] != m["block"]:
            raise AdapterFormatError(f"{weights}: {show(key)} targets module {show(module)}, which {shape.name} "
                                     f"lacks; supported modules: {list(MODULES)}")
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
                  shape: ModelShape, max_rank: int, weights: Path | StoreUrl) -> LoraModule:
    where = f"{weights}: layer {layer} {module}"
    for missing in sorted({"A", "B"} - set(ab)):  # report the first missing one
        raise AdapterFormatError(f"{where} has no lora_{missing} tensor ({peft_key(layer, module, missing)!r}); "
                                 "every adapted module needs both lora_A and lora_B")
    try:
        targeted = config.targets(module, layer)
        rank, alpha = config.rank_alpha(layer, module)
    except patterns.PatternError as e:  # a pattern that costs too much, found as the paths are matched
        raise AdapterFormatError(f"{weights}: a pattern of target_modules, rank_pattern or alpha_pattern {e}") from None
    if not targeted:
        raise AdapterFormatError(f"{where} has tensors but target_modules={show(config.target_modules)} excludes "
                                 "it; the config and the weights disagree")
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
    config = _read_config_bytes(roots, directory)
    weights = directory / WEIGHTS_FILE
    with open_adapter_file(roots, weights, f"{weights} is missing") as f:
        return digest_weights(f.fd, f.identity, weights, config, 0)[0]
