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

from lora_cache.api.validate import RequestError, show

MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KiB


class PushBody(NamedTuple):
    name: str
    tag: str
    config: bytes
    weights: bytearray


async def gather(requests: AsyncIterator[Any], max_bytes: int) -> PushBody:
    """The whole push of ``requests`` (``PushAdapterRequest`` messages), checked (the module's docstring)."""
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
