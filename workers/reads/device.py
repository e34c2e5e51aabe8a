"""A rank's shard read from a safetensors image in device memory (lifecycle step 5, the device source of a push).

Issue 44 item 5: a trainer pushes a version from its own GPU. Its buffer holds the adapter's safetensors image (the
8-byte header length, the header, the tensors' bytes: the file a push would write), and a rank that can see that
memory (CUDA IPC, ``torch.multiprocessing``'s handle and event) takes its shard from it without a host copy:

- ``DeviceRead``: the plan, made once per (header, layout). Every slice the host read would make is a gather
  segment (``workers.kernels.gather``): a contiguous slice one segment, a column slice one per row, from the same
  byte arithmetic as the host read (``workers.reads.plan``), so both read the same bytes into the same places. A
  tensor of another dtype than the slot's is a conversion, copied by torch entry by entry.
- ``read_image``: on the given stream (a rank's copy stream), after the trainer's event: one gather launch, the
  conversions, and the proof that the shard is finite as a flag on the device, all without a host sync; the caller
  reads the flag once the returned event has completed (``finite_or_raise``), as the completion watcher polls.

The bytes themselves are the trainer's promise: its event orders the copy after its writes, and it must not write
the buffer again until every rank's copy has completed (the push answers only then). This module does not hash.
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardEntry, ShardLayout
from lora_cache.errors import AdapterFormatError
from workers.kernels.gather import GatherPlan, gather, gather_plan
from workers.reads.finite import check_finite, total_finite
from workers.reads.plan import FileTensor, contiguous, run_of, span_of, strided_of
from workers.reads.proof import parse_index


class DeviceRead(NamedTuple):
    """One layout's read from an image: the gather of every slice of the slot's dtype, and the conversions."""

    layout: ShardLayout
    tensors: Mapping[str, FileTensor]  # where each tensor is in the image
    gather: GatherPlan
    converts: tuple[ShardEntry, ...]  # entries whose file tensor has another dtype than the layout's
    image_bytes: int  # the image's size the plan was made for


def image_index(image_head: bytes, image_bytes: int) -> dict[str, FileTensor]:
    """key -> where its bytes are in an image of ``image_bytes`` bytes whose first bytes are ``image_head`` (the
    8-byte header length and the header JSON, at least): the file read's own parser, so both agree."""
    if len(image_head) < 8:
        raise AdapterFormatError(f"a safetensors image starts with an 8-byte header length; {len(image_head)} bytes "
                                 "were given: send the image's first 8 + header-length bytes")
    n = int.from_bytes(image_head[:8], "little")
    if not 0 < n <= image_bytes - 8 or len(image_head) < 8 + n:
        raise AdapterFormatError(f"the image's header length {n} does not fit its {image_bytes} bytes and the "
                                 f"{len(image_head)} header bytes given: send the image's first 8 + {n} bytes")
    return parse_index(bytes(image_head[:8 + n]), image_bytes)


def device_read(index: Mapping[str, FileTensor], layout: ShardLayout, image_bytes: int) -> DeviceRead:
    """The read of ``layout``'s entries out of an image laid out as ``index`` says. Refused, naming the tensor:
    an entry whose key the image lacks, or whose slice lies outside the tensor."""
    segments: list[tuple[int, int, int]] = []
    converts: list[ShardEntry] = []
    for e in layout.entries:
        t = index.get(e.key)
        if t is None:
            raise AdapterFormatError(f"adapter {layout.adapter}@{layout.version}: the pushed image has no tensor "
                                     f"{e.key!r} (layer {e.layer} {e.module}.lora_{e.ab}); push every module the "
                                     "config names")
        if len(t.shape) != 2 or e.rows.stop > t.shape[0] or e.cols.stop > t.shape[1]:
            raise AdapterFormatError(f"adapter {layout.adapter}@{layout.version}: tensor {e.key!r} is "
                                     f"{list(t.shape)}, too small for its slice rows {e.rows.start}:{e.rows.stop}, "
                                     f"cols {e.cols.start}:{e.cols.stop}; push the shapes its config implies")
        if t.dtype != layout.dtype:
            converts.append(e)
        elif contiguous(e, t):
            run = run_of(e, t)
            segments.append((run.start, run.at, run.nbytes))
        else:
            st = strided_of(e, t)
            segments.extend((st.start + i * st.stride, st.at + i * st.width, st.width) for i in range(st.rows))
    plan = gather_plan(segments)
    if plan.src_end > image_bytes:
        raise AdapterFormatError(f"adapter {layout.adapter}@{layout.version}: its header places tensors up to byte "
                                 f"{plan.src_end} of a {image_bytes}-byte image; push the whole image")
    return DeviceRead(layout, index, plan, tuple(converts), image_bytes)


def _convert(dest: torch.Tensor, image: torch.Tensor, e: ShardEntry, t: FileTensor) -> None:
    first, span = span_of(e, t)
    raw = image[first:first + span]
    if raw.data_ptr() % t.dtype.itemsize:  # a tensor not aligned to its own dtype in the image: aligned bytes first
        raw = raw.clone()
    cols = t.shape[-1]
    flat = raw.view(t.dtype)
    src = flat.as_strided((e.shape[0], e.shape[1]), (cols, 1))
    dest[e.offset:e.offset + e.numel].view(e.shape).copy_(src)


def read_image(read: DeviceRead, image: torch.Tensor, dest: torch.Tensor, after: Any = None,
               stream: Any = None, record: bool = True) -> tuple[Any, torch.Tensor]:
    """Fill ``dest`` (1-D, the layout's dtype, >= its numel, on the image's device) with the shard from ``image``
    (1-D uint8, the whole image). On CUDA it runs on ``stream`` (default: the current one) after ``after`` (the
    trainer's event) and returns (an event recorded after the last copy, a device bool: every element finite);
    read the flag only once the event has completed. On the CPU it runs at once and returns (None, the flag).
    ``record`` False: no event (None), for a caller whose own event follows (a slot's copy: ``ImageShard``)."""
    check_buffers(read, image, dest)
    cuda = image.device.type == "cuda"
    with torch.cuda.stream(stream) if cuda and stream is not None else contextlib.nullcontext():
        if cuda and after is not None:
            torch.cuda.current_stream(image.device).wait_event(after)
        flag = issue_read(read, image, dest)
        if not cuda or not record:
            return None, flag
        done = torch.cuda.Event()
        done.record()
        return done, flag


def check_buffers(read: DeviceRead, image: torch.Tensor, dest: torch.Tensor) -> None:
    """Refused, naming both: an image that is not the 1-D uint8 buffer of the size ``read`` was planned for, or a
    destination that is not a 1-D buffer of the layout's dtype, of at least its elements, on the image's device."""
    layout = read.layout
    if image.dtype != torch.uint8 or image.dim() != 1 or image.numel() != read.image_bytes:
        raise AdapterFormatError(f"adapter {layout.adapter}@{layout.version}: the image is {image.dtype} of shape "
                                 f"{tuple(image.shape)}, not the {read.image_bytes} bytes (uint8, 1-D) its plan was "
                                 "made for; open the pushed buffer as sent")
    if dest.dtype != layout.dtype or dest.dim() != 1 or dest.numel() < layout.numel or dest.device != image.device:
        raise AdapterFormatError(f"adapter {layout.adapter}@{layout.version}: the destination is {dest.dtype} "
                                 f"{tuple(dest.shape)} on {dest.device}; give a 1-D {layout.dtype} buffer of at least "
                                 f"{layout.numel} elements on {image.device}")


def issue_read(read: DeviceRead, image: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """The gather, the conversions and the finite flag, on the current stream (``read_image``, checked; or captured
    once into a graph, ``workers.reads.fill_graph``)."""
    body = dest[:read.layout.numel]
    gather(body.view(torch.uint8), image, read.gather)
    for e in read.converts:
        _convert(body, image, e, read.tensors[e.key])
    return total_finite(body)  # False only for a NaN, an Inf or a float32 total past its range: ``finite_or_raise``


def finite_or_raise(read: DeviceRead, dest: torch.Tensor, flag: torch.Tensor) -> None:
    """After ``read_image``'s event: NonFiniteWeightsError naming the first tensor with a NaN or Inf, if the flag
    says there is one (only then is each entry looked at)."""
    if not bool(flag):
        layout = read.layout
        check_finite(f"{layout.adapter}@{layout.version}", layout, dest[:layout.numel].cpu(), layout.entries)



class ImageReads:
    """A rank's read plans of pushed images, one per (header, layout entries): a trainer's next version of an
    adapter has the same header and layout, so it reuses the plan (the 70B rank-64 shard's plan is ~11,000
    segments). Keeps the last ``keep`` plans."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._plans: dict[tuple[bytes, int], DeviceRead] = {}
        self._lock = threading.Lock()
        # the last head seen, by identity (a trainer's buffer's head is one bytes object, ``TrainerImages``): its CRC
        # per length, and its header as the plans' key, so a push does not hash or copy its ~60 KB again
        self._head: tuple[bytes, dict[int, int], bytes] | None = None

    def _crc(self, head: bytes, nbytes: int) -> int:
        last = self._head
        if last is not None and last[0] is head and nbytes in last[1]:
            return last[1][nbytes]
        crc = zlib.crc32(head[:nbytes])
        if last is not None and last[0] is head:
            last[1][nbytes] = crc
        return crc

    def _key(self, head: bytes) -> bytes:
        last = self._head
        if last is not None and last[0] is head:
            return last[2]
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        key = bytes(head[:8 + n])
        self._head = (head, {}, key)
        return key

    def read(self, spec: AdapterSpec, layout: ShardLayout, head: bytes, image: torch.Tensor) -> DeviceRead:
        """The read of ``layout`` from ``image`` (``head``: its first bytes, the header). Where ``spec`` has a file,
        an image whose header or size is not the file's is refused, naming both."""
        where = f"adapter {layout.adapter}@{layout.version}"
        if image.dtype != torch.uint8 or image.dim() != 1:
            raise AdapterFormatError(f"{where}: the pushed image is {image.dtype} of shape {tuple(image.shape)}; "
                                     "send the image as a 1-D uint8 buffer (the safetensors bytes)")
        declared = []  # (what, size, header bytes, header CRC) the image must match
        if spec.source is not None:
            src = spec.source
            declared.append(("this version's file", src.identity.size, src.header_bytes, src.header_crc))
        if spec.device is not None:
            dev = spec.device
            declared.append(("the image this device version was pushed as", dev.size, dev.header_bytes,
                             dev.header_crc))
        header = self._key(head)
        for what, size, header_bytes, header_crc in declared:
            crc = self._crc(head, header_bytes)
            if image.numel() != size or len(head) < header_bytes or crc != header_crc:
                raise AdapterFormatError(f"{where}: the pushed image ({image.numel()} bytes, header CRC {crc:08x}) is "
                                         f"not {what} ({size} bytes, header CRC {header_crc:08x}); push the image of "
                                         "the version named")
        key = (header, image.numel())
        with self._lock:
            read = self._plans.get(key)
        if read is None or read.layout.entries != layout.entries:
            read = device_read(image_index(head, image.numel()), layout, image.numel())
            with self._lock:
                self._plans.pop(key, None)
                self._plans[key] = read
                while len(self._plans) > self.keep:
                    del self._plans[next(iter(self._plans))]
        return read._replace(layout=layout) if read.layout is not layout else read


class ImageShard:
    """One rank's shard to take from a pushed image into its slot (``WorkerCache.load_image``): ``fill`` is the
    slot's copy (``streams.copy_chunk``'s source), issuing ``read_image`` on the current stream (the copy stream)
    after the trainer's event ``after``, the finite flag copied into pinned host memory behind it; ``check``, once
    the copy's event has completed (the completion watcher), raises ``NonFiniteWeightsError`` naming the tensor if
    the flag says so, reading only host memory (no sync)."""

    def __init__(self, read: DeviceRead, image: torch.Tensor, after: Any = None,
                 marks: list[tuple[str, float]] | None = None, graphs: Any = None) -> None:
        self.read, self.image, self.after = read, image, after
        self.graphs = graphs  # the rank's ``FillGraphs``: a graph fills the slot where one pays (None: launches)
        self.flag = (graphs.flag(image.is_cuda) if graphs is not None
                     else torch.ones((), dtype=torch.bool, pin_memory=image.is_cuda))
        self.dest: torch.Tensor | None = None
        # the load's phases (``SlotLoad.marks``), if it keeps them: its load takes these first ones over
        self.marks: list[tuple[str, float]] | None = marks
        if marks is not None:
            marks.append(("flag", time.perf_counter()))

    def fill(self, dest: torch.Tensor) -> None:
        if self.marks is not None:
            self.marks.append(("fill", time.perf_counter()))
        self.dest = dest
        after = self.after
        if self.graphs is not None and self.image.is_cuda and after is not None:
            torch.cuda.current_stream(self.image.device).wait_event(after)  # before a capture's first fill too
            after = None  # waited for: ``read_image`` below need not again
        graph = self.graphs.get(self.read, self.image, dest) if self.graphs is not None else None
        if graph is not None:  # one graph launch into the slot, its flag into ours
            graph.fill(self.flag)
            if self.marks is not None:
                self.marks.append(("filled", time.perf_counter()))
        else:
            flag = read_image(self.read, self.image, dest, after=after, record=False)[1]
            if self.marks is not None:
                self.marks.append(("filled", time.perf_counter()))
            self.flag.copy_(flag, non_blocking=True)  # in stream order: complete when the copy's event is
        if self.marks is not None:
            self.marks.append(("flagged", time.perf_counter()))

    def check(self) -> None:
        if self.dest is None:
            raise RuntimeError(f"{self.read.layout.adapter}@{self.read.layout.version}: checked before its fill ran")
        try:
            finite_or_raise(self.read, self.dest, self.flag)
        finally:
            if self.graphs is not None:  # read, and its copy long complete: another load may take it
                self.graphs.give(self.flag)
