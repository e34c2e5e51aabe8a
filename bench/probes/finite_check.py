"""The finiteness check's rate (``workers.reads.finite``) against a host memcpy of the same bytes, in one run.

Each chunk a read publishes is proven finite on the read's publishing thread (issue 46). This probe times
``all_finite`` (pieces on its pool) and ``one_finite`` (this thread) over a shard's bytes at 1 and ``--threads``
torch threads (a worker actor's torch runs one) and,
as the reference, one ``copy_`` of the same bytes between two host tensors (what a page-cache read costs per
byte, at best, on one thread). A ratio below 1 means the check is slower than a one-thread copy of the shard.

    python -m bench.probes.finite_check --mib 42,168 --threads 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from workers.reads.finite import CHECK_THREADS, all_finite, one_finite


def best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(mib: int, threads: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    src = torch.randn(mib << 19, dtype=torch.bfloat16)  # mib MiB of bf16
    dst = torch.empty_like(src)
    copy_s = best_s(lambda: dst.copy_(src), repeats)
    check_s = best_s(lambda: all_finite(src), repeats)
    one_s = best_s(lambda: one_finite(src), repeats)
    gb = src.numel() * src.element_size() / 1e9
    return {"mib": mib, "threads": threads, "pool": CHECK_THREADS, "check_ms": check_s * 1e3, "copy_ms": copy_s * 1e3,
            "one_thread_check_ms": one_s * 1e3, "check_gb_s": gb / check_s, "copy_gb_s": gb / copy_s,
            "one_thread_check_gb_s": gb / one_s, "check_over_copy_rate": copy_s / check_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="42,168", help="shard sizes in MiB (8B r16 / r64 at TP 1: ~42 / ~168)")
    parser.add_argument("--threads", type=int, default=4, help="torch threads besides 1")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="", help="write the rows here too")
    ns = parser.parse_args()
    rows = [measure(int(m), t, ns.repeats) for m in ns.mib.split(",") for t in sorted({1, ns.threads})]
    for r in rows:
        print(f"{r['mib']:>5} MiB, {r['threads']} torch thread(s): check on {r['pool']} {r['check_ms']:.1f} ms "
              f"({r['check_gb_s']:.1f} GB/s), on this thread {r['one_thread_check_gb_s']:.1f} GB/s, "
              f"copy {r['copy_ms']:.1f} ms ({r['copy_gb_s']:.1f} GB/s), "
              f"check rate / copy rate {r['check_over_copy_rate']:.2f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
