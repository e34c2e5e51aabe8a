"""The version proof of a read (lifecycle step 5): a read returns only the bytes its version was registered
with (``lora_cache.adapters.files``), or refuses with ``AdapterChangedError``.

The file is stat'ed and compared with the registered identity before it is opened (a FIFO or device swapped in
is never opened), read through one fd that is ``fstat``'ed against it (a rename-over between the two is caught),
its header's CRC is compared, the blocks the read copied are CRC-checked as ``verify`` says (``VERIFY``), and the
fd is ``fstat``'ed again after the copy (a write during the read is caught; ``workers.reads.shard``).

An identity version (``lora_cache.adapters.files.identity_version``) has no block CRCs until its first read on
this machine pins them (``_pin_first``, once per machine: later reads, in any process, take the pin). What is
proven is remembered per process, bounded (``workers.lru.BoundedLRU``): a file's identity accepted again after a
full check, pinned CRCs, a racy version's settled blocks.
"""

from __future__ import annotations

import functools
import mmap
import os
import random
import stat
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch

from lora_cache.adapters.files import (
    BLOCK_BYTES,
    BlockCrcs,
    FileIdentity,
    WeightsSource,
    content_crcs,
    file_kind,
    load_pin,
    publish_pin,
    same_file,
)
from lora_cache.adapters.peft import FLOAT_DTYPES, parse_tensors
from lora_cache.adapters.shards import ShardEntry
from lora_cache.errors import AdapterChangedError, AdapterFormatError
from workers.lru import BoundedLRU
from workers.reads.plan import FileTensor
from workers.reads.positioned import FileShrank, bad_block, crc32

# How much of what a read copied it checks against the version's CRCs (hashed at registration, or, for an
# identity version, pinned on this machine by its first read: ``_pin_first``), on top of the identity and
# header checks every read makes (bench/RESULTS.md, "What the content check costs"). A racy version (changed
# within RACY_NS of its registration) is checked in full whatever the mode, until a check after its window.
VERIFY = {
    "identity": "identity and header only: catches any change a file system records in stat",
    "sample": "plus one of the blocks read, at random: catches an overwrite by other content even where "
              "stat does not show it (a coarse or lying file system) for one 1 MiB CRC (under 0.5 ms)",
    "content": "plus every block read: no change of the bytes read goes unseen; costs a CRC of the shard",
}


# What this process has proven, each bounded (oldest first out):
# (path, version) -> the registered source under the file's new identity, after a full check (``_revalidated``)
_ACCEPTED: BoundedLRU[tuple[str, str], WeightsSource] = BoundedLRU(1024)
# (path, version) -> an identity version's pinned CRCs, this process's (``_pin_first``, ``load_pin``)
_PINS: BoundedLRU[tuple[str, str], BlockCrcs] = BoundedLRU(1024)
# (path, version, identity) -> a racy version's blocks proven after its racy window (``settle_blocks``)
_SETTLED: BoundedLRU[tuple[str, str, FileIdentity], set[int]] = BoundedLRU(1024)


def chunk_checks(source: WeightsSource, blocks: tuple[int, ...], verify: str) -> list[int]:
    """The blocks of a chunk (``blocks``: all it touches) that a split read checks: as ``_blocks_to_check``."""
    if verify not in VERIFY:
        raise AdapterFormatError(f"verify {verify!r} is not one of {', '.join(VERIFY)}")
    if source.racy and verify != "content":
        done = _SETTLED.peek((source.path, source.version, source.identity)) or set()
        return [b for b in blocks if b not in done]
    if verify != "content":  # identity; sample: checked once the chunk is in the buffer (``_sample``)
        return []
    return list(blocks)




def open_unchanged(registered: WeightsSource) -> tuple[int, WeightsSource]:
    """An fd of the registered file and the identity it is checked against from now on.

    The path is stat'ed before the open (a FIFO, a device or a file of another size put in its place is never
    opened) and the fd after it (so a file renamed over it in between is not read). A file of the registered
    size whose identity changed (copied back, touched, re-synced) is checked in full against the registered
    CRCs: the same bytes are accepted under their new identity, other bytes refused."""
    registered = _pinned(registered)
    weights, key = Path(registered.path), (registered.path, registered.version)
    source = _ACCEPTED.peek(key) or registered
    try:
        st = os.stat(weights)
        _regular(weights, st, registered.version)
        if source.identity.changes(now := FileIdentity.of(st)) and now.size != registered.identity.size:
            same_file(weights, source.identity, now, "since", source.version)
        fd = os.open(weights, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise AdapterChangedError(f"{weights} is gone ({e}); it was registered as version {registered.version}: "
                                  "register the adapter again") from e
    try:
        fst = os.fstat(fd)
        _regular(weights, fst, registered.version)
        now = FileIdentity.of(fst)
        if source.identity.changes(now):
            if now.size != registered.identity.size:
                same_file(weights, source.identity, now, "since", source.version)
            source = _revalidated(fd, registered, now)
        if not source.pinned:
            source = _pin_first(fd, source)
        return fd, source
    except BaseException:
        os.close(fd)
        raise


def _regular(weights: Path, st: os.stat_result, version: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise AdapterChangedError(f"{weights} is now a {file_kind(st.st_mode)}, not the regular file registered as "
                                  f"version {version}: refused without reading it; put the adapter file back and "
                                  "register it again")


def _revalidated(fd: int, registered: WeightsSource, now: FileIdentity) -> WeightsSource:
    """``registered`` under the file's new identity ``now``, if every block still has its registered CRC."""
    checked_at = time.time_ns()
    change = registered.identity.changes(now)
    if not registered.pinned:  # an identity version no read has pinned: nothing proves these bytes are its own
        raise AdapterChangedError(f"{registered.path} changed since it was registered as version "
                                  f"{registered.version}: {change}; that version was taken from the file's identity "
                                  "and no read pinned its content before the change, so nothing proves these bytes "
                                  "are its own: the read is refused; register it again for a new version "
                                  "(lora-cache register NAME PATH)")
    try:  # by preadv, no page mapped: a file cut short now is refused, never a SIGBUS
        bad = bad_block(fd, registered.block_crcs, now.size, range(len(registered.block_crcs)), BLOCK_BYTES)
    except FileShrank as e:
        raise AdapterChangedError(f"{registered.path} shrank while it was checked (it ended before byte {e.offset}) "
                                  f"since it was registered as version {registered.version}; the read is "
                                  "refused: register it again") from e
    if bad is not None or crc32(os.pread(fd, registered.header_bytes, 0)) != registered.header_crc:
        raise AdapterChangedError(f"{registered.path} changed since it was registered as version "
                                  f"{registered.version}: {change}, and its bytes are not the ones registered "
                                  f"(block {bad} of {BLOCK_BYTES} bytes differs); a read under that version would "
                                  "return other bytes, so it is refused: register it again for a new version "
                                  "(lora-cache register NAME PATH)")
    source = registered._replace(identity=now, registered_ns=checked_at)  # racy again if ``now`` is recent
    _ACCEPTED.put((registered.path, registered.version), source, refresh=False)
    return source




def _pinned(registered: WeightsSource) -> WeightsSource:
    """``registered`` with its content's CRCs, if they are known: hashed at registration (a content version), or
    pinned on this machine by a read of its identity version (this process's, or another's through the pin
    directory); as it is if no read pinned it yet."""
    if registered.pinned:
        return registered
    key = (registered.path, registered.version)
    crcs = _PINS.peek(key)
    if crcs is None:
        crcs = load_pin(registered)
        if crcs is None:
            return registered
        _keep_pin(key, crcs)
    return registered._replace(block_crcs=crcs)


def _keep_pin(key: tuple[str, str], crcs: BlockCrcs) -> None:
    _PINS.put(key, crcs)


def _pin_first(fd: int, source: WeightsSource) -> WeightsSource:
    """The first read of an identity version on this machine pins its content: every block's CRC, taken through
    the open ``fd`` whose identity is the registered one before and after (so, stat being honest, the bytes the
    file held at registration), published for every process of this machine; if another read published first,
    its CRCs are the version's, and other bytes here are refused (never two contents under one version)."""
    weights = Path(source.path)
    crcs = content_crcs(fd, source.identity.size, weights)
    if zlib.crc32(os.pread(fd, source.header_bytes, 0)) != source.header_crc:
        raise AdapterChangedError(f"{weights} changed since it was registered as version {source.version}: its "
                                  "header is not the one registered; the read is refused: register it again")
    same_file(weights, source.identity, FileIdentity.of(os.fstat(fd)), "while its content was pinned, after",
              source.version)
    pinned = publish_pin(source, crcs)
    if pinned != crcs:
        bad = next(b for b in range(len(crcs)) if crcs[b] != pinned[b])
        raise AdapterChangedError(f"{weights} holds other bytes (block {bad} of {BLOCK_BYTES} bytes differs) than "
                                  f"another read pinned as the content of version {source.version} on this machine, "
                                  "though its stat did not change (a file system that does not show every write): "
                                  "the read is refused; register it again for a new version")
    _keep_pin((source.path, source.version), pinned)
    return source._replace(block_crcs=pinned)


def checked_index(fd: int, source: WeightsSource) -> dict[str, FileTensor]:
    """Where every tensor is, from the header this fd holds now, if it is the one registered."""
    head = os.pread(fd, source.header_bytes, 0)
    if crc32(head) != source.header_crc:
        raise AdapterChangedError(f"{source.path} changed since it was registered as version {source.version}: its "
                                  "header is not the one registered (rewritten in place, same size and stat "
                                  "times); the read is refused: register it again for a new version")
    return parse_index(head, source.identity.size)



# -- the content check ------------------------------------------------------------------------------------



def blocks_of(t: FileTensor, e: ShardEntry) -> range:
    """The blocks holding the bytes ``e`` reads of ``t`` (from its first byte read to its last)."""
    row = t.shape[-1] * t.dtype.itemsize
    first = t.start + e.rows.start * row + e.cols.start * t.dtype.itemsize
    end = t.start + (e.rows.stop - 1) * row + e.cols.stop * t.dtype.itemsize
    return range(first // BLOCK_BYTES, (end - 1) // BLOCK_BYTES + 1)


def _blocks_to_check(source: WeightsSource, index: dict[str, FileTensor], entries: tuple[ShardEntry, ...],
                     verify: str) -> list[int]:
    if verify not in VERIFY:
        raise AdapterFormatError(f"verify {verify!r} is not one of {', '.join(VERIFY)}")
    if source.racy and verify != "content":
        done = _SETTLED.peek((source.path, source.version, source.identity)) or set()
        return sorted({b for e in entries for b in blocks_of(index[e.key], e)} - done)
    if verify == "identity" or not entries:
        return []
    if verify == "sample":
        e = random.choice(entries)
        return [random.choice(blocks_of(index[e.key], e))]
    return sorted({b for e in entries for b in blocks_of(index[e.key], e)})


def _bad_block(mapped: mmap.mmap, source: WeightsSource, blocks: Iterable[int]) -> int | None:
    """The first of ``blocks`` whose CRC is not the registered one, or None."""
    with memoryview(mapped) as view:
        return next((b for b in blocks
                     if crc32(view[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES]) != source.block_crcs[b]), None)


def _check_blocks(mapped: mmap.mmap, source: WeightsSource, blocks: list[int], settle: bool = True) -> None:
    """Refuse the read if one of ``blocks`` is not as registered; ``settle``: remember the blocks proven (the
    single reader's check, from the mapped file)."""
    checked_at = time.time_ns()  # before the check: the bytes seen are at least this recent
    bad = _bad_block(mapped, source, blocks)
    if bad is not None:
        raise changed_block(source, bad)
    if settle:
        settle_blocks(source, blocks, checked_at)


def changed_block(source: WeightsSource, bad: int) -> AdapterChangedError:
    return AdapterChangedError(
        f"{source.path} changed since it was registered as version {source.version}: bytes "
        f"{bad * BLOCK_BYTES}-{(bad + 1) * BLOCK_BYTES} are not the ones registered (rewritten in place with "
        "the same size and stat times); the read is refused: register it again for a new version")


def settle_blocks(source: WeightsSource, blocks: list[int], checked_at: int) -> None:
    """A racy version's ``blocks``, checked at ``checked_at``, stay proven if the racy window was over by then:
    later writes must show in stat."""
    if source.racy and blocks and source.settled(checked_at):
        key = (source.path, source.version, source.identity)  # proofs hold for this identity only
        _SETTLED.get_or_create(key, set).update(blocks)


# -- the header ------------------------------------------------------------------------------------------


def tensor_index(path: str, version: str, size: int) -> dict[str, FileTensor]:
    """key -> where its bytes are, from the safetensors header of ``path`` (of ``version``, ``size`` bytes)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise AdapterFormatError(f"its safetensors header length {n} does not fit the {size}-byte file")
        f.seek(0)
        return parse_index(f.read(8 + n), size)


@functools.lru_cache(maxsize=512)  # ~50 KiB of header and its index per 8B adapter
def parse_index(head: bytes, size: int) -> dict[str, FileTensor]:
    """key -> where its bytes are, from a safetensors header (its 8-byte length and its JSON), parsed once per
    header by registration's own parser (``peft.parse_tensors``: every tensor inside the ``size``-byte file)."""
    try:
        tensors = parse_tensors(head[8:], size)
    except (ValueError, KeyError, TypeError) as e:  # the file changed since registration
        raise AdapterFormatError(f"the safetensors header no longer parses ({e}); register the adapter again") from e
    index = {}
    for key, (dtype, shape, begin) in tensors.items():
        if dtype not in FLOAT_DTYPES:  # registration refuses these; the file changed since
            raise AdapterFormatError(f"tensor {key!r} is {dtype}, not one of {sorted(FLOAT_DTYPES)}")
        index[key] = FileTensor(getattr(torch, FLOAT_DTYPES[dtype]), shape, len(head) + begin)
    return index
