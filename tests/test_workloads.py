"""The benchmark's workloads (bench/workloads.py): distributions, traces, determinism, errors."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.workloads import WorkloadSpec, make_workload, read_trace
from lora_cache.errors import ConfigError
from lora_cache.runtime.cliargs import add_config_args, config_from_args

NAMES = [f"adapter-{i:03d}" for i in range(64)]


def draw(**kw: object):
    spec = WorkloadSpec(**kw)  # type: ignore[arg-type]
    return make_workload(spec, NAMES)


def test_zipf_head_share_matches_the_distribution() -> None:
    wl = draw(popularity="zipf:1.5", requests=20_000)
    counts = Counter(r.adapter for r in wl.requests)
    weights = [1 / (i + 1) ** 1.5 for i in range(len(NAMES))]
    for i in (0, 1, 2):
        expected = weights[i] / sum(weights)
        assert counts[NAMES[i]] / 20_000 == pytest.approx(expected, abs=0.015), f"rank {i} share"
    top8 = sum(counts[n] for n in NAMES[:8]) / 20_000
    assert top8 == pytest.approx(sum(weights[:8]) / sum(weights), abs=0.02)
    assert wl.describe()["top_adapter_share"] == pytest.approx(weights[0] / sum(weights), abs=0.015)


def test_zipf_default_exponent_is_1_5() -> None:
    assert WorkloadSpec(popularity="zipf").parsed_popularity().alpha == 1.5


def test_shifting_zipf_ranks_each_phase_anew_and_its_first_phase_is_plain_zipf() -> None:
    """zipf:1.5,4: four equal phases; the first is zipf:1.5's own draw (same seed, same requests), each later
    one ranks the adapters afresh, so the hot adapter changes and the share of the top one stays Zipf's."""
    n, phases = 8000, 4
    shifting = draw(popularity=f"zipf:1.5,{phases}", requests=n).requests
    assert WorkloadSpec(popularity="zipf:1.5,4").parsed_popularity().rankings == 4
    weights = [1 / (i + 1) ** 1.5 for i in range(len(NAMES))]
    tops = []
    for k in range(phases):
        counts = Counter(r.adapter for r in shifting[k * n // phases:(k + 1) * n // phases])
        top, hits = counts.most_common(1)[0]
        assert hits / (n // phases) == pytest.approx(weights[0] / sum(weights), abs=0.03), f"phase {k}"
        tops.append(top)
    assert tops[0] == NAMES[0] and len(set(tops)) == phases, f"the hot adapter did not move: {tops}"
    plain = draw(popularity="zipf:1.5", requests=n // phases).requests
    assert [r.adapter for r in plain] == [r.adapter for r in shifting[: n // phases]]


def test_uniform_spreads_evenly() -> None:
    counts = Counter(r.adapter for r in draw(popularity="uniform", requests=12_800).requests)
    assert set(counts) == set(NAMES)
    assert max(counts.values()) < 1.5 * min(counts.values())


def test_bursty_phases_are_disjoint_and_in_order() -> None:
    wl = draw(popularity="bursty:10,20,20", requests=300)
    phases = [wl.requests[:100], wl.requests[100:200], wl.requests[200:]]
    expected = [set(NAMES[:10]), set(NAMES[10:30]), set(NAMES[30:50])]
    for requests, allowed in zip(phases, expected):
        used = {r.adapter for r in requests}
        assert used <= allowed
        assert len(used) >= len(allowed) // 2, "a phase uses its adapters, not one of them"
    assert WorkloadSpec(popularity="bursty").parsed_popularity().phases == (10, 20, 20)


def test_bursty_splits_unequal_counts_evenly_in_order() -> None:
    wl = draw(popularity="bursty:2,3", requests=7)
    phase = [0 if r.adapter in NAMES[:2] else 1 for r in wl.requests]
    assert phase == sorted(phase) and phase.count(0) in (3, 4)


def test_distinct_gives_every_request_its_own_adapter() -> None:
    wl = draw(popularity="distinct", requests=64)
    assert len({r.adapter for r in wl.requests}) == 64
    with pytest.raises(ConfigError, match="needs an adapter per request"):
        draw(popularity="distinct", requests=65)


def test_lengths_follow_bench_serving_random() -> None:
    wl = draw(requests=2000, random_input_len=100, random_output_len=10, random_range_ratio=0.5)
    assert {r.input_len for r in wl.requests} == set(range(50, 101))
    assert {r.output_len for r in wl.requests} == set(range(5, 11))
    exact = draw(requests=50, random_input_len=7, random_output_len=3, random_range_ratio=1.0)
    assert {(r.input_len, r.output_len) for r in exact.requests} == {(7, 3)}
    floor = draw(requests=500, random_output_len=3, random_range_ratio=0.0)
    assert {r.output_len for r in floor.requests} == {1, 2, 3}, "never a zero-length request"


def test_poisson_arrivals_have_the_rate() -> None:
    wl = draw(arrivals="poisson:50", requests=5000)
    times = [r.arrival_s for r in wl.requests]
    assert times[0] == 0.0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(50, rel=0.05)
    assert wl.inflight == 0


def test_inflight_is_a_closed_loop() -> None:
    wl = draw(arrivals="inflight:8", requests=40)
    assert wl.inflight == 8 and {r.arrival_s for r in wl.requests} == {0.0}


def test_same_seed_same_requests_and_aspects_are_independent() -> None:
    a, b = draw(requests=300, workload_seed=3), draw(requests=300, workload_seed=3)
    assert a.requests == b.requests
    assert a.requests != draw(requests=300, workload_seed=4).requests
    uniform = draw(requests=300, workload_seed=3, popularity="uniform")
    same = [(r.arrival_s, r.input_len, r.output_len) for r in a.requests]
    assert same == [(r.arrival_s, r.input_len, r.output_len) for r in uniform.requests], \
        "changing the popularity keeps the arrival times and lengths (paired comparisons)"


def test_adapter_names_are_four_per_slot_and_outnumber_slots() -> None:
    assert WorkloadSpec().adapter_names(8) == [f"adapter-{i:03d}" for i in range(32)]
    names = WorkloadSpec(adapters_per_slot=2.5).adapter_names(500)
    assert len(names) == 1250 and names == sorted(names), "zero-padded: name order is index order"
    assert len(WorkloadSpec(popularity="bursty").adapter_names(4)) == 50, "raised to what the phases use"
    assert len(WorkloadSpec(popularity="distinct", requests=100).adapter_names(4)) == 100
    assert len(WorkloadSpec(num_adapters=10).adapter_names(4)) == 10
    with pytest.raises(ConfigError, match="more adapters than slots"):
        WorkloadSpec(num_adapters=8).adapter_names(8)


def write_trace(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


GOOD = [{"time": 0.0, "adapter": "adapter-001", "input_len": 5, "output_len": 2},
        {"time": 0.5, "adapter": None, "input_len": 7, "output_len": 1, "extra": "ignored"},
        {"time": 0.5, "adapter": "adapter-003", "input_len": 9, "output_len": 4}]


def test_a_trace_replays_exactly(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [GOOD[0], "", *GOOD[1:]])
    spec = WorkloadSpec(arrivals="trace", popularity=f"trace:{path}", requests=0)
    assert spec.adapter_names(1) == ["adapter-001", "adapter-003"]
    wl = make_workload(spec, spec.adapter_names(1))
    assert [(r.rid, r.adapter, r.input_len, r.output_len, r.arrival_s) for r in wl.requests] == [
        (0, "adapter-001", 5, 2, 0.0), (1, None, 7, 1, 0.5), (2, "adapter-003", 9, 4, 0.5)]
    first_two = WorkloadSpec(arrivals="trace", popularity=f"trace:{path}", requests=2)
    assert len(make_workload(first_two, NAMES).requests) == 2
    retimed = make_workload(WorkloadSpec(arrivals="poisson:10", popularity=f"trace:{path}", requests=0), NAMES)
    assert [r.adapter for r in retimed.requests] == [r.adapter for r in wl.requests]
    assert retimed.requests[2].arrival_s != 0.5


@pytest.mark.parametrize(("line", "words"), [
    ("{not json", ["line 2", "not valid JSON", "one object per line"]),
    ("[1, 2]", ["line 2", "expected a JSON object"]),
    ({"time": 1.0, "adapter": "adapter-001", "input_len": 5}, ["line 2", "missing output_len"]),
    ({"time": -1, "adapter": "a", "input_len": 5, "output_len": 1}, ["line 2", "time is -1", ">= 0"]),
    ({"time": True, "adapter": "a", "input_len": 5, "output_len": 1}, ["line 2", "time is True"]),
    ({"time": 0.0, "adapter": "a", "input_len": 5, "output_len": 1}, ["line 2", "earlier than the line before",
                                                                      "sort the trace"]),
    ({"time": 2.0, "adapter": "", "input_len": 5, "output_len": 1}, ["line 2", "adapter is ''", "null"]),
    ({"time": 2.0, "adapter": "a", "input_len": 0, "output_len": 1}, ["line 2", "input_len is 0", ">= 1"]),
    ({"time": 2.0, "adapter": "a", "input_len": 5, "output_len": 2.5}, ["line 2", "output_len is 2.5",
                                                                        "whole number"]),
])
def test_bad_trace_lines_name_the_line_field_and_fix(tmp_path: Path, line: object, words: list[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", [{"time": 1.0, "adapter": "a", "input_len": 3, "output_len": 1}, line])
    with pytest.raises(ConfigError) as e:
        read_trace(str(path))
    for word in words:
        assert word in str(e.value)


def test_trace_errors_for_files_adapters_and_counts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        read_trace(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="holds no requests"):
        read_trace(str(write_trace(tmp_path / "empty.jsonl", [""])))
    path = write_trace(tmp_path / "t.jsonl", GOOD)
    with pytest.raises(ConfigError, match=r"request 3: adapter 'adapter-003' is not registered"):
        make_workload(WorkloadSpec(popularity=f"trace:{path}", requests=0), ["adapter-001"])
    with pytest.raises(ConfigError, match="has 3 lines; pass --requests 3"):
        make_workload(WorkloadSpec(popularity=f"trace:{path}", requests=4), NAMES)


@pytest.mark.parametrize(("kw", "words"), [
    ({"arrivals": "poisson"}, ["arrivals 'poisson'", "not a number", "poisson:8"]),
    ({"arrivals": "poisson:0"}, ["must be > 0"]),
    ({"arrivals": "inflight:x"}, ["not a whole number", "inflight:32"]),
    ({"arrivals": "inflight:0"}, ["at least 1"]),
    ({"arrivals": "burst"}, ["not one of", "poisson:RATE"]),
    ({"arrivals": "trace"}, ["times come from a trace file"]),
    ({"popularity": "zipf:-1"}, ["exponent must be > 0"]),
    ({"popularity": "zipf:1.5,0"}, ["at least 1 phase", "zipf:1.5,4"]),
    ({"popularity": "zipf:1.5,x"}, ["not a whole number", "zipf:1.5,4"]),
    ({"popularity": "pareto"}, ["not one of", "zipf:ALPHA"]),
    ({"popularity": "bursty:5"}, ["at least two phases"]),
    ({"popularity": "bursty:5,x"}, ["not a whole number"]),
    ({"popularity": "trace:"}, ["not one of"]),
    ({"requests": 0}, ["requests is 0", "only for a trace"]),
    ({"random_input_len": 0}, ["random_input_len is 0"]),
    ({"random_range_ratio": 1.5}, ["in [0, 1]"]),
    ({"adapters_per_slot": 1.0}, ["ratio > 1", "more adapters than GPU slots"]),
    ({"popularity": "distinct", "num_adapters": 5, "requests": 6}, ["adapter per request"]),
    ({"popularity": "bursty:4,4", "num_adapters": 5}, ["uses 8 adapters"]),
])
def test_bad_specs_name_field_value_and_fix(kw: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        WorkloadSpec(**kw)  # type: ignore[arg-type]
    for word in words:
        assert word in str(e.value)


def test_the_cli_is_generated_from_the_spec() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, WorkloadSpec)
    ns = parser.parse_args(["--arrivals", "inflight:4", "--popularity", "bursty:3,3", "--random-range-ratio", "0.5"])
    assert config_from_args(WorkloadSpec, ns) == WorkloadSpec(arrivals="inflight:4", popularity="bursty:3,3",
                                                              random_range_ratio=0.5)


@settings(max_examples=60, deadline=None)
@given(popularity=st.sampled_from(["uniform", "zipf:0.8", "zipf:2", "zipf:1.2,3", "bursty:3,5,7", "distinct"]),
       arrivals=st.sampled_from(["poisson:3", "poisson:1000", "inflight:5"]),
       requests=st.integers(1, 60), top=st.integers(1, 300), ratio=st.floats(0, 1), seed=st.integers(0, 10**6))
def test_any_spec_draws_valid_reproducible_requests(popularity: str, arrivals: str, requests: int, top: int,
                                                     ratio: float, seed: int) -> None:
    spec = WorkloadSpec(arrivals=arrivals, popularity=popularity, requests=requests, random_input_len=top,
                        random_output_len=top, random_range_ratio=ratio, workload_seed=seed)
    names = spec.adapter_names(slots=4)
    wl = make_workload(spec, names)
    assert wl == make_workload(spec, names)
    assert [r.rid for r in wl.requests] == list(range(requests))
    assert all(r.adapter in names for r in wl.requests)
    low = max(1, int(top * ratio))
    assert all(low <= r.input_len <= top and low <= r.output_len <= top for r in wl.requests)
    times = [r.arrival_s for r in wl.requests]
    assert times == sorted(times) and times[0] == 0.0 and all(math.isfinite(t) for t in times)
    assert (wl.inflight > 0) == arrivals.startswith("inflight")
    json.dumps(wl.describe())
