"""A rank's node copies of pushed versions (lifecycle step 0; issue 44 item 2 on more than one node).

The controller keeps a pushed version in its own node's memory (``lora_cache.adapters.pushed.PushArea``) and
registers that directory. A rank on another node has no such file (or, where nodes name their push areas
differently, another directory): ``NodeCopies.localize`` gives it the version's directory in its own node's push
area, copied once per node from the controller's bytes (``ControllerActor.pushed_payload``). A copy is taken only
once it hashes to the version the controller registered (the version is the content's hash, so a copy proves
itself); a copy already there is hashed again before it is taken (left by a service of the same name before, it
may hold other bytes under the tag: then it is replaced). Two ranks of one node may copy one version at once: the
area's rename keeps one and both take it.

What the controller retires it drops here too (``drop``: those tags only, never a copy being written); what a rank
forgets goes (``forget``, a name it took copies of). A rank on the controller's own node, sharing its push area,
has nothing to copy or drop.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lora_cache.adapters.device_source import DeviceSource
from lora_cache.adapters.device_versions import as_copy_of, same_bytes
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, KnownVersion
from lora_cache.adapters.pushed import TMP_PREFIX, PushArea, digest
from lora_cache.errors import ConflictError

LOCK_FILE = ".copying"  # in the node's push area: one rank of a node copies at a time
Fetch = Callable[[str, str], tuple[bytes, np.ndarray]]  # (name, tag) -> the controller's (config, weights) bytes
PAYLOAD_S = 120.0  # a pushed version's bytes from another node (a 70B rank-64 adapter is ~1.6 GB)


def fetch_payload(controller: Any, name: str, tag: str) -> tuple[bytes, np.ndarray]:
    """A ``Fetch`` over Ray: the controller actor's ``pushed_payload`` (``Pushes.payload``), its refusal raised."""
    import ray

    return ray.get(controller.pushed_payload.remote(name, tag), timeout=PAYLOAD_S)  # type: ignore[no-any-return]


class NodeCopies:
    """One rank's view of its node's push area (the module's docstring). ``fetch`` asks the controller."""

    def __init__(self, area: PushArea, node: str, fetch: Fetch) -> None:
        self.area, self.node, self.fetch = area, node, fetch
        self.copied = self.reused = 0  # versions this rank copied from the controller / found here and proved
        self.names: set[str] = set()  # names this rank took a node copy of (never on the controller's own area)

    def localize(self, name: str, path: str, known: KnownVersion | None) -> tuple[str, KnownVersion | None]:
        """Where this rank reads the registration ``(name, path, known)``: ``path`` itself unless it is a pushed
        version of this service that this node holds elsewhere or not at all; then this node's copy, proved to be
        ``known``'s version, with that proof (the rank takes it without hashing it again)."""
        pushed = Path(path)
        if (known is None or isinstance(known.source, DeviceSource) or pushed.parent.name != name
                or pushed.parent.parent.name != self.area.dir.name):
            return path, known  # not a push of this service (a pushed version is always registered with its hash),
            # or a device push's before its node copy (its ranks take it from the trainer's buffer)
        local = self.area.path(name, pushed.name)
        if local == pushed and local.is_dir():
            return path, known  # the controller's node (or one sharing its area): its own file, proved as ever
        with self._node_lock():  # one rank of the node fetches; the others then find its copy and prove it
            return self._take(name, pushed.name, local, known)

    def _take(self, name: str, tag: str, local: Path, known: KnownVersion) -> tuple[str, KnownVersion]:
        if local.is_dir():
            config, weights = (local / CONFIG_FILE).read_bytes(), (local / WEIGHTS_FILE).read_bytes()
            found = as_copy_of(digest(config, weights), local, known)
            if found is not None:
                self.reused += 1
                self.names.add(name)
                return str(local), found
            self.area.drop(name, [tag])  # another content under this tag: a service's leftover, replaced
        config, array = self.fetch(name, tag)
        content = digest(config, array.data)
        if content.version != known.version and not same_bytes(known, content):
            raise ConflictError(f"the controller's bytes of pushed {name}@{tag} hash to version "
                                f"{content.version}, not the registered {known.version} (pushed again meanwhile?): "
                                "not copied; the next registration of the name brings the current one")
        copy, _ = self.area.write(name, tag, config, array.data)
        self.copied += 1
        self.names.add(name)
        proven = as_copy_of(content, copy, known)
        assert proven is not None
        return str(copy), proven

    @contextlib.contextmanager
    def _node_lock(self) -> Iterator[None]:
        """Held by one rank of this node at a time (``flock`` on a file in the node's area: ranks are processes)."""
        self.area.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.area.dir / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def drop(self, name: str, tags: list[str], node: str, area: str) -> list[str]:
        """The controller on ``node`` (its push area ``area``) retired ``name``'s ``tags``: this node's copies of them
        go, unless this rank shares the controller's area (the controller removed them itself)."""
        if node == self.node and Path(area).resolve() == self.area.dir.resolve():
            return []
        return self.area.drop(name, tags)

    def forget(self, name: str) -> list[str]:
        """``name`` was unregistered: this node's copies of it go (not one being written), if this rank took any."""
        if name not in self.names:
            return []
        self.names.discard(name)
        return self.area.drop(name, [p.name for p in (self.area.dir / name).glob("*")
                                     if not p.name.startswith(TMP_PREFIX)])

