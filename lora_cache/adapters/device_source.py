"""A version pushed from a trainer's device buffer, before its node copy (lifecycle step 0; issue 44 item 5).

A device push (``lora_cache.controller.pushes.Pushes.push_device``) registers a version before any file of it
exists: the trainer's GPU buffer holds the version's safetensors image, and the ranks of the replica on the trainer's
node take their shards from it (``workers.reads.device``). Until the node copy is written and hashed (``land``),
the version's only proof is that image: ``DeviceSource`` is what a rank checks it by (its size, its header's length
and CRC), the version's ``KnownVersion.source`` meanwhile, with its config and header carried in ``meta``
(``objects.pack_meta``) so every rank builds the spec without a file. Such a version ("device-only") is never read
from the host: the planner commands no load or stage of it and keeps it where it is held, a rank refuses a host
load of it naming why, and the durable catalog does not save it (a restarted controller has the version before it).
Once its node copy lands, the version keeps its id and becomes an ordinary pushed version (``promote``).
"""

from __future__ import annotations

from typing import NamedTuple


class DeviceSource(NamedTuple):
    """A device-only version's image, as the trainer declared it and the controller checked it."""

    tag: str  # the trainer's tag (its step): the push area's ``NAME/TAG`` that the node copy lands in
    size: int  # the image's bytes (the safetensors file's)
    header_bytes: int  # 8 + the header's length
    header_crc: int  # CRC-32 of those bytes
    ahead: bool = False  # registered ahead of its push (``DevicePushes.reserve``): loadable by its exact version
    # from the trainer's image, not current, until the push's commit registers it again without this flag
