"""The host's part of a slot's fill from a pushed image (issue 44 item 5), in one process with no Ray.

A device push's READY is the trainer's write and event, the doorbells, and each rank's own part: from its doorbell's
request to its answer, 1.9-3.6 ms in a Ray worker actor on one H100 (bench/reports/issue-44.md, "registered ahead"),
nearly all of it host time (the gather itself is ~0.1 ms on the GPU). This separates what the code costs from what the
process around it costs, on one GPU:

- ``loads``: ``WorkerCache.load_image`` of the shard (``--tp``, rank 0) from a device image, each load a new device
  version registered as a push's is (so its layout and plans are those of a version never loaded), READY awaited,
  ``--repeats`` times after each gap of ``--gaps`` seconds (0: back to back, the CPU hot; longer: the thread and the
  CPU idle in between, as a rank between a trainer's steps). Per gap: each phase's median (``SlotLoad.marks``, from the
  call), READY (``ready_us``), and the calling thread's CPU time and context switches to the call's return and from it
  to READY (CPU time short of the wall time: the thread waited).
- ``ops``: each host step alone, hot (median and p90 microseconds, no sync): the gather's launch, the finite proof as
  row sums or one total, an event's record and query, a stream's wait, the flag's copy, a pinned scalar's allocation;
  and the process's own: a clock, a system call (``os.getppid``: what a sandboxed kernel adds), a thread's wake-up by
  a condition (the completion watcher's hand-over), a UNIX socket's round trip between two threads (a doorbell's).
- ``host``: the kernel (``/proc/version``), the CPU count, Python's GIL switch interval.

    python -m bench.probes.fill_host --model llama-3.1-8b --rank 16 --tp 2 --out /tmp/fill_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.device_versions import device_known
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE
from lora_cache.adapters.pushed import PushArea
from lora_cache.adapters.serialize import image_and_head
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.actor_images import SETTLE_S, thread_use, use_split
from workers.cache import WorkerCache, WorkerConfig
from workers.kernels.gather import gather
from workers.reads.finite import sums_finite, total_finite
from workers.staging.host_config import HostTierConfig


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1, help="the shard's TP degree (rank 0's shard is loaded)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50, help="loads per gap, and repeats of each op")
    ap.add_argument("--gaps", default="0,0.2", help="seconds idle before each load, a list")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the launching thread over the first gap's loads (its 40 costliest functions)")
    ap.add_argument("--out", required=True)
    return ap


def timed(op: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median and p90 of ``op``'s host time, in us (after a few warm calls)."""
    for _ in range(5):
        op()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return {"median_us": statistics.median(times), "p90_us": times[int(0.9 * (len(times) - 1))]}


def condition_wakeup(repeats: int) -> dict[str, float]:
    """From one thread's notify to another's return from its wait, in us (a hand-over between threads)."""
    cond = threading.Condition()
    box: list[float] = []
    woke: list[float] = []
    done = threading.Event()

    def waiter() -> None:
        with cond:
            while not done.is_set():
                while not box and not done.is_set():
                    cond.wait()
                if box:
                    woke.append((time.perf_counter() - box.pop()) * 1e6)
                    cond.notify()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    for _ in range(repeats):
        with cond:
            box.append(time.perf_counter())
            cond.notify()
            while box:
                cond.wait()
        time.sleep(0.0005)
    with cond:
        done.set()
        cond.notify()
    thread.join()
    woke.sort()
    return {"median_us": statistics.median(woke), "p90_us": woke[int(0.9 * (len(woke) - 1))]}


def socket_round_trip(repeats: int) -> dict[str, float]:
    """A 64-byte request and answer over a UNIX socket pair between two threads, in us (a doorbell's round trip)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def echo() -> None:
        while data := b.recv(64):
            b.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    msg = b"x" * 64

    def once() -> None:
        a.sendall(msg)
        got = 0
        while got < len(msg):
            got += len(a.recv(64))

    try:
        return timed(once, repeats)
    finally:
        a.close()
        b.close()


def ops(image: torch.Tensor, read: Any, dest: torch.Tensor, repeats: int) -> dict[str, Any]:
    """Each host step alone, hot: the process's (a clock, a system call, a thread's wake-up, a socket's round trip)
    and the CUDA calls of a load's fill."""
    out: dict[str, Any] = {
        "perf_counter": timed(time.perf_counter, repeats),
        "thread_use": timed(thread_use, repeats),
        "getppid": timed(os.getppid, repeats),
        "condition_wakeup": condition_wakeup(min(repeats, 100)),
        "socket_round_trip": socket_round_trip(repeats),
    }
    stream = torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record()
    flag_host = torch.ones((), dtype=torch.bool, pin_memory=True)
    body = dest[:read.layout.numel]
    torch.cuda.synchronize()

    def record() -> None:
        torch.cuda.Event().record(stream)

    def wait() -> None:
        stream.wait_event(event)

    def launch() -> None:
        with torch.cuda.stream(stream):
            gather(body.view(torch.uint8), image, read.gather)

    def finite() -> None:
        with torch.cuda.stream(stream):
            total_finite(body)

    flag = total_finite(body)

    def flag_copy() -> None:
        with torch.cuda.stream(stream):
            flag_host.copy_(flag, non_blocking=True)

    out |= {"event_record": timed(record, repeats), "event_query": timed(event.query, repeats),
            "stream_wait_event": timed(wait, repeats), "stream_context": timed(lambda: torch.cuda.stream(stream)
                                                                               .__enter__(), repeats),
            "gather_launch": timed(launch, repeats), "finite_launches": timed(finite, repeats),
            "flag_copy": timed(flag_copy, repeats),
            "pinned_scalar": timed(lambda: torch.ones((), dtype=torch.bool, pin_memory=True), repeats)}
    torch.cuda.synchronize()
    return out


def main() -> None:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no GPU is visible here: this probe times a load's CUDA calls; run it on a GPU host")
    root = Path(tempfile.mkdtemp(prefix="fill-host-"))
    (src,) = make_adapters(root, SynthConfig(model=args.model, count=1, rank=str(args.rank), seed=3))
    tensors = load((src / WEIGHTS_FILE).read_bytes())
    config = (src / CONFIG_FILE).read_bytes()
    image, head = image_and_head(tensors, {"format": "pt"})
    image = image.cuda()
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=args.model, max_rank=args.rank,
                                           push_dir=str(root / "push")))
    catalog.register("a", str(src))
    cache = WorkerCache(WorkerConfig(num_slots=args.slots, tp=args.tp, tp_rank=0, device="cuda", dtype="bfloat16",
                                     host=HostTierConfig(host_bytes=1 << 30, pin=False)), catalog)
    area = PushArea(catalog.push_root, "probe", 1 << 40)
    step = 0

    def one() -> tuple[float, list[tuple[str, float]], float, dict[str, float]]:
        """A new device version of ``a`` (a push's registration), loaded from the image to READY, then evicted."""
        nonlocal step
        step += 1
        known = device_known("a", str(step), config, head, image.numel())
        catalog.add(catalog.read("a", str(area.path("a", str(step))), known))
        t0, before = time.perf_counter(), thread_use()
        future = cache.load_image("a", known.version, image, head, settle_s=SETTLE_S)  # as a push's rank calls it
        t1, issued = time.perf_counter(), thread_use()
        record = future.result(60)
        t2, answered = time.perf_counter(), thread_use()
        with cache.book.lock:
            marks = list(cache.book.loads[record.slot].marks)
        use = use_split(before, issued, answered)
        cache.evict("a", known.version)  # the next load takes a free slot
        return t0, [*marks, ("started", t1), ("answered", t2)], t2, use

    try:
        for _ in range(3):  # the image's plan made, the gather compiled
            one()
        out: dict[str, Any] = {"model": args.model, "rank": args.rank, "tp": args.tp,
                               "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime()),
                               "host": {"node": platform.node(), "kernel": Path("/proc/version").read_text().strip(),
                                        "cpus": os.cpu_count(), "switch_interval_s": sys.getswitchinterval()},
                               "loads": {}, "captures": 0}
        profile = cProfile.Profile() if args.profile else None
        for k, gap in enumerate(float(g) for g in args.gaps.split(",") if g):
            rows = []
            for _ in range(args.repeats):
                time.sleep(gap)
                if profile is not None and k == 0:
                    profile.enable()
                rows.append(one())
                if profile is not None:
                    profile.disable()
            phases: dict[str, list[float]] = {}
            use: dict[str, list[float]] = {}
            for t0, marks, end, used in rows:
                for phase, at in marks:
                    phases.setdefault(phase, []).append((at - t0) * 1e6)
                phases.setdefault("ready_us", []).append((end - t0) * 1e6)
                for what, value in used.items():
                    what = what.replace("_cpu_s", "_cpu_us")
                    use.setdefault(what, []).append(value * 1e6 if what.endswith("_us") else value)
            out["loads"][str(gap)] = {"phases_us": {k: statistics.median(v) for k, v in phases.items()},
                                      "use": {k: statistics.median(v) for k, v in use.items()}}
            print(f"gap {gap} s: READY {out['loads'][str(gap)]['phases_us']['ready_us']:.0f} us", flush=True)
        if profile is not None:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
            out["profile"] = text.getvalue().splitlines()
        out["captures"] = cache.fill_graphs.captures  # fill graphs made (one: every load after the first replays it)
        spec = catalog.get("a")
        layout = cache.layout_of("a")
        read = cache.image_reads.read(spec, layout, head, image)
        dest = torch.empty(layout.numel, dtype=layout.dtype, device="cuda")
        out["ops"] = ops(image, read, dest, args.repeats)
        out["ops"]["sums_finite"] = timed(lambda: sums_finite(dest), args.repeats)
        out["ops"]["plan_lookup"] = timed(lambda: cache.image_reads.read(spec, layout, head, image), args.repeats)
        torch.cuda.synchronize()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(json.dumps(out, indent=2))
    finally:
        cache.close()


if __name__ == "__main__":
    main()
