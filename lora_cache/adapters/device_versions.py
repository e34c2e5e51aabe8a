"""The versions of device pushes (lifecycle step 0; issue 44 item 5): made, carried to the ranks, and landed.

A device push's version (``device_source``) is registered before any file of it exists. Its id is made here
(``device_known``): a hash of the name, the trainer's tag, the config, the header and the size, and a nonce, so
that no two device pushes ever share an id, even the same tag pushed again after its name was unregistered: a slot
filled from one image can never be taken for another's bytes (invariant 1), whatever a rank still holds. Its
``KnownVersion`` carries the config and header (``objects.pack_meta``), from which every rank builds the spec
(``device_spec``) without a file, as a store version's.

When the node copy is written (``DevicePushes.land``), it is hashed as any push's (``pushed.digest``), and the version
keeps its id: ``landed_known`` is the file's proof under that id (its identity, header and block CRCs), so every
rank then takes the file as it takes a pushed file (``peft.proves``), and a rank on another node copies it proven by
its block CRCs (``workers.control.node_copies``) rather than by the content hash the id is not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from lora_cache.adapters.device_source import DeviceSource
from lora_cache.adapters.files import WeightsSource
from lora_cache.adapters.objects import pack_meta, unpack_meta
from lora_cache.adapters.peft import AdapterSpec, KnownVersion
from lora_cache.adapters.pushed import PushDigest, head_spec
from lora_cache.adapters.shapes import ModelShape
from lora_cache.errors import AdapterChangedError, AdapterFormatError, ConflictError

if TYPE_CHECKING:
    from lora_cache.adapters.catalog import AdapterCatalog


def device_known(name: str, tag: str, config_bytes: bytes, head: bytes, size: int,
                 ahead: bool = False) -> KnownVersion:
    """The version of a device push of ``name`` under ``tag`` (checked by ``pushed.check_head``): a new id each
    call (the module's docstring), carrying its config and header for the ranks. ``ahead``: registered ahead of its
    push (``DeviceSource.ahead``; ``committed`` is the same version made current)."""
    n = 8 + int.from_bytes(head[:8], "little")
    meta = pack_meta(config_bytes, bytes(head[:n]))
    if not meta:
        raise AdapterFormatError(f"device push {name}@{tag}: its config and header ({len(config_bytes) + n} bytes) "
                                 "are over what a registration carries to the ranks; push it by value "
                                 "(push_in_ray) instead")
    config_digest = hashlib.blake2b(config_bytes, digest_size=8)
    digest = config_digest.copy()
    digest.update(f"device\0{name}\0{tag}\0{size}\0".encode() + bytes(head[:n]) + os.urandom(16))
    source = DeviceSource(tag, size, n, zlib.crc32(head[:n]), ahead)
    return KnownVersion(digest.hexdigest(), config_digest.hexdigest(), "", source, meta)


def committed(known: KnownVersion) -> KnownVersion:
    """Device version ``known``, registered ahead of its push, as its push's commit registers it: the same id and
    declaration, current wherever it is registered."""
    source = known.source
    assert isinstance(source, DeviceSource)
    return known._replace(source=source._replace(ahead=False))


def device_spec(name: str, directory: Path, shape: ModelShape, max_rank: int, known: KnownVersion) -> AdapterSpec:
    """The spec of a device-only version from what ``known`` carries (no file): its config and header must be the
    ones it declared (length, CRC, config digest), or ``AdapterChangedError``. ``directory``: where its node copy
    lands (``PushArea.path``; it need not exist)."""
    source = known.source
    assert isinstance(source, DeviceSource)
    config_bytes, head = unpack_meta(known.meta, f"device push {name}@{source.tag}")
    config_digest = hashlib.blake2b(config_bytes, digest_size=8).hexdigest()
    if (len(head), zlib.crc32(head), config_digest) != (source.header_bytes, source.header_crc, known.config_digest):
        raise AdapterChangedError(f"device push {name}@{source.tag}: the carried config and header are not those of "
                                  f"version {known.version}; refused: push it again")

    def unreadable(e: Exception) -> AdapterFormatError:
        return AdapterFormatError(f"device push {name}@{source.tag}: its header is not readable safetensors ({e}); "
                                  "push it again")

    spec = head_spec(name, directory, config_bytes, bytes(head[8:]), source.size, shape, max_rank, known.version,
                     config_digest, unreadable)
    return dataclasses.replace(spec, store_meta=known.meta, device=source)


def landed_known(content: PushDigest, directory: Path, known: KnownVersion) -> KnownVersion:
    """The proof of device version ``known``'s node copy in ``directory``, hashed as ``content``: the file's, under
    the device version's id. ``AdapterChangedError`` if the file is not the image declared (size, header)."""
    device = known.source
    assert isinstance(device, DeviceSource)
    found = content.known(directory)
    source = found.source
    assert isinstance(source, WeightsSource)
    if (source.identity.size, content.header_bytes, content.header_crc, content.config_digest) != (
            device.size, device.header_bytes, device.header_crc, known.config_digest):
        raise AdapterChangedError(f"the node copy of device push {directory.parent.name}@{device.tag} is not the image "
                                  f"pushed as version {known.version} ({source.identity.size} bytes, header CRC "
                                  f"{content.header_crc:08x}; pushed {device.size} bytes, {device.header_crc:08x}): "
                                  "not landed; the trainer's buffer was written before its copy was taken")
    return found._replace(version=known.version, source=source._replace(version=known.version))


def as_copy_of(copy: PushDigest, directory: Path, known: KnownVersion) -> KnownVersion | None:
    """The proof of ``directory``, hashed as ``copy``, as a copy of the pushed version ``known``: ``copy.known``
    if its content hash is the version (a push by value), the same under ``known``'s id if the file is the same bytes
    by its header and every block's CRC (``same_bytes``: a landed device version, whose id is not its content hash);
    None if neither."""
    found = copy.known(directory)
    if copy.version == known.version:
        return found
    source = found.source
    if not same_bytes(known, copy) or not isinstance(source, WeightsSource):
        return None
    return found._replace(version=known.version, source=source._replace(version=known.version))


def same_bytes(known: KnownVersion, copy: PushDigest) -> bool:
    """Whether ``copy`` hashes the bytes of the landed device version ``known`` (its header's CRC, every block's)."""
    source = known.source
    return (isinstance(source, WeightsSource) and source.pinned and source.version == known.version
            and (source.header_bytes, source.header_crc, source.block_crcs) == (
                copy.header_bytes, copy.header_crc, copy.block_crcs))


def host_readable(spec: AdapterSpec) -> AdapterSpec:
    """``spec``, if a host read can load it; ``ConflictError`` for a device-only version (no file yet)."""
    if spec.device_only:
        raise ConflictError(f"adapter {spec.name}@{spec.version} is a device push (tag {spec.device.tag}) whose node "  # type: ignore[union-attr]
                            "copy has not landed: it loads only from the trainer's buffer, on the replicas the trainer "
                            "pushed to; wait for its node copy (the push's land) or ask for the version before it")
    return spec


def image_only(catalog: AdapterCatalog, name: str, version: str) -> bool:
    """Whether ``catalog`` holds ``name@version`` as a device push's version whose node copy has not landed: loadable
    from its trainer's image only (``host_readable`` refuses it), so no rank can load it on demand. Nothing is built
    (a lazily registered version never is one); False for a version not kept. The catalog's friend, as ``Ahead``."""
    with catalog._lock:
        entry: object = catalog._specs.get(name)
        if entry is None or getattr(entry, "version", None) != version:
            older, ahead = catalog._older.get(name), catalog._ahead.get(name)
            entry = (older.get(version) if older else None) or (ahead.get(version) if ahead else None)
    return isinstance(entry, AdapterSpec) and entry.device_only
