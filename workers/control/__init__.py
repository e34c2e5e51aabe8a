"""Lifecycle steps 4 and 7 on a rank: the controller's commands, what it calls on a rank, and the residency
deltas sent back. Files: workers/control/README.md."""
