"""A Ray worker process whose output files are on a full disk still runs its tasks (issue 46).

Ray points each worker process's stdout and stderr at files in the session's ``logs/``, on Ray's temp disk, and
writes its markers (``:job_id:``, ``:task_name:``) to stdout as the process runs its first tasks. On a full disk that
write raises ``OSError(ENOSPC)`` inside Ray's task executor, which then fails its own check ("Object at idx 0 was
not stored", ``task_receiver.cc``) and the process exits 1: a worker actor SIGKILLed while the disk is full is
restarted, dies on its first call, and so on until space is freed. Ray's own C++ logs only report such failures.

``tolerate_full_disk`` is the job's ``worker_process_setup_hook`` (``connect``, so every process of the service
runs it before its first task): output that finds no space is dropped and counted (``TolerantStream.dropped``);
any other error is raised as before. It is shipped by value (this module's code, pickled), never imported by name:
Ray runs the hook before it puts the driver's ``sys.path`` on the worker's, so a name could resolve to another
lora-cache installed on the node, or to none, and a hook that fails to load kills every worker of the job.
"""

from __future__ import annotations

import errno
import sys
from typing import Any, TextIO

from ray import cloudpickle

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class TolerantStream:
    """A text stream whose writes and flushes that find a full disk (or quota) are dropped, not raised."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.dropped = 0  # writes and flushes that found no space

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self._drop(e)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self._drop(e)

    def _drop(self, error: OSError) -> None:
        if error.errno not in NO_SPACE:
            raise error
        self.dropped += 1

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


def tolerate_full_disk() -> None:
    """Wrap this process's stdout and stderr (once) in ``TolerantStream``s."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, TolerantStream):
            setattr(sys, name, TolerantStream(stream))


def runtime_env() -> dict[str, Any]:
    """The job's runtime environment that installs the hook in every worker process, by value (stdlib only)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return {"worker_process_setup_hook": tolerate_full_disk}
