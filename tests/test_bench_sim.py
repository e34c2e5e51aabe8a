"""The fleet simulator (bench/sim): the policies' ordering, invariants, determinism, calibration fitting."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench.policies import BENCH_POLICIES, BenchPolicy
from bench.sim import Calibration, SimConfig, SimResult, fit_calibration, load_calibration, simulate
from bench.workloads import Workload, WorkloadSpec, make_workload
from lora_cache.errors import ConfigError
from workers.engine.workload import Request

H200 = load_calibration("h200-llama8b")
# H200's costs with every coefficient identifiable from this module's small workloads' logs (one prompt
# per prefill there) and no host time between steps: for the tests that fit a run's own logs back
EXACT = dataclasses.replace(H200, prefill_base_ms=H200.prefill_base_ms + H200.prefill_per_item_ms,
                            prefill_per_item_ms=0.0, round_ms=0.0, readiness_ms=0.0)
SMALL = SimConfig(replicas=2, tp=1, slots=4, max_adapters=4)


@cache
def workload(arrivals: str = "poisson:6", requests: int = 240, seed: int = 0, output: int = 64) -> Workload:
    spec = WorkloadSpec(arrivals=arrivals, popularity="zipf:1.5", requests=requests, random_input_len=512,
                        random_output_len=output, workload_seed=seed)
    return make_workload(spec, spec.adapter_names(SMALL.slots))


@cache
def run(policy: str, config: SimConfig = SMALL) -> SimResult:
    """``workload()`` under ``policy``, with integrity checks as it runs (cached: several tests read one run)."""
    return simulate(config, BENCH_POLICIES[policy], workload(), H200, check=True)


# -- the ordering the benchmark must show ------------------------------------------------------------
# Two replicas of 8 slots (max_adapters 8, one batch's adapters fill the slots, as SGLang and vLLM size
# the pool), 32 adapters (4 per slot), Zipf 1.5, 12 requests/s: a loaded fleet, where queues form and
# loads, not compute, decide the tail. At a light load (8/s and below) no queue forms, so queue prefetch
# has nothing to act on and ties ondemand (0.91-1.04x on seeds 0-5); at 16/s the fleet is overloaded
# (the oracle's own p99 is 0.6-1.2 s). With max_adapters < slots, p99 TTFT is set by head-of-line
# blocking on max_adapters, not by the cache.
# The router here hints 0.5 s ahead (a router that queues requests): this ordering and its goals were set
# at that lead; at 0.05 s (the benchmark's default since issue 20) the order holds but global's p99 is
# 1.7x the oracle's on seed 0 (bench/RESULTS.md, issue 20).
ORDERING = SimConfig(replicas=2, tp=1, slots=8, max_adapters=8, hint_lead_s=0.5)


def ordering_p99(seed: int, policies: tuple[str, ...]) -> dict[str, float]:
    return {name: _ordering_p99(seed, name) for name in policies}


@cache
def _ordering_p99(seed: int, policy: str) -> float:
    """p99 TTFT of one policy on the ordering workload of ``seed`` (cached: two tests read seed 0)."""
    spec = WorkloadSpec(arrivals="poisson:12", popularity="zipf:1.5", requests=600, random_input_len=512,
                        random_output_len=128, workload_seed=seed)
    wl = make_workload(spec, spec.adapter_names(ORDERING.slots))
    return float(simulate(ORDERING, BENCH_POLICIES[policy], wl, H200).summary()["p99_ttft_ms"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_p99_ttft_ordering_for_zipf_with_four_adapters_per_slot(seed: int) -> None:
    """oracle <= global <= queue <= ondemand on p99 TTFT, and global within the goal's 1.15x of the oracle.

    On seeds 0-5 (the p99 is the sixth worst of 600 requests): global is 0.98-1.12x the oracle, queue
    0.50-0.95x ondemand. Global's p99 can fall a little under the oracle's (seed 1: 0.98x since speculative
    loads need 0.5 requests/s, 2026-11-24), where batches form differently around its few loads: "a little"
    is 5% here. Without staging (needed
    adapters that find every slot pinned read into the host tier ahead, lora_cache.planner.policies),
    global was 1.11-2.23x the oracle here: its cold loads waited for a slot, then read the disk."""
    p99 = ordering_p99(seed, ("oracle", "global", "queue", "ondemand"))
    assert 0.95 * p99["oracle"] <= p99["global"] <= p99["queue"] <= p99["ondemand"], p99
    assert p99["global"] <= 1.15 * p99["oracle"], p99


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_at_a_realistic_lead_global_beats_the_engine_baselines(seed: int) -> None:
    """At a 50 ms router lead (the default: a router that forwards within milliseconds) the order holds and
    global's p99 is <= 0.75x queue's and overlap's (issue 20's goal). Seeds 0-3: 0.59-0.67x queue; the
    oracle's gap stays open (global 1.47-1.73x the oracle: cold adapters have no lead to load in). The engine
    baselines are ordered on the mean: their p99s are one store read each, 132.2 (queue) and 132.1 ms (ondemand) at
    seed 2 once a copy after a write-back waited only for the pieces of its range."""
    config = dataclasses.replace(ORDERING, hint_lead_s=0.05)
    spec = WorkloadSpec(arrivals="poisson:12", popularity="zipf:1.5", requests=600, random_input_len=512,
                        random_output_len=128, workload_seed=seed)
    wl = make_workload(spec, spec.adapter_names(config.slots))
    runs = {p: simulate(config, BENCH_POLICIES[p], wl, H200).summary()
            for p in ("oracle", "global", "queue", "overlap", "ondemand")}
    p99 = {p: float(s["p99_ttft_ms"]) for p, s in runs.items()}
    mean = {p: float(s["mean_ttft_ms"]) for p, s in runs.items()}
    assert p99["oracle"] <= p99["global"] <= min(p99["queue"], p99["ondemand"]), p99
    assert mean["oracle"] <= mean["global"] <= mean["queue"] <= mean["ondemand"], mean
    assert p99["global"] <= 0.75 * min(p99["queue"], p99["overlap"]), p99


def test_staging_cuts_global_load_waits_on_the_loaded_fleet() -> None:
    """Needed adapters that find every slot pinned are read into the host tier ahead (Stage commands): the
    load that follows is a host hit. Without it, global's cold loads wait for a slot and then the disk.
    On seeds 0-5 staging raised the loads' host-hit share from 0.52-0.61 to 0.64-0.70 and took global's p99
    from 64.7-132.0 ms to 58.0-64.9 ms (seed 2 alone unchanged: 64.7 against 64.9)."""
    spec = WorkloadSpec(arrivals="poisson:12", popularity="zipf:1.5", requests=600, random_input_len=512,
                        random_output_len=128, workload_seed=0)
    wl = make_workload(spec, spec.adapter_names(ORDERING.slots))
    on = simulate(ORDERING, BENCH_POLICIES["global"], wl, H200, check=True)
    off = simulate(dataclasses.replace(ORDERING, max_staged=0, stage_share=0.0, warm_share=0.0),
                   BENCH_POLICIES["global"], wl, H200, check=True)
    assert int(on.controller["stage_commands"]) > 0 and on.totals()["stages"] > 0  # type: ignore[call-overload]
    assert off.controller["stage_commands"] == 0 and off.totals()["stages"] == 0
    host_hit = {name: sum(ld.host_hit for ld in r.loads) / len(r.loads) for name, r in (("on", on), ("off", off))}
    assert host_hit["on"] > host_hit["off"], host_hit
    waits = {name: r.summary()["mean_load_wait_ms"] for name, r in (("on", on), ("off", off))}
    assert waits["on"] < waits["off"], waits
    assert on.summary()["p99_ttft_ms"] < off.summary()["p99_ttft_ms"]
    for policy in ("queue", "ondemand"):  # the baselines never stage
        assert run(policy).controller["stage_commands"] == 0 and run(policy).totals()["stages"] == 0


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_max_staged_must_be_a_count(value: object) -> None:
    with pytest.raises(ConfigError, match=f"max_staged is {value!r}; give an int >= 0"):
        SimConfig(max_staged=value)  # type: ignore[arg-type]


def test_global_p99_ttft_meets_the_goals_against_oracle_and_queue() -> None:
    """bench.figures.GOALS: global p99 TTFT <= 1.15x the oracle's and <= 0.8x queue's (Zipf)."""
    p99 = ordering_p99(0, ("oracle", "global", "queue"))
    assert p99["global"] <= 1.15 * p99["oracle"] and p99["global"] <= 0.8 * p99["queue"], p99


# -- invariants ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", list(BENCH_POLICIES))
def test_every_request_completes_with_consistent_records(policy: str) -> None:
    result = run(policy)
    assert [r.rid for r in result.records] == list(range(len(workload().requests)))
    for r, req in zip(result.records, workload().requests):
        assert r.ok and r.error is None, r
        assert (r.adapter, r.input_len, r.output_len, r.arrival_s) == (req.adapter, req.input_len, req.output_len,
                                                                       req.arrival_s)
        assert r.prefill_s is not None and r.arrival_s <= r.prefill_s < r.token_s[0]
        assert list(r.token_s) == sorted(r.token_s) and len(r.token_s) == r.output_len
        assert 0.0 <= r.load_wait_s <= r.ttft_s
    assert result.end_s == max(r.token_s[-1] for r in result.records)


@pytest.mark.parametrize("policy", ["ondemand", "queue", "global"])
def test_slots_bytes_and_counters_add_up(policy: str) -> None:
    config = dataclasses.replace(SMALL, tp=2)
    result = run(policy, config)  # check=True: every rank's slot table and the controller checked as it ran
    totals = result.totals()
    assert len(result.ranks) == config.replicas * config.tp
    for rank in result.ranks:
        assert int(rank["slots_ready"]) + int(rank["slots_loading"]) <= config.slots  # type: ignore[call-overload]
    assert totals["loads"] == len(result.loads) > 0
    assert totals["bytes_host_to_gpu"] == sum(ld.nbytes for ld in result.loads)
    shard_mb = {16: 56.6, 64: 226.5}  # Llama-3.1-8B, 7 modules, bf16, TP 2: one rank's shard (bench/RESULTS.md)
    ranks = SMALL.lora_ranks()
    index = {name: i for i, name in enumerate(workload().adapters)}
    for ld in result.loads:
        assert ld.nbytes / 1e6 == pytest.approx(shard_mb[ranks[index[ld.adapter] % len(ranks)]], abs=0.05)
    assert totals["host_hits"] + totals["host_misses"] == totals["prefetches"] + totals["demand_loads"]
    assert totals["prefetch_used"] + totals["prefetch_unused"] <= totals["evictions"]
    assert all(ld.ready_s >= ld.start_s for ld in result.loads)
    series = result.series
    assert sum(int(b["loads"] or 0) for b in series) == totals["loads"]
    assert sum(int(b["done"] or 0) for b in series) == len(result.records)
    assert sum(int(b["tokens"] or 0) for b in series) == sum(r.output_len for r in result.records)


@pytest.mark.parametrize("policy", ["queue", "global"])
def test_a_paged_pool_at_equal_bytes_serves_every_request_and_hits_at_least_as_often(policy: str) -> None:
    """Issue 43 in the simulator: the 16/64 mix on 4 slots of rank 64 against the same bytes in 16 pages of rank
    16 (up to 12 adapters at once): every rank's table checked as it runs (no page shared), every request served,
    the books balanced, more adapters resident at once, at least the slots' GPU hit rate, and no thrash: before
    single pages went to the pool's start and runs to its end, `global` made 604 loads here against the slots' 71
    (the planner's bytes fitted where no contiguous run was free, and the rank's own choice evicted what it had
    planned to keep)."""
    paged = dataclasses.replace(SMALL, slots=12, page_rank=16, pool_pages=16)
    result, slots = run(policy, paged), run(policy)
    totals, before = result.totals(), slots.totals()
    assert all(r.ok for r in result.records) and len(result.records) == len(workload().requests)
    assert totals["loads"] == totals["prefetches"] + totals["demand_loads"] == len(result.loads)
    assert max(int(rank["slots_ready"]) for rank in result.ranks) > SMALL.slots  # type: ignore[call-overload]
    rate = totals["gpu_hits"] / (totals["gpu_hits"] + totals["gpu_misses"])
    assert rate >= before["gpu_hits"] / (before["gpu_hits"] + before["gpu_misses"]), (totals, before)
    assert totals["loads"] <= 1.25 * before["loads"], (totals["loads"], before["loads"])


def test_concurrent_misses_wait_for_host_room_instead_of_failing() -> None:
    """The smallest fast run of bench.sweep's fleet8-bursty (8 round-robin replicas, bursty over 200
    adapters, ondemand, the default 2 GiB host tier) that raised before loads waited for host room: seed 2,
    850 requests ("on-demand load of adapter-129 failed: no GPU slot or host-tier room"; found by trying
    400-2,000 requests on seeds 0-5). Now the load that finds every host byte held by loads in flight waits
    for one of them (counted in host_waits), and every request is served."""
    # inclusive tiers: the case that raised (exclusive ones free a shard's host bytes once it is READY: no waits here)
    config = SimConfig(replicas=8, slots=8, max_adapters=8, routing="round-robin", host_bytes=2 << 30,
                       host_tiers="inclusive")
    spec = WorkloadSpec(arrivals="poisson:32", popularity="bursty:40,80,80", num_adapters=200, requests=850,
                        workload_seed=2)
    result = simulate(config, BENCH_POLICIES["ondemand"], make_workload(spec, spec.adapter_names(8)), H200,
                      check=True)
    totals = result.totals()
    assert all(r.ok for r in result.records) and len(result.records) == 850
    assert totals["host_waits"] > 0 and totals["load_failures"] == 0, totals
    assert totals["loads"] == totals["prefetches"] + totals["demand_loads"]  # every started load completed
    assert totals["host_hits"] + totals["host_misses"] == totals["loads"]


def test_exclusive_tiers_write_evicted_shards_back_and_serve_every_request() -> None:
    """``host_tiers`` exclusive in the simulator (``LoadPath.vacate``'s rules): shards evicted from slots come
    back into the host tier with no store read, a READY slot's shard keeps no idle host copy (``check``), and every
    request is served with the books balanced."""
    result = run("global")  # exclusive: the default
    totals = result.totals()
    assert all(r.ok for r in result.records) and len(result.records) == len(workload().requests)
    assert totals["host_written_back"] > 0
    assert totals["host_hits"] + totals["host_misses"] == totals["prefetches"] + totals["demand_loads"]
    inclusive = run("global", dataclasses.replace(SMALL, host_tiers="inclusive"))
    assert inclusive.totals()["host_written_back"] == 0  # nothing written back


def test_the_same_seed_gives_identical_records() -> None:
    a = run("global")  # the cached run (integrity checks on: they do not change the records)
    b = simulate(SMALL, BENCH_POLICIES["global"], workload(), H200)
    assert a.records == b.records and a.loads == b.loads and a.steps == b.steps and a.series == b.series
    other = simulate(SMALL, BENCH_POLICIES["global"], workload(seed=1), H200)
    assert [r.token_s for r in other.records] != [r.token_s for r in a.records]


def test_loads_placed_before_the_clock_starts_take_their_own_time() -> None:
    """The fleet runs settle_s (1 s) before the first request, and the controller's first plans load adapters then (the
    catalog fits the fleet's slots: each one placed at its home). Those loads run then, as on the real path: none of
    them waits for t=0. Before (issue 31) every rank's readers and copy stream started free at t=0, so a load sent at
    -0.5 s was READY at +10 ms, and the controller's LoadClock read 8 ms loads as 0.5 s all run long."""
    wl = workload(requests=40)
    fits = dataclasses.replace(SMALL, slots=len(wl.adapters) // SMALL.replicas + 1)  # the slots hold the catalog
    result = simulate(fits, BENCH_POLICIES["global"], wl, H200)
    early = [ld for ld in result.loads if ld.start_s < -0.1]
    assert early, "no load before the clock: the catalog was not placed during settle"
    assert all(ld.ready_s - ld.start_s < 0.1 and ld.ready_s < 0 for ld in early), early


def test_the_oracle_never_loads() -> None:
    result = run("oracle")
    assert result.loads == [] and result.totals()["loads"] == 0 and result.totals()["evictions"] == 0
    assert all(result.ready_on_arrival) and result.summary()["ready_on_arrival"] == 1.0
    # the scheduler counts a request held back by admission as waiting on a load: under overlap that is
    # also the one-round readiness lag (see below), never more than one step here
    longest_step = max(s.end_s - s.start_s for s in result.steps)
    assert all(r.load_wait_s <= longest_step for r in result.records)


def test_ondemand_with_infinite_slots_and_free_loads_equals_the_oracle() -> None:
    """With a slot per adapter and free loads, loading on first use costs nothing: the oracle's records
    (the oracle run with the same admission rule: see the next test for why)."""
    free = dataclasses.replace(H200, load_fixed_ms=0.0, h2d_gbps=math.inf, disk_fixed_ms=0.0, disk_gbps=math.inf)
    infinite = dataclasses.replace(SMALL, slots=len(workload().adapters))
    ondemand = simulate(infinite, BENCH_POLICIES["ondemand"], workload(), free, check=True)
    oracle = simulate(SMALL, dataclasses.replace(BENCH_POLICIES["oracle"], admission="ondemand"), workload(), H200)
    assert ondemand.records == oracle.records
    assert 0 < ondemand.totals()["loads"] <= len(workload().adapters) * SMALL.replicas
    assert ondemand.totals()["evictions"] == 0


def test_overlap_admits_a_resident_arrival_as_soon_as_ondemand() -> None:
    """Engines report every READY adapter, not only the previous round's pinned ones, so a request that
    arrives during a step with its adapter resident is admitted the next round under overlap too: the
    oracle (overlap admission, everything resident) is the floor of ondemand with everything resident."""
    requests = [Request(0, "adapter-000", 16, 40, 0.0), Request(1, "adapter-001", 16, 2, 0.1)]
    wl = Workload(WorkloadSpec(requests=2), [f"adapter-{i:03d}" for i in range(8)], requests, 0)
    one = dataclasses.replace(SMALL, replicas=1)
    oracle = BENCH_POLICIES["oracle"]
    overlap = simulate(one, oracle, wl, EXACT).records[1]  # no readiness exchange, which only overlap has
    ondemand = simulate(one, dataclasses.replace(oracle, admission="ondemand"), wl, EXACT).records[1]
    assert overlap.prefill_s == pytest.approx(ondemand.prefill_s)
    assert overlap.load_wait_s == 0.0


def test_pipelined_joins_copies_to_the_next_batch_and_no_step_waits_on_a_chunk() -> None:
    """Issue 31: under ``pipelined`` a request whose adapter's copy is issued (LOADING) runs in the batch about
    to start, beside running requests or ready ones, not only in rounds that would run nothing; and no step
    ends later than its own compute for a chunk (a copy lands before the step's last layer needs it), so
    what it gains costs the batch nothing."""
    steps = run("pipelined").steps
    joined = [s for s in steps if s.loading and s.held > s.loading]  # on a copy, beside other adapters
    assert joined and any(s.kind == "prefill" for s in joined), "no LOADING request joined a batch"
    assert max(s.chunk_wait_ms for s in steps) == 0.0
    assert all(s.loading == 0 for s in run("overlap").steps)  # overlap computes on whole adapters only


def _one_replica(policy: str, requests: list[Request], slots: int) -> SimResult:
    wl = Workload(WorkloadSpec(requests=len(requests)), [f"adapter-{i:03d}" for i in range(8)], requests, 0)
    config = dataclasses.replace(SMALL, replicas=1, slots=slots, max_adapters=slots)
    return simulate(config, BENCH_POLICIES[policy], wl, EXACT, check=True)


@pytest.mark.parametrize("policy", ["overlap", "pipelined"])
def test_an_arrivals_adapter_load_starts_at_arrival_not_at_the_next_round(policy: str) -> None:
    """Issue 31 item 2: a request that arrives mid-step has its adapter's load started at its arrival, not at
    the round after the step in progress (up to a whole step later)."""
    arrival = 0.2
    res = _one_replica(policy, [Request(0, "adapter-000", 16, 80, 0.0), Request(1, "adapter-001", 16, 2, 0.0),
                                Request(2, "adapter-002", 16, 2, arrival)], slots=3)
    during = [s for s in res.steps if s.start_s < arrival < s.end_s]
    assert during, "the arrival should land mid-step"
    (load,) = [ld for ld in res.loads if ld.adapter == "adapter-002"]
    assert load.start_s == pytest.approx(arrival) and load.start_s < during[0].end_s


@pytest.mark.parametrize("policy", ["overlap", "pipelined"])
def test_a_waiting_requests_ready_adapter_is_not_evicted_by_a_load_placed_after_its_arrival(policy: str) -> None:
    """Issue 31 item 2: rid 3 arrives mid-step for adapter-001, READY and idle; a load started before its
    arrival (adapter-003's, for rid 2) is placed during that step, before the round that takes rid 3. The
    arrival pins adapter-001, so that load does not evict it: rid 3 runs on it, loaded once, with no wait."""
    res = _one_replica(policy, [Request(0, "adapter-000", 16, 80, 0.0), Request(1, "adapter-001", 16, 2, 0.0),
                                Request(2, "adapter-003", 16, 2, 0.1564), Request(3, "adapter-001", 16, 2, 0.2365)],
                       slots=2)
    assert [ld.adapter for ld in res.loads].count("adapter-001") == 1
    assert res.records[3].load_wait_s == 0.0
    assert all(r.error is None and len(r.token_s) == r.output_len for r in res.records)


def test_closed_loop_keeps_exactly_n_in_flight() -> None:
    n = 6
    wl = workload(arrivals=f"inflight:{n}", requests=60, output=16)
    records = simulate(SMALL, BENCH_POLICIES["global"], wl, H200, check=True).records
    assert sum(r.arrival_s == 0.0 for r in records) == n
    last_release = max(r.arrival_s for r in records)
    for t in sorted({r.arrival_s for r in records} | {r.token_s[-1] for r in records}):
        if t < last_release:
            assert sum(r.arrival_s <= t < r.token_s[-1] for r in records) == n, t
    ends = sorted(r.token_s[-1] for r in records)[: len(records) - n]
    assert sorted(r.arrival_s for r in records)[n:] == ends, "each release is a completion"


def test_the_controller_acts_only_for_policies_that_plan() -> None:
    assert run("ondemand").controller["prefetch_commands"] == 0
    assert run("overlap").controller["prefetch_commands"] == 0
    queue, glob = run("queue").controller, run("global").controller
    assert int(queue["prefetch_commands"]) > 0 and queue["hints_received"] == 0  # type: ignore[call-overload]
    assert glob["hints_accepted"] == len(workload().requests)
    assert run("global").summary()["ready_on_arrival"] > run("overlap").summary()["ready_on_arrival"]


def test_least_loaded_routing_spreads_requests() -> None:
    result = run("ondemand")
    steps = {s.replica for s in result.steps}
    assert steps == {"replica-0", "replica-1"}
    rr = simulate(dataclasses.replace(SMALL, routing="round-robin"), BENCH_POLICIES["ondemand"], workload(), H200)
    assert len(rr.records) == len(workload().requests)


# -- calibration -------------------------------------------------------------------------------------
def test_fitting_the_simulators_own_logs_recovers_its_calibration() -> None:
    """Inclusive tiers: every host hit's copy is the copy alone (under exclusive ones most follow a write-back of
    their slot here, and the fit keeps them where fewer than two others hit the host tier)."""
    result = simulate(dataclasses.replace(SMALL, host_tiers="inclusive"), BENCH_POLICIES["ondemand"], workload(),
                      EXACT, check=True)
    fitted = fit_calibration([s.as_log() for s in result.steps], [ld.as_log() for ld in result.loads], base=EXACT)
    assert fitted.prefill_per_token_ms == pytest.approx(EXACT.prefill_per_token_ms, rel=1e-6)
    assert fitted.prefill_base_ms == pytest.approx(EXACT.prefill_base_ms, rel=1e-6)
    assert fitted.decode_per_item_ms == pytest.approx(EXACT.decode_per_item_ms, rel=1e-6)
    assert fitted.decode_base_ms == pytest.approx(EXACT.decode_base_ms, rel=1e-6)
    assert fitted.h2d_gbps == pytest.approx(EXACT.h2d_gbps, rel=1e-6)
    assert fitted.disk_gbps == pytest.approx(EXACT.disk_gbps, rel=1e-6)
    assert fitted.load_fixed_ms == pytest.approx(EXACT.load_fixed_ms, abs=0.05)
    assert not fitted.provisional and fitted.report_latency_ms == EXACT.report_latency_ms


def test_steps_beside_disk_reads_are_slower_and_the_slowdown_is_fitted_back() -> None:
    """A step runs slower per disk read in flight in its process (``*_read_slowdown``); fitting the
    simulator's own logs recovers the fractions, and none where there was none. The queue rule's logs at 12
    requests/s: 11 prefill steps start beside a read (at 6/s, 1; global, whose speculative loads need 0.5
    requests/s since 2026-11-24, loads too little to identify the fraction), and the fit, which takes the
    share of a step a read overlapped, recovers 0.61 for 0.5 (within 30%), the decode one within 20%."""
    for prefill, decode in ((0.5, 0.1), (0.0, 0.0)):
        calib = dataclasses.replace(EXACT, prefill_read_slowdown=prefill, decode_read_slowdown=decode)
        # reads that start mid-step (arrivals' loads, the controller's commands) slow the step for their overlap,
        # as the fit counts them; with only the reads at a step's start charged, the fit is 0.30-0.39 for 0.5
        config = dataclasses.replace(SMALL, mid_step_reads=True)
        result = simulate(config, BENCH_POLICIES["queue"], workload(arrivals="poisson:12"), calib, check=True)
        info: dict[str, Any] = {}
        fitted = fit_calibration([s.as_log() for s in result.steps], [ld.as_log() for ld in result.loads],
                                 base=EXACT, info=info)
        assert info["prefill"]["beside_reads"] > 0 and info["decode"]["beside_reads"] > 0
        assert fitted.prefill_read_slowdown == pytest.approx(prefill, rel=0.3, abs=1e-6)
        assert fitted.decode_read_slowdown == pytest.approx(decode, rel=0.2, abs=1e-6)
        assert fitted.prefill_base_ms == pytest.approx(EXACT.prefill_base_ms, rel=1e-6)  # from the quiet steps
    assert EXACT.step_s("prefill", 1, 100, 1, reads=2) == pytest.approx(
        EXACT.prefill_s(100, 1) * (1 + 2 * EXACT.prefill_read_slowdown))


def test_round_costs_are_charged_between_steps_and_fitted_back() -> None:
    """The engine loop's host time between steps (``round_ms``, plus ``readiness_ms`` for rules that
    prefetch) separates every two steps back to back; the sim logs it as the engine does (``gap_ms``)
    and the fit recovers it."""
    costly = dataclasses.replace(H200, round_ms=0.3, readiness_ms=0.7)
    for policy, per_round in (("ondemand", 0.3), ("overlap", 1.0)):
        slow = simulate(SMALL, BENCH_POLICIES[policy], workload(), costly, check=True)
        gaps = [s.gap_ms for s in slow.steps if s.gap_ms is not None]
        assert gaps and all(g == pytest.approx(per_round) for g in gaps), policy
        assert slow.steps[0].gap_ms is None, "the first step has no step before it"
        fitted = fit_calibration([s.as_log() for s in slow.steps], [ld.as_log() for ld in slow.loads], base=H200)
        assert fitted.round_ms == pytest.approx(0.3, rel=1e-6), policy
        assert fitted.readiness_ms == pytest.approx(0.7 if policy == "overlap" else H200.readiness_ms), policy
    older = fit_calibration([{k: v for k, v in s.as_log().items() if k not in ("gap_ms", "readiness_ms")}
                             for s in slow.steps], [ld.as_log() for ld in slow.loads], base=costly)
    assert (older.round_ms, older.readiness_ms) == (0.3, 0.7), "logs without gaps keep the base's"


def test_gaps_of_runs_logged_without_them_are_estimated_from_request_intervals() -> None:
    """``estimate_gaps``: the time a replica held a request minus its steps' time, per step; the readiness
    exchange is what a prefetching policy adds to the others' estimate."""
    from bench.sim.check import estimate_gaps

    def log(ms: float, n: int) -> list[dict[str, object]]:
        return [{"replica": "replica-0", "kind": "decode", "ms": ms} for _ in range(n)]
    requests = {p: [{"rid": 0, "arrival_s": 0.0, "finish_s": 1.0}, {"rid": 1, "arrival_s": 0.5, "finish_s": 1.2},
                    {"rid": 2, "arrival_s": 2.0, "finish_s": 2.3}] for p in ("ondemand", "overlap")}
    steps = {"ondemand": log(14.0, 100), "overlap": log(13.0, 100)}  # held 1.5 s: gaps 1.0 and 2.0 ms per step
    out = estimate_gaps(requests, steps)
    assert out["ondemand"][0]["gap_ms"] is None and out["ondemand"][1]["gap_ms"] == pytest.approx(1.0)
    assert out["overlap"][1]["gap_ms"] == pytest.approx(2.0) and out["overlap"][1]["readiness_ms"] == pytest.approx(1.0)
    assert out["ondemand"][1]["readiness_ms"] == 0.0
    measured = {p: [{**s, "gap_ms": 0.5, "readiness_ms": 0.0} for s in run] for p, run in steps.items()}
    assert estimate_gaps(requests, measured) == measured, "measured gaps are kept as they are"


def test_fit_keeps_costs_non_negative_and_needs_data() -> None:
    steps = [{"kind": k, "items": i, "tokens": 10 * i, "adapters": 1, "ms": 5.0 - 0.1 * i}
             for k in ("prefill", "decode") for i in (1, 2, 3)]
    loads = [{"nbytes": 1000, "ready_ms": 2.0, "h2d_ms": 1.0, "disk_ms": 0.0, "host_hit": True}] * 2
    fitted = fit_calibration(steps, loads, base=H200)
    assert fitted.decode_per_item_ms == 0.0 and fitted.decode_base_ms == pytest.approx(4.8)
    assert fitted.disk_gbps == H200.disk_gbps, "no host-tier miss: disk figures come from the base"
    assert fitted.h2d_gbps == pytest.approx(1000 / 1e-3 / 1e9)
    with pytest.raises(ConfigError, match="0 prefill steps"):
        fit_calibration([s for s in steps if s["kind"] == "decode"], loads)
    with pytest.raises(ConfigError, match="no loads"):
        fit_calibration(steps, [])


def test_a_run_without_loads_takes_its_load_costs_from_the_base() -> None:
    """An oracle's run (every adapter resident before its clock) logs steps and no load: its steps are fitted,
    its load costs are the base's (``bench.sim.check`` of an oracle-only run)."""
    steps = [{"kind": k, "items": i, "tokens": 10 * i, "adapters": 1, "ms": 5.0 + i}
             for k in ("prefill", "decode") for i in (1, 2, 3)]
    fitted = fit_calibration(steps, [], base=H200)
    assert fitted.decode_per_item_ms == pytest.approx(1.0) and fitted.decode_base_ms == pytest.approx(5.0)
    for name in ("h2d_gbps", "load_fixed_ms", "disk_fixed_ms", "disk_gbps", "device_gbps", "device_fixed_ms"):
        assert getattr(fitted, name) == getattr(H200, name)


def _synthetic_logs(truth: Calibration, seed: int, waited_prefills: bool = False) -> tuple[list, list]:
    """Step and load logs as the real engine writes them, from known costs: multiplicative noise of mean 1
    on every step, load waits added to some steps' ``ms`` (all prefills' with ``waited_prefills``), three
    JIT-compile stalls; loads of two shard sizes, host hits and misses, queueing on some."""
    rng = random.Random(seed)
    steps: list[dict[str, object]] = []
    for i in range(6000):
        if i % 5 == 0:
            items = rng.choice((1, 1, 1, 2, 3, 5))
            tokens = sum(rng.randint(8, 1024) for _ in range(items))
            kind, adapters, cost = "prefill", min(items, 4), truth.prefill_s(tokens, items) * 1e3
        else:
            items = rng.randint(1, 24)
            tokens, adapters = items, min(items, rng.randint(1, 4))
            kind, cost = "decode", truth.decode_s(items, adapters) * 1e3
        wait = rng.uniform(20.0, 300.0) if (kind == "prefill" and waited_prefills) or i % 13 == 0 else 0.0
        steps.append({"replica": "replica-0", "kind": kind, "items": items, "tokens": tokens, "adapters": adapters,
                      "ms": cost * rng.uniform(0.85, 1.15) + wait, "load_wait_ms": wait})
    for tokens in (143, 8, 16):  # first prefills on a fresh machine: 1.4-2.0 s of JIT compiles
        steps.append({"replica": "replica-1", "kind": "prefill", "items": 1, "tokens": tokens, "adapters": 1,
                      "ms": rng.uniform(1400.0, 2000.0), "load_wait_ms": 0.0})
    loads: list[dict[str, object]] = []
    for i in range(400):
        nbytes = (80 << 20) if i % 2 else (320 << 20)
        hit = i % 5 == 0
        h2d = truth.h2d_s(nbytes) * 1e3 * rng.uniform(0.95, 1.05)
        disk = 0.0 if hit else truth.disk_s(nbytes) * 1e3 * rng.uniform(0.8, 1.2)
        queued = rng.expovariate(0.5) if i % 3 == 0 else 0.0  # a reader, a slot or the copy stream was busy
        loads.append({"nbytes": nbytes, "ready_ms": disk + h2d + truth.load_fixed_ms + queued, "h2d_ms": h2d,
                      "disk_ms": disk, "host_hit": hit})
    return steps, loads


@pytest.mark.parametrize("waited_prefills", [False, True])
def test_fit_recovers_known_costs_through_load_waits_noise_and_stalls(waited_prefills: bool) -> None:
    """Synthetic logs from known costs: step times include load waits (subtracted, or such steps left out),
    noise (fitted for its mean) and compile stalls (dropped); the costs come back within a few %."""
    truth = dataclasses.replace(H200, prefill_base_ms=20.0, prefill_per_token_ms=0.01, prefill_per_item_ms=9.0,
                                decode_base_ms=22.0, decode_per_item_ms=0.3, decode_per_adapter_ms=0.5,
                                load_fixed_ms=0.8, h2d_gbps=55.0, disk_fixed_ms=15.0, disk_gbps=3.7)
    steps, loads = _synthetic_logs(truth, seed=1, waited_prefills=waited_prefills)
    info: dict[str, dict[str, float]] = {}
    fitted = fit_calibration(steps, loads, base=H200, info=info)
    for name in ("prefill_base_ms", "prefill_per_item_ms", "decode_base_ms", "h2d_gbps", "disk_gbps",
                 "load_fixed_ms"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.06), name
    for nbytes in (80 << 20, 320 << 20):  # reads vary +-20%: their intercept alone is loose, their costs are not
        assert fitted.disk_s(nbytes) == pytest.approx(truth.disk_s(nbytes), rel=0.03)
        assert fitted.h2d_s(nbytes) == pytest.approx(truth.h2d_s(nbytes), rel=0.02)
    for name in ("prefill_per_token_ms", "decode_per_item_ms", "decode_per_adapter_ms"):  # small terms: loosely;
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.25), name  # the costs below: 2%
    for tokens, items in ((64, 1), (1000, 1), (3000, 4)):
        assert fitted.prefill_s(tokens, items) == pytest.approx(truth.prefill_s(tokens, items), rel=0.02)
    for items, adapters in ((1, 1), (8, 4), (24, 4)):
        assert fitted.decode_s(items, adapters) == pytest.approx(truth.decode_s(items, adapters), rel=0.02)
    assert info["prefill"]["dropped"] == 3 and info["prefill"]["dropped_excess_ms"] > 3 * 1300
    assert info["decode"]["dropped"] == 0 and info["decode"]["waited_left_out"] > 0
    if waited_prefills:  # too few prefills without a wait: all of them, their waits subtracted
        assert info["prefill"]["waited_left_out"] == 0
        raw = fit_calibration([{**s, "load_wait_ms": 0.0} for s in steps], loads, base=H200)
        assert raw.prefill_s(500, 1) > 2 * truth.prefill_s(500, 1), "not subtracted, the waits would be compute"


def test_the_check_replays_each_requests_submission_lag_and_ttft_still_counts_from_its_arrival() -> None:
    """``Workload.submit_lag_s`` (``bench.sim.check`` replays a real run's router lags): a request reaches its
    replica that long after its arrival, never sooner, and its TTFT counts from the arrival, so it includes the lag.
    ``submit_lags`` reads a real run's ``submitted_s`` on the run's clock: a time before the arrival counts 0, a rid
    the workload lacks is left out, and a closed loop (no arrival times) has none."""
    from bench.sim.check import submit_lags

    base = workload()
    lags = {r.rid: 0.02 * (r.rid % 3) for r in base.requests}  # 0, 20 and 40 ms in turn
    played = simulate(SMALL, BENCH_POLICIES["queue"], dataclasses.replace(base, submit_lag_s=lags), H200, check=True)
    at = {r.rid: r.arrival_s for r in base.requests}
    assert all(rec.prefill_s is not None and rec.prefill_s >= at[rec.rid] + lags[rec.rid] - 1e-9
               and rec.arrival_s == at[rec.rid] for rec in played.records)
    plain = {rec.rid: rec.ttft_s for rec in run("queue").records}
    late = [rec.ttft_s - plain[rec.rid] for rec in played.records if lags[rec.rid] == 0.04]
    assert sum(late) / len(late) > 0.03, "a 40 ms lag is in the TTFT"
    first, second = base.requests[0], base.requests[1]
    routing = {"submitted_s": {str(first.rid): first.arrival_s + 0.005, str(second.rid): second.arrival_s - 0.001,
                               "999999": 1.0}}
    assert submit_lags(routing, base) == pytest.approx({first.rid: 0.005, second.rid: 0.0})
    assert submit_lags({}, base) == {}
    # where rank 0 logged when its feed got a request, that is the lag (the Ray call to it included)
    got = [{"rid": first.rid, "received_s": first.arrival_s + 0.007}, {"rid": second.rid, "received_s": None}]
    assert submit_lags(routing, base, got) == pytest.approx({first.rid: 0.007, second.rid: 0.0})
    assert submit_lags(routing, workload("inflight:4")) == {}


@pytest.mark.parametrize("tiers", ["inclusive", "exclusive"])
def test_sim_check_recovers_a_simulated_run_from_its_own_logs(tiers: str) -> None:
    """``bench.sim.check.compare`` on a run of the simulator itself: fitted from that run's logs, the
    simulation reproduces its TTFT; the noisy runs' band holds it; no stalls. Under exclusive tiers most host hits
    here follow a write-back of their slot and the fit leaves those copies out, so it is near, not exact: within
    0.5% (0.9% when a copy after a write-back waited for the whole copy out, not for the pieces of its range)."""
    from bench.config import BenchConfig
    from bench.figures import figures
    from bench.sim.check import NoisyCalibration, compare, step_ratios
    from bench.sim.job import run_policies

    bench = BenchConfig(engine="sim", replicas=SMALL.replicas, slots=SMALL.slots, max_adapters=SMALL.max_adapters,
                        host_tiers=tiers)
    policy = BENCH_POLICIES["ondemand"]
    (run_,) = run_policies(bench, [policy], workload(), {}, EXACT)
    out = compare(bench, [policy], workload(), {"ondemand": figures(run_)}, {"ondemand": run_.steps},
                  {"ondemand": run_.loads}, fit="per-policy", noise=2)
    entry = out["policies"]["ondemand"]
    assert out["within_15pct"] and "stalls" not in out
    for key in ("mean_ttft_ms", "p99_ttft_ms"):
        assert abs(entry[key]["error"]) < (0.01 if tiers == "inclusive" else 0.005), entry
        assert entry[key]["real_in_band"] or tiers == "exclusive", entry
    if tiers == "exclusive":
        assert any(ld["after_write_back"] for ld in run_.loads), "no copy after a write-back: the case is not run"
        return
    ratios = step_ratios(run_.steps, EXACT)
    assert ratios and all(r == pytest.approx(1.0) for r in ratios), "the sim's own steps cost exactly their fit"
    noisy = NoisyCalibration.wrap(H200, {"decode": [0.5, 2.0], "prefill": [3.0]}, seed=3)
    again = NoisyCalibration.wrap(H200, {"decode": [0.5, 2.0], "prefill": [3.0]}, seed=3)
    draws = [noisy.decode_s(4, 2) for _ in range(200)]
    assert draws == [again.decode_s(4, 2) for _ in range(200)], "seeded: deterministic"
    assert set(draws) == {0.5 * H200.decode_s(4, 2), 2.0 * H200.decode_s(4, 2)}
    assert noisy.prefill_s(100, 1) == pytest.approx(3.0 * H200.prefill_s(100, 1)), "each kind its own ratios"
    assert noisy.disk_s(1 << 20) == H200.disk_s(1 << 20), "no ratios of a kind: its fitted cost"
    slow = NoisyCalibration.wrap(H200, {"disk": [2.0], "h2d": [1.5]}, seed=0)
    assert slow.disk_s(1 << 20) == pytest.approx(2.0 * H200.disk_s(1 << 20))
    assert slow.h2d_s(1 << 20) == pytest.approx(1.5 * H200.h2d_s(1 << 20))
    assert slow.device_slowdown() == pytest.approx(2.0) and H200.device_slowdown() == 1.0  # device reads: disk's


def test_shipped_calibrations_load_and_say_what_they_are() -> None:
    cpu = load_calibration("cpu-tiny")
    assert not H200.provisional and "fitted" in H200.source and "proc/fleet2" in H200.source
    assert H200.slot_dtype == "bfloat16" and cpu.slot_dtype == "float32" and not cpu.provisional
    assert Calibration.from_dict(json.loads(H200.to_json()), "round trip") == H200
    # the two-replica H200 run's shapes (bench/RESULTS.md): a decode step of a few requests ~10 ms, a
    # 500-token prefill ~30-40 ms, a rank-64 shard (320 MiB) to the GPU in ~6 ms, from disk in ~100 ms
    assert 0.008 < H200.decode_s(2, 2) < 0.015 and 0.025 < H200.prefill_s(500, 1) < 0.045
    assert 0.004 < H200.h2d_s(320 << 20) < 0.008 and 0.05 < H200.disk_s(320 << 20) < 0.15


def test_bad_calibrations_and_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cpu-tiny"):
        load_calibration("no-such-machine")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "decode_ms": 3}))
    with pytest.raises(ConfigError, match="unknown fields"):
        load_calibration(str(bad))
    with pytest.raises(ConfigError, match="decode_base_ms is -1"):
        Calibration(decode_base_ms=-1)
    with pytest.raises(ConfigError, match="h2d_gbps is 0"):
        Calibration(h2d_gbps=0)
    with pytest.raises(ConfigError, match="max_adapters"):
        SimConfig(slots=2, max_adapters=4)
    with pytest.raises(ConfigError, match="routing"):
        SimConfig(routing="random")
    with pytest.raises(ConfigError, match="rank"):
        SimConfig(adapter_ranks="16,x")
    with pytest.raises(ConfigError, match="host_bytes"):
        simulate(dataclasses.replace(SMALL, host_bytes=1 << 20), BENCH_POLICIES["ondemand"], workload(), H200)
    unknown = BenchPolicy("x", planner="lru", admission="overlap", hints=False)
    with pytest.raises(ConfigError, match="policy 'lru'"):
        simulate(SMALL, unknown, workload(), H200)


@settings(max_examples=25, deadline=None)
# Found by CI's draw when the router's lead fell to 0.05 s: one slot, pinned, and a host tier of two shards;
# the engine's prefetch of a held-back adapter was refused for room and its WAIT round re-ran at the same
# instant forever. A rank with nothing loading for its held-back adapters now polls.
@example(policy="global", tp=1, slots=1, replicas=3, arrivals="poisson:40", popularity="distinct", host_shards=2,
         seed=395, tiers="inclusive")
@given(policy=st.sampled_from(list(BENCH_POLICIES)), tp=st.sampled_from([1, 2]), slots=st.integers(1, 4),
       replicas=st.integers(1, 3), arrivals=st.sampled_from(["poisson:4", "poisson:40", "inflight:3"]),
       popularity=st.sampled_from(["uniform", "zipf:1.5", "bursty:2,3", "distinct"]),
       host_shards=st.sampled_from([2, 100]), seed=st.integers(0, 1000),
       tiers=st.sampled_from(["inclusive", "exclusive"]))
def test_any_small_fleet_finishes_every_request_with_its_books_balanced(
        policy: str, tp: int, slots: int, replicas: int, arrivals: str, popularity: str, host_shards: int,
        seed: int, tiers: str) -> None:
    """Every request leaves (served, or failed with an error when its load found no room), nothing stalls,
    and the slot tables, host tiers and controller stay consistent (``check``) whatever the fleet. (A host
    tier of two shards is less than some fleets' loads in flight: a load that finds no host room waits for
    one of them, as the real one does.)"""
    config = SimConfig(replicas=replicas, tp=tp, slots=slots, max_adapters=min(slots, 2), max_running=4,
                       host_bytes=host_shards * (320 << 20), host_tiers=tiers)
    spec = WorkloadSpec(arrivals=arrivals, popularity=popularity, requests=24, random_input_len=64,
                        random_output_len=6, workload_seed=seed)
    wl = make_workload(spec, spec.adapter_names(slots))
    result = simulate(config, BENCH_POLICIES[policy], wl, H200, check=True)
    assert len(result.records) == 24
    for r in result.records:
        assert r.ok or (r.error is not None and not r.token_s), r
    if host_shards == 100:
        assert all(r.ok for r in result.records), "with room in the host tier, no load fails"


def test_a_loop_stuck_at_one_instant_is_an_error_not_a_hang() -> None:
    from bench.sim.events import Loop, SimulationStuck

    loop = Loop(max_same_instant=1000)

    def again() -> None:
        loop.at(loop.now, again)

    loop.at(0.5, again)
    with pytest.raises(SimulationStuck, match=r"at t=0\.500000 s without time moving on"):
        loop.run(lambda: False)


@pytest.mark.parametrize("h2d_gbps", [2.0, 8.0])
def test_pipelined_admits_a_copy_only_if_it_lands_before_the_layer_that_needs_it(h2d_gbps: float) -> None:
    """Issue 31 item 2: on a card whose copies are slower than its steps (the h2d link at 2 or 8 GB/s: an
    adapter's copy takes 10-170 ms against a 9-40 ms step), ``pipelined`` admits a LOADING request only where
    its copy, at the measured copy times, lands before the step's last layer (``CopyClock``): no step ends later
    than its own compute for a chunk. Before, every issued copy was admitted, and steps waited on chunks (26 and
    66 steps, up to 17 and 172 ms)."""
    slow = dataclasses.replace(H200, h2d_gbps=h2d_gbps)
    res = simulate(SMALL, BENCH_POLICIES["pipelined"], workload(), slow, check=True)
    waited = [s for s in res.steps if s.chunk_wait_ms > 0]
    assert not waited, (f"{len(waited)} steps waited on a chunk, up to {max(s.chunk_wait_ms for s in waited):.1f} "
                        "ms: a copy admitted as LOADING landed after the layer that needed it")
    assert res.records and all(r.error is None for r in res.records)


def test_the_warming_gate_reaches_the_simulated_planner() -> None:
    """``SimConfig.warm_min_miss_s`` is the planner's: on page-cache reads (H200: a rank-64 shard in ~80 ms) the
    default gate (0.15 s) never opens, so no warm stage is sent; 0 warms from the start, as real runs made before
    the gate did (``bench.sim.check.run_warm_gate``)."""
    gated = simulate(SMALL, BENCH_POLICIES["global"], workload(), H200, check=True)
    always = simulate(dataclasses.replace(SMALL, warm_min_miss_s=0.0), BENCH_POLICIES["global"], workload(), H200,
                      check=True)
    assert int(always.controller["stage_commands"]) > int(gated.controller["stage_commands"])  # type: ignore[call-overload]


def test_the_check_replays_the_warming_gate_the_real_run_had() -> None:
    from bench.sim.check import WARM_GATE_SINCE, run_warm_gate
    from lora_cache.planner import PlannerConfig

    def doc(started: str, real: dict[str, Any]) -> dict[str, Any]:
        return {"config": {"started": started, "real": real}}

    assert run_warm_gate(doc("2026-11-29 10:00:00", {"warm_min_miss_s": 0.4})) == 0.4  # recorded: as recorded
    assert run_warm_gate(doc("2026-11-28 15:44:39", {})) == 0.0  # before the gate existed: warmed from the start
    assert WARM_GATE_SINCE > "2026-11-28 15:44:39"
    assert run_warm_gate(doc("2026-11-28 19:00:00", {})) == PlannerConfig.warm_min_miss_s  # unrecorded: the default


def test_global_ranks_the_fleet_for_its_host_tiers_and_a_baselines_popular_tier_is_lru() -> None:
    """Where a miss hurts (the device store; warming on from the start), ``global`` sends its workers the fleet's
    ranking and its host tiers evict by it; ``queue`` sends none, so its ``popular`` tiers keep the LRU's order: every
    figure of its run is the LRU run's (invariant: no ranking, no change)."""
    device = dataclasses.replace(SMALL, store="device", warm_min_miss_s=0.0, host_bytes=1 << 30)  # a few shards
    popular = dataclasses.replace(device, host_eviction="popular")
    ranked = simulate(popular, BENCH_POLICIES["global"], workload(), H200, check=True)
    assert int(ranked.controller["ranking_commands"]) > 0  # type: ignore[call-overload]
    assert ranked.totals()["host_rankings"] > 0  # taken by the tiers' order, counted as WorkerCache.stats() does
    lru = simulate(device, BENCH_POLICIES["queue"], workload(), H200, check=True)
    same = simulate(popular, BENCH_POLICIES["queue"], workload(), H200, check=True)
    assert same.controller["ranking_commands"] == 0
    assert same.summary() == lru.summary() and same.totals() == lru.totals() and lru.totals()["host_rankings"] == 0
