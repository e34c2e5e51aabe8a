"""Worked example (issue 44 item 7): a trainer pushes a new version every second while requests keep coming; the
version each request ran on is recorded, and checked.

What it runs, on one machine (CPU by default; ``--gpu`` on a GPU host):
- the embedded service: a controller and one replica of ``--tp`` ranks, with the gRPC gateway;
- a trainer thread: every ``--push-every`` seconds it takes its tensors one step further and pushes them as
  ``--adapter`` (tag = the step), in turn over each way of ``--via``: the gateway (``grpc``: ``LoraCacheClient.push``),
  a Ray object reference (``ray``: ``push_in_ray``) and the trainer's device buffer (``device``: ``DevicePusher``,
  every rank READY from the buffer by its doorbell, the node copy landed after), keeping its own copy of what it
  pushed;
- the reference engine hosted on the replica's ranks, serving ``--rate`` requests a second for ``--seconds``, two
  in three for the pushed adapter and the rest for another, each admitted with the adapter's version current then.

At the end, for every request: the version it ran on (``--out``: one JSON line per request). Then the check of
invariant 1 (``bench/version_check.py``): every request was served; every rank ran the same steps, each item
with the version its request was admitted with; and each slot held exactly that version's bytes, the digest of
the rank's shard of what the trainer pushed under it.

Whether a push stalls the running batches (issue 44 item 5): rank 0's steps are split into those that overlap a
push (from its call to ``PUSH_TAIL_S`` after its answer, when the ranks load it) and the others, and the step
times of each kind compared (``--summary``: JSON). Run it with ``--no-audit`` for that: auditing a step digests its
slots on the host (a synchronization per step), and the version check then covers the requests' versions only.
``--source gpu`` keeps the trainer's tensors on the GPU (an RL trainer's).

    python -m bench.probes.push_loop --seconds 20 --out /tmp/push_loop.jsonl
    python -m bench.probes.push_loop --gpu --tp 1 --model llama-3.1-8b --source gpu --no-audit --rate 20 \
        --out /tmp/pl.jsonl --summary /tmp/pl.json                             # one GPU: do pushes stall steps?
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import load

from bench.version_check import check_steps
from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.passes import pass_nice, pass_threads, passes
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, read_adapter
from lora_cache.adapters.refs import base_name
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api.client import LoraCacheClient
from lora_cache.api.client_values import push_payload
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.app.serve import ServeConfig, start
from lora_cache.integrations.device_push import DevicePusher
from lora_cache.integrations.ray_push import push_in_ray
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import WorkerId
from workers.cache import WorkerConfig
from workers.engine import EngineConfig, Request
from workers.engine.rank import StepLog, slot_digest
from workers.reads.shard import read_shard
from workers.staging.host_config import HostTierConfig

PUSH_TAIL_S = 0.2  # after a push's answer, the ranks' loads of it: still the push's, for the stall figures


class Trainer:
    """Pushes a new version every ``every`` seconds until stopped; keeps a copy of each (version -> directory)."""

    def __init__(self, client: LoraCacheClient, name: str, tensors: dict[str, torch.Tensor], config: dict,
                 every: float, copies: Path, device: str = "cpu", ways: Sequence[str] = ("grpc", "ray")) -> None:
        self.client, self.name, self.config, self.ways = client, name, config, tuple(ways)
        self.pusher: DevicePusher | None = None  # made at the first device push
        self.tensors = {k: v.to(device) for k, v in tensors.items()}
        self.every, self.copies = every, copies
        self.versions: dict[str, Path] = {}
        self.log: list[dict[str, object]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.step = 0

    def push(self) -> None:
        step = self.step
        tensors = {k: (v.float() * (1.0 + step / 10)).to(v.dtype) for k, v in self.tensors.items()}  # "training"
        how = self.ways[step % len(self.ways)] if step else "ray"  # version 0: registered before any request
        if next(iter(tensors.values())).is_cuda:
            torch.cuda.synchronize()  # the step's tensors made: the push starts from them
        t0 = time.time()
        if how == "device":
            self.pusher = self.pusher or DevicePusher(self.name, self.config)
            # every rank READY; its node copy lands after; the next device step's version registered ahead
            done: Any = self.pusher.push(tensors, tag=step, next_tag=step + len(self.ways))
        elif how == "grpc":
            done = self.client.push(self.name, tensors, self.config, tag=step)
        else:
            done = push_in_ray(self.name, tensors, self.config, tag=step)
        answered = time.time()
        copy = self.copies / str(step)
        copy.mkdir()
        config_bytes, weights = push_payload(tensors, self.config)
        (copy / CONFIG_FILE).write_bytes(config_bytes)
        (copy / WEIGHTS_FILE).write_bytes(weights)
        self.versions[done.version] = copy
        self.log.append({"step": step, "how": how, "version": done.version, "t0": t0,
                         "answer_ms": (answered - t0) * 1e3})
        self.step += 1

    def run(self) -> None:
        try:
            while not self.stop.wait(self.every):
                self.push()
        except BaseException as e:  # reported by main
            self.error = e


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long requests keep coming")
    ap.add_argument("--push-every", type=float, default=1.0)
    ap.add_argument("--keep-versions", type=int, default=4,
                    help="older versions kept past those a rank holds (the catalog's keep_versions)")
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="GPU ranks (default: CPU)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--adapter", default="trained")
    ap.add_argument("--out", required=True, help="one JSON line per request: its adapter and the version it ran on")
    ap.add_argument("--audit", action=argparse.BooleanOptionalAction, default=True,
                    help="digest every step's slots and check them against the pushed bytes (a host sync a step)")
    ap.add_argument("--source", choices=("cpu", "gpu"), default="cpu", help="where the trainer's tensors lie")
    ap.add_argument("--summary", default="", help="write the run's figures here (JSON): pushes, steps by push")
    ap.add_argument("--admission", default=EngineConfig.admission,
                    help="the engine's admission rule (workers.engine.admission.ADMISSION); ondemand loads an "
                         "adapter only when its request is admitted, so a request waits unloaded for a lane")
    ap.add_argument("--via", default="grpc,ray", help="the ways pushes go, in turn: grpc, ray, device")
    ap.add_argument("--staleness", type=int, default=-1,
                    help="K >= 0: each request for the pushed adapter names the version K pushes behind the newest "
                         "(ADAPTER@STEP, as an RL trainer's rollouts on a lagging policy do), submitted as it arrives "
                         "to a streaming run; -1 (default): given up front, each admitted on the version current then")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    ways = [w for w in args.via.split(",") if w]
    if not ways or set(ways) - {"grpc", "ray", "device"}:
        raise SystemExit(f"--via {args.via!r}: give a list of grpc, ray, device")
    if args.source == "gpu" and not args.gpu:
        raise SystemExit("--source gpu keeps the trainer's tensors on a GPU: add --gpu")

    work = Path(tempfile.mkdtemp(prefix="push-loop-"))
    make_adapters(work / "adapters", SynthConfig(model=args.model, count=2, rank="8"))
    src = work / "adapters" / "adapter-001"
    tensors, config = load((src / WEIGHTS_FILE).read_bytes()), json.loads((src / CONFIG_FILE).read_text())
    catalog = CatalogConfig(adapter_roots=(str(work / "adapters"),), model=args.model, max_rank=16,
                            keep_versions=args.keep_versions,
                            push_dir=str(work / "push") if not Path("/dev/shm").is_dir() else "")
    host = HostTierConfig(host_bytes=(64 << 20) if args.model == "tiny" else (2 << 30), pin=args.gpu)
    ray.init(address="local", num_cpus=4, num_gpus=args.tp if args.gpu else 0, namespace="lora-cache",
             include_dashboard=False, log_to_driver=False)
    svc = start(ServeConfig(adapters=str(work / "adapters"), replicas=1, tp=args.tp, gpus=args.gpu), catalog,
                PlannerConfig(), WorkerConfig(num_slots=4, host=host))
    gw = start_gateway_thread(GatewayConfig(grpc_port=0, token="example"), svc.controller)
    client = LoraCacheClient(gw.target, token="example", timeout_s=120)
    (work / "copies").mkdir()
    trainer = Trainer(client, args.adapter, tensors, config, args.push_every, work / "copies",
                      "cuda:0" if args.source == "gpu" else "cpu", ways)
    try:
        trainer.push()  # version 0, before the first request
        ranks = [svc.workers[WorkerId("replica-0", k)] for k in range(args.tp)]
        engine = EngineConfig(adapters=str(work / "adapters"), model=args.model, device="cuda" if args.gpu else "cpu",
                              tp=args.tp, num_slots=4, max_adapters=2, max_running=8, max_prefill_tokens=64,
                              max_seq_len=64, max_rank=16, audit_steps=args.audit, host=host,
                              admission=args.admission)
        meet = ray.get(ranks[0].engine_rendezvous.remote(args.tp), timeout=60)
        ray.get([h.engine_build.remote(engine, meet) for h in ranks], timeout=600)
        count = int(args.seconds * args.rate)
        requests = [Request(i, args.adapter if i % 3 else "adapter-000", 4 + i % 5, 3 + i % 4, i / args.rate)
                    for i in range(count)]
        start_wall = time.time() + 1.0
        streaming = args.staleness >= 0
        runs = [ranks[0].engine_run.remote([] if streaming else requests, start_wall, 0, True, streaming),
                *[h.engine_run.remote([] if streaming else requests, start_wall) for h in ranks[1:]]]
        pusher = threading.Thread(target=trainer.run, name="trainer", daemon=True)
        pusher.start()
        refused = submit_stale(ranks[0], requests, trainer, args.adapter, args.staleness, start_wall) \
            if streaming else []
        result = ray.get(runs[0], timeout=args.seconds * 10 + 300)
        audits = [result.ranks[k].audit for k in range(args.tp)]
        ray.get(runs[1:])
        trainer.stop.set()
        pusher.join(timeout=120)
        if trainer.error is not None:
            raise trainer.error
        if trainer.pusher is not None:
            trainer.pusher.close()
        tags = {row["version"]: row["step"] for row in trainer.log}
        with open(args.out, "w") as f:
            for r in result.records:
                ours = r.adapter is not None and base_name(r.adapter) == args.adapter  # ``A`` or a pinned ``A@V``
                f.write(json.dumps({"rid": r.rid, "adapter": r.adapter, "version": r.version, "ok": r.ok,
                                    "pushed_step": tags.get(r.version) if ours else None}) + "\n")

        failed = [r for r in result.records if not r.ok]
        print(f"{len(failed)} of {len(result.records)} requests failed (keep_versions {args.keep_versions}, a push "
              f"every {args.push_every} s)" + "".join(f"\n  {r.rid}: {r.error}" for r in failed[:5]))
        if streaming:
            print(f"{len(refused)} of {count} submits refused (each names the version {args.staleness} pushes behind "
                  "the newest)" + "".join(f"\n  {e}" for e in refused[:5]))
        shape = catalog.shape()

        def expected(directory: Path, name: str, rank: int) -> str:
            spec = read_adapter(name, directory, shape, 16)
            layout = shard_layout(spec, shape, args.tp, rank, torch.bfloat16)  # the workers' slot dtype
            staged = torch.empty(layout.numel, dtype=layout.dtype)
            read_shard(spec, layout, staged)
            return slot_digest(staged)

        pushes = [float(row["answer_ms"]) for row in trainer.log]  # type: ignore[arg-type]
        stalls = push_stalls(result.ranks[0].step_log, trainer.log)
        print(f"{len(result.records)} requests served while {len(trainer.log)} versions were pushed "
              f"(answers {min(pushes):.0f}-{max(pushes):.0f} ms); steps during a push / the others: "
              + json.dumps(stalls))
        if args.audit:
            checked, served = check_steps(result.records, audits, args.adapter,
                                          lambda name, v: trainer.versions[v] if name == args.adapter
                                          else work / "adapters" / name, expected)
            print(f"{served} versions of {args.adapter} served; {checked} slot digests checked: every step of every "
                  f"rank ran the version its request was admitted with, and held that version's bytes. Per request: "
                  f"{args.out}")
        else:
            assert not failed and not refused, ([r.error for r in failed], refused)
            served = len({r.version for r in result.records if r.adapter and base_name(r.adapter) == args.adapter})
            print(f"{served} versions of {args.adapter} served (steps not audited: --no-audit)")
        if args.summary:
            Path(args.summary).write_text(json.dumps(
                {"model": args.model, "tp": args.tp, "gpu": args.gpu, "source": args.source, "audit": args.audit,
                 "rate": args.rate, "seconds": args.seconds, "push_every": args.push_every,
                 "staleness": args.staleness, "keep_versions": args.keep_versions, "failed": len(failed),
                 "via": ways,
                 "pass_threads": pass_threads(), "pass_nice": pass_nice(),
                 "pass_niceness_seen": passes().submit(lambda: os.getpriority(
                     os.PRIO_PROCESS, threading.get_native_id())).result(),
                 "refused": len(refused),
                 "requests": len(result.records), "served_versions": served, "pushes": trainer.log,
                 "steps": stalls, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, indent=2))
    finally:
        client.close()
        gw.stop()
        svc.stop()
        ray.shutdown()


def submit_stale(rank0: Any, requests: Sequence[Request], trainer: Trainer, adapter: str, staleness: int,
                 start_wall: float) -> list[str]:
    """Submit each request to the streaming run at its arrival, naming ``adapter``'s version ``staleness`` pushes
    behind the newest the trainer has pushed then (``ADAPTER@STEP``); then end the stream. The refusals (a submit
    naming a version no longer kept is refused whole: ``HostedEngine.submit``)."""
    refused: list[str] = []
    for r in requests:
        time.sleep(max(0.0, start_wall + r.arrival_s - time.time()))
        if r.adapter == adapter:
            r = r._replace(adapter=f"{adapter}@{max(0, trainer.step - 1 - staleness)}")
        try:
            ray.get(rank0.engine_submit.remote([r]), timeout=60)
        except Exception as e:  # a refusal names the request and the version: counted, the stream goes on
            refused.append(f"{r.rid} {r.adapter}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    ray.get(rank0.engine_end_stream.remote(), timeout=60)
    return refused


def push_stalls(steps: Sequence[StepLog], pushes: Sequence[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Rank 0's step times (ms) by kind, for the steps that overlap a push (its call to ``PUSH_TAIL_S`` after its
    answer) and for the others: count, median, p90, max; and the ratio of the medians (1.0: no stall)."""
    windows = [(float(p["t0"]), float(p["t0"]) + float(p["answer_ms"]) / 1e3 + PUSH_TAIL_S)  # type: ignore[arg-type]
               for p in pushes]
    out: dict[str, dict[str, float]] = {}
    for kind in ("decode", "prefill"):
        during: list[float] = []
        other: list[float] = []
        for step in steps:
            if step.kind != kind:
                continue
            end = step.wall_s + step.ms / 1e3
            (during if any(a < end and step.wall_s < b for a, b in windows) else other).append(step.ms)
        for name, values in (("during_push", during), ("other", other)):
            values.sort()
            out[f"{kind}_{name}"] = ({"count": len(values), "median_ms": statistics.median(values),
                                      "p90_ms": values[int(0.9 * (len(values) - 1))], "max_ms": values[-1]}
                                     if values else {"count": 0})
        if during and other:
            out[f"{kind}_ratio"] = {"median": statistics.median(during) / statistics.median(other)}
    return out


if __name__ == "__main__":
    main()
