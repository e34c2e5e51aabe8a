"""Registration's reads against a store that throttles (issue 44 item 6): how close to the store's own rate.

N tiny adapters are uploaded to moto's S3 server (a process of its own); in front of it a ``ThrottleProxy`` admits
``--rate`` requests a second (a token bucket of ``--burst``) and answers the rest ``503 SlowDown``, as a store asked
too fast does. The N adapters' metadata is then read ``--store-reads`` at a time, as the registrar reads a batch
(``read_store_adapter`` on a pool of threads, one shared client). Printed: adapters read and failed, seconds, the
floor the rate sets (2 requests an adapter / rate), their ratio, the store's throttled answers per request passed,
and the client's window at the end (``StorePace``).

    python -m bench.probes.store_throttle --count 400 --rate 100 --burst 20 --store-reads 32
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.probes.catalog import make_adapters
from bench.probes.s3_local import ThrottleProxy, moto_server, upload

BUCKET = "throttle-bkt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--rate", type=float, default=100.0, help="requests a second the store admits")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--store-reads", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=20.0, help="the store timeout (each call's deadline)")
    parser.add_argument("--cache", default="/tmp/lora-cache-bench-throttle")
    args = parser.parse_args()

    import os

    from lora_cache.adapters.objects import StoreUrl
    from lora_cache.adapters.shapes import resolve_model
    from lora_cache.adapters.store import client, read_store_adapter

    root = Path(args.cache)
    make_adapters(root, "tiny", 8, args.count)
    dirs = sorted(p for p in root.iterdir() if p.is_dir())[: args.count]
    shape = resolve_model("tiny")
    with moto_server() as endpoint:
        upload(dirs, BUCKET, "a")
        with ThrottleProxy(endpoint, args.rate, args.burst) as proxy:
            os.environ["AWS_ENDPOINT_URL"] = proxy.url

            def one(d: Path) -> str | None:
                try:
                    read_store_adapter(d.name, StoreUrl.parse(f"s3://{BUCKET}/a/{d.name}"), shape, 64, args.timeout_s)
                    return None
                except Exception as e:
                    return f"{type(e).__name__}: {e}"

            start = time.monotonic()
            with ThreadPoolExecutor(args.store_reads) as pool:
                errors = [e for e in pool.map(one, dirs) if e is not None]
            took = time.monotonic() - start
            paced = getattr(client(args.timeout_s), "lora_cache_pace", None)  # None: a build before the pace
            pace = paced.stats() if paced is not None else {"window": float("nan"), "cuts": 0}
    floor = 2 * len(dirs) / args.rate
    print(f"{len(dirs)} adapters, {args.store_reads} at a time, store admitting {args.rate:g}/s (burst {args.burst}): "
          f"{len(dirs) - len(errors)} read, {len(errors)} failed, {took:.2f} s against the rate's floor {floor:.2f} s "
          f"(x{took / floor:.2f}); the store throttled {proxy.throttled} requests, passed {proxy.passed} "
          f"({proxy.throttled / max(1, proxy.passed):.2f} per passed); the client's window at the end "
          f"{pace['window']:.1f} ({pace['cuts']} halvings)")
    for e in errors[:3]:
        print("  e.g.", e[:300])


if __name__ == "__main__":
    main()
