"""Read only this rank's slices of an adapter file into a packed staging buffer (lifecycle step 5)."""

from __future__ import annotations

import torch
from safetensors import safe_open

from lora_cache.errors import AdapterFormatError
from lora_cache.peft import AdapterSpec
from lora_cache.shards import ShardLayout


def read_shard(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> int:
    """Fill ``dest`` (1-D, ``layout.dtype``, >= ``layout.numel``) with the shard; returns bytes read.

    Each matrix is read with ``get_slice`` so a rank never reads the other ranks' parts of the file.
    """
    _check_unchanged(spec)
    read = 0
    try:
        with safe_open(str(spec.weights), framework="pt") as f:
            for e in layout.entries:
                part = f.get_slice(e.key)[e.rows, e.cols]
                dest[e.offset : e.offset + e.numel].view(e.shape).copy_(part)
                read += part.numel() * part.element_size()
    except Exception as e:  # safetensors reports truncation and I/O errors with its own types
        raise AdapterFormatError(f"{spec.weights}: reading the TP {layout.rank}/{layout.tp} shard failed ({e}); "
                                 "the file may be truncated or corrupt: re-copy it and register again") from e
    return read


def _check_unchanged(spec: AdapterSpec) -> None:
    try:
        size = spec.weights.stat().st_size
    except OSError as e:
        raise AdapterFormatError(f"{spec.weights} is gone ({e}); register the adapter again") from e
    if size != spec.file_bytes:
        raise AdapterFormatError(f"{spec.weights} changed size since it was registered as version {spec.version} "
                                 f"({spec.file_bytes} -> {size} bytes); register it again for a new version")
