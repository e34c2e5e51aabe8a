"""The planner's domain errors: each names the input, the value and the fix."""

from __future__ import annotations

from collections.abc import Iterable

from lora_cache.errors import ConfigError, LoraCacheError, NotFoundError

__all__ = [
    "ConfigError",
    "PlannerInputError",
    "UnknownAdapterError",
    "UnknownReplicaError",
    "UnknownWorkerError",
    "known_names",
]


class PlannerInputError(LoraCacheError, ValueError):
    """A report, hint or spec given to the planner is malformed (a bad value, not an unknown name)."""


class UnknownReplicaError(NotFoundError):
    """An input names a replica the planner was never told about (or that was removed)."""


class UnknownAdapterError(NotFoundError):
    """An input names an adapter that is not in the planner's catalog."""


class UnknownWorkerError(NotFoundError):
    """An input names a worker that belongs to no replica (never added, or lost)."""


def known_names(names: Iterable[str], show: int = 5) -> str:
    """`'a', 'b', 'c' (+7 more)` for error messages; `none` when empty."""
    ordered = sorted(names)
    if not ordered:
        return "none"
    shown = ", ".join(repr(n) for n in ordered[:show])
    more = len(ordered) - show
    return f"{shown} (+{more} more)" if more > 0 else shown
