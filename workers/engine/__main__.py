"""``python -m workers.engine --adapters DIR --model tiny --tp 2 --requests 32``: serve a synthetic stream.

Options come from EngineConfig, WorkloadConfig and HostTierConfig. Prints each rank's cache counters
and the bench_serving-style summary (``--json``: the summary as JSON; ``--records``: one JSON line per
request).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.errors import LoraCacheError
from lora_cache.runtime.cliargs import add_config_args, config_from_args
from workers.engine.catalog import load_catalog
from workers.engine.config import EngineConfig
from workers.engine.engine import EngineResult, run_engine
from workers.engine.timings import RequestRecord, format_summary
from workers.engine.workload import WorkloadConfig, make_requests

CACHE_KEYS = ("gpu_hits", "gpu_misses", "loads", "evictions", "host_hits", "host_misses", "bytes_host_to_gpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, EngineConfig)
    add_config_args(parser, WorkloadConfig)
    parser.add_argument("--make-adapters", type=int, default=0, metavar="N",
                        help="if the adapters directory holds none, first write N random ones for --model")
    parser.add_argument("--adapter-ranks", default="8,16", help="ranks of the adapters --make-adapters writes")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--records", type=Path, help="write one JSON line per request to this file")
    return parser


def _record_json(r: RequestRecord) -> str:
    return json.dumps({"rid": r.rid, "adapter": r.adapter, "input_len": r.input_len, "output_len": r.output_len,
                       "arrival_s": r.arrival_s, "prefill_s": r.prefill_s, "token_s": list(r.token_s),
                       "load_wait_s": r.load_wait_s, "error": r.error})


def report(config: EngineConfig, result: EngineResult, as_json: bool) -> str:
    summary = result.summary()
    if as_json:
        return json.dumps(summary, indent=2)
    lines = [f"{config.shape().name}: {config.layers} layers, TP {config.tp} on {config.device_kind()}, "
             f"admission {config.admission}, {config.num_slots} slots"]
    for rank in result.ranks:
        counters = " ".join(f"{k}={rank.cache.get(k)}" for k in CACHE_KEYS)
        lines.append(f"  rank {rank.rank}: {rank.steps} steps ({rank.prefill_steps} prefill), "
                     f"{rank.unready_items} items run before their adapter was ready; {counters}")
    return "\n".join([*lines, format_summary(summary, f"{config.admission} / TP {config.tp}")])


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        config, workload = config_from_args(EngineConfig, ns), config_from_args(WorkloadConfig, ns)
        if ns.make_adapters and config.adapters and not any(Path(config.adapters).glob("*/adapter_config.json")):
            make_adapters(config.adapters, SynthConfig(model=config.model, count=ns.make_adapters,
                                                       rank=ns.adapter_ranks))
        requests = make_requests(workload, load_catalog(config).names())
        result = run_engine(config, requests)
    except LoraCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.records:
        ns.records.write_text("".join(_record_json(r) + "\n" for r in result.records))
    print(report(config, result, ns.json))
    return 0 if all(r.ok for r in result.records) else 1


if __name__ == "__main__":
    sys.exit(main())
