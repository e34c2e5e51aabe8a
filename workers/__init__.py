"""The data plane on each GPU: pinned host tier, GPU slot pool, side-stream loads, readiness reports.

Files and how a load flows through them: workers/README.md; the module map: docs/architecture.md.
"""
