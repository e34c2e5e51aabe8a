"""Adapters pushed from a trainer's memory (lifecycle step 0; issue 44 item 2): checked, then kept in node memory.

A trainer (an RL or online fine-tuning loop) pushes a new version of adapter ``A`` from its own process: its
tensors and PEFT config, with a version tag of its own (a step number) or none (the content's hash). The
controller checks the push before anything is kept (``check_push``: the config and every tensor's name, shape,
dtype and rank against the model, as a registration checks a file, naming what is wrong), then writes it once
into the node's shared memory (``PushArea``: ``/dev/shm``, no disk) in the PEFT layout, and registers that
directory as any other version: its content hashed into the version, every rank taking it without hashing
again, and each rank reading only its own shard's slices from it (``workers.reads``). So a pushed version is
served, kept, proven and retired by the same machinery as a file's (docs/decisions.md, "Pushed versions live
in node memory").

A version's directory is ``ROOT/SERVICE/NAME/TAG`` (``SERVICE``: the controller's Ray namespace, so two
services never share or retire each other's pushes). It is written under a temporary name and renamed whole: a
push cut short leaves no half-written version, and the name's current version is the one before. The same tag
pushed again with the same bytes is the same version; with other bytes it is refused (a tag names one
content). ``retire`` removes the directories of versions the catalog no longer keeps; an open read of one
keeps its bytes until it closes (unlink semantics).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lora_cache.adapters.files import (
    BLOCK_BYTES,
    HOST,
    RACY_NS,
    BlockCrcs,
    FileIdentity,
    WeightsSource,
    block_digest,
    content_version_of,
)
from lora_cache.adapters.header import MAX_HEADER_BYTES, parse_header
from lora_cache.adapters.passes import PASS_BYTES, passes, task_bytes
from lora_cache.adapters.peft import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterSpec,
    KnownVersion,
    LoraModule,
    built_spec,
    parse_config,
)
from lora_cache.adapters.shapes import ModelShape
from lora_cache.errors import AdapterFormatError, CapacityError, ConfigError, ConflictError, LoraCacheError

ENV = "LORA_CACHE_PUSH_DIR"  # where pushed versions go, if set (tests give each run its own)
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TMP_PREFIX = ".push-"  # a version being written (renamed whole when complete)
STALE_WRITE_S = 600.0  # a version being written this long ago is a dead writer's (a 70B rank-64 one takes ~1 s)


def default_push_dir() -> Path:
    """``LORA_CACHE_PUSH_DIR`` if set, else one directory per user in shared memory (no disk writes)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"lora-cache-pushed-{os.getuid()}"


def check_tag(tag: object) -> str:
    """A version tag (a trainer's step, ``"step-8"``): 1-64 characters of letters, digits, ``.``, ``_``, ``-``."""
    if isinstance(tag, int) and not isinstance(tag, bool) and tag >= 0:
        tag = str(tag)
    if not isinstance(tag, str) or not TAG_RE.match(tag):
        raise ConfigError(f"push version tag {tag!r} is not valid: give 1-64 letters, digits, '.', '_' or '-' "
                          "starting with a letter or digit (a step number such as 8 or 'step-8'), or none for the "
                          "content's hash")
    return tag


def content_tag(config_bytes: bytes, weights: bytes | memoryview) -> str:
    """The tag of a push that names none: a hash of its config and weights (the same bytes, the same tag)."""
    return digest(config_bytes, weights).tag


class PushDigest(NamedTuple):
    """A push's content as registration would hash its file, taken from the push's bytes in memory (``digest``)."""

    version: str  # ``files.content_version_of``: ``peft.read_adapter``'s content version
    config_digest: str
    header_bytes: int
    header_crc: int
    block_crcs: BlockCrcs

    @property
    def tag(self) -> str:
        """The tag of a push that names none (``content_tag``): its content version."""
        return f"c{self.version}"

    def known(self, directory: Path) -> KnownVersion:
        """The version of the pushed directory as written (``PushArea.write``), for its registration to take
        without reading the weights back (``peft.proves``: the same file, identity, config and header, or they
        are hashed after all). Sealed: its racy window is over by construction, as ``read_adapter`` counts it."""
        weights = (directory / WEIGHTS_FILE).resolve()
        identity = FileIdentity.of(os.stat(weights))
        source = WeightsSource(str(weights), self.version, identity, self.header_bytes, self.header_crc,
                               self.block_crcs, max(time.time_ns(), identity.ctime_ns + RACY_NS))
        return KnownVersion(self.version, self.config_digest, HOST, source)


def digest(config_bytes: bytes, weights: bytes | memoryview) -> PushDigest:
    """The content version, header CRC and block CRCs of a push (checked by ``check_push``) from its bytes, as
    ``files.digest_weights`` makes them over the file, so the file need not be read back to register it: each
    block hashed and CRC'd once, the blocks spread over ``passes()`` threads (both free the GIL)."""
    view = memoryview(weights).cast("B")
    task = task_bytes(len(view), PASS_BYTES)
    spans = passes().map(lambda at: _span(view[at:at + task]), range(0, len(view), task))
    hashes, blocks = zip(*[block for span in spans for block in span]) if len(view) else ((), ())
    header_bytes = 8 + int.from_bytes(view[:8], "little")
    return PushDigest(content_version_of(config_bytes, len(view), hashes),
                      hashlib.blake2b(config_bytes, digest_size=8).hexdigest(), header_bytes,
                      zlib.crc32(view[:header_bytes]), BlockCrcs(blocks))


def write_spread(path: Path, data: bytes | memoryview) -> None:
    """A new file at ``path`` holding ``data``, copied in by ``passes()``' threads at once through a shared
    mapping (a ``write`` to one file is one thread's copy: tmpfs serializes writers of a file)."""
    src = np.frombuffer(data, dtype=np.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, src.nbytes)
        if not src.nbytes:
            return
        with mmap.mmap(fd, src.nbytes) as mapped:
            _copy_spread(np.frombuffer(mapped, dtype=np.uint8), src)  # no view of the mapping outlives the call
    finally:
        os.close(fd)


def _copy_spread(dst: np.ndarray, src: np.ndarray) -> None:
    list(passes().map(lambda at: np.copyto(dst[at:at + PASS_BYTES], src[at:at + PASS_BYTES]),
                      range(0, src.nbytes, PASS_BYTES)))


def _span(span: memoryview) -> list[tuple[bytes, int]]:
    """The hash and CRC of each block of ``span`` (whole blocks from a block's start, the last may be short)."""
    return [block_digest(span[at:at + BLOCK_BYTES]) for at in range(0, len(span), BLOCK_BYTES)]


def check_push(name: str, config_bytes: bytes, weights: bytes | memoryview, shape: ModelShape,
               max_rank: int) -> AdapterSpec:
    """The pushed adapter validated as a registration validates a file (config, then every tensor of the
    safetensors bytes against ``shape`` and ``max_rank``), before anything is written: AdapterFormatError
    naming what is wrong and the fix. The spec's path and version are placeholders (``<pushed>``)."""
    view = memoryview(weights).cast("B")
    n = int.from_bytes(view[:8], "little") if len(view) >= 8 else 0
    return check_head(name, config_bytes, bytes(view[:8 + min(n, MAX_HEADER_BYTES)]), len(view), shape, max_rank)


def check_head(name: str, config_bytes: bytes, head: bytes, size: int, shape: ModelShape,
               max_rank: int) -> AdapterSpec:
    """``check_push`` from the image's first bytes only (``head``: its 8-byte length and header) and its size
    ``size``: what a device push declares of the image in the trainer's buffer (``device_versions``)."""
    where = Path(f"<pushed {name}>")
    if size < 8 or len(head) < 8:
        raise AdapterFormatError(f"pushed weights of {name} are {size} bytes, not safetensors; push the "
                                 "tensors (the client serializes them) or safetensors.torch.save's bytes")
    n = int.from_bytes(head[:8], "little")
    if not 0 < n <= min(size - 8, MAX_HEADER_BYTES) or len(head) < 8 + n:
        raise AdapterFormatError(f"pushed weights of {name} are not safetensors (a header of {n} bytes in "
                                 f"{size}, {len(head)} given); push safetensors.torch.save's bytes")

    def unreadable(e: Exception) -> AdapterFormatError:
        return AdapterFormatError(f"pushed weights of {name} are not readable safetensors ({e}); push "
                                  "safetensors.torch.save's bytes")

    return head_spec(name, where, config_bytes, bytes(head[8:8 + n]), size, shape, max_rank, "<pushed>", "",
                     unreadable)


def head_spec(name: str, where: Path, config_bytes: bytes, header: bytes, size: int, shape: ModelShape,
              max_rank: int, version: str, config_digest: str,
              unreadable: Callable[[Exception], LoraCacheError]) -> AdapterSpec:
    """``built_spec`` of a config and a safetensors header (its JSON bytes) for an image of ``size`` bytes at
    ``where``, parsed and checked once per distinct (config, header, size, model, max rank): a trainer's pushes of
    an adapter declare the same ones each time, so the controller's check and registration of a device push, and
    each rank's registration, take the last result (``_HEAD_PARTS``). ``unreadable``: the error for a header that
    does not parse."""
    key = (config_bytes, header, size, shape, max_rank)
    with _HEAD_LOCK:
        parts = _HEAD_PARTS.get(key)
    if parts is None:
        try:
            parsed = parse_header(header, size)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise unreadable(e) from e
        config = parse_config(config_bytes, where / CONFIG_FILE)
        spec = built_spec(name, where, config, parsed, shape, max_rank, version, size, None, config_digest)
        with _HEAD_LOCK:
            _HEAD_PARTS[key] = (spec.config, spec.modules, spec.dtype)
            while len(_HEAD_PARTS) > MAX_HEAD_PARTS:
                del _HEAD_PARTS[next(iter(_HEAD_PARTS))]
        return spec
    config, modules, dtype = parts
    return AdapterSpec(name, where, config, modules, dtype, version, size, None, config_digest)


_HEAD_PARTS: dict[tuple[bytes, bytes, int, ModelShape, int], tuple[AdapterConfig, tuple[LoraModule, ...], str]] = {}
MAX_HEAD_PARTS = 16  # distinct (config, header)s kept: an 8B rank-16 header is ~60 KB
_HEAD_LOCK = threading.Lock()


class PushArea:
    """One service's pushed versions in node memory (the module's docstring); thread-safe."""

    def __init__(self, root: Path, service: str, max_bytes: int) -> None:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", service):
            raise ConfigError(f"push area service name {service!r} must be a plain directory name")
        self.root = root
        self.dir = root / service
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def path(self, name: str, tag: str) -> Path:
        return self.dir / name / tag

    def used(self) -> int:
        """Bytes of every version this service keeps pushed."""
        total = 0
        for weights in self.dir.glob(f"*/*/{WEIGHTS_FILE}"):
            try:
                total += weights.stat().st_size
            except FileNotFoundError:
                continue
        return total

    def write(self, name: str, tag: str, config_bytes: bytes, weights: bytes | memoryview) -> tuple[Path, bool]:
        """``NAME/TAG`` holding the push, written whole or not at all; and whether it was new (False: the same
        bytes were pushed under this tag before). ConflictError if the tag holds other bytes; CapacityError past
        ``max_bytes``."""
        target = self.path(name, tag)
        size = memoryview(weights).nbytes
        with self._lock:
            if target.is_dir():
                if _same(target, config_bytes, weights):
                    return target, False
                raise ConflictError(f"version tag {tag!r} of adapter {name!r} was pushed before with other weights or "
                                    "config; a tag names one content: push under a new tag (the next step)")
            used = self.used()
            if used + size > self.max_bytes:
                raise CapacityError(f"pushing {name}@{tag} ({size} bytes) would take the service's pushed versions "
                                    f"to {used + size} bytes, over push_bytes ({self.max_bytes}); keep fewer versions "
                                    "(keep_versions), unregister adapters no longer trained, or raise push_bytes")
            self._sweep()
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=target.parent))
            try:
                (tmp / CONFIG_FILE).write_bytes(config_bytes)
                write_spread(tmp / WEIGHTS_FILE, weights)
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                # another process wrote the same version meanwhile (two ranks of a node copying one push)
                if target.is_dir() and _same(target, config_bytes, weights):
                    return target, False
                raise
        return target, True

    def read(self, name: str, tag: str) -> tuple[bytes, np.ndarray]:
        """The config's bytes and the weights' bytes (uint8) of the version ``NAME/TAG`` kept here: what a rank
        on another node copies into its own node's area (``workers.control.node_copies``)."""
        target = self.path(name, tag)
        return (target / CONFIG_FILE).read_bytes(), np.fromfile(target / WEIGHTS_FILE, dtype=np.uint8)

    def retire(self, name: str, keep: set[Path]) -> list[str]:
        """Remove ``name``'s pushed versions (and leftovers of cut pushes) not in ``keep``; the tags removed."""
        removed = []
        with self._lock:
            parent = self.dir / name
            if not parent.is_dir():
                return []
            kept = {p.resolve() for p in keep}
            for child in parent.iterdir():
                if child.resolve() in kept:
                    continue
                shutil.rmtree(child, ignore_errors=True)
                if not child.name.startswith(TMP_PREFIX):
                    removed.append(child.name)
            self._prune(parent)
        return sorted(removed)

    def drop(self, name: str, tags: Collection[str]) -> list[str]:
        """Remove ``name``'s versions ``tags`` and nothing else (in a node copy's area, where another rank may be
        writing a copy: its ``.push-*`` directory stays); the tags removed."""
        removed = []
        with self._lock:
            self._sweep()
            for tag in sorted(set(tags)):
                version = self.path(name, check_tag(tag))
                if version.is_dir():
                    shutil.rmtree(version, ignore_errors=True)
                    removed.append(tag)
            self._prune(self.dir / name)
        return removed

    def _sweep(self) -> None:
        """Remove the versions being written that are older than ``STALE_WRITE_S``: a writer that died midway (a rank
        killed while it copied a version to its node) left them, and nothing else would free that node memory before
        the machine restarts. A live write is never that old (under the lock)."""
        for tmp in self.dir.glob(f"*/{TMP_PREFIX}*"):
            try:
                stale = time.time() - tmp.stat().st_mtime > STALE_WRITE_S
            except FileNotFoundError:  # renamed into place or removed by its writer meanwhile
                continue
            if stale:
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _prune(parent: Path) -> None:
        with contextlib.suppress(OSError):  # gone, or another rank of the node is writing into it
            if not any(parent.iterdir()):
                parent.rmdir()

    def holds(self, path: str | Path) -> bool:
        """Whether ``path`` is a pushed version's directory of this area."""
        try:
            return Path(path).resolve().parent.parent == self.dir.resolve()
        except OSError:
            return False


def _same(target: Path, config_bytes: bytes, weights: bytes | memoryview) -> bool:
    try:
        if (target / CONFIG_FILE).read_bytes() != config_bytes:
            return False
        view = memoryview(weights).cast("B")
        if (target / WEIGHTS_FILE).stat().st_size != len(view):
            return False
        return (target / WEIGHTS_FILE).read_bytes() == bytes(view)
    except OSError:
        return False


def config_json(config: dict[str, Any] | str | bytes) -> bytes:
    """A PEFT config as the bytes written to ``adapter_config.json``."""
    if isinstance(config, bytes):
        return config
    if isinstance(config, str):
        return config.encode()
    return json.dumps(config, sort_keys=True).encode()
