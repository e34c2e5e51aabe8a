"""bench/bound.py: the floors no online policy beats, checked against every holding of small fleets by brute force,
and on a simulated run's own results file."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.bound import for_results, main, online_floor, probabilities, shard_bytes
from lora_cache.errors import ConfigError


def test_one_holding_by_hand() -> None:
    """Two adapters of 100 bytes, a host tier of 100: the likelier one is held, the other's requests all wait."""
    prob, nbytes, wait = {"a": 0.75, "b": 0.25}, {"a": 100, "b": 100}, {"a": 1.0, "b": 1.0}
    bound = online_floor(prob, nbytes, wait, slots=0, host_bytes=100)
    assert bound.missed == pytest.approx(0.25) and bound.stall_ms == pytest.approx(250.0)
    assert bound.tail_ms == pytest.approx(1000.0)  # 25% of requests wait 1 s: the p99 does
    assert online_floor(prob, nbytes, wait, 0, 100, quantile=0.7).tail_ms == 0.0  # 25% < 30%: the p70 need not
    half = online_floor(prob, nbytes, wait, slots=0, host_bytes=150)  # fractional: half of b's bytes
    assert half.missed == pytest.approx(0.125)
    assert online_floor(prob, nbytes, wait, slots=1, host_bytes=100).missed == pytest.approx(0.0)  # a slot holds one


def _feasible(names: tuple[str, ...], nbytes: dict[str, int], slots: int, host: int) -> bool:
    """A holding fits: the slots take its largest shards (one each), the host tiers the rest."""
    sizes = sorted((nbytes[n] for n in names), reverse=True)
    return sum(sizes[slots:]) <= host


instances = st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n),
    st.lists(st.integers(1, 50), min_size=n, max_size=n),
    st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n),
    st.integers(0, 3), st.integers(0, 120), st.sampled_from([0.5, 0.9, 0.99])))


@given(instances)
def test_no_holding_that_fits_beats_the_floors(instance: tuple) -> None:
    """Every holding that fits (brute force) misses at least ``missed``, stalls at least ``stall_ms`` per request,
    and leaves more than 1 - quantile of the requests waiting at least ``tail_ms``."""
    weights, sizes, waits, slots, host, q = instance
    names = [f"a{i}" for i in range(len(weights))]
    total = sum(weights)
    prob = {n: w / total for n, w in zip(names, weights)}
    nbytes, wait = dict(zip(names, sizes)), dict(zip(names, waits))
    bound = online_floor(prob, nbytes, wait, slots, host, q)
    for k in range(len(names) + 1):
        for held in itertools.combinations(names, k):
            if not _feasible(held, nbytes, slots, host):
                continue
            out = [n for n in names if n not in held]
            assert sum(prob[n] for n in out) >= bound.missed - 1e-9
            assert sum(prob[n] * wait[n] for n in out) * 1e3 >= bound.stall_ms - 1e-6
            if bound.tail_ms > 0:
                assert sum(prob[n] for n in out if wait[n] * 1e3 >= bound.tail_ms - 1e-9) > 1 - q - 1e-9


@given(instances, st.integers(1, 100))
def test_more_host_bytes_never_raise_a_floor(instance: tuple, more: int) -> None:
    weights, sizes, waits, slots, host, q = instance
    names = [f"a{i}" for i in range(len(weights))]
    prob = {n: w / sum(weights) for n, w in zip(names, weights)}
    nbytes, wait = dict(zip(names, sizes)), dict(zip(names, waits))
    small, large = (online_floor(prob, nbytes, wait, slots, h, q) for h in (host, host + more))
    assert large.missed <= small.missed + 1e-12 and large.stall_ms <= small.stall_ms + 1e-9
    assert large.tail_ms <= small.tail_ms


def test_probabilities_follow_the_benchmarks_draws() -> None:
    names = [f"adapter-{i:03d}" for i in range(4)]
    zipf = probabilities("zipf:1.5", names)
    assert sum(zipf.values()) == pytest.approx(1.0) and list(zipf.values()) == sorted(zipf.values(), reverse=True)
    assert zipf["adapter-000"] / zipf["adapter-001"] == pytest.approx(2 ** 1.5)
    assert probabilities("zipf:1.5,3", names) == zipf  # each phase ranks anew, with the same weights
    assert set(probabilities("uniform", names).values()) == {0.25}


@pytest.mark.parametrize("popularity", ["bursty", "distinct"])
def test_a_popularity_without_fixed_probabilities_is_refused_by_name(popularity: str) -> None:
    with pytest.raises(ConfigError, match=f"popularity '{popularity}'.*zipf or uniform"):
        probabilities(popularity, ["adapter-000", "adapter-001"])


def test_bad_inputs_are_refused() -> None:
    one = ({"a": 1.0}, {"a": 10}, {"a": 1.0})
    with pytest.raises(ConfigError, match=r"quantile is 1\.0"):
        online_floor(*one, slots=0, host_bytes=0, quantile=1.0)
    with pytest.raises(ConfigError, match="shard size"):
        online_floor({"a": 1.0}, {"a": 0}, {"a": 1.0}, 0, 0)


def test_a_simulated_runs_results_give_its_floors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a real results file: the shard sizes the floor assumes are the ones the run loaded, and the run's own
    load wait is above its floor (no policy but the oracle gets under it)."""
    from bench.run import main as bench

    out = tmp_path / "run"
    assert bench(["--engine", "sim", "--model", "llama-3.1-8b", "--adapter-ranks", "16,64", "--scenario", "zipf",
                  "--num-adapters", "20", "--requests", "120", "--no-plots", "--replicas", "2", "--tp", "1",
                  "--arrivals", "poisson:8", "--store", "device", "--host-bytes", str(1 << 30),
                  "--policies", "queue", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    names = [f"adapter-{i:03d}" for i in range(20)]
    sizes = shard_bytes("llama-3.1-8b", [16, 64], names, 1)
    assert all(sizes[ld["adapter"]] == ld["nbytes"] for ld in doc["loads"]["queue"])
    bound = for_results(doc)
    assert 0 < bound.missed < 1 and doc["figures"]["queue"]["mean_load_wait_ms"] >= bound.stall_ms
    assert doc["floor"]["missed"] == pytest.approx(bound.missed) and "floor for any online policy" in doc["table"]
    assert main([str(out / "results.json")]) == 0
    assert str(out / "results.json") in capsys.readouterr().out
    doc["loads"] = {"queue": []}  # nothing read: no read time known
    with pytest.raises(ConfigError, match="--read-gbps"):
        for_results(doc)
    assert for_results(doc, read_gbps=1.2).missed == pytest.approx(bound.missed)
    doc["config"]["bench"]["num_layers"] = 2  # a cut model: its shards are not the whole model's
    with pytest.raises(ConfigError, match="--num-layers"):
        for_results(doc, read_gbps=1.2)
    doc["config"]["bench"]["num_layers"] = 0
    doc["config"]["bench"]["host_bytes"] = 0  # auto-sized: its bytes are not in the results
    with pytest.raises(ConfigError, match="--host-bytes N"):
        for_results(doc, read_gbps=1.2)
