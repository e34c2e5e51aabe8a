"""The ``lora-cache`` command line. Options come from the components' config dataclasses.

The router commands (``hint``, ``lookup``, ``watch``, ``status``, ``register``, ...) are what routers and
operators run in scripts: ``main`` parses them with a parser of their own, from ``client_cli`` (grpc and
the generated stubs only), so they start without importing torch or Ray. Every other command's module
is imported when its parser is built.

Exit status, every command: 0 done; 1 the server, the cluster or the service failed (a ClientError, a
cluster that cannot be joined, an item the server refused); 2 usage: an option or argument that cannot
work (argparse's errors, ``ConfigError``s such as ``serve``'s checks before Ray starts, ``preflight``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lora_cache import __version__
from lora_cache.app.client_cli import CLIENT_COMMANDS, add_client_commands
from lora_cache.errors import ConfigError, LoraCacheError
from lora_cache.runtime.cliargs import add_config_args, add_config_groups, config_from_args, shell_path, shell_paths

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2  # every command: 2 also for argparse's own usage errors


def cmd_make_adapters(ns: argparse.Namespace) -> int:
    from lora_cache.adapters.synth import SynthConfig, make_adapters

    paths = make_adapters(ns.out, config_from_args(SynthConfig, ns))
    for p in paths:
        print(p)
    return 0


def inspect_adapter(directory: str, model: str, tp: int, max_rank: int,
                    store_timeout_s: float = 20.0) -> dict[str, object]:
    """What ``inspect`` prints of the adapter in ``directory``: a local directory or a store prefix
    (``s3://BUCKET/PREFIX/NAME``, read as registration reads it: config and header, no weight byte)."""
    import torch

    from lora_cache.adapters.base_model import adapter_bases, choose_model
    from lora_cache.adapters.objects import StoreUrl, is_store_url
    from lora_cache.adapters.peft import read_adapter
    from lora_cache.adapters.roots import AdapterRoots
    from lora_cache.adapters.shapes import resolve_model
    from lora_cache.adapters.shards import shard_layout

    if is_store_url(directory):
        from lora_cache.adapters.store import read_store_adapter

        url = StoreUrl.parse(directory)
        if not url.key:
            raise ConfigError(f"{directory} names a bucket, not an adapter: give s3://{url.bucket}/PREFIX/NAME")
        parent = str(StoreUrl(url.bucket, url.key.rpartition("/")[0]))
        if not model:  # the adapter's own base model; the read below reports a prefix that is not an adapter
            bases = adapter_bases(parent, url.name, store_timeout_s)  # its config read once
            model = choose_model("", parent, bases=bases) if bases else "tiny"
        shape = resolve_model(model)
        spec = read_store_adapter(url.name, url, shape, max_rank, store_timeout_s)
    else:
        roots = AdapterRoots((Path(directory).resolve().parent,))
        path = roots.resolve(Path(directory).resolve())
        if not model:  # the adapter's own base model; read_adapter reports a directory that is not an adapter
            has_config = (path / "adapter_config.json").is_file()
            model = choose_model("", path.parent, only=path.name) if has_config else "tiny"
        shape = resolve_model(model)
        spec = read_adapter(path.name, path, shape, max_rank, roots)
    ranks = sorted({m.rank for m in spec.modules})
    layouts = [shard_layout(spec, shape, tp, k, getattr(torch, spec.dtype)) for k in range(tp)]
    return {
        "name": spec.name, "path": str(spec.path), "version": spec.version, "model": shape.name,
        "dtype": spec.dtype, "rank": spec.config.r, "ranks": ranks, "lora_alpha": spec.config.lora_alpha,
        "use_rslora": spec.config.use_rslora, "scaling": sorted({round(m.scaling, 6) for m in spec.modules}),
        "modules": sorted({m.module for m in spec.modules}), "layers": len({m.layer for m in spec.modules}),
        "file_bytes": spec.file_bytes, "tp": tp, "shard_bytes": [lay.nbytes for lay in layouts],
    }


def cmd_inspect(ns: argparse.Namespace) -> int:
    info = inspect_adapter(ns.dir, ns.model, ns.tp, ns.max_rank, ns.store_timeout_s)
    if ns.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:12} {v}")
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    from lora_cache.adapters.synth import SynthConfig
    from lora_cache.app.demo import run_demo
    from workers.cache import WorkerConfig

    out = Path(shell_path(ns.out) if ns.out else tempfile.mkdtemp(prefix="lora-cache-demo-"))
    synth = SynthConfig(model=ns.model or "tiny", count=ns.count, rank=ns.rank)
    run_demo(out, synth, config_from_args(WorkerConfig, ns), steps=ns.steps, seed=ns.seed)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    """Every option checked (``preflight``) before Ray starts; then the service, the gateway, and serving on."""
    from lora_cache.adapters.base_model import choose_model
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.adapters.synth import SynthConfig, make_adapters
    from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
    from lora_cache.app import preflight
    from lora_cache.app.serve import ServeConfig, serve_forever, start
    from lora_cache.planner import PlannerConfig
    from lora_cache.routing.ranking import RouterConfig
    from lora_cache.runtime.cluster import ObserveConfig, endpoints
    from workers.cache import WorkerConfig

    gateway_config = config_from_args(GatewayConfig, ns)  # token and TLS files, auth beyond loopback checked here
    demo_token = gateway_config.token_for("router") if ns.demo else None  # the demo router is a router
    observe = config_from_args(ObserveConfig, ns)
    if ns.demo:  # demo adapters of a small shape, unless the caller named their own
        ns.model = ns.model or "tiny"
        ns.max_rank = ns.max_rank or 16
        if not ns.adapters:
            ns.adapters = tempfile.mkdtemp(prefix="lora-cache-demo-")
            make_adapters(ns.adapters, SynthConfig(model=ns.model, count=ns.demo, rank="8,16"))
            print(f"made {ns.demo} demo adapters ({ns.model}) in {ns.adapters}", flush=True)
    serve_config = config_from_args(ServeConfig, ns)
    catalog = config_from_args(CatalogConfig, ns)
    worker = config_from_args(WorkerConfig, ns)
    preflight.check_environment()
    preflight.check_adapters(serve_config.adapters, catalog)
    model = choose_model(catalog.model, serve_config.adapters or None, timeout_s=catalog.store_timeout_s)
    if model != catalog.model:
        print(f"serving base model {model} (from the adapters' base_model_name_or_path; --model to override)",
              flush=True)
        catalog = dataclasses.replace(catalog, model=shell_paths(model, "name_or_file"))
    preflight.check_sizes(catalog, worker, serve_config.tp)
    preflight.check_port(gateway_config)
    service = start(serve_config, catalog, config_from_args(PlannerConfig, ns), worker,
                    config_from_args(RouterConfig, ns), observe)
    try:
        gateway = start_gateway_thread(gateway_config, service.controller, health_name=serve_config.service)
    except BaseException:
        service.stop()
        raise
    where = endpoints()
    print(f"lora-cache gRPC gateway on {gateway.target} (lora_cache.v1.LoraCacheService, health "
          f"{serve_config.service!r}, reflection; {gateway_config.security()})", flush=True)
    print(f"lora-cache metrics (Prometheus, this node): {where['metrics']}; logs of the controller and workers: "
          f"{where['logs']}{' (and here)' if observe.worker_logs else ''}", flush=True)
    if ns.demo:
        from lora_cache.app.serve_demo import run_router_demo

        try:
            names = sorted(p.name for p in Path(ns.adapters).iterdir() if (p / "adapter_config.json").is_file())
            run_router_demo(gateway.target, demo_token, names, requests=2 * ns.demo)
        except BaseException:
            gateway.stop()
            service.stop()
            raise
    serve_forever(service, ns.duration, before_stop=gateway.stop)
    return 0


def _add_service_commands(sub: Any) -> None:
    """The commands that build caches and services (they import torch, and ``serve`` Ray)."""
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.adapters.synth import SynthConfig
    from lora_cache.api.gateway import GatewayConfig
    from lora_cache.app.serve import ServeConfig
    from lora_cache.planner import PlannerConfig
    from lora_cache.routing.ranking import RouterConfig
    from lora_cache.runtime.cluster import ObserveConfig
    from workers.cache import WorkerConfig

    p = sub.add_parser("make-adapters", help="write random PEFT-layout LoRA adapters")
    p.add_argument("out", type=shell_path, help="output directory")
    add_config_args(p, SynthConfig)
    p.set_defaults(func=cmd_make_adapters)

    p = sub.add_parser("inspect", help="rank, scaling, modules, version and per-TP-rank shard bytes of an adapter")
    p.add_argument("dir", type=shell_path, help="adapter directory (adapter_config.json + adapter_model.safetensors), "
                   "or its object-store prefix s3://BUCKET/PREFIX/NAME")
    p.add_argument("--model", default="", type=lambda v: shell_paths(v, "name_or_file"),
                   help="named model shape or path to its config.json (default: the adapter's "
                        "base_model_name_or_path)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--max-rank", type=int, default=1024, help="reject adapters above this rank")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--store-timeout-s", type=float, default=20.0,
                   help="an s3:// adapter's: seconds each store request may take")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="make demo adapters and load them through one worker cache")
    p.add_argument("--out", help="directory for the demo adapters (default: a new temporary directory)")
    p.add_argument("--model", default="tiny", help="named model shape or path to its config.json")
    p.add_argument("--count", type=int, default=12, help="adapters to make (more than slots)")
    p.add_argument("--rank", default="8,16", help="ranks, used in turn")
    p.add_argument("--steps", type=int, default=24, help="engine steps to run")
    p.add_argument("--seed", type=int, default=0, help="seed of adapters and batches")
    add_config_args(p, WorkerConfig)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="start the controller and the replicas' workers on Ray (embedded by default)",
                       description="Start a lora-cache service: its controller, its replicas' workers and the gRPC "
                                   "gateway. Options are grouped by the component they configure.")
    add_config_groups(p, ServeConfig)
    add_config_groups(p, CatalogConfig)
    add_config_groups(p, PlannerConfig)
    add_config_groups(p, RouterConfig)
    add_config_groups(p, WorkerConfig, skip=("tp", "tp_rank", "device"))
    add_config_groups(p, GatewayConfig)
    add_config_groups(p, ObserveConfig)
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: until Ctrl-C)")
    p.add_argument("--demo", type=int, default=0, metavar="N",
                   help="make N demo adapters (tiny shape unless --model; into a temporary directory unless "
                        "--adapters) and drive a router's traffic through the gRPC gateway before serving on")
    p.set_defaults(func=cmd_serve)


def build_parser(service_commands: bool = True) -> argparse.ArgumentParser:
    """Every command's parser; ``service_commands=False``: the router commands' alone (no torch, no Ray)."""
    parser = argparse.ArgumentParser(prog="lora-cache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lora-cache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    if service_commands:
        _add_service_commands(sub)
    add_client_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    router_only = bool(args) and (args[0] in CLIENT_COMMANDS or args[0] == "--version")  # no torch, no Ray
    try:
        parser = build_parser(service_commands=not router_only)
    except ModuleNotFoundError as e:  # a base install (the router's): torch, Ray and the rest are in [server]
        print(f"lora-cache: {e.name} is not installed; the service commands need the server extra: "
              "pip install 'lora-cache[server]' (the router commands work without it: "
              f"{', '.join(sorted(CLIENT_COMMANDS))})", file=sys.stderr)
        return 2
    ns = parser.parse_args(args)
    func: Callable[[argparse.Namespace], int] = ns.func
    try:
        return func(ns)
    except LoraCacheError as e:  # usage: what the user gave cannot work; else the server or service failed
        print(f"lora-cache {ns.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE if e.usage else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
