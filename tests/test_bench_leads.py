"""bench.leads: one scenario at several router lead times, with the gap shares of each lead's own run."""

from __future__ import annotations

import json

import pytest

from bench.leads import main, parse_leads
from lora_cache.errors import ConfigError


def test_policies_without_hints_do_not_depend_on_the_lead_and_global_gains_from_it(tmp_path, capsys) -> None:
    out = tmp_path / "leads"
    rc = main(["--engine", "sim", "--scenario", "zipf", "--requests", "120", "--no-plots", "--leads", "0,0.5",
               "--policies", "global,queue,ondemand,oracle", "--out", str(out)])
    assert rc == 0
    docs = {lead: json.loads((out / f"lead-{lead}" / "results.json").read_text()) for lead in ("0", "0.5")}
    assert [d["config"]["bench"]["hint_lead_s"] for d in docs.values()] == [0.0, 0.5]
    for policy in ("queue", "ondemand", "oracle"):  # no router hints: the same run at every lead
        assert docs["0"]["figures"][policy]["p99_ttft_ms"] == docs["0.5"]["figures"][policy]["p99_ttft_ms"]
    assert docs["0.5"]["figures"]["global"]["gpu_hit_rate"] > docs["0"]["figures"]["global"]["gpu_hit_rate"]
    table = (out / "leads.md").read_text()
    assert table in capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| global |")]
    assert [r.split("|")[2].strip() for r in rows] == ["0", "0.5"]
    assert "adapter_gap_closed_p99" in table and "| oracle | 0 |" in table


@pytest.mark.parametrize("text", ["", "0,x", "-1", "inf"])
def test_leads_must_be_seconds(text: str) -> None:
    with pytest.raises(ConfigError, match="--leads"):
        parse_leads(text)


def test_the_lead_is_given_once(capsys) -> None:
    assert main(["--engine", "sim", "--hint-lead-s", "0.2"]) == 2
    assert "give --leads, not --hint-lead-s" in capsys.readouterr().err
