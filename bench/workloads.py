"""The benchmark's workloads: arrivals, adapter popularity and lengths, shared by ``--engine real`` and ``sim``.

A ``WorkloadSpec`` (one frozen config; ``lora_cache.runtime.cliargs`` makes its options) says how requests
arrive and which adapter each uses; ``make_workload(spec, adapter_names)`` draws the requests, the same
ones for a seed whatever the engine. Each aspect (arrival times, adapter choice, lengths) has its own
random stream, so two specs that differ in popularity only get the same arrival times and lengths.

=====================  =============================================================================
arrivals               ``poisson:RATE`` (open loop, requests/s, the first at t=0), ``inflight:N`` (closed
                       loop: N requests in flight, a new one arrives when one finishes) or ``trace``
                       (the times of a ``trace:FILE`` popularity)
popularity             ``uniform``; ``zipf:ALPHA`` (adapter i, 0-based, has weight 1/(i+1)**ALPHA);
                       ``zipf:ALPHA,PHASES`` (popularity that shifts: requests split evenly into PHASES
                       phases, the first ranked as ``zipf:ALPHA``, each later one by a fresh random
                       ranking of the adapters, so yesterday's cold adapter can be today's hot one);
                       ``distinct`` (every request a different adapter); ``bursty:N1,N2,...`` (phases of
                       disjoint adapter sets, requests split evenly across the phases in order, uniform
                       within a phase); ``trace:FILE`` (JSONL replay: adapters and lengths, and times
                       with ``arrivals=trace``)
lengths                SGLang ``bench_serving``'s random dataset: uniform integers in
                       [max(1, int(len * random_range_ratio)), len]
=====================  =============================================================================

A trace file holds one JSON object per line: ``{"time": 0.25, "adapter": "adapter-007", "input_len":
512, "output_len": 64}`` (time in seconds, non-decreasing; adapter null for the base model).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from lora_cache.errors import ConfigError
from workers.engine.workload import Request

ARRIVALS = "poisson:RATE | inflight:N | trace"
POPULARITY = "uniform | zipf:ALPHA[,PHASES] | distinct | bursty:N1,N2,... | trace:FILE"
DEFAULT_ZIPF_ALPHA = 1.5
DEFAULT_PHASES = (10, 20, 20)
TRACE_FIELDS = ("time", "adapter", "input_len", "output_len")


class Arrivals(NamedTuple):
    kind: str  # "poisson", "inflight" or "trace"
    rate: float = 0.0  # poisson: requests/s
    inflight: int = 0  # inflight: requests kept in flight


class Popularity(NamedTuple):
    kind: str  # "uniform", "zipf", "distinct", "bursty" or "trace"
    alpha: float = 0.0  # zipf
    rankings: int = 1  # zipf: phases, each with its own ranking of the adapters (the first: names in order)
    phases: tuple[int, ...] = ()  # bursty: adapters per phase
    path: str = ""  # trace


class TraceLine(NamedTuple):
    time: float
    adapter: str | None
    input_len: int
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    """A request stream: how requests arrive, which adapter each uses, and their lengths."""

    arrivals: str = field(default="poisson:8", metadata={"help": f"arrivals: {ARRIVALS}"})
    popularity: str = field(default="zipf:1.5", metadata={"help": f"adapter choice: {POPULARITY}"})
    requests: int = field(default=1000, metadata={
        "help": "number of requests (a trace replays its first N lines; 0: all of them)"})
    random_input_len: int = field(default=1024, metadata={"help": "prompt tokens, at most (bench_serving)"})
    random_output_len: int = field(default=128, metadata={"help": "output tokens, at most (bench_serving)"})
    random_range_ratio: float = field(default=0.0, metadata={
        "help": "lengths are uniform in [len * ratio, len] (bench_serving's random dataset)"})
    num_adapters: int = field(default=0, metadata={
        "help": "adapters registered (0: adapters_per_slot x slots, or what the popularity needs if more)"})
    adapters_per_slot: float = field(default=4.0, metadata={
        "help": "adapters per GPU slot when num_adapters is 0 (always > 1: more adapters than slots)"})
    workload_seed: int = field(default=0, metadata={"help": "seed of arrival times, adapter choice and lengths"})

    def __post_init__(self) -> None:
        arrivals, popularity = self.parsed_arrivals(), self.parsed_popularity()
        if arrivals.kind == "trace" and popularity.kind != "trace":
            raise ConfigError(f"arrivals is 'trace' but popularity is {self.popularity!r}: the times come from a "
                              "trace file; pass --popularity trace:FILE or --arrivals poisson:RATE")
        if self.requests < 0 or (self.requests == 0 and popularity.kind != "trace"):
            raise ConfigError(f"requests is {self.requests}; give a count >= 1 (0, all lines, only for a trace)")
        for name in ("random_input_len", "random_output_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} is {getattr(self, name)}; give a number of tokens >= 1")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise ConfigError(f"random_range_ratio is {self.random_range_ratio}; give a ratio in [0, 1] "
                              "(1: every length exactly len)")
        if self.num_adapters < 0:
            raise ConfigError(f"num_adapters is {self.num_adapters}; give a count >= 1, or 0 for "
                              "adapters_per_slot x slots")
        if not (math.isfinite(self.adapters_per_slot) and self.adapters_per_slot > 1.0):
            raise ConfigError(f"adapters_per_slot is {self.adapters_per_slot}; give a ratio > 1 (the benchmark "
                              "always has more adapters than GPU slots), e.g. 4")
        if popularity.kind == "distinct" and self.num_adapters and self.num_adapters < self.requests:
            raise ConfigError(f"popularity 'distinct' needs an adapter per request: num_adapters "
                              f"({self.num_adapters}) < requests ({self.requests}); raise num_adapters or pass 0")
        if popularity.kind == "bursty" and self.num_adapters and self.num_adapters < sum(popularity.phases):
            raise ConfigError(f"popularity {self.popularity!r} uses {sum(popularity.phases)} adapters but "
                              f"num_adapters is {self.num_adapters}; raise num_adapters or pass 0")

    def parsed_arrivals(self) -> Arrivals:
        return parse_arrivals(self.arrivals)

    def parsed_popularity(self) -> Popularity:
        return parse_popularity(self.popularity)

    def adapter_names(self, slots: int) -> list[str]:
        """The adapters to register for a fleet of ``slots`` GPU slots per rank: more than ``slots``.

        ``adapter-000`` ... (zero-padded to one width, so name order is index order), as many as
        ``num_adapters`` or ``adapters_per_slot x slots``, raised to what ``distinct`` or ``bursty``
        needs; a trace's own adapter names (sorted) otherwise.
        """
        popularity = self.parsed_popularity()
        if popularity.kind == "trace":
            names = sorted({line.adapter for line in self.trace_lines if line.adapter is not None})
        else:
            count = self.num_adapters or max(math.ceil(self.adapters_per_slot * slots), self._needed(popularity))
            width = max(3, len(str(count - 1)))
            names = [f"adapter-{i:0{width}d}" for i in range(count)]
        if len(names) <= slots:
            raise ConfigError(f"the workload has {len(names)} adapters for {slots} GPU slots per rank; the "
                              "benchmark needs more adapters than slots: raise num_adapters or lower the slots")
        return names

    def _needed(self, popularity: Popularity) -> int:
        if popularity.kind == "distinct":
            return self.requests
        return sum(popularity.phases)

    @functools.cached_property
    def trace_lines(self) -> tuple[TraceLine, ...]:
        """The replayed lines of a ``trace:FILE`` popularity (the first ``requests``, or all), read once."""
        lines = read_trace(self.parsed_popularity().path)
        if self.requests > len(lines):
            raise ConfigError(f"requests is {self.requests} but trace {self.parsed_popularity().path} has "
                              f"{len(lines)} lines; pass --requests {len(lines)} or fewer (0: all)")
        return tuple(lines[: self.requests or len(lines)])


@dataclass(frozen=True)
class Workload:
    """The drawn requests (by rid) and how they are released: open loop, or ``inflight`` at a time."""

    spec: WorkloadSpec
    adapters: list[str]  # every registered adapter, in popularity-rank order (Zipf rank i is adapters[i])
    requests: list[Request]
    inflight: int  # 0: open loop (arrival_s); N > 0: closed loop, arrival_s are 0 and the driver releases them
    warmup: int = 0  # the first ``warmup`` requests (rids) are the warm-up, played before the measured window
    # rid -> seconds from its arrival to its submission reaching the engine (the simulator's open loop; empty: at
    # arrival). ``bench.sim.check`` replays a real run's (its router's ``submitted_s``): TTFT still counts from arrival
    submit_lag_s: Mapping[int, float] = field(default_factory=dict)

    def describe(self) -> dict[str, object]:
        """The spec and what was drawn, for the results JSON."""
        measured = self.requests[self.warmup:]
        used = Counter(r.adapter for r in measured)
        top = used.most_common(1)[0][1] if used else 0
        first = measured[0].arrival_s if measured and self.warmup else 0.0
        last = max((r.arrival_s - first for r in measured), default=0.0)
        return {
            "arrivals": self.spec.arrivals, "popularity": self.spec.popularity, "requests": len(measured),
            "warmup_requests": self.warmup, "warmup_s": first,
            "adapters": len(self.adapters),
            "inflight": self.inflight, "seed": self.spec.workload_seed,
            "adapters_used": len(used), "top_adapter_share": top / max(1, len(measured)),
            "last_arrival_s": last, "offered_rate": (len(measured) - 1) / last if last > 0 else None,
            "mean_input_len": sum(r.input_len for r in measured) / max(1, len(measured)),
            "mean_output_len": sum(r.output_len for r in measured) / max(1, len(measured)),
            "random_input_len": self.spec.random_input_len, "random_output_len": self.spec.random_output_len,
            "random_range_ratio": self.spec.random_range_ratio,
        }


def make_workload(spec: WorkloadSpec, adapter_names: Sequence[str]) -> Workload:
    """``spec``'s requests over ``adapter_names`` (in that order: Zipf rank i is ``adapter_names[i]``)."""
    if not adapter_names:
        raise ConfigError("a workload needs adapters; pass spec.adapter_names(slots) or registered names")
    if len(set(adapter_names)) != len(adapter_names):
        raise ConfigError("adapter_names lists a name twice; give each adapter once")
    arrivals, popularity = spec.parsed_arrivals(), spec.parsed_popularity()
    rng = functools.partial(_stream, spec.workload_seed)
    lines = spec.trace_lines if popularity.kind == "trace" else ()
    if lines:
        _check_trace_adapters(lines, adapter_names, popularity.path)
        adapters = [line.adapter for line in lines]
        inputs, outputs = [line.input_len for line in lines], [line.output_len for line in lines]
    else:
        n = spec.requests
        adapters = list(_choose(popularity, n, adapter_names, rng("adapters")))
        inputs = _lengths(rng("input"), n, spec.random_input_len, spec.random_range_ratio)
        outputs = _lengths(rng("output"), n, spec.random_output_len, spec.random_range_ratio)
    n = len(adapters)
    if arrivals.kind == "poisson":
        times = _poisson(rng("arrivals"), n, arrivals.rate)
    elif arrivals.kind == "trace":
        times = [line.time for line in lines]
    else:
        times = [0.0] * n
    requests = [Request(i, a, x, y, t) for i, (a, x, y, t) in enumerate(zip(adapters, inputs, outputs, times))]
    return Workload(spec, list(adapter_names), requests, arrivals.inflight)


# -- parsing -------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def parse_arrivals(text: str) -> Arrivals:
    kind, _, arg = text.strip().partition(":")
    if kind == "poisson":
        rate = _number(arg, f"arrivals {text!r}", "a rate in requests/s, e.g. poisson:8")
        if not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"arrivals {text!r}: the rate must be > 0 requests/s, e.g. poisson:8")
        return Arrivals("poisson", rate=rate)
    if kind == "inflight":
        count = _integer(arg, f"arrivals {text!r}", "a number of requests in flight, e.g. inflight:32")
        if count < 1:
            raise ConfigError(f"arrivals {text!r}: keep at least 1 request in flight, e.g. inflight:32")
        return Arrivals("inflight", inflight=count)
    if kind == "trace" and not arg:
        return Arrivals("trace")
    raise ConfigError(f"arrivals {text!r} is not one of {ARRIVALS}")


@functools.lru_cache(maxsize=64)
def parse_popularity(text: str) -> Popularity:
    kind, colon, arg = text.strip().partition(":")
    if kind in ("uniform", "distinct") and not colon:
        return Popularity(kind)
    if kind == "zipf":
        exponent, comma, count = arg.partition(",")
        alpha = _number(exponent, f"popularity {text!r}", "an exponent, e.g. zipf:1.5") if colon else DEFAULT_ZIPF_ALPHA
        if not (math.isfinite(alpha) and alpha > 0):
            raise ConfigError(f"popularity {text!r}: the Zipf exponent must be > 0, e.g. zipf:1.5")
        rankings = _integer(count, f"popularity {text!r}", "a number of phases, e.g. zipf:1.5,4") if comma else 1
        if rankings < 1:
            raise ConfigError(f"popularity {text!r}: give at least 1 phase, e.g. zipf:1.5,4 (4 rankings in turn)")
        return Popularity("zipf", alpha=alpha, rankings=rankings)
    if kind == "bursty":
        if not colon:
            return Popularity("bursty", phases=DEFAULT_PHASES)
        fix = "adapters per phase, e.g. bursty:10,20,20"
        phases = tuple(_integer(p, f"popularity {text!r}", fix) for p in arg.split(","))
        if len(phases) < 2 or min(phases) < 1:
            raise ConfigError(f"popularity {text!r}: give at least two phases of >= 1 adapter each, e.g. "
                              "bursty:10,20,20")
        return Popularity("bursty", phases=phases)
    if kind == "trace" and arg.strip():
        return Popularity("trace", path=arg.strip())
    raise ConfigError(f"popularity {text!r} is not one of {POPULARITY}")


def read_trace(path: str) -> list[TraceLine]:
    """Every line of a JSONL trace, validated: a clear error names the line, the field and the fix."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"trace {path}: cannot be read ({e.strerror or e}); pass --popularity trace:FILE with "
                          "a JSONL file, one request per line") from e
    lines: list[TraceLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            lines.append(_trace_line(raw, f"trace {path} line {number}", lines[-1].time if lines else 0.0))
    if not lines:
        raise ConfigError(f"trace {path} holds no requests; write one JSON object per line with {TRACE_FIELDS}")
    return lines


def _trace_line(raw: str, where: str, previous: float) -> TraceLine:
    example = '{"time": 0.25, "adapter": "adapter-007", "input_len": 512, "output_len": 64}'
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg}); write one object per line, e.g. {example}") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}; e.g. {example}")
    missing = [f for f in TRACE_FIELDS if f not in obj]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}; every line needs {', '.join(TRACE_FIELDS)}, "
                          f"e.g. {example}")
    time, adapter = obj["time"], obj["adapter"]
    if isinstance(time, bool) or not isinstance(time, int | float) or not math.isfinite(time) or time < 0:
        raise ConfigError(f"{where}: time is {time!r}; give seconds from the start as a number >= 0")
    if time < previous:
        raise ConfigError(f"{where}: time {time} is earlier than the line before ({previous}); sort the trace by time")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise ConfigError(f"{where}: adapter is {adapter!r}; give the adapter's name, or null for the base model")
    for name in ("input_len", "output_len"):
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {name} is {value!r}; give a whole number of tokens >= 1")
    return TraceLine(float(time), adapter, obj["input_len"], obj["output_len"])


def _check_trace_adapters(lines: Sequence[TraceLine], names: Sequence[str], path: str) -> None:
    known = set(names)
    for number, line in enumerate(lines, start=1):
        if line.adapter is not None and line.adapter not in known:
            raise ConfigError(f"trace {path} request {number}: adapter {line.adapter!r} is not registered; register "
                              "the trace's adapters (spec.adapter_names(slots) lists them)")


def _number(text: str, what: str, fix: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a number; give {fix}") from None


def _integer(text: str, what: str, fix: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a whole number; give {fix}") from None


# -- drawing -------------------------------------------------------------------------------------------
def _stream(seed: int, aspect: str) -> random.Random:
    """One random stream per aspect of the workload (str seeds hash the same in every process)."""
    return random.Random(f"{seed}/{aspect}")


def _choose(popularity: Popularity, n: int, names: Sequence[str], rng: random.Random) -> list[str]:
    if popularity.kind == "uniform":
        return [names[rng.randrange(len(names))] for _ in range(n)]
    if popularity.kind == "zipf":
        cum = list(itertools.accumulate(1.0 / (i + 1) ** popularity.alpha for i in range(len(names))))
        if popularity.rankings == 1:
            return rng.choices(names, cum_weights=cum, k=n)
        out: list[str] = []
        ranking = list(names)
        for phase in range(popularity.rankings):  # request i is in phase i * rankings // n
            size = (phase + 1) * n // popularity.rankings - phase * n // popularity.rankings
            if phase:
                rng.shuffle(ranking)
            out += rng.choices(ranking, cum_weights=cum, k=size)
        return out
    if popularity.kind == "distinct":
        if n > len(names):
            raise ConfigError(f"popularity 'distinct' needs an adapter per request: {len(names)} adapters for {n} "
                              "requests; register more adapters or send fewer requests")
        return rng.sample(list(names), n)
    return _bursty(popularity.phases, n, names, rng)


def _bursty(phases: tuple[int, ...], n: int, names: Sequence[str], rng: random.Random) -> list[str]:
    """Request i is in phase ``i * len(phases) // n``; phase j draws uniformly from its own adapters."""
    if sum(phases) > len(names):
        raise ConfigError(f"bursty phases {phases} use {sum(phases)} adapters but {len(names)} are registered; "
                          "register more adapters or use smaller phases")
    starts = [0, *itertools.accumulate(phases)]
    out = []
    for i in range(n):
        phase = i * len(phases) // n
        out.append(names[starts[phase] + rng.randrange(phases[phase])])
    return out


def _lengths(rng: random.Random, n: int, top: int, ratio: float) -> list[int]:
    low = max(1, int(top * ratio))
    return [rng.randint(low, top) for _ in range(n)]


def _poisson(rng: random.Random, n: int, rate: float) -> list[float]:
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times
