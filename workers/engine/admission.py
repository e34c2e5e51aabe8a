"""Admission rules: may a waiting request whose bounds fit be prefilled now? A registry, open to users.

``ondemand``: always (the step blocks on loading a cold adapter: engines' default).
``overlap``: only once its adapter is READY on every rank; loads for waiting requests start at once on
the copy stream and run beside the steps of requests whose adapters are ready (SGLang's overlap loading).
``pipelined``: as ``overlap``, and a request whose adapter is ``LOADING`` (on every rank READY, or its read
done and its copy into a slot issued: READY within a copy's time) is admitted as if it were READY, into any
batch: the step does not wait for whole adapters; the LoRA op of layer l waits (on the GPU) only for the chunk
of the load that holds layer l (``workers.pipeline``), and a copy already issued lands long before the step's
last layer (a copy of an 8B adapter's shard takes 1-7 ms, a step's compute 8-40 ms), so the batch never waits
on it. A request whose load has not started or is still reading is held back as under ``overlap``: on a real
trace, admitting every request at once (the rule before 2026-11-26) let one cold adapter hold the whole batch
at its missing layer (p99 1.27x overlap's, issue 31). Admitting LOADING requests only in rounds that would run
nothing else (the rule until issue 31's fourth round) gained at most a copy's time, and lost on 8 of 12 named
runs: the loss was not the early step but the phase of arrivals against step boundaries, which any change of
timing reshuffles (``bench/RESULTS.md``); joining the batch that is about to run gains a whole step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import IntEnum
from typing import ClassVar, TypeVar

from workers.engine.workload import Request


class Readiness(IntEnum):
    """An adapter's state on the replica: the minimum over its ranks."""

    FAILED = -1  # its load failed on some rank
    NOT_READY = 0  # not resident, or still loading, on some rank
    LOADING = 1  # on every rank READY or its copy into a slot issued (its read done): READY within a copy's time
    READY = 2  # READY (and held for the engine) on every rank


class AdmissionRule(ABC):
    """A rule's class attributes tell the engine what it needs; ``admits`` decides per request."""

    name: ClassVar[str]
    prefetch: ClassVar[bool] = False  # start loads for waiting requests' adapters and report readiness
    pipelined: ClassVar[bool] = False  # steps wait per layer on load chunks, not on whole adapters
    idle: ClassVar[bool] = False  # a round that would run nothing asks ``admits_idle`` of held-back requests
    loading: ClassVar[bool] = False  # the replica reports LOADING (not only READY) to ``admits``

    @abstractmethod
    def admits(self, request: Request, ready: Readiness) -> bool:
        """Whether ``request`` may join the next prefill batch (bounds are checked elsewhere)."""

    def admits_idle(self, request: Request, ready: Readiness) -> bool:
        """Whether a request ``admits`` held back may run in a round that would otherwise run nothing."""
        return False


ADMISSION: dict[str, type[AdmissionRule]] = {}
R = TypeVar("R", bound=type[AdmissionRule])


def register_admission(cls: R) -> R:
    """Class decorator: make a rule selectable as ``--admission NAME``."""
    if cls.name in ADMISSION and ADMISSION[cls.name] is not cls:
        raise ValueError(f"admission rule {cls.name!r} is already registered by {ADMISSION[cls.name].__qualname__}")
    ADMISSION[cls.name] = cls
    return cls


@register_admission
class OnDemand(AdmissionRule):
    name = "ondemand"

    def admits(self, request: Request, ready: Readiness) -> bool:
        return True


@register_admission
class Overlap(AdmissionRule):
    name = "overlap"
    prefetch = True

    def admits(self, request: Request, ready: Readiness) -> bool:
        return request.adapter is None or ready is Readiness.READY


@register_admission
class Pipelined(AdmissionRule):
    name = "pipelined"
    prefetch = True  # readiness is still reported (READY means every chunk) and running adapters pinned
    pipelined = True
    loading = True

    def admits(self, request: Request, ready: Readiness) -> bool:
        # LOADING: its load will finish in time (only its copy is left); NOT_READY: not started or still reading
        return request.adapter is None or ready is Readiness.READY or ready is Readiness.LOADING
