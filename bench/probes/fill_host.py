"""The host's part of a slot's fill from a pushed image (issue 44 item 5), in one process with no Ray.

``bench.probes.push_slots`` found a rank's own part of an 8B rank-16 push at 0.7-1.3x the shard's host-to-device copy,
nearly all of it host time (the gather itself is ~0.1 ms on the GPU). This splits that host time: each step's
median microseconds on the host (``time.perf_counter`` around the call, no sync: what the launching thread spends), and
a whole ``WorkerCache.load_image`` from the call to READY (``ready_us``) with its phases (``SlotLoad.marks``).

    python -m bench.probes.fill_host --model llama-3.1-8b --rank 16 --out /tmp/fill_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import WEIGHTS_FILE
from lora_cache.adapters.shapes import MODULE_ORDER, resolve_model
from lora_cache.adapters.synth import write_adapter
from lora_cache.vocab import AdapterKey
from workers.cache import WorkerCache, WorkerConfig
from workers.kernels.gather import gather
from workers.reads.device import ImageShard, read_image
from workers.reads.finite import sums_finite, total_finite
from workers.staging.host_config import HostTierConfig


def host_us(fn: Callable[[], Any], repeats: int) -> float:
    """Median host microseconds of ``fn`` (the GPU drained between calls, outside the timing)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the launching thread over the load_image loop (its 40 costliest functions)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(Path(tmp) / "a", resolve_model(args.model), args.rank, 2.0 * args.rank, list(MODULE_ORDER),
                      torch.bfloat16, torch.Generator().manual_seed(5))
        catalog = AdapterCatalog(CatalogConfig(adapter_roots=(tmp,), model=args.model, max_rank=args.rank))
        spec = catalog.register("a", Path(tmp) / "a")
        raw = (Path(tmp) / "a" / WEIGHTS_FILE).read_bytes()
        head = raw[:8 + int.from_bytes(raw[:8], "little")]
        image = torch.frombuffer(bytearray(raw), dtype=torch.uint8).cuda()
        config = WorkerConfig(num_slots=2, device="cuda", host=HostTierConfig(host_bytes=1 << 30, pin=False))
        cache = WorkerCache(config, catalog)
        layout = cache.layout_of("a")
        read = cache.image_reads.read(spec, layout, head, image)
        dest = torch.empty(layout.numel, dtype=layout.dtype, device="cuda")
        stream = torch.cuda.Stream()
        out: dict[str, Any] = {"model": args.model, "rank": args.rank, "gpu": torch.cuda.get_device_name(),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        with torch.cuda.stream(stream):
            gather(dest.view(torch.uint8), image, read.gather)  # compiled and warm
            out["gather_us"] = host_us(lambda: gather(dest.view(torch.uint8), image, read.gather), args.repeats)
            out["sums_finite_us"] = host_us(lambda: sums_finite(dest), args.repeats)
            out["total_finite_us"] = host_us(lambda: total_finite(dest), args.repeats)
            out["read_image_us"] = host_us(lambda: read_image(read, image, dest), args.repeats)
            out["event_us"] = host_us(lambda: torch.cuda.Event().record(), args.repeats)
            out["image_shard_us"] = host_us(lambda: ImageShard(read, image), args.repeats)
            shard = ImageShard(read, image)
            out["fill_us"] = host_us(lambda: shard.fill(dest), args.repeats)
        out["plan_lookup_us"] = host_us(lambda: cache.image_reads.read(spec, layout, head, image), args.repeats)
        ready, phases = [], []
        profile = cProfile.Profile() if args.profile else None
        for k in range(args.repeats):
            if profile is not None and k == 1:
                profile.enable()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.load_image("a", spec.version, image, head).result(timeout=60)
            ready.append((time.perf_counter() - t0) * 1e6)
            with cache.book.lock:
                slot = cache.book.table.lookup(AdapterKey("a", spec.version))
                assert slot is not None
                marks = list(cache.book.loads[slot.index].marks)
            phases.append([(name, (t - t0) * 1e6) for name, t in marks])
            cache.evict("a", spec.version)
        if profile is not None:
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
            out["profile"] = text.getvalue().splitlines()
        out["ready_us"] = statistics.median(ready[1:])
        names = [n for n, _ in phases[1]]
        out["phases_us"] = {n: statistics.median(dict(p).get(n, 0.0) for p in phases[1:]) for n in names}
        cache.close()
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
