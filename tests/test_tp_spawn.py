"""The TP ranks' processes (workers/engine/tp.py): a rank that finished leaves without interpreter finalization, so
a crash there (a gloo worker thread dropping a tensor as the interpreter ends: SIGABRT) cannot fail a finished run;
a rank that raised still reports its own traceback."""

from __future__ import annotations

import atexit
import os

import pytest
import torch
from torch.multiprocessing.spawn import ProcessRaisedException

from workers.engine.tp import Comm, spawn


def _abort_at_exit(comm: Comm) -> tuple[int, list[float]]:
    """Runs a collective, then arms a crash for interpreter finalization (what a gloo thread's late tensor release
    does there, made certain)."""
    t = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(t)
    gathered = comm.gather(float(comm.rank))
    atexit.register(os.abort)
    return int(t.item()), gathered


def _raise_on_rank_1(comm: Comm) -> int:
    comm.barrier()
    if comm.rank == 1:
        raise ValueError("rank 1's own error, with its message")
    return comm.rank


def test_a_finished_rank_skips_finalization_and_its_result_comes_back() -> None:
    """(Before: the atexit crash, standing in for gloo's at finalization, failed the run with SIGABRT.)"""
    assert spawn(_abort_at_exit, 2, "cpu") == (3, [0.0, 1.0])


def test_a_rank_that_raised_reports_its_traceback() -> None:
    with pytest.raises(ProcessRaisedException, match="rank 1's own error, with its message"):
        spawn(_raise_on_rank_1, 2, "cpu")
