"""A trainer's device pushes (lifecycle step 0; issue 44 item 5): a new version of an adapter READY on the ranks of
the trainer's replica straight from its GPU, its node copy landed after.

    from lora_cache.integrations.device_push import DevicePusher
    pusher = DevicePusher("tenant-7", lora_config)
    for step in ...:
        train(...)
        pushed = pusher.push(lora_state_dict, tag=step)  # every rank of the replica READY on step's weights
    pusher.close()

Each push has the next one's version registered ahead (``next_tag``: by default ``tag + 1`` for an integer tag;
``DevicePushes.reserve``), answered while the trainer trains, so that the next push is steps 1 and 3 alone: the
ranks rung with that id, and the controller's commit (the version made current) once every rank is READY. Where the
tag, or the tensors' names, shapes or dtypes, are not the ones registered ahead, or the controller gave it up, the
push registers itself as below. A trainer that trains in the buffer (``views()``: e.g. ``param.data =
views[name]``) writes each step into the image, and its push copies nothing.

One push (``lora_cache/controller/device_pushes.py`` for the controller's side):
1. the tensors are laid into the pusher's image buffer on their device (``serialize.image_and_head``: the
   safetensors file; a next push of the same names, shapes and dtypes is one multi-tensor copy into the same buffer's
   kept layout, ``serialize.ImageLayout``, so the ranks' handles stay valid) and the trainer's one interprocess event
   is recorded behind the writes;
2. the controller registers the version, device-only (one Ray call: its checks, its id; sent before the tensors
   are copied in where the layout is kept, since it reads only the header; answered once the ranks were sent the
   registration, which each rank's load waits for if the doorbell comes first);
3. each rank of the replicas on this node takes its shard from the buffer (``WorkerCache.load_image``), asked by its
   doorbell (a UNIX socket: no Ray call; ``workers.control.doorbell``): the buffer and the event are opened on each
   rank once (CUDA IPC), at the first push or when the buffer is new; ``push`` returns when every rank is READY;
4. once every rank answered, the image's copy to pinned host memory starts on a side stream behind that event (not
   before: its bytes on the device-to-host copy engine held up each rank's finite flag, ``_copy_out``); once it is
   complete, the controller is handed it (an ObjectRef) to land the version
   (``DevicePushes.land``), in the background: ``DevicePushed.landing`` resolves to its ``Landed``. The buffer may
   be written again as soon as ``push`` returns (the host copy is complete by then). A push a rank refuses (a NaN
   in the image, a buffer it cannot open) is withdrawn at once (``withdraw_device``): the version before it is
   current again, and the error is raised.

A replica is pushed to only if every one of its ranks is on this node and opens the buffer (on a GPU: the trainer's
GPU; CUDA IPC across GPUs is unproven here). Others take the version from its node copy once it lands, as the
planner sends it. On the CPU (a CPU-only service, the tests) there is no IPC: the image is put in Ray's object store
with every push, and each rank maps it from there.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np
import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from lora_cache.adapters.serialize import ImageLayout, image_and_head
from lora_cache.api.client_values import push_config
from lora_cache.controller.pushes import Pushed
from lora_cache.errors import ConfigError, LoraCacheError, NotFoundError
from lora_cache.link.bell import Bell, ring_all
from lora_cache.link.endpoint import controller_handle

GUESS = object()  # ``DevicePusher.push``'s default next tag: the tag + 1, where it is an integer


class DevicePushed(NamedTuple):
    """One device push: the version registered (``Pushed``'s fields), each rank's readiness record (as the doorbell
    answers it), the seconds from ``push`` to every rank READY, and the landing of its node copy (an ObjectRef of the
    controller's ``Landed``: ``ray.get`` it to know the version is loadable anywhere)."""

    name: str
    tag: str
    version: str
    previous: str
    records: tuple[dict[str, Any], ...]
    ready_s: float
    landing: Any
    split_s: dict[str, float]


class DevicePusher:
    """A trainer's device pushes of adapter ``name`` (the module's docstring). ``replicas``: those to push to (all
    of this node's by default); ``service``: the service's namespace (this process's by default)."""

    def __init__(self, name: str, config: Any, replicas: Sequence[str] | None = None, service: str = "",
                 timeout_s: float = 60.0) -> None:
        self.controller = controller_handle(service)  # held: a temporary handle's method keeps a weak reference
        self.name, self.config, self.replicas, self.timeout_s = name, push_config(config), replicas, timeout_s
        self.buffer = f"{name}-{uuid.uuid4().hex[:12]}"  # this pusher's buffer, as the ranks know it
        self.image: torch.Tensor | None = None
        self.layout: ImageLayout | None = None  # the GPU buffer's layout, for the next push of the same tensors
        self.event: Any = None  # the trainer's one interprocess event (a GPU image's)
        self.ranks: list[Any] = []  # the ranks pushed to (every rank of each replica taken)
        self.bells: list[Bell] = []
        self._host: torch.Tensor | None = None  # pinned: the image's copy for its landing
        self._copied: Any = None  # the host copy's event
        self._side: Any = None  # the stream the host copy runs on, behind the trainer's event
        self._next: tuple[str, Future[Pushed]] | None = None  # (tag, its Pushed): the next push's, registered ahead
        self.rung_at = self.answered_at = 0.0  # the last push's doorbells rung, and every answer read (perf_counter)

    def push(self, tensors: Mapping[str, torch.Tensor], tag: str | int, next_tag: str | int | object | None = GUESS
             ) -> DevicePushed:
        """Push ``tensors`` (PEFT-named, on one device) as version ``tag`` of the adapter (the module's docstring);
        its ``DevicePushed`` once every rank pushed to is READY and the version is current, or the error (the
        previous version serving). ``next_tag``: the tag of this pusher's next push, registered ahead of it once this
        one is READY (``DevicePushes.reserve``), so that the next push is the doorbells alone; by default ``tag + 1``
        where ``tag`` is an integer; None registers none."""
        t0 = time.perf_counter()
        tensors = {str(k): v for k, v in tensors.items()}
        layout = self.layout
        ordered = layout.fits(tensors) if layout is not None else None
        ahead = self._ahead(str(tag), layout is not None and ordered is not None)
        if ahead is not None:
            assert layout is not None and ordered is not None
            pushed: DevicePushed | None = self._push_ahead(ahead, layout, ordered, t0)
        else:
            pushed = None
        if pushed is None:
            pushed = self._push(tensors, tag, layout, ordered, t0)
        self._reserve_next(tag, next_tag)
        return pushed

    def views(self) -> dict[str, torch.Tensor]:
        """The image buffer's tensors, by name, as views of it (after a first push; empty before): a trainer that
        trains in them (e.g. ``param.data = views[name]``) writes the next version in place, and a push of these same
        tensors copies nothing (``ImageLayout.write``). Valid until a push of other names, shapes or dtypes makes a
        new buffer."""
        layout = self.layout
        return dict(zip(layout.names, layout.views, strict=True)) if layout is not None else {}

    def _push(self, tensors: dict[str, torch.Tensor], tag: str | int, layout: ImageLayout | None,
              ordered: list[torch.Tensor] | None, t0: float) -> DevicePushed:
        """A push registered now: the controller's call, then the doorbells."""
        call = None
        if layout is not None and ordered is not None:  # the last push's buffer and layout: the controller's call
            image, head = layout.image, layout.head  # goes while the tensors are copied in (it reads only the header)
            call = self._register(tag, head, image.numel())
            try:
                layout.write(ordered)
            except BaseException:
                self._give_up(call)
                raise
        else:
            image, head = image_and_head(tensors, {"format": "pt"})  # a new buffer, opened again on the ranks
            self.layout = self._layout(tensors, image, head)
        self._written(image)
        t1 = time.perf_counter()
        stored = self._stored(image)
        pushed: Pushed = ray.get(call if call is not None else self._register(tag, head, image.numel()),
                                 timeout=self.timeout_s)
        t2 = time.perf_counter()
        answers, t3 = self._ring(image, head, stored, pushed.version)
        t4 = time.perf_counter()
        self._copy_out(image)
        split = {"image": t1 - t0, "register": t2 - t1, "open": t3 - t2, "bells": t4 - t3}
        return DevicePushed(pushed.name, pushed.tag, pushed.version, pushed.previous,
                            tuple(a["record"] for a in answers), t4 - t0, self._land(pushed.version, stored), split)

    def _push_ahead(self, ahead: Pushed, layout: ImageLayout, ordered: list[torch.Tensor],
                    t0: float) -> DevicePushed | None:
        """A push registered ahead (``reserve_device``): the tensors copied into the kept layout, the doorbells rung
        with its id, then the controller's commit (``commit_device``) once every rank is READY. None where the
        controller had given it up (it waited past ``AHEAD_LAND_TIMES`` x ``push_land_s``, or a push of its tag took
        it): the caller registers the push now instead."""
        image, head = layout.image, layout.head
        try:
            layout.write(ordered)
        except BaseException:
            self._withdraw(ahead.version)
            raise
        self._written(image)
        t1 = time.perf_counter()
        stored = self._stored(image)
        answers, t2 = self._ring(image, head, stored, ahead.version)
        t3 = time.perf_counter()
        self._copy_out(image)
        # committed once every rank is READY, not while they load: its registration reaching the ranks meanwhile
        # took their time (measured: the doorbells' 2.3 -> 4.2 ms at TP 2, bench/reports/issue-44.md)
        try:
            pushed: Pushed = ray.get(self.controller.commit_device.remote(self.name, ahead.version),
                                     timeout=self.timeout_s)
        except NotFoundError:  # given up before its commit: the ranks loaded an id no longer registered; none serves
            return None  # it by the name (never current), and the planner lets it go
        except BaseException:
            self._withdraw(ahead.version)
            raise
        t4 = time.perf_counter()
        split = {"image": t1 - t0, "register": 0.0, "open": t2 - t1, "bells": t3 - t2, "commit": t4 - t3}
        return DevicePushed(pushed.name, pushed.tag, pushed.version, pushed.previous,
                            tuple(a["record"] for a in answers), t3 - t0, self._land(pushed.version, stored), split)

    def _stored(self, image: torch.Tensor) -> Any:
        """On the CPU the image goes into the object store once: each rank maps it from there, and so does the
        landing; None for a GPU image."""
        return None if image.is_cuda else ray.put(image.numpy())

    def _ring(self, image: torch.Tensor, head: bytes, stored: Any, version: str) -> tuple[list[dict[str, Any]], float]:
        """Every rank pushed to takes ``version`` from the buffer (opened first where it is new, or on the CPU):
        their answers, and when the doorbells were rung. A rank's refusal (e.g. a NaN) withdraws the version, so
        that the one before it is current again, and is raised."""
        rung = time.perf_counter()
        try:
            if image is not self.image or not image.is_cuda or not self.ranks:
                self.image = image
                self._open(image, head, stored)
                rung = time.perf_counter()
            self.rung_at = rung
            answers = ring_all(self.bells, [{"buffer": self.buffer, "name": self.name, "version": version}]
                               * len(self.bells))
            self.answered_at = time.perf_counter()
            return answers, rung
        except BaseException:
            self._withdraw(version)
            raise

    def _land(self, version: str, stored: Any) -> Any:
        """The landing of ``version``'s node copy (``land_device``), an ObjectRef."""
        return self.controller.land_device.remote(self.name, version, self.config,
                                                  stored if stored is not None else ray.put(self._host_bytes()))

    def _ahead(self, tag: str, fits: bool) -> Pushed | None:
        """The version registered ahead for this push (``_reserve_next``), if it is this push's tag and the kept
        layout's (the header it declared); one that is not is given up first."""
        if self._next is None:
            return None
        (next_tag, answer), self._next = self._next, None
        try:
            ahead: Pushed = answer.result(timeout=self.timeout_s)  # answered long since, as a rule
        except LoraCacheError:  # refused (e.g. the name was unregistered): this push registers itself
            return None
        if next_tag == tag and fits:
            return ahead
        self._withdraw(ahead.version)  # another tag, or other tensors: before this push's registration, which it could
        return None  # hold up (its tag)

    def _reserve_next(self, tag: str | int, next_tag: str | int | object | None) -> None:
        """Register the next push's version ahead (``reserve_device``), answered in the background."""
        if next_tag is GUESS:
            text = str(tag)
            next_tag = str(int(text) + 1) if text.isdigit() else None
        if next_tag is None or self.layout is None:
            return
        head, size = self.layout.head, self.layout.image.numel()
        # its answer as a future, set by Ray's own thread when it comes: the next push reads it with no call into
        # Ray (a ``ray.get`` of an object long resolved still costs a fraction of a millisecond)
        call = self.controller.reserve_device.remote(self.name, next_tag, self.config, head, size)
        self._next = (str(next_tag), call.future())

    def _register(self, tag: str | int, head: bytes, size: int) -> Any:
        """The controller's registration of this push (``push_device``), an ObjectRef."""
        return self.controller.push_device.remote(self.name, tag, self.config, head, size)

    def _give_up(self, call: Any) -> None:
        """The push's registration ``call`` went, but the push cannot go on: withdrawn if it was registered."""
        with contextlib.suppress(Exception):
            self._withdraw(ray.get(call, timeout=self.timeout_s).version)

    def _withdraw(self, version: str) -> None:
        """Give up ``version`` (``withdraw_device``): a push that cannot go on, or one registered ahead and not
        pushed."""
        with contextlib.suppress(Exception):  # else it expires: the error that stopped the push is the one raised
            ray.get(self.controller.withdraw_device.remote(self.name, version), timeout=self.timeout_s)

    @staticmethod
    def _layout(tensors: dict[str, torch.Tensor], image: torch.Tensor, head: bytes) -> ImageLayout | None:
        """The image's layout, kept for the next push (a CPU image too: each push puts a copy of it in the object
        store, so it may be written again); None where the tensors' places cannot be typed views (mixed dtypes,
        which the controller refuses anyway)."""
        try:
            return ImageLayout(tensors, image, head)
        except RuntimeError:
            return None

    def _written(self, image: torch.Tensor) -> None:
        """Record the trainer's event behind the image's writes (a GPU image's): the ranks' reads wait for it."""
        if not image.is_cuda:
            return
        if self.event is None or self._host is None or self._host.numel() != image.numel():
            self.event = torch.cuda.Event(interprocess=True)
            self._host = torch.empty(image.numel(), dtype=torch.uint8, pin_memory=True)
            self._side = torch.cuda.Stream(image.device)
            self.ranks = []  # a new event: opened again with the buffer
        self.event.record()

    def _copy_out(self, image: torch.Tensor) -> None:
        """Start the image's copy to pinned host memory, for its landing, behind the trainer's event: once every rank
        answered, so that the ranks' own small copies (each load's finite flag) never queue behind it on the GPU's
        device-to-host copy engine (measured on one H100: their READY 0.2 ms later with it started first,
        bench/reports/issue-44.md). The landing waits for it (``_host_bytes``) before the push returns, so the trainer
        never writes the buffer under it."""
        if not image.is_cuda:
            return
        side = self._side
        assert self._host is not None  # made with the event (``_written``)
        side.wait_event(self.event)
        with torch.cuda.stream(side):
            self._host.copy_(image, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _host_bytes(self) -> np.ndarray:
        """The GPU image's host copy (``_copy_out``), once complete."""
        assert self._host is not None and self._copied is not None
        self._copied.synchronize()
        return self._host.numpy()

    def _open(self, image: torch.Tensor, head: bytes, stored: Any = None) -> None:
        """Open the buffer (and its event) on the ranks pushed to, finding them at the first push; ``stored``: a CPU
        image's ObjectRef."""
        handle = reduce_tensor(image) if image.is_cuda else stored
        event = self.event.ipc_handle() if image.is_cuda else None
        if not self.ranks:
            self.ranks = self._local_ranks(handle, event, head)
        else:
            ray.get([r.open_image.remote(self.buffer, handle, event, head) for r in self.ranks], timeout=self.timeout_s)
        if len(self.bells) != len(self.ranks):
            self.close_bells()
            paths = ray.get([r.open_doorbell.remote() for r in self.ranks], timeout=self.timeout_s)
            self.bells = [Bell(p, self.timeout_s) for p in paths]

    def _local_ranks(self, handle: Any, event: bytes | None, head: bytes) -> list[Any]:
        """Every rank of the replicas whose ranks are all on this node and open the buffer (a rank on another GPU
        refuses it, naming why); ConfigError naming the fix if none."""
        node = ray.get_runtime_context().get_node_id()
        replicas = ray.get(self.controller.replica_ranks.remote(list(self.replicas) if self.replicas else None),
                           timeout=self.timeout_s)
        taken: list[Any] = []
        why: list[str] = []
        for replica, ranks in sorted(replicas.items()):
            nodes = {d["node"] for d in ray.get([r.describe.remote() for r in ranks], timeout=self.timeout_s)}
            if nodes != {node}:
                why.append(f"{replica}: ranks on another node")
                continue
            try:
                ray.get([r.open_image.remote(self.buffer, handle, event, head) for r in ranks], timeout=self.timeout_s)
            except ConfigError as e:  # e.g. a rank on another GPU: the replica is not pushed to, none of its ranks
                why.append(f"{replica}: {e}")  # keeps the buffer open
                ray.get([r.close_image.remote(self.buffer) for r in ranks], timeout=self.timeout_s)
                continue
            taken += ranks
        if not taken:
            raise ConfigError(f"device push of {self.name}: no replica has every rank on this node and able to open "
                              f"the trainer's buffer ({'; '.join(why) or 'no replicas'}); run the trainer on a "
                              "replica's node and GPU, or push by value (push_in_ray)")
        return taken

    def close_bells(self) -> None:
        for bell in self.bells:
            bell.close()
        self.bells = []

    def close(self) -> None:
        """Let go of the buffer on every rank and the doorbells, and of the version registered ahead for the next
        push (the last landing goes on)."""
        if self._next is not None:
            (_, answer), self._next = self._next, None
            with contextlib.suppress(Exception):
                self._withdraw(answer.result(timeout=self.timeout_s).version)
        self.close_bells()
        if self.ranks:
            ray.get([r.close_image.remote(self.buffer) for r in self.ranks], timeout=self.timeout_s)
        self.ranks = []
