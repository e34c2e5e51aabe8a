"""The data plane on each GPU: pinned host tier, GPU slot pool, side-stream loads, readiness reports."""
