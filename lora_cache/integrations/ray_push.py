"""A trainer on the Ray cluster pushes a new adapter version by object reference (lifecycle step 0; issue 44 item 2).

    from lora_cache.integrations.ray_push import push_in_ray
    pushed = push_in_ray("tenant-7", model.state_dict_of_the_lora(), lora_config, tag=step)

The weights are serialized once (safetensors, in the PEFT layout: ``client_values.push_payload``), put in Ray's
object store by this process as a uint8 array, and the controller is handed the reference at the top level of its
call, so Ray gives it the array in place in the store (no copy out of it): the bytes never pass through the gRPC
gateway. From there the push is the
gateway's (``lora_cache/controller/pushes.py``): checked, kept in node memory, registered on every rank, each
rank reading only its own shard. A trainer outside the cluster pushes with ``LoraCacheClient.push``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from lora_cache.api.client_values import Pushed, push_payload
from lora_cache.controller.pushes import Pushed as ControllerPushed
from lora_cache.link.endpoint import controller_handle


def push_in_ray(name: str, tensors: Any, config: Any, tag: str | int | None = None, service: str = "",
                timeout_s: float = 120.0) -> Pushed:
    """Push a version of ``name`` from this Ray process's memory (the module's docstring); ``service``: the
    service's namespace (default: this process's). Its ``Pushed``, or the controller's error (nothing changed)."""
    config_bytes, weights = push_payload(tensors, config)
    controller = controller_handle(service)  # held: a method of a temporary handle keeps only a weak reference
    ref = ray.put(np.frombuffer(weights, dtype=np.uint8))  # an array: the controller reads it in place, no copy
    try:
        done: ControllerPushed = ray.get(controller.push_adapter.remote(name, tag, config_bytes, ref),
                                         timeout=timeout_s)
    finally:
        del ref  # the controller's copy is in node memory once it answers: the store may free ours
    return Pushed(done.name, done.tag, done.version, done.previous, done.rank_pending)
