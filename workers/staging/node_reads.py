"""Demand reads in flight on this node, seen by every rank's process on it (lifecycle step 5: reads by priority).

The ranks of one node share its store: one device, one network link to an object store. A rank's warm stages
(``workers.staging.warming``) wait while its own host tier reads, but another rank's demand read, a load a
request waits for, shared the store with them: on two replicas of one host that sharing cost `global` more store
time per request than warming saved (bench/reports/issue-42.md, "the warm set's value"). So each demand read
leaves a marker file for as long as it runs, in a directory the node's ranks share, and a warm stage waits while
any other process's marker is there.

A marker is named ``PID-START-SEQ`` (``START``: the process's start time, so a reused PID is not taken for the
dead process); ``busy`` counts the markers of other live processes and removes those of dead ones. A marker older
than ``MAX_READ_S`` is ignored and removed (a process that hangs with a read in flight must not stop every warm
stage of its node for good). Marking is best effort: a directory that cannot be written costs the yield only,
never a read.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from lora_cache.adapters.files import replace_text

log = logging.getLogger(__name__)

MAX_READ_S = 600.0  # a demand read in flight longer than this is taken for a leftover
ENV = "LORA_CACHE_READS_DIR"  # where the markers go, if set (one directory per node; its ranks share it)
FETCHES_DIR = ".fetches"  # in it: the node's demand fetches from a store, in their order (``NodeFetches``)
RATE_PRIOR = 200e6  # bytes/s: the store's rate ``NodeFetches`` orders by until a fetch of the node measured one
RATE_FILE = "rate"  # in ``FETCHES_DIR``: the node's measure of that rate, bytes/s as text (sorts after every marker)


def default_dir() -> Path:
    """One directory per user and node: ``LORA_CACHE_READS_DIR`` if set (tests give each run its own), else in
    shared memory where there is some (no disk writes per read)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"lora-cache-reads-{os.getuid()}"


def started(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); "0" where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "0"
    return stat.rsplit(")", 1)[-1].split()[19]


class NodeReads:
    """This process's demand-read markers, and whether other processes on the node have any (module docstring)."""

    def __init__(self, path: Path | None = None, ident: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``ident``: this process's marker prefix (``PID-START``; ``PID-START.TAG`` gives several in one process their
        own, as the tests do)."""
        self.path = path if path is not None else default_dir()
        self.ident = ident if ident is not None else f"{os.getpid()}-{started(os.getpid())}"
        self._clock = clock
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._warned = False
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            self._warn(e)

    def mark(self) -> str:
        """Leave a marker for a demand read starting now; its name ('' if it could not be written)."""
        name = f"{self.ident}-{next(self._seq)}"
        try:
            fd = os.open(self.path / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError as e:
            self._warn(e)
            return ""
        os.close(fd)
        return name

    def unmark(self, name: str) -> None:
        """The read ``name`` marked is over (succeeded or failed)."""
        if name:
            try:
                os.unlink(self.path / name)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn(e)

    def busy(self) -> int:
        """Demand reads in flight in other live processes on this node (leftovers of dead ones removed)."""
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return 0
        now, alive, count = self._clock(), dict[str, bool](), 0
        for entry in entries:
            ident = entry.name.rsplit("-", 1)[0]
            if ident == self.ident or entry.name.startswith("."):  # its own, or not a marker (``FETCHES_DIR``)
                continue
            if ident not in alive:
                alive[ident] = _alive(ident)
            try:
                stale = not alive[ident] or now - entry.stat().st_mtime > MAX_READ_S
            except FileNotFoundError:
                continue  # its read ended meanwhile
            if stale:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            count += 1
        return count

    def _warn(self, error: OSError) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        log.warning("demand reads are not marked in %s (%s): other ranks' warm stages on this node will not "
                    "yield to this one's loads; give the directory write access", self.path, error)


def _alive(ident: str) -> bool:
    """Whether the process ``PID-START`` still runs (the same process: its start time matches)."""
    pid_text, _, start = ident.partition("-")
    try:
        pid = int(pid_text)
    except ValueError:
        return False  # not a marker of ours
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process under that PID: its start time says whether it is the marker's
    start = start.split(".", 1)[0]  # ``START.TAG``: several identities of one process (tests)
    return start in ("0", started(pid))


class Marked(Protocol):
    """A host-tier entry as the marks see it (``HostEntry``): its lock, its marker, whether its read is over."""

    lock: threading.Lock
    node_mark: str
    read_over: bool
    joined: bool


class DemandMarks:
    """A host tier's side of ``NodeReads``: its reads are demand reads, marked while they run, except those a warm
    stage starts (fetches made within ``speculative()`` on the warm queue's thread)."""

    def __init__(self, node: NodeReads | None = None, reading: Callable[[], int] = lambda: 0) -> None:
        """``reading``: how many reads of the tier are in flight (``HostTier.reading``), for ``busy``."""
        self.node = node if node is not None else NodeReads()
        self._reading = reading
        self._local = threading.local()
        self._lock = threading.Lock()
        self._demand: set[int] = set()  # ids of this tier's entries whose demand reads run (marked or not)

    @contextlib.contextmanager
    def speculative(self) -> Iterator[None]:
        """The fetches of this thread within are warm stages: their reads leave no marker."""
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = False

    @property
    def warm(self) -> bool:
        """Whether this thread's fetches are warm stages now."""
        return bool(getattr(self._local, "on", False))

    def busy(self) -> bool:
        """What a warm stage waits for before it starts, and a disk warm stage's fetch yields the store to: a read in
        flight in this tier (of either kind), or a demand read of another process on the node."""
        return self._reading() > 0 or self.node.busy() > 0

    def mark(self, entry: Marked) -> None:
        """Mark ``entry``'s read as a demand read (also one a load joined in flight), unless it is over or marked."""
        with entry.lock:
            if not entry.read_over and not entry.node_mark:
                with self._lock:
                    self._demand.add(id(entry))
                entry.node_mark = self.node.mark()

    def join(self, entry: Marked) -> None:
        """A load joined the warm stage's read of ``entry``: a demand read from now, whose store fetch yields no
        more (``yields``)."""
        entry.joined = True
        self.mark(entry)

    def unmark(self, entry: Marked) -> None:
        """``entry``'s read ended, whichever way: its marker goes, and none is left for it later."""
        with entry.lock:
            name, entry.node_mark, entry.read_over = entry.node_mark, "", True
            with self._lock:
                self._demand.discard(id(entry))
        self.node.unmark(name)

    def yields(self, entry: Marked, crowded: Callable[[], bool]) -> Callable[[], bool]:
        """What the warm stage's read of ``entry`` yields the store to where its adapter's object is not on the
        node's disk yet (``DiskTier.held``'s ``busy``): a demand read of this tier or of another process on the node,
        until a load joins ``entry``; never while ``crowded()`` (a read of this tier waits for a reader thread, which
        may be the one the yielding read holds). A speculative read never holds the store against a demand one
        (issue 42 item 3): before 2026-12-02 only disk warm stages yielded, and a host warm stage's fetch of a whole
        object took the store from the demand reads that came while it ran (in the simulator, two replicas on one
        node with a disk tier smaller than the catalog: ``global`` up to 4.81x ``queue``'s mean TTFT,
        bench/reports/issue-42.md, "Host warm reads yield the store")."""

        def busy() -> bool:
            if entry.joined or crowded():
                return False
            with self._lock:
                here = bool(self._demand)
            return here or self.node.busy() > 0

        return busy


@contextlib.contextmanager
def awaiting(fd: int) -> Iterator[None]:
    """A demand read of this node waits for the disk tier's object whose ``locks/NAME.want`` file ``fd`` is open
    on (its proven copy, or a fetch of it by this or another process) while within; ``fd`` is closed at the end.
    Such a fetch, if a warm stage's that yields the store, yields no more (``awaited``; a marker says that a demand
    read runs, not which object it waits for). A shared ``flock``: the kernel lets go of it with its process, so a
    reader killed while it waits leaves nothing that counts."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def awaited(fd: int) -> bool:
    """Whether a demand read of any process on this node waits for the object whose want file ``fd`` is open on
    (``awaiting``): the caller opens it once for all its polls."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class StoreShare:
    """The share of the last ``tau_s`` seconds (exponentially weighted) in which a demand read of this process waited
    for the store (its object not on the node's disk yet): how saturated the store is with demand. Thread-safe."""

    def __init__(self, tau_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.tau_s, self._clock = tau_s, clock
        self._lock = threading.Lock()
        self._share, self._at, self._waiting = 0.0, clock(), 0

    def share(self) -> float:
        with self._lock:
            return self._now(self._clock())

    def past(self, threshold: float) -> bool:
        """Whether demand saturates the store: the share is at least ``threshold``, a share below 1 (1: never)."""
        return threshold < 1 and self.share() >= threshold

    def _now(self, now: float) -> float:
        kept = math.exp(-max(0.0, now - self._at) / self.tau_s)
        return self._share * kept + (1.0 - kept) * (self._waiting > 0)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Within: a demand read of this process waits for the store."""
        self.add(1)
        try:
            yield
        finally:
            self.add(-1)

    def add(self, delta: int) -> None:
        """One more (``delta`` 1) or one less (-1) demand read waiting for the store (``waiting``; the simulator's)."""
        with self._lock:
            now = self._clock()
            self._share, self._at = self._now(now), now
            self._waiting += delta


class NodeFetches:
    """The node's demand fetches from an object store, in the order they take its bandwidth: the one that would end
    soonest had it the store alone - its first byte's time plus its bytes at the store's rate - first; a fetch reads
    nothing while another live one of the node comes before it (``ahead``). Each fetch leaves a marker for as long as
    it runs, named ``END-PID-START-SEQ`` (``END`` in ns, zero-padded: the names sort in that order), in
    ``FETCHES_DIR`` of the directory of ``NodeReads``' markers. The rate is the node's: every process's fetches that
    moved alone (``moved``) fold their measure into ``RATE_FILE`` there, and each fetch reads it as it enters, so two
    ranks count the same fetch's end alike (until 2026-12-03 each process kept its own, 200 MB/s until one of its own
    fetches had moved alone); ``RATE_PRIOR`` until any did.

    Why (issue 42, a store slower than demand): the store's bandwidth is shared by every fetch in flight, so a burst
    of cold adapters' fetches all end late together (a rank-16 object beside four rank-64 ones takes five times its
    own time); one at a time, the first ends at once and the requests behind it wait less. By the end it would have
    alone, not by size: a small fetch that comes later passes a large one only by the difference of their times
    alone, so no large fetch waits behind a stream of small ones for ever (smallest-first did: a rank-64 adapter's
    load waited 7 s at the p99 where sharing took 4.6; bench/reports/issue-42.md). The order is kept per block read
    (``DiskTier``). A marker of a dead process, or older than ``MAX_READ_S``, is removed; a directory that cannot be
    written leaves the fetches unordered (shared), never stops one."""

    def __init__(self, path: Path | None = None, ident: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path if path is not None else default_dir() / FETCHES_DIR
        self.ident = ident if ident is not None else f"{os.getpid()}-{started(os.getpid())}"
        self._clock = clock
        self._seq = itertools.count()
        self._warned = threading.Event()
        self._made = False  # the directory, by this process
        self.rate = RATE_PRIOR  # bytes/s of the store, as the node measured it when this process last looked

    def enter(self, nbytes: int) -> str:
        """A demand fetch of an object of ``nbytes`` whose bytes begin to come now: its marker ('' if it could not be
        written). The directory is made by the first fetch (a service of local files makes none)."""
        end = int((self._clock() + nbytes / self.node_rate()) * 1e9)
        name = f"{end:020d}-{self.ident}-{next(self._seq)}"
        try:
            if not self._made:  # made again after a clean-up took it
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._made = True
            os.close(os.open(self.path / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return name
        except OSError as e:
            self._made = self._made and not isinstance(e, FileNotFoundError)
            self._warn(e)
            return ""

    def leave(self, name: str) -> None:
        """The fetch ``name`` entered is over (succeeded or failed)."""
        if name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / name)

    def ahead(self, name: str) -> bool:
        """Whether a live demand fetch of this node (this process's too) comes before ``name`` (never for '')."""
        if not name:
            return False
        try:
            entries = [e for e in os.scandir(self.path) if e.name < name]
        except OSError:
            return False
        now = self._clock()
        for entry in entries:
            ident = "-".join(entry.name.split("-")[1:3])
            try:
                stale = (ident != self.ident and not _alive(ident)) or now - entry.stat().st_mtime > MAX_READ_S
            except FileNotFoundError:
                continue  # it ended meanwhile
            if not stale:
                return True
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        return False

    def node_rate(self) -> float:
        """The store's rate as the node measured it last (``RATE_FILE``; this process's last reading where there is
        none, or it cannot be read: ``rate``)."""
        try:
            rate = float((self.path / RATE_FILE).read_text())
        except (OSError, ValueError):
            return self.rate
        if math.isfinite(rate) and rate > 0:
            self.rate = rate
        return self.rate

    def moved(self, nbytes: int, seconds: float) -> None:
        """A demand fetch moved ``nbytes`` alone in ``seconds``: the store's rate, as every fetch of the node counts it
        from now (the mean of the last few of the node's, weighted to the newest; fetches too short to time say
        nothing). Two processes that measure at once may each fold into the same reading, one's result kept: an
        estimate, never a lost fetch."""
        if nbytes < 1 << 22 or seconds <= 0.02:
            return
        self.rate = 0.5 * self.node_rate() + 0.5 * nbytes / seconds
        with contextlib.suppress(OSError):  # a directory that cannot be written: ``enter`` warns of it
            replace_text(self.path / RATE_FILE, repr(self.rate))

    def _warn(self, error: OSError) -> None:
        if not self._warned.is_set():
            self._warned.set()
            log.warning("demand fetches are not ordered in %s (%s): they share the store's bandwidth; give the "
                        "directory write access", self.path, error)
