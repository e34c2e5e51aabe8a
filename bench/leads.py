"""One scenario at several router lead times: ``bench.run`` once per lead, and one table across them.

    python -m bench.leads --engine sim --scenario zipf [any bench.run option] [--leads 0,0.05,0.5]

A router that forwards a request within milliseconds of choosing its replica gives the cache almost no
lead (0 and 0.05 s); one that queues requests gives more (0.5 s). Every lead's run is written as
``bench.run`` writes it, under ``OUT/lead-<s>``; the combined table (``OUT/leads.md``, and printed) has,
per policy and lead, mean and p99 TTFT, the GPU hit rate, prefetch accuracy, GB moved host to GPU, and the
share of the adapter gap (ondemand to oracle) and of the queue gap (queue to oracle) closed
(``bench.figures.gaps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.figures import GAP_KEYS
from bench.report import cell
from bench.run import build_parser, configs, run
from lora_cache.errors import ConfigError, LoraCacheError

DEFAULT_LEADS = (0.0, 0.05, 0.5)
COLUMNS = (("mean_ttft_ms", "mean TTFT ms", 1), ("p99_ttft_ms", "p99 TTFT ms", 1), ("gpu_hit_rate", "GPU hit", 1),
           ("prefetch_accuracy", "prefetch acc.", 1), ("bytes_host_to_gpu", "GB to GPU", 1e-9))


def parse_leads(text: str) -> tuple[float, ...]:
    try:
        leads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--leads {text!r} is not a comma list of seconds; e.g. --leads 0,0.05,0.5") from None
    if not leads or any(not 0 <= x < float("inf") for x in leads):
        raise ConfigError(f"--leads {text!r} must name one or more leads >= 0 seconds, e.g. 0,0.05,0.5")
    return leads


def table(docs: dict[float, dict[str, Any]]) -> str:
    """Policies down, leads within each policy; gap shares from each lead's own run."""
    head = ["policy", "hint lead s"] + [h for _, h, _ in COLUMNS] + list(GAP_KEYS)
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: |" + " ---: |" * (len(head) - 2)]
    policies = list(dict.fromkeys(p for doc in docs.values() for p in doc["figures"]))
    for policy in policies:
        for lead, doc in docs.items():
            figs = doc["figures"].get(policy)
            if figs is None:
                continue
            shares = doc.get("gaps", {}).get(policy, {})
            cells = [cell(figs.get(k), s) for k, _, s in COLUMNS] + [cell(shares.get(k), 1) for k in GAP_KEYS]
            lines.append(f"| {policy} | {lead:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.prog = "python -m bench.leads"
    parser.add_argument("--leads", default=",".join(f"{x:g}" for x in DEFAULT_LEADS),
                        help="comma list of router lead times in seconds (each replaces --hint-lead-s)")
    ns = parser.parse_args(argv)
    try:
        leads = parse_leads(ns.leads)
        if ns.hint_lead_s is not None:
            raise ConfigError("bench.leads sets the lead itself: give --leads, not --hint-lead-s")
        bench, spec = configs(argparse.Namespace(**{k: v for k, v in vars(ns).items() if k != "leads"}))
        out = Path(bench.out)
        docs = {}
        for lead in leads:
            docs[lead] = run(dataclasses.replace(bench, hint_lead_s=lead, out=str(out / f"lead-{lead:g}")), spec)
    except LoraCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = table(docs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "leads.md").write_text(text + "\n")
    print(text)
    print(f"\nresults: {out}/lead-*/results.json, {out / 'leads.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
