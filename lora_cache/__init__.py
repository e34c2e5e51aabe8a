"""lora-cache: puts LoRA adapters into GPU memory before the requests that need them are scheduled.

The control plane lives here (adapter catalog, TP shard specs, planner, controller, gateway, CLI);
the data plane on each GPU lives in the sibling package ``workers``. See docs/architecture.md.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``lora_cache.attach`` (and ``AttachConfig``, ``Attachment``, ``WorkerConfig``): the engine seam,
    ``workers/attach/attachment.py``, imported on first use (it brings torch and the data plane; the control plane does
    not need them)."""
    if name in ("attach", "AttachConfig", "Attachment", "WorkerConfig"):
        import workers.attach.attachment

        return getattr(workers.attach.attachment, name)
    raise AttributeError(f"module 'lora_cache' has no attribute {name!r}")
