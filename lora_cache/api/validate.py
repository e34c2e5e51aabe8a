"""Request messages -> checked controller inputs (lifecycle step 2). Plain functions, no gRPC server.

Every check raises RequestError (a malformed request; the servicer answers INVALID_ARGUMENT) with
a message that names the field, the value and the fix. Whether a well-formed name exists is the
controller's business (NotFoundError).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from google.protobuf.message import DecodeError, Message

from lora_cache.adapters.catalog import NAME_RE
from lora_cache.adapters.pushed import TAG_RE
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.errors import LoraCacheError
from lora_cache.routing.advice import RouteRequest

HintTuple = tuple[str, str, str, float]  # (hint id, adapter, replica, expected in seconds from now)
M = TypeVar("M", bound=Message)
Item = TypeVar("Item")
T = TypeVar("T")

HINT_ID_RE = re.compile(r"[!-~]{1,128}")  # printable ASCII, no spaces
MAX_EXPECTED_S = 3600.0
DEFAULT_DRAIN_S, MAX_DRAIN_S = 30.0, 600.0
NAME_FORM = "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
HINT_ID_FORM = "1-128 printable ASCII characters without spaces (a request id works)"
BINDING_FORM = f"REPLICA (every rank) or REPLICA/RANK (that rank only), REPLICA of {NAME_FORM}"
PRIORITIES = frozenset(pb.HintPriority.values())

_name_ok = NAME_RE.match
_hint_id_ok = HINT_ID_RE.fullmatch


def binding_ok(entry: object) -> bool:
    """Whether ``entry`` binds an engine credential: a replica's name, or ``REPLICA/RANK`` for one of its ranks."""
    if not isinstance(entry, str):
        return False
    replica, slash, rank = entry.partition("/")
    return bool(_name_ok(replica)) and (not slash or (rank.isdigit() and rank.isascii() and len(rank) <= 4))


MAX_PATH_CHARS = 4096  # an adapter path in a request (PATH_MAX on Linux)
SHOWN_CHARS = 64  # an error quotes at most this much of a value it refuses


class RequestError(LoraCacheError, ValueError):
    """A malformed request: a bad id, an empty or oversized batch, a bad time, an undecodable body."""


def show(value: object) -> str:
    """``value`` quoted for an error message: its start and its length when it is long (an error that echoes
    a 100 kB name exceeds gRPC's metadata limit and reaches the caller as a transport error)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= SHOWN_CHARS:
        return repr(text) if isinstance(value, str) else text
    return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


def parse(cls: type[M], raw: bytes) -> M:
    """Decode a request body; bytes that are not a ``cls`` are a RequestError, not a crash."""
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        raise RequestError(f"the request body ({len(raw)} bytes) is not a valid {cls.DESCRIPTOR.full_name}: {e}; "
                           "send the serialized request message (use stubs generated from lora_cache.v1)") from e


def name(field: str, value: str, where: str = "") -> str:
    if not _name_ok(value):
        raise RequestError(f"{field} {show(value)}{where} is malformed: use {NAME_FORM}")
    return value


def _ref_ok(value: str) -> bool:
    base, sep, ref = value.partition("@")
    return bool(_name_ok(base)) and (not sep or TAG_RE.match(ref) is not None)


def adapter_ref(field: str, value: str, where: str = "") -> str:
    """An adapter's name, or ``NAME@REF``: one version of it by version or by the tag it was pushed under (the
    value is shown cut short, never echoed whole)."""
    if not _ref_ok(value):
        raise RequestError(f"{field} {show(value)}{where} is malformed: use {NAME_FORM}, or NAME@VERSION / "
                           "NAME@TAG (1-64 letters, digits, '.', '_' or '-') for one version")
    return value


def optional_name(field: str, value: str) -> str | None:
    """An empty filter means 'any'."""
    return name(field, value) if value else None


def count(what: str, n: int, limit: int) -> None:
    if n == 0:
        raise RequestError(f"the batch of {what} is empty; send 1 to {limit} {what} per call")
    if n > limit:
        raise RequestError(f"the batch has {n} {what}, more than this server's max_hints_per_call ({limit}); "
                           f"split it into calls of at most {limit}")


class HintCall(NamedTuple):
    """A checked Hint call: the well-formed hints (with their positions), the malformed ones' errors."""

    items: list[tuple[int, HintTuple]]  # (position in the batch, hint)
    malformed: dict[int, RequestError]  # position -> why (answered for that hint alone)


def hints(items: Sequence[pb.PrefetchHint], limit: int) -> HintCall:
    """A Hint batch as (hint id, adapter, replica, expected in s) tuples; HIGH priority is due now. Its size fails
    the call; a malformed hint only itself (as RegisterAdapters and Route answer their items)."""
    count("hints", len(items), limit)
    return HintCall(*per_item(items, _hint))


def per_item(items: Sequence[Item],
             check: Callable[[int, Item], T]) -> tuple[list[tuple[int, T]], dict[int, RequestError]]:
    """Each item checked by itself (``check(position, item)``): the well-formed ones with their positions, and
    the malformed ones' errors by position (answered for that item alone)."""
    good: list[tuple[int, T]] = []
    malformed: dict[int, RequestError] = {}
    for i, item in enumerate(items):
        try:
            good.append((i, check(i, item)))
        except RequestError as e:
            malformed[i] = e
    return good, malformed


def _hint(i: int, h: pb.PrefetchHint) -> HintTuple:
    hint_id, adapter, replica, priority = h.hint_id, h.adapter, h.replica, h.priority
    if not (_hint_id_ok(hint_id) and _ref_ok(adapter) and _name_ok(replica)) or priority not in PRIORITIES:
        raise RequestError(_bad_hint(i, h))
    expected = 0.0
    if h.HasField("expected_in"):
        expected = _seconds(h.expected_in)
        if not 0.0 <= expected <= MAX_EXPECTED_S:
            raise RequestError(f"hint {i} ({show(hint_id)}): expected_in is {expected:g} s; give 0 to "
                               f"{MAX_EXPECTED_S:g} s from now (leave it unset for 'now')")
    return hint_id, adapter, replica, 0.0 if priority == pb.HINT_PRIORITY_HIGH else expected


def _bad_hint(i: int, h: pb.PrefetchHint) -> str:
    where = f"hint {i} of the batch"
    if not _hint_id_ok(h.hint_id):
        return f"{where}: hint_id {show(h.hint_id)} is malformed: use {HINT_ID_FORM}"
    where = f"{where} ({show(h.hint_id)})"
    if not _ref_ok(h.adapter):
        return f"{where}: adapter {show(h.adapter)} is malformed: use {NAME_FORM}, or NAME@VERSION / NAME@TAG"
    if not _name_ok(h.replica):
        return f"{where}: replica {show(h.replica)} is malformed: use {NAME_FORM}"
    return (f"{where}: priority {h.priority} is not a HintPriority; use HINT_PRIORITY_NORMAL or "
            "HINT_PRIORITY_HIGH")


def hint_ids(items: Sequence[str], limit: int) -> list[str]:
    count("hint ids", len(items), limit)
    for i, hint_id in enumerate(items):
        if not _hint_id_ok(hint_id):
            raise RequestError(f"hint id {i} of the batch, {show(hint_id)}, is malformed: use {HINT_ID_FORM}")
    return list(items)


def queue(request: pb.ReportQueueRequest, limit: int) -> tuple[str, list[tuple[str, float]]]:
    """(replica, [(adapter, arrival in s since the epoch)]) in queue order; an empty queue is valid."""
    replica = name("replica", request.replica)
    if len(request.requests) > limit:
        raise RequestError(f"the queue of {show(replica)} has {len(request.requests)} requests, more than this "
                           f"server's max_hints_per_call ({limit}); report the first {limit} (the head matters most)")
    entries = []
    for i, r in enumerate(request.requests):
        adapter_ref("adapter", r.adapter, f" (queue position {i})")  # NAME@REF: a request naming one version
        if not r.HasField("arrival_time"):
            raise RequestError(f"queue position {i} ({show(r.adapter)}) has no arrival_time; set it to when the "
                               "request arrived (it tells new arrivals from ones already reported)")
        entries.append((r.adapter, _seconds(r.arrival_time)))
    return replica, entries


class RouteCall(NamedTuple):
    """A checked Route call: the well-formed items (with their positions), the malformed ones' errors."""

    items: list[tuple[int, RouteRequest]]  # (position in the batch, item)
    malformed: dict[int, RequestError]  # position -> why (answered for that item alone)
    request_ids: list[str]  # by position
    outstanding: dict[str, float]  # the router's in-flight counts per replica
    max_replicas: int  # 0: all
    finished: list[tuple[str, str]]  # (replica, adapter): the router's requests finished since its last call


def route(request: pb.RouteRequest, limit: int) -> RouteCall:
    """A Route batch: its size and the outstanding map fail the call; a malformed item fails only itself."""
    count("route items", len(request.items), limit)
    outstanding = {name("replica", r, " (a key of outstanding_requests)"): float(n)
                   for r, n in sorted(request.outstanding_requests.items())}
    if len(request.finished_requests) > limit:
        raise RequestError(f"the call reports {len(request.finished_requests)} finished requests, more than this "
                           f"server's max_hints_per_call ({limit}); send the rest with the next call")
    finished = [(name("replica", f.replica, f" (finished_requests {i})"),
                 adapter_ref("adapter", f.adapter, f" (finished_requests {i})"))
                for i, f in enumerate(request.finished_requests)]
    good, malformed = per_item(request.items, _route_item)
    return RouteCall(good, malformed, [item.request_id for item in request.items], outstanding, request.max_replicas,
                     finished)


def _route_item(i: int, item: pb.RouteItem) -> RouteRequest:
    where = f" (item {i})"
    adapter_ref("adapter", item.adapter, where)
    if item.version:
        name("version", item.version, where)
        if "@" in item.adapter:
            raise RequestError(f"item {i} names a version twice (adapter {show(item.adapter)}, version "
                               f"{show(item.version)}); give NAME@REF or NAME with a version, not both")
    if item.request_id and not _hint_id_ok(item.request_id):
        raise RequestError(f"request_id {show(item.request_id)}{where} is malformed: use {HINT_ID_FORM}, "
                           "or leave it empty")
    return RouteRequest(item.adapter, item.version, item.tokens)


def watch(request: pb.WatchReadinessRequest) -> tuple[str | None, str | None, int | None]:
    """(replica filter, adapter filter, cursor or None for 'from now')."""
    after = request.after_seq if request.HasField("after_seq") else None
    adapter = adapter_ref("adapter", request.adapter) if request.adapter else None  # NAME@REF: one version's events
    return optional_name("replica", request.replica), adapter, after


def register(request: pb.RegisterAdapterRequest, where: str = "") -> tuple[str, str, str]:
    """(name, path, request id or "")."""
    if len(request.path) > MAX_PATH_CHARS:
        raise RequestError(f"path{where} has {len(request.path)} characters, more than {MAX_PATH_CHARS}; give the "
                           "adapter's directory by a shorter path (relative to an adapter root)")
    if "\0" in request.path:
        raise RequestError(f"path{where} {show(request.path)} contains a NUL byte; give a file system path")
    if not request.path:
        raise RequestError(f"path{where} is empty; give the directory of adapter {show(request.name)} under an adapter "
                           "root")
    if request.request_id and not _hint_id_ok(request.request_id):
        raise RequestError(f"request_id{where} {show(request.request_id)} is malformed: use 1-128 printable ASCII "
                           "characters without spaces (a UUID, say), or leave it empty")
    return name("name", request.name, where), request.path, request.request_id


class RegisterCall(NamedTuple):
    """A checked RegisterAdapters call: the well-formed items (with their positions), the malformed ones' errors."""

    items: list[tuple[int, tuple[str, str, str]]]  # (position in the batch, (name, path, request id or ""))
    malformed: dict[int, RequestError]  # position -> why (answered for that item alone)


def register_many(request: pb.RegisterAdaptersRequest, limit: int) -> RegisterCall:
    """A RegisterAdapters batch: its size fails the call; a malformed item (or a name given twice) only itself."""
    count("adapters", len(request.adapters), limit)
    call, first = RegisterCall([], {}), dict[str, int]()
    for i, item in enumerate(request.adapters):
        try:
            adapter = register(item, f" (item {i})")
            if adapter[0] in first:
                raise RequestError(f"adapter {show(adapter[0])} (item {i}) is named again in this batch (first as item "
                                   f"{first[adapter[0]]}); name each adapter once per call")
        except RequestError as e:
            call.malformed[i] = e
            continue
        first[adapter[0]] = i
        call.items.append((i, adapter))
    return call


def drain_timeout(request: pb.UnregisterAdapterRequest) -> float:
    if not request.HasField("drain_timeout"):
        return DEFAULT_DRAIN_S
    seconds = _seconds(request.drain_timeout)
    if not 0.0 < seconds <= MAX_DRAIN_S:
        raise RequestError(f"drain_timeout is {seconds:g} s; give more than 0 and at most {MAX_DRAIN_S:g} s "
                           f"(unset: {DEFAULT_DRAIN_S:g} s)")
    return seconds


def _seconds(value: Any) -> float:
    """A Duration or Timestamp in seconds."""
    return float(value.seconds + value.nanos * 1e-9)
