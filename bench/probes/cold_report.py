"""The cold-load probe's results for readers (``bench.probes.cold_read``, issue 30): one run's table, many runs'
summary against the issue's goals.

A split of ``cold_read.py`` along its seam: the probe measures and writes JSON; this only reads that JSON (a
run's ``out``, or a folder of ``cold-*.json``) and writes markdown.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def table(out: dict[str, Any]) -> str:
    lines = [f"{out['model']} rank {out['rank']} TP {out['tp']} on {out['device']}: shard "
             f"{out['largest_shard_bytes'] / 2**20:.1f} MiB; memcpy {out['memcpy_together_GBps']:.1f} GB/s all at once "
             f"({med(out['memcpy_alone_GBps']):.1f} alone); read reference x{out['ref_threads']} "
             f"{out['read'][out['ref_threads']]['alone_GBps']:.1f} GB/s alone, "
             f"{out['read'][out['ref_threads']]['together_GBps']:.1f} all at once",
             "reference reads, GB/s alone / all at once: " + ", ".join(
                 f"x{t} {r['alone_GBps']:.1f} / {r['together_GBps']:.1f}" for t, r in out["read"].items()),
             "",
             "| reads | verify | readers (processes) | cold per rank GB/s | load / read | cold together GB/s "
             "| cold / memcpy | hit / memcpy | ready ms | (read + copy) ms | ready / bound |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in out["rows"]:
        lines.append(f"| {r['reads']} | {r['verify']} | {r['readers']} ({r['split']}) | "
                     f"{med(r['per_rank_GBps']):.2f} | "
                     f"{r['load_over_read']:.2f} | "
                     f"{r['cold_GBps']:.1f} | {r['cold_over_memcpy']:.2f} | {r['hit_over_memcpy']:.2f} | "
                     f"{r['ready_ms']:.1f} | {r['bound_ms']:.1f} | {r['ready_over_bound']:.2f} |")
    lines += ["", "phases, ms (medians; bench.probes.cold_read.phases says what each is):"]
    for r in out["rows"]:
        for what in ("cold_alone", "cold_together", "hit_together"):
            split = r[f"phases_{what}"]
            lines.append(f"  {r['reads']} {r['verify']} x{r['readers']} {what}: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    if "mechanisms_GBps" in out:
        lines += ["", "rank 0 alone, outside the cache, GB/s: " + ", ".join(
            f"{k} {v:.2f}" for k, v in out["mechanisms_GBps"].items())]
    return "\n".join(lines)


GOALS = {"load_over_read": (">=", 0.8), "cold_over_memcpy": (">=", 0.5), "hit_over_memcpy": (">=", 0.9),
         "ready_over_bound": ("<=", 1.3)}


def summary(folder: Path) -> str:
    """A markdown summary of the probe's JSON files in ``folder``: each row's goals (issue 30 item 1) and
    phases."""
    lines = ["| shape | reads | verify | readers (processes) | "
             + " | ".join(f"{k} ({op} {v})" for k, (op, v) in GOALS.items())
             + " | load / best read | cold per rank GB/s | ref GB/s (threads) | memcpy 4 at once GB/s |",
             "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in GOALS) + " | ---: | ---: | ---: | ---: |"]
    split: list[str] = []
    for path in sorted(folder.glob("cold-*.json")):
        out = json.loads(path.read_text())
        ref = out["read"][str(out["ref_threads"])] if str(out["ref_threads"]) in out["read"] else \
            out["read"][out["ref_threads"]]
        for r in out["rows"]:
            lines.append(f"| {out['model']} r{out['rank']} | {r['reads']} | {r.get('verify', 'sample')} | "
                         f"{r['readers']} ({r.get('split', 1)}) | " + " | ".join(f"{r[k]:.2f}" for k in GOALS)
                         + f" | {r['load_over_best_read']:.2f} | {med(r['per_rank_GBps']):.2f} | "
                         f"{ref['alone_GBps']:.1f} (x{out['ref_threads']}) | {out['memcpy_together_GBps']:.1f} |")
            for what in ("cold_alone", "cold_together", "hit_together"):
                phases_ = r.get(f"phases_{what}", {})
                split.append(f"- {out['model']} r{out['rank']} {r['reads']} {r.get('verify', 'sample')} "
                             f"x{r['readers']} {what}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases_.items()))
    return "\n".join([*lines, "", "Phases, ms (medians; bench.probes.cold_read.phases):", *split]) + "\n"
