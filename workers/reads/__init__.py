"""Lifecycle step 5, the read: one rank's slices of an adapter file into a packed buffer, the version proven on
the way. Files and how a read flows through them: workers/reads/README.md."""
