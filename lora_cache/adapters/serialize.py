"""Tensors as safetensors bytes in one pass (lifecycle step 0: a push's payload, issue 44 item 5).

``safetensors.torch.save`` copies each tensor to bytes and then joins them (two passes over the weights, ~1 GB/s on
a CPU core); ``safetensors_bytes`` lays out the header first and copies each tensor once into its place in one
buffer: CPU tensors in groups on the push's threads (``passes``); a trainer's GPU tensors gathered on their device
(one kernel for up to ``GATHER_BYTES`` of consecutive tensors) and copied to the host through two pinned stages, not
one synchronous transfer per tensor (an 8B rank-16 adapter has 448). The result is a safetensors file's bytes that
the format's own loader reads back (``tests/test_push.py``): a header of JSON padded with spaces to a multiple of 8,
the tensors back to back in the header's (name) order, each tensor's ``data_offsets`` from the header's end. For
tensors of one dtype (an adapter's) these are the very bytes ``safetensors.torch.save`` writes (it orders data by
dtype, then name), so a pushed version's content hash did not change with it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from concurrent.futures import Future, wait

import numpy as np
import torch

from lora_cache.adapters.passes import PASS_BYTES, passes
from lora_cache.errors import AdapterFormatError

GATHER_BYTES = 256 << 20  # a trainer's GPU tensors are gathered on their device this much at a time
STAGE_BYTES = 32 << 20  # ... and cross to the host through two pinned stages of this size (``to_host``)
_STAGE_LOCK = threading.Lock()
_STAGES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
Placed = tuple[torch.Tensor, int, int]  # a tensor and its data's [begin, end) in the file's data section

DTYPE_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
               torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int32: "I32", torch.float32: "F32", torch.int64: "I64", torch.float64: "F64"}


def safetensors_layout(tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[Placed]]:
    """(the 8-byte length and the padded header JSON, each tensor with its data's [begin, end) in name order) of the
    safetensors file of ``tensors``. A dtype the format lacks is refused, naming it."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    placed: list[Placed] = []  # each tensor and its data's [begin, end)
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
    return len(head).to_bytes(8, "little") + head, placed


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> np.ndarray:
    """The safetensors bytes of ``tensors`` (names sorted), as a writable uint8 array over one buffer: what
    ``safetensors.torch.save`` gives, with one copy of each tensor. A dtype the format lacks is refused, naming it."""
    head, placed = safetensors_layout(tensors, metadata)
    start = len(head)
    out = np.empty(start + (placed[-1][2] if placed else 0), dtype=np.uint8)
    out[:start] = np.frombuffer(head, dtype=np.uint8)
    on_cpu = [p for p in placed if p[0].device.type == "cpu"]
    for run in device_runs([p for p in placed if p[0].device.type != "cpu"]):
        copy_run(out[start:], run)

    def copy(group: list[Placed]) -> None:  # numpy's copies: one thread each, GIL free
        for t, begin, end in group:
            out[start + begin:start + end] = as_bytes(t).numpy()

    groups: list[list[Placed]] = [[]]
    for t, begin, end in on_cpu:  # about PASS_BYTES a group, each copied by one of the push's threads
        if groups[-1] and end - groups[-1][0][1] > PASS_BYTES:
            groups.append([])
        groups[-1].append((t, begin, end))
    list(passes().map(copy, [g for g in groups if g]))
    return out


def device_image(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The safetensors file of ``tensors`` as one uint8 buffer on their device, written on its current stream: the
    image a trainer pushes from its GPU (issue 44 item 5), which each rank reads its shard from by CUDA IPC
    (``workers.reads.device``). ``out``: the buffer of the trainer's last push, written in place when the image
    has its size (so the ranks' open handles stay valid), else refused naming both sizes. The bytes are
    ``safetensors_bytes``'s. Every tensor must be on one device."""
    return image_and_head(tensors, metadata, out)[0]


def image_and_head(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, bytes]:
    """``device_image``, and the image's first bytes (its 8-byte length and header) as host bytes: what a device
    push declares to the controller (``integrations.device_push``)."""
    head, placed = safetensors_layout(tensors, metadata)
    if not placed:
        raise AdapterFormatError("a pushed image needs at least one tensor; push the adapter's lora_A and lora_B")
    devices = {t.device for t, _, _ in placed}
    if len(devices) != 1:
        raise AdapterFormatError(f"a pushed image's tensors are on {sorted(map(str, devices))}: gather them on one "
                                 "device (the one the ranks open) before pushing")
    device = devices.pop()
    size = len(head) + placed[-1][2]
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != size or out.device != device:
        raise AdapterFormatError(f"the image buffer given is {out.dtype} {tuple(out.shape)} on {out.device}, but this "
                                 f"push's image is {size} bytes (uint8) on {device}: pass out=None for a new buffer "
                                 "(the ranks open its handle again)")
    header = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    out[:len(head)].copy_(header.pin_memory() if device.type == "cuda" else header, non_blocking=True)
    torch.cat([as_bytes(t) for t, _, _ in placed], out=out[len(head):])  # one batched copy on the device
    return out, head


class ImageLayout:
    """An image buffer (``image_and_head``'s) and the layout its tensors were written in, for the trainer's next
    pushes: tensors of the same names, shapes, dtypes and device are copied into their places in one multi-tensor
    copy on the current stream (``write``), the header left as it was written, with no layout worked out again (an
    8B rank-16 adapter's 448 tensors: ~2.4 ms of Python on an H100 host, measured, against a 1 ms shard copy)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], image: torch.Tensor, head: bytes) -> None:
        _, placed = safetensors_layout(tensors)
        self.image, self.head = image, head
        self.names = tuple(sorted(tensors))
        self.keys = frozenset(self.names)
        self.shapes = [tensors[n].shape for n in self.names]
        self.dtypes = [tensors[n].dtype for n in self.names]
        data = image[len(head):]
        # each tensor's place as a view of its dtype and shape (one dtype an adapter: aligned), so the copy is typed
        self.views = [data[begin:end].view(t.dtype).view(t.shape) for t, begin, end in placed]

    def fits(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """``tensors`` in the layout's order if they are its names, shapes, dtypes and device, else None."""
        if tensors.keys() != self.keys:
            return None
        ordered = [tensors[n] for n in self.names]
        if all(t is v for t, v in zip(ordered, self.views, strict=True)):
            return ordered  # the layout's own views (``DevicePusher.views``): nothing to compare
        device = self.image.device
        if ([t.shape for t in ordered] != self.shapes or [t.dtype for t in ordered] != self.dtypes
                or any(t.device != device for t in ordered)):
            return None
        return ordered

    def write(self, ordered: list[torch.Tensor]) -> None:
        """Copy ``fits``'s tensors into their places (queued on the current stream); nothing where they are the
        layout's own views (a trainer that trains in the buffer: ``DevicePusher.views``)."""
        if all(t is v or t.data_ptr() == v.data_ptr() for t, v in zip(ordered, self.views, strict=True)):
            return  # (``fits`` checked their shapes and dtypes, or they are the views: the same first byte is the
            # same place)
        with torch.no_grad():
            torch._foreach_copy_(self.views, ordered)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D uint8 tensor on its device (a copy only where ``t`` is not contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


def device_runs(placed: list[Placed], limit: int = 0) -> list[list[Placed]]:
    """``placed`` (tensors off the CPU, in file order, each with its data's [begin, end)) cut into runs each gathered
    in one kernel and copied in one transfer: tensors of one device that lie back to back in the file, up to
    ``limit`` bytes a run (``GATHER_BYTES``: the gather's own device memory; a larger tensor is a run alone)."""
    limit = limit or GATHER_BYTES
    runs: list[list[Placed]] = []
    for t, begin, end in placed:
        last = runs[-1] if runs else None
        if (last is None or last[-1][2] != begin or last[-1][0].device != t.device
                or end - last[0][1] > limit):
            runs.append([])
        runs[-1].append((t, begin, end))
    return runs


def copy_run(data: np.ndarray, run: list[Placed]) -> None:
    """Copy ``run`` (``device_runs``) into ``data`` (the file's data section): gathered into one buffer on its
    device, then to the host through pinned stages (``to_host``); where the device has no room for the gather, each
    tensor of the run by itself."""
    pieces = [as_bytes(t) for t, _, _ in run]
    try:
        gathered = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    except torch.OutOfMemoryError:  # a trainer's GPU too full for the gather: each tensor crosses by itself
        for (_, begin, end), piece in zip(run, pieces):
            copy_run(data, [(piece, begin, end)])
        return
    dst = data[run[0][1]:run[-1][2]]
    if gathered.device.type == "cuda":
        to_host(dst, gathered)
    else:
        torch.from_numpy(dst).copy_(gathered)


def to_host(dst: np.ndarray, src: torch.Tensor) -> None:
    """Copy the bytes of ``src`` (1-D uint8 on a GPU) into ``dst`` (pageable host memory). A transfer into pageable
    memory runs at a few GB/s on one thread (the driver's own bounce buffer: 4 GB/s on an H200's host); here each
    ``STAGE_BYTES`` goes to a pinned stage at the link's rate while the push's threads copy the stage before out of
    the other one (``passes``), so the bytes cross at about the threads' copy rate. The stages are this process's
    (two per device, made at its first push from a GPU, kept), one transfer at a time."""
    stream = torch.cuda.current_stream(src.device)  # after whatever the trainer's stream wrote into the tensors
    with _STAGE_LOCK, torch.cuda.device(src.device):
        stages = _stages(src.device)
        copies: list[list[Future[None]]] = [[], []]  # each stage's host copies in flight
        try:
            for k, at in enumerate(range(0, src.numel(), STAGE_BYTES)):
                stage, n = stages[k % 2], min(STAGE_BYTES, src.numel() - at)
                for done in copies[k % 2]:  # the stage's last copy out is over before the link writes it again
                    done.result()
                stage[:n].copy_(src[at:at + n], non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
                landed.synchronize()
                host = stage[:n].numpy()
                copies[k % 2] = [passes().submit(np.copyto, dst[at + b:at + min(b + PASS_BYTES, n)],
                                                 host[b:min(b + PASS_BYTES, n)])
                                 for b in range(0, n, PASS_BYTES)]
        finally:  # no copy out of a stage outlives the lock (the next push writes the stages), even on an error
            wait(copies[0] + copies[1])
        for done in copies[0] + copies[1]:
            done.result()


def _stages(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's two pinned stages for ``device`` (``to_host``; under ``_STAGE_LOCK``)."""
    if device not in _STAGES or _STAGES[device][0].numel() != STAGE_BYTES:
        _STAGES[device] = (torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True),
                           torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True))
    return _STAGES[device]
