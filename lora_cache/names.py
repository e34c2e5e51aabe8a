"""The names by which the control plane finds its actors on a Ray cluster: the controller, and each TP
rank's worker (a ``lora-cache serve`` worker actor or an attached rank's endpoint). Plain Python, so an
engine process attached through the gateway can name its rank without importing Ray."""

from __future__ import annotations

from lora_cache.control import WorkerId

NAMESPACE = "lora-cache"
CONTROLLER_NAME = "lora-cache-controller"
WORKER_PREFIX = "lora-cache-worker:"


def worker_name(worker: WorkerId) -> str:
    return f"{WORKER_PREFIX}{worker.replica}:{worker.rank}"


def parse_worker_name(name: str) -> WorkerId:
    replica, rank = name[len(WORKER_PREFIX):].rsplit(":", 1)
    return WorkerId(replica, int(rank))
