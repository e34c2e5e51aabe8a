"""Adapter files on disk: opened confined and regular, read whole once, and pinned to what was read (step 5).

Registration opens each file of an adapter through :meth:`AdapterRoots.open_file` (every symlink resolved
and confined to the roots, the open walking from the root with no link followed, non-blocking so that a
FIFO cannot hang it, refused unless a regular file), reads it exactly once, and records what it read:

- the file's identity ``(st_dev, st_ino, size, mtime_ns, ctime_ns)`` before and after the read, which must
  agree (a file changed while registered is refused);
- the content version (a hash of the config's bytes and of each block of the weights, ``content_version_of``);
- a CRC-32 of the safetensors header and of every ``BLOCK_BYTES`` block of the weights.

Or, for a settled file with ``local_versions="identity"`` (the default), an *identity version*
(``identity_version``: the boot, real path, identity, config and header), with the header's CRC and no block
CRCs: the weights are not read at registration. The first read of it on this machine CRCs every block
(``content_crcs``) and pins them (``publish_pin``: the first to link ``pins/VERSION.crc`` wins); every later
read, in any process of the machine, checks against the pinned CRCs (docs/decisions.md, "A local version
from its file's identity").

A read under that version (``workers.reads.shard``) then proves it reads those bytes: the identity must still
match (a rename-over, an in-place write, a truncation all change it), the header's CRC must match, and the
blocks it reads are checked as the ``verify`` mode says. A file whose last change was less than
``RACY_NS`` before its registration is *racy* (like git's racily clean index entries): a later write in
the same timestamp tick would leave its identity unchanged, so its blocks are checked in full until a
check made after the racy window has passed (docs/decisions.md, "A version is the bytes it hashed").
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import os
import re
import stat
import sys
import tempfile
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, overload

from lora_cache.adapters.roots import AdapterRoots
from lora_cache.errors import AdapterChangedError, AdapterFormatError, AdapterPathError

BLOCK_BYTES = 1 << 20  # CRC granularity of the weights: a read checks whole blocks
RACY_NS = 2_000_000_000  # a change this close to registration may share its timestamp tick (FAT: 2 s)
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes; refuse to read a huge one


def _boot_id() -> str:
    """This machine's boot: a file's identity says nothing on another machine, or after a reboot (a file
    system changed while unmounted, from another OS, can carry any stat times). "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


HOST = _boot_id()  # where identities taken by this process hold


class FileIdentity(NamedTuple):
    """What ``stat`` says about a file; any write, truncation, rename-over or replacement changes it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def changes(self, now: FileIdentity) -> str:
        """How ``now`` differs from this identity, in words ("" if it does not)."""
        if (self.dev, self.ino) != (now.dev, now.ino):
            return f"it was replaced by another file (device/inode {self.dev}/{self.ino} -> {now.dev}/{now.ino})"
        if self.size != now.size:
            return f"its size changed ({self.size} -> {now.size} bytes)"
        if (self.mtime_ns, self.ctime_ns) != (now.mtime_ns, now.ctime_ns):
            return f"it was written in place (mtime {self.mtime_ns} -> {now.mtime_ns} ns, same size)"
        return ""


class WeightsSource(NamedTuple):
    """The weights file of one registered version, as registration read it: what every read checks."""

    path: str  # the real path (symlinks resolved, under a root)
    version: str
    identity: FileIdentity
    header_bytes: int  # 8 + the safetensors header's length: where the tensor data starts
    header_crc: int
    block_crcs: BlockCrcs  # CRC-32 of each BLOCK_BYTES block of the file
    registered_ns: int  # wall clock (time.time_ns) when it was registered

    @property
    def pinned(self) -> bool:
        """Whether the CRCs of its content are known: hashed at registration (a content version), or pinned by
        the first read on this machine (an identity version, ``workers.reads.shard._pin_first``); False until then."""
        return len(self.block_crcs) == -(-self.identity.size // BLOCK_BYTES)

    @property
    def racy(self) -> bool:
        """Changed so shortly before registration that a later same-tick write could keep its identity."""
        return self.registered_ns - self.identity.ctime_ns < RACY_NS

    def settled(self, now_ns: int) -> bool:
        """Whether a write after ``now_ns`` must show in the identity (the racy window is over)."""
        return now_ns - self.identity.ctime_ns >= RACY_NS


class BlockCrcs(Sequence[int]):
    """The CRC-32 of every block of a file, packed 4 bytes each (a tuple of Python ints costs ~36 bytes a block,
    and an 8B adapter has 81 blocks); immutable and hashable, ``crcs[b]`` is block b's."""

    __slots__ = ("packed",)
    packed: bytes  # little-endian uint32 per block: what snapshots and messages carry

    def __init__(self, crcs: Iterable[int] | bytes) -> None:
        packed = bytes(crcs) if isinstance(crcs, bytes | bytearray) else array.array("I", crcs).tobytes()
        if isinstance(crcs, bytes | bytearray) and len(packed) % 4:
            raise ValueError(f"block CRCs are 4 bytes each; got {len(packed)} bytes")
        if not isinstance(crcs, bytes | bytearray) and sys.byteorder != "little":
            swapped = array.array("I", packed)
            swapped.byteswap()
            packed = swapped.tobytes()
        object.__setattr__(self, "packed", packed)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("BlockCrcs is immutable")

    def __len__(self) -> int:
        return len(self.packed) // 4

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        return int.from_bytes(self.packed[4 * index : 4 * index + 4], "little")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockCrcs) and other.packed == self.packed

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"BlockCrcs({list(self)})"

    def __reduce__(self) -> tuple[type[BlockCrcs], tuple[bytes]]:
        return BlockCrcs, (self.packed,)


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole: a reader in any process sees the old text or the new, never half (written
    beside it under a name of this process and thread, then renamed over it; no fsync: a cache's notes, not data)."""
    part = path.with_name(f"{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    part.write_text(text)
    os.replace(part, path)


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO (named pipe)"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "special file"


def check_regular(path: Path, real: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        where = f" ({real})" if real != path else ""
        raise AdapterPathError(f"{path}{where} is a {file_kind(mode)}, not a regular file: adapter files must be "
                               "regular files under an adapter root; replace it with the file itself")


class OpenFile(NamedTuple):
    fd: int
    real: Path  # symlinks resolved, under a root
    identity: FileIdentity  # as opened


@contextlib.contextmanager
def open_adapter_file(roots: AdapterRoots, path: Path, missing: str) -> Iterator[OpenFile]:
    """``path`` opened for reading: confined to ``roots`` (every symlink followed and checked), a regular file
    (checked on the path before the open, so a FIFO or a device is never opened, and on the fd after it),
    and the same file both times. ``missing`` is the error if there is no such file."""
    real = roots.confine_file(path)
    try:
        st = os.stat(real)
    except FileNotFoundError as e:
        raise AdapterFormatError(missing) from e
    check_regular(path, real, st.st_mode)
    fd = roots.open_file(real)
    try:
        opened = FileIdentity.of(fst := os.fstat(fd))
        check_regular(path, real, fst.st_mode)
        if (opened.dev, opened.ino) != (st.st_dev, st.st_ino):
            raise AdapterChangedError(f"{path} was replaced while it was opened; register it again")
        if opened.size == 0 and os.pread(fd, 1, 0):
            raise AdapterPathError(f"{path} ({real}) says it is empty but holds bytes: a /proc or /sys file, not "
                                   "an adapter file; point the adapter at the real file")
        yield OpenFile(fd, real, opened)
    finally:
        os.close(fd)


def same_file(what: Path, registered: FileIdentity, now: FileIdentity, when: str, version: str) -> None:
    """Refuse if ``now`` is not the identity registered for ``version``; ``when`` says when it was seen."""
    change = registered.changes(now)
    if change:
        size = "changed size" if registered.size != now.size else "changed"
        raise AdapterChangedError(f"{what} {size} {when} it was registered as version {version}: {change}; a read "
                                  "under that version would return other bytes, so it is refused: register it "
                                  "again for a new version (lora-cache register NAME PATH)")


def read_exact(fd: int, identity: FileIdentity, what: Path, limit: int) -> bytes:
    """All ``identity.size`` bytes of an open regular file; refused if larger than ``limit``, or if it grows
    or shrinks while read (a /proc or /sys file claims 0 or 4096 bytes and holds something else)."""
    if identity.size > limit:
        raise AdapterFormatError(f"{what} is {identity.size} bytes, more than the {limit} such a file can be: "
                                 "is it the right file?")
    data = b"".join(_chunks(fd, identity.size, what))
    _check_ends(fd, identity.size, what)
    return data


def _chunks(fd: int, size: int, what: Path, chunk: int = BLOCK_BYTES) -> Iterator[bytes]:
    """``size`` bytes of ``fd`` in ``chunk``-byte pieces (positioned reads: the fd's offset is not used)."""
    for offset in range(0, size, chunk):
        want = min(chunk, size - offset)
        got = os.pread(fd, want, offset)
        if len(got) != want:
            raise AdapterChangedError(f"{what} shrank while it was read (stat gave {size} bytes, it ended at "
                                      f"{offset + len(got)}: a file being written, or a /proc or /sys file); wait "
                                      "until it is written completely and register again")
        yield got


def _check_ends(fd: int, size: int, what: Path) -> None:
    if not os.pread(fd, 1, size):
        return
    if size == 0:
        raise AdapterPathError(f"{what} says it is empty but holds bytes: a /proc or /sys file, not an adapter "
                               "file; point the adapter at the real file")
    raise AdapterChangedError(f"{what} grew while it was read (it held more than the {size} bytes stat gave); "
                              "wait until it is written completely and register again")


def digest_weights(fd: int, identity: FileIdentity, what: Path, config: bytes,
                   header_bytes: int) -> tuple[str, int, BlockCrcs]:
    """One pass over the weights: their content version (with the config's bytes, ``content_version_of``), the
    header's CRC and every block's CRC."""
    crcs, hashes, head = [], [], b""
    for block in _chunks(fd, identity.size, what):
        hashed, crc = block_digest(block)
        hashes.append(hashed)
        crcs.append(crc)
        if len(head) < header_bytes:
            head += block[: header_bytes - len(head)]
    _check_ends(fd, identity.size, what)
    return content_version_of(config, identity.size, hashes), zlib.crc32(head), BlockCrcs(crcs)


# -- content versions: the config's bytes and the hash of every weights block ------------------------------

CONTENT_SCHEME = b"lora-cache content version 2\0"  # version 1 hashed the weights in one stream


def block_hash(block: bytes | memoryview) -> bytes:
    """The hash of one ``BLOCK_BYTES`` block of weights (the last may be shorter). A content version hashes these,
    not the weights in one stream, so that a push's blocks hash on several cores at once (``pushed.digest``)."""
    return hashlib.blake2b(block, digest_size=16).digest()


def block_digest(block: bytes | memoryview) -> tuple[bytes, int]:
    """One block's hash (``block_hash``) and CRC-32: what a content version and a read's check take of it."""
    return block_hash(block), zlib.crc32(block)


def content_version_of(config: bytes, size: int, block_hashes: Iterable[bytes]) -> str:
    """The content version of an adapter: a hash of its config's bytes, its weights' size and the hash of each
    of its weights' blocks in order (``block_hash``); the same bytes give the same version however they are read."""
    digest = hashlib.blake2b(CONTENT_SCHEME, digest_size=8)
    digest.update(len(config).to_bytes(8, "little"))
    digest.update(config)
    digest.update(size.to_bytes(8, "little"))
    for hashed in block_hashes:
        digest.update(hashed)
    return digest.hexdigest()


def header_matches(fd: int, header_bytes: int, header_crc: int) -> bool:
    """Whether the file's safetensors header is still the one registered (a few KiB: cheap on every read)."""
    return zlib.crc32(os.pread(fd, header_bytes, 0)) == header_crc


def unchanged_since_open(fd: int, what: Path, before: FileIdentity) -> None:
    """Refuse a file that changed while it was registered (its bytes were read at different moments)."""
    change = before.changes(FileIdentity.of(os.fstat(fd)))
    if change:
        raise AdapterChangedError(f"{what} changed while it was being registered ({change}); wait until it is "
                                  "written completely and register it again")


# -- identity versions: the version from the file's identity, its content pinned by the first read ----------


def identity_version(real: Path, identity: FileIdentity, config: bytes, header: bytes) -> str:
    """The version of a settled file taken from what stat says of it on this machine's boot (``HOST``), its real
    path, its config's bytes and its safetensors header, without reading the weights: a write, a truncation or a
    rename-over changes the identity and so the version. Its content is pinned by the first read (``publish_pin``)."""
    digest = hashlib.blake2b(b"lora-cache identity version 1\0", digest_size=8)
    for part in (HOST.encode(), str(real).encode(), repr(tuple(identity)).encode(), config, header):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def settled_at(identity: FileIdentity, now_ns: int) -> bool:
    """Whether a file last changed at ``identity.ctime_ns`` shows any write after ``now_ns`` in its stat (the racy
    window is over): only then may its version come from its identity."""
    return now_ns - identity.ctime_ns >= RACY_NS


def content_crcs(fd: int, size: int, what: str | Path) -> BlockCrcs:
    """The CRC-32 of every ``BLOCK_BYTES`` block of the open ``size``-byte file (positioned reads, no page mapped);
    ``AdapterChangedError`` if it ends early."""
    crcs = []
    for offset in range(0, size, BLOCK_BYTES):
        want = min(BLOCK_BYTES, size - offset)
        block = os.pread(fd, want, offset)
        if len(block) != want:
            raise AdapterChangedError(f"{what} shrank while its content was pinned (it ended at byte "
                                      f"{offset + len(block)} of {size}); the read is refused: register it again")
        crcs.append(zlib.crc32(block))
    return BlockCrcs(crcs)


PIN_MAGIC = b"LCPIN1\0\0"
VERSION_RE = re.compile(r"^[0-9a-f]{16}$")


def pin_dir() -> Path:
    """This machine's directory of pinned contents, shared by every process of this user (``LORA_CACHE_PIN_DIR``,
    else ``lora-cache-pins-UID`` in the temporary directory): created private, refused unless it is a directory
    of this user that no one else may write."""
    path = Path(os.environ.get("LORA_CACHE_PIN_DIR") or Path(tempfile.gettempdir()) / f"lora-cache-pins-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise AdapterPathError(f"{path}, where identity versions' contents are pinned, is not a directory of this "
                               f"user (uid {os.getuid()}) that only it may write (mode {oct(st.st_mode)}, owner "
                               f"{st.st_uid}); remove it, or set LORA_CACHE_PIN_DIR to a private directory")
    return path


def _pin_path(version: str) -> Path:
    if not VERSION_RE.match(version):
        raise AdapterFormatError(f"version {version!r} is not 16 hex digits; an identity version always is: the "
                                 "registration was corrupted, register the adapter again")
    return pin_dir() / f"{version}.crc"


def _pin_bytes(source: WeightsSource, crcs: BlockCrcs) -> bytes:
    size, header_crc = source.identity.size.to_bytes(8, "little"), source.header_crc.to_bytes(4, "little")
    body = PIN_MAGIC + size + header_crc + crcs.packed
    return body + zlib.crc32(body).to_bytes(4, "little")


def load_pin(source: WeightsSource) -> BlockCrcs | None:
    """The content pinned on this machine for ``source``'s version (an identity version), or None if no read
    has pinned it yet. ``AdapterChangedError`` for a pin that does not fit the version (size, header)."""
    path = _pin_path(source.version)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    blocks = -(-source.identity.size // BLOCK_BYTES)
    if len(data) != len(PIN_MAGIC) + 16 + 4 * blocks or not data.startswith(PIN_MAGIC) or \
            zlib.crc32(data[:-4]) != int.from_bytes(data[-4:], "little"):
        raise AdapterChangedError(f"{path}, the pinned content of version {source.version} ({source.path}), is "
                                  "corrupt or of another file; delete it (the next read pins the file again)")
    crcs = BlockCrcs(data[len(PIN_MAGIC) + 12 : -4])
    if data != _pin_bytes(source, crcs):
        raise AdapterChangedError(f"{path}, the pinned content of version {source.version} ({source.path}), was "
                                  "taken of another file (size or header); delete it and register the adapter again")
    return crcs


def publish_pin(source: WeightsSource, crcs: BlockCrcs) -> BlockCrcs:
    """Pin ``crcs`` as the content of ``source``'s version on this machine, unless a read pinned it first
    (atomically: the first ``link`` wins); the content pinned, the first reader's."""
    path = _pin_path(source.version)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".pin-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_pin_bytes(source, crcs))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pinned = load_pin(source)
                assert pinned is not None, f"{path} exists and was not read"
                return pinned
            return crcs
        finally:
            os.unlink(tmp)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise AdapterPathError(
            f"{path.parent}, where identity versions' contents are pinned, has no room ({e.strerror}): the read of "
            f"{source.path} is refused until its version's content is pinned for every process of this machine; "
            f"free space there, or set LORA_CACHE_PIN_DIR to a private directory with room (a pin takes 4 bytes per "
            "MiB of adapter)") from e
