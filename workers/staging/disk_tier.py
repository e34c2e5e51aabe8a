"""The local disk tier: adapters from an object store, kept whole on a disk the operator chooses, LRU by bytes,
in front of the pinned host tier (lifecycle step 5; issue 29).

A read of a store adapter (``HostTier``'s, when it misses) asks ``held(spec)`` for a local copy: a hit is the
file already here; a miss fetches the object once for the whole node (``workers.staging.store_fetch``: ranged GETs of
the registered ETag only) into ``NAME.part.PID``, preallocated, and renames it into place with its proof beside
it (``NAME.crc``: the file's identity after the write, the safetensors header's CRC and every block's, taken
from the bytes the store sent under that ETag). The copy is then read as any adapter file is
(``workers.reads.shard``): its identity and header checked on every read, its blocks as ``verify`` says (a fresh
copy is racy: every block a process reads is checked in full until a check after the racy window), so a
version is proven on every read from every tier. A copy whose identity no longer matches its proof is dropped
and fetched again; one whose bytes do not (torn by a crash: a copy is not fsync'ed) fails that read and is
dropped, so the next load fetches it again.

The node's demand fetches (of every service and rank on it) take the store's bandwidth one at a time, the one that
would end soonest alone first (``node_reads.NodeFetches``, ``fetch_order``); warm stages' fetches yield to any demand
read.

Each service has a directory of its own, ``SERVICE`` under ``--disk-cache`` (its name: ``serve --service``), so
that one service's copies and cap never evict another's (docs/decisions.md, "the disk tier per service").
Every rank of the service on a node shares it: a file lock per entry (``locks/NAME.lock``) makes one process fetch
while the others wait for its copy (shared lock: read; exclusive: fetch or evict), and a lock on the
directory (``.lock``) orders the room-making. A copy is evicted (oldest use first, by its proof's mtime) only
when no process holds it. An adapter larger than the tier, or a tier whose every byte is held by reads in
progress, is refused (``CapacityError``) before anything is fetched; a disk that fills up under the
preallocation is refused the same way, and a failed fetch leaves nothing behind.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_cache.adapters.files import BLOCK_BYTES, BlockCrcs, FileIdentity, WeightsSource, replace_text
from lora_cache.adapters.objects import StoreSource
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.store import client
from lora_cache.errors import AdapterChangedError, AdapterFormatError, CapacityError, ConfigError
from lora_cache.vocab import NAMESPACE, check_service_name
from workers.staging.fetch_pace import FetchPace
from workers.staging.node_reads import NodeFetches, StoreShare, awaiting
from workers.staging.store_fetch import fetch_object

log = logging.getLogger(__name__)
FETCH_ORDERS = ("soonest", "shared")  # DiskTierConfig.fetch_order


@dataclass(frozen=True)
class DiskTierConfig:
    """Where adapters fetched from an object store are kept on this node, and how they are fetched."""

    disk_cache: str = field(default="", metadata={"path": True, "help": (
        "directory of the local disk tiers for adapters from an object store: each service keeps its copies in a "
        "subdirectory named after it (shared by its ranks on the node); empty: lora-cache-disk-UID under the system's "
        "temporary directory")})
    disk_cache_bytes: int = field(
        default=64 << 30, metadata={"help": "bytes of adapter files the disk tier may hold (LRU by bytes)"}
    )
    fetch_parallel: int = field(default=8, metadata={"help": "ranged GETs of one object at once"})
    victim_share: float = field(default=0.3, metadata={"help": (
        "while a rank's demand reads waited for the store this share of the last minute or more, a copy whose adapter "
        "the rank's host tier lets go of becomes the disk tier's most recent (a victim cache of memory); 1: never")})
    fetch_order: str = field(default="soonest", metadata={"help": (
        "how the node's demand fetches share the store: soonest (one moves at a time, the one that would end soonest "
        "alone first: a burst of cold adapters does not end late all together) or shared (all at once)")})
    fetch_part_bytes: int = field(default=8 << 20, metadata={"help": (
        "bytes per ranged GET (a multiple of 1 MiB, the CRC block); 0: one GET of the whole object (for a store "
        "whose ranged GETs cost the whole object, as moto's do)")})

    def __post_init__(self) -> None:
        if self.disk_cache_bytes < 1 << 16:
            raise ConfigError(f"disk_cache_bytes ({self.disk_cache_bytes}) must be at least 64 KiB; size it for the "
                              "adapters a node serves (64 GiB by default)")
        if not 0 <= self.victim_share <= 1:
            raise ConfigError(f"victim_share is {self.victim_share!r}; give a share in [0, 1], e.g. 0.3 (1: never)")
        if self.fetch_order not in FETCH_ORDERS:
            raise ConfigError(f"fetch_order is {self.fetch_order!r}; give one of {', '.join(FETCH_ORDERS)}")
        if not 1 <= self.fetch_parallel <= 64:
            raise ConfigError(f"fetch_parallel must be in 1..64, got {self.fetch_parallel}")
        if self.fetch_part_bytes < 0 or self.fetch_part_bytes % BLOCK_BYTES:
            raise ConfigError(
                f"fetch_part_bytes ({self.fetch_part_bytes}) must be 0 (one GET) or a multiple of "
                f"{BLOCK_BYTES} (the CRC block); 8 MiB is the default"
            )

    def directory(self, service: str = NAMESPACE) -> Path:
        """The disk tier of ``service`` on this node: its own subdirectory, whoever else uses ``disk_cache``."""
        check_service_name(service, "the disk tier's service")  # a path component: no "/", no ".."
        return Path(self.disk_cache or Path(tempfile.gettempdir()) / f"lora-cache-disk-{os.getuid()}") / service


def entry_name(source: StoreSource) -> str:
    where = hashlib.blake2b(f"{source.bucket}/{source.key}".encode(), digest_size=8).hexdigest()
    return f"{where}-{source.version}"


class DiskTier:
    """Local copies of store objects, by version. ``held`` gives a proven copy and holds it while used."""

    def __init__(self, config: DiskTierConfig, timeout_s: float = 20.0, service: str = NAMESPACE) -> None:
        self.config, self.timeout_s = config, timeout_s
        self.dir = config.directory(service)  # this service's alone: another's cap never evicts its copies
        self._lock = threading.Lock()  # protects _flights and the counters
        self._flights: dict[str, Future[WeightsSource]] = {}  # name -> this process's fetch in flight
        self.pace = FetchPace(NodeFetches() if config.fetch_order == "soonest" else None)  # the fetches' pauses
        self._stager: ThreadPoolExecutor | None = None
        self.store_share = StoreShare()  # how much of the time this process's demand reads wait for the store
        self.hits = self.fetches = self.fetched_bytes = self.evictions = self.stage_failures = self.touches = 0

    # -- reads ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def held(self, spec: AdapterSpec, busy: Callable[[], bool] | None = None) -> Iterator[AdapterSpec]:
        """``spec`` with ``source`` its local copy's (fetched if need be), which no process evicts until the
        ``with`` ends; ``spec`` itself for an adapter not in a store. ``busy``: a warm stage's, whose fetch yields
        (``stage``; a host warm read's: ``DemandMarks.yields``)."""
        if spec.store is None:
            yield spec
            return
        name = entry_name(spec.store)
        want = contextlib.ExitStack()
        if busy is None:  # a read that needs it: a warm stage's fetch of it in flight here, or in another process
            self.pace.forget(name)  # of the node, yields no more (its entry lock keeps this read out until it ends)
            want.enter_context(awaiting(self._open_lock(f"{name}.want")))
            want.enter_context(self.store_share.waiting())  # until its copy is here (a hit: no time at all)
        fd = -1
        try:
            fd = self._entry_lock(name, fcntl.LOCK_SH)
            local = self._proof(name, spec.store)
            if local is None:
                os.close(fd)
                fd = -1
                self._fetch_once(name, spec.store, busy)
                fd = self._entry_lock(name, fcntl.LOCK_SH)
                local = self._proof(name, spec.store)
                if local is None:  # evicted between the fetch and this lock: rare, fetched once more
                    os.close(fd)
                    fd = -1
                    self._fetch_once(name, spec.store)
                    fd = self._entry_lock(name, fcntl.LOCK_SH)
                    local = self._proof(name, spec.store)
                    if local is None:
                        raise CapacityError(f"the disk tier {self.dir} evicted {spec.store.url} as soon as it was "
                                            "fetched: too small for the adapters in use; raise --disk-cache-bytes")
            else:
                with self._lock:
                    self.hits += 1
            want.close()
            try:
                yield dataclasses.replace(spec, source=local)
            except AdapterChangedError:  # the copy is not what its proof says (torn by a crash): dropped, fetched
                os.close(fd)  # again by the next load
                fd = -1
                self._evict(name)
                raise
        finally:
            want.close()
            if fd >= 0:
                os.close(fd)

    def stage(self, spec: AdapterSpec, busy: Callable[[], bool] | None = None) -> Future[None] | None:
        """Fetch ``spec``'s object into the tier in the background (the planner's stage, ahead of need); None
        for an adapter not in a store. A failure is logged and counted (``stage_failures``), not raised.
        ``busy``: a disk warm stage's, which yields the store at once: while ``busy()`` (a demand read on this
        node) its fetch reads no more of the object (the store's bandwidth goes to the demand), up to ``YIELD_MAX_S``
        at a time; a read that needs the object, of this process or another of the node (``awaiting``), joins the
        fetch and it is a demand fetch from then on (it yields no more; it takes its turn among the node's demand
        fetches: ``FetchPace``)."""
        if spec.store is None:
            return None
        with self._lock:
            if self._stager is None:
                self._stager = ThreadPoolExecutor(2, thread_name_prefix="lora-disk-stage")
            stager = self._stager
        return stager.submit(self._stage, spec, busy)

    def _stage(self, spec: AdapterSpec, busy: Callable[[], bool] | None = None) -> None:
        try:
            with self.held(spec, busy):
                pass
        except Exception as e:  # staging is advice: the load that needs it reports the error
            with self._lock:
                self.stage_failures += 1
            log.warning("staging %s@%s into the disk tier failed: %s", spec.name, spec.version, e)

    def contains(self, source: StoreSource) -> bool:
        return (self.dir / f"{entry_name(source)}.crc").exists()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "disk_hits": self.hits,
                "disk_fetches": self.fetches,
                "disk_fetched_bytes": self.fetched_bytes,
                "disk_evictions": self.evictions,
                "disk_stage_failures": self.stage_failures,
                "disk_touches": self.touches,  # copies made most recent as a host tier let go of them (``let_go``)
                **self.pace.stats(),
            }

    def close(self) -> None:
        if self._stager is not None:
            self._stager.shutdown(wait=True, cancel_futures=True)

    # -- one fetch per node ----------------------------------------------------------------------------
    def _fetch_once(self, name: str, source: StoreSource, busy: Callable[[], bool] | None = None) -> None:
        """The copy of ``source`` in place: fetched by this thread, or by the one (of any process here) already
        fetching it, whose end this waits for. ``busy``: a warm stage's fetch (it yields: ``stage``)."""
        with self._lock:
            flight = self._flights.get(name)
            mine = flight is None
            if mine:
                flight = self._flights[name] = Future()
                if busy is not None:
                    self.pace.yielding(name, busy)
        assert flight is not None
        if not mine:
            flight.result()
            return
        try:
            fd = self._entry_lock(name, fcntl.LOCK_EX)  # another process's fetch of it: wait for its end
            try:
                local = self._proof(name, source)
                if local is None:
                    want = self._open_lock(f"{name}.want") if busy is not None else -1  # closed by the pause
                    with self.pace.pause(name, source.size, want) as pause:
                        local = self._fetch(name, source, pause)
            finally:
                os.close(fd)
            flight.set_result(local)
        except BaseException as e:
            flight.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._flights[name]
            self.pace.forget(name)

    def _fetch(self, name: str, source: StoreSource, pause: Callable[[], None] | None = None) -> WeightsSource:
        """Fetch ``source`` into ``name`` (caller holds its entry lock exclusively); ``pause``: ``FetchPace``'s."""
        part = self.dir / f"{name}.part.{os.getpid()}"
        fd = self._reserve(source, part)
        try:
            s3 = client(self.timeout_s, pool=max(32, self.config.fetch_parallel))
            crcs = fetch_object(s3, source, fd, self.config.fetch_parallel, self.config.fetch_part_bytes,
                                pause=pause)
            # no fsync (a quarter of a fetch's time here): a copy torn by a crash is caught by its first read in
            # any process (a fresh copy is racy: every block read is checked against its proof) and dropped
            path = self.dir / f"{name}.safetensors"
            os.replace(part, path)
            identity = FileIdentity.of(os.fstat(fd))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise
        finally:
            os.close(fd)
        fetched_ns = time.time_ns()
        local = WeightsSource(
            str(path), source.version, identity, source.header_bytes, source.header_crc, crcs, fetched_ns
        )
        _write_proof(self.dir / f"{name}.crc", local)
        with self._lock:
            self.fetches += 1
            self.fetched_bytes += source.size
        return local

    # -- proofs ----------------------------------------------------------------------------------------
    def _proof(self, name: str, source: StoreSource) -> WeightsSource | None:
        """The local copy of ``source`` as its proof describes it, if its file still has that identity (else the
        copy is dropped and None: fetched again); touched as used (LRU)."""
        proof, path = self.dir / f"{name}.crc", self.dir / f"{name}.safetensors"
        try:
            local = _read_proof(proof)
            now = FileIdentity.of(os.stat(path))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        if (local.version, local.header_crc, local.identity.size) != (
            source.version,
            source.header_crc,
            source.size,
        ) or local.identity != now:
            log.warning(
                "disk tier copy %s of %s changed since it was fetched (%s): dropped, fetched again",
                path,
                source.url,
                local.identity.changes(now) or "another version",
            )
            for p in (proof, path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(proof)
        return local

    def let_go(self, source: StoreSource) -> None:
        """A host tier here evicted ``source``'s adapter. While demand saturates the store (waited for it
        ``victim_share`` of the last minute: ``store_share``) its copy becomes the most recent: the LRU orders by when
        the node last held an adapter (a victim cache of memory), not by reads from here, which a hot adapter served
        from memory never makes. Else nothing: the disk warm set keeps its places (bench/reports/issue-42.md, "The
        disk a victim cache")."""
        if not self.store_share.past(self.config.victim_share):
            return
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.dir / f"{entry_name(source)}.crc")
            with self._lock:
                self.touches += 1

    # -- room ------------------------------------------------------------------------------------------
    def _reserve(self, source: StoreSource, part: Path) -> int:
        """An fd of ``part``, preallocated for ``source`` once there is room (unheld copies evicted, oldest use
        first), under the directory's lock so that fetches starting together cannot overcommit the tier; or
        ``CapacityError`` at once."""
        cap = self.config.disk_cache_bytes
        if source.size > cap:
            raise CapacityError(
                f"{source.url} is {source.size} bytes, more than the whole disk tier {self.dir} "
                f"({cap} bytes); raise --disk-cache-bytes"
            )
        with self._dir_lock():
            entries, used = _entries(self.dir)
            for _last_use, name, nbytes in sorted(entries):
                if used + source.size <= cap:
                    break
                if self._evict(name):
                    used -= nbytes
            if used + source.size > cap:
                raise CapacityError(
                    f"the disk tier {self.dir} ({cap} bytes) cannot take {source.url} "
                    f"({source.size} bytes): {used} bytes are held by reads and fetches in progress; "
                    "raise --disk-cache-bytes, or retry when they are done"
                )
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _preallocate(fd, source, self.dir)  # counted as used from now on (its size)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
                raise
            return fd

    def _evict(self, name: str) -> bool:
        """Drop ``name``'s copy unless a process holds it (its entry lock taken without waiting)."""
        try:
            fd = self._entry_lock(name, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            for suffix in (".crc", ".safetensors"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.dir / f"{name}{suffix}")
        finally:
            os.close(fd)
        with self._lock:
            self.evictions += 1
        return True

    @contextlib.contextmanager
    def _dir_lock(self) -> Iterator[None]:
        fd = os.open(self._ensure_dir() / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _entry_lock(self, name: str, how: int) -> int:
        """An fd of ``locks/NAME.lock`` locked ``how`` (flock); the caller closes it to unlock."""
        fd = self._open_lock(f"{name}.lock")
        try:
            fcntl.flock(fd, how)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_lock(self, file: str) -> int:
        """An fd of ``locks/FILE``, made if need be (the directory too, only when it is missing)."""
        path = self.dir / "locks" / file
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            self._ensure_dir()
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _ensure_dir(self) -> Path:
        try:
            (self.dir / "locks").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"the disk tier directory {self.dir} cannot be made ({e}); point --disk-cache at a writable directory"
            ) from e
        return self.dir


def _entries(directory: Path) -> tuple[list[tuple[float, str, int]], int]:
    """(last use, name, bytes) of each complete copy, and the bytes of every copy and fetch in progress (a
    dead process's leftover part is removed)."""
    entries, used = [], 0
    for p in directory.iterdir():
        try:
            if p.suffix == ".safetensors":
                nbytes = p.stat().st_size
                proof = p.with_suffix(".crc")
                mtime = proof.stat().st_mtime if proof.exists() else 0.0
                entries.append((mtime, p.stem, nbytes))
                used += nbytes
            elif ".part." in p.name:
                pid = int(p.name.rsplit(".", 1)[1])
                if _alive(pid):
                    used += p.stat().st_size
                else:
                    p.unlink()
        except (FileNotFoundError, ValueError):
            continue
    return entries, used


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _preallocate(fd: int, source: StoreSource, directory: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, source.size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CapacityError(
                f"the disk of the disk tier {directory} is full: {source.url} needs {source.size} "
                "bytes; free room there, lower --disk-cache-bytes below the free space, or point "
                "--disk-cache at a larger disk"
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, source.size)


def _write_proof(path: Path, local: WeightsSource) -> None:
    data = json.dumps({"v": local.version, "w": local.path, "id": list(local.identity), "hb": local.header_bytes,
                       "hc": local.header_crc, "b": base64.b64encode(local.block_crcs.packed).decode(),
                       "t": local.registered_ns})
    replace_text(path, data)


def _read_proof(path: Path) -> WeightsSource:
    d: dict[str, Any] = json.loads(path.read_text())
    crcs = BlockCrcs(base64.b64decode(d["b"]))
    identity = FileIdentity(*map(int, d["id"]))
    if len(crcs) != -(-identity.size // BLOCK_BYTES):
        raise AdapterFormatError(f"{path} holds {len(crcs)} block CRCs for {identity.size} bytes")
    return WeightsSource(str(d["w"]), str(d["v"]), identity, int(d["hb"]), int(d["hc"]), crcs, int(d["t"]))
