"""The benchmark job: every policy on one workload, at equal GPU memory, on the real engine or the simulator.

    python -m bench.run --scenario zipf --engine real --out results/zipf        # embedded Ray, here
    ray job submit --working-dir . --runtime-env deploy/runtime_env.yaml -- python -m bench.run --scenario zipf
    python -m bench.run --quick                                                 # the small CI run
    lora-cache bench ...                                                        # the same

It makes its adapters (``make-adapters``, in the model's shape) or takes ``--adapters DIR``, runs each
policy of ``--policies`` (``bench.policies``) on the same drawn requests, and writes ``results.json``
(every figure, the whole configuration, per-request timings), ``ttft_cdf.png`` and
``cache_over_time.png`` under ``--out``; a markdown table goes to stdout, a progress bar to stderr.

``--engine real``: the service and the reference engine through the real path (``bench.real``).
``--attach`` (with ``--engine real``): the engine ranks in processes of their own, attached through the
engine seam as an external engine would (``bench.attached``), instead of inside the worker actors.
``--engine sim``: the discrete-event simulator (``bench.sim``), calibrated by ``--calibration``.
``--check-sim`` (with ``--engine real``): also simulates the same configuration with costs fitted from
this run's own step and load logs, and reports how far the simulated TTFT mean and p99 are from the
real ones (the simulator's check: within 15%).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.config import SCENARIOS, BenchConfig
from bench.figures import PolicyRun, figures
from bench.policies import BenchPolicy, parse_policies
from bench.report import progress, write, write_results
from bench.store import StoreModel, drop_all_pages, s3_store, write_back
from bench.warmup import split_run, warm_workload
from bench.workloads import Workload, WorkloadSpec
from lora_cache.errors import ConfigError, LoraCacheError
from lora_cache.runtime.cliargs import add_config_args, config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, BenchConfig)
    add_config_args(parser, WorkloadSpec)
    return parser


def configs(ns: argparse.Namespace) -> tuple[BenchConfig, WorkloadSpec]:
    """Both configs from the options, a scenario filling what was left unset."""
    name = "quick" if ns.quick else (ns.scenario or "")
    if name and name not in SCENARIOS:
        raise ConfigError(f"scenario {name!r} is not one of {', '.join(SCENARIOS)}")
    preset = {k: v for k, v in SCENARIOS.get(name, {}).items() if getattr(ns, k, None) is None}
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    bench = config_from_args(BenchConfig, ns, **{k: v for k, v in preset.items() if k in names},
                             **({"scenario": name} if name else {}))
    spec = config_from_args(WorkloadSpec, ns, **{k: v for k, v in preset.items() if k not in names})
    return sized(bench), spec


def sized(bench: BenchConfig) -> BenchConfig:
    """``bench`` with its host tier resolved once here (``host_bytes`` 0: the host tier's auto size on this
    host, for ``tp`` ranks per replica), so every policy and both engines get the same bytes per rank."""
    if bench.host_bytes:
        return bench
    from workers.reads.threads import ranks_on_host
    from workers.staging.host_config import HostTierConfig

    return dataclasses.replace(bench, host_bytes=HostTierConfig().sized(ranks_on_host(bench.tp)).host_bytes)


def check_router(bench: BenchConfig, spec: WorkloadSpec) -> None:
    """The real path routes a closed loop (``inflight:N``) round-robin up front: other routers are refused."""
    arrivals = spec.parsed_arrivals()
    if bench.engine == "real" and arrivals.kind == "inflight" and bench.router != "round-robin":
        raise ConfigError(f"--router {bench.router} routes open-loop arrivals only on --engine real; a closed loop "
                          f"({spec.arrivals}) is routed round-robin up front: use --router round-robin or poisson "
                          "arrivals")


MADE_HERE = ".made-by-lora-cache-bench"  # in an adapter directory: the job may add adapters to it


def adapter_dir(bench: BenchConfig, names: Sequence[str]) -> str:
    """The directory of the adapters to serve, from ``--adapters`` (default: under ``--out``), holding every
    adapter in ``names`` (the workload's: ``adapter-NNN``, or a trace's own names). A directory that is
    empty, or holds only adapters this job made, gets the missing ones made (each seeded by its name: one
    made again is rewritten identical); any other directory must hold them all already."""
    return ensure_adapters(Path(bench.adapters or Path(bench.out) / "adapters"), bench.model, bench.adapter_ranks,
                           names)


def ensure_adapters(root: Path, model: str, ranks: str, names: Sequence[str]) -> str:
    """``root`` holding every adapter in ``names`` (``adapter_dir``'s rule: a directory that is empty or holds only
    adapters this job made gets the missing ones made, of ``model``'s shape and ``ranks`` in turn)."""
    from lora_cache.adapters.synth import SynthConfig, make_named_adapters

    have = {p.name for p in root.glob("*") if (p / "adapter_config.json").is_file()} if root.is_dir() else set()
    missing = [n for n in names if n not in have]
    ours = (root / MADE_HERE).is_file() or all(re.fullmatch(r"adapter-\d{3,}", n) for n in have)
    if missing and ours:
        root.mkdir(parents=True, exist_ok=True)
        (root / MADE_HERE).touch()
        jobs = min(16, os.cpu_count() or 1) if len(missing) > 8 else 1  # an 8B catalog: ~2 min in one process
        make_named_adapters(root, SynthConfig(model=model, count=len(names), rank=ranks), list(names), jobs=jobs,
                            skip=have)  # each name's rank by its place in the workload, made now or before
        # on the device before any policy runs: else the first policy's reads (and an S3 store's uploads and
        # disk-tier writes) share the device with the write-back of what was just made (~21 GB for the 8B catalog)
        write_back(root)
    elif missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(f"adapters: {root} lacks {len(missing)} of the workload's {len(names)} adapters "
                          f"({shown}); point --adapters at a directory that holds them, or at an empty one to "
                          "make them")
    return str(root)


def run(bench: BenchConfig, spec: WorkloadSpec) -> dict[str, Any]:
    bench = sized(bench)  # host_bytes 0: resolved once here, for every policy
    policies = parse_policies(bench.policies)
    # a paged pool: the catalog of the slots its bytes equal (with --kv-rows, less the engine's own KV cache)
    slots_for_names = bench.byte_slots(_own_kv_pages(bench) if bench.kv_rows else 0)
    names = spec.adapter_names(slots_for_names)
    check_router(bench, spec)
    # the same warm-up (and measured window) as the slots the bytes equal: a paged run compares with them
    workload, names = warm_workload(spec, names, bench.warmup_requests, bench.replicas, slots_for_names)
    if bench.engine == "real":
        root = adapter_dir(bench, names)
    store = bench.store_model()
    config = {"bench": dataclasses.asdict(bench), "workload": workload.describe(), "adapters": len(names),
              "store": {"model": store.describe(), **store._asdict()},
              "policies": [dataclasses.asdict(p) for p in policies], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "host": _host(), "title": f"({bench.scenario or spec.popularity}, {bench.engine})",
              "host_tier": {"host_bytes_per_rank": bench.host_bytes, "same_for_every_policy": True}}
    described = workload.describe()
    print(f"host tier: {bench.host_bytes / 2**30:.2f} GiB per rank, the same for every policy; store: "
          f"{store.describe()}; warm-up: {workload.warmup} requests ({described['warmup_s']:.1f} s) before the "
          f"measured window of {described['requests']}", file=sys.stderr)
    if bench.engine == "real":
        runs = _run_real(bench, policies, root, names, workload, config)
    else:
        from bench.sim.job import run_policies

        runs = run_policies(bench, policies, workload, config)
    halves = [split_run(run, workload.warmup) for run in runs]
    doc = write(Path(bench.out), config, [m for m, _ in halves], plots=bench.plots)
    cold = {c.policy: figures(c) for _, c in halves if c is not None}
    doc["cold_start"] = cold
    doc["table"] = _headline(bench, store, described) + "\n\n" + doc["table"] + _cold_table(cold, described)
    doc["floor"] = _floor(doc)
    if doc["floor"] is not None:
        doc["table"] += _floor_line(doc["floor"])
    if bench.engine == "real" and bench.check_sim:
        doc["sim_check"] = _check_sim(bench, policies, workload, runs, doc["figures"])
    write_results(Path(bench.out) / "results.json", doc)
    return doc


def _headline(bench: BenchConfig, store: StoreModel, described: dict[str, Any]) -> str:
    """What the figures below are of: the store, the host tier, the warm-up and the measured window."""
    return (f"store: {store.describe()}; host tier: {bench.host_bytes / 2**30:.2f} GiB per rank, the same for every "
            f"policy; warm-up: {described['warmup_requests']} requests ({described['warmup_s']:.1f} s, the same "
            f"arrival process) before the measured window of {described['requests']} requests. The table is the "
            "measured window (steady state); the cold start (the warm-up) is the last table.")


def _floor(doc: dict[str, Any]) -> dict[str, float] | None:
    """The floors no online policy beats on this run's fleet and workload (``bench/bound.py``); None where none
    holds (a popularity without fixed probabilities, a store never read, an auto-sized host tier)."""
    from bench.bound import for_results

    try:
        return dataclasses.asdict(for_results(doc))
    except ConfigError:
        return None


def _floor_line(floor: dict[str, float]) -> str:
    return (f"\n\nfloor for any online policy on this fleet and popularity (python -m bench.bound): "
            f"{floor['missed'] * 100:.2f}% of requests miss every tier, {floor['stall_ms']:.1f} ms load wait per "
            f"request, p{floor['quantile'] * 100:g} load wait {floor['tail_ms']:.0f} ms (the oracle, a slot per "
            "adapter, is below it)")


def _cold_table(cold: dict[str, dict[str, Any]], described: dict[str, Any]) -> str:
    if not cold:
        return ""
    from bench.report import table

    return (f"\n\ncold start (the warm-up's {described['warmup_requests']} requests, "
            f"{described['warmup_s']:.1f} s):\n\n" + table(cold, []).split("\n\n")[0])


def _own_kv_pages(bench: BenchConfig) -> int:
    from bench.real import own_kv_pages  # torch: only for the real engine, which --kv-rows needs

    return own_kv_pages(bench)


def _run_real(bench: BenchConfig, policies: Sequence[BenchPolicy], root: str, names: list[str], workload: Workload,
              config: dict[str, Any]) -> list[PolicyRun]:
    from bench.real import RealConfig

    gpus = bench.use_gpus()
    if bench.gpu_share != 1 and not gpus:
        raise ConfigError(f"--gpu-share {bench.gpu_share}: this run's engine is on the CPU (--gpus {bench.gpus}), "
                          "where there is no GPU to share; give --gpus yes on a GPU host, or leave --gpu-share at 1")
    real = RealConfig(model=bench.model, num_layers=bench.num_layers, replicas=bench.replicas, tp=bench.tp,
                      slots=bench.slots, max_rank=bench.max_rank, page_rank=bench.page_rank,
                      pool_pages=bench.pool_pages, max_running=bench.max_running,
                      max_adapters=bench.max_adapters, max_prefill_tokens=bench.max_prefill_tokens,
                      max_seq_len=bench.max_seq_len, hint_lead_s=bench.hint_lead_s, gpus=gpus,
                      gpu_share=bench.gpu_share,
                      host_bytes=bench.host_bytes, host_eviction=bench.host_eviction,
                      host_recent_s=bench.host_recent_s, host_tiers=bench.host_tiers,
                      direct_reads=bench.direct_reads, read_ahead=bench.read_ahead,
                      dtype="bfloat16" if gpus else "float32",
                      timeout_s=bench.timeout_s,
                      # one set of random base weights for every layer: the same math and bytes read per
                      # layer (far beyond any cache), a fraction of the start-up time and memory
                      engine={"share_weights": True, **({"kv_rows": bench.kv_rows} if bench.kv_rows else {})},
                      attach=bench.attach, router=bench.router, join_over=bench.join_over,
                      store=bench.store, disk_bytes=bench.disk_bytes, fetch_order=bench.fetch_order,
                      disk_root=str(Path(bench.out).resolve() / "disk-tier"))
    config["real"] = dataclasses.asdict(real)
    with contextlib.ExitStack() as stack:
        served = root
        if real.store_model().kind == "s3":  # moto + the proxy, for the whole job; workers fetch through the proxy
            served, env = stack.enter_context(s3_store(real.store_model(), root, names))
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # as an operator sets AWS_* for serve and the cluster's processes
            stack.callback(_restore, saved)
        return _run_policies(bench, real, policies, root, served, names, workload, config)


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _run_policies(bench: BenchConfig, real: Any, policies: Sequence[BenchPolicy], root: str, served: str,
                  names: list[str], workload: Workload, config: dict[str, Any]) -> list[PolicyRun]:
    import ray

    from bench.real import run_policy
    from lora_cache.vocab import NAMESPACE

    owns = not ray.is_initialized()
    if owns:  # inside `ray job submit` this joins the job's cluster; alone, it starts an embedded one
        # RAY_ADDRESS is the job's cluster under `ray job submit`; never one found through a stale
        # /tmp/ray/ray_current_cluster (a dead cluster's address: ray.init would wait on it)
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", namespace=NAMESPACE, log_to_driver=False)
    runs: list[PolicyRun] = []
    try:
        for policy in policies:
            try:
                if real.store_model().kind == "device":  # every policy starts from the device, not the page cache
                    dropped = drop_all_pages(root)
                    config.setdefault("dropped", {})[policy.name] = dropped._asdict()
                    print(f"store: {dropped.describe()}", file=sys.stderr)
                with progress(policy.name) as tick:
                    runs.append(run_policy(real, policy, served, names, workload, tick))
            except Exception as e:  # the other policies still run; the error is in results.json
                config.setdefault("errors", {})[policy.name] = f"{type(e).__name__}: {e}"
                print(f"error: policy {policy.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            write(Path(bench.out), config, runs, plots=False)  # what is done so far survives a later failure
    finally:
        if owns:
            ray.shutdown()
    return runs


def _check_sim(bench: BenchConfig, policies: Sequence[BenchPolicy], workload: Workload,
               runs: list[PolicyRun], real: dict[str, Any]) -> dict[str, Any]:
    """The simulator on this run's configuration, with costs fitted from this run's logs; ``real``: the
    run's figures by policy (as written)."""
    from bench.sim.check import compare, submit_lags

    return compare(bench, policies, workload, real,
                   [s for run in runs for s in run.steps], [x for run in runs for x in run.loads],
                   lags={run.policy: submit_lags(run.routing, workload, run.records) for run in runs})


def _host() -> dict[str, Any]:
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"hostname": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "gpu": gpu, "gpus": torch.cuda.device_count() if gpu else 0}


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        bench, spec = configs(ns)
        doc = run(bench, spec)
    except LoraCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(doc["table"])
    if "sim_check" in doc:
        from bench.sim.check import format_comparison

        print("\nsimulator vs real (TTFT):\n" + format_comparison(doc["sim_check"]))
    print(f"\nresults: {Path(bench.out) / 'results.json'}")
    failed = {name: f["failed"] for name, f in doc["figures"].items() if f["failed"]}
    if failed:
        print(f"error: requests failed: {failed}", file=sys.stderr)
    errors = doc["config"].get("errors", {})
    for name, error in errors.items():  # again, last: a log's tail shows why, before any later policy's echo
        print(f"error: policy {name} failed: {error}", file=sys.stderr)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
