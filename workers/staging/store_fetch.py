"""A store object fetched whole into a local file, proven on the way (lifecycle step 5; issue 29).

The object is cut into parts of ``part_bytes`` (whole ``BLOCK_BYTES`` blocks) fetched by ``parallel`` ranged GETs
at once (botocore releases the GIL on the socket reads), each with ``If-Match`` on the registered ETag: a part
of any other version is refused by the store itself (HTTP 412, ``AdapterChangedError``), so a file of mixed
versions is never made. Each part is checked for its length (a truncated object or an answer cut off is
refused), read straight from the socket into one reused buffer (no copy), written in place with ``os.pwrite``
and CRC-32'ed by block (ISA-L's CRC when ``isal`` is installed: the same checksum, three times as fast); the
header's CRC must be the registered one. What comes back is the CRC of every block, which the disk tier keeps as
the local copy's proof (``workers.staging.disk_tier``): every later read of the copy is checked like any adapter file's
(``workers.reads.shard``).

Why whole objects and not each rank's byte ranges: docs/decisions.md, "Adapters from an object store".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from lora_cache.adapters.files import BLOCK_BYTES, BlockCrcs
from lora_cache.adapters.objects import StoreSource
from lora_cache.adapters.store import stream_range
from lora_cache.errors import AdapterChangedError

try:  # ISA-L's CRC-32: the same checksum as zlib's, about 3x as fast (6 against 2 GB/s here); optional
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - without the s3 extra's isal
    from zlib import crc32


def part_spans(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """(start, bytes) of each part of a ``size``-byte object, ``part_bytes`` (whole blocks) each; 0: one part."""
    assert part_bytes % BLOCK_BYTES == 0, "parts must be whole CRC blocks"
    if part_bytes == 0:
        return [(0, size)]
    return [(start, min(part_bytes, size - start)) for start in range(0, size, part_bytes)]


def fetch_object(
    s3: Any, source: StoreSource, fd: int, parallel: int, part_bytes: int, on_part: Callable[[int], None] | None = None,
    pause: Callable[[], None] | None = None,
) -> BlockCrcs:
    """Every byte of ``source`` written to ``fd`` (a file of ``source.size`` bytes) by ranged GETs of that very
    version; the CRC of each block. ``on_part(k)``: told when part k is written (progress; a test's hook).
    ``pause()``: called before each block is taken from the socket (a speculative fetch yielding the store)."""
    spans = part_spans(source.size, part_bytes)
    crcs = [0] * -(-source.size // BLOCK_BYTES)

    def one(k: int) -> None:
        start, nbytes = spans[k]

        def write(offset: int, piece: memoryview) -> None:  # one block (pieces are block-aligned), or the end
            if pause is not None:
                pause()
            written = 0
            while written < len(piece):
                written += os.pwrite(fd, piece[written:], offset + written)
            crcs[offset // BLOCK_BYTES] = crc32(piece)

        stream_range(
            s3, source.bucket, source.key, start, nbytes, source.etag, source.version, write, BLOCK_BYTES, direct=True
        )
        if on_part is not None:
            on_part(k)

    if parallel <= 1 or len(spans) == 1:
        for k in range(len(spans)):
            one(k)
    else:
        with ThreadPoolExecutor(min(parallel, len(spans)), thread_name_prefix="lora-store-get") as pool:
            futures = [pool.submit(one, k) for k in range(len(spans))]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                for f in futures:
                    f.cancel()  # parts not started are not fetched; those started end (the pool waits for them)
                raise failed.exception()  # type: ignore[misc]
    if crc32(os.pread(fd, source.header_bytes, 0)) != source.header_crc:
        raise AdapterChangedError(
            f"{source.url}: the store sent another safetensors header than the one registered "
            f"as version {source.version} under the same ETag {source.etag}; refused: check "
            "the store, and register the adapter again"
        )
    return BlockCrcs(crcs)
