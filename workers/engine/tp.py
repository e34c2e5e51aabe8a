"""Tensor-parallel plumbing: one process per rank, the activations' all-reduce and rank 0's control channel.

Activations go over the default group (NCCL on GPUs, gloo on the CPU); the small control messages
(readiness, the step plan, final stats) over a gloo group, so they never wait behind GPU work.
The group meets through a file store in a fresh temporary directory: no ports to pick or collide.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T = TypeVar("T")


class Comm:
    """A single rank's view of its TP group; with ``world == 1`` every call is local."""

    def __init__(self, rank: int = 0, world: int = 1, control: Any = None) -> None:
        self.rank, self.world, self.control = rank, world, control

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum a row-parallel projection's partial outputs across the ranks, in place."""
        if self.world > 1:
            dist.all_reduce(t)

    def min_control(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise minimum over ranks of a small CPU tensor (readiness: READY only if every rank is)."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return t

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's ``obj`` on every rank (the step plan)."""
        if self.world == 1:
            assert obj is not None
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[return-value]

    def gather(self, obj: T) -> list[T]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.control)


def spawn(fn: Callable[[Comm], T], world: int, device_kind: str) -> T:
    """Run ``fn(comm)`` on ``world`` new processes (rank k on cuda:k for GPUs); rank 0's result comes back.

    ``fn`` must be picklable (a module-level function or a functools.partial of one).
    """
    with tempfile.TemporaryDirectory(prefix="lora-engine-") as tmp:
        mp.spawn(_rank_main, args=(fn, world, device_kind, tmp), nprocs=world, join=True)
        return pickle.loads((Path(tmp) / "result.pkl").read_bytes())  # type: ignore[no-any-return]


def _rank_main(rank: int, fn: Callable[[Comm], Any], world: int, device_kind: str, tmp: str) -> None:
    faulthandler.enable(all_threads=True)  # a crash prints every thread's Python stack (the child's stderr)
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        result = fn(Comm(rank, world, control))
        if rank == 0:
            (Path(tmp) / "result.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """End a rank whose work is done (its result written, its groups destroyed) without interpreter finalization.

    A gloo group's C++ worker threads may still drop the last reference to a tensor while the interpreter
    finalizes; taking the GIL then ends the thread by a forced unwind, and the process aborts ("terminate called
    without an active exception", SIGABRT; pytorch/pytorch#190489). A CI run lost a passing TP-2 test that way
    (rank 1 of test_feed's late-registration run, 2026-11-29). So the groups are collected here, while the
    interpreter is whole, and the process then exits at once. A rank that raised does not come here: spawn reports
    its traceback, as before.
    """
    gc.collect()  # process groups held only by cycles (the engine's) are destroyed now, their threads joined
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
