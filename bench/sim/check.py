"""The simulator against a real run: ``python -m bench.sim.check DIR/results.json`` after the fact, or
``python -m bench.run --engine real --check-sim`` in the same job.

Fits the simulator's costs from the run's own step and load logs (``fit_calibration``, the shipped
H200 calibration filling what the logs cannot fit), simulates the same workload, fleet and policies
(routed by the run's own rule, ``--router``, as the real router was), and compares mean and p99 TTFT
per policy (the benchmark issue's check: within 15%).

Fits (``--fit``): ``pooled``, one calibration from every policy's steps and loads (what a calibration
file would hold); ``per-policy``, each policy from its own run's logs. Every policy's real run is a
fresh service, and their step speeds differ by more than the effects compared (two-replica run: mean
decode step 21 ms under global, 29 ms under queue and ondemand, at the same batch sizes), so
``per-policy`` separates the simulator's model from that run-to-run drift; ``both`` (the default here)
reports the two.

The real router sends a hint ``hint_lead_s`` before its request arrives, from before the engines'
clock starts; the simulator routes at ``max(0, arrival - hint_lead_s)``, so every arrival is shifted by
``hint_lead_s`` to give the first requests their hints' full lead (TTFT is relative to arrival).

Warming: the simulated controller warms the host tiers under the gate the real one had (``run_warm_gate``:
``RealConfig.warm_min_miss_s`` as the run recorded it; runs from before the gate existed warmed from the start,
0). With the current default gate the simulated controller starts warming only after its first slow reads: a
run that warmed from the start staged its warm set during the warm-up, the gated simulation during the
measured window, where its warm reads share the device with the misses (two-replica device run: 20 stages
simulated in the window against 3 real).

Stalls: steps whose compute took more than ``OUTLIER_FACTOR`` times its fit (JIT compiles on a fresh
machine, GC pauses) are left out of the fit and listed per policy: the real TTFT includes them, the
simulated one cannot.

Rounds: the engine's host time between steps (``Calibration.round_ms``, ``readiness_ms``) is fitted
from the steps' ``gap_ms`` and ``readiness_ms``. Runs logged before the engine recorded them
(2026-11-22) get an estimate (``estimate_gaps``): per policy, the time its replicas held a request
(the union of arrival-to-finish intervals) minus the time in steps, over its steps; the readiness
exchange is what a prefetching policy's estimate adds to that of the policies without one.

Noise (``--noise N``): the engine's step times are noisy and the noise comes in slow stretches of a
second or so (18-45 ms decode steps at the same batch size); with 100 requests, p99 is the second
worst request, and one slow stretch behind a head-of-line wait (``max_adapters``) moves it by 2x.
``--noise N`` runs each simulation N more times, each step's cost multiplied by the ratio of a real
step of the same kind to its fit, drawn in blocks of ``NOISE_BLOCK`` consecutive steps of that kind in
the run's own log (stalls left out), and reports the 5th-95th percentile band of the simulated
figures; loads likewise draw their disk reads' and copies' ratios to their fits (``--store device``: a read's
ratio stretches its transfer on the shared device; the logged reads' ratios hold the sharing the device models
too, so that band is a little wide). Per kind, because
the two kinds of step differ: a decode step is one CUDA graph launch, a
prefill a thousand eager launches whose rare slow ones (a 263-token prefill of 169 ms, ~30 ms
normally, was global's worst TTFT on the two-replica run) a block of decode ratios never draws.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.config import BenchConfig
from bench.figures import figures
from bench.policies import BENCH_POLICIES, BenchPolicy
from bench.report import read_results_or_say, results_parser
from bench.sim.calibration import OUTLIER_FACTOR, Calibration, fit_calibration, load_calibration, read_overlaps
from bench.sim.fleet import SimConfig, simulate
from bench.sim.job import run_policies
from bench.sim.store import fit_store
from bench.warmup import split_run, warm_workload
from bench.workloads import Workload, WorkloadSpec, make_workload
from lora_cache.planner import PlannerConfig
from workers.engine.admission import ADMISSION

KEYS = ("mean_ttft_ms", "p99_ttft_ms")
FITS = ("pooled", "per-policy")
NOISE_BLOCK = 50  # consecutive steps drawn together (about a second of a replica's steps)
BAND = (5, 95)  # percentiles of the noisy runs reported

Logs = list[dict[str, Any]] | Mapping[str, list[dict[str, Any]]]


def compare(bench: BenchConfig, policies: Sequence[BenchPolicy], workload: Workload,
            real: Mapping[str, Mapping[str, Any]], steps: Logs, loads: Logs, *, fit: str = "pooled",
            noise: int = 0, seed: int = 0, warm_min_miss_s: float = PlannerConfig.warm_min_miss_s,
            lags: Mapping[str, Mapping[int, float]] | None = None) -> dict[str, Any]:
    """``real``: each policy's figures; ``steps``/``loads``: the real run's logs the costs are fitted from, as
    one list or by policy (``fit='per-policy'`` needs them by policy). ``noise``: noisy runs per policy.
    ``warm_min_miss_s``: the warming gate the real run's controller had (``run_warm_gate``). ``lags``: by policy,
    each request's lag from its arrival to its submission in the real run (``submit_lags``), replayed."""
    if fit not in FITS:
        raise ValueError(f"fit {fit!r}: use one of {FITS}")
    by_policy = isinstance(steps, Mapping)
    if fit == "per-policy" and not (by_policy and isinstance(loads, Mapping)):
        raise ValueError("fit='per-policy' needs the steps and loads by policy")
    all_steps = [s for run in steps.values() for s in run] if isinstance(steps, Mapping) else list(steps)
    all_loads = [x for run in loads.values() for x in run] if isinstance(loads, Mapping) else list(loads)
    base = load_calibration("h200-llama8b")
    source = "the real run's step and load logs"
    reads = ({p: read_overlaps(run, loads[p]) for p, run in steps.items()}  # each policy's run: its own clock
             if isinstance(steps, Mapping) and isinstance(loads, Mapping) else None)
    all_reads = [r for run in reads.values() for r in run] if reads is not None else read_overlaps(all_steps, all_loads)
    pooled = fit_calibration(all_steps, all_loads, name=f"fitted-{bench.model}", source=source, base=base,
                             reads=all_reads)
    store = bench.store_model()  # the store's costs, from the same logs (bench.sim.store.fit_store)
    runs_loads = list(loads.values()) if isinstance(loads, Mapping) else [all_loads]
    pooled = fit_store(pooled, runs_loads, store)
    out: dict[str, Any] = {"fit": fit, "calibration": dataclasses.asdict(pooled), "policies": {},
                           "store": store.describe(), "warmup_requests": workload.warmup,
                           "warm_min_miss_s": warm_min_miss_s}
    workload = _shift(workload, bench.hint_lead_s)
    for policy in policies:
        own_steps = steps[policy.name] if isinstance(steps, Mapping) else all_steps
        calib, own_loads = pooled, all_loads
        if fit == "per-policy" and isinstance(loads, Mapping):  # (checked above) its own loads, unless it
            own_loads = loads[policy.name] if len(loads[policy.name]) >= 2 else all_loads  # made too few to fit
            calib = fit_calibration(own_steps, own_loads, name=f"fitted-{bench.model}-{policy.name}",
                                    source=f"{source} of {policy.name}", base=pooled,  # e.g. disk: no miss
                                    reads=reads[policy.name] if reads is not None else None)
            calib = fit_store(calib, [own_loads], store)
            out.setdefault("calibrations", {})[policy.name] = dataclasses.asdict(calib)
        config: dict[str, Any] = {}
        played = dataclasses.replace(workload, submit_lag_s=(lags or {}).get(policy.name, {}))
        (sim,) = run_policies(bench, [policy], played, config, calib, warm_min_miss_s)
        r, s = real[policy.name], figures(split_run(sim, workload.warmup)[0])  # the measured window, as the real
        entry: dict[str, Any] = {k: {"real": r[k], "sim": s[k], "error": s[k] / r[k] - 1 if r[k] else math.inf}
                                 for k in KEYS}
        if by_policy:
            stalls = step_stalls(own_steps, calib)
            if stalls["steps"]:
                out.setdefault("stalls", {})[policy.name] = stalls
        if noise:
            logged, beside = ((own_steps, reads[policy.name]) if fit == "per-policy" and reads is not None
                              else (all_steps, all_reads))
            ratios = {kind: step_ratios([s for s in logged if s["kind"] == kind], calib,
                                        [r for s, r in zip(logged, beside) if s["kind"] == kind])
                      for kind in ("prefill", "decode")}
            ratios.update(load_ratios(own_loads, calib))
            sim_config = SimConfig(**config["sim"])  # as run_policies made it, without a progress bar per run
            runs = [figures(split_run(simulate(sim_config, policy, played,
                                               NoisyCalibration.wrap(calib, ratios, seed + i))
                                      .as_policy_run(policy.name, 0.0), workload.warmup)[0]) for i in range(noise)]
            for k in KEYS:
                values = [run[k] for run in runs]
                lo, hi = (float(np.percentile(values, q)) for q in BAND)
                entry[k]["band"] = [lo, hi]
                entry[k]["real_in_band"] = lo * (1 - 1e-9) <= r[k] <= hi * (1 + 1e-9)  # rounding: ratios of 1
        out["policies"][policy.name] = entry
    out["within_15pct"] = all(abs(v["error"]) <= 0.15 for p in out["policies"].values() for v in p.values())
    return out


def _shift(workload: Workload, lead_s: float) -> Workload:
    """Arrivals ``lead_s`` later (open loop), so the simulated router hints every request ``lead_s`` ahead."""
    if workload.inflight or lead_s <= 0:
        return workload
    return dataclasses.replace(workload, requests=[r._replace(arrival_s=r.arrival_s + lead_s)
                                                  for r in workload.requests])


def _fitted_ms(step: Mapping[str, Any], calib: Calibration, reads: float = 0.0) -> float:
    return calib.step_s(step["kind"], step["items"], step["tokens"], step["adapters"], reads) * 1e3


def step_stalls(steps: Sequence[Mapping[str, Any]], calib: Calibration) -> dict[str, Any]:
    """Steps whose compute (``ms - load_wait_ms``) took over ``OUTLIER_FACTOR`` times ``calib``'s cost."""
    found = [(s, s["ms"] - (s.get("load_wait_ms") or 0.0), _fitted_ms(s, calib)) for s in steps]
    found = [(s, ms, fit) for s, ms, fit in found if ms > OUTLIER_FACTOR * fit]
    return {"steps": len(found), "excess_ms": sum(ms - fit for _, ms, fit in found),
            "largest": [{"replica": s.get("replica"), "kind": s["kind"], "items": s["items"], "tokens": s["tokens"],
                         "ms": ms} for s, ms, _ in sorted(found, key=lambda x: -x[1])[:5]]}


def step_ratios(steps: Sequence[Mapping[str, Any]], calib: Calibration,
                reads: Sequence[float] | None = None) -> list[float]:
    """Each step's compute over its fitted cost with the disk reads beside it (``reads``, aligned with
    ``steps``; none if not given), in log order (stalls and steps that waited left out)."""
    out = []
    for s, beside in zip(steps, reads if reads is not None else [0.0] * len(steps)):
        if s.get("load_wait_ms"):
            continue
        fit = _fitted_ms(s, calib, beside)
        if fit > 0 and s["ms"] <= OUTLIER_FACTOR * fit:
            out.append(s["ms"] / fit)
    return out


def load_ratios(loads: Sequence[Mapping[str, Any]], calib: Calibration) -> dict[str, list[float]]:
    """Each load's disk read (host-tier misses) and host -> GPU copy over their fitted costs, in log order."""
    out: dict[str, list[float]] = {"disk": [], "h2d": []}
    for ld in loads:
        for kind, ms, fitted in (("h2d", ld["h2d_ms"], calib.h2d_s(ld["nbytes"]) * 1e3),
                                 ("disk", ld["disk_ms"], calib.disk_s(ld["nbytes"]) * 1e3)):
            if kind == "disk" and ld["host_hit"]:
                continue
            if fitted > 0 and 0 < ms <= OUTLIER_FACTOR * fitted:
                out[kind].append(ms / fitted)
    return out


@dataclass(frozen=True)
class NoisyCalibration(Calibration):
    """``Calibration`` whose step, read and copy costs are scaled by real ratios of the same kind
    (``prefill``, ``decode``, ``disk``, ``h2d``), drawn ``NOISE_BLOCK`` at a time from a random start in
    that kind's ``ratios`` (a block bootstrap: slow stretches stay together). Seeded: deterministic."""

    ratios: tuple[tuple[str, tuple[float, ...]], ...] = ()  # (kind, its ratios in log order)
    seed: int = 0
    _state: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def wrap(cls, calib: Calibration, ratios: Mapping[str, Sequence[float]], seed: int) -> NoisyCalibration:
        fields = {f.name: getattr(calib, f.name) for f in dataclasses.fields(Calibration)}
        return cls(**fields, ratios=tuple((k, tuple(v)) for k, v in ratios.items()), seed=seed)

    def _factor(self, kind: str) -> float:
        ratios = self._state.setdefault("by_kind", dict(self.ratios)).get(kind, ())
        if not ratios:
            return 1.0
        rng = self._state.setdefault("rng", random.Random(self.seed))
        st = self._state.setdefault(kind, {"at": 0, "left": 0})
        if not st["left"]:
            st["at"], st["left"] = rng.randrange(len(ratios)), NOISE_BLOCK
        st["left"] -= 1
        st["at"] = (st["at"] + 1) % len(ratios)
        return ratios[st["at"]]

    def prefill_s(self, tokens: int, items: int) -> float:
        return super().prefill_s(tokens, items) * self._factor("prefill")

    def decode_s(self, items: int, adapters: int) -> float:
        return super().decode_s(items, adapters) * self._factor("decode")

    def disk_s(self, nbytes: int) -> float:
        return super().disk_s(nbytes) * self._factor("disk")

    def device_slowdown(self) -> float:
        return self._factor("disk")  # a device read: the same ratios of a logged read to its fit

    def h2d_s(self, nbytes: int) -> float:
        return super().h2d_s(nbytes) * self._factor("h2d")


def estimate_gaps(requests: Mapping[str, Sequence[Mapping[str, Any]]],
                  steps: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """``steps`` with ``gap_ms``/``readiness_ms`` estimated per policy (see the module docstring); logs that
    have them are returned as they are."""
    if any(s.get("gap_ms") is not None for run in steps.values() for s in run):
        return dict(steps)
    gap = {p: _host_ms_per_step(requests[p], run) for p, run in steps.items() if run}
    plain = [g for p, g in gap.items() if not ADMISSION[BENCH_POLICIES[p].admission].prefetch]
    round_ms = min(plain) if plain else 0.0
    out = {}
    for p, run in steps.items():
        readiness = max(0.0, gap.get(p, 0.0) - round_ms) if ADMISSION[BENCH_POLICIES[p].admission].prefetch else 0.0
        out[p] = [{**s, "gap_ms": None if i == 0 else gap[p], "readiness_ms": readiness} for i, s in enumerate(run)]
    return out


def _host_ms_per_step(requests: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]]) -> float:
    replicas = max(1, len({s.get("replica") for s in steps}))
    by_replica: dict[int, list[tuple[float, float]]] = {}
    for i, r in enumerate(sorted(requests, key=lambda r: (r["arrival_s"], r["rid"]))):  # bench.real.route
        by_replica.setdefault(i % replicas, []).append((r["arrival_s"], r["finish_s"]))
    held = 0.0
    for spans in by_replica.values():  # union of each replica's request intervals
        end = -math.inf
        for a, f in sorted(spans):
            held += max(0.0, f - max(a, end))
            end = max(end, f)
    return max(0.0, (held * 1e3 - sum(s["ms"] for s in steps)) / len(steps))


WARM_GATE_SINCE = "2026-11-28 15:55"  # the controller's first warming gate (commit 4a1b808): warmed always before


def run_warm_gate(doc: Mapping[str, Any]) -> float:
    """The warming gate (``PlannerConfig.warm_min_miss_s``) a real run's controller had: as recorded in its
    config (``RealConfig.warm_min_miss_s``); a run from before the record that started before the gate existed
    (``WARM_GATE_SINCE``) warmed from the start (0); any other, the planner's default (a service starts with it)."""
    recorded = doc["config"].get("real", {}).get("warm_min_miss_s")
    if recorded is not None:
        return float(recorded)
    return 0.0 if str(doc["config"].get("started", "")) < WARM_GATE_SINCE else PlannerConfig.warm_min_miss_s


def check(doc: dict[str, Any], fit: str = "pooled", noise: int = 0) -> dict[str, Any]:
    """``compare`` for a results.json document of a ``--engine real`` run."""
    # a run from before --fetch-order (2026-12-03) shared the store among its demand fetches: replayed so
    bench = BenchConfig(**{"fetch_order": "shared", **doc["config"]["bench"]})
    w = doc["config"]["workload"]
    spec = WorkloadSpec(arrivals=w["arrivals"], popularity=w["popularity"], requests=w["requests"],
                        random_input_len=w["random_input_len"], random_output_len=w["random_output_len"],
                        random_range_ratio=w["random_range_ratio"], workload_seed=w["seed"],
                        num_adapters=doc["config"]["adapters"])
    names = spec.adapter_names(bench.slots)
    warmup = int(w.get("warmup_requests", 0) or 0)  # the run's warm-up, replayed; its logs are the measured window's
    workload = warm_workload(spec, names, warmup, bench.replicas, bench.slots)[0] if warmup else \
        make_workload(spec, names)
    routing = doc.get("routing") or {}
    return compare(bench, [BENCH_POLICIES[p] for p in doc["figures"]], workload, doc["figures"],
                   estimate_gaps(doc["requests"], doc["steps"]), doc["loads"], fit=fit, noise=noise,
                   warm_min_miss_s=run_warm_gate(doc),
                   lags={p: submit_lags(routing.get(p) or {}, workload, doc["requests"].get(p, ()))
                         for p in doc["figures"]})


def submit_lags(routing: Mapping[str, Any], workload: Workload, records: Sequence[Any] = ()) -> dict[int, float]:
    """rid -> seconds from its arrival to its submission reaching the engine in a real run, for the simulator to
    replay (``Workload.submit_lag_s``): when rank 0's feed got it (the records' ``received_s``, logged since
    2026-11-30), else when the router sent it (its ``submitted_s``: the Ray call to rank 0 not counted). On two
    H200s the router sent 0.6-1.2 ms after arrival on average, up to 16 ms, and without any lag the simulated wait
    before prefill was 1.8-3.8 ms short of the real one on every run (bench/reports/issue-42.md). None before 0;
    runs that logged neither (older ones, closed loops): empty, every request at its arrival."""
    if workload.inflight:
        return {}
    arrival = {r.rid: r.arrival_s for r in workload.requests}
    sent = {int(rid): float(t) for rid, t in (routing.get("submitted_s") or {}).items()}
    for r in records:
        rid, got = (r["rid"], r.get("received_s")) if isinstance(r, Mapping) else (r.rid, r.received_s)
        if got is not None:
            sent[int(rid)] = float(got)
    return {rid: max(0.0, t - arrival[rid]) for rid, t in sent.items() if rid in arrival}


def format_comparison(out: Mapping[str, Any]) -> str:
    lines = [f"fit: {out.get('fit', 'pooled')}"]
    for name, figs in out["policies"].items():
        parts = []
        for k, v in figs.items():
            text = f"{k} real {v['real']:.1f} sim {v['sim']:.1f} ({v['error']:+.0%})"
            if "band" in v:
                lo, hi = v["band"]
                outside = "" if v["real_in_band"] else ", real outside"
                text += f" [noise {BAND[0]}-{BAND[1]}%: {lo:.0f}-{hi:.0f}{outside}]"
            parts.append(text)
        lines.append(f"{name:>9}: " + "  ".join(parts))
    for name, stalls in out.get("stalls", {}).items():
        lines.append(f"{name:>9}: {stalls['steps']} stalled steps (> {OUTLIER_FACTOR:g}x their fit) cost "
                     f"{stalls['excess_ms'] / 1e3:.1f} s more than fitted: in the real TTFT, not the simulated one")
    return "\n".join([*lines, f"within 15%: {'yes' if out['within_15pct'] else 'no'}"])


def main(argv: list[str] | None = None) -> int:
    parser = results_parser("python -m bench.sim.check", __doc__)
    parser.add_argument("--fit", choices=(*FITS, "both"), default="both",
                        help="one calibration for all policies, each policy's own, or both (default)")
    parser.add_argument("--noise", type=int, default=0, metavar="N",
                        help="also N simulations per policy with the run's own step noise (a 5-95%% band)")
    parser.add_argument("--json", type=Path, help="also write the comparison(s) here")
    ns = parser.parse_args(argv)
    doc = read_results_or_say(ns.results)
    if doc is None:
        return 2
    outs = {fit: check(doc, fit, ns.noise) for fit in (FITS if ns.fit == "both" else (ns.fit,))}
    print("\n".join(format_comparison(out) for out in outs.values()))
    if ns.json:
        ns.json.write_text(json.dumps(outs, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
