"""The adapter catalog: names -> validated, versioned adapters under the configured roots."""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lora_cache.adapters.ahead import Ahead
from lora_cache.adapters.device_source import DeviceSource
from lora_cache.adapters.device_versions import device_spec
from lora_cache.adapters.files import HOST, FileIdentity, WeightsSource
from lora_cache.adapters.objects import StoreUrl, is_store_url
from lora_cache.adapters.peft import WEIGHTS_FILE, AdapterSpec, KnownVersion, config_digest, read_adapter
from lora_cache.adapters.pushed import default_push_dir
from lora_cache.adapters.retirement import Retirement
from lora_cache.adapters.roots import AdapterRoots
from lora_cache.adapters.shapes import ModelShape, resolve_model
from lora_cache.errors import (
    AdapterChangedError,
    AdapterFormatError,
    AdapterPathError,
    ConfigError,
    LoraCacheError,
    NotFoundError,
)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class CatalogConfig:
    """Where adapters may come from and what they must fit."""

    adapter_roots: tuple[str, ...] = field(default=(), metadata={
        "path": True, "help": "directories adapters may be read from, and object-store prefixes "
                              "(s3://BUCKET/PREFIX) adapters may be registered from"})
    model: str = field(default="", metadata={"path": "name_or_file", "help": (
        "named model shape or path to its config.json (empty: the adapters' base_model_name_or_path)")})
    max_rank: int = field(default=64, metadata={"help": "largest LoRA rank served (sizes the GPU slots)"})
    keep_versions: int = field(default=4, metadata={
        "help": "older versions of a re-registered adapter kept loadable (from their own files), the newest "
                "first; an older one still in use (held by a rank: a request admitted on it) stays loadable "
                "past this bound and retires once no rank holds it"})
    local_versions: str = field(default="identity", metadata={
        "help": "how a local adapter file's version is established: 'identity' (from its stat identity, config "
                "and header, no weights read at registration; the first read on the machine pins its content; "
                "only ranks on the registering machine can serve it) or 'content' (a hash of every byte at "
                "registration; for per-node copies or a file system shared between nodes)"})
    store_timeout_s: float = field(default=20.0, metadata={
        "help": "seconds an object-store request may go unanswered, its retries included, before it fails "
                "(registration and fetches; "
                "endpoint, region and credentials come from AWS_* variables and ~/.aws)"})
    store_reads: int = field(default=32, metadata={
        "help": "object-store requests a registration keeps in flight (each adapter: its config, then its weights' "
                "header); a throttling store (SlowDown, 503) is backed off from, per client"})
    resolve_s: float = field(default=10.0, metadata={
        "help": "a request naming an unregistered adapter that lies under adapter_roots registers it on demand "
                "within this many seconds (one lookup per name however many requests wait); 0: never, "
                "unregistered names are refused"})
    resolve_parallel: int = field(default=8, metadata={
        "help": "names resolved on demand at once; a request for one more is refused (over capacity)"})
    resolve_bytes: int = field(default=1 << 40, metadata={
        "help": "weight bytes the adapters registered on demand may add up to; past it, on-demand registration "
                "is refused (register explicitly, or raise this)"})
    push_dir: str = field(default="", metadata={"path": True, "help": (
        "where versions pushed from a trainer's memory are kept, in the PEFT layout, one directory per service, "
        "adapter and version tag (empty: /dev/shm/lora-cache-pushed-UID, the node's shared memory: no disk); "
        "every process of the service takes adapters from under it as from an adapter root")})
    push_bytes: int = field(default=8 << 30, metadata={
        "help": "bytes the versions pushed to this service may take in push_dir (the current and keep_versions "
                "older versions of each pushed adapter); a push past it is refused"})
    push_land_s: float = field(default=60.0, metadata={
        "help": "seconds a version pushed from a trainer's GPU buffer may serve before its node copy lands; one not "
                "landed by then (the trainer died) is given up, and the version before it is current again"})
    resolve_miss_s: float = field(default=5.0, metadata={
        "help": "seconds a name found under no root is answered 'not found' without asking the roots again"})

    def __post_init__(self) -> None:
        if not 1 <= self.max_rank <= 1024:
            raise ConfigError(f"max_rank must be in 1..1024, got {self.max_rank}; typical LoRA ranks are 8-128")
        if not 0 <= self.keep_versions <= 64:
            raise ConfigError(f"keep_versions must be in 0..64, got {self.keep_versions}; 0 keeps only the "
                              "current version of each adapter")
        if self.local_versions not in ("identity", "content"):
            raise ConfigError(f"local_versions must be 'identity' or 'content', got {self.local_versions!r}")
        if not 1 <= self.store_reads <= 64:
            raise ConfigError(f"store_reads must be in 1..64, got {self.store_reads}; 32 suits most stores, 1 reads "
                              "one adapter at a time")
        if not 0.1 <= self.store_timeout_s <= 600:
            raise ConfigError(f"store_timeout_s must be in 0.1..600 seconds, got {self.store_timeout_s}")
        if not (0 <= self.resolve_s <= 600 and 1 <= self.resolve_parallel <= 256 and self.resolve_bytes >= 0
                and 0 <= self.resolve_miss_s <= 3600):
            raise ConfigError(f"resolve_s {self.resolve_s} must be in 0..600 (0: off), resolve_parallel "
                              f"{self.resolve_parallel} in 1..256, resolve_bytes {self.resolve_bytes} >= 0, "
                              f"resolve_miss_s {self.resolve_miss_s} in 0..3600")
        if not 1 <= self.push_land_s <= 3600:
            raise ConfigError(f"push_land_s must be in 1..3600 seconds, got {self.push_land_s}; a device push's node "
                              "copy lands within a second of its push")
        if self.push_bytes < 0:
            raise ConfigError(f"push_bytes must be >= 0, got {self.push_bytes}; 0 refuses every push")
        if is_store_url(self.push_dir):
            raise ConfigError(f"push_dir {self.push_dir!r} must be a local directory (pushed versions are kept in "
                              "node memory), not an object-store URL")
        for root in self.adapter_roots:
            if is_store_url(root):
                StoreUrl.parse(root)  # a malformed URL fails here, before anything starts

    def shape(self) -> ModelShape:
        return resolve_model(self.model)

    def push_root(self) -> Path:
        """The directory pushed versions are kept under (``lora_cache.adapters.pushed``)."""
        return Path(self.push_dir).expanduser() if self.push_dir else default_push_dir()


MAX_PARSED = 256  # parsed specs of lazily registered versions a catalog keeps (LRU); beyond, parsed again on use


class Registered:
    """A version registered on another process's word (a rank taking the controller's registration), not yet
    parsed here: its name, where it is, its version and the ``KnownVersion`` that proves it. ``AdapterCatalog.get``
    builds (and checks) the spec from it when the version is first loaded or staged."""

    __slots__ = ("known", "name", "path")

    def __init__(self, name: str, path: Path | StoreUrl, known: KnownVersion) -> None:
        self.name, self.path, self.known = name, path, known

    @property
    def version(self) -> str:
        return self.known.version

    @property
    def weights(self) -> Path | StoreUrl:
        return self.path / WEIGHTS_FILE


def check_carried(name: str, spec: AdapterSpec, known: KnownVersion | None) -> AdapterSpec:
    """``spec`` (this process's read) if it is the version ``known`` carried (the controller's); else
    ``AdapterChangedError``: this process would serve other bytes under that version."""
    if known is None or spec.version == known.version:
        return spec
    if isinstance(known.source, WeightsSource) and not known.source.racy and not known.source.pinned:
        raise AdapterChangedError(
            f"adapter {name!r}: the controller registered version {known.version} from the identity of "
            f"{known.source.path} on its machine (local_versions 'identity'), and this rank cannot prove its "
            f"file is that one ({'another machine' if known.host != HOST else 'the file changed since'}): "
            "register the adapter again, or for copies on several machines (or a file system shared between "
            "them) run the controller with --local-versions content, or serve the adapters from an object store")
    raise AdapterChangedError(
        f"adapter {name!r}: {spec.weights} hashes to version {spec.version} on this rank, but the controller "
        f"registered version {known.version}: the file changed since, or this node's copy differs; this "
        "rank refuses it (it would serve other bytes under that version): make every node's copy the "
        "same and register the adapter again")


def _unknown(name: str) -> str:
    return f"adapter {name!r} is not registered; register it first (lora-cache register NAME PATH)"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise AdapterFormatError(f"adapter name {name!r} is invalid: use 1-128 characters of letters, digits, "
                                 "'.', '_' or '-', starting with a letter or digit")
    return name


class AdapterCatalog:
    """Registered adapters by name. Thread-safe; re-registering new content yields a new version.

    Each name has one current version (what new work gets) and older ones that stay loadable by exact
    version, for requests admitted on them before a re-registration (invariant 1: a request keeps its
    version to the end): the ``keep_versions`` newest older ones, and past that bound those still in use
    (``use``: the versions of a name a user holds, e.g. a rank's slots or the fleet's residency), each
    retired once it is no longer (``trim``, called by that user when its use ends). An older version is kept
    only if it lives in other files than the new one: a re-registration from the same directory means its
    files were rewritten, and their old bytes are gone. ``generation`` grows with every change, so callers
    can cache what they derive from the current versions."""

    def __init__(self, config: CatalogConfig, shape: ModelShape | None = None) -> None:
        self.config = config
        self.shape = shape or config.shape()
        local = tuple(Path(r) for r in config.adapter_roots if not is_store_url(r))
        self.store_roots = tuple(StoreUrl.parse(r) for r in config.adapter_roots if is_store_url(r))
        self.roots = AdapterRoots(local) if local or not self.store_roots else None  # None: store-only
        self.push_root = config.push_root().resolve()  # pushed versions' directories (``_pushed``), resolved once
        self._push_roots: AdapterRoots | None = None  # made (and the directory created) at the first pushed path
        self._lock = threading.Lock()  # protects _specs, _older and generation
        self._specs: dict[str, AdapterSpec | Registered] = {}  # name -> current version
        self._older: dict[str, OrderedDict[str, AdapterSpec | Registered]] = {}  # name -> version -> spec, oldest first
        self._parsed: OrderedDict[tuple[str, str], AdapterSpec] = OrderedDict()  # lazily registered, parsed (LRU)
        # name -> version -> spec registered ahead of its device push (``ahead.py``), oldest first, until made current
        self._ahead: dict[str, OrderedDict[str, AdapterSpec]] = {}
        self.ahead = Ahead(self)  # ``reserve`` / ``drop`` them
        self.parses = 0  # specs built from lazily registered versions (first load or stage, or after the LRU)
        self.generation = 0
        # older versions retired by use past keep_versions (``retirement.py``): ``use``/``unuse`` its users, ``trim``
        self.retirement = Retirement(self)
        self.use, self.unuse, self.trim = self.retirement.use, self.retirement.unuse, self.retirement.trim

    def register(self, name: str, path: str | Path, known: KnownVersion | None = None) -> AdapterSpec:
        """Validate the adapter at ``path`` (under a root) and make it the current version of ``name``."""
        spec = self.read(name, path, known)
        self.add(spec)
        return spec

    def read(self, name: str, path: str | Path, known: KnownVersion | None = None,
             carried: bool = False) -> AdapterSpec:
        """The adapter at ``path`` validated and versioned, the catalog unchanged (the expensive half of
        ``register``: it may hash the whole file; safe on any thread). ``known``: a version another process
        hashed, taken without reading the weights if this open proves it is the same file (``peft.proves``).
        ``carried``: a store version's config and header carried in ``known`` are taken without asking the
        store (a rank taking the controller's registration: ``store.read_store_adapter``)."""
        if is_store_url(path):
            from lora_cache.adapters.store import read_store_adapter  # deferred: boto3 only where a store is used

            return read_store_adapter(check_name(name), self.store_url(str(path)), self.shape, self.config.max_rank,
                                      self.config.store_timeout_s, known, carried)
        if known is not None and isinstance(known.source, DeviceSource):  # a device push's, before its node copy
            if self._pushed(path) is None:
                raise AdapterPathError(f"device push {name}@{known.source.tag}: {path} is not under the push root "
                                       f"{self.push_root}; a device version lands only in its service's push area")
            return device_spec(check_name(name), Path(os.path.realpath(path)), self.shape, self.config.max_rank,
                               known)
        pushed = self._pushed(path)
        roots = pushed or self._local()
        directory = roots.resolve(path)
        return read_adapter(check_name(name), directory, self.shape, self.config.max_rank, roots, known,
                            identity=self.config.local_versions == "identity" and pushed is None,
                            sealed=pushed is not None)

    def store_url(self, url: str) -> StoreUrl:
        """``url`` parsed, if it is under one of the store roots (the store's counterpart of ``AdapterRoots``)."""
        parsed = StoreUrl.parse(url)
        if not any(parsed.under(r) for r in self.store_roots):
            roots = ", ".join(map(str, self.store_roots)) or "none"
            raise AdapterPathError(f"{url} is outside the object-store adapter roots ({roots}); add its prefix to "
                                   "--adapter-roots (s3://BUCKET/PREFIX) or register it from under one")
        return parsed

    def _pushed(self, path: str | Path) -> AdapterRoots | None:
        """The push root's ``AdapterRoots`` if ``path`` lies under it (a pushed version: its content is hashed into
        its version, never taken from its identity), else None."""
        try:
            raw = Path(path).expanduser()
            if not raw.is_absolute() or not raw.resolve().is_relative_to(self.push_root):
                return None
            if self._push_roots is None:
                self.push_root.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._push_roots = AdapterRoots((self.push_root,))
            return self._push_roots
        except (OSError, ValueError):
            return None

    def _local(self) -> AdapterRoots:
        if self.roots is None:
            raise AdapterPathError("this catalog reads adapters only from an object store (its roots are "
                                   f"{', '.join(map(str, self.store_roots))}); register s3:// prefixes, or add a "
                                   "local directory to --adapter-roots")
        return self.roots

    def add_lazy(self, name: str, path: str | Path, known: KnownVersion | None) -> Registered | None:
        """Register ``name`` at ``known``'s version without parsing it (a rank taking the controller's
        registration): only its identity is kept until ``get`` first needs the spec, which is then read and
        checked as ``read`` + ``check_carried`` check it. None (nothing registered) where this process cannot
        prove cheaply that it would take the same version (a file on another machine, changed or racy since
        the controller read it, another config; no version carried): the caller reads it now instead."""
        if known is None:
            return None
        check_name(name)
        if isinstance(known.source, WeightsSource):
            source = known.source
            if not known.host or known.host != HOST or source.racy or is_store_url(path):
                return None
            roots = self._pushed(path) or self._local()
            directory = roots.resolve(path)
            try:
                same = FileIdentity.of(os.stat(source.path)) == source.identity and Path(
                    os.path.realpath(directory / WEIGHTS_FILE)) == Path(source.path)
                same = same and config_digest(roots, directory) == known.config_digest
            except (OSError, LoraCacheError):
                return None  # the eager read says why, as before
            if not same:
                return None
            where: Path | StoreUrl = directory
        elif known.meta and is_store_url(path):  # a store version carried with its config and header
            where = self.store_url(str(path))
        else:
            return None
        record = Registered(name, where, known)
        self.add(record)
        return record

    def add(self, spec: AdapterSpec | Registered) -> AdapterSpec | Registered:
        """Make ``spec`` (from ``read``) the current version of its name (the cheap half of ``register``)."""
        name = spec.name
        with self._lock:
            previous = self._specs.get(name)
            self._specs[name] = spec
            ahead = self._ahead.get(name)
            if ahead is not None and ahead.pop(spec.version, None) is not None and not ahead:
                del self._ahead[name]
            if previous is not None and previous.version != spec.version:
                self._older.setdefault(name, OrderedDict())[previous.version] = previous
            older = self._older.get(name)
            if older is not None:  # most names have no older version: no table for them
                older.pop(spec.version, None)
                for version in [v for v, s in older.items() if s.weights == spec.weights]:
                    del older[version]  # rewritten in place: that version's bytes are gone
                if not older:
                    del self._older[name]
            self.generation += 1
        self.trim(name)  # past the bound: the oldest ones no longer in use retire
        return spec

    def promote(self, spec: AdapterSpec) -> bool:
        """Put ``spec`` in the place of the version of its name with its id, current or older, changing no current
        version (a device version whose node copy landed: ``device_versions``); False if no version of that id is
        kept any more (retired, or the name unregistered)."""
        with self._lock:
            current = self._specs.get(spec.name)
            older: Mapping[str, AdapterSpec | Registered] = self._older.get(spec.name, {})
            if current is not None and current.version == spec.version:
                self._specs[spec.name] = spec
            elif spec.version in older:
                self._older[spec.name][spec.version] = spec
            elif spec.version in self._ahead.get(spec.name, {}):
                self._ahead[spec.name][spec.version] = spec
            else:
                return False
            self._parsed.pop((spec.name, spec.version), None)
            self.generation += 1
        return True

    def unregister(self, name: str) -> AdapterSpec | Registered:
        with self._lock:
            if name not in self._specs:
                raise NotFoundError(_unknown(name))
            self._older.pop(name, None)
            self._ahead.pop(name, None)
            for key in [k for k in self._parsed if k[0] == name]:
                del self._parsed[key]
            self.generation += 1
            return self._specs.pop(name)

    def _built(self, entry: AdapterSpec | Registered) -> AdapterSpec:
        """The spec of ``entry``: itself, or a lazily registered version's, read and checked against the version
        registered (``AdapterChangedError`` if this process's read finds another: nothing is kept then)."""
        if isinstance(entry, AdapterSpec):
            return entry
        key = (entry.name, entry.version)
        with self._lock:
            spec = self._parsed.get(key)
            if spec is not None:
                self._parsed.move_to_end(key)
                return spec
        where = entry.path if isinstance(entry.path, Path) else str(entry.path)
        spec = check_carried(entry.name, self.read(entry.name, where, entry.known, carried=True), entry.known)
        with self._lock:
            self.parses += 1
            self._parsed[key] = spec
            while len(self._parsed) > MAX_PARSED:
                self._parsed.popitem(last=False)
        return spec

    def parsed(self) -> list[tuple[str, str]]:
        """(name, version) of every spec this catalog holds parsed: those registered eagerly, and the lazily
        registered ones built so far (still in the LRU)."""
        with self._lock:
            eager = [(s.name, s.version) for s in self._specs.values() if isinstance(s, AdapterSpec)]
            eager += [(s.name, s.version) for o in self._older.values() for s in o.values()
                      if isinstance(s, AdapterSpec)]
            return sorted({*eager, *self._parsed})

    def current(self, name: str) -> str:
        """The current version of ``name`` (nothing parsed)."""
        with self._lock:
            spec = self._specs.get(name)
        if spec is None:
            raise NotFoundError(_unknown(name))
        return spec.version

    def get(self, name: str, version: str | None = None) -> AdapterSpec:
        """The current version of ``name``, or exactly ``version`` (current or kept)."""
        with self._lock:
            spec = self._specs.get(name)
            kept = self._older[name].get(version) if version is not None and name in self._older else None
            if kept is None and version is not None and name in self._ahead:
                kept = self._ahead[name].get(version)
        if spec is None:
            raise NotFoundError(_unknown(name))
        if version is None or version == spec.version:
            return self._built(spec)
        if kept is None:
            raise NotFoundError(f"adapter {name!r} is at version {spec.version}, not {version}; it was "
                                "re-registered with new content and that version's files are gone or no longer "
                                "kept (keep_versions): plan with the current version")
        return self._built(kept)

    def keep(self, spec: AdapterSpec | Registered) -> None:
        """Keep ``spec`` loadable as an older version of its name, behind those kept already (a restored
        catalog's); nothing if it is the current version or the name is not registered."""
        with self._lock:
            current = self._specs.get(spec.name)
            if current is None or current.version == spec.version or current.weights == spec.weights:
                return
            self._older.setdefault(spec.name, OrderedDict())[spec.version] = spec
            self.generation += 1
        self.trim(spec.name)

    def known(self, name: str) -> KnownVersion | None:
        """The current version of ``name`` as hashed here (None if not registered, or not read from disk)."""
        with self._lock:
            spec = self._specs.get(name)
        return None if spec is None else self._built(spec).known

    def entries(self) -> list[tuple[AdapterSpec, list[AdapterSpec]]]:
        """Every registered name's current version and the older ones kept (oldest first), by name."""
        with self._lock:
            found = [(self._specs[n], list(self._older.get(n, {}).values())) for n in sorted(self._specs)]
        return [(self._built(s), [self._built(o) for o in older]) for s, older in found]

    def entry(self, name: str) -> tuple[AdapterSpec, list[AdapterSpec]]:
        """The current version of ``name`` and the older ones kept, oldest first."""
        with self._lock:
            if name not in self._specs:
                raise NotFoundError(_unknown(name))
            spec, older = self._specs[name], list(self._older.get(name, {}).values())
        return self._built(spec), [self._built(o) for o in older]

    def paths(self, name: str) -> dict[str, Path]:
        """Where each version of ``name`` the catalog keeps lives: version -> directory, oldest first (local
        directories only; none if unknown)."""
        with self._lock:
            entries = [*self._older.get(name, {}).values(), self._specs[name]] if name in self._specs else []
        return {e.version: e.path for e in entries if isinstance(e.path, Path)}

    def versions(self, name: str) -> list[str]:
        """Loadable versions of ``name``, oldest first; the last is the current one."""
        with self._lock:
            if name not in self._specs:
                raise NotFoundError(_unknown(name))
            return [*self._older.get(name, {}), self._specs[name].version]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._specs)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._specs

    def __len__(self) -> int:
        with self._lock:
            return len(self._specs)

    def register_dir(self, parent: str | Path, known: Mapping[str, KnownVersion] | None = None) -> list[AdapterSpec]:
        """Register every adapter directory directly under ``parent`` by its directory name (``known``: versions
        another process hashed, by name, taken where this open proves the same file: ``register``)."""
        if is_store_url(parent):
            from lora_cache.adapters.store import list_adapters

            found = list_adapters(self.store_url(str(parent)), self.config.store_timeout_s)
            return [self.register(name, str(url)) for name, url in found]
        base = self._local().resolve(parent)
        known = known or {}
        return [self.register(d.name, d, known.get(d.name)) for d in sorted(base.iterdir())
                if (d / "adapter_config.json").is_file()]
