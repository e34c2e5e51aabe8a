"""One TP replica on real Ray: each rank loads only its shard, the replica is ready only after all.

Starts the embedded service (controller + one replica of ``--tp`` GPU workers, or CPU workers with
``--cpu``), makes Llama-shaped PEFT adapters, and for each adapter in turn reports a one-request
queue, then records:

- per rank: the wall time its shard became READY, its h2d copy time and bytes (the shard's packed
  size, from the layout), and a check of the slot against that rank's slices of the file;
- the time the controller's readiness event for the replica reached a subscriber (this driver).

It checks that every rank's bytes are its own shard's (not the whole adapter), that the ranks' shards
together hold exactly the adapter's values (column-parallel lora_A and row-parallel lora_B are
replicated, the rest split), and that the replica event never precedes the last rank's READY.

    python -m bench.probes.tp_ready --tp 2 --out results/tp2.json            # on a 2-GPU machine
    python -m bench.probes.tp_ready --tp 2 --cpu --model tiny --out /tmp/x.json  # anywhere
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig, start
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import WorkerId
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig


def wait_event(controller, cursor: int, replica: str, adapter: str, timeout_s: float = 120.0) -> tuple[float, int]:
    """Block until the replica-level ready event for ``adapter``; (wall time seen, new cursor)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = ray.get(controller.wait_events.remote(cursor, replica, adapter, 5.0))
        seen = time.time()
        for e in events:
            cursor = max(cursor, e.seq)
            if e.ready:
                return seen, cursor
    raise TimeoutError(f"{replica} never became ready for {adapter}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--count", type=int, default=6)
    ap.add_argument("--cpu", action="store_true", help="CPU workers (no GPU needed)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tp-ready-"))
    synth = SynthConfig(model=args.model, count=args.count, rank=args.ranks, seed=1)
    make_adapters(root, synth)
    max_rank = max(synth.ranks())
    catalog_config = CatalogConfig(adapter_roots=(str(root),), model=args.model, max_rank=max_rank)
    ray.init(address="local", num_cpus=8, num_gpus=0 if args.cpu else args.tp, namespace="lora-cache",
             include_dashboard=False)
    svc = start(ServeConfig(replicas=1, tp=args.tp, gpus=not args.cpu, worker_cpus=1.0, adapters=str(root)),
                catalog_config, PlannerConfig(policy="queue"),
                WorkerConfig(num_slots=args.count, dtype="bfloat16" if not args.cpu else "float32",
                             host=HostTierConfig(host_bytes=4 << 30, pin=not args.cpu)))
    try:
        local = AdapterCatalog(catalog_config)
        local.register_dir(root)
        ctl, replica, cursor, rows = svc.controller, "replica-0", 0, []
        devices = {r: ray.get(svc.workers[WorkerId(replica, r)].describe.remote())["node"] for r in range(args.tp)}
        for name in sorted(p.name for p in root.iterdir()):
            spec = local.get(name)
            dtype = torch.bfloat16 if not args.cpu else torch.float32
            full = shard_layout(spec, local.shape, 1, 0, dtype).nbytes
            t0 = time.time()
            ray.get(ctl.report_queue.remote(replica, [(name, t0)]))
            t_event, cursor = wait_event(ctl, cursor, replica, name)
            ranks = []
            for r in range(args.tp):
                worker = svc.workers[WorkerId(replica, r)]
                t_ready, record = next((t, rec) for t, rec in reversed(ray.get(worker.load_log.remote()))
                                       if rec.adapter == name)
                check = ray.get(worker.verify.remote(name))
                want = shard_layout(spec, local.shape, args.tp, r, dtype).nbytes
                assert record.nbytes == want == check["nbytes"], (record.nbytes, want, check)
                assert check["max_abs_diff"] == 0.0, check
                ranks.append({"rank": r, "ready_after_ms": (t_ready - t0) * 1e3, "h2d_ms": record.h2d_ms,
                              "disk_ms": record.disk_ms, "ready_ms": record.ready_ms, "nbytes": record.nbytes,
                              "shard_fraction": record.nbytes / full,
                              "h2d_GBps": record.nbytes / record.h2d_ms / 1e6 if record.h2d_ms else None})
            last_rank = max(x["ready_after_ms"] for x in ranks)
            event_ms = (t_event - t0) * 1e3
            assert event_ms >= last_rank, f"{name}: replica event at {event_ms} ms before a rank's READY"
            rows.append({"adapter": name, "rank": spec.modules[0].rank, "full_bytes": full,
                         "replica_ready_ms": event_ms, "last_rank_ready_ms": last_rank,
                         "first_rank_ready_ms": min(x["ready_after_ms"] for x in ranks), "ranks": ranks})
            print(f"{name} r={spec.modules[0].rank:3d} full {full / 2**20:7.2f} MiB | " + " | ".join(
                f"rank {x['rank']}: {x['nbytes'] / 2**20:6.2f} MiB ({x['shard_fraction']:.3f}) "
                f"h2d {x['h2d_ms']:6.3f} ms ready +{x['ready_after_ms']:7.2f} ms" for x in ranks)
                + f" | replica ready +{event_ms:7.2f} ms", flush=True)
        # the reference: a plain pinned memcpy of the largest shard, per rank alone, then all ranks at once
        biggest = max(x["nbytes"] for r in rows for x in r["ranks"])
        handles = [svc.workers[WorkerId(replica, r)] for r in range(args.tp)]
        alone = [ray.get(h.copy_probe.remote(biggest)) for h in handles]
        together = ray.get([h.copy_probe.remote(biggest) for h in handles])
        load_ms = [x["h2d_ms"] for r in rows[1:] for x in r["ranks"] if x["nbytes"] == biggest]  # past warm-up
        summary = {
            "memcpy_ms_alone": alone, "memcpy_ms_together": together,
            "memcpy_GBps_alone": [biggest / t / 1e6 for t in alone],
            "median_load_h2d_ms_largest": statistics.median(load_ms) if load_ms else None,
            "load_over_memcpy_alone": statistics.median(load_ms) / statistics.median(alone) if load_ms else None,
            "median_shard_fraction": statistics.median(x["shard_fraction"] for r in rows for x in r["ranks"]),
            "median_replica_minus_last_rank_ms": statistics.median(
                r["replica_ready_ms"] - r["last_rank_ready_ms"] for r in rows),
            "median_rank_spread_ms": statistics.median(
                r["last_rank_ready_ms"] - r["first_rank_ready_ms"] for r in rows),
            "events_after_every_rank": all(r["replica_ready_ms"] >= r["last_rank_ready_ms"] for r in rows),
            # all ranks' shards of one adapter move at once: their bytes over the slowest rank's copy, against
            # every rank's plain pinned copy of the largest shard at once (same run, same GPUs)
            "aggregate_load_GBps": statistics.median(
                sum(x["nbytes"] for x in r["ranks"]) / max(x["h2d_ms"] for x in r["ranks"]) / 1e6 for r in rows[1:])
            if len(rows) > 1 else None,
            "aggregate_memcpy_GBps": args.tp * biggest / max(together) / 1e6,
        }
        if summary["aggregate_load_GBps"] is not None:
            summary["aggregate_load_over_memcpy"] = summary["aggregate_load_GBps"] / summary["aggregate_memcpy_GBps"]
        out = {"tp": args.tp, "model": args.model, "cpu": args.cpu, "nodes": devices,
               "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "rows": rows, "summary": summary}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(json.dumps(summary, indent=2))
    finally:
        svc.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
