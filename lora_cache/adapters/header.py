"""A safetensors file's header (lifecycle steps 0 and 5): its length bounded, its JSON parsed and checked as
safetensors checks it, without reading tensor data.

The one parser of the format (``parse_tensors``), for registration (``peft.read_adapter``, ``store``) and for
every read (``workers/reader.py``, through ``peft``): every tensor's bytes its dtype times its shape, the
tensors back to back from the header's end to the end of the file. Headers up to ``CACHED_HEADER_BYTES`` are
parsed once (adapters of one shape and rank share theirs). What the header must hold for a PEFT adapter (keys,
modules, shapes against the model) is ``peft``'s.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

from lora_cache.adapters.files import OpenFile
from lora_cache.errors import AdapterFormatError

MAX_HEADER_BYTES = 16 << 20  # a safetensors header's JSON: parsed holding the GIL, so bounded
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # bytes per element


def show(value: Any, limit: int = 80) -> str:
    """A value for an error message: its repr, clipped (a config may hold anything, of any size)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 24]}...{text[-12:]} ({len(text)} characters)"


def header_size(f: OpenFile, weights: Path) -> int:
    """8 + the safetensors header's length, if it fits the file (else the file is not safetensors)."""
    head = os.pread(f.fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= f.identity.size - 8:
        raise AdapterFormatError(f"{weights} is not a readable safetensors file (its header length {n} does not "
                                 f"fit its {f.identity.size} bytes); it may be truncated or corrupt: re-copy or "
                                 "re-save it")
    if n > MAX_HEADER_BYTES:
        raise AdapterFormatError(f"{weights}: its safetensors header is {n} bytes, more than the {MAX_HEADER_BYTES} "
                                 "a LoRA adapter's needs (a 120-layer model's is under 0.3 MiB); is it an adapter?")
    return 8 + n


def read_header(fd: int, header_bytes: int, size: int, weights: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (safetensors dtype, shape) from the header this fd holds (``parse_header``), without reading
    tensor data. Truncation is caught here."""
    try:
        return parse_header(os.pread(fd, header_bytes - 8, 8), size)
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # bad JSON, an unknown dtype, a bad entry
        why = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
        raise AdapterFormatError(f"{weights} is not a readable safetensors file ({why}); it may be truncated or "
                                 "corrupt: re-copy or re-save it") from e


def parse_header(head: bytes, size: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (safetensors dtype, shape) of ``parse_tensors``."""
    return {key: (dtype, dims) for key, (dtype, dims, _) in parse_tensors(head, size).items()}


def parse_tensors(head: bytes, size: int) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """``_parse_tensors``, remembered for headers up to ``CACHED_HEADER_BYTES`` (adapters of one shape and rank
    have the same header: parsed once; a huge one is not kept)."""
    return _cached_tensors(head, size) if len(head) <= CACHED_HEADER_BYTES else _parse_tensors(head, size)


CACHED_HEADER_BYTES = 1 << 20  # an 8B adapter's header is ~50 KiB; 256 are kept


@functools.lru_cache(maxsize=256)
def _cached_tensors(head: bytes, size: int) -> dict[str, tuple[str, tuple[int, ...], int]]:
    return _parse_tensors(head, size)


def _parse_tensors(head: bytes, size: int) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """key -> (safetensors dtype, shape, first byte after the header) of a safetensors header's JSON ``head``,
    checked as safetensors checks them: every tensor's bytes its dtype times its shape, the tensors back to
    back from the header's end to the end of the ``size``-byte file. The one parser of the format, for
    registration and for every read (``workers/reader.py``). Shared: read only. ValueError, KeyError or
    TypeError for a malformed header."""
    raw = json.loads(head)
    if not isinstance(raw, dict):
        raise ValueError(f"the header is a JSON {type(raw).__name__}, not an object")
    header: dict[str, tuple[str, tuple[int, ...], int]] = {}
    spans = []
    for key, info in raw.items():
        if key == "__metadata__":
            continue
        dtype, dims, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {show(key)} has dtype {show(dtype)}, which safetensors does not define")
        if not all(type(d) is int and d >= 0 for d in (*dims, begin, end)):
            raise ValueError(f"tensor {show(key)}: shape {show(list(dims))} or offsets {show([begin, end])} "
                             "are not sizes")
        if end - begin != math.prod(dims) * SAFETENSORS_DTYPES[dtype]:
            raise ValueError(f"tensor {show(key)}: {end - begin} bytes for {dtype} {show(list(dims))}")
        header[key] = (dtype, dims, begin)
        spans.append((begin, end, key))
    at = 0
    for begin, end, key in sorted(spans):
        if begin != at:
            raise ValueError(f"tensor {show(key)} starts at {begin}, not where the one before it ends ({at})")
        at = end
    if len(head) + 8 + at != size:
        raise ValueError(f"the tensors end at byte {len(head) + 8 + at} of a {size}-byte file")
    return header
