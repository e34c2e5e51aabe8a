"""Stalls in a real run's logs, per policy: what held requests up beyond their steps' fitted costs.

    python -m bench.probes.stalls DIR/results.json[.gz]

- ``wait_before_load_ms``: the longest time from a request's step start (its ``prefill_s``) to the
  start of the on-demand load it waited on (a load's start is ``t_s - ready_ms``). Requests do not log
  their replica, so each load is matched to the latest request of its adapter that waited on a load
  and began its step at most 0.5 s before the load: an estimate. A load starts ~0.3 ms after its step
  when nothing stalls the process.
- ``worst_prefill_ratio``: the slowest prefill that did not wait on a load, over a least-squares fit of
  the policy's prefills on their prompt tokens (1.0: as fast as its shape predicts).
- ``longest_step_gc_ms``: the longest collector stall inside one step (``gc_ms``; runs logged before
  2026-11-22 evening have none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench.report import read_results_or_say, results_parser

MATCH_S = 0.5  # a load is matched to a request whose step began at most this long before it


def wait_before_load_ms(requests: Sequence[Mapping[str, Any]], loads: Sequence[Mapping[str, Any]]) -> float:
    longest = 0.0
    for ld in loads:
        start = ld["t_s"] - ld["ready_ms"] / 1e3
        began = [r["prefill_s"] for r in requests if r["adapter"] == ld["adapter"] and r["prefill_s"] is not None
                 and r["load_wait_s"] > 0 and 0 <= start - r["prefill_s"] < MATCH_S]
        if began:
            longest = max(longest, (start - max(began)) * 1e3)
    return longest


def worst_prefill_ratio(steps: Sequence[Mapping[str, Any]]) -> float:
    rows = [s for s in steps if s["kind"] == "prefill" and not s.get("load_wait_ms")]
    if len(rows) < 2:
        return float("nan")
    x = np.array([[1.0, s["tokens"]] for s in rows])
    y = np.array([s["ms"] for s in rows])
    fit = x @ np.linalg.lstsq(x, y, rcond=None)[0]
    return float(np.max(y / fit))


def stalls(doc: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    return {p: {"wait_before_load_ms": wait_before_load_ms(doc["requests"][p], doc["loads"][p]),
                "worst_prefill_ratio": worst_prefill_ratio(doc["steps"][p]),
                "longest_step_gc_ms": max((s.get("gc_ms") or 0.0 for s in doc["steps"][p]), default=0.0)}
            for p in doc["figures"]}


def main(argv: list[str] | None = None) -> int:
    ns = results_parser("python -m bench.probes.stalls", __doc__).parse_args(argv)
    doc = read_results_or_say(ns.results)
    if doc is None:
        return 2
    print("| policy | wait before load ms | worst prefill / fit | longest step gc ms |\n| --- | ---: | ---: | ---: |")
    for policy, s in stalls(doc).items():
        print(f"| {policy} | {s['wait_before_load_ms']:.1f} | {s['worst_prefill_ratio']:.2f} | "
              f"{s['longest_step_gc_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
