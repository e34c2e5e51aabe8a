"""Push to READY (issue 44 items 2 and 5): a trainer pushes new versions of one adapter; how long until every rank
of a TP replica holds the new version READY, against one host-to-device copy of the shards in the same run.

Starts the embedded service (controller + one replica of ``--tp`` workers, GPU or ``--cpu``) with the gRPC gateway,
loads version 0 of the adapter, then pushes ``--pushes`` new versions in turn, alternately over the gateway
(``LoraCacheClient.push``: the ``PushAdapter`` stream) and by Ray object reference (``push_in_ray``). For each:

- ``answer_ms``: from the call to its answer (the stream or the object store, the check, the write into node
  memory, the content hash, every rank's registration);
- ``ready_ms``: from the call to the replica's readiness event for the new version (a one-request queue reported at
  once, as a request for it would): every rank READY;
- each rank's slot is checked against its slices of the pushed version's file (``verify``: max |diff| 0).

The reference is ``copy_probe``: each rank's plain pinned host-to-device copy of its shard's bytes, all ranks at
once (on ``--cpu``: a memcpy), so ``ready_over_copy`` is the goal's ratio (<= 1.3x).

``--via device`` pushes from a trainer's device buffer (``DevicePusher``, issue 44 item 5): the version is registered
device-only, each rank takes its shard from the buffer when its doorbell rings, and ``answer_ms`` is then every rank
READY by the doorbells' answers (``ready_in_push_ms``: the same, timed inside the call, the goal's figure);
``landed_ms`` is its node copy landed (after which each slot is checked against the
landed file). Each device push but the first takes its version registered ahead while the trainer trained
(``next_tag``: the next device step's), its every rank READY then the doorbells alone; ``device-now`` is a second
trainer's buffer whose pushes register at the call (``next_tag=None``), the path before, for the ratio in the same
run (``device_ready_over_copy`` against ``device_now_ready_over_copy``). On ``--cpu`` the image travels to each
rank by value with every push (no IPC); on a GPU the ranks open
the trainer's buffer by CUDA IPC once (``--source gpu --one-gpu``: the trainer's GPU is the ranks'). ``--via`` takes a
list (``grpc,ray``: alternately, the default).

``--source gpu`` pushes tensors that lie on the GPU (a trainer's, the RL case: the client gathers them on the device
and copies them out in one transfer), ``cpu`` tensors in host memory. ``--one-gpu`` puts every rank of the replica on
GPU 0 (a one-GPU host measuring TP 2: the ranks' copies then share one link, the reference's too; Ray is told of
``--tp`` GPUs and leaves ``CUDA_VISIBLE_DEVICES`` alone).

    python -m bench.probes.push --tp 2 --out /tmp/push.json                  # on a 2-GPU machine
    python -m bench.probes.push --tp 2 --cpu --out /tmp/push.json            # anywhere
    python -m bench.probes.push --tp 2 --one-gpu --source gpu --out /tmp/push.json   # a one-GPU host
    python -m bench.probes.push --tp 2 --one-gpu --source gpu --via device,ray --out /tmp/push.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import load

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api.client import LoraCacheClient
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.app.serve import ServeConfig, start
from lora_cache.integrations.device_push import DevicePusher
from lora_cache.integrations.ray_push import push_in_ray
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import WorkerId
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig

NAME = "trained"


def wait_ready(controller, cursor: int, version: str, timeout_s: float = 120.0) -> tuple[float, int]:
    """Block until replica-0's ready event for ``NAME@version``; (wall time seen, new cursor)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = ray.get(controller.wait_events.remote(cursor, "replica-0", NAME, 5.0))
        seen = time.time()
        for e in events:
            cursor = max(cursor, e.seq)
            if e.ready and e.version == version:
                return seen, cursor
    raise TimeoutError(f"replica-0 never became ready for {NAME}@{version}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pushes", type=int, default=6, help="new versions pushed after the first (at least 1)")
    ap.add_argument("--cpu", action="store_true", help="CPU workers (no GPU needed)")
    ap.add_argument("--source", choices=("cpu", "gpu"), default="cpu",
                    help="where the pushed tensors lie: host memory, or GPU 0 (a trainer's)")
    ap.add_argument("--one-gpu", action="store_true", help="every rank on GPU 0 (TP > 1 on a one-GPU host)")
    ap.add_argument("--via", default="grpc,ray", help=f"the ways pushes go, in turn: {', '.join(WAYS)}")
    ap.add_argument("--slots", type=int, default=4,
                    help="each rank's slots (4: every push past the fourth evicts one, written back to the host tier)")
    ap.add_argument("--in-place", action="store_true",
                    help="the device way's trainer trains in the pusher's buffer (DevicePusher.views): no copy in")
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    ways = [w for w in args.via.split(",") if w]
    if not ways or set(ways) - set(WAYS):
        raise SystemExit(f"--via {args.via!r}: give a list of {', '.join(WAYS)}")
    if args.source == "gpu" and args.cpu:
        raise SystemExit("--source gpu pushes tensors that lie on a GPU: leave out --cpu")
    if args.one_gpu:  # set before Ray starts: its workers inherit it and each sees GPU 0
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"

    root = Path(tempfile.mkdtemp(prefix="push-src-"))
    (src,) = make_adapters(root, SynthConfig(model=args.model, count=1, rank=str(args.rank), seed=3))
    tensors = load((src / WEIGHTS_FILE).read_bytes())
    config = json.loads((src / CONFIG_FILE).read_text())
    dtype = torch.float32 if args.cpu else torch.bfloat16
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())  # room for every way's kept versions
    catalog_config = CatalogConfig(adapter_roots=(str(root),), model=args.model, max_rank=args.rank,
                                   push_bytes=max(8 << 30, 16 * nbytes),
                                   push_dir=tempfile.mkdtemp(prefix="push-area-", dir=memory_dir()))
    ray.init(address="local", num_cpus=8, num_gpus=0 if args.cpu else args.tp, namespace="lora-cache",
             include_dashboard=False)
    svc = start(ServeConfig(replicas=1, tp=args.tp, gpus=not args.cpu, worker_cpus=1.0, adapters=str(root)),
                catalog_config, PlannerConfig(policy="queue"),
                WorkerConfig(num_slots=args.slots, dtype="float32" if args.cpu else "bfloat16",
                             host=HostTierConfig(host_bytes=2 << 30, pin=not args.cpu)))
    gw = start_gateway_thread(GatewayConfig(grpc_port=0, token="probe"), svc.controller)
    client = LoraCacheClient(gw.target, token="probe", timeout_s=120)
    try:
        ctl, cursor = svc.controller, 0
        rows: list[dict[str, Any]] = []
        device = "cuda:0" if args.source == "gpu" else "cpu"
        workers = [svc.workers[WorkerId("replica-0", r)] for r in range(args.tp)]
        spec = AdapterCatalog(catalog_config).register("src", str(src))
        shard = [shard_layout(spec, catalog_config.shape(), args.tp, r, dtype).nbytes for r in range(args.tp)]
        pushers = {how: DevicePusher(NAME, config) for how in ways if how.startswith("device")}
        for step in range(args.pushes + 1):
            pushed = {k: (v.float() * (1.0 + step / 100)).to(v.dtype).to(device) for k, v in tensors.items()}
            how = ways[step % len(ways)] if step else ("ray" if ways == ["device"] else ways[0])  # step 0: a version
            if device != "cpu":
                torch.cuda.synchronize()  # the tensors made: the push starts from them in place
            t0 = time.time()
            landed_ms = ready_in_push_ms = split_ms = bells = None
            done: Any
            views = pushers[how].views() if how == "device" and args.in_place else {}
            if views:  # the trainer trains in the pusher's buffer: its step's weights are written there, not copied
                for k, v in views.items():
                    v.copy_(pushed[k])
                pushed = views
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.time()
            if how in pushers:  # device: the next device step's version registered ahead; device-now: none
                ahead = step + len(ways) if how == "device" else None
                done = pushers[how].push(pushed, tag=step, next_tag=ahead)
                ready_in_push_ms = done.ready_s * 1e3  # every rank READY (the doorbells' answers), in the call
                # the ranks' logs are timed against these (an older tree's pusher, ``OLD=`` of the GPU script, has none)
                bells = (getattr(pushers[how], "rung_at", 0.0), getattr(pushers[how], "answered_at", 0.0))
                split_ms = {k: v * 1e3 for k, v in done.split_s.items()}
            else:
                done = (client.push(NAME, pushed, config, tag=step) if how == "grpc"
                        else push_in_ray(NAME, pushed, config, tag=step))
            t_answer = time.time()
            ray.get(ctl.report_queue.remote("replica-0", [(NAME, t_answer)]))
            t_ready, cursor = wait_ready(ctl, cursor, done.version)
            if how in pushers:  # each slot is checked against the landed file below
                landed = ray.get(done.landing, timeout=120)  # type: ignore[union-attr]
                landed_ms = (time.time() - t0) * 1e3
                assert landed.version == done.version
                # the landed file is the trainer's buffer as pushed: its tensors must be the step's (the slots are
                # checked against that file below)
                weights = Path(catalog_config.push_dir) / "lora-cache" / NAME / str(step) / WEIGHTS_FILE
                written = load(weights.read_bytes())
                assert written.keys() == pushed.keys() and all(torch.equal(written[k], pushed[k].cpu())
                                                               for k in written), f"push {step}: landed other bytes"
            checks = ray.get([w.verify.remote(NAME, done.version) for w in workers])
            assert all(c["max_abs_diff"] == 0.0 for c in checks), checks
            assert [c["nbytes"] for c in checks] == shard, (checks, shard)
            rows.append({"step": step, "how": how, "answer_ms": (t_answer - t0) * 1e3,
                         "ready_ms": (t_ready - t0) * 1e3, "landed_ms": landed_ms,
                         "ready_in_push_ms": ready_in_push_ms, "split_ms": split_ms, "version": done.version,
                         "bells": bells})
            print(f"push {step} ({how}): answered {rows[-1]['answer_ms']:8.1f} ms, every rank READY "
                  f"{rows[-1]['ready_ms']:8.1f} ms" + (f", landed {landed_ms:8.1f} ms" if landed_ms else ""),
                  flush=True)
        for pusher in pushers.values():
            pusher.close()
        # each rank's own part of a device push: from its doorbell's call to its answer (READY), its first load of
        # each buffer (the open, the plan) left out
        logs = ray.get([w.image_log.remote() for w in workers]) if pushers else []
        logs = [[(*entry[:3], entry[3] if len(entry) > 3 else {}) for entry in log] for log in logs]  # an older rank's
        rank_ms = [(end - called) * 1e3 for log in logs for called, _, end, _ in log[len(pushers):]]
        phases: dict[str, list[float]] = {}  # each phase of a rank's load (``SlotLoad.marks``), from its call
        use: dict[str, list[float]] = {}  # the rank's calling thread: CPU time and context switches (``image_log``)
        rung = sorted(r["bells"] for r in rows[1:] if r["bells"] and r["bells"][0])
        per_push: dict[tuple[float, float], list[tuple[float, float]]] = {}  # each push's ranks, from its ring
        for log in logs:
            for called, marks, end, used in log[len(pushers):]:
                for phase, at in marks:
                    phases.setdefault(phase, []).append((at - called) * 1e3)
                for what, value in used.items():
                    use.setdefault(what, []).append(value * 1e3 if what.endswith("_s") else value)
                bell = next(((r, a) for r, a in reversed(rung) if r <= called), None)
                if bell is not None and end <= bell[1]:  # this push's: from its ring to the rank, and the answer back
                    use.setdefault("bell_to_rank_ms", []).append((called - bell[0]) * 1e3)
                    use.setdefault("rank_to_trainer_ms", []).append((bell[1] - end) * 1e3)
                    per_push.setdefault(bell, []).append(((called - bell[0]) * 1e3, (end - bell[0]) * 1e3))
        together = ray.get([w.copy_probe.remote(n) for w, n in zip(workers, shard)])
        measured = rows[1:]  # step 0 is the first version (a cold start): not a push of a new version
        copy_ms = max(together)
        summary = {"shard_bytes": shard, "copy_ms_together": together,
                   "median_answer_ms": statistics.median(r["answer_ms"] for r in measured),
                   "median_ready_ms": statistics.median(r["ready_ms"] for r in measured),
                   "median_ready_ms_grpc": _median([r["ready_ms"] for r in measured if r["how"] == "grpc"]),
                   "median_ready_ms_ray": _median([r["ready_ms"] for r in measured if r["how"] == "ray"]),
                   # a device push's every rank READY is its answer (the doorbells'); the readiness event follows
                   "median_answer_ms_device": _median([r["answer_ms"] for r in measured if r["how"] == "device"]),
                   "median_ready_ms_device": _median([r["ready_ms"] for r in measured if r["how"] == "device"]),
                   "median_landed_ms_device": _median([r["landed_ms"] for r in measured if r["how"] == "device"]),
                   "median_ready_in_push_ms_device": _median([r["ready_in_push_ms"] for r in measured
                                                              if r["how"] == "device"])}
        now = [r for r in measured if r["how"] == "device-now"]  # registered at the call, in the same run
        summary["median_ready_in_push_ms_device_now"] = _median([r["ready_in_push_ms"] for r in now])
        for part in ("image", "register", "open", "bells", "commit"):  # where a device push's time went
            for how in pushers:
                summary[f"median_{part}_ms_{how.replace('-', '_')}"] = _median(
                    [r["split_ms"][part] for r in measured if r["how"] == how and part in r["split_ms"]])
        # device pushes that took the version registered ahead (the others registered at the call: the first one,
        # or one whose guess was given up)
        summary["device_pushes_ahead"] = sum("commit" in r["split_ms"] for r in measured if r["how"] == "device")
        summary["median_rank_load_ms"] = _median(rank_ms)
        summary["median_rank_phase_ms"] = {phase: _median(at) for phase, at in phases.items()}
        summary["median_rank_use"] = {what: _median(v) for what, v in use.items()}
        # each doorbell push: every rank's (call, answer) from the ring, and every answer read, in ms
        summary["bells_ms"] = [{"ranks": sorted(ranks), "answers_read": (a - r) * 1e3}
                               for (r, a), ranks in sorted(per_push.items())]
        summary["ready_over_copy"] = summary["median_ready_ms"] / copy_ms
        for key in ("device", "device_now"):
            if summary[f"median_ready_in_push_ms_{key}"] is not None:
                summary[f"{key}_ready_over_copy"] = summary[f"median_ready_in_push_ms_{key}"] / copy_ms
        out = {"tp": args.tp, "model": args.model, "rank": args.rank, "cpu": args.cpu, "source": args.source,
               "one_gpu": args.one_gpu, "via": ways, "host": platform.node(),
               "push_dir": catalog_config.push_dir,
               "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "date": time.strftime("%Y-%m-%d"), "rows": rows, "summary": summary}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(json.dumps(summary, indent=2))
    finally:
        client.close()
        gw.stop()
        svc.stop()
        ray.shutdown()
        shutil.rmtree(catalog_config.push_dir, ignore_errors=True)  # node memory: the pushes kept there
        shutil.rmtree(root, ignore_errors=True)


WAYS = ("grpc", "ray", "device", "device-now")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None  # one push is over one path only


def memory_dir() -> str:
    """/dev/shm where it has room for the pushes (a container's may be 64 MiB), else the temporary directory."""
    try:
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize >= 16 << 30:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


if __name__ == "__main__":
    main()
