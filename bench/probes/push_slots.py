"""A pushed version taken into the ranks' slots from the trainer's GPU buffer, READY on every rank (issue 44 item 5).

``bench.probes.device_read`` timed a rank's read of its shard into a bare buffer. Here each rank is a real
``WorkerActor`` (its ``WorkerCache``: slot table, copy stream, completion watcher, readiness record) and the push is
``load_image``: the trainer's buffer opened once per rank (``open_image``: CUDA IPC, and its one interprocess event),
then per push the trainer records its event and calls every rank (the call names the buffer; its header bytes
were sent with the open), each reserving a slot, gathering its shard into it on
its copy stream after that event, proving it finite and answering once READY. Per model and TP size, in one run:

- ``copy_ms``: the reference, each rank copying its shard's bytes from pinned host memory to its GPU, all at once
  (``WorkerActor.copy_probe``);
- ``push_ms``: from the trainer's event to every rank's READY answer (median of ``repeats``, the first apart:
  ``push_first_ms``); ``ready_ms`` / ``gather_ms``: inside the slowest rank, from the call to READY and the gather's
  own time by CUDA events (the readiness record's ``ready_ms`` / ``h2d_ms``); ``call_ms``: the same Ray call to every
  rank doing nothing (``ping``).

``--via`` names how a push reaches the ranks, each timed in the same run on the same ranks: ``call`` (one Ray call
per rank), ``call-head`` (the same, the header bytes sent with each push), ``bell`` (each rank's doorbell,
``workers.control.doorbell``: a UNIX socket on the node, no Ray call on the push's path).

Between pushes each rank evicts the version (a controller's ``Evict``), outside the timing. Every rank's slot is
checked against its slices of the file (``WorkerActor.verify``) after the pushes.

    python -m bench.probes.push_slots --model llama-3.1-8b --rank 16 --tp 1,2 --via call,bell --out /tmp/push_slots.json
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

from bench.probes.device_read import build_parser as device_read_parser
from bench.probes.push_floor import timed
from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.peft import WEIGHTS_FILE
from lora_cache.adapters.serialize import device_image
from lora_cache.adapters.shapes import MODULE_ORDER, resolve_model
from lora_cache.adapters.synth import write_adapter
from lora_cache.link.bell import Bell, ring_all
from lora_cache.vocab import Evict, ReadinessRecord
from workers.actor import WorkerActor
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig

DTYPE = torch.bfloat16


def build_parser() -> argparse.ArgumentParser:
    ap = device_read_parser()  # the same adapter, TP sizes, repeats and output
    ap.description = __doc__
    ap.add_argument("--via", default="call,bell",
                    help="how a push reaches the ranks, comma-separated, each timed in the same run: call (one Ray "
                         "call per rank), call-head (the same with the image's header bytes sent each push, as before "
                         "2026-12-05, not once at the open), bell (each rank's doorbell: a UNIX socket, no Ray call)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of the probe itself (the image sent by value; no timing that means anything)")
    return ap


def split_phases(calls: list[tuple[float, float]], logs: list[list[Any]]) -> dict[str, list[float]]:
    """Where each push's time went, in ms per push (the slowest rank's), from the trainer's call and each rank's
    ``image_log`` (one monotonic clock on one node): to the rank's method (``arrive``), to its slot (``slot``), its
    residency reports (``reported``), to the fill's start (``fill``), the read's launches (``filled``), the finite
    flag's copy (``meta``), the metadata's host work (``meta_end``), to the watcher (``watch``), until it saw the
    copy done (``seen``), to READY (``ready``), to the method's answer (``answer``) and back to the trainer
    (``back``)."""
    out: dict[str, list[float]] = {}
    for i, (t_call, t_back) in enumerate(calls):
        per_rank = []
        for log in logs:
            t_in, marks, t_out = log[i][:3]
            at = {name: t for name, t in marks}
            points = [("arrive", t_in), ("slot", at.get("slot")), ("reported", at.get("reported")),
                      ("fill", at.get("fill")), ("filled", at.get("filled")), ("meta", at.get("meta")),
                      ("meta_end", at.get("meta end")), ("watch", at.get("watch")), ("seen", at.get("seen")),
                      ("ready", at.get("ready")), ("answer", t_out), ("back", t_back)]
            prev, row = t_call, {}
            for name, t in points:
                if t is not None:
                    row[name] = (t - prev) * 1e3
                    prev = t
            per_rank.append(row)
        for name in per_rank[0]:
            out.setdefault(name, []).append(max(r.get(name, 0.0) for r in per_rank))
    return out


VIAS = ("call", "call-head", "bell")  # one Ray call per rank; the same with the header each push; each rank's doorbell


def one_tp(root: str, model: str, rank: int, tp: int, image: torch.Tensor, head: bytes, repeats: int,
           vias: list[str]) -> list[dict[str, Any]]:
    cuda = image.is_cuda
    gpus = torch.cuda.device_count()
    catalog = CatalogConfig(adapter_roots=(root,), model=model, max_rank=rank)
    ranks = []
    for k in range(tp):
        config = WorkerConfig(num_slots=2, tp=tp, tp_rank=k, device=f"cuda:{k % gpus}" if cuda else "cpu",
                              host=HostTierConfig(host_bytes=4 << 30, pin=False))
        ranks.append(WorkerActor.options(num_cpus=1).remote(  # type: ignore[attr-defined]
            f"probe-{tp}-{k}", "probe", config, catalog))
    try:
        versions = ray.get([r.register_adapter.remote("a", str(Path(root) / "a")) for r in ranks], timeout=600)
        version = versions[0]
        event = torch.cuda.Event(interprocess=True) if cuda else None  # the trainer's one, opened once by each rank
        handle = reduce_tensor(image) if cuda else image  # on the CPU (a dry run) the image travels by value
        sizes = ray.get([r.open_image.remote("trainer", handle, event.ipc_handle() if event else None, head)
                         for r in ranks])
        assert sizes == [image.numel()] * tp
        bells = [Bell(path) for path in ray.get([r.open_doorbell.remote() for r in ranks])]
        copy_ms = 0.0
        out = []
        for via in vias:
            records: list[list[Any]] = []
            calls: list[tuple[float, float]] = []

            def push(via: str = via, records: list[list[Any]] = records, calls: list[tuple[float, float]] = calls
                     ) -> None:
                image[-1:].add_(0)  # the trainer's last write (a no-op on its last byte), then its event
                if event is not None:
                    event.record()
                t0 = time.perf_counter()
                if via == "bell":
                    answers = ring_all(bells, [{"buffer": "trainer", "name": "a", "version": version}] * tp)
                    records.append([ReadinessRecord(**a["record"]) for a in answers])
                else:  # the header bytes again with each push, or only those sent with the open
                    sent = head if via == "call-head" else b""
                    records.append(ray.get([r.load_image.remote("a", version, "trainer", sent) for r in ranks],
                                           timeout=120))
                calls.append((t0, time.perf_counter()))

            logged = [len(x) for x in ray.get([r.image_log.remote() for r in ranks])]
            times = []
            for _ in range(repeats):
                times.append(timed(push, 1)[0])
                ray.get([r.apply.remote([Evict("a", version, 0)]) for r in ranks], timeout=60)  # a rank's eviction
            push()  # once more, left resident for the check
            checks = ray.get([r.verify.remote("a", version) for r in ranks], timeout=600)
            if any(c["max_abs_diff"] != 0.0 for c in checks):
                raise AssertionError(f"TP {tp} {via}: a rank's slot holds other bytes than its slices of the file: "
                                     f"{checks}")
            shard_bytes = max(int(c["nbytes"]) for c in checks)
            if not copy_ms:
                copy_ms = max(ray.get([r.copy_probe.remote(shard_bytes, repeats) for r in ranks]))  # ranks at once
            ray.get([r.apply.remote([Evict("a", version, 0)]) for r in ranks], timeout=60)
            call = timed(lambda: ray.get([r.ping.remote() for r in ranks]), repeats)
            logs = [x[n:] for x, n in zip(ray.get([r.image_log.remote() for r in ranks]), logged, strict=True)]
            phases = split_phases(calls[:-1], logs)
            ready = [max(rec.ready_ms for rec in recs) for recs in records[:-1]]
            gather = [max(rec.h2d_ms for rec in recs) for recs in records[:-1]]
            summary: dict[str, Any] = {
                "copy_ms": copy_ms, "shard_bytes": shard_bytes, "push_first_ms": times[0],
                "push_ms": statistics.median(times[1:]), "push_min_ms": min(times[1:]),
                "push_max_ms": max(times[1:]), "ready_ms": statistics.median(ready[1:]),
                "gather_ms": statistics.median(gather[1:]), "call_ms": statistics.median(call[1:]),
            }
            for key in ("push_ms", "push_first_ms", "push_min_ms", "ready_ms", "gather_ms", "call_ms"):
                summary[key.replace("_ms", "_over_copy")] = summary[key] / copy_ms
            summary["phases_ms"] = {k: statistics.median(v[1:]) for k, v in phases.items()}
            out.append({"tp": tp, "via": via, "push_all_ms": times, "ready_all_ms": ready, "gather_all_ms": gather,
                        "call_all_ms": call, "summary": summary, "checks": checks})
        for bell in bells:
            bell.close()
        return out
    finally:
        for r in ranks:
            ray.kill(r)


def main() -> None:
    args = build_parser().parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no GPU is visible here: this probe times a device path; run it on a GPU host "
                         "(or --device cpu for a dry run)")
    tps = [int(x) for x in args.tp.split(",")]
    os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"  # each rank sees the trainer's GPU
    shape = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(Path(tmp) / "a", shape, args.rank, 2.0 * args.rank, list(MODULE_ORDER), DTYPE,
                      torch.Generator().manual_seed(5))
        raw = (Path(tmp) / "a" / WEIGHTS_FILE).read_bytes()
        tensors = {k: v.to(args.device) for k, v in load_file(str(Path(tmp) / "a" / WEIGHTS_FILE)).items()}
        image = device_image(tensors, {"format": "pt"})  # the trainer's pushed buffer, laid out on its GPU
        if bytes(image.cpu().numpy()) != raw:
            raise AssertionError("the trainer's image is not the adapter's safetensors file")
        head = raw[:8 + int.from_bytes(raw[:8], "little")]
        ray.init(address="local", num_cpus=max(4, max(tps) + 1), include_dashboard=False)
        try:
            vias = args.via.split(",")
            runs = [run for tp in tps for run in one_tp(tmp, args.model, args.rank, tp, image, head, args.repeats,
                                                        vias)]
        finally:
            ray.shutdown()
    out = {"model": args.model, "rank": args.rank, "image_bytes": len(raw), "host": platform.node(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "repeats": args.repeats, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({f"tp{r['tp']}-{r['via']}": r["summary"] for r in runs}, indent=2))


if __name__ == "__main__":
    main()
