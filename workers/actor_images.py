"""A trainer's pushes from its GPU buffer, on the worker actor (issue 44 item 5): the buffer opened once
(``workers.control.images``), each push's load from it (``WorkerCache.load_image``) by a Ray call or by the rank's
doorbell (``workers.control.doorbell``: no Ray call on the push's path). A mixin of ``workers.actor.WorkerActor`` (its
seam: a trainer's calls, apart from the controller's), which provides ``cache``, ``catalog``, ``control``, ``name``,
``images``, ``image_times`` and ``doorbell``."""

from __future__ import annotations

import resource
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import ray
import torch

from lora_cache.link.bell import bell_path
from lora_cache.vocab import ReadinessRecord
from workers.control.doorbell import Doorbell

REGISTRATION_S = 30.0  # how long a doorbell's push waits for its version's registration to reach the rank
SETTLE_S = 0.005  # how long a push's call polls its gather itself before leaving it to the completion watcher

if TYPE_CHECKING:
    from lora_cache.adapters.catalog import AdapterCatalog
    from workers.cache import WorkerCache
    from workers.control.images import TrainerImages
    from workers.control.rank import WorkerControl


class ImagePushCalls:
    cache: WorkerCache
    catalog: AdapterCatalog
    name: str
    images: TrainerImages
    control: WorkerControl
    image_times: deque[tuple[float, list[tuple[str, float]], float, dict[str, float]]]
    doorbell: Doorbell | None

    def open_image(self, buffer: str, handle: Any, event: bytes | None = None, head: bytes = b"") -> int:
        """Open a trainer's push buffer on this rank (``workers.control.images``); its size in bytes."""
        return self.images.open(buffer, handle, event, head)

    def load_image(self, name: str, version: str, buffer: str, head: bytes = b"",
                   timeout_s: float = 60.0, registration_s: float = 0.0) -> ReadinessRecord:
        """Load ``name@version`` into a slot from the open trainer buffer ``buffer`` (``WorkerCache.load_image``,
        after the trainer's event; ``head``: the image's header bytes, if not those it was opened with); its
        readiness record once READY, or the load's error. ``registration_s``: how long to wait for the version's
        registration to reach this rank (a doorbell's push: ``WorkerControl.await_version``); 0 on a Ray call,
        whose thread is the one registrations arrive on."""
        t0, before = time.perf_counter(), thread_use()
        image, after, opened = self.images.get(buffer)
        if registration_s > 0:
            self.control.await_version(name, version, registration_s)  # its registration may be on its way still
        t1 = time.perf_counter()
        # the rank's own load at the trainer's word, not the controller's command: its deltas say so
        # (``Delta.acquired``), and the controller believes its READY as it believes an engine's acquire's
        future = self.cache.load_image(name, version, image, head or opened, after, settle_s=SETTLE_S)
        t2, issued = time.perf_counter(), thread_use()
        record = future.result(timeout_s)
        t3, answered = time.perf_counter(), thread_use()
        with self.cache.book.lock:  # its phases (``SlotLoad.marks``), for the probes
            marks = list(self.cache.book.loads[record.slot].marks) if record.slot in self.cache.book.loads else []
        self.image_times.append((t0, [("registered", t1), *marks, ("started", t2), ("answered", t3)],
                                 time.perf_counter(), use_split(before, issued, answered)))
        return record

    def image_log(self) -> list[tuple[float, list[tuple[str, float]], float, dict[str, float]]]:
        """(perf_counter at the call, the load's phases, at its answer, the calling thread's use: its CPU seconds and
        context switches to the load's call returning, ``launch_*``, and from there to READY, ``wait_*``) of this
        rank's recent ``load_image`` calls: ``time.perf_counter`` is the machine's monotonic clock, comparable with the
        caller's on the same node."""
        return list(self.image_times)

    def close_image(self, buffer: str) -> bool:
        return self.images.close(buffer)

    def open_doorbell(self) -> str:
        """This rank's push doorbell (``workers.control.doorbell``), started on first use: the path of its UNIX socket,
        where a trainer on this node asks for ``load_image`` with no Ray call."""
        if self.doorbell is None:
            device = self.cache.device
            setup = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else (lambda: None)
            self.doorbell = Doorbell(bell_path(self.catalog.config.push_root(), ray.get_runtime_context().namespace,
                                               self.name), self._rung, setup)
        return str(self.doorbell.path)

    def _rung(self, request: dict[str, Any]) -> dict[str, Any]:
        record = self.load_image(str(request["name"]), str(request["version"]), str(request["buffer"]),
                                 registration_s=REGISTRATION_S)
        return {"record": record._asdict()}


def thread_use() -> tuple[float, int, int]:
    """This thread's CPU seconds and its voluntary and involuntary context switches so far."""
    use = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), use.ru_nvcsw, use.ru_nivcsw


def use_split(before: tuple[float, int, int], issued: tuple[float, int, int],
              answered: tuple[float, int, int]) -> dict[str, float]:
    """The calling thread's CPU seconds and context switches to the load's call returning (``launch_*``) and from it
    to READY (``wait_*``), from three ``thread_use`` readings: CPU time well short of the wall time is a thread that
    waited (the GIL, a lock, the scheduler)."""
    return {f"{part}_{what}": b - a for part, (x, y) in (("launch", (before, issued)), ("wait", (issued, answered)))
            for what, a, b in zip(("cpu_s", "voluntary", "involuntary"), x, y, strict=True)}
