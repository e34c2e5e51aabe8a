"""``--engine real --attach``: every engine rank in a process of its own, attached through the engine seam.

The service runs the controller alone (``serve --replicas 0``); the benchmark starts one process per
rank (``workers.engine.process.EngineProcess``), as an engine's launcher would, each joining the Ray
cluster and attaching as rank k of its replica (``workers/attach/attachment.py``). On GPUs, process i of the fleet
(replica r, rank k: i = r * tp + k) runs on ``cuda:i``. The calls mirror ``bench.real.ActorFleet``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future
from typing import Any

import ray

from lora_cache.vocab import ReadinessRecord
from workers.attach.attachment import AttachConfig
from workers.cache import WorkerConfig
from workers.engine.config import EngineConfig
from workers.engine.hosted import Rendezvous, rendezvous
from workers.engine.process import EngineProcess, start_ranks
from workers.engine.workload import Request


def attach_config(replica: str, address: str, engine: EngineConfig | None, rank: int) -> AttachConfig:
    """Rank ``rank`` of ``replica`` (every rank alike), declaring ``engine``'s admission limits in its hello as an
    engine's own launcher would (``AttachConfig.max_adapters``/``max_running``; routing advice's lanes)."""
    if engine is None:
        return AttachConfig(replica=replica, address=address)
    return AttachConfig(replica=replica, address=address, max_adapters=engine.max_adapters,
                        max_running=engine.max_running)


class ProcessFleet:
    """The replicas' engine ranks, each in its own attached process; ``stop`` detaches them all."""

    def __init__(self, ranks: dict[str, list[EngineProcess]]) -> None:
        self.ranks = ranks
        self.keys = [(replica, rank) for replica, procs in ranks.items() for rank in range(len(procs))]
        self.procs = [p for procs in ranks.values() for p in procs]

    @classmethod
    def start(cls, replicas: list[str], worker: WorkerConfig, tp: int, gpus: bool,
              engine: EngineConfig | None = None) -> ProcessFleet:
        """Start and attach every rank of every replica (``tp`` ranks each, ``worker`` their cache), all at once;
        ``engine``: the engine they will build, whose admission limits each rank declares in its hello."""
        gcs = ray.get_runtime_context().gcs_address
        ranks: dict[str, list[EngineProcess]] = {}
        try:
            for r, replica in enumerate(replicas):
                configs = [dataclasses.replace(worker, tp=tp, tp_rank=k, device=f"cuda:{r * tp + k}" if gpus else "cpu")
                           for k in range(tp)]
                ranks[replica] = start_ranks(functools.partial(attach_config, replica, gcs, engine), configs)
        except BaseException:
            cls(ranks).stop()
            raise
        return cls(ranks)

    def preload(self, names: list[str], timeout_s: float) -> None:
        for f in [p.submit("preload", names, timeout_s) for p in self.procs]:
            f.result(timeout=timeout_s)

    def build(self, engine: EngineConfig, timeout_s: float) -> None:
        meets = {replica: Rendezvous(*rendezvous(len(procs))[:2], len(procs)) for replica, procs in self.ranks.items()}
        calls = [p.submit("build", engine, meets[replica]) for replica, procs in self.ranks.items() for p in procs]
        for f in calls:
            f.result(timeout=timeout_s)

    def run(self, routed: list[list[Request]], start_wall: float, inflight: int, report: bool,
            streaming: bool = False) -> list[Future[Any]]:
        """Every rank's run, the replicas' rank 0 first (they report the queue, if ``report``; and take
        ``submit``ted requests until ``end_streams``, if ``streaming``)."""
        groups = list(self.ranks.values())
        runs = [procs[0].submit("run", reqs, start_wall, inflight, report, streaming)
                for procs, reqs in zip(groups, routed)]
        runs += [p.submit("run", reqs, start_wall, inflight) for procs, reqs in zip(groups, routed) for p in procs[1:]]
        return runs

    def submit(self, replica: str, requests: list[Request]) -> None:
        self.ranks[replica][0].submit_requests(requests)

    def end_streams(self) -> None:
        for procs in self.ranks.values():
            procs[0].end_stream()

    def finished(self, replica: str, timeout_s: float) -> list[int] | None:
        return self.ranks[replica][0].finished(timeout_s)

    def stats(self) -> dict[tuple[str, int], dict[str, Any]]:
        return dict(zip(self.keys, [f.result(timeout=60) for f in [p.submit("stats") for p in self.procs]]))

    def load_logs(self) -> dict[tuple[str, int], list[tuple[float, ReadinessRecord]]]:
        return dict(zip(self.keys, [f.result(timeout=60) for f in [p.submit("load_log") for p in self.procs]]))

    def stop(self) -> None:
        for proc in self.procs:
            proc.close()
