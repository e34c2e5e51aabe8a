"""The floor of a push that crosses into another process (issue 44 item 5): how fast any push could be READY.

Item 5's goal is a pushed version READY on every rank of a TP replica within 1.3x of the time to copy its shards
host-to-device. Every push here crosses at least one process boundary (the trainer's process to each rank's
worker), so this probe times, in one run on one host, the parts no implementation can skip, with no controller,
catalog, hash, file or proof:

- ``copy_ms``: the reference, each rank copying its shard's bytes from pinned host memory to its GPU, all ranks at
  once (the push probe's ``copy_probe``; on ``--cpu`` a memcpy);
- ``call_ms``: one Ray call from the trainer's process to every rank's actor and back, doing nothing;
- ``ipc_ms`` (GPU only): the trainer's payload on GPU 0 handed to every rank by CUDA IPC (torch's own handle and
  event), each rank copying its shard's slice device-to-device into a buffer of its own on a side stream, waited for:
  the device-to-device push with nothing else. ``ipc_first_ms`` is the first such push (the rank opens the handle;
  later ones find it open, as a trainer pushing from one buffer every step would);
- ``host_ms``: the host path's bare floor: the payload copied to host memory, put in Ray's object store, each rank
  copying its slice to its GPU from the store's memory in place.

The ratios to ``copy_ms`` say whether the goal is in reach of a path at all: ``call_ms`` alone over 1.3 means no
push through Ray calls can meet it. Ranks sit on GPU ``r % GPUs`` (``--one-gpu``: all on GPU 0), each in an actor
that sees every GPU (a rank must see the trainer's GPU to open its memory).

    python -m bench.probes.push_floor --tp 2 --out /tmp/push_floor.json            # a GPU host
    python -m bench.probes.push_floor --tp 2 --cpu --mib 8 --out /tmp/floor.json   # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from lora_cache.adapters.shapes import resolve_model
from lora_cache.adapters.shards import max_shard_numel
from workers.gpu.copies import host_copy_ms

DTYPE = torch.bfloat16  # the pushed adapter's weights


@ray.remote
class Rank:
    """One rank's stand-in: a buffer of its shard's size on its device, filled from a trainer's payload."""

    def __init__(self, device: str, nbytes: int) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(self.device)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.opened: dict[bytes, torch.Tensor] = {}  # the trainer's buffer by its IPC handle, opened once

    def ping(self) -> None:
        return None

    def take_ipc(self, handle: tuple[Any, tuple[Any, ...]], start: int) -> int:
        """Copy ``dst``'s bytes from the trainer's GPU buffer at ``start`` (opened by its CUDA IPC handle)."""
        rebuild, args = handle
        key = args[7]  # the storage's IPC handle (``rebuild_cuda_tensor``'s storage_handle): opened once
        src = self.opened.get(key)
        if src is None:
            self.opened = {key: rebuild(*args)}  # waits on the trainer's event for the bytes' last write
            src = self.opened[key]
        elif args[-1]:  # open already: still wait on this push's event (the trainer's last write before it)
            torch.cuda.current_stream(self.device).wait_event(torch.cuda.Event.from_ipc_handle(args[6], args[-2]))
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self.dst.copy_(src[start:start + self.dst.numel()], non_blocking=True)
        self.stream.synchronize()
        return self.dst.numel()

    def take_ref(self, payload: np.ndarray, start: int) -> int:
        """Copy ``dst``'s bytes from the payload in Ray's object store (read in place) at ``start``."""
        with warnings.catch_warnings():  # the store's memory is read-only; the tensor is only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(payload[start:start + self.dst.numel()])
        if self.device.type == "cuda":
            with torch.cuda.stream(self.stream):
                self.dst.copy_(src)
            self.stream.synchronize()
        else:
            self.dst.copy_(src)
        return self.dst.numel()

    def release(self) -> None:
        """Let go of the trainer's buffer (its process frees it only once every rank has)."""
        self.opened = {}
        torch.cuda.synchronize(self.device)

    def checksum(self) -> int:
        """The sum of ``dst``'s bytes with their positions (what the probe checks each path's copy by)."""
        return _checksum(self.dst)

    def copy_probe(self, repeats: int) -> float:
        """Median ms of a plain pinned-host -> device copy of ``dst``'s bytes (a memcpy on the CPU)."""
        return host_copy_ms(self.device, self.dst.numel(), repeats)


def _checksum(data: torch.Tensor) -> int:
    """Bytes weighted by their position mod 251: a slice taken at the wrong offset or length sums otherwise."""
    weights = torch.arange(data.numel(), device=data.device, dtype=torch.int64) % 251 + 1
    return int((data.to(torch.int64) * weights).sum())


def shard_bytes(model: str, rank: int, tp: int, mib: float | None) -> int:
    """One rank's shard: ``--mib`` if given, else the largest shard of a rank-``rank`` adapter of ``model`` at TP
    ``tp`` in bf16 (an 8B rank-16 at TP 1: the push probe's 83,886,080 bytes)."""
    if mib is not None:
        return int(mib * (1 << 20))
    return max_shard_numel(resolve_model(model), tp, rank, DTYPE) * DTYPE.itemsize


def check(ranks: list[Any], expected: list[int], path: str) -> None:
    """Every rank holds its own slice of the payload after ``path``'s pushes (else the timing is of nothing)."""
    got = ray.get([r.checksum.remote() for r in ranks])
    if got != expected:
        raise AssertionError(f"{path}: the ranks' shards sum to {got}, their slices of the payload to {expected}")


def timed(fn: Any, repeats: int) -> list[float]:
    """``fn()``'s wall times in ms, ``repeats`` times."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--mib", type=float, default=None, help="each rank's shard in MiB (default: the model's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="no GPU: the host path and the calls only")
    ap.add_argument("--one-gpu", action="store_true", help="every rank on GPU 0")
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.tp < 1 or args.repeats < 2:
        raise SystemExit(f"--tp {args.tp} --repeats {args.repeats}: give --tp >= 1 and --repeats >= 2")
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no GPU is visible here: run on a GPU host, or give --cpu")
    os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"  # each rank sees the trainer's GPU
    nbytes = shard_bytes(args.model, args.rank, args.tp, args.mib)
    gpus = 0 if args.cpu else torch.cuda.device_count()
    devices = ["cpu" if args.cpu else f"cuda:{0 if args.one_gpu else r % gpus}" for r in range(args.tp)]
    # the trainer's payload: every rank's shard one after another (a TP rank's shard is a part of the whole)
    payload = torch.randint(0, 256, (nbytes * args.tp,), dtype=torch.uint8, device=devices[0] if gpus else "cpu")
    ray.init(address="local", num_cpus=max(4, args.tp + 1), include_dashboard=False)
    try:
        ranks = [Rank.options(num_cpus=1).remote(d, nbytes) for d in devices]
        ray.get([r.ping.remote() for r in ranks])
        starts = [r * nbytes for r in range(args.tp)]
        copy_ms = max(ray.get([r.copy_probe.remote(args.repeats) for r in ranks]))  # all ranks at once
        call = timed(lambda: ray.get([r.ping.remote() for r in ranks]), args.repeats)

        def host_push() -> None:
            host = payload.cpu().numpy()
            ref = ray.put(host)
            ray.get([r.take_ref.remote(ref, s) for r, s in zip(ranks, starts)])

        host = timed(host_push, args.repeats)
        expected = [_checksum(payload[s:s + nbytes]) for s in starts]
        check(ranks, expected, "the host path")
        summary: dict[str, Any] = {"shard_bytes": nbytes, "copy_ms": copy_ms,
                                   "call_ms": statistics.median(call[1:]), "host_ms": statistics.median(host[1:])}
        if gpus:
            torch.cuda.synchronize()
            ipc = timed(lambda: ray.get([r.take_ipc.remote(reduce_tensor(payload), s) for r, s in zip(ranks, starts)]),
                        args.repeats)
            check(ranks, expected, "CUDA IPC")
            ray.get([r.release.remote() for r in ranks])
            torch.cuda.ipc_collect()
            summary.update(ipc_first_ms=ipc[0], ipc_ms=statistics.median(ipc[1:]))
        for key in ("call_ms", "host_ms", "ipc_ms"):
            if key in summary:
                summary[key.replace("_ms", "_over_copy")] = summary[key] / copy_ms
        out = {"tp": args.tp, "model": args.model, "rank": args.rank, "cpu": args.cpu, "one_gpu": args.one_gpu,
               "devices": devices, "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
               "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
               "repeats": args.repeats, "call_all_ms": call, "host_all_ms": host, "summary": summary}
        if gpus:
            out["ipc_all_ms"] = ipc
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(json.dumps(summary, indent=2))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
