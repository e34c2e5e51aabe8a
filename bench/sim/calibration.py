"""What the simulator charges for each thing the fleet does, fitted from a real engine's logs.

A ``Calibration`` is a frozen dataclass read from JSON (``bench/calibration/*.json``; the README there
says how each file was measured). Costs are linear models, in milliseconds:

==========  ====================================================================================
prefill     ``prefill_base_ms + prefill_per_token_ms * prompt tokens + prefill_per_item_ms * prompts``
decode      ``decode_base_ms + decode_per_item_ms * batch + decode_per_adapter_ms * distinct adapters``
host->GPU   a copy holds the rank's copy stream for ``nbytes / h2d_gbps``; the shard is READY
            ``load_fixed_ms`` after the copy ends (launch, completion polling: off the stream)
round       ``round_ms`` of host work between two steps back to back (finishing the step's requests,
            scheduling, the queue report), plus ``readiness_ms`` for rules that prefetch (pin and
            report what is READY; at TP > 1 the ranks' minimum)
disk->host  a read holds one of the rank's reader threads for ``disk_fixed_ms + nbytes / disk_gbps``
control     ``report_latency_ms``: an engine's queue report, a router's hint or a worker's residency
            deltas reach the controller this long after they happen (the worker outbox gathers
            deltas over this window); ``command_latency_ms``: commands reach a worker this long after
            the controller planned them
==========  ====================================================================================

``fit_calibration(steps, loads)`` fits these models from the logs of a real run (the engine's
``workers.engine.rank.StepLog`` per step and ``workers.gpu.copies.ReadinessRecord`` per load); what the logs
cannot tell (slot dtype, control latencies, disk costs without a host-tier miss) comes from ``base``:

- Step compute: a step's ``ms`` runs from its start to its tokens, *including* ``load_wait_ms``
  blocked on adapter loads; the simulator charges load waits itself, so the compute time fitted is
  ``ms - load_wait_ms``. Steps that waited are left out when a kind has enough steps without a wait
  (``MIN_CLEAN_STEPS``): on a GPU the wait ends when the copy is issued and the compute then waits on
  the copy, so their remainder still holds the copy. Each kind is fitted by least squares on a fixed
  per-step cost plus its per-token / per-item / per-adapter terms, every coefficient >= 0 (a negative
  one is dropped and the rest refitted; a column with no spread is left to the fixed cost).
- Robust to stalls: a step that took more than ``OUTLIER_FACTOR`` times its fitted cost is not a cost
  of its shape but a stall (a JIT compile on a fresh machine: 1.4-2.0 s for a 35 ms prefill; a GC
  pause): it is dropped and the rest refitted until none is. What stays is fitted for its *mean*, not
  its median: queueing depends on the mean service time, and the engine's step times are noisy and
  skewed (an eager, launch-bound H200 decode step takes 18-45 ms at any batch of 1-16, 15-20 ms more
  while a disk read runs in the same process), so a median fit, or trimming by a robust deviation,
  would make the simulated engine faster than the real one on average.
- Rounds: the engine logs each step's ``gap_ms`` (the previous step's end to its start, rounds back
  to back) and ``readiness_ms`` (of it, the readiness exchange); ``round_ms`` is the mean of
  ``gap_ms - readiness_ms``, ``readiness_ms`` the mean over the rounds that had an exchange (gaps over
  ``OUTLIER_FACTOR`` times the median dropped first). On the H200 these were 0.05 ms and 0.4-0.9 ms:
  at the ~92% busy engine of the benchmark scenarios, leaving them out made every simulated TTFT of a
  prefetching policy 10-40% low. Logs without them (older runs) keep ``base``'s.
- Reads beside steps: a worker's disk reads run in the engine's process, and a step with reads in
  flight runs slower (H200, two replicas: prefills ~1.4x beside one read, decode steps ~1.03x).
  ``read_overlaps`` counts, per step, the reads on its replica's rank 0 weighted by the share of the
  step they overlapped; the step models are fitted on the steps with none (when there are
  ``MIN_CLEAN_STEPS``), and each kind's ``*_read_slowdown`` is then the least-squares fraction of its
  fitted cost that one read adds. The simulator charges it for the reads in flight on rank 0 when a
  step starts.
- Loads: host->GPU from the loads that hit the host tier (``h2d_ms`` on ``nbytes``: the slope gives
  ``h2d_gbps``), or from every load when fewer than two hit it: a load read from disk streams its chunks
  to the GPU as they are read, so its ``h2d_ms`` spans the read (2.5-3 GB/s on the H100 against 20-40
  for host hits, 2026-11-25; fitting every load charged the simulator's serial read-then-copy twice),
  leaving out copies that followed a write-back of their slot (exclusive tiers: their chunks waited for the
  copy out's pieces, which the simulator charges itself) where two others are left;
  disk->host from the loads that missed the host tier (``disk_ms`` on ``nbytes``: ``disk_fixed_ms``
  and ``disk_gbps``); both by the same least squares (slow reads, beside other reads or steps, are
  costs of that run, not stalls: only rows over ``OUTLIER_FACTOR`` times their fit are dropped).
  ``load_fixed_ms`` is the copy's fitted intercept plus the 25th percentile of ``ready - h2d - disk``
  (waits for a reader, a slot or the copy stream only add to it).

``fit_calibration(..., info=dict)`` fills ``info`` with what each fit used and dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lora_cache.errors import ConfigError

CALIBRATION_DIR = Path(__file__).resolve().parent.parent / "calibration"
SLOT_DTYPES = ("bfloat16", "float16", "float32")
GB = 1e9  # bandwidths are in GB/s: 1e9 bytes per second


def _cost(default: float, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class Calibration:
    """Simulated costs of one engine on one machine (ms; bandwidths in GB/s, inf: free)."""

    name: str = field(default="unnamed", metadata={"help": "what this calibration is, e.g. h200-llama8b"})
    source: str = field(default="", metadata={"help": "how and from what it was measured"})
    provisional: bool = field(default=False, metadata={"help": "not yet fitted from a run of the engine it models"})
    slot_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the slots (decides shard bytes)"})
    prefill_base_ms: float = _cost(0.0, "prefill step: fixed cost")
    prefill_per_token_ms: float = _cost(0.0, "prefill step: per prompt token")
    prefill_per_item_ms: float = _cost(0.0, "prefill step: per prompt in the batch")
    decode_base_ms: float = _cost(0.0, "decode step: fixed cost")
    decode_per_item_ms: float = _cost(0.0, "decode step: per request in the batch")
    decode_per_adapter_ms: float = _cost(0.0, "decode step: per distinct adapter in the batch")
    round_ms: float = _cost(0.0, "host work between two steps back to back (scheduling, reports)")
    readiness_ms: float = _cost(0.0, "of a round, the readiness exchange (rules that prefetch only)")
    load_fixed_ms: float = _cost(0.0, "a load: from the copy's end to READY (off the copy stream)")
    h2d_gbps: float = _cost(math.inf, "host -> GPU copy bandwidth of one rank, GB/s")
    disk_fixed_ms: float = _cost(0.0, "a disk -> host read: fixed cost")
    disk_gbps: float = _cost(math.inf, "disk -> host read bandwidth of one reader thread, GB/s")
    device_fixed_ms: float = _cost(0.0, "--store device: a read's fixed cost before its bytes move")
    device_gbps: float = _cost(1.2, "--store device: the device's bandwidth, GB/s, shared by every read in flight "
                                    "(1.2: an H200 host's reads with the pages dropped, docs: ARCHITECTURE)")
    prefill_read_slowdown: float = _cost(0.0, "prefill step: extra cost, as a fraction, per disk read beside it")
    decode_read_slowdown: float = _cost(0.0, "decode step: extra cost, as a fraction, per disk read beside it")
    report_latency_ms: float = _cost(0.0, "engine/router/worker -> controller message latency")
    command_latency_ms: float = _cost(0.0, "controller plan -> worker command latency")

    def __post_init__(self) -> None:
        if self.slot_dtype not in SLOT_DTYPES:
            raise ConfigError(f"calibration {self.name!r}: slot_dtype is {self.slot_dtype!r}; use one of {SLOT_DTYPES}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_ms", "_slowdown")) and (isinstance(value, bool) or not isinstance(value, int | float)
                                           or not math.isfinite(value) or value < 0):
                raise ConfigError(f"calibration {self.name!r}: {f.name} is {value!r}; give a finite number >= 0 "
                                  "(milliseconds, or a fraction for a slowdown)")
            if f.name.endswith("_gbps") and (isinstance(value, bool) or not isinstance(value, int | float)
                                             or math.isnan(value) or value <= 0):
                raise ConfigError(f"calibration {self.name!r}: {f.name} is {value!r}; give GB/s > 0 "
                                  "(Infinity: a free transfer)")

    # -- costs, in seconds -------------------------------------------------------------------------
    def prefill_s(self, tokens: int, items: int) -> float:
        return (self.prefill_base_ms + self.prefill_per_token_ms * tokens + self.prefill_per_item_ms * items) / 1e3

    def decode_s(self, items: int, adapters: int) -> float:
        return (self.decode_base_ms + self.decode_per_item_ms * items + self.decode_per_adapter_ms * adapters) / 1e3

    def step_s(self, kind: str, items: int, tokens: int, adapters: int, reads: float = 0.0) -> float:
        """A step's compute: ``prefill_s`` for a prefill, else ``decode_s``, slower by its kind's
        ``*_read_slowdown`` per disk read in flight beside it (``reads``) in the same process."""
        if kind == "prefill":
            return self.prefill_s(tokens, items) * (1.0 + self.prefill_read_slowdown * reads)
        return self.decode_s(items, adapters) * (1.0 + self.decode_read_slowdown * reads)

    def round_s(self, readiness: bool) -> float:
        """The host time of a round before its step; ``readiness``: the rule prefetches (pins, reports)."""
        return (self.round_ms + (self.readiness_ms if readiness else 0.0)) / 1e3

    def h2d_s(self, nbytes: int) -> float:
        return nbytes / (self.h2d_gbps * GB)

    def disk_s(self, nbytes: int) -> float:
        return self.disk_fixed_ms / 1e3 + nbytes / (self.disk_gbps * GB)

    def device_slowdown(self) -> float:
        """How many times its fitted time the next ``--store device`` read takes alone on the device: 1 (the
        reads' noise, ``bench.sim.check.NoisyCalibration``, draws it from the real reads' ratios to their fit)."""
        return 1.0

    # -- files ---------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> Calibration:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known - {"comment"})
        if unknown:
            raise ConfigError(f"{where}: unknown fields {unknown}; a calibration has {sorted(known)} "
                              "(and an optional 'comment')")
        return cls(**{k: v for k, v in raw.items() if k in known})


def load_calibration(name_or_path: str) -> Calibration:
    """A calibration by file path, or by name from ``bench/calibration`` (``h200-llama8b``, ``cpu-tiny``)."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = CALIBRATION_DIR / f"{name_or_path}.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as e:
        shipped = sorted(p.stem for p in CALIBRATION_DIR.glob("*.json"))
        raise ConfigError(f"calibration {name_or_path!r}: no file {path}; pass a JSON file or one of {shipped}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"calibration {path}: not valid JSON ({e}); see bench/calibration/README.md") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"calibration {path}: expected a JSON object of fields, got {type(raw).__name__}")
    return Calibration.from_dict(raw, str(path))


# -- fitting ---------------------------------------------------------------------------------------
OUTLIER_FACTOR = 10.0  # a step (or load) taking this many times its fitted cost is a stall: dropped
MIN_CLEAN_STEPS = 10  # steps of a kind without a load wait needed to fit on those alone
STEP_COLUMNS = {"prefill": ("tokens", "items"), "decode": ("items", "adapters")}


def fit_calibration(steps: Iterable[Mapping[str, Any]], loads: Iterable[Mapping[str, Any]], *,
                    name: str = "fitted", source: str = "", base: Calibration | None = None,
                    info: dict[str, Any] | None = None, reads: Sequence[float] | None = None) -> Calibration:
    """Step and load costs fitted from a real run's logs; what the logs cannot tell comes from ``base``.

    ``steps``: ``{kind: 'prefill'|'decode', items, tokens, adapters, ms, load_wait_ms[, gap_ms,
    readiness_ms]}`` (``ms`` includes ``load_wait_ms``, which is subtracted). ``loads``: ``{nbytes,
    ready_ms, h2d_ms, disk_ms, host_hit}``.
    The module docstring says how each cost is fitted. No loads (an oracle's run: every adapter resident
    before its clock): the load costs are ``base``'s, and a ``base`` must be given. ``info``: filled per fit
    (``prefill``, ``decode``, ``h2d``, ``disk``) with ``rows`` given, ``used``, ``dropped`` and
    ``dropped_excess_ms`` (the time of the dropped rows above their fit) and, for steps, ``waited_left_out``
    (steps left out for their load wait).
    ``reads``: the disk reads in flight beside each step (``read_overlaps``); by default computed from
    ``steps`` and ``loads`` as one run's logs (one clock): pass them when pooling several runs.
    """
    given_base, base = base, base or Calibration()
    info = info if info is not None else {}
    steps, loads = list(steps), list(loads)
    beside = list(reads) if reads is not None else read_overlaps(steps, loads)
    fitted = {kind: _fit_steps([s for s in steps if s["kind"] == kind],
                               [r for s, r in zip(steps, beside) if s["kind"] == kind], kind, info,
                               getattr(base, f"{kind}_read_slowdown")) for kind in STEP_COLUMNS}
    prefill, decode = fitted["prefill"], fitted["decode"]
    round_ms, readiness_ms = _fit_rounds(steps, base, info)
    computed = dataclasses.replace(
        base, name=name, source=source, provisional=False,
        prefill_base_ms=prefill["1"], prefill_per_token_ms=prefill["tokens"], prefill_per_item_ms=prefill["items"],
        decode_base_ms=decode["1"], decode_per_item_ms=decode["items"], decode_per_adapter_ms=decode["adapters"],
        prefill_read_slowdown=prefill["read_slowdown"], decode_read_slowdown=decode["read_slowdown"],
        round_ms=round_ms, readiness_ms=readiness_ms)
    if not loads:
        if given_base is None:
            raise ConfigError("fit_calibration: no loads in the log and no base calibration to take their costs "
                              "from; a run must load at least one adapter, or pass base=")
        return computed  # an oracle alone: every adapter resident before its clock; the load costs are the base's
    hits = [ld for ld in loads if ld["host_hit"]]  # a read's chunks are copied while it reads: not a copy's time
    alone = [ld for ld in hits if not ld.get("after_write_back")]  # the others waited for a slot's copy out
    copies = alone if len(alone) >= 2 else hits if len(hits) >= 2 else loads
    nbytes = np.array([ld["nbytes"] for ld in copies], dtype=np.float64)
    h2d = np.array([ld["h2d_ms"] for ld in copies], dtype=np.float64)
    copy_fixed, h2d_gbps = _fit_rate(nbytes, h2d, "h2d", info)
    residual = np.array([ld["ready_ms"] - ld["h2d_ms"] - ld["disk_ms"] for ld in loads])
    missed = [ld for ld in loads if not ld["host_hit"]]
    disk_fixed, disk_gbps = base.disk_fixed_ms, base.disk_gbps
    if missed:
        disk_fixed, disk_gbps = _fit_rate(np.array([ld["nbytes"] for ld in missed], dtype=np.float64),
                                          np.array([ld["disk_ms"] for ld in missed], dtype=np.float64), "disk", info)
    return dataclasses.replace(
        computed, h2d_gbps=h2d_gbps, load_fixed_ms=copy_fixed + max(0.0, float(np.percentile(residual, 25))),
        disk_fixed_ms=disk_fixed, disk_gbps=disk_gbps)


def _fit_rounds(steps: Sequence[Mapping[str, Any]], base: Calibration, info: dict[str, Any]) -> tuple[float, float]:
    """(round_ms, readiness_ms) from the steps' ``gap_ms`` and ``readiness_ms``; ``base``'s if none has a gap."""
    rows = [s for s in steps if s.get("gap_ms") is not None]
    if not rows:
        info["round"] = {"rows": 0, "used": 0, "dropped": 0, "dropped_excess_ms": 0.0}
        return base.round_ms, base.readiness_ms
    gaps = np.array([s["gap_ms"] for s in rows], dtype=np.float64)
    exchange = np.array([s.get("readiness_ms") or 0.0 for s in rows], dtype=np.float64)
    limit = OUTLIER_FACTOR * max(float(np.median(gaps)), 1e-3)  # a GC pause, a Ray call: not a round's cost
    keep = gaps <= limit
    info["round"] = {"rows": len(rows), "used": int(keep.sum()), "dropped": int((~keep).sum()),
                     "dropped_excess_ms": float((gaps[~keep] - limit).sum())}
    gaps, exchange = gaps[keep], exchange[keep]
    with_exchange = exchange > 0
    readiness = float(exchange[with_exchange].mean()) if with_exchange.any() else base.readiness_ms
    return max(0.0, float((gaps - exchange).mean())), readiness


def read_overlaps(steps: Sequence[Mapping[str, Any]], loads: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per step, the disk reads in flight beside it on its replica's rank 0 (the process whose steps are
    logged), each counted by the share of the step it overlapped. A read runs from its load's start
    (``t_s - ready_ms``, ``t_s`` being READY) for ``disk_ms``. Steps without a start time (logs older
    than ``t_s``) get 0. One run's logs: one clock."""
    reads: dict[Any, list[tuple[float, float]]] = {}
    for ld in loads:
        if not ld.get("host_hit", True) and ld.get("rank", 0) == 0 and "t_s" in ld:
            start = ld["t_s"] - ld["ready_ms"] / 1e3
            reads.setdefault(ld.get("replica"), []).append((start, start + ld["disk_ms"] / 1e3))
    spans = {k: np.array(v, dtype=np.float64) for k, v in reads.items()}
    out = []
    for s in steps:
        span = spans.get(s.get("replica"))
        if span is None or s.get("t_s") is None or s["ms"] <= 0:
            out.append(0.0)
            continue
        a, b = s["t_s"], s["t_s"] + s["ms"] / 1e3
        out.append(float(np.clip(np.minimum(b, span[:, 1]) - np.maximum(a, span[:, 0]), 0.0, None).sum() / (b - a)))
    return out


def _fit_steps(steps: Sequence[Mapping[str, Any]], reads: Sequence[float], kind: str, info: dict[str, Any],
               base_slowdown: float) -> dict[str, float]:
    """One kind's compute model from its steps: ``ms - load_wait_ms``, on the steps without a wait if
    there are ``MIN_CLEAN_STEPS`` of them (else on all), and of those on the steps with no disk read
    beside them if there are as many. Then ``read_slowdown``: the least-squares fraction of the fitted
    cost that each read in flight adds, from the steps that had reads beside them (``base_slowdown``
    if none did)."""
    clean = [(s, r) for s, r in zip(steps, reads) if not s.get("load_wait_ms")]
    rows = clean if len(clean) >= MIN_CLEAN_STEPS else list(zip(steps, reads))
    rows = [({**s, "ms": s["ms"] - (s.get("load_wait_ms") or 0.0)}, r) for s, r in rows]
    quiet = [s for s, r in rows if r == 0]
    out = _fit(quiet if len(quiet) >= MIN_CLEAN_STEPS else [s for s, _ in rows], STEP_COLUMNS[kind], kind, info)
    info[kind]["rows"] = len(steps)
    info[kind]["waited_left_out"] = len(steps) - len(rows)
    beside = [(s["ms"], _predict(out, s, kind), r) for s, r in rows if r > 0]
    beside = [(ms, fit, r) for ms, fit, r in beside if fit > 0 and ms <= OUTLIER_FACTOR * fit]
    x = np.array([fit * r for _, fit, r in beside])
    y = np.array([ms - fit for ms, fit, _ in beside])
    out["read_slowdown"] = max(0.0, float(x @ y / (x @ x))) if len(beside) and x @ x > 0 else base_slowdown
    info[kind]["beside_reads"] = len(beside)
    return out


def _predict(fitted: Mapping[str, float], step: Mapping[str, Any], kind: str) -> float:
    return fitted["1"] + sum(fitted[c] * step[c] for c in STEP_COLUMNS[kind])


def _fit(rows: Sequence[Mapping[str, Any]], columns: tuple[str, ...], kind: str,
         info: dict[str, Any] | None = None) -> dict[str, float]:
    """Least squares of ``ms`` on an intercept ("1") and ``columns``, every coefficient >= 0, robust to stalls.

    A column with no spread cannot be told from the intercept: it is left out (coefficient 0). A
    negative coefficient is not a cost: the most negative column is left out and the rest refitted.
    Rows that took more than ``OUTLIER_FACTOR`` times their fitted ``ms`` are dropped and the rest
    refitted, until none is.
    """
    if len(rows) < 2:
        raise ConfigError(f"fit_calibration: {len(rows)} {kind} steps in the log; a fit needs at least 2 "
                          f"(run more requests, or several batch sizes)")
    y = np.array([r["ms"] for r in rows], dtype=np.float64)
    data = {c: np.array([r[c] for r in rows], dtype=np.float64) for c in columns}
    data["1"] = np.ones(len(rows))
    keep = np.ones(len(rows), dtype=bool)
    while True:
        coef, active = _nonneg_lstsq(data, y, keep, columns)
        predicted = np.column_stack([data[c] for c in active]) @ coef
        off = keep & (y > OUTLIER_FACTOR * np.maximum(predicted, 0.0)) & (y > 0)
        if not off.any() or keep.sum() - off.sum() < 2:
            break
        keep &= ~off
    if info is not None:
        info[kind] = {"rows": len(rows), "used": int(keep.sum()), "dropped": int((~keep).sum()),
                      "dropped_excess_ms": float((y - predicted)[~keep].sum())}
    fitted = dict.fromkeys(("1", *columns), 0.0)
    fitted.update({c: max(0.0, float(v)) for c, v in zip(active, coef)})
    return fitted


def _nonneg_lstsq(data: Mapping[str, np.ndarray], y: np.ndarray, keep: np.ndarray,
                  columns: tuple[str, ...]) -> tuple[np.ndarray, list[str]]:
    """Least squares over the kept rows, dropping the most negative column until none is negative."""
    active = ["1", *(c for c in columns if np.ptp(data[c][keep]) > 0)]
    while True:
        coef, *_ = np.linalg.lstsq(np.column_stack([data[c][keep] for c in active]), y[keep], rcond=None)
        worst = int(np.argmin(coef))
        if coef[worst] >= 0 or len(active) == 1:
            return coef, active
        del active[worst]


def _fit_rate(nbytes: np.ndarray, ms: np.ndarray, kind: str = "load",
              info: dict[str, Any] | None = None) -> tuple[float, float]:
    """(fixed ms, GB/s) of ``ms = fixed + nbytes / rate``. Several sizes: robust least squares (no growth
    with size: a fixed cost at infinite rate); one size cannot tell the two apart: a rate through the origin."""
    if np.ptp(nbytes) > 0:
        fitted = _fit([{"nbytes": b, "ms": t} for b, t in zip(nbytes, ms)], ("nbytes",), kind, info)
        slope = fitted["nbytes"]
        return fitted["1"], 1.0 / (slope * GB / 1e3) if slope > 0 else math.inf
    total = float(ms.sum())
    if info is not None:
        info[kind] = {"rows": len(ms), "used": len(ms), "dropped": 0, "dropped_excess_ms": 0.0}
    return 0.0, (float(nbytes.sum()) / (total / 1e3) / GB) if total > 0 else math.inf
