"""bench.sweep: the simulator grid runs every baseline once per router and global at every lead, and says
what it ran; bad names are refused with the choices."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from bench import sweep


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(sweep.SCENARIOS, "tiny", ({"replicas": 2, "slots": 4, "max_adapters": 4},
                                                  {"popularity": "zipf:0.9", "num_adapters": 12,
                                                   "arrivals": "poisson:8", "requests": 40}))
    return "tiny"


def test_a_sweep_runs_each_baseline_once_per_router_and_global_at_every_lead(tiny: str, tmp_path: Path) -> None:
    routers = ["round-robin", "lora-cache"]
    log = io.StringIO()
    rows = sweep.sweep(tiny, routers, tmp_path, seed=0, calibration="h200-llama8b", log=log)
    assert log.getvalue().count("\n") == len(rows)  # a progress line per run
    jobs = [(r.router, r.policy, r.lead) for r in rows]
    assert jobs[0] == ("least-loaded", "oracle", None)
    for router in routers:
        assert [(p, lead) for r, p, lead in jobs if r == router] == (
            [(p, None) for p in sweep.BASELINES] + [("global", lead) for lead in sweep.LEADS])
    for r in rows:
        assert r.figures["completed"] == 40 and r.figures["failed"] == 0, r
        assert (tmp_path / tiny / r.router / (r.policy if r.lead is None else f"{r.policy}-{r.lead:g}")
                / "results.json").is_file()
    text = sweep.table(tiny, rows)
    assert text.count("\n| ") == len(rows) + 2  # the header, its rule and a row per run
    assert "| lora-cache | global | 0.05 |" in text
    assert "| least-loaded | oracle | - |" in text and text.splitlines()[4].endswith("| 1.00 |")
    shares = sweep.gaps(rows)
    assert [(r.router, r.lead) for r, _ in shares] == [(r, lead) for r in routers for lead in sweep.LEADS]
    gap = sweep.gap_table([(tiny, rows)])
    assert gap.count(f"\n| {tiny} |") == len(shares)  # a line per global row of the fleet


def test_the_gap_share_is_one_at_the_oracle_and_zero_at_the_best_baseline() -> None:
    assert sweep.gap_closed(200.0, 100.0, 100.0) == 1.0 and sweep.gap_closed(200.0, 100.0, 200.0) == 0.0
    assert sweep.gap_closed(200.0, 100.0, 150.0) == 0.5 and sweep.gap_closed(200.0, 100.0, 250.0) == -0.5
    assert sweep.gap_closed(100.0, 100.0, 90.0) is None  # no gap to close


def test_unknown_scenarios_and_routers_are_refused_with_the_choices(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    assert sweep.main(["--scenarios", "nope", "--out", str(tmp_path)]) == 2
    assert sweep.main(["--routers", "random", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "'random'" in err and "fleet32-zipf0.9" in err and "lora-cache" in err
    assert sweep.main(["--grid", "routing-quick", "--seeds", "0,x", "--out", str(tmp_path)]) == 2
    assert sweep.main(["--grid", "routing-quick", "--seeds", "1,1", "--out", str(tmp_path)]) == 2
    assert sweep.main(["--grid", "routing-quick", "--jobs", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--seeds is '0,x'; give a comma list of workload seeds" in err
    assert "grid seeds [1, 1]: give distinct workload seeds" in err and "--jobs is 0" in err
