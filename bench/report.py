"""The benchmark's outputs: a markdown table on stdout, one JSON file with every figure and the whole
configuration, and PNG plots (TTFT CDF per policy; GPU hit rate and bytes moved over time); while it runs,
a progress bar per policy on stderr."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.figures import GAP_KEYS, PolicyRun, figures, gaps, goals, timeline
from lora_cache.errors import ConfigError

COLUMNS = (  # (figure, header, scale)
    ("mean_ttft_ms", "mean TTFT ms", 1), ("p99_ttft_ms", "p99 TTFT ms", 1), ("median_e2el_ms", "median E2EL ms", 1),
    ("mean_tpot_ms", "mean TPOT ms", 1), ("request_throughput", "req/s", 1), ("gpu_hit_rate", "GPU hit", 1),
    ("prefetch_accuracy", "prefetch acc.", 1), ("mean_load_wait_ms", "stall ms/req", 1),
    ("median_time_to_ready_ms", "ready ms p50", 1), ("loads", "loads", 1), ("bytes_host_to_gpu", "GB to GPU", 1e-9),
)


def cell(value: Any, scale: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int) and scale == 1:
        return str(value)
    v = float(value) * scale
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def table(by_policy: dict[str, dict[str, Any]], checked: list[dict[str, Any]]) -> str:
    lines = ["| policy | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "| --- |" + " ---: |" * len(COLUMNS)]
    for name, figs in by_policy.items():
        lines.append(f"| {name} | " + " | ".join(cell(figs.get(k), s) for k, _, s in COLUMNS) + " |")
    tiers = [(name, figs) for name, figs in by_policy.items() if "gpu_hits" in figs]
    if tiers:  # the miss cost per tier: GPU hit (no wait), host-tier hit (a copy), host-tier miss (a read first)
        lines += ["", "| miss cost per tier | GPU hits | host hits | host hit ready ms p50 / p99 | disk loads | "
                  "disk ready ms p50 / p99 | disk read ms p50 |", "| --- |" + " ---: |" * 6]
        lines += [f"| {name} | {figs['gpu_hits']} | {figs['host_hit_loads']} | "
                  f"{cell(figs['host_hit_ready_ms_p50'], 1)} / {cell(figs['host_hit_ready_ms_p99'], 1)} | "
                  f"{figs['disk_loads']} | {cell(figs['disk_ready_ms_p50'], 1)} / {cell(figs['disk_ready_ms_p99'], 1)}"
                  f" | {cell(figs['disk_read_ms_p50'], 1)} |" for name, figs in tiers]
    shares = gaps(by_policy)
    if shares:
        keys = [k for k in GAP_KEYS if any(k in row for row in shares.values())]
        lines += ["", "| gap to the oracle closed | " + " | ".join(keys) + " |", "| --- |" + " ---: |" * len(keys)]
        lines += [f"| {p} | " + " | ".join(cell(row.get(k), 1) for k in keys) + " |" for p, row in shares.items()]
    if checked:
        lines += ["", "| goal | ratio | met |", "| --- | ---: | :---: |"]
        lines += [f"| {g['goal']} | {g['ratio']:.3f} | {'yes' if g['met'] else 'no'} |" for g in checked]
    return "\n".join(lines)


# The document's sections, each by policy: how each is taken from a policy's run.
SECTIONS: dict[str, Callable[[PolicyRun], Any]] = {
    "figures": figures, "timeline": timeline, "requests": lambda run: [_record(r) for r in run.records],
    "ranks": lambda run: run.ranks, "loads": lambda run: run.loads, "steps": lambda run: run.steps,
    "routing": lambda run: run.routing, "startup": lambda run: run.startup}


def write(out: Path, config: dict[str, Any], runs: list[PolicyRun], plots: bool = True) -> dict[str, Any]:
    """Write ``results.json`` (and the plots) under ``out``; returns the JSON document."""
    out.mkdir(parents=True, exist_ok=True)
    doc = _document(config, {key: {run.policy: of(run) for run in runs} for key, of in SECTIONS.items()})
    write_results(out / "results.json", doc)
    if plots:
        plot(out, doc)
    return doc


def _document(config: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The results document: ``config``, each of ``SECTIONS`` by policy, and the goals and table."""
    by_policy = sections["figures"]
    checked = goals(by_policy, str(config.get("workload", {}).get("popularity", "")))
    return {"config": config, "figures": by_policy, "goals": checked, "gaps": gaps(by_policy),
            **{k: v for k, v in sections.items() if k != "figures"}, "table": table(by_policy, checked)}


def _record(r: Any) -> dict[str, Any]:
    return {"rid": r.rid, "adapter": r.adapter, "input_len": r.input_len, "output_len": r.output_len,
            "arrival_s": r.arrival_s, "prefill_s": r.prefill_s, "first_token_s": r.token_s[0] if r.token_s else None,
            "finish_s": r.token_s[-1] if r.token_s else None, "load_wait_s": r.load_wait_s, "error": r.error,
            "received_s": r.received_s}


def read_results(path: Path) -> dict[str, Any]:
    """A results file as bench.run wrote it, or gzipped (``results.json.gz``: how the repository keeps them)."""
    try:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        return dict(json.loads(text))
    except FileNotFoundError as e:
        raise ConfigError(f"results {path}: no such file; give a results.json (.gz) that bench.run wrote") from e
    except (json.JSONDecodeError, gzip.BadGzipFile, EOFError, UnicodeDecodeError) as e:
        raise ConfigError(f"results {path}: not a results JSON ({e}); give a results.json that bench.run wrote") from e


def results_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """The parser of a tool that reads one real run's results file (its first argument, ``results``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="results.json (or .json.gz) of a --engine real run")
    return parser


def read_results_or_say(path: Path) -> dict[str, Any] | None:
    """``read_results`` for a command line: None after printing why it failed (the tool then exits 2)."""
    try:
        return read_results(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def write_results(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as JSON, gzipped if ``path`` ends in .gz."""
    text = json.dumps(doc, indent=1, default=_json_default)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "_asdict"):
        return value._asdict()
    return str(value)


def _ttft_ms(requests: list[dict[str, Any]]) -> list[float]:
    return [(r["first_token_s"] - r["arrival_s"]) * 1e3 for r in requests
            if r["error"] is None and r["first_token_s"] is not None]


def plot(out: Path, doc: dict[str, Any]) -> None:
    """The two PNGs from a results document (``python -m bench.report results.json`` redraws them)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    title = str(doc["config"].get("title", ""))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, requests in doc["requests"].items():
        ttft = np.sort(_ttft_ms(requests))
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name)
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF {title}".strip())
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=120)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, series in doc["timeline"].items():
        top.plot(series["t_s"], series["gpu_hit_rate"], label=name)
        bottom.plot(series["t_s"], np.asarray(series["bytes_host_to_gpu"]) / 2**20, label=name)
    top.set_ylabel("GPU hit rate (requests)")
    bottom.set_ylabel("MiB host -> GPU per bin")
    bottom.set_xlabel("time (s)")
    top.set_title(f"hit rate and bytes moved over time {title}".strip())
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend()
    fig.tight_layout()
    fig.savefig(out / "cache_over_time.png", dpi=120)
    plt.close(fig)


class progress:
    """A tqdm bar per policy (to stderr), fed the fraction of the request stream's time elapsed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> Any:
        from tqdm import tqdm

        self.bar = tqdm(total=100, desc=f"{self.name:>8}", unit="%", file=sys.stderr, leave=True,
                        bar_format="{desc} {bar} {n:.0f}% [{elapsed}]")

        def tick(fraction: float) -> None:
            self.bar.n = round(100 * fraction)
            self.bar.refresh()

        return tick

    def __exit__(self, *exc: object) -> None:
        self.bar.n = 100 if exc[0] is None else self.bar.n
        self.bar.close()


RUN_ONLY = ("policies", "out", "check_sim", "timeout_s", "plots")  # bench options that may differ between parts


def merge(docs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One results document from runs of the same configuration that each ran some of the policies (say,
    across device calls); goals and the table are recomputed. A policy in two parts, or parts whose
    workload or fleet differ, are refused: their figures would not be comparable."""
    if not docs:
        raise ConfigError("merge: no results given")
    first = docs[0]["config"]

    def fixed(config: dict[str, Any]) -> tuple[Any, Any]:
        return ({k: v for k, v in config["bench"].items() if k not in RUN_ONLY}, config["workload"])
    merged: dict[str, dict[str, Any]] = {k: {} for k in SECTIONS}
    for doc, name in zip(docs, names):
        if fixed(doc["config"]) != fixed(first):
            a, b = fixed(first), fixed(doc["config"])
            diff = sorted(k for part in (0, 1) for k in set(a[part]) | set(b[part]) if a[part].get(k) != b[part].get(k))
            raise ConfigError(f"merge: {name} ran another configuration than {names[0]} (differs in {diff}); "
                              "merge only parts of one run configuration")
        for policy in doc["figures"]:
            if policy in merged["figures"]:
                raise ConfigError(f"merge: policy {policy!r} is in more than one part ({name} too); "
                                  "give each policy's run once")
            for k in SECTIONS:
                merged[k][policy] = doc.get(k, {}).get(policy, {})  # results from before a section have none
    config = {**first, "merged_from": names, "policies": [p for d in docs for p in d["config"]["policies"]]}
    config.pop("errors", None)
    return _document(config, merged)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.report DIR/results.json``: print its table and redraw its plots beside it.
    ``python -m bench.report A.json B.json --merge OUT.json``: merge runs of one configuration that each ran
    some policies, write OUT.json and draw its plots beside it."""
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    parser.add_argument("results", type=Path, nargs="+", help="results.json written by bench.run (or .json.gz)")
    parser.add_argument("--merge", type=Path, help="merge the given results into this file")
    parser.add_argument("--no-plots", action="store_true", help="only print the table")
    ns = parser.parse_args(argv)
    try:
        docs = [read_results(p) for p in ns.results]
        if ns.merge is None and len(docs) > 1:
            raise ConfigError("several results given: pass --merge OUT.json to merge them, or give one")
        doc = docs[0] if ns.merge is None else merge(docs, [str(p) for p in ns.results])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = ns.results[0] if ns.merge is None else ns.merge
    if ns.merge is not None:
        write_results(ns.merge, doc)
    print(doc["table"])
    if not ns.no_plots:
        plot(where.parent, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
