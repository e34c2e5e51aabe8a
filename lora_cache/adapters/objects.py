"""Adapters in an S3-compatible object store: where one is (``StoreUrl``) and which version of its weights
object a registration saw (``StoreSource``). Plain data, no client (``lora_cache.adapters.store`` talks to the
store; ``workers.staging.store_fetch`` fetches).

A store version's identity is the store's own: the weights object's ETag, its VersionId (on a versioned
bucket) and size, with the CRC-32 of its safetensors header and the config's digest (lifecycle step 0).
Every read from the store sends ``If-Match: <ETag>``, so a replaced object is refused by the store itself
(HTTP 412) instead of being mixed with the bytes already fetched; the disk tier then proves every later read
of its copy as a local file's (``workers.staging.disk_tier``).
"""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

from lora_cache.errors import AdapterFormatError, AdapterPathError

SCHEME = "s3://"
MAX_META_BYTES = 256 << 10  # a registration's packed config and header carried to the ranks; a larger one is not
# carried (each rank reads it from the store, as before): an 8B-shaped rank-16 adapter's packs to ~3 KB


def is_store_url(path: object) -> bool:
    return isinstance(path, str | StoreUrl) and str(path).startswith(SCHEME)


class StoreUrl(NamedTuple):
    """``s3://bucket/key``; ``/`` joins a name under it, like a ``Path``."""

    bucket: str
    key: str  # no leading or trailing "/"; "" for the bucket's top

    @classmethod
    def parse(cls, url: str) -> StoreUrl:
        if not url.startswith(SCHEME):
            raise AdapterPathError(f"{url!r} is not an object-store URL; write s3://BUCKET/PREFIX")
        bucket, _, key = url[len(SCHEME) :].partition("/")
        key = key.strip("/")
        if not bucket or not 3 <= len(bucket) <= 63 or not bucket.replace("-", "").replace(".", "").isalnum():
            raise AdapterPathError(
                f"{url!r} names no valid bucket ({bucket!r}); write s3://BUCKET/PREFIX with a "
                "bucket name of 3-63 lowercase letters, digits, '-' or '.'"
            )
        if ".." in key.split("/"):
            raise AdapterPathError(f"{url!r} contains '..'; name the adapter's prefix itself")
        return cls(bucket, key)

    def __truediv__(self, name: str) -> StoreUrl:
        return StoreUrl(self.bucket, f"{self.key}/{name}" if self.key else name)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def under(self, root: StoreUrl) -> bool:
        """Whether this URL is ``root`` or inside it (whole path segments)."""
        return self.bucket == root.bucket and (
            not root.key or self.key == root.key or self.key.startswith(root.key + "/")
        )


class StoreSource(NamedTuple):
    """The weights object of one registered store version: what every fetch asks the store for (``If-Match``)
    and checks (size, header CRC)."""

    bucket: str
    key: str  # the weights object (…/adapter_model.safetensors)
    version: str
    etag: str  # as the store quotes it, e.g. '"9b2cf535f27731c974343645a3985328"'
    version_id: str  # "" on an unversioned bucket
    size: int
    header_bytes: int  # 8 + the safetensors header's length
    header_crc: int

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def pack_meta(config: bytes, header: bytes) -> bytes:
    """A store version's config bytes and safetensors header bytes (with its 8-byte length), as registered, in
    one compressed blob for ``KnownVersion.meta``; b"" if it would exceed ``MAX_META_BYTES``."""
    packed = _compressed(config, header)  # a trainer's device pushes declare the same config and header each time
    if len(packed) > MAX_META_BYTES:
        return b""
    shared = _METAS.setdefault(packed, packed) if len(_METAS) < MAX_SHARED_METAS else _METAS.get(packed, packed)
    return shared  # adapters of one shape and config share one blob in the registering process (and its snapshot)


@functools.lru_cache(maxsize=16)  # the last (config, header)s packed (an 8B header: ~60 KB)
def _compressed(config: bytes, header: bytes) -> bytes:
    return zlib.compress(len(config).to_bytes(4, "little") + config + header, 6)


_METAS: dict[bytes, bytes] = {}  # each distinct blob once (10,000 8B-shaped adapters of one config: ~5.5 KB in all)
MAX_SHARED_METAS = 1024


def unpack_meta(meta: bytes, where: str) -> tuple[bytes, bytes]:
    """(config bytes, header bytes) of ``pack_meta``'s blob; ``AdapterFormatError`` for a malformed one."""
    try:
        raw = zlib.decompressobj().decompress(meta, 101 << 20)
    except zlib.error as e:
        raise AdapterFormatError(f"{where}: the registration's carried metadata is corrupt ({e})") from e
    n = int.from_bytes(raw[:4], "little")
    if len(raw) < 4 + n:
        raise AdapterFormatError(f"{where}: the registration's carried metadata is {len(raw)} bytes, cut short")
    return raw[4 : 4 + n], raw[4 + n :]
