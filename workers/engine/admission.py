"""Admission rules: may a waiting request whose bounds fit be prefilled now? A registry, open to users.

``ondemand``: always (the step blocks on loading a cold adapter: engines' default).
``overlap``: only once its adapter is READY on every rank; loads for waiting requests start at once on
the copy stream and run beside the steps of requests whose adapters are ready (SGLang's overlap loading).
``pipelined``: as ``overlap``, and a request whose adapter is ``LOADING`` (on every rank READY, or its read
done, its copy into a slot issued, and that copy due before a step's last layer: ``CopyClock``) is admitted as
if it were READY, into any batch: the step does not wait for whole adapters; the LoRA op of layer l waits (on
the GPU) only for the chunk of the load that holds layer l (``workers.gpu.chunk_waits``). Each rank times its own
copies and steps, and reports an issued copy LOADING only where the bytes of every copy in flight on its stream,
at the slowest copy rate it measured, land before the shortest step it measured reaches its last layer (issue
31 item 2: before, every issued copy was LOADING on the assumption that a copy of 1-7 ms lands within a step of
8-40 ms; with copies slower than steps, steps waited on chunks). A request whose load has not started, is still
reading, or whose copy would land late is held back as under ``overlap``: on a real
trace, admitting every request at once (the rule before 2026-11-26) let one cold adapter hold the whole batch
at its missing layer (p99 1.27x overlap's, issue 31). Admitting LOADING requests only in rounds that would run
nothing else (the rule until issue 31's fourth round) gained at most a copy's time, and lost on 8 of 12 named
runs: the loss was not the early step but the phase of arrivals against step boundaries, which any change of
timing reshuffles (``bench/RESULTS.md``); joining the batch that is about to run gains a whole step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from typing import ClassVar, TypeVar

from workers.attach.versions import Readiness
from workers.engine.workload import Request

K = TypeVar("K")
COPY_WINDOW = 32  # copies remembered by ``CopyClock``
STEP_WINDOW = 8  # steps remembered by ``CopyClock`` (the shortest of the last few: the batch as it runs now)


class CopyClock:
    """Whether an issued copy lands before the layer that needs it, from measured copies and steps (per rank).

    A pipelined step's layer l waits for the chunk of each load that holds layer l. Chunks are copied in layer
    order on the rank's one copy stream, so a copy that lands before a step's last layer starts has its chunks
    ahead of the layers that read them. When a copy lands is predicted from this rank's own measurements: a copy
    of n bytes takes ``fixed + n * per_byte`` (least squares over the last ``COPY_WINDOW`` copies, each timed
    from its start on the stream to READY, then moved up by the largest underestimate among them: no copy
    measured took longer than its prediction), and the copies issued and not landed run one after another on
    the stream in the order issued, the first no sooner than the last copy seen landing (each starts at its
    issue or when the one before it ends: a copy issued behind others waits for them). A step reaches its
    last layer ``(layers - 1) / layers`` of its compute after it starts, the shortest of the last
    ``STEP_WINDOW`` steps measured. A copy that follows a write-back of its slot (exclusive tiers) lands no
    sooner than the write-back stream has copied out what it held ahead of the copy's range when the copy took its
    slot, and then the copy itself (``in_time``). Until a copy and a step have been measured nothing
    is in time: the request waits for READY, as under ``overlap``. No rate is assumed: on a card whose copies run
    slower than its steps (a congested link, a large adapter beside a short decode step) LOADING requests wait
    instead of holding a batch at a layer.
    """

    def __init__(self, layers: int) -> None:
        if layers < 1:
            raise ValueError(f"CopyClock: layers is {layers}; pass the model's layer count (>= 1)")
        self.layers = layers
        self._copies: deque[tuple[int, float]] = deque(maxlen=COPY_WINDOW)  # (bytes, seconds) measured
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)  # seconds of each measured step's compute
        self._model: tuple[float, float] | None = None  # (fixed s, s per byte), refitted on each copy
        self._free = -float("inf")  # when the last copy seen landing landed (the stream was busy until then)

    def copied(self, nbytes: int, seconds: float, landed: float) -> None:
        """A copy of ``nbytes`` took ``seconds`` from its start on the stream to READY, seen READY at ``landed``
        (the clock ``in_time``'s ``now`` reads; later than the copy's end only makes the prediction later)."""
        self._free = max(self._free, landed)
        if nbytes <= 0 or seconds <= 0:
            return
        self._copies.append((nbytes, seconds))
        xs, ys = [float(n) for n, _ in self._copies], [t for _, t in self._copies]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        per_byte = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
        if per_byte <= 0:  # one size measured (or no slope): all of the time scales with the bytes
            self._model = (0.0, max(y / x for x, y in zip(xs, ys)))
            return
        fixed = max(0.0, my - per_byte * mx)
        fixed += max(0.0, *(y - (fixed + per_byte * x) for x, y in zip(xs, ys)))  # none measured above it
        self._model = (fixed, per_byte)

    def stepped(self, seconds: float) -> None:
        """A step computed for ``seconds`` (no load wait in it)."""
        if seconds > 0:
            self._steps.append(seconds)

    def budget_s(self) -> float | None:
        """How long the shortest recent step takes to reach its last layer (None before any step)."""
        return min(self._steps) * (self.layers - 1) / self.layers if self._steps else None

    def copy_s(self, nbytes: int) -> float | None:
        """The longest a copy of ``nbytes`` is predicted to take on the stream (None before any copy)."""
        return self._model[0] + self._model[1] * nbytes if self._model is not None else None

    def in_time(self, issued: Mapping[K, tuple[int, float] | tuple[int, float, int]], now: float) -> set[K]:
        """Of the copies issued and not landed (key -> (bytes, when issued[, bytes to be written back first])),
        those predicted to land within a step's time to its last layer from ``now``, the stream taking them in the
        order issued. A copy into a slot whose last shard is being written back (exclusive tiers) waits, chunk by
        chunk, for the pieces of the range it overwrites; the third value is what the write-back stream had still
        to copy out, when the copy took its slot, before the last of those pieces (``workers.gpu.loads.
        write_back_ahead``: earlier write-backs queued ahead included). The copy is taken to land no sooner than
        those bytes out from its issue, at the measured copy rate (PCIe's two directions alike), and then the whole
        copy in: later than it can, never sooner."""
        budget = self.budget_s()
        if not issued or budget is None or self._model is None:
            return set()
        fixed, per_byte = self._model
        out: set[K] = set()
        end = self._free
        for key, copy in sorted(issued.items(), key=lambda kv: kv[1][1]):
            nbytes, at = copy[0], copy[1]
            end = max(end, at) + fixed + per_byte * nbytes
            if len(copy) > 2 and copy[2] > 0:
                end = max(end, at + 2 * fixed + per_byte * (copy[2] + nbytes))
            if end - now <= budget:
                out.add(key)
        return out


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
        # LOADING: only its copy is left, due before the layer that needs it (``CopyClock``); NOT_READY: not
        # started, still reading, or a copy that would land late
        return request.adapter is None or ready is Readiness.READY or ready is Readiness.LOADING
