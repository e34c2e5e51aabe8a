"""A push's passes over its bytes, each against its one-thread form, in one process (issue 44 item 5).

For an adapter of ``--model`` at ``--rank`` (bf16 tensors of its shapes, random values), times:

- ``payload``: the client's safetensors bytes (``serialize.safetensors_bytes``, CPU tensors copied in groups on the
  push's threads) against ``safetensors.torch.save`` (one thread, two passes);
- ``digest``: the content version and every block's CRC (``pushed.digest``: each block hashed and CRC'd on the push's
  threads, the block hashes then hashed) against one stream of blake2b over the bytes and a CRC pass (the version
  before content version 2);
- ``write``: the bytes into a new file of the push area's file system (``pushed.write_spread``: copied in through a
  shared mapping by the push's threads) against one ``write`` call;
- ``memcpy``: one numpy copy of the bytes into a fresh buffer (the reference: what one pass over the bytes costs
  here);
- where a GPU is seen, ``payload_gpu``: the payload of the same tensors on GPU 0 (a trainer's: gathered on the device
  in runs, one transfer each) against ``payload_gpu_per_tensor`` (one synchronous transfer per tensor into its place,
  the form before), and ``d2h``: one device-to-host copy of the weights' bytes into a fresh buffer (the reference).

Each is run ``--repeats`` times (the median and the range are reported); files are written under ``--dir``
(default: the push area's own file system, ``/dev/shm``).

    python -m bench.probes.push_passes --model llama-3.1-8b --rank 16 --out /tmp/passes.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from lora_cache.adapters import pushed, serialize
from lora_cache.adapters.files import BLOCK_BYTES
from lora_cache.adapters.passes import pass_threads
from lora_cache.adapters.peft import peft_key
from lora_cache.adapters.pushed import default_push_dir, digest, write_spread
from lora_cache.adapters.serialize import safetensors_bytes
from lora_cache.adapters.shapes import MODULES, resolve_model


def tensors_of(model: str, rank: int) -> dict[str, torch.Tensor]:
    """bf16 LoRA tensors of every module of ``model`` at ``rank``, in PEFT's names."""
    shape = resolve_model(model)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(shape.num_layers):
        for module in MODULES:
            d_in, d_out = shape.dims(module)
            out[peft_key(layer, module, "A")] = torch.randn(rank, d_in, generator=gen).to(torch.bfloat16)
            out[peft_key(layer, module, "B")] = torch.randn(d_out, rank, generator=gen).to(torch.bfloat16)
    return out


def timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def one_stream(config: bytes, data: np.ndarray) -> None:
    """The content version before version 2: one blake2b stream over the config and the weights, and the CRCs."""
    stream = hashlib.blake2b(config, digest_size=8)
    stream.update(data.data)
    view = data.data
    [zlib.crc32(view[at:at + BLOCK_BYTES]) for at in range(0, len(view), BLOCK_BYTES)]


def gpu_rows(tensors: dict[str, torch.Tensor], repeats: int) -> dict[str, dict[str, float]]:
    """The payload of ``tensors`` put on GPU 0, gathered (now) and one tensor at a time (before), and one plain
    device-to-host copy of as many bytes (``main``'s docstring)."""
    on_gpu = {k: v.cuda() for k, v in tensors.items()}
    flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in on_gpu.values()])
    torch.cuda.synchronize()

    def per_tensor() -> None:  # the payload's device branch before the gather
        out = np.empty(flat.numel(), dtype=np.uint8)
        host, at = torch.from_numpy(out), 0
        for name in sorted(on_gpu):
            t = on_gpu[name].reshape(-1).view(torch.uint8)
            host[at:at + t.numel()].copy_(t)
            at += t.numel()

    return {"payload_gpu": timed(lambda: safetensors_bytes(on_gpu), repeats),
            "payload_gpu_per_tensor": timed(per_tensor, repeats),
            "d2h": timed(lambda: torch.from_numpy(np.empty(flat.numel(), dtype=np.uint8)).copy_(flat), repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="", help="where the files are written (default: the push area's parent)")
    ap.add_argument("--pass-bytes", type=int, default=0,
                    help="the bytes of one task of the push's threads, in MiB (default: PASS_BYTES as built)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.pass_bytes:  # every pass that splits its bytes into tasks of the pool
        for module in (pushed, serialize):
            module.PASS_BYTES = args.pass_bytes << 20  # type: ignore[attr-defined]
    tensors = tensors_of(args.model, args.rank)
    data = safetensors_bytes(tensors)
    config = json.dumps({"r": args.rank, "lora_alpha": 2 * args.rank}).encode()
    where = Path(args.dir) if args.dir else default_push_dir().parent
    scratch = Path(tempfile.mkdtemp(prefix="push-passes-", dir=where))
    files = iter(range(1 << 30))

    def spread() -> None:
        path = scratch / f"s{next(files)}"
        write_spread(path, data.data)
        path.unlink()

    def plain() -> None:
        path = scratch / f"p{next(files)}"
        with open(path, "wb") as f:
            f.write(data.data)
        path.unlink()

    try:
        rows = {
            "payload": timed(lambda: safetensors_bytes(tensors), args.repeats),
            "payload_one_thread": timed(lambda: safetensors.torch.save(tensors), args.repeats),
            "digest": timed(lambda: digest(config, data.data), args.repeats),
            "digest_one_stream": timed(lambda: one_stream(config, data), args.repeats),
            "write": timed(spread, args.repeats),
            "write_one_call": timed(plain, args.repeats),
            "memcpy": timed(lambda: np.array(data, copy=True), args.repeats),
        }
        if torch.cuda.is_available():
            rows |= gpu_rows(tensors, args.repeats)
    finally:
        for leftover in scratch.iterdir():
            leftover.unlink()
        scratch.rmdir()
    result = {"model": args.model, "rank": args.rank, "bytes": int(data.nbytes), "cpus": os.cpu_count(),
              "pass_bytes": pushed.PASS_BYTES,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
              "threads": pass_threads(), "dir": str(where), "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
