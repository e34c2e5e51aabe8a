"""Tensors as safetensors bytes in one pass (lifecycle step 0: a push's payload, issue 44 item 5).

``safetensors.torch.save`` copies each tensor to bytes and then joins them (two passes over the weights, ~1 GB/s
on a CPU core); ``safetensors_bytes`` lays out the header first and copies each tensor once into its place in one
buffer (a GPU tensor straight from the device into it; CPU tensors in groups on the push's threads,
``passes``). The result is a safetensors file's bytes that the format's
own loader reads back (``tests/test_push.py``): a header of JSON padded with spaces to a multiple of 8, the tensors
back to back in the header's (name) order, each tensor's ``data_offsets`` from the header's end. For tensors of one
dtype (an adapter's) these are the very bytes ``safetensors.torch.save`` writes (it orders data by dtype, then name),
so a pushed version's content hash did not change with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import torch

from lora_cache.adapters.passes import PASS_BYTES, passes
from lora_cache.errors import AdapterFormatError

DTYPE_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
               torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int32: "I32", torch.float32: "F32", torch.int64: "I64", torch.float64: "F64"}


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> np.ndarray:
    """The safetensors bytes of ``tensors`` (names sorted), as a writable uint8 array over one buffer: what
    ``safetensors.torch.save`` gives, with one copy of each tensor. A dtype the format lacks is refused, naming it."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    placed: list[tuple[torch.Tensor, int, int]] = []  # each tensor and its data's [begin, end)
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise AdapterFormatError(f"tensor {name} has dtype {t.dtype}, which safetensors cannot hold; push "
                                     "float32, float16 or bfloat16 weights")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        placed.append((t, offset, offset + size))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    out = np.empty(start + offset, dtype=np.uint8)
    out[:8] = np.frombuffer(len(head).to_bytes(8, "little"), dtype=np.uint8)
    out[8:start] = np.frombuffer(head, dtype=np.uint8)
    if any(t.device.type != "cpu" for t, _, _ in placed):  # from a device: one copy after another, as it serves them
        flat = torch.from_numpy(out)
        for t, begin, end in placed:
            flat[start + begin:start + end].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return out

    def copy(group: list[tuple[torch.Tensor, int, int]]) -> None:  # numpy's copies: one thread each, GIL free
        for t, begin, end in group:
            out[start + begin:start + end] = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()

    groups: list[list[tuple[torch.Tensor, int, int]]] = [[]]
    for t, begin, end in placed:  # about PASS_BYTES a group, each copied by one of the push's threads
        if groups[-1] and end - groups[-1][0][1] > PASS_BYTES:
            groups.append([])
        groups[-1].append((t, begin, end))
    list(passes().map(copy, groups))
    return out
