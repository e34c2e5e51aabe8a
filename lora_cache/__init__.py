"""lora-cache: puts LoRA adapters into GPU memory before the requests that need them are scheduled.

The control plane lives here (adapter catalog, TP shard specs, planner, controller, gateway, CLI);
the data plane on each GPU lives in the sibling package ``workers``. See docs/architecture.md.
"""

__version__ = "0.1.0"
