"""``lora-cache hint | cancel-hint | lookup | route | watch | status | register | unregister | pool``: the client
on the command line (``register`` also registers many adapters in batches: ``NAME=PATH ...``, ``--dir DIR``).

``cli.build_parser`` adds these with ``add_client_commands(sub)``. Connection options come from
``ClientConfig`` (``--server``, ``--token-file``, ``--tls-ca``, ``--tls``, ``--timeout-s``: each call's deadline,
and how long ``watch`` streams); failures are ClientErrors, which ``cli.main`` prints with the server's
message (exit status 1; usage errors 2). Every command prints one JSON style: snake_case keys, numbers as
numbers (``proto_json`` for the messages printed as they come).

This module imports grpc and the generated stubs only, never torch or Ray: ``cli.main`` parses these
commands with a parser of their own, so a router's script starts them in a fraction of a second
(``bench/probes/cli_startup.py`` measures it; ``tests/test_cli.py`` checks ``sys.modules``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from lora_cache.api.client import ClientConfig, Hint, LoraCacheClient, Resync, RouteItem
from lora_cache.errors import ConfigError
from lora_cache.runtime.cliargs import add_config_args, config_from_args, shell_path

EXIT_FAILED = 1  # an item the server refused (cli.EXIT_FAILED)
STORE_LIST_TIMEOUT_S = 20.0  # each request of listing ``register --dir s3://...`` (the catalog's default timeout)


def _client(ns: argparse.Namespace) -> LoraCacheClient:
    return LoraCacheClient.from_config(config_from_args(ClientConfig, ns))


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _field_json(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return proto_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else value
    return value


def proto_json(message: Message) -> dict[str, Any]:
    """``message`` as the client commands print it: proto field names (snake_case), every field (unset ones at
    their defaults), 64-bit integers as numbers (``MessageToDict`` makes them strings and keys camelCase)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _field_json(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_field_json(field, v) for v in value]
        else:
            out[field.name] = _field_json(field, value)
    return out


def cmd_hint(ns: argparse.Namespace) -> int:
    with _client(ns) as lc:
        result = lc.hint([Hint(ns.hint_id or uuid.uuid4().hex, ns.adapter, ns.replica, ns.expected_in_s,
                               ns.high_priority)])
    if result.rejections:  # the one hint was wrong: its error, as when the whole call failed (exit 1)
        raise result.rejections[0].error
    if ns.json:
        _print({"accepted": result.accepted, "ignored": result.ignored})
    else:
        print(f"accepted {result.accepted}, ignored {result.ignored}")
    return 0


def cmd_cancel_hint(ns: argparse.Namespace) -> int:
    with _client(ns) as lc:
        print(f"cancelled {lc.cancel_hint(*ns.hint_ids)}")
    return 0


def cmd_lookup(ns: argparse.Namespace) -> int:
    with _client(ns) as lc:
        found = lc.lookup(ns.adapter)
    _print(found._asdict())
    return 0


def cmd_route(ns: argparse.Namespace) -> int:
    """Ranked replicas per adapter (JSON); exit 1 if any item could not be routed (its error is printed)."""
    outstanding = {}
    for pair in ns.outstanding:
        replica, sep, n = pair.partition("=")
        if not sep or not n.isdigit():
            raise ConfigError(f"--outstanding {pair!r} is malformed; give REPLICA=N, e.g. replica-0=3")
        outstanding[replica] = int(n)
    items = [RouteItem(a, ns.version, ns.request_id, ns.tokens) for a in ns.adapters]
    with _client(ns) as lc:
        routes = lc.route(items, outstanding, ns.max_replicas)
    _print([{**r._asdict(), "replicas": [x._asdict() for x in r.replicas],
             "error": None if r.error is None else {"code": r.error.code, "message": r.error.message}}
            for r in routes])
    return EXIT_FAILED if any(r.error is not None for r in routes) else 0


def cmd_watch(ns: argparse.Namespace) -> int:
    """Events until ``--count``, Ctrl-C, or ``--timeout-s`` (if given: the stream's deadline; exit 0)."""
    with _client(ns) as lc, contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends the watch
        for n, event in enumerate(lc.watch(ns.replica, ns.adapter, ns.after_seq, duration_s=ns.timeout_s), start=1):
            line = {"resync": event._asdict()} if isinstance(event, Resync) else event._asdict()
            print(json.dumps(line), flush=True)  # a resync: events were lost, "ready" is the state now
            if n == ns.count:
                break
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    with _client(ns) as lc:
        _print(proto_json(lc.status()))
    return 0


def cmd_register(ns: argparse.Namespace) -> int:
    """``register NAME PATH`` (one adapter), or many in batches: ``register NAME=PATH ...`` and/or ``--dir DIR``
    (every adapter directory under DIR, by its directory name). Many: one JSON entry each, exit 1 if any
    item was not registered (its error is printed; the others were)."""
    items = register_items(ns.items, ns.dir)
    if items is None:
        with _client(ns) as lc:
            _print(lc.register(ns.items[0], register_path(ns.items[1]))._asdict())
        return 0
    done = []
    with _client(ns) as lc:
        for start in range(0, len(items), ns.batch):
            done += lc.register_many(items[start:start + ns.batch])
    _print([{**d._asdict(), "error": None if d.error is None else {"code": d.error.code, "message": d.error.message},
             "rank_errors": list(d.rank_errors), "rank_pending": list(d.rank_pending)} for d in done])
    return EXIT_FAILED if any(d.error is not None for d in done) else 0


def register_items(args: list[str], directory: str | None) -> list[tuple[str, str]] | None:
    """The (name, path) items ``register`` was given; None for the one-adapter form ``NAME PATH``."""
    if directory is None and len(args) == 2 and not any("=" in a for a in args):
        return None
    bad = [a for a in args if a.partition("=")[1] != "=" or not a.partition("=")[0] or not a.partition("=")[2]]
    if bad or (directory is None and not args):
        raise ConfigError(f"{bad[0] if bad else 'nothing to register'!r}: give NAME PATH for one "
                         "adapter, NAME=PATH items for several, or --dir DIR for every adapter directory under DIR")
    items = [(n, register_path(p)) for n, _, p in (a.partition("=") for a in args)]
    if directory is not None and directory.startswith("s3://"):  # every adapter prefix under it, listed from here
        from lora_cache.adapters.objects import StoreUrl  # deferred: boto3 and the adapter modules only for s3://
        from lora_cache.adapters.store import list_adapters
        from lora_cache.errors import LoraCacheError

        try:
            items += [(n, str(url)) for n, url in list_adapters(StoreUrl.parse(directory), STORE_LIST_TIMEOUT_S)]
        except LoraCacheError as e:
            raise SystemExit(f"lora-cache register: --dir {directory}: {e}") from e
    elif directory is not None:
        local = Path(shell_path(directory))
        if not local.is_dir():
            raise ConfigError(f"--dir {directory!r} is not a directory here; give a directory "
                             "whose subdirectories are adapters (adapter_config.json + adapter_model.safetensors)")
        items += [(d.name, str(d)) for d in sorted(local.iterdir()) if (d / "adapter_config.json").is_file()]
        if not items:
            raise ConfigError(f"--dir {directory!r} holds no adapter directory (none with an "
                             "adapter_config.json); is it the right directory?")
    return items


def cmd_unregister(ns: argparse.Namespace) -> int:
    with _client(ns) as lc:
        _print({"name": ns.name, "evicted_versions": lc.unregister(ns.name, ns.drain_timeout_s)})
    return 0


def cmd_pool(ns: argparse.Namespace) -> int:
    with _client(ns) as lc:
        _print(proto_json(lc.resize_pool(ns.replica, ns.lend_bytes, ns.keep)))
    return 0


def _bytes(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of bytes (an integer >= 0)")
    return int(value)


def register_path(path: str) -> str:
    """The path ``register`` sends: one that exists from here, as the shell user means it (absolute), else
    as given (the server takes a relative path from its first adapter root)."""
    local = shell_path(path)
    return local if Path(local).exists() else path


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return int(value)


def add_client_commands(sub: Any) -> None:
    """Add the client subcommands to ``sub`` (the parser's ``add_subparsers()`` object)."""
    p = sub.add_parser("hint", help="tell the gateway a request for ADAPTER is heading to a replica")
    p.add_argument("adapter")
    p.add_argument("--replica", required=True, help="replica the request was routed to")
    p.add_argument("--hint-id", help="idempotency id (default: a random one)")
    p.add_argument("--expected-in-s", type=float, help="when the request needs the adapter, from now (default: now)")
    p.add_argument("--high-priority", action="store_true", help="plan it as due now, ahead of normal hints")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=cmd_hint)

    p = sub.add_parser("cancel-hint", help="withdraw hints by id")
    p.add_argument("hint_ids", nargs="+")
    p.set_defaults(func=cmd_cancel_hint)

    p = sub.add_parser("lookup", help="replicas where ADAPTER is ready or loading (JSON)")
    p.add_argument("adapter")
    p.set_defaults(func=cmd_lookup)

    p = sub.add_parser("route", help="replicas ranked for requests of ADAPTER (ready, loading, staged, cold; "
                       "expected wait; bounded load), one JSON entry per adapter given")
    p.add_argument("adapters", nargs="+", metavar="ADAPTER", help="routed in order, each taking load before the next")
    p.add_argument("--version", default="", help="the version the request was admitted with (default: current)")
    p.add_argument("--request-id", default="", help="your request id, echoed back")
    p.add_argument("--tokens", type=int, default=0, help="prompt tokens of each request")
    p.add_argument("--max-replicas", type=int, default=0, help="replicas per adapter (0: all)")
    p.add_argument("--outstanding", action="append", default=[], metavar="REPLICA=N",
                   help="your own count of requests in flight at a replica (repeat per replica)")
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("watch", help="stream readiness events, one JSON object per line")
    p.add_argument("--replica", help="only this replica's events")
    p.add_argument("--adapter", help="only this adapter's events")
    p.add_argument("--after-seq", type=int, help="resume after this event sequence number (default: from now); "
                   "if events after it are gone, the first line is {\"resync\": ...} with the state now")
    p.add_argument("--count", type=int, default=0, help="stop after this many events (0: until Ctrl-C)")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("status", help="replicas, workers, residency counts, hit rates, queue depths (JSON)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("register", help="register (or re-register: new content, new version) an adapter, or many: "
                       "NAME PATH, or NAME=PATH ..., and/or --dir DIR")
    p.add_argument("items", nargs="*", metavar="NAME PATH | NAME=PATH",
                   help="NAME PATH: one adapter directory under one of the server's adapter roots; NAME=PATH ...: "
                        "several, registered in batches, each by itself")
    p.add_argument("--dir", help="also every adapter directory under DIR (named after its directory), or every "
                   "adapter prefix under s3://BUCKET/PREFIX (listed with this shell's AWS_* credentials)")
    p.add_argument("--batch", type=_positive, default=1000, help="adapters per RegisterAdapters call")
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("unregister", help="remove an adapter once no running batch uses it")
    p.add_argument("name")
    p.add_argument("--drain-timeout-s", type=float, help="wait this long for in-use references (default: 30)")
    p.set_defaults(func=cmd_unregister)

    p = sub.add_parser("pool", help="lend part of every GPU adapter pool of a replica's ranks to their engine, or take "
                       "it back (JSON: each rank's pool after)")
    p.add_argument("--replica", required=True)
    p.add_argument("--lend-bytes", type=_bytes, required=True,
                   help="bytes each rank lends in all, whole pages (0: every page back)")
    p.add_argument("--keep", action="append", default=[], metavar="ADAPTER",
                   help="an adapter needed soon, evicted last (repeat)")
    p.set_defaults(func=cmd_pool)

    for parser in sub.choices.values():
        if parser.get_default("func") in _COMMANDS:
            add_config_args(parser, ClientConfig)


_COMMANDS = (cmd_hint, cmd_cancel_hint, cmd_lookup, cmd_route, cmd_watch, cmd_status, cmd_register, cmd_unregister,
             cmd_pool)
CLIENT_COMMANDS = ("hint", "cancel-hint", "lookup", "route", "watch", "status", "register", "unregister", "pool")
