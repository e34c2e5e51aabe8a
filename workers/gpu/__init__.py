"""Lifecycle steps 6-7 and 9 on the GPU: slots, streams, chunked copies, the load path, and an engine's batch
holds. Files: workers/gpu/README.md."""
