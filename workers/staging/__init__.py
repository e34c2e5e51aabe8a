"""Lifecycle step 5, staging: the pinned host tier over the reads, its arena, and the node's disk tier of
adapters from an object store. Files: workers/staging/README.md."""
