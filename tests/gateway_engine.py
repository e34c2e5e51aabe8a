"""An engine process outside the Ray cluster, for tests/test_ray_gateway_attach.py: it attaches one rank
through the gateway (``AttachConfig(gateway=...)``) and obeys one JSON command per stdin line, answering
one JSON line on stdout: ``residency``, ``step`` (acquire + release), ``queue``, ``resolve``, ``pushed`` (a pushed
version's copy here and the slot's bytes against it), ``stats``, ``detach``. ``push_dir``: this process's push area
(``LORA_CACHE_PUSH_DIR``), as another machine's.

    python tests/gateway_engine.py '{"replica": "replica-g", "gateway": "127.0.0.1:50051", "token": "..."}'
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("push_dir"):
        import os

        from lora_cache.adapters.pushed import ENV

        os.environ[ENV] = args["push_dir"]
    from workers.attach.attachment import AttachConfig, attach
    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    config = AttachConfig(replica=args["replica"], gateway=args["gateway"], token=args.get("token", ""),
                          tls_ca=args.get("tls_ca", ""), tls_client_cert=args.get("tls_client_cert", ""),
                          tls_client_key=args.get("tls_client_key", ""),
                          poll_s=0.5, liveness_s=args.get("liveness_s", 10.0),
                          name_wait_s=args.get("name_wait_s", 30.0), max_adapters=args.get("max_adapters", 0),
                          max_running=args.get("max_running", 0), **({"service": args["service"]} if "service" in args
                                                                        else {}))
    worker = WorkerConfig(num_slots=3, tp=args.get("tp", 1), tp_rank=args.get("rank", 0), device="cpu",
                          dtype="float32", host=HostTierConfig(host_bytes=1 << 22, pin=False))
    try:
        rank = attach(config, worker)
    except Exception as e:  # the test reads the refusal
        reply({"error": type(e).__name__, "message": str(e), "ray": "ray" in sys.modules})
        return
    reply({"attached": rank.name, "ray": "ray" in sys.modules, "model": rank.catalog.shape.name})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            reply({"ok": run(rank, command)})
        except Exception:
            reply({"error": traceback.format_exc()})
        if command["op"] == "detach":
            return


def run(rank: Any, command: dict[str, Any]) -> Any:
    op = command["op"]
    if op == "residency":
        return [(r["adapter"], r["state"]) for r in rank.cache.residency()]
    if op == "step":
        batch = rank.acquire(command["adapters"])
        rank.release(batch)
        return list(batch.slots)
    if op == "queue":
        rank.report_queue([(a, time.time()) for a in command["adapters"]])
        return True
    if op == "resolve":  # a request for a name not registered yet: registered on demand, then in this catalog
        try:
            return {"version": rank.resolve(command["adapter"], command.get("timeout_s", 30.0)),
                    "catalog": rank.catalog.get(command["adapter"]).version}
        except Exception as e:  # the controller's typed refusal, as the engine sees it
            return {"error": type(e).__name__, "message": str(e)}
    if op == "pushed":  # the current version of a pushed name: where this rank reads it, and its slot against it
        import torch

        from workers.reads.shard import read_shard

        spec = rank.catalog.get(command["adapter"])
        batch = rank.acquire([command["adapter"]])
        try:
            layout = rank.cache.layout_of(spec.name, spec.version)
            staged = torch.empty(layout.numel, dtype=layout.dtype)
            read_shard(spec, layout, staged)
            same = torch.equal(rank.cache.shard(batch.slots[0]).cpu()[:layout.numel], staged)
        finally:
            rank.release(batch)
        return {"version": spec.version, "path": str(spec.path), "slot_is_the_file": same}
    if op == "stats":
        served = rank.served
        return {**rank.control.stats(), "calls": served.calls, "errors": served.errors, "lost": repr(served.lost),
                "ray": "ray" in sys.modules}
    if op == "detach":
        rank.detach()
        return True
    raise ValueError(f"unknown op {op!r}")


def reply(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, default=str) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
