"""How long a benchmark policy run takes from its service start to its first request (issue 30, item 3).

Makes ``--count`` adapters of ``--model``'s shape cheaply (one written by ``make-adapters``, the others hard
links to its files under their own names: registration reads metadata only, and a load reads the same bytes
as a distinct adapter's would), then runs ``bench.run --engine real`` on them with a short stream and prints,
per policy, the seconds from the service's start to the first request and each start-up phase
(``bench.real``: the service with its workers and registrations, the engine build with the slowest rank's
cache, model and warm-up).

    python -m bench.probes.fast_start --model tiny --count 100 --out /tmp/fs                 # CPU, anywhere
    python -m bench.probes.fast_start --model llama-3.1-8b --count 100 --out OUT/fast-start  # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench.report import read_results
from bench.run import main as bench_main
from lora_cache.adapters.synth import SynthConfig, make_named_adapters


def make_linked(root: Path, model: str, count: int, rank: int) -> float:
    """``adapter-000`` .. ``adapter-{count-1}`` under ``root``: the first written, the rest hard links to its
    files (copies where links fail); returns the seconds it took."""
    t0 = time.perf_counter()
    first = make_named_adapters(root, SynthConfig(model=model, rank=str(rank)), ["adapter-000"])[0]
    for i in range(1, count):
        out = root / f"adapter-{i:03d}"
        out.mkdir(parents=True, exist_ok=True)
        for f in first.iterdir():
            try:
                os.link(f, out / f.name)
            except OSError:
                shutil.copyfile(f, out / f.name)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--count", type=int, default=100, help="adapters registered")
    ap.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    ap.add_argument("--policies", default="ondemand,global")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--out", required=True, help="results.json and the adapters (under adapters/) go here")
    ap.add_argument("--keep", default="", help="also copy the JSON results into this directory")
    ap.add_argument("bench_args", nargs="*", help="more bench.run options, after --")
    args = ap.parse_args(argv)
    out = Path(args.out)
    adapters = out / "adapters"
    if adapters.exists():
        shutil.rmtree(adapters)
    made_s = make_linked(adapters, args.model, args.count, args.rank)
    small = (
        [
            "--random-input-len",
            "64",
            "--random-output-len",
            "8",
            "--max-seq-len",
            "256",
            "--max-prefill-tokens",
            "512",
            "--max-running",
            "8",
            "--max-adapters",
            "2",
        ]
        if args.model == "tiny"
        else []
    )
    try:
        code = bench_main(
            ["--engine", "real", "--model", args.model, "--adapters", str(adapters), "--no-plots",
             "--num-adapters", str(args.count), "--slots", "8", "--policies", args.policies,
             "--requests", str(args.requests), "--arrivals", "poisson:8", "--popularity", "uniform",
             "--out", str(out), *small, *args.bench_args])  # fmt: skip
    finally:
        shutil.rmtree(adapters, ignore_errors=True)
    doc = read_results(out / "results.json")
    runs = {
        p: {"start_to_first_request_s": f.get("start_to_first_request_s"), "wall_s": f.get("wall_s"),
            "phases": doc.get("startup", {}).get(p, {})}
        for p, f in doc["figures"].items()
    }  # fmt: skip
    summary = {"model": args.model, "adapters": args.count, "made_s": made_s, "host": doc["config"].get("host"),
               "host_tier": doc["config"].get("host_tier"), "policies": runs}  # fmt: skip
    (out / "fast_start.json").write_text(json.dumps(summary, indent=2))
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        for name in ("fast_start.json", "results.json"):
            shutil.copyfile(out / name, Path(args.keep) / name)
    print(f"\nadapters made in {made_s:.1f} s; start to first request per policy (s): "
          + ", ".join(f"{p} {r['start_to_first_request_s']:.1f}" for p, r in runs.items()
                      if r["start_to_first_request_s"] is not None), flush=True)  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
