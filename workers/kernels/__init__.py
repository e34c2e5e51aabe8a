"""Triton LoRA kernels over the slot pool (lifecycle step 9): metadata, SGMV, BGMV, the torch reference.

``meta`` (SlotMeta, BatchMeta) and ``reference`` import no Triton, so the worker cache can use them
anywhere. ``lora_apply`` loads ``workers.kernels.lora`` (and Triton) on first use: ``TRITON_INTERPRET``
must be decided before Triton is imported, and importing the worker cache must not decide it. Every file:
workers/kernels/README.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from workers.kernels.meta import BatchMeta, SlotMeta, shard_dims
from workers.kernels.reference import lora_apply_ref

if TYPE_CHECKING:
    from workers.kernels.lora import lora_apply

__all__ = ["BatchMeta", "SlotMeta", "lora_apply", "lora_apply_ref", "shard_dims"]
_LAZY = {"lora_apply": "workers.kernels.lora"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workers.kernels' has no attribute {name!r}")
