"""The reference engine on the CPU (tiny shape): serving, TP 1 = TP 2, LoRA math, admission rules, config.

The TP runs are shared by module fixtures (spawning ranks costs seconds); each test asserts invariants
of the records: every token counted and after arrival, bounds per step, outputs equal across TP sizes
and equal to an explicit torch computation of base + LoRA.
"""

from __future__ import annotations

import gc
import json
import math
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import AdapterSpec, peft_key
from lora_cache.adapters.shapes import SHAPES
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.errors import ConfigError
from tests.waiting import wait_for
from workers.engine import (
    ADMISSION,
    EngineConfig,
    EngineResult,
    Readiness,
    Request,
    RequestRecord,
    WorkloadConfig,
    make_requests,
    register_admission,
    run_engine,
)
from workers.engine.__main__ import main
from workers.engine.admission import CopyClock, Overlap
from workers.engine.catalog import load_catalog
from workers.engine.feed import Feed
from workers.engine.model import final_norm_weight, full_weights, prompt_states
from workers.engine.rank import RankEngine
from workers.engine.scheduler import DECODE, PREFILL, WAIT, Scheduler, StepPlan
from workers.engine.tp import Comm
from workers.staging import tier_reads
from workers.staging.host_config import HostTierConfig

TINY = SHAPES["tiny"]
FULL = [f"adapter-{i:03d}" for i in range(4)]
PARTIAL = "partial-000"  # adapts only q_proj, v_proj and down_proj


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine-adapters")
    make_adapters(root, SynthConfig(model="tiny", count=len(FULL), rank="8,16"))
    make_adapters(root, SynthConfig(model="tiny", count=1, rank="4", targets="q_proj,v_proj,down_proj",
                                    prefix="partial", seed=7))
    return root


def engine_config(adapters: Path, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(adapters=str(adapters), model="tiny", device="cpu", num_slots=3, max_adapters=2,
                                max_running=4, max_prefill_tokens=24, max_seq_len=32, record_outputs=True,
                                host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False))
    return EngineConfig(**(base | kw))


# more adapters than slots, a base-model request, staggered arrivals, odd lengths
REQUESTS = [Request(rid, adapter, 3 + rid % 5, 1 + rid % 4, 0.002 * rid)
            for rid, adapter in enumerate([*FULL, PARTIAL, None, FULL[0], FULL[3], PARTIAL, FULL[1], FULL[2]])]


@pytest.fixture(scope="module")
def tp1_ondemand(adapters: Path) -> EngineResult:
    return run_engine(engine_config(adapters, admission="ondemand"), REQUESTS)


@pytest.fixture(scope="module")
def tp2_overlap(adapters: Path) -> EngineResult:
    return run_engine(engine_config(adapters, tp=2, admission="overlap"), REQUESTS)


def check_served(result: EngineResult, config: EngineConfig, requests: list[Request], outputs: bool = True) -> None:
    """Every request completed with one timestamp per output token, after its arrival; bounds per step."""
    assert [r.rid for r in result.records] == sorted(q.rid for q in requests)
    for r, q in zip(result.records, sorted(requests)):
        assert r.ok, r
        assert (r.adapter, r.input_len, r.output_len, r.arrival_s) == (q.adapter, q.input_len, q.output_len,
                                                                       q.arrival_s)
        assert len(r.token_s) == q.output_len
        assert r.prefill_s is not None and q.arrival_s <= r.prefill_s < r.token_s[0]
        assert all(a < b for a, b in zip(r.token_s, r.token_s[1:])), "one token per step, steps in order"
        if outputs:
            assert r.outputs is not None and r.outputs.shape == (q.output_len, TINY.hidden_size)
    steps: dict[float, list[RequestRecord]] = defaultdict(list)  # a step's tokens share its end time
    for r in result.records:
        for t in r.token_s:
            steps[t].append(r)
    for batch in steps.values():
        assert len(batch) <= config.max_running
        assert len({r.adapter for r in batch if r.adapter}) <= config.max_adapters
    summary = result.summary()
    assert summary["completed"] == len(requests) and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(q.output_len for q in requests)
    assert 0 < summary["mean_ttft_ms"] <= summary["mean_e2el_ms"]
    assert len(result.ranks) == config.tp
    assert len({(s.steps, s.prefill_steps) for s in result.ranks}) == 1, "every rank ran the same steps"
    for s in result.ranks:
        assert s.cache["slots_loading"] == 0 and s.cache["load_failures"] == 0


def test_tp1_serves_a_stream_with_timings(adapters: Path, tp1_ondemand: EngineResult) -> None:
    check_served(tp1_ondemand, engine_config(adapters), REQUESTS)
    assert tp1_ondemand.ranks[0].cache["evictions"] > 0  # 5 adapters through 3 slots


def test_tp2_serves_a_stream_with_timings(adapters: Path, tp2_overlap: EngineResult) -> None:
    check_served(tp2_overlap, engine_config(adapters, tp=2), REQUESTS)
    assert all(s.cache["evictions"] > 0 for s in tp2_overlap.ranks)


def test_tp2_outputs_equal_tp1(tp1_ondemand: EngineResult, tp2_overlap: EngineResult) -> None:
    """Column/row-parallel shards of weights and adapters plus the all-reduce compute the TP 1 model."""
    for one, two in zip(tp1_ondemand.records, tp2_overlap.records):
        assert one.outputs is not None and two.outputs is not None
        torch.testing.assert_close(two.outputs, one.outputs, rtol=1e-4, atol=1e-4)


def test_a_paged_pool_computes_what_slots_do(adapters: Path, tp1_ondemand: EngineResult) -> None:
    """Issue 43: the engine on a pool of rank-16 pages (ranks 4, 8 and 16 in one page each, two adapters of the max
    rank's bytes in all) serves the stream with the outputs of slots of the max rank, request by request; a pool
    too small for a batch's max_adapters of the max rank is refused before serving, naming the fix."""
    config = engine_config(adapters, admission="ondemand", page_rank=16, pool_pages=8)
    paged = run_engine(config, REQUESTS)
    check_served(paged, config, REQUESTS)
    for one, two in zip(tp1_ondemand.records, paged.records, strict=True):
        assert one.outputs is not None and two.outputs is not None
        torch.testing.assert_close(two.outputs, one.outputs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"pool_pages 7 cannot hold a batch's max_adapters \(2\) adapters of rank "
                                          r"64 \(4 pages each\): give pool_pages >= 8"):
        run_engine(engine_config(adapters, page_rank=16, pool_pages=7), REQUESTS)


# -- the LoRA math against an explicit computation ------------------------------------------------------
def lora_weights(spec: AdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(layer, module) -> (A, B, scaling) straight from the adapter file."""
    with safe_open(str(spec.weights), framework="pt") as f:
        return {(m.layer, m.module): (f.get_tensor(peft_key(m.layer, m.module, "A")).float(),
                                      f.get_tensor(peft_key(m.layer, m.module, "B")).float(), m.scaling)
                for m in spec.modules}


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, hd] at positions 0..n-1: pairs (i, i + hd/2) rotated by position * theta^(-2i/hd)."""
    n, hd = x.shape[0], x.shape[-1]
    angle = torch.arange(n, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, hd, 2) / hd)[None]
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
    lo, hi = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], -1)


def reference_outputs(config: EngineConfig, request: Request, catalog: AdapterCatalog,
                      device: str = "cpu") -> torch.Tensor:
    """Generate by recomputing the whole sequence each token (no KV cache): base + scale * x A^T B^T.

    ``device``: where the engine drew its random weights and prompts (the math runs on the CPU).
    """
    lora = lora_weights(catalog.get(request.adapter)) if request.adapter else {}
    drawn = torch.device(device)
    layers = [{k: v.cpu() for k, v in full_weights(TINY, config.seed, i, drawn).items()}
              for i in range(config.layers)]
    hd, group = TINY.head_dim, TINY.num_heads // TINY.num_kv_heads

    def proj(h: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        y = h @ layers[layer][module].T
        if (layer, module) in lora:
            a, b, scale = lora[(layer, module)]
            y = y + scale * (h @ a.T) @ b.T
        return y

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w

    def forward(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        for i, w in enumerate(layers):
            h = norm(x, w["in_norm"])
            q = rope(proj(h, i, "q_proj").view(n, -1, hd), config.rope_theta)
            k = rope(proj(h, i, "k_proj").view(n, -1, hd), config.rope_theta).repeat_interleave(group, 1)
            v = proj(h, i, "v_proj").view(n, -1, hd).repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
            x = x + proj(attn, i, "o_proj")
            h = norm(x, w["post_norm"])
            x = x + proj(F.silu(proj(h, i, "gate_proj")) * proj(h, i, "up_proj"), i, "down_proj")
        return norm(x[-1], final_norm_weight(TINY, config.seed, drawn).cpu())

    seq = prompt_states(config.seed, request.rid, request.input_len, TINY.hidden_size, drawn).cpu()
    outs = []
    for _ in range(request.output_len):
        outs.append(forward(seq))
        seq = torch.cat([seq, outs[-1][None]])  # the next input is the last output, as in the engine
    return torch.stack(outs)


@pytest.mark.parametrize("rid", [0, 4, 5, 9])  # full adapter (rank 8), partial adapter (rank 4), none, rank 16
def test_outputs_equal_explicit_base_plus_lora(adapters: Path, tp1_ondemand: EngineResult, rid: int) -> None:
    config, catalog = engine_config(adapters), load_catalog(engine_config(adapters))
    got = tp1_ondemand.records[rid].outputs
    assert got is not None
    torch.testing.assert_close(got, reference_outputs(config, REQUESTS[rid], catalog), rtol=1e-4, atol=1e-4)


def test_adapter_changes_the_output(adapters: Path, tp1_ondemand: EngineResult) -> None:
    config, catalog = engine_config(adapters), load_catalog(engine_config(adapters))
    for rid in (0, 4):
        base = reference_outputs(config, REQUESTS[rid]._replace(adapter=None), catalog)
        got = tp1_ondemand.records[rid].outputs
        assert got is not None and (got - base).abs().max() > 1e-2, "the LoRA delta must reach the output"


# -- admission rules --------------------------------------------------------------------------------------
def test_ondemand_runs_cold_adapters_in_blocked_steps(tp1_ondemand: EngineResult) -> None:
    assert tp1_ondemand.ranks[0].unready_items > 0  # the first steps load their adapters on demand
    assert any(r.load_wait_s > 0 for r in tp1_ondemand.records)


def test_pipelined_steps_on_chunked_loads_compute_what_ondemand_does(adapters: Path,
                                                                   tp1_ondemand: EngineResult) -> None:
    """Invariant 1 under ``pipelined``: each layer waits only on its chunk (a chunk per layer here), and every
    token equals the one computed on whole adapters."""
    config = engine_config(adapters, admission="pipelined", chunk_bytes=0)
    result = run_engine(config, REQUESTS)
    check_served(result, config, REQUESTS)
    for got, want in zip(result.records, tp1_ondemand.records, strict=True):
        assert got.outputs is not None and want.outputs is not None
        # 1e-4: pipelined batches requests on loads in flight with ready ones, so batches (and sum orders)
        # differ
        torch.testing.assert_close(got.outputs, want.outputs, rtol=1e-4, atol=1e-4)


def test_overlap_never_runs_a_request_before_its_adapter_is_ready(tp2_overlap: EngineResult) -> None:
    assert [s.unready_items for s in tp2_overlap.ranks] == [0, 0]
    assert any(r.load_wait_s > 0 for r in tp2_overlap.records), "cold adapters held their requests back"


def test_step_logs_time_the_host_work_between_steps(tp1_ondemand: EngineResult, tp2_overlap: EngineResult) -> None:
    """Each step logs the loop's host time since the previous step (``gap_ms``, what the simulator charges
    as ``round_ms``), the readiness exchange's share of it (every rule exchanges: the ranks agree on each
    adapter's version, workers/attach/versions.py), and its wall-clock start (to line steps up with the
    loads beside them), and how long the garbage collector stopped it."""
    for result, exchanges in ((tp1_ondemand, True), (tp2_overlap, True)):
        for stats in result.ranks:
            log = stats.step_log
            assert log[0].gap_ms is None, "no step before the first"
            gaps = [s for s in log if s.gap_ms is not None]
            assert gaps, "back-to-back steps were run"
            for s in gaps:
                assert s.gap_ms >= 0 and 0 <= s.readiness_ms <= s.gap_ms + 1e-9
                assert (s.readiness_ms > 0) == exchanges
            starts = [s.wall_s for s in log]
            assert starts == sorted(starts), "start times (the loads' clock) in step order"
            assert all(0 <= s.gc_ms <= s.ms for s in log), "a step's collector stall is part of its time"
            assert sum(s.gc_ms for s in log) <= stats.gc["gc_total_ms"] + 1e-9 and stats.gc["gc_collections"] > 0


def test_the_heap_is_frozen_while_serving_and_thawed_after(adapters: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No full collection walks the built engine mid-run (lora_cache/runtime/heap.py), and nothing stays frozen."""
    frozen: list[int] = []
    plan = Scheduler.plan

    def recording(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        frozen.append(gc.get_freeze_count())
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "plan", recording)
    run_engine(engine_config(adapters, admission="ondemand"), REQUESTS[:3])
    assert frozen and min(frozen) > 1000
    assert gc.get_freeze_count() == 0


def test_overlap_serves_ready_adapters_while_one_loads(adapters: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow adapter's read is held until every other request has finished: overlap must get there."""
    slow, others_done = FULL[3], threading.Event()
    requests = [Request(0, slow, 4, 2, 0.0)] + [Request(i, FULL[i % 3], 3, 3, 0.0) for i in range(1, 6)]
    read = tier_reads.read_shard

    def gated_read(spec: AdapterSpec, *args: Any) -> int:
        if spec.name == slow:
            assert others_done.wait(timeout=30), "the other requests never finished while the slow load waited"
        return read(spec, *args)

    finish_step = Scheduler.finish_step

    def watch(self: Scheduler, *args: Any, **kw: Any) -> None:
        finish_step(self, *args, **kw)
        if all(len(self.live[i].token_s) == 3 for i in range(1, 6)):
            others_done.set()

    monkeypatch.setattr(tier_reads, "read_shard", gated_read)
    monkeypatch.setattr(Scheduler, "finish_step", watch)
    result = run_engine(engine_config(adapters, admission="overlap", max_adapters=3), requests)
    check_served(result, engine_config(adapters, max_adapters=3), requests)
    first = result.records[0]
    assert first.prefill_s is not None and first.prefill_s > max(r.token_s[-1] for r in result.records[1:])
    assert first.load_wait_s > 0 and result.ranks[0].unready_items == 0


class FakeRule(Overlap):
    name = "test-base-first"

    def admits(self, request: Request, ready: Readiness) -> bool:
        return request.adapter is None


def test_scheduler_plans_follow_the_rule_and_bounds(adapters: Path) -> None:
    config = engine_config(adapters, max_running=2, max_adapters=1)
    requests = [Request(0, FULL[0], 4, 2), Request(1, FULL[1], 4, 2), Request(2, FULL[0], 4, 1),
                Request(3, None, 4, 1, arrival_s=1.0)]
    s = Scheduler(config, Overlap(), requests)
    plan = s.plan(0.0, {})  # nothing ready: prefetch both, wait for either (or the next arrival)
    assert (plan.kind, plan.wait_for, plan.prefetch, plan.timeout_s) == (WAIT, (FULL[0], FULL[1]),
                                                                         (FULL[0], FULL[1]), 1.0)
    plan = s.plan(0.5, {FULL[0]: Readiness.READY, FULL[1]: Readiness.READY})
    assert plan.kind == PREFILL and [it.rid for it in plan.items] == [0, 2]  # one adapter, two rows
    s.finish_step(plan, 0.6, 0.0)
    plan = s.plan(0.7, {FULL[0]: Readiness.READY, FULL[1]: Readiness.READY})
    assert plan.kind == DECODE and [(it.rid, it.start) for it in plan.items] == [(0, 4)]
    assert s.records()[0].load_wait_s == pytest.approx(0.5)
    s = Scheduler(config, FakeRule(), requests)
    assert s.plan(0.0, {}).kind == WAIT and s.plan(1.0, {}).items[0].rid == 3
    s = Scheduler(engine_config(adapters, max_running=4), ADMISSION["ondemand"](), requests)
    plan = s.plan(2.0, {})  # ondemand admits cold adapters; one adapter's prompts side by side (one segment)
    assert [(it.rid, it.adapter) for it in plan.items] == [(0, FULL[0]), (2, FULL[0]), (1, FULL[1]), (3, None)]
    assert plan.prefetch == plan.wanted == () and sorted(plan.hold) == sorted(FULL[:2])


def test_pipelined_runs_loading_requests_in_the_next_batch_never_reading_ones(adapters: Path) -> None:
    """Issue 31: a request whose adapter's copy is issued on every rank (LOADING) joins the batch about to run,
    ready requests' or one that would otherwise be the running requests' decode; one whose load has not
    started or is still reading (NOT_READY) never does: no batch waits on a read."""
    config = engine_config(adapters, max_running=4, max_adapters=3)
    requests = [Request(0, FULL[0], 4, 2), Request(1, FULL[1], 4, 2), Request(2, FULL[2], 4, 2, arrival_s=0.15)]
    s = Scheduler(config, ADMISSION["pipelined"](), requests)
    plan = s.plan(0.0, {FULL[1]: Readiness.READY})  # rid 0 still reading: rid 1 runs alone; rid 0's load starts
    assert plan.kind == PREFILL and [it.rid for it in plan.items] == [1] and FULL[0] in plan.prefetch
    s.finish_step(plan, 0.1, 0.0)
    plan = s.plan(0.2, {FULL[1]: Readiness.READY, FULL[0]: Readiness.LOADING, FULL[2]: Readiness.NOT_READY})
    # rid 0's copy is issued: it runs now, layer by layer on its chunks, rather than after rid 1's decode;
    # rid 2's load is still reading: it waits (and its load is asked for)
    assert plan.kind == PREFILL and [it.rid for it in plan.items] == [0] and FULL[2] in plan.prefetch
    assert set(plan.hold) == {FULL[0], FULL[1]}
    s.finish_step(plan, 0.3, 0.0)
    plan = s.plan(0.4, {FULL[1]: Readiness.READY, FULL[0]: Readiness.READY, FULL[2]: Readiness.LOADING})
    assert plan.kind == PREFILL and [it.rid for it in plan.items] == [2]  # joins with rid 0 and 1 running
    ready_and_loading = Scheduler(config, ADMISSION["pipelined"](), requests[:2])
    plan = ready_and_loading.plan(0.0, {FULL[0]: Readiness.LOADING, FULL[1]: Readiness.READY})
    assert plan.kind == PREFILL and sorted(it.rid for it in plan.items) == [0, 1]  # one batch, one step
    overlap = Scheduler(config, Overlap(), requests[:1])
    assert overlap.plan(0.0, {FULL[0]: Readiness.LOADING}).kind == WAIT  # overlap waits for the whole load


def test_an_arrival_pins_its_ready_adapter_and_starts_its_load_at_once(adapters: Path) -> None:
    """Issue 31 item 2: a request submitted while the loop is busy has its adapter pinned (READY) or its load
    started at once, from the feed's thread, not at the next round: a load placed before that round cannot
    evict a waiting request's READY adapter, and a cold one loads with no round run. The pins go once the
    round that took the requests holds its own; closing leaves the cache's books balanced."""
    engine = RankEngine(engine_config(adapters, admission="overlap", num_slots=2), Comm())
    refs = lambda name: next((r["refs"] for r in engine.cache.residency() if r["adapter"] == name), None)  # noqa: E731
    try:
        for name in (FULL[0], FULL[2]):
            engine.cache.prefetch(name).result(timeout=30)
        feed = Feed()
        feed.watch(engine.arrivals.arrived)
        feed.submit([Request(0, FULL[0], 3, 1)])
        assert refs(FULL[0]) == 1  # pinned by the submit itself
        engine.cache.prefetch(PARTIAL).result(timeout=30)  # a load placed meanwhile evicts the other one
        assert FULL[0] in engine.cache.ready_names() and FULL[2] not in engine.cache.ready_names()
        feed.submit([Request(1, FULL[1], 3, 1)])  # cold: its load starts now, with no round
        wait_for(lambda: FULL[1] in engine.cache.ready_names(), "the arrival's load to finish with no round run")
        assert FULL[0] in engine.cache.ready_names()
        engine.arrivals.taken()  # the loop takes them; its next round's pins take over
        engine.execute(StepPlan(WAIT, timeout_s=0.0))
        assert refs(FULL[0]) == 0
        feed.watch(None)
    finally:
        engine.close()


def test_pipelined_reports_loading_only_for_copies_that_land_before_a_steps_last_layer(adapters: Path) -> None:
    """Issue 31 item 2: a rank times its own copies (each finished load's bytes and its events' time) and its
    steps' compute (``CopyClock``); a copy issued there is reported LOADING only where it is predicted to land
    (behind the copies issued before it on the stream) before the shortest recent step reaches its last layer.
    Before anything is measured nothing is LOADING: the request waits for READY, as under overlap."""
    config = engine_config(adapters, admission="pipelined")
    engine = RankEngine(config, Comm())
    clock = engine.clock
    try:
        now = time.perf_counter()
        assert clock.layers == config.layers and clock.in_time({FULL[0]: (1, now)}, now) == set()  # none measured
        s = Scheduler(config, ADMISSION["pipelined"](), [Request(0, FULL[0], 4, 2)])
        plan = s.plan(0.0, {})
        assert plan.kind == WAIT and plan.prefetch == (FULL[0],)
        engine.execute(plan)  # starts the load (its record may be completed by the loader thread a moment later)
        # the rounds after: the finished copy is timed by the first round that sees its record done
        wait_for(lambda: engine.readiness(plan.wanted) is not None and clock.copy_s(1) is not None,
                 "the finished copy timed by a readiness round")
        record = engine.cache.prefetch(FULL[0]).result(timeout=30)
        assert clock.copy_s(record.nbytes) == pytest.approx(record.h2d_ms / 1e3) and clock.budget_s() is None
        assert clock.in_time({FULL[0]: (record.nbytes, now)}, now) == set()  # a copy measured, no step yet
        plan = s.plan(0.1, {FULL[0]: Readiness.READY})
        assert plan.kind == PREFILL
        result = engine.execute(plan)
        assert result is not None
        budget = clock.budget_s()
        assert budget == pytest.approx((result.end_s - result.start_s) * (config.layers - 1) / config.layers)
        per_byte = clock.copy_s(record.nbytes) / record.nbytes  # one size measured: time in proportion to bytes
        fits, late = int(budget * 0.9 / per_byte), int(budget * 1.1 / per_byte) + 1
        now = time.perf_counter()
        assert clock.in_time({FULL[0]: (fits, now)}, now) == {FULL[0]}
        assert clock.in_time({FULL[0]: (late, now)}, now) == set()
        assert clock.in_time({FULL[0]: (late, now - budget)}, now) == {FULL[0]}  # most of it copied already
        # one stream: the second copy starts when the first ends
        assert clock.in_time({FULL[0]: (fits // 2, now), FULL[1]: (fits // 2, now + 1e-9)}, now) == {FULL[0], FULL[1]}
        assert clock.in_time({FULL[0]: (fits, now), FULL[1]: (fits, now + 1e-9)}, now) == {FULL[0]}
    finally:
        engine.close()


def test_a_registered_rule_is_selectable(adapters: Path) -> None:
    register_admission(FakeRule)
    try:
        assert engine_config(adapters, admission="test-base-first").admission == "test-base-first"
        with pytest.raises(ValueError, match="already registered"):
            register_admission(type("Other", (Overlap,), {"name": "test-base-first"}))
    finally:
        del ADMISSION["test-base-first"]


# -- configuration and request errors ---------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "words"), [
    ({"tp": 3}, ["tp (3) must divide", "num_heads (4)"]),
    ({"max_adapters": 4, "num_slots": 3}, ["max_adapters (4)", "num_slots (3)", "lower max_adapters"]),
    ({"admission": "eager"}, ["admission 'eager'", "ondemand", "overlap"]),
    ({"num_layers": 5}, ["num_layers (5)", "0..2"]),
    ({"dtype": "int8"}, ["dtype", "'int8'"]),
    ({"max_running": 0}, ["max_running must be >= 1", "got 0"]),
    ({"max_seq_len": 1}, ["max_seq_len must be >= 2"]),
    ({"model": "gpt-9"}, ["unknown model 'gpt-9'"]),
    ({"device": "cuda:1"}, ["rank k runs on cuda:k"]),
    ({"device": "tpu"}, ["device must be cpu, cuda or auto", "'tpu'"]),
])
def test_bad_config_names_field_value_and_fix(adapters: Path, kw: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        engine_config(adapters, **kw)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(("request_", "words"), [
    (Request(0, "nope", 4, 2), ["request 0", "'nope'", "not registered"]),
    (Request(0, FULL[0], 30, 4), ["input_len + output_len (34)", "max_seq_len (32)"]),
    (Request(0, FULL[0], 25, 1), ["input_len (25)", "max_prefill_tokens (24)"]),
    (Request(0, FULL[0], 0, 1), ["input_len and output_len must be >= 1"]),
])
def test_bad_requests_are_refused_before_serving(adapters: Path, request_: Request, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        run_engine(engine_config(adapters), [request_])
    for word in words:
        assert word in str(info.value)


def test_missing_adapters_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no adapter directories"):
        run_engine(engine_config(tmp_path), [Request(0, None, 2, 1)])
    with pytest.raises(ConfigError, match="pass --adapters DIR"):
        run_engine(EngineConfig(model="tiny", device="cpu"), [Request(0, None, 2, 1)])


def test_workload_is_reproducible_and_valid() -> None:
    config = WorkloadConfig(requests=50, rate=100.0, input_len=20, output_len=8, len_jitter=0.5,
                            popularity="zipf", base_fraction=0.1)
    requests = make_requests(config, FULL)
    assert requests == make_requests(config, FULL)
    assert all(10 <= r.input_len <= 20 and 4 <= r.output_len <= 8 for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    counts = [sum(r.adapter == a for r in requests) for a in FULL]
    assert counts[0] > counts[-1], "Zipf: the first adapter is the most popular"
    with pytest.raises(ConfigError, match="popularity must be uniform or zipf"):
        WorkloadConfig(popularity="pareto")


def test_cli_serves_and_prints_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "records.jsonl"
    argv = ["--adapters", str(tmp_path / "ad"), "--make-adapters", "3", "--model", "tiny", "--device", "cpu",
            "--requests", "6", "--input-len", "5", "--output-len", "3", "--num-slots", "2", "--max-adapters", "2",
            "--host-bytes", str(1 << 20), "--no-pin", "--admission", "overlap", "--json", "--records", str(records)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 18
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [len(r["token_s"]) for r in lines] == [3] * 6
    assert main(["--adapters", str(tmp_path / "none"), "--model", "tiny", "--device", "cpu"]) == 2
    assert "error: " in capsys.readouterr().err


# -- GPU ---------------------------------------------------------------------------------------------------
def gpu_config(adapters: Path, **kw: Any) -> EngineConfig:
    return engine_config(adapters, **({"device": "cuda", "dtype": "bfloat16",
                                       "host": HostTierConfig(host_bytes=16 << 20)} | kw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("admission", ["ondemand", "overlap", "pipelined"])
def test_gpu_tp1_serves_a_stream(adapters: Path, admission: str) -> None:
    config = gpu_config(adapters, admission=admission)
    result = run_engine(config, REQUESTS)
    check_served(result, config, REQUESTS)
    if admission == "overlap":
        assert result.ranks[0].unready_items == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_outputs_equal_explicit_base_plus_lora(adapters: Path) -> None:
    """The Triton kernels inside the engine: fp32 (TF32 dots) against the CPU reference."""
    config = gpu_config(adapters, dtype="float32")
    result = run_engine(config, REQUESTS)
    catalog = load_catalog(config)
    for rid in (0, 4, 5, 9):
        got = result.records[rid].outputs
        assert got is not None
        want = reference_outputs(config, REQUESTS[rid], catalog, device="cuda")
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_graphs_equal_eager_steps(adapters: Path) -> None:
    """Replayed decode graphs (padded batches, bucketed KV lengths, refilled LoRA metadata) compute what
    the eager steps compute, token for token; and every decode bucket was captured before the clock."""
    eager = run_engine(gpu_config(adapters, dtype="float32", cuda_graphs=False), REQUESTS)
    config = gpu_config(adapters, dtype="float32", graph_kv_block=16)
    graphs = run_engine(config, REQUESTS)
    check_served(graphs, config, REQUESTS)
    for a, b in zip(eager.records, graphs.records):
        assert a.outputs is not None and b.outputs is not None
        torch.testing.assert_close(b.outputs, a.outputs, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_tp2_equals_tp1(adapters: Path) -> None:
    one = run_engine(gpu_config(adapters, dtype="float32"), REQUESTS)
    config = gpu_config(adapters, dtype="float32", tp=2, admission="overlap")
    two = run_engine(config, REQUESTS)
    check_served(two, config, REQUESTS)
    assert [s.unready_items for s in two.ranks] == [0, 0]
    for a, b in zip(one.records, two.records):
        assert a.outputs is not None and b.outputs is not None
        torch.testing.assert_close(b.outputs, a.outputs, rtol=2e-2, atol=2e-2)  # TF32 dots, NCCL sum order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_real_shape_serves(tmp_path: Path, tp: int) -> None:
    """Llama-3.1-8B sizes (two layers run; slots hold all 32), bf16, more adapters than slots."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    make_adapters(tmp_path, SynthConfig(model="llama-3.1-8b", count=4, rank="8,16"))
    config = EngineConfig(adapters=str(tmp_path), model="llama-3.1-8b", num_layers=2, tp=tp, device="cuda",
                          num_slots=3, max_rank=16, max_adapters=2, max_running=8, max_seq_len=256,
                          admission="overlap", host=HostTierConfig(host_bytes=512 << 20))
    requests = make_requests(WorkloadConfig(requests=12, rate=200.0, input_len=96, output_len=8, len_jitter=0.5),
                             [f"adapter-{i:03d}" for i in range(4)])
    result = run_engine(config, requests)
    check_served(result, config, requests, outputs=False)



def test_copy_clock_predicts_from_the_slowest_fit_and_the_stream_order() -> None:
    """``CopyClock``: copies of two sizes fit ``fixed + bytes * per_byte``, moved up so no copy measured took
    longer than predicted; copies in flight land one after another in the order issued, after the last one seen
    landing."""
    clock = CopyClock(layers=4)
    for nbytes, seconds in ((1000, 0.002), (4000, 0.005), (1000, 0.0025)):
        clock.copied(nbytes, seconds, -1.0)
    fixed = clock.copy_s(0)
    assert fixed is not None and all(clock.copy_s(n) >= t - 1e-12 for n, t in ((1000, 0.0025), (4000, 0.005)))
    clock.stepped(0.012)
    clock.stepped(0.008)  # the shortest: 6 ms to its last layer
    assert clock.budget_s() == pytest.approx(0.006)
    four = clock.copy_s(4000)
    assert four is not None and four < 0.006
    assert clock.in_time({"a": (4000, 0.0)}, 0.0) == {"a"}
    assert clock.in_time({"a": (4000, 0.0), "b": (4000, 0.0001)}, 0.0) == {"a"}  # b queues behind a
    # exclusive tiers: a copy into a slot being written back lands after that copy out (the third value) and its own
    assert clock.in_time({"a": (1000, 0.0, 0)}, 0.0) == {"a"}
    assert clock.in_time({"a": (1000, 0.0, 4000)}, 0.0) == set()  # 4000 out then 1000 in: past the 6 ms budget
    assert clock.in_time({"a": (1000, 0.0, 1000)}, 0.0) == ({"a"} if 2 * clock.copy_s(1000) <= 0.006 else set())
    clock.copied(0, 0.0, 0.004)  # a copy seen landing at 4 ms: one issued before it started on the stream then
    assert clock.in_time({"a": (4000, -0.001)}, 0.0) == set()
    with pytest.raises(ValueError, match="layers is 0"):
        CopyClock(layers=0)


def test_requests_given_at_start_may_name_a_version(adapters: Path, tp1_ondemand: EngineResult) -> None:
    """Issue 44 item 3: a request list given at start may name one version (``A@VERSION``), as a streaming submit may:
    it runs at exactly that version, with the outputs of the same request naming the adapter alone (its one kept
    version); a version not kept is refused before anything runs, naming the request and what is kept."""
    config = engine_config(adapters, admission="ondemand")
    version = load_catalog(config).get(FULL[0]).version
    named = [r._replace(adapter=f"{FULL[0]}@{version}") if r.adapter == FULL[0] else r for r in REQUESTS]
    result = run_engine(config, named)
    for rid, r in enumerate(named):
        rec = result.records[rid]
        assert rec.ok and rec.adapter == r.adapter, rec
        if r.adapter == f"{FULL[0]}@{version}":
            assert rec.version == version
            torch.testing.assert_close(rec.outputs, tp1_ondemand.records[rid].outputs, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match=r"request 0: adapter 'adapter-000' has no version or pushed tag 'nope' kept"):
        run_engine(config, [REQUESTS[0]._replace(adapter=f"{FULL[0]}@nope")])
