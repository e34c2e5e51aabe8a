"""Domain errors. Each names the thing, the value and the fix; only the gRPC servicer maps them to codes."""

from __future__ import annotations


class LoraCacheError(Exception):
    """Base of every error lora-cache raises on purpose. ``usage``: what the user gave cannot work (the CLI
    exits 2), rather than a server, cluster or service that failed (exit 1)."""

    usage = False


class ConfigError(LoraCacheError, ValueError):
    """A configuration value is invalid."""

    usage = True


class AdapterError(LoraCacheError, ValueError):
    """An adapter on disk is malformed or does not fit the model."""

    usage = True


class AdapterFormatError(AdapterError):
    """adapter_config.json or adapter_model.safetensors is missing, corrupt or inconsistent."""


class AdapterMissingError(AdapterFormatError):
    """Nothing at an adapter's location: its store key (or its file) does not exist."""


class UnsupportedAdapterError(AdapterError):
    """A valid PEFT adapter that uses a feature lora-cache does not serve (DoRA, modules_to_save)."""


class AdapterPathError(AdapterError):
    """A path outside the configured adapter roots (a symlink that leaves them included), a file that is
    not a regular file (a FIFO, a device, a directory), or a pickle file."""


class AdapterChangedError(AdapterFormatError):
    """An adapter file changed since (or while) its version was registered: a read under that version
    would return other bytes, so it is refused; registering the adapter again makes a new version."""


class NonFiniteWeightsError(AdapterFormatError):
    """An adapter's weights hold NaN or Inf as read for a slot (in its dtype): every request that used them would
    compute NaNs, so the load is refused before the bad chunk reaches a GPU; the adapter must be re-exported."""


class AdapterStoreError(AdapterError):
    """The object store an adapter lives in refused or failed a request: credentials, a store that does not
    answer in time or breaks off (a missing bucket or key is an ``AdapterPathError`` / ``AdapterFormatError``,
    an object replaced since registration an ``AdapterChangedError``)."""


class ShardError(AdapterError):
    """A tensor that cannot be split across the tensor-parallel ranks."""


class NotFoundError(LoraCacheError, KeyError):
    """An unknown adapter, replica or worker."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CapacityError(LoraCacheError, RuntimeError):
    """A bounded resource (GPU slots, pinned host bytes) cannot take more right now."""


class SlotsBusyError(CapacityError):
    """Every GPU slot is held by running batches: a prefetch finds no room (counted, not a failed load), or a
    request's load waited ``slot_wait_s`` for one in vain."""


class PermissionDeniedError(LoraCacheError):
    """The caller's credential may not do this (e.g. an engine credential bound to another replica)."""


class ConflictError(LoraCacheError):
    """The request is valid but conflicts with an operation in progress (e.g. an adapter draining)."""


class ResolveTimeoutError(LoraCacheError, TimeoutError):
    """An unregistered adapter's on-demand registration (request-time resolution) did not end within its deadline."""
