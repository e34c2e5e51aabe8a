"""A rank's open trainer images (issue 44 item 5, lifecycle step 0 into step 6): a trainer's push buffer opened
once, each push then naming it and carrying nothing else.

A trainer on the rank's node keeps one buffer per adapter it pushes, its safetensors image
(``lora_cache.adapters.serialize.device_image``, rewritten in place for each version), and one interprocess CUDA
event it records after each rewrite. A rank opens both once (``open``): the buffer from torch's IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``), the event from its IPC handle. A push is then a call naming
the buffer (``WorkerCache.load_image`` with ``get``'s image, event and head): measured on one H100, sending the handle
and a new event with every push cost 0.6-1.6 ms more than that (bench/reports/issue-44.md).

The event is one for every push: a rank's wait on it, issued when the push's call arrives, orders its gather after
the trainer's last record, which precedes the call. The trainer records again only for its next push, after this
push answered (every rank READY), so no rank waits on a later write than its own push's. The trainer must not write
the buffer between its record and that answer.

On the CPU (the tests, a CPU-only service) there is no IPC: the trainer sends the image itself, by value, or as an
array in Ray's object store, which each rank maps without a copy.

A GPU rank compiles the gather when it starts, on a thread (``gather.warm``): the first push on a fresh machine
waited 2.0-2.3 s for Triton's compiler before (bench/reports/issue-44.md).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lora_cache.errors import ConfigError, NotFoundError
from workers.kernels.gather import warm

log = logging.getLogger(__name__)


class TrainerImages:
    """The trainer buffers open on this rank, by the id the trainer gave each (``open``, ``get``, ``close``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._open: dict[str, tuple[torch.Tensor, Any, bytes]] = {}  # buffer id -> (image, trainer's event, head)
        self._lock = threading.Lock()
        self.warm_s: float | None = None  # the gather compiled at start (``gather.warm``), on a GPU rank
        self.warming = threading.Thread(target=self._warm, name="lora-gather-warm", daemon=True)
        if device.type == "cuda":  # on a thread: the rank's start does not wait for the compiler
            self.warming.start()

    def _warm(self) -> None:
        try:
            self.warm_s = warm(self.device)
        except Exception:  # a warm-up only: the first push compiles it then, as before
            log.warning("the gather could not be compiled at the rank's start; a trainer's first push compiles it",
                        exc_info=True)

    def open(self, buffer: str,
             handle: torch.Tensor | np.ndarray | tuple[Callable[..., torch.Tensor], tuple[Any, ...]],
             event: bytes | None = None, head: bytes = b"") -> int:
        """Open the trainer's buffer ``buffer``: ``handle`` is torch's ``reduce_tensor`` of it (CUDA IPC), or on the
        CPU the image itself (a tensor, or an array mapped from Ray's object store); ``event`` the IPC handle of the
        trainer's one interprocess event (None: its pushes are ordered otherwise); ``head``: the image's first 8 +
        header-length bytes, the same for every version the buffer holds (the same tensors' shapes:
        ``device_image`` rewrites it in place), so a push need not send them (the 8B rank-16's are ~60 KB, the 70B
        rank-64's ~140 KB: ~1 ms of a push's call measured on one H100). Opening an id again replaces it (a
        trainer's new buffer, or new shapes). Its size in bytes."""
        if isinstance(handle, np.ndarray):  # on the CPU: the image mapped from Ray's object store (read-only)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # not writable: a rank only reads an image
                handle = torch.from_numpy(handle)
        if isinstance(handle, torch.Tensor):
            if handle.device.type == "cuda":
                raise ConfigError(f"trainer buffer {buffer!r}: a GPU image cannot travel by value; send torch's "
                                  "reduce_tensor(image) so the rank opens it by CUDA IPC")
            image = handle
        else:
            rebuild, args = handle
            image = rebuild(*args)  # torch's own rebuild: the IPC open, ordered after the trainer's event then
        if image.dtype != torch.uint8 or image.dim() != 1:
            raise ConfigError(f"trainer buffer {buffer!r} is {image.dtype} of shape {tuple(image.shape)}; push the "
                              "image as a 1-D uint8 buffer (device_image)")
        if image.device != self.device and not (image.device.type == self.device.type == "cuda"
                                                and image.device.index == self.device.index):
            raise ConfigError(f"trainer buffer {buffer!r} is on {image.device}, this rank's slots on {self.device}: "
                              "a rank takes a pushed image from its own GPU only; push from a process on that GPU, "
                              "or push the tensors by value (push_in_ray)")
        after = torch.cuda.Event.from_ipc_handle(image.device, event) if event is not None else None
        with self._lock:
            self._open[buffer] = (image, after, bytes(head))
        return image.numel()

    def get(self, buffer: str) -> tuple[torch.Tensor, Any, bytes]:
        """(the image, the trainer's event or None, its head as opened) of an open buffer; NotFoundError naming it
        if it is not open."""
        with self._lock:
            found = self._open.get(buffer)
        if found is None:
            raise NotFoundError(f"trainer buffer {buffer!r} is not open on this rank; open it first (open_image) "
                                "with the buffer's IPC handle")
        return found

    def close(self, buffer: str) -> bool:
        """Let go of ``buffer`` (the trainer frees it, or went away); False if it was not open. A load issued from
        it keeps its tensor until its copy has run."""
        with self._lock:
            return self._open.pop(buffer, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
