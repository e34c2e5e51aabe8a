"""A ``PushAdapter`` stream gathered into one push (lifecycle step 0; issue 44 item 2): plain, checked as it comes.

The first message names the adapter, its tag, its config and the weights' whole size; every message carries the
next bytes of the weights. ``gather`` checks the first message before any weight is taken (a size over the
gateway's ``max_push_bytes``, a missing name or config: refused at once, nothing buffered), fills one buffer of
the announced size, refuses a stream that sends more than it announced, and one that ends before it (a trainer
that died, a connection dropped: nothing reaches the controller, so the adapter's current version stays).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.validate import RequestError, parse, show

MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KiB


WEIGHTS_TAG = 0x2A  # PushAdapterRequest.weights on the wire: field 5, length-delimited


class Weights(NamedTuple):
    """A later message of a push that holds weights alone, not decoded: its bytes where gRPC put them."""

    weights: memoryview
    name: str = ""
    tag: str = ""
    config_json: bytes = b""
    total_bytes: int = 0


def parse_request(raw: bytes) -> Any:
    """One ``PushAdapterRequest`` body: a message of weights alone as protobuf writes it (field 5's tag, a varint
    length, the bytes to the body's end: every encoder's form of it) taken in place (``Weights``); any other body
    (the first message, a later one with other fields) decoded, a malformed one refused (``validate.parse``)."""
    view = memoryview(raw)
    if len(view) > 1 and view[0] == WEIGHTS_TAG:
        length, at, shift = 0, 1, 0
        while at < len(view) and at <= 10:
            byte = view[at]
            length |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if not byte & 0x80:
                if at + length == len(view):
                    return Weights(view[at:])
                break
    return parse(pb.PushAdapterRequest, raw)


class PushBody(NamedTuple):
    name: str
    tag: str
    config: bytes
    weights: bytearray


async def gather(requests: AsyncIterator[Any], max_bytes: int) -> PushBody:
    """The whole push of ``requests`` (``PushAdapterRequest`` messages, or ``Weights`` of ``parse_request``),
    checked (the module's docstring)."""
    first = None
    buffer = bytearray()
    filled = 0
    async for message in requests:
        if first is None:
            first = message
            total = _check_first(message, max_bytes)
            buffer = bytearray(total)
        elif message.name or message.tag or message.config_json or message.total_bytes:
            raise RequestError("only the first PushAdapter message names the adapter, tag, config and size; send "
                               "the later ones with weights alone")
        chunk = message.weights
        if filled + len(chunk) > len(buffer):
            raise RequestError(f"push of {show(first.name)} sent more than the {len(buffer)} bytes its first message "
                               "announced; set total_bytes to the weights' whole size")
        buffer[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    if first is None:
        raise RequestError("the PushAdapter stream was empty; send the name, tag, config and size first")
    if filled != len(buffer):
        raise RequestError(f"push of {show(first.name)} ended after {filled} of the {len(buffer)} bytes announced: "
                           "nothing was changed; push again")
    return PushBody(first.name, first.tag, bytes(first.config_json), buffer)


def _check_first(message: Any, max_bytes: int) -> int:
    if not message.name:
        raise RequestError("the first PushAdapter message has no name; name the adapter")
    if not message.config_json:
        raise RequestError(f"push of {show(message.name)} has no config_json; send adapter_config.json's bytes "
                           "(PEFT's LoraConfig as JSON) in the first message")
    if len(message.config_json) > MAX_CONFIG_BYTES:
        raise RequestError(f"push of {show(message.name)}: config_json is {len(message.config_json)} bytes, more "
                           f"than the {MAX_CONFIG_BYTES} a PEFT config needs; send adapter_config.json's bytes")
    if not 8 < message.total_bytes <= max_bytes:
        raise RequestError(f"push of {show(message.name)} announces {message.total_bytes} bytes of weights; give "
                           f"the safetensors bytes' whole size, at most the gateway's max_push_bytes ({max_bytes})")
    return int(message.total_bytes)
