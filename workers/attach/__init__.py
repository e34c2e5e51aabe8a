"""Lifecycle steps 4 and 9 in an engine's own process: the engine seam (``attach``), its transports to the
control plane, and the version exchange. Files: workers/attach/README.md."""
