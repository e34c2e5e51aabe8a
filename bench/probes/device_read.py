"""A rank taking its shard of a pushed adapter from the trainer's GPU buffer (issue 44 item 5): the real layout.

``bench.probes.push_floor`` timed the device path as one contiguous slice per rank. A rank's shard is not one
slice: it is every matrix of the adapter, cut by rows or columns for TP (row-parallel ``lora_A``s by columns: one
range per row). Here the trainer's buffer holds the adapter's real safetensors image, each rank (a Ray actor that
sees the trainer's GPU) opens it by CUDA IPC, and reads its shard by ``workers.reads.device``: one gather launch on
its copy stream after the trainer's event, the shard proven finite on the GPU, the event waited. Per model, rank
and TP size, in one run:

- ``copy_ms``: the reference, each rank copying its shard's bytes from pinned host memory to its GPU, all at once;
- ``take_ms``: one Ray call from the trainer to every rank that takes its shard (wait, gather, proof, event) and
  answers, the buffer's IPC handle and a new event's sent with each (torch's ``reduce_tensor``); ``take_first_ms``
  the first (the rank opens the buffer and plans the read: once per trainer buffer; the kernel is compiled at the
  rank's start, as a rank would); ``take_open_ms``: the same with the trainer's one interprocess event opened once
  by each rank, so a push's call carries nothing (the trainer records the event before calling); ``inside_*`` the
  part of each inside the slowest rank;
- ``gather_ms`` / ``twin_ms``: the gather alone on the rank's stream (CUDA events), by the kernel and by the torch
  twin (one copy per range), the buffer open: what batching the ranges into one launch buys;
- ``plan_ms``: the rank's plan of the read from the header (once per header and layout);
- ``call_ms``: the same Ray call doing nothing.

The trainer's image is made from its tensors on its GPU (``lora_cache.adapters.serialize.device_image``; checked to be
the adapter's file byte for byte); ``image_ms`` times remaking it in place, the trainer's part of a push. Every
rank's shard is compared byte for byte with the file read of the same layout (``workers.reads.shard``).

    python -m bench.probes.device_read --model llama-3.1-8b --rank 16 --tp 1,2 --out /tmp/device_read.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import load_file
from torch.multiprocessing.reductions import reduce_tensor

from bench.probes.push_floor import timed
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import WEIGHTS_FILE, AdapterSpec
from lora_cache.adapters.serialize import device_image
from lora_cache.adapters.shapes import MODULE_ORDER, resolve_model
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import write_adapter
from workers.gpu.copies import host_copy_ms
from workers.kernels.gather import gather, gather_plan, gather_reference
from workers.reads.device import device_read, finite_or_raise, image_index, read_image
from workers.reads.shard import read_slices

DTYPE = torch.bfloat16


@ray.remote
class Rank:
    """One TP rank: its shard's layout, a slot-sized buffer on its GPU, and the trainer's buffer once opened."""

    def __init__(self, device: str, spec: AdapterSpec, model: str, tp: int, k: int) -> None:
        self.device = torch.device(device)
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.spec = spec
        self.layout = shard_layout(spec, resolve_model(model), tp, k, DTYPE)
        self.dest = torch.empty(self.layout.numel, dtype=DTYPE, device=self.device)
        self.image: torch.Tensor | None = None
        self.read: Any = None
        self.plan_ms = 0.0
        self.event: Any = None  # the trainer's one interprocess event, opened once (``open_event``)
        warm = torch.zeros(16, dtype=torch.uint8, device=self.device)  # the kernel compiled at start, as a rank would
        gather(warm[8:], warm[:8], gather_plan([(0, 0, 8)]))
        torch.cuda.synchronize(self.device)

    def ping(self) -> None:
        return None

    def take(self, handle: tuple[Any, tuple[Any, ...]], head: bytes) -> float:
        """Take this rank's shard from the trainer's buffer: open it (the first time) and plan, wait for the
        trainer's event, gather, prove finite, wait for the copy's event. Returns ms inside the rank."""
        t0 = time.perf_counter()
        rebuild, args = handle
        after = None
        if self.image is None:
            self.image = rebuild(*args)  # opening waits on the trainer's event (torch's own rebuild)
            p0 = time.perf_counter()
            self.read = device_read(image_index(head, self.image.numel()), self.layout, self.image.numel())
            self.plan_ms = (time.perf_counter() - p0) * 1e3
            after = torch.cuda.Event()
            after.record()  # the current stream has waited on the trainer's event: the copy stream waits on it
        elif args[-1]:  # open already: this push's event (the trainer's last write before it)
            after = torch.cuda.Event.from_ipc_handle(args[6], args[-2])
        done, flag = read_image(self.read, self.image, self.dest, after=after, stream=self.stream)
        done.synchronize()
        finite_or_raise(self.read, self.dest, flag)
        return (time.perf_counter() - t0) * 1e3

    def open_event(self, handle: bytes) -> None:
        """Open the trainer's interprocess event once: each later push is a call that carries nothing."""
        self.event = torch.cuda.Event.from_ipc_handle(self.device, handle)

    def take_open(self) -> float:
        """``take`` with the buffer and the trainer's event already open: wait on the event (recorded by the trainer
        before its call), gather, prove finite, wait for the copy. Returns ms inside the rank."""
        t0 = time.perf_counter()
        assert self.image is not None, "take opens the trainer's buffer first"
        done, flag = read_image(self.read, self.image, self.dest, after=self.event, stream=self.stream)
        done.synchronize()
        finite_or_raise(self.read, self.dest, flag)
        return (time.perf_counter() - t0) * 1e3

    def gather_times(self, repeats: int) -> dict[str, float]:
        """Median ms (CUDA events on the rank's stream) of the gather by the kernel and by the twin."""
        assert self.image is not None
        dst = self.dest.view(torch.uint8)
        out = {}
        for name, fn in (("gather_ms", gather), ("twin_ms", gather_reference)):
            times = []
            with torch.cuda.stream(self.stream):
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn(dst, self.image, self.read.gather)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
            out[name] = statistics.median(times)
        out["plan_ms"] = self.plan_ms
        out["segments"] = len(self.read.gather.segments)
        out["rows"] = len(self.read.gather.rows(self.read.gather.word))
        out["word"] = self.read.gather.word
        return out

    def equals_file_read(self) -> bool:
        """Whether this rank's shard is byte for byte the file read of its layout."""
        want = torch.empty(self.layout.numel, dtype=DTYPE)
        assert self.spec.source is not None
        read_slices(self.spec.source, self.layout.entries, want, "", "sample")
        return bool(torch.equal(self.dest.cpu().view(torch.uint8), want.view(torch.uint8)))

    def release(self) -> None:
        self.image, self.read = None, None
        torch.cuda.synchronize(self.device)

    def copy_probe(self, repeats: int) -> float:
        return host_copy_ms(self.device, self.layout.nbytes, repeats)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tp", default="1,2", help="TP sizes, comma-separated (all ranks on GPU r %% GPUs)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    return ap


def one_tp(spec: AdapterSpec, model: str, tp: int, image: torch.Tensor, head: bytes, repeats: int) -> dict[str, Any]:
    gpus = torch.cuda.device_count()
    devices = [f"cuda:{k % gpus}" for k in range(tp)]
    ranks = [Rank.options(num_cpus=1).remote(d, spec, model, tp, k)  # type: ignore[attr-defined]
             for k, d in enumerate(devices)]
    try:
        ray.get([r.ping.remote() for r in ranks])
        copy_ms = max(ray.get([r.copy_probe.remote(repeats) for r in ranks]))  # all ranks at once
        call = timed(lambda: ray.get([r.ping.remote() for r in ranks]), repeats)
        torch.cuda.synchronize()
        inside: list[list[float]] = []

        def push() -> None:
            torch.cuda.current_stream().synchronize()
            inside.append(ray.get([r.take.remote(reduce_tensor(image), head) for r in ranks]))

        take = timed(push, repeats)
        event = torch.cuda.Event(interprocess=True)  # one event for every push, opened once by each rank
        ray.get([r.open_event.remote(event.ipc_handle()) for r in ranks])
        opened: list[list[float]] = []

        def push_open() -> None:
            image[-1:].add_(0)  # the trainer's write (a no-op on its last byte), then its event
            event.record()
            opened.append(ray.get([r.take_open.remote() for r in ranks]))

        take_open = timed(push_open, repeats)
        same = ray.get([r.equals_file_read.remote() for r in ranks])
        if not all(same):
            raise AssertionError(f"TP {tp}: ranks {[k for k, s in enumerate(same) if not s]} hold other bytes than "
                                 "the file read of their layout")
        gathers = ray.get([r.gather_times.remote(repeats) for r in ranks])
        ray.get([r.release.remote() for r in ranks])
        summary: dict[str, Any] = {
            "copy_ms": copy_ms, "call_ms": statistics.median(call[1:]), "take_first_ms": take[0],
            "take_ms": statistics.median(take[1:]), "inside_ms": statistics.median(max(x) for x in inside[1:]),
            "inside_first_ms": max(inside[0]), "take_open_ms": statistics.median(take_open[1:]),
            "inside_open_ms": statistics.median(max(x) for x in opened[1:]),
            "gather_ms": max(g["gather_ms"] for g in gathers), "twin_ms": max(g["twin_ms"] for g in gathers),
            "plan_ms": max(g["plan_ms"] for g in gathers), "segments": [g["segments"] for g in gathers],
            "rows": [g["rows"] for g in gathers], "word": [g["word"] for g in gathers],
            "shard_bytes": max(shard_layout(spec, resolve_model(model), tp, k, DTYPE).nbytes for k in range(tp)),
        }
        for key in ("take_ms", "take_first_ms", "take_open_ms", "call_ms", "gather_ms", "twin_ms", "inside_ms",
                    "inside_open_ms"):
            summary[key.replace("_ms", "_over_copy")] = summary[key] / copy_ms
        return {"tp": tp, "devices": devices, "take_all_ms": take, "take_open_all_ms": take_open,
                "call_all_ms": call, "summary": summary,
                "equal_to_file_read": same}
    finally:
        for r in ranks:
            ray.kill(r)


def main() -> None:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no GPU is visible here: this probe times a device path; run it on a GPU host")
    tps = [int(x) for x in args.tp.split(",")]
    os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"  # each rank sees the trainer's GPU
    shape = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_adapter(Path(tmp) / "a", shape, args.rank, 2.0 * args.rank, list(MODULE_ORDER), DTYPE,
                      torch.Generator().manual_seed(5))
        catalog = AdapterCatalog(CatalogConfig(adapter_roots=(tmp,), model=args.model, max_rank=args.rank))
        spec = catalog.register("a", Path(tmp) / "a")
        raw = (Path(tmp) / "a" / WEIGHTS_FILE).read_bytes()
        tensors = {k: v.to("cuda:0") for k, v in load_file(str(Path(tmp) / "a" / WEIGHTS_FILE)).items()}
        image = device_image(tensors, {"format": "pt"})  # the trainer's pushed buffer, laid out on its GPU
        if bytes(image.cpu().numpy()) != raw:
            raise AssertionError("the trainer's image is not the adapter's safetensors file")
        image_ms = []
        for _ in range(args.repeats):  # the trainer's part of a push: its tensors into the image, in place
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            device_image(tensors, {"format": "pt"}, out=image)
            end.record()
            end.synchronize()
            image_ms.append(start.elapsed_time(end))
        head = raw[:8 + int.from_bytes(raw[:8], "little")]
        made_s = time.perf_counter() - t0
        ray.init(address="local", num_cpus=max(4, max(tps) + 1), include_dashboard=False)
        try:
            runs = [one_tp(spec, args.model, tp, image, head, args.repeats) for tp in tps]
        finally:
            ray.shutdown()
    out = {"model": args.model, "rank": args.rank, "image_bytes": len(raw), "made_s": made_s,
           "image_ms": statistics.median(image_ms), "image_all_ms": image_ms,
           "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "repeats": args.repeats, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({"image_ms": out["image_ms"], **{f"tp{r['tp']}": r["summary"] for r in runs}}, indent=2))


if __name__ == "__main__":
    main()
