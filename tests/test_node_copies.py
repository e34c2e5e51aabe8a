"""A rank's node copies of pushed versions on the CPU (``workers.control.node_copies``; issue 44 item 2 on more than
one node): the controller's node area and a rank's node area are two real push areas; ``fetch`` reads the
controller's as ``Pushes.payload`` does. A copy is taken only once it hashes to the registered version, a stale copy
under the tag is replaced, two ranks of a node taking one version at once fetch it once and both take one copy, and
drops touch only the tags retired. The same path on two Ray nodes: ``tests/test_ray_push_nodes.py``."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load

from lora_cache.adapters import pushed
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE
from lora_cache.adapters.pushed import TMP_PREFIX, PushArea, digest
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api import client_values as msg
from lora_cache.errors import ConflictError
from workers.control.node_copies import NodeCopies

SERVICE = "svc"


@pytest.fixture
def world(tmp_path: Path) -> Any:
    """The controller's area holding version 1 of ``a`` (its registration's path and known version), and a
    rank's area on another node."""
    (src,) = make_adapters(tmp_path / "src", SynthConfig(model="tiny", count=1, rank="8"))
    tensors = load((src / WEIGHTS_FILE).read_bytes())
    config = json.loads((src / CONFIG_FILE).read_text())
    config_bytes, weights = msg.push_payload(tensors, config)
    controller = PushArea(tmp_path / "node-a", SERVICE, 1 << 30)
    path, _ = controller.write("a", "1", config_bytes, weights)
    known = digest(config_bytes, weights).known(path)
    return controller, PushArea(tmp_path / "node-b", SERVICE, 1 << 30), str(path), known, (config_bytes, weights)


def fetch_from(area: PushArea, calls: list[str] | None = None) -> Any:
    def fetch(name: str, tag: str) -> tuple[bytes, np.ndarray]:
        if calls is not None:
            calls.append(f"{name}@{tag}")
        return area.read(name, tag)
    return fetch


def test_a_rank_off_the_controllers_node_copies_a_version_once_proved_and_reads_it_from_its_own_node(
        world: Any, tmp_path: Path) -> None:
    controller, node, path, known, (_, weights) = world
    calls: list[str] = []
    copies = NodeCopies(node, "node-b", fetch_from(controller, calls))
    local, proof = copies.localize("a", path, known)
    assert Path(local) == node.path("a", "1") and calls == ["a@1"] and copies.copied == 1
    assert (Path(local) / WEIGHTS_FILE).read_bytes() == bytes(weights)
    assert proof is not None and proof.version == known.version
    # the rank takes it on that proof without hashing it again (its identity is this node's file's)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path / "src"),), model="tiny", max_rank=16,
                                          push_dir=str(tmp_path / "node-b")))
    assert catalog.add_lazy("a", local, proof) is not None and catalog.get("a").version == known.version
    # a second rank of that node finds the copy, hashes it and takes it: no second fetch
    other = NodeCopies(node, "node-b", fetch_from(controller, calls))
    assert other.localize("a", path, known)[0] == local and calls == ["a@1"] and other.reused == 1


def test_the_controllers_own_node_and_what_is_no_push_read_where_registered(world: Any, tmp_path: Path) -> None:
    controller, _, path, known, _ = world
    calls: list[str] = []
    same = NodeCopies(controller, "node-a", fetch_from(controller, calls))
    assert same.localize("a", path, known) == (path, known)
    elsewhere = NodeCopies(PushArea(tmp_path / "node-b", SERVICE, 1 << 30), "node-b", fetch_from(controller, calls))
    plain = str(tmp_path / "adapters" / "a")
    assert elsewhere.localize("a", plain, known) == (plain, known)  # not under SERVICE/NAME/TAG
    assert elsewhere.localize("b", path, known) == (path, known)  # another name's directory
    assert elsewhere.localize("a", path, None) == (path, None)  # a push is always registered with its version
    assert calls == []


def test_a_stale_copy_under_the_tag_is_replaced_and_other_bytes_from_the_controller_are_refused(world: Any) -> None:
    controller, node, path, known, (config_bytes, weights) = world
    stale = msg.push_payload({k: v * 3 for k, v in load(bytes(weights)).items()}, json.loads(config_bytes))
    node.write("a", "1", *stale)  # left under tag 1 by a service of this name before
    copies = NodeCopies(node, "node-b", fetch_from(controller))
    local, _ = copies.localize("a", path, known)
    assert (Path(local) / WEIGHTS_FILE).read_bytes() == bytes(weights) and copies.copied == 1
    # the controller's bytes no longer the registered version (pushed again meanwhile): nothing copied
    node.drop("a", ["1"])
    liar = NodeCopies(node, "node-b", lambda name, tag: (stale[0], np.frombuffer(stale[1], np.uint8)))
    with pytest.raises(ConflictError, match="not the registered"):
        liar.localize("a", path, known)
    assert not node.path("a", "1").exists()


def test_two_ranks_of_a_node_taking_one_version_at_once_fetch_it_once_and_both_take_one_copy(world: Any) -> None:
    controller, node_root, path, known, (_, weights) = world
    calls: list[str] = []
    both_ready = threading.Barrier(2)  # both ranks take the registration at once

    # two processes' areas: each its own lock object, as two ranks' are; the node's file lock is shared
    ranks = [NodeCopies(PushArea(node_root.root, SERVICE, 1 << 30), "node-b", fetch_from(controller, calls))
             for _ in range(2)]
    out: list[Any] = [None, None]

    def take(k: int) -> None:
        both_ready.wait(timeout=30)
        out[k] = ranks[k].localize("a", path, known)

    threads = [threading.Thread(target=take, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out[0][0] == out[1][0] == str(node_root.path("a", "1"))
    assert sorted(p.name for p in (node_root.dir / "a").iterdir()) == ["1"]  # one copy, no leftover
    assert (node_root.path("a", "1") / WEIGHTS_FILE).read_bytes() == bytes(weights)
    assert calls == ["a@1"] and sorted(r.copied for r in ranks) == [0, 1]  # it crossed to the node once


def test_drops_take_only_the_retired_tags_never_a_copy_being_written_nor_the_controllers_area(world: Any) -> None:
    controller, node, path, known, (config_bytes, weights) = world
    copies = NodeCopies(node, "node-b", fetch_from(controller))
    copies.localize("a", path, known)
    node.write("a", "2", config_bytes, weights)
    writing = node.dir / "a" / f"{TMP_PREFIX}x"
    writing.mkdir()
    assert copies.drop("a", ["1"], "node-a", str(controller.dir)) == ["1"]
    assert sorted(p.name for p in (node.dir / "a").iterdir()) == sorted(["2", writing.name])
    # a rank sharing the controller's area leaves it to the controller
    shared = NodeCopies(controller, "node-a", fetch_from(controller))
    assert shared.drop("a", ["1"], "node-a", str(controller.dir)) == [] and controller.path("a", "1").is_dir()
    # forgetting the name takes this node's copies (not one being written); a rank that took none takes nothing
    assert shared.forget("a") == [] and controller.path("a", "1").is_dir()
    assert copies.forget("a") == ["2"] and [p.name for p in (node.dir / "a").iterdir()] == [writing.name]


def test_a_version_left_half_written_by_a_dead_writer_is_swept_and_a_live_one_is_not(world: Any) -> None:
    """A rank killed while it wrote a version into its node's area left a ``.push-*`` directory: the next write or
    drop on that node removes it once it is older than any live write (``STALE_WRITE_S``), whatever adapter it
    was of; one written now stays, and so do the versions."""
    _, node, _, _, (config_bytes, weights) = world
    node.write("a", "1", config_bytes, weights)
    dead = node.dir / "a" / f"{TMP_PREFIX}dead"
    other = node.dir / "b" / f"{TMP_PREFIX}dead"
    live = node.dir / "a" / f"{TMP_PREFIX}live"
    for d in (dead, other, live):
        d.mkdir(parents=True)
        (d / WEIGHTS_FILE).write_bytes(b"half")
    old = time.time() - pushed.STALE_WRITE_S - 5
    for d in (dead, other):
        os.utime(d, (old, old))
    node.write("a", "2", config_bytes, weights)
    assert sorted(p.name for p in (node.dir / "a").iterdir()) == sorted(["1", "2", live.name])
    assert not other.exists()
    os.utime(live, (old, old))
    assert node.drop("a", ["1"]) == ["1"]
    assert sorted(p.name for p in (node.dir / "a").iterdir()) == ["2"]
