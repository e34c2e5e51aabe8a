"""Registration from an S3-compatible object store (lifecycle step 0; issue 29).

``read_store_adapter`` reads only metadata, in two requests: ``adapter_config.json`` (one GET), then the weights
object's first ``HEAD_GUESS`` bytes (one ranged GET), whose answer carries its identity (ETag, VersionId, and its size
in ``Content-Range``) and most adapters' whole safetensors header (a longer header: a second ranged GET with
``If-Match`` on that ETag); never the weights. The version is a hash
of the config's bytes and of that identity and header CRC (``objects.StoreSource``). ``list_adapters`` finds
every adapter prefix directly under a prefix (``serve --adapters s3://bucket/prefix``).

The client is boto3's (docs/decisions.md, "Adapters from an object store"): it takes the endpoint, region
and credentials the usual ways (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, ``~/.aws/config`` and ``~/.aws/credentials``). Every failure is
one of the domain errors, naming the bucket and key and the fix (``store_error``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lora_cache.adapters.files import MAX_CONFIG_BYTES
from lora_cache.adapters.header import parse_header
from lora_cache.adapters.objects import StoreSource, StoreUrl, pack_meta, unpack_meta
from lora_cache.adapters.peft import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterSpec,
    KnownVersion,
    built_spec,
    parse_config,
)
from lora_cache.adapters.shapes import ModelShape
from lora_cache.adapters.store_pace import StorePace, StoreThrottled
from lora_cache.errors import (
    AdapterChangedError,
    AdapterFormatError,
    AdapterMissingError,
    AdapterPathError,
    AdapterStoreError,
)

HEAD_GUESS = 64 << 10  # first ranged GET of the weights: the 8-byte length and most adapters' whole header
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
ATTEMPTS = 2  # tries of one request (botocore's "standard" retry conditions: a dropped connection, a 5xx, a throttle)
DEADLINE = "lora_cache_deadline"  # the key of a call's deadline (time.monotonic()) in botocore's request context

_CLIENTS_LOCK = threading.Lock()  # protects _CLIENTS (boto3 sessions are not thread-safe; clients are)
_CLIENTS: dict[tuple[Any, ...], Any] = {}
ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)  # a change of any makes a new client


class CallDeadline:
    """``timeout_s`` as the deadline of each whole S3 call, its attempts and backoff included: botocore applies
    its timeouts per attempt and retries, so a stalled store cost ``attempts`` x ``timeout_s`` (a 3 s timeout
    failed after ~9 s). Hooked on the client's events: ``before-call`` sets the call's deadline, ``before-send``
    gives each attempt only the time left as its read timeout (botocore's request-context ``read_timeout``: 1.44
    honours it; a botocore that does not keeps ``timeout_s`` per attempt, so a call may end one attempt late),
    and ``needs-retry`` retries what botocore's standard conditions retry only while the backoff ends before the
    deadline. The answer's body
    is read after the call, each read bounded by the read timeout of the attempt that answered."""

    def __init__(self, timeout_s: float, attempts: int) -> None:
        from botocore.retries import standard

        self.timeout_s = timeout_s
        self.conditions = standard.StandardRetryConditions(max_attempts=attempts)
        self.backoff = standard.ExponentialBackoff()
        self.adapter = standard.RetryEventAdapter()

    def hook(self, s3: Any) -> None:
        events = s3.meta.events
        events.register("before-call.s3", self.start)
        events.register("before-send.s3", self.attempt)
        events.register_first("needs-retry.s3", self.retry_delay)

    def start(self, context: dict[str, Any], **_: Any) -> None:
        context[DEADLINE] = time.monotonic() + self.timeout_s

    def attempt(self, request: Any, **_: Any) -> None:
        context = getattr(request, "context", None)
        if context is not None and DEADLINE in context:
            context["read_timeout"] = max(0.001, context[DEADLINE] - time.monotonic())

    def retry_delay(self, **kwargs: Any) -> float | None:
        """Seconds to wait before the next attempt, or None: no retry (botocore raises or returns the last)."""
        retry = self.adapter.create_retry_context(**kwargs)
        if not self.conditions.is_retryable(retry):
            return None
        delay = float(self.backoff.delay_amount(retry))
        deadline = kwargs["request_dict"]["context"].get(DEADLINE, float("inf"))
        return delay if time.monotonic() + delay < deadline else None


def client(timeout_s: float, attempts: int = ATTEMPTS, pool: int = 32) -> Any:
    """A boto3 S3 client (shared per process and settings) whose every call, its ``attempts`` tries and their
    backoff included, gives up ``timeout_s`` after it started (``CallDeadline``)."""
    key = (timeout_s, attempts, pool, *(os.environ.get(v, "") for v in ENV))
    with _CLIENTS_LOCK:
        made = _CLIENTS.get(key)
        if made is None:
            import boto3  # deferred: ~0.3 s, paid only by a process that uses a store
            from botocore.config import Config

            config = Config(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                max_pool_connections=pool,
                # botocore's own handler never retries (its "max_attempts" counts retries: 2 made 3 tries);
                # CallDeadline retries, within the deadline
                retries={"total_max_attempts": 1, "mode": "standard"},
            )
            made = _CLIENTS[key] = boto3.session.Session().client("s3", config=config)
            CallDeadline(timeout_s, attempts).hook(made)
            made.lora_cache_pace = StorePace(pool)  # its requests in flight, fewer while the store throttles
        return made


def endpoint(s3: Any) -> str:
    return str(s3.meta.endpoint_url)


def store_error(e: BaseException, bucket: str, key: str, s3: Any, version: str = "", etag: str = "") -> Exception:
    """``e`` (from botocore) as a domain error that names ``s3://bucket/key``, what went wrong and the fix."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    url, where = f"s3://{bucket}/{key}", endpoint(s3)
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code == "NoSuchBucket":
            return AdapterPathError(
                f"{url}: bucket {bucket!r} does not exist at {where}; check the URL's bucket, "
                "and that AWS_ENDPOINT_URL (or the profile's endpoint_url) names your store"
            )
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return AdapterMissingError(
                f"{url} does not exist at {where}; check the key (an adapter's prefix holds "
                f"{CONFIG_FILE} and {WEIGHTS_FILE}) or upload it"
            )
        if code in ("PreconditionFailed", "412") or status == 412:
            return AdapterChangedError(
                f"{url} was replaced in the store since it was registered as version "
                f"{version} (its ETag is no longer {etag}); the fetch is refused and nothing "
                "of it is kept: register the adapter again for the new version"
            )
        if (
            code
            in (
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "403",
                "Forbidden",
                "ExpiredToken",
                "InvalidToken",
            )
            or status == 403
        ):
            return AdapterStoreError(
                f"{url}: the store at {where} refused the credentials ({code}); set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE and "
                "~/.aws/credentials) to keys that may read this bucket"
            )
        return AdapterStoreError(
            f"{url}: the store at {where} answered {status} {code}: "
            f"{e.response.get('Error', {}).get('Message', '')}; retry, or check the store"
        )
    if isinstance(e, NoCredentialsError):
        return AdapterStoreError(
            f"{url}: no credentials for the object store; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials"
        )
    if isinstance(e, BotoCoreError | OSError):
        return AdapterStoreError(
            f"{url}: the store at {where} did not answer or broke off ({type(e).__name__}: {e}; each call, "
            f"retries included, has --store-timeout-s {s3.meta.config.read_timeout:g} s); check that it is up "
            "and reachable, or raise --store-timeout-s"
        )
    return e if isinstance(e, Exception) else RuntimeError(str(e))


def call(s3: Any, bucket: str, key: str, fn: Callable[[], Any], version: str = "", etag: str = "") -> Any:
    """``fn()`` (one request) in a turn of the client's ``StorePace`` (throttles retried); errors: ``store_error``."""
    from botocore.exceptions import BotoCoreError, ClientError

    pace = getattr(s3, "lora_cache_pace", None) or StorePace(1 << 20)  # a client made elsewhere: no window
    try:
        return pace.paced(fn, s3.meta.config.read_timeout)
    except StoreThrottled as e:
        raise AdapterStoreError(
            f"s3://{bucket}/{key}: the store at {endpoint(s3)} kept asking to slow down ({e.cause}; {e}, "
            f"{int(pace.window)} requests in flight now) until the call's --store-timeout-s; retry later, read "
            "fewer adapters at once (--store-reads), or raise --store-timeout-s") from e.cause
    except (BotoCoreError, ClientError, OSError) as e:
        raise store_error(e, bucket, key, s3, version, etag) from e


def stream_range(
    s3: Any,
    bucket: str,
    key: str,
    start: int,
    nbytes: int,
    etag: str,
    version: str,
    sink: Callable[[int, memoryview], None],
    chunk: int = 1 << 20,
    direct: bool = False,
) -> None:
    """Bytes ``start : start + nbytes`` of the object, only from the version whose ETag is ``etag`` (the store
    refuses any other: ``AdapterChangedError``), handed to ``sink(offset, piece)`` in pieces of ``chunk`` bytes
    (the last one shorter) as they arrive: one GET, constant memory. A short answer is refused. ``piece`` is a
    view of one reused buffer, valid only during the call. ``direct`` (a large fetch): the socket's bytes are
    read straight into that buffer (``readinto`` of the HTTP response under urllib3's, no copy; the length is
    checked here), where the response allows it."""
    got = 0

    def fetch() -> None:
        nonlocal got
        answer = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + nbytes - 1}", IfMatch=etag)
        if answer.get("ETag", etag) != etag:  # a store that ignores If-Match
            raise AdapterChangedError(
                f"s3://{bucket}/{key} was replaced in the store (ETag {etag} -> "
                f"{answer['ETag']}) since it was registered as version {version}; refused: "
                "register the adapter again"
            )
        body = answer["Body"]
        fp = _direct_fp(body) if direct else None
        view = memoryview(bytearray(min(chunk, nbytes)))
        clean = False
        try:
            while got < nbytes:
                n = _fill(body, fp, view[: min(chunk, nbytes - got)])
                if not n:
                    break
                sink(start + got, view[:n])
                got += n
            if got == nbytes and (fp.read(1) if fp is not None else body.read(1)):
                got += 1  # longer than asked: refused below
            clean = got == nbytes
        finally:
            if fp is not None:  # urllib3 did not see the bytes: hand its connection back (or drop it) here
                if clean:
                    body._raw_stream.release_conn()
                else:
                    body.close()

    call(s3, bucket, key, fetch, version, etag)
    if got != nbytes:
        raise AdapterChangedError(
            f"s3://{bucket}/{key}: the store sent {got} of the {nbytes} bytes asked from byte "
            f"{start} (the object is shorter than registered, or the answer was cut off); "
            "refused: check the object and register the adapter again"
        )


def _direct_fp(body: Any) -> Any:
    """The ``http.client`` response under botocore's streaming body, if its bytes are the object's as sent (no
    content coding, not chunked) and it can ``readinto``; else None (``body.read`` is used)."""
    raw: Any = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if raw is None or fp is None or not hasattr(fp, "readinto") or getattr(raw, "chunked", True):
        return None
    if raw.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        return None
    return fp


def _fill(body: Any, fp: Any, view: memoryview) -> int:
    """Bytes read into ``view``: all of it, fewer only at the body's end."""
    n = 0
    while n < len(view):
        if fp is not None:
            got = fp.readinto(view[n:])
        else:
            piece = body.read(len(view) - n)
            got = len(piece)
            view[n : n + got] = piece
        if not got:
            break
        n += got
    return n


def get_range(s3: Any, bucket: str, key: str, start: int, nbytes: int, etag: str, version: str = "") -> bytes:
    """``stream_range``'s bytes in memory (a header)."""
    out = bytearray()
    stream_range(s3, bucket, key, start, nbytes, etag, version, lambda _, piece: out.extend(piece))
    return bytes(out)


def read_store_adapter(
    name: str,
    url: StoreUrl,
    shape: ModelShape,
    max_rank: int,
    timeout_s: float,
    known: KnownVersion | None = None,
    carried: bool = False,
) -> AdapterSpec:
    """The adapter under ``url`` validated from its config and safetensors header, versioned by the store's
    identity of its weights object; no weight byte is read. ``known``: the version as registered before, kept
    (the same ``StoreSource`` object) if the store still holds exactly it. ``carried`` (a rank taking the
    controller's registration): ``known``'s carried config and header are taken without asking the store
    (``_known_spec``); the registering process itself always asks (a re-registration must see a new version)."""
    weights = url / WEIGHTS_FILE
    if (
        carried
        and known is not None
        and known.meta
        and isinstance(known.source, StoreSource)
        and (known.source.bucket, known.source.key) == (url.bucket, weights.key)
    ):
        return _known_spec(name, url, shape, max_rank, known)
    s3 = client(timeout_s)
    config_key = (url / CONFIG_FILE).key
    config_bytes = _config_bytes(s3, url.bucket, config_key)
    config = parse_config(config_bytes, url / CONFIG_FILE)
    first, etag, size, version_id = _first_range(s3, url.bucket, weights.key)
    n = int.from_bytes(first[:8], "little") if len(first) >= 8 else -1
    if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
        raise AdapterFormatError(
            f"{weights} is not a readable safetensors file (its header length {n} does not fit "
            f"its {size} bytes); it may be truncated or corrupt: upload it again"
        )
    head_bytes = (
        first[: 8 + n]
        if len(first) >= 8 + n
        else first + get_range(s3, url.bucket, weights.key, len(first), 8 + n - len(first), etag)
    )
    try:
        header = parse_header(head_bytes[8:], size)
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterFormatError(
            f"{weights} is not a readable safetensors file ({e}); it may be truncated or corrupt: upload it again"
        ) from e
    config_digest = hashlib.blake2b(config_bytes, digest_size=8).hexdigest()
    header_crc = zlib.crc32(head_bytes)
    version = _version(config_bytes, url.bucket, weights.key, etag, version_id, size, header_crc)
    source = StoreSource(url.bucket, weights.key, version, etag, version_id, size, 8 + n, header_crc)
    if known is not None and known.source == source and known.config_digest == config_digest:
        source = known.source  # type: ignore[assignment]  # the same version: its proof kept as it was
    spec = built_spec(name, url, config, header, shape, max_rank, source.version, size, None, config_digest, source)
    return dataclasses.replace(spec, store_meta=pack_meta(config_bytes, head_bytes))


def _first_range(s3: Any, bucket: str, key: str) -> tuple[bytes, str, int, str]:
    """The object's first ``HEAD_GUESS`` bytes (all of it, if shorter) with its identity (ETag, size, VersionId),
    in one ranged GET: what a HEAD and a GET told before, in one round trip (registration's second request)."""
    from botocore.exceptions import ClientError

    def fetch() -> tuple[bytes, str, int, str]:
        try:
            answer = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{HEAD_GUESS - 1}")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":  # an empty object has no byte 0
                return b"", "", 0, ""
            raise
        total = str(answer.get("ContentRange", "")).rpartition("/")[2]
        body = answer["Body"].read(HEAD_GUESS + 1)
        size = int(total) if total.isdigit() else len(body)  # a store that ignores Range sends it all
        return bytes(body[:HEAD_GUESS]), str(answer["ETag"]), size, str(answer.get("VersionId") or "")

    return call(s3, bucket, key, fetch)  # type: ignore[no-any-return]


def _version(config: bytes, bucket: str, key: str, etag: str, version_id: str, size: int, header_crc: int) -> str:
    digest = hashlib.blake2b(config, digest_size=8)
    digest.update(f"s3\0{bucket}\0{key}\0{etag}\0{version_id}\0{size}\0{header_crc}".encode())
    return digest.hexdigest()


def _known_spec(name: str, url: StoreUrl, shape: ModelShape, max_rank: int, known: KnownVersion) -> AdapterSpec:
    """The spec of the version the registering process read (``known``), from the config and header it carries:
    no request to the store. The carried bytes must be the ones that version was hashed from (its config
    digest, header length and CRC, and the version itself), so they cannot stand for another version; the
    weights are proven by the first fetch (``If-Match`` on the ETag, the header CRC: ``workers.staging.store_fetch``).
    The spec keeps no ``store_meta`` (a rank holds what it loads, not every header)."""
    source = known.source
    assert isinstance(source, StoreSource)
    weights = url / WEIGHTS_FILE
    config_bytes, head_bytes = unpack_meta(known.meta, str(weights))
    config_digest = hashlib.blake2b(config_bytes, digest_size=8).hexdigest()
    header_crc = zlib.crc32(head_bytes)
    version = _version(config_bytes, source.bucket, source.key, source.etag, source.version_id, source.size, header_crc)
    if (config_digest, len(head_bytes), header_crc, version) != (
        known.config_digest,
        source.header_bytes,
        source.header_crc,
        known.version,
    ) or source.version != known.version:
        raise AdapterChangedError(
            f"{weights}: the registration's carried config and header are not those of version "
            f"{known.version} (config digest {config_digest}, header CRC {header_crc}); refused: register "
            "the adapter again"
        )
    config = parse_config(config_bytes, url / CONFIG_FILE)
    try:
        header = parse_header(head_bytes[8:], source.size)
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterFormatError(f"{weights} is not a readable safetensors file ({e}); upload it again") from e
    return built_spec(
        name, url, config, header, shape, max_rank, source.version, source.size, None, config_digest, source
    )


def _config_bytes(s3: Any, bucket: str, key: str) -> bytes:
    def fetch() -> bytes:
        answer = s3.get_object(Bucket=bucket, Key=key)
        if int(answer.get("ContentLength", 0)) > MAX_CONFIG_BYTES:
            raise AdapterFormatError(
                f"s3://{bucket}/{key} is {answer['ContentLength']} bytes, more than an "
                f"adapter config can be ({MAX_CONFIG_BYTES}): is it the right object?"
            )
        return bytes(answer["Body"].read())

    return call(s3, bucket, key, fetch)  # type: ignore[no-any-return]


def list_adapters(url: StoreUrl, timeout_s: float, limit: int = 0) -> list[tuple[str, StoreUrl]]:
    """(name, prefix) of every adapter directly under ``url`` (a prefix holding ``adapter_config.json``),
    by name; with ``limit``, the first ``limit`` by name (the listing stops there)."""
    s3 = client(timeout_s)
    base = f"{url.key}/" if url.key else ""
    found = []
    for key in _keys(s3, url.bucket, base):
        rest = key[len(base) :]
        name, _, file = rest.partition("/")
        if file == CONFIG_FILE and name:
            found.append((name, url / name))
            if len(found) == limit:
                break
    if not found:
        raise AdapterFormatError(
            f"{url} holds no adapter (no NAME/{CONFIG_FILE} under it); check the prefix, or "
            "upload adapters as s3://BUCKET/PREFIX/NAME/{adapter_config.json,"
            "adapter_model.safetensors}"
        )
    return sorted(found)


BASE_READS = 32  # configs read at once to find the adapters' base model: one round trip per 32 adapters
BASE_SAMPLE = 64  # adapters whose configs name a store prefix's base model (each config is a round trip)


def adapter_bases(url: StoreUrl, timeout_s: float, only: str = "") -> dict[str, str]:
    """``{adapter name: base_model_name_or_path}`` of the first ``BASE_SAMPLE`` adapters (by name) directly under
    ``url`` (of the one named ``only``), as ``base_model.adapter_bases`` gives for a directory: the listing's first
    page(s), then each ``adapter_config.json`` (``BASE_READS`` at a time). Not every adapter's: a catalog of 10,000
    would cost 10,000 round trips before anything starts; an adapter of another shape further on is refused at its
    registration, by itself. A config that is not JSON, or names no base, maps to "" (the catalog reports it, with
    its own message, when it registers); the store's own failures (no bucket, no credentials, a stalled server)
    raise its clear error, as registration would."""
    s3 = client(timeout_s, pool=BASE_READS)
    if only:
        key = (url / only / CONFIG_FILE).key
        if key not in _keys(s3, url.bucket, key):
            return {}
        found = [(only, url / only)]
    else:
        found = list_adapters(url, timeout_s, limit=BASE_SAMPLE)

    def base(prefix: StoreUrl) -> str:
        data = _config_bytes(s3, prefix.bucket, (prefix / CONFIG_FILE).key)
        try:
            raw = json.loads(data)
            return str(raw.get("base_model_name_or_path") or "") if isinstance(raw, dict) else ""
        except (ValueError, RecursionError):
            return ""

    with ThreadPoolExecutor(min(BASE_READS, len(found)), thread_name_prefix="lora-cache-bases") as pool:
        return dict(zip([name for name, _ in found], pool.map(base, [prefix for _, prefix in found]), strict=True))


def _keys(s3: Any, bucket: str, prefix: str) -> Iterator[str]:
    """Every key under ``prefix``, in order, a page (1,000 keys) per request, asked as the caller goes on."""
    pages = iter(s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix))
    while (page := call(s3, bucket, prefix, lambda: next(pages, None))) is not None:
        for item in page.get("Contents", ()):
            yield str(item["Key"])
