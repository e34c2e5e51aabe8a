"""Load times and request leads as the controller measures them (lifecycle step 1, beside the ranking). Plain Python.

The ranking (``lora_cache.routing.ranking``, ``RouterConfig.idle_ready``) asks, per replica, how long from now the
request's adapter takes to be READY there (``ReplicaLoad.ready_s``) and how long before its arrival the request is
routed (the lead): an idle replica where the adapter is READY by the request's arrival starts it on arrival, sooner
than any busy one. Neither figure is a constant of this module; both are measured:

- a load's time is what the controller saw: from its ``Prefetch`` to the rank's READY report (the command's and the
  report's latency included), per shard size. ``LoadClock.sent`` / ``LoadClock.ready`` feed an exponentially
  decayed least-squares fit ``seconds = fixed + per_byte x bytes`` per kind: from the host tier (the adapter was
  staged there: one copy) or from storage (a read and a copy). Shard bytes are the adapter's bytes per rank at TP
  1 (``AdapterInfo.bytes_per_rank``) over the replica's TP. Until a kind has a sample, ``RouterConfig``'s
  ``cold_s`` / ``staged_s`` stand in (conservative: 0.1 s and 0.01 s). A prefetch sent while another to the same
  worker awaits its READY report gives no sample: its time is the worker's queue of loads, not a load (issue 31: the
  catalog's first placement, 8 loads a worker at once, read as 0.5 s loads on a fleet whose loads take 8 ms from
  storage, so ``idle_ready`` never found a cold adapter ready by a 50 ms lead; bench/RESULTS.md). The ranking reads
  the fit plus one standard deviation of the samples about it (``spread``): a prefetch the controller counts as
  from storage may be a host-tier hit (the host tier keeps what it read; the planner knows only the stages it
  sent), so the mean mixes fast and slow loads, and a load the ranking expects to finish by the arrival should
  most likely do so
  (issue 31: with the mean, a heavy-load fleet lost residency to idle moments, p99 1542 -> 1839 ms);
- the lead is a decayed mean of the leads the hints carry (``expected in`` seconds, ``ControllerCore.hint_batches``),
  0 until a hint comes: without hints only a replica where the adapter is READY now counts as ready by arrival.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from lora_cache.errors import ConfigError

DECAY = 0.97  # weight of the past per new sample (about the last 30 loads or hints count)
KEEP = 65536  # prefetches awaiting their READY report, at most (the oldest forgotten first)


WARM_MIN_SAMPLES = 2.0  # the (decayed) weight of loads from storage timed before judging what a miss costs

class _Fit:
    """Decayed least squares of y on x; ``predict`` falls back to the mean ratio while the sizes barely vary."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n = DECAY * self.n + 1.0
        self.sx = DECAY * self.sx + x
        self.sy = DECAY * self.sy + y
        self.sxx = DECAY * self.sxx + x * x
        self.sxy = DECAY * self.sxy + x * y
        self.syy = DECAY * self.syy + y * y

    def predict(self, x: float, spread: bool = False) -> float | None:
        """The fit at ``x``; ``spread``: plus one standard deviation of the samples about the fit."""
        if self.n <= 0:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        vy = max(0.0, self.syy / self.n - my * my)
        if var > (0.05 * mx) ** 2:  # at least two sizes: fixed cost plus per byte
            slope = max(0.0, (self.sxy / self.n - mx * my) / var)
            resid = max(0.0, vy - slope * (self.sxy / self.n - mx * my))
            return max(0.0, my + slope * (x - mx)) + (math.sqrt(resid) if spread else 0.0)
        scale = x / mx if mx > 0 else 1.0
        return scale * (my + (math.sqrt(vy) if spread else 0.0))


class Sent(NamedTuple):
    nbytes: float
    staged: bool
    at: float
    queued: bool = False  # another prefetch to its worker was awaiting READY when it was sent: no sample


class LoadClock:
    """Measured load times (per kind and size) and request leads (module docstring)."""

    def __init__(self, cold_s: float = 0.1, staged_s: float = 0.01) -> None:
        for name, value in (("cold_s", cold_s), ("staged_s", staged_s)):
            if not 0 <= value < math.inf:
                raise ConfigError(f"{name} is {value}; give a finite number of seconds >= 0")
        self.prior = {False: cold_s, True: staged_s}
        self._fits = {False: _Fit(), True: _Fit()}
        self._reads = _Fit()  # the workers' own store reads (seconds per shard size): the warming gate
        self._sent: dict[tuple[str, str, str], Sent] = {}
        self._pending: dict[str, int] = {}  # worker -> its prefetches in _sent
        self._lead_n = self._lead_sum = 0.0

    # -- inputs ---------------------------------------------------------------------------------------
    def sent(self, worker: str, adapter: str, version: str, nbytes: float, staged: bool, now: float) -> None:
        """The controller sent ``worker`` a prefetch of ``adapter@version`` (a shard of ``nbytes``; ``staged``: in
        its host tier) at ``now``; a resend keeps the first time."""
        key = (worker, adapter, version)
        if key not in self._sent:
            if len(self._sent) >= KEEP:
                self._pop(next(iter(self._sent)))
            self._sent[key] = Sent(nbytes, staged, now, self._pending.get(worker, 0) > 0)
            self._pending[worker] = self._pending.get(worker, 0) + 1

    def ready(self, worker: str, adapter: str, version: str, now: float) -> None:
        """``worker`` reported ``adapter@version`` READY at ``now``: a sample if the controller sent its prefetch."""
        s = self._pop((worker, adapter, version))
        if s is not None and not s.queued and now >= s.at:
            self._fits[s.staged].add(s.nbytes, now - s.at)

    def read(self, nbytes: float, seconds: float) -> None:
        """A worker's load read its shard of ``nbytes`` from storage in ``seconds`` (its own measure, no waits for a
        slot or a report): what a miss costs beyond a host hit."""
        if nbytes > 0 and 0 < seconds < math.inf:
            self._reads.add(nbytes, seconds)

    def dropped(self, worker: str, adapter: str, version: str) -> None:
        """The load failed or the residency is gone: no sample."""
        self._pop((worker, adapter, version))

    def forget(self, worker: str) -> None:
        for key in [k for k in self._sent if k[0] == worker]:
            self._pop(key)

    def _pop(self, key: tuple[str, str, str]) -> Sent | None:
        s = self._sent.pop(key, None)
        if s is not None:
            left = self._pending[key[0]] - 1
            if left:
                self._pending[key[0]] = left
            else:
                del self._pending[key[0]]
        return s

    def lead(self, seconds: float) -> None:
        """A hint said its request comes in ``seconds``."""
        if math.isfinite(seconds):
            self._lead_n = DECAY * self._lead_n + 1.0
            self._lead_sum = DECAY * self._lead_sum + max(0.0, seconds)

    # -- estimates --------------------------------------------------------------------------------------
    @property
    def lead_s(self) -> float:
        """The requests' lead over their routing, as the hints tell it (0 before any hint)."""
        return self._lead_sum / self._lead_n if self._lead_n else 0.0

    def load_s(self, nbytes: float, staged: bool, spread: bool = False) -> float:
        """Expected seconds from a prefetch of a shard of ``nbytes`` to its READY report: from the host tier
        (``staged``) or from storage; ``spread``: plus one standard deviation of the measured times about the fit
        (a load that most likely ends by then)."""
        got = self._fits[staged].predict(nbytes, spread)
        return self.prior[staged] if got is None else got

    def miss_hurts(self, nbytes: float, min_gain_s: float) -> bool:
        """Whether the workers' reads from storage of a shard of ``nbytes`` take ``min_gain_s`` at least, as they
        measured them (``read``; ``WARM_MIN_SAMPLES`` of decayed weight at least): the controller warms the host
        tiers only then (``PlannerConfig.warm_min_miss_s``); where it does not (a store the page cache holds),
        warm reads only add work beside the engine's steps. The reads' own times, not prefetch-to-READY: those
        include waits for a slot and the reports' latency, which a loaded fleet on a fast store has too."""
        if self._reads.n < WARM_MIN_SAMPLES or nbytes <= 0:
            return False
        got = self._reads.predict(nbytes)
        return got is not None and got >= min_gain_s

    def read_s(self, nbytes: float) -> float | None:
        """What a worker's store read of a shard of ``nbytes`` takes, as the workers timed their reads (``read``);
        None before ``WARM_MIN_SAMPLES`` of them (the warm set's weighing, ``planner/warming.py``)."""
        if self._reads.n < WARM_MIN_SAMPLES:
            return None
        return self._reads.predict(nbytes)

    def gate(self, nbytes: float, min_gain_s: float) -> dict[str, float]:
        """What ``miss_hurts`` reads, for status: a shard of ``nbytes`` loaded from storage and from the host tier
        (seconds), the weight of the storage loads timed, and the gain asked for."""
        return {"shard_bytes": nbytes, "read_s": self._reads.predict(nbytes) or 0.0, "read_samples": self._reads.n,
                "cold_s": self.load_s(nbytes, staged=False), "staged_s": self.load_s(nbytes, staged=True),
                "min_miss_s": min_gain_s}

    def samples(self, staged: bool) -> float:
        """The (decayed) weight of the samples behind ``load_s`` of that kind (0: the prior)."""
        return self._fits[staged].n
