"""bench/probes/cold_read.py on the CPU (issue 30): the tiny model, two ranks as threads, every figure the issue
names present and the loads real (each cold load a host-tier miss, each hit a hit; the probe asserts both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.probes.cold_read import main

FIGURES = ("load_over_read", "cold_over_memcpy", "hit_over_memcpy", "ready_over_bound")


def test_the_probe_runs_on_the_cpu_and_names_the_issues_figures(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = main(["--model", "tiny", "--rank", "16", "--tp", "2", "--cpu", "--readers", "1,3,auto", "--ref-threads",
                "1,2", "--mechanisms", "2", "--repeats", "2", "--adapters", str(tmp_path / "ad"),
                "--out", str(tmp_path / "cold.json")])
    saved = json.loads((tmp_path / "cold.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(out["rows"])) and saved["cpu"] and saved["ranks_in"] == "thread"
    assert [r["readers"] for r in out["rows"]][:2] == [1, 3] and out["rows"][2]["asked"] == 0
    assert len(out["shard_bytes"]) == 2 and out["largest_shard_bytes"] == max(out["shard_bytes"])
    for row in out["rows"]:
        assert all(row[f] > 0 for f in FIGURES) and len(row["per_rank_GBps"]) == 2
        assert row["ready_ms"] > 0 and row["bound_ms"] > 0 and min(row["cold_alone_ms"]) > 0
    assert set(out["read"]) >= {1, 2, out["auto_readers"]}  # the sweep asked and the default readers
    assert out["mechanisms_ms"].keys() >= {"single (mmap copy)", "preadv x2", "rows x2", "mmap x2"}
    table = capsys.readouterr().out
    assert "| readers (processes) | cold per rank GB/s | load / read |" in table and "ready / bound" in table
    for row in out["rows"]:  # each load split into its phases (issue 30 item 1), cold and hit
        assert {"dispatch", "open", "read", "copy_tail", "total"} <= set(row["phases_cold_alone"])
        assert {"to_slot", "issue", "copy_tail", "total"} <= set(row["phases_hit_together"])
    assert "phases, ms" in table


def test_the_probe_measures_variants_and_summarizes_the_goals(tmp_path: Path) -> None:
    out = main(["--model", "tiny", "--rank", "16", "--tp", "2", "--cpu", "--repeats", "1", "--variants",
                "process:2:2:sample,thread:1:1:identity", "--adapters", str(tmp_path / "ad"),
                "--out", str(tmp_path / "cold-tiny.json")])
    assert [(r["reads"], r["readers"], r["split"], r["verify"]) for r in out["rows"]] == [
        ("process", 2, 2, "sample"), ("thread", 1, 1, "identity")]
    text = main(["--summary", str(tmp_path)])["summary"]
    assert (tmp_path / "summary.md").read_text() == text
    assert "| tiny r16 | process | sample | 2 (2) |" in text and "load_over_read (>= 0.8)" in text
    assert "tiny r16 thread identity x1 cold_alone: " in text


def test_the_arena_pin_probe_times_pinning_in_place_and_in_the_background(tmp_path: Path) -> None:
    out = main(["--arena-pin", str(8 / 1024), "--out", str(tmp_path / "pin.json")])
    assert out["bytes"] == 8 << 20 and out["pin_error"] == "" and out["background_pinned_s"] >= out["pin_s"] > 0
    assert out["background_returns_s"] < out["background_pinned_s"] and out["step_ms_after_p50"] > 0


def test_the_fixed_costs_probe_times_a_loads_fixed_steps_on_the_cpu(tmp_path: Path) -> None:
    from bench.probes.fixed_costs import main as fixed_costs

    out = fixed_costs(["--model", "tiny", "--rank", "16", "--tp", "2", "--readers", "4", "--parts", "2", "--repeats",
                       "5", "--device", "cpu", "--adapters", str(tmp_path / "ad"), "--out", str(tmp_path / "f.json")])
    assert json.loads((tmp_path / "f.json").read_text()) == json.loads(json.dumps(out))
    assert out["meta_write_us"] > 0 and out["job_pickle_us"] > 0 and out["shard_bytes"] > 0
    for steps in (out["one_process"], out["part_1_of_2"]):
        assert 0 < steps["reader_open_ms"] < steps["reader_call_ms"] and steps["reader_plan_ms"] > 0
