"""The benchmark's plain parts on the CPU: policy registry, scenarios and options, figures, goals, outputs."""

from __future__ import annotations

import json

import pytest

from bench.figures import PolicyRun, figures, gaps, goals, timeline
from bench.policies import BENCH_POLICIES, parse_policies
from bench.probes.stalls import main as stalls_main
from bench.probes.stalls import stalls
from bench.report import main as report_main
from bench.report import read_results, write, write_results
from bench.run import build_parser, configs
from lora_cache.errors import ConfigError
from workers.engine.timings import RequestRecord


def _record(rid: int, arrival: float, first: float, tokens: int = 3, wait: float = 0.0) -> RequestRecord:
    token_s = tuple(first + 0.01 * i for i in range(tokens))
    return RequestRecord(rid, f"a{rid % 2}", 8, tokens, arrival, arrival, token_s, wait)


def _run(policy: str = "global") -> PolicyRun:
    records = [_record(i, 0.1 * i, 0.1 * i + 0.02 * (i + 1), wait=0.005 * (i % 2)) for i in range(10)]
    ranks = [{"replica": "replica-0", "rank": 0, "host_hits": 3, "host_misses": 1, "prefetch_used": 2,
              "prefetch_unused": 1, "loads": 2, "bytes_host_to_gpu": 300, "bytes_disk_to_host": 100}]
    loads = [{"t_s": 0.05, "nbytes": 100, "ready_ms": 2.0}, {"t_s": 0.5, "nbytes": 200, "ready_ms": 4.0}]
    return PolicyRun(policy, "sim", records, ranks, loads)


def test_policy_registry_and_parsing() -> None:
    assert [p.name for p in parse_policies("all")] == ["ondemand", "overlap", "queue", "global", "oracle", "pipelined"]
    assert [p.name for p in parse_policies("global, ondemand")] == ["global", "ondemand"]
    assert BENCH_POLICIES["oracle"].oracle and BENCH_POLICIES["global"].hints
    for bad, word in (("", "none given"), ("fifo", "not registered"), ("global,global", "twice")):
        with pytest.raises(ConfigError, match=word):
            parse_policies(bad)


def test_figures_follow_their_definitions() -> None:
    f = figures(_run())
    assert f["completed"] == 10 and f["failed"] == 0
    assert f["gpu_hit_rate"] == pytest.approx(0.5)  # half the requests waited on a load
    assert f["host_hit_rate"] == pytest.approx(0.75)
    assert f["prefetch_accuracy"] == pytest.approx(2 / 3)
    assert f["median_time_to_ready_ms"] == pytest.approx(3.0)
    assert f["mean_load_wait_ms"] == pytest.approx(2.5)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert f[f"median_{m}_ms"] <= f[f"p90_{m}_ms"] <= f[f"p99_{m}_ms"]
    no_prefetch = _run()
    no_prefetch.ranks[0].update(prefetch_used=0, prefetch_unused=0)
    assert figures(no_prefetch)["prefetch_accuracy"] is None
    line = timeline(_run(), bins=4)
    assert sum(line["bytes_host_to_gpu"]) == 300 and len(line["t_s"]) == 4


def test_goals_compare_against_the_named_references() -> None:
    by = {"ondemand": {"mean_ttft_ms": 100.0, "p99_ttft_ms": 1000.0}, "global": {"mean_ttft_ms": 30.0,
          "p99_ttft_ms": 150.0}, "oracle": {"mean_ttft_ms": 20.0, "p99_ttft_ms": 140.0},
          "queue": {"mean_ttft_ms": 60.0, "p99_ttft_ms": 200.0}}
    checked = {g["goal"]: g for g in goals(by, "zipf:1.5")}
    assert checked["global mean TTFT <= 0.40x ondemand"]["ratio"] == pytest.approx(0.3)
    assert checked["global p99 TTFT <= 0.20x ondemand"]["met"]
    assert checked["global p99 TTFT <= 1.15x oracle"]["ratio"] == pytest.approx(150 / 140)
    assert checked["global p99 TTFT <= 0.8x queue"]["met"]
    assert not any("0.8x queue" in g["goal"] for g in goals(by, "uniform"))  # that goal is for bursty and zipf
    assert any("0.75x queue" in g["goal"] for g in goals(by, "uniform"))  # issue 20's: every workload


def test_gap_shares_run_from_the_baseline_to_the_oracle() -> None:
    """(baseline - policy) / (baseline - oracle): 1 at the oracle, 0 at the baseline, negative when worse;
    no share for the oracle itself, for a baseline against itself, or for a gap the oracle does not open."""
    by = {"ondemand": {"mean_ttft_ms": 100.0, "p99_ttft_ms": 1000.0}, "global": {"mean_ttft_ms": 30.0,
          "p99_ttft_ms": 150.0}, "oracle": {"mean_ttft_ms": 20.0, "p99_ttft_ms": 140.0},
          "queue": {"mean_ttft_ms": 60.0, "p99_ttft_ms": 200.0}, "worse": {"mean_ttft_ms": 80.0, "p99_ttft_ms": 260.0}}
    shares = gaps(by)
    assert "oracle" not in shares
    assert shares["global"]["adapter_gap_closed_mean"] == pytest.approx(70 / 80)
    assert shares["global"]["adapter_gap_closed_p99"] == pytest.approx(850 / 860)
    assert shares["global"]["queue_gap_closed_mean"] == pytest.approx(30 / 40)
    assert shares["global"]["queue_gap_closed_p99"] == pytest.approx(50 / 60)
    assert shares["queue"] == {"adapter_gap_closed_mean": pytest.approx(0.5),
                               "adapter_gap_closed_p99": pytest.approx(800 / 860)}
    assert shares["ondemand"]["queue_gap_closed_mean"] == pytest.approx(-1.0)
    assert shares["worse"]["queue_gap_closed_p99"] == pytest.approx(-1.0)
    by["oracle"]["p99_ttft_ms"] = 1000.0  # the oracle no better than ondemand on p99: no adapter-gap p99 share
    assert "adapter_gap_closed_p99" not in gaps(by)["global"]
    assert gaps({k: v for k, v in by.items() if k != "oracle"}) == {}


def test_scenarios_fill_only_unset_options() -> None:
    bench, spec = configs(build_parser().parse_args(["--scenario", "seed", "--slots", "4"]))
    assert bench.slots == 4 and spec.num_adapters == 16 and spec.arrivals == "poisson:4"
    bench, spec = configs(build_parser().parse_args(["--quick"]))
    assert bench.scenario == "quick" and bench.model == "tiny" and spec.popularity == "zipf:1.5"
    with pytest.raises(ConfigError, match="scenario 'nope'"):
        configs(build_parser().parse_args(["--scenario", "nope"]))
    with pytest.raises(ConfigError, match="engine"):
        configs(build_parser().parse_args(["--engine", "gpu"]))


def test_write_and_redraw(tmp_path, capsys) -> None:
    doc = write(tmp_path, {"workload": {"popularity": "zipf:1.5"}, "title": "t"}, [_run("ondemand"), _run("global")])
    assert json.loads((tmp_path / "results.json").read_text())["figures"]["global"]["completed"] == 10
    assert "| global |" in doc["table"] and "0.40x ondemand" in doc["table"]
    (tmp_path / "ttft_cdf.png").unlink()
    assert report_main([str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "ttft_cdf.png").exists() and "| ondemand |" in capsys.readouterr().out


def test_runs_of_one_configuration_merge_and_others_are_refused(tmp_path, capsys) -> None:
    """Parts of one run configuration that each ran some policies (say, across device calls) merge into
    one document with its goals recomputed; a policy given twice, or another configuration, is refused."""
    config = {"workload": {"popularity": "zipf:1.5", "requests": 10}, "bench": {"slots": 8, "out": "a"},
              "policies": [], "title": "t"}
    parts = []
    for name, runs in (("a", [_run("ondemand")]), ("b", [_run("global"), _run("oracle")])):
        write(tmp_path / name, {**config, "bench": {"slots": 8, "out": name}}, runs, plots=False)
        parts.append(str(tmp_path / name / "results.json"))
    out = tmp_path / "merged" / "results.json"
    out.parent.mkdir()
    assert report_main([*parts, "--merge", str(out), "--no-plots"]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["figures"]) == ["ondemand", "global", "oracle"] and doc["config"]["merged_from"] == parts
    assert {g["goal"] for g in doc["goals"]} >= {"global mean TTFT <= 0.40x ondemand",
                                                 "global p99 TTFT <= 1.15x oracle"}
    assert set(doc["steps"]) == set(doc["requests"]) == set(doc["figures"])
    assert report_main([parts[0], parts[0], "--merge", str(out)]) == 2
    assert "in more than one part" in capsys.readouterr().err
    write(tmp_path / "c", {**config, "bench": {"slots": 4, "out": "c"}}, [_run("queue")], plots=False)
    assert report_main([parts[0], str(tmp_path / "c" / "results.json"), "--merge", str(out)]) == 2
    err = capsys.readouterr().err
    assert "another configuration" in err and "slots" in err, err
    assert report_main(parts) == 2, "several results without --merge"


def test_results_are_read_plain_or_gzipped_and_bad_files_are_named(tmp_path, capsys) -> None:
    doc = write(tmp_path, {"workload": {"popularity": "zipf:1.5"}, "title": "t"}, [_run("ondemand")], plots=False)
    write_results(tmp_path / "results.json.gz", doc)
    assert read_results(tmp_path / "results.json.gz") == read_results(tmp_path / "results.json")
    assert report_main([str(tmp_path / "results.json.gz"), "--no-plots"]) == 0
    assert "ondemand" in capsys.readouterr().out
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    for bad in ("bad.json.gz", "missing.json"):
        with pytest.raises(ConfigError, match=bad):
            read_results(tmp_path / bad)


def test_stalls_find_the_wait_before_a_load_the_slow_prefill_and_the_collector(tmp_path, capsys) -> None:
    def prefill(tokens: int, ms: float, **kw) -> dict:
        return {"kind": "prefill", "tokens": tokens, "ms": ms, "load_wait_ms": 0.0, **kw}

    steps = [prefill(t, 5 + 0.1 * t) for t in (100, 200, 300, 400)]
    requests = [{"adapter": "a", "prefill_s": 1.0, "load_wait_s": 0.3},  # waited: its load began 200 ms late
                {"adapter": "a", "prefill_s": 0.1, "load_wait_s": 0.0}]
    loads = [{"adapter": "a", "t_s": 1.3, "ready_ms": 100.0}]
    doc = {"figures": {"quiet": {}, "stalled": {}}, "requests": {"quiet": [], "stalled": requests},
           "loads": {"quiet": [], "stalled": loads},
           "steps": {"quiet": steps, "stalled": [*steps, prefill(250, 90.0, gc_ms=4.0)]}}
    found = stalls(doc)
    assert found["quiet"] == {"wait_before_load_ms": 0.0, "worst_prefill_ratio": pytest.approx(1.0),
                              "longest_step_gc_ms": 0.0}
    assert found["stalled"]["wait_before_load_ms"] == pytest.approx(200.0)
    assert found["stalled"]["worst_prefill_ratio"] > 2 and found["stalled"]["longest_step_gc_ms"] == 4.0
    write_results(tmp_path / "r.json.gz", doc)
    assert stalls_main([str(tmp_path / "r.json.gz")]) == 0 and "| stalled | 200.0 |" in capsys.readouterr().out
    assert stalls_main([str(tmp_path / "missing.json")]) == 2
