"""Read only this rank's slices of an adapter file into a packed staging buffer (lifecycle step 5).

The file is memory-mapped and every slice is copied in one ``torch._foreach_copy_`` call, which runs with
the GIL released; the header is parsed once per file version. What is left under the GIL is building
the views, 5-8 ms per Llama-3.1-8B shard on the H200's host: a step launched from Python beside it
waits for the GIL at every kernel. So a GPU worker runs this in reader processes
(``workers.reader_proc``), and threads run it only where there is no GPU (bench/RESULTS.md, ``python
-m bench.reader_probe``). A file cut short while it is read, after the size check, raises SIGBUS in the
process that maps it: a reader process dies and the read fails; a reader thread faults its process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import mmap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from lora_cache.errors import AdapterFormatError
from lora_cache.peft import FLOAT_DTYPES, AdapterSpec
from lora_cache.shards import ShardEntry, ShardLayout


class FileTensor(NamedTuple):
    """Where one tensor's bytes are in the file (row-major)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its first element in the file


def read_shard(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor, chunks: Sequence[slice] | None = None,
               on_chunk: Callable[[int], None] | None = None) -> int:
    """Fill ``dest`` (1-D, ``layout.dtype``, >= ``layout.numel``) with the shard; returns bytes read.

    A rank reads only its parts of each matrix (strided views of the mapped file); a file tensor of
    another dtype is converted as it is copied. ``chunks``: ranges of the layout's entries read one
    after another (default: one); ``on_chunk(k)`` runs once the first ``k`` are in ``dest``, so their
    host-to-GPU copies can start while the rest is read (``lora_cache.chunks``).
    """
    return read_slices(spec.weights, spec.version, spec.file_bytes, layout.entries, dest,
                       f"TP {layout.rank}/{layout.tp}", chunks, on_chunk)


def read_slices(weights: Path, version: str, file_bytes: int, entries: tuple[ShardEntry, ...], dest: torch.Tensor,
                shard: str, chunks: Sequence[slice] | None = None,
                on_chunk: Callable[[int], None] | None = None) -> int:
    """``read_shard`` from what a reader process is sent: the file, its registered version and size, the
    layout's entries; ``shard`` names the shard in errors."""
    _check_unchanged(weights, version, file_bytes)
    try:
        index = tensor_index(str(weights), version, file_bytes)
        with open(weights, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: nothing is written back
        try:
            read = 0
            for k, span in enumerate(chunks or (slice(0, len(entries)),)):
                read += _copy_slices(mapped, index, entries[span], dest)
                if on_chunk is not None:
                    on_chunk(k + 1)
            return read
        finally:
            with contextlib.suppress(BufferError):  # a view still alive in a traceback: unmapped when it dies
                mapped.close()
    except (AdapterFormatError, OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        why = str(e) if isinstance(e, AdapterFormatError) else f"{type(e).__name__}: {e}"
        raise AdapterFormatError(f"{weights}: reading the {shard} shard failed ({why}); "
                                 "the file may be truncated or corrupt: re-copy it and register again") from e


def _copy_slices(mapped: mmap.mmap, index: dict[str, FileTensor], entries: tuple[ShardEntry, ...],
                 dest: torch.Tensor) -> int:
    if not entries:
        return 0
    file = torch.frombuffer(mapped, dtype=torch.uint8)
    sources, targets, read = [], [], 0
    for e in entries:
        t = index[e.key]
        numel = math.prod(t.shape)
        if t.start % t.dtype.itemsize:  # not aligned to its element: a view of its own
            whole = torch.frombuffer(mapped, dtype=t.dtype, count=numel, offset=t.start)
        else:
            whole = file[t.start : t.start + numel * t.dtype.itemsize].view(t.dtype)
        sources.append(whole.view(t.shape)[e.rows, e.cols])
        targets.append(dest[e.offset : e.offset + e.numel].view(e.shape))
        read += e.numel * t.dtype.itemsize
    torch._foreach_copy_(targets, sources)  # one call, the GIL released for every copy
    return read


@functools.lru_cache(maxsize=4096)
def tensor_index(path: str, version: str, size: int) -> dict[str, FileTensor]:
    """key -> where its bytes are, from the safetensors header of ``path`` (``version`` and ``size`` key the
    cache: a new version of the file is parsed again). Every tensor must lie inside the file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise AdapterFormatError(f"its safetensors header length {n} does not fit the {size}-byte file")
        header = json.loads(f.read(n))
    index = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in FLOAT_DTYPES:  # registration refuses these; the file changed since
            raise AdapterFormatError(f"tensor {key!r} is {info['dtype']}, not one of {sorted(FLOAT_DTYPES)}")
        dtype = getattr(torch, FLOAT_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end <= size - 8 - n:
            raise AdapterFormatError(f"tensor {key!r} ({info['dtype']} {list(shape)}) has byte range [{begin}, {end}) "
                                     "that does not match its shape or the file")
        index[key] = FileTensor(dtype, shape, 8 + n + begin)
    return index


def _check_unchanged(weights: Path, version: str, file_bytes: int) -> None:
    try:
        size = weights.stat().st_size
    except OSError as e:
        raise AdapterFormatError(f"{weights} is gone ({e}); register the adapter again") from e
    if size != file_bytes:
        raise AdapterFormatError(f"{weights} changed size since it was registered as version {version} "
                                 f"({file_bytes} -> {size} bytes); register it again for a new version")
