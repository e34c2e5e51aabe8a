"""Adapter files under change and attack (issue 19, items 1-2): every file confined to the roots, only regular
files opened, and a read under a version returns that version's bytes or a classified refusal, never others.

Faults are injected at named points (a wrapper around the real function that changes the file right after
it ran), never by sleeping; every refusal leaves the catalog and the host tier as they were.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lora_cache.adapters.files as files_module
import lora_cache.adapters.peft as peft_module
import workers.reads.proof as proof_module
import workers.reads.shard as reader_module
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.chunks import chunk_plan
from lora_cache.adapters.files import FileIdentity
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec
from lora_cache.adapters.roots import AdapterRoots
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import ShardLayout, shard_layout
from lora_cache.adapters.synth import write_adapter
from lora_cache.errors import AdapterChangedError, AdapterError, AdapterFormatError, AdapterPathError
from workers.reads.shard import read_shard
from workers.reads.threads import ReadPool
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostTier

TINY = SHAPES["tiny"]
F32 = torch.float32
MiB = 1 << 20


def in_thread(fn: Callable[[], Any]) -> Future[Any]:
    """Run ``fn`` on a daemon thread: a hang (a FIFO opened blocking) shows as a timeout, not a stuck run."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def refused(fn: Callable[[], Any], kind: type[Exception]) -> str:
    """The message of the classified error ``fn`` raises, within 10 s (never a hang)."""
    with pytest.raises(kind) as e:
        in_thread(fn).result(timeout=10)
    assert isinstance(e.value, AdapterError)
    return str(e.value)


def adapter(directory: Path, seed: int) -> Path:
    """A tiny rank-8 adapter; every seed gives a file of the same size and other weights."""
    return write_adapter(directory, TINY, 8, 16.0, list(MODULE_ORDER), torch.bfloat16,
                         torch.Generator().manual_seed(seed))


@pytest.fixture
def tree(tmp_path: Path) -> tuple[AdapterCatalog, Path, Path]:
    """A catalog over ``root`` (one good adapter, ``good``) and a directory ``outside`` every root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    adapter(root / "good", 0)
    adapter(outside / "evil", 1)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=16))
    return catalog, root.resolve(), outside.resolve()


def copy_config(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / CONFIG_FILE, dst / CONFIG_FILE)
    return dst


POOL = ReadPool(3)  # reads split over three reader threads (workers.reads.threads), beside the single reader


def read(spec: AdapterSpec, verify: str = "sample", tp: int = 1, rank: int = 0, readers: int = 1,
         dtype: torch.dtype = F32) -> torch.Tensor:
    """The shard, read by one thread or split over ``POOL`` (``readers`` 3), in a chunk per layer."""
    lay = shard_layout(spec, TINY, tp, rank, dtype)
    dest = torch.full((lay.numel,), float("nan"), dtype=dtype)
    spans = chunk_plan(lay.entries, lay.numel, TINY.num_layers, dtype.itemsize, 0).entry_spans
    read_shard(spec, lay, dest, verify, spans, None, POOL if readers > 1 else None)
    return dest


# -- item 1: every file confined to the roots -----------------------------------------------------------------


@pytest.mark.parametrize("which", [WEIGHTS_FILE, CONFIG_FILE])
def test_a_file_symlink_that_leaves_the_roots_is_refused(tree: tuple[AdapterCatalog, Path, Path], which: str) -> None:
    catalog, root, outside = tree
    shutil.copytree(root / "good", root / "a")
    (root / "a" / which).unlink()
    (root / "a" / which).symlink_to(outside / "evil" / which)
    msg = refused(lambda: catalog.register("a", "a"), AdapterPathError)
    assert str(root / "a" / which) in msg and f"resolves to {outside / 'evil' / which}" in msg  # the file, where
    assert "outside the adapter roots" in msg and "add a root" in msg and "copy the file" in msg  # ...and the fix
    assert "a" not in catalog


def test_a_symlink_chain_and_a_linked_directory_that_leave_are_refused(
    tree: tuple[AdapterCatalog, Path, Path],
) -> None:
    catalog, root, outside = tree
    chain = copy_config(root / "good", root / "chain")  # weights -> hop1 -> hop2 -> outside, each hop inside
    (root / "hop2").symlink_to(outside / "evil" / WEIGHTS_FILE)
    (root / "hop1").symlink_to(root / "hop2")
    (chain / WEIGHTS_FILE).symlink_to(root / "hop1")
    msg = refused(lambda: catalog.register("chain", "chain"), AdapterPathError)
    assert f"resolves to {outside / 'evil' / WEIGHTS_FILE}" in msg and f"a symlink to '{root / 'hop1'}'" in msg
    linked = copy_config(root / "good", root / "linked")  # weights -> blobs/x, where blobs is a link outside
    (root / "blobs").symlink_to(outside / "evil", target_is_directory=True)
    (linked / WEIGHTS_FILE).symlink_to(root / "blobs" / WEIGHTS_FILE)
    msg = refused(lambda: catalog.register("linked", "linked"), AdapterPathError)
    assert f"resolves to {outside / 'evil' / WEIGHTS_FILE}" in msg and "outside the adapter roots" in msg
    assert len(catalog) == 0


def test_links_that_stay_under_a_root_are_read_like_the_hugging_face_cache(
    tree: tuple[AdapterCatalog, Path, Path],
) -> None:
    catalog, root, _ = tree
    blobs = root / "blobs"
    blobs.mkdir()
    shutil.copy(root / "good" / WEIGHTS_FILE, blobs / "sha256-1")
    snap = copy_config(root / "good", root / "snapshots" / "rev1")
    (snap / WEIGHTS_FILE).symlink_to(Path("../../blobs/sha256-1"))  # relative, as huggingface_hub writes them
    spec = catalog.register("hf", snap)
    assert spec.source is not None and spec.source.path == str(blobs / "sha256-1")
    assert spec.version == catalog.register("good", "good").version  # same bytes, same version
    assert torch.equal(read(spec), read(catalog.get("good")))


def test_a_dangling_link_is_a_missing_file(tree: tuple[AdapterCatalog, Path, Path]) -> None:
    catalog, root, _ = tree
    a = copy_config(root / "good", root / "a")
    (a / WEIGHTS_FILE).symlink_to(root / "nowhere")
    msg = refused(lambda: catalog.register("a", "a"), AdapterFormatError)
    assert str(a / WEIGHTS_FILE) in msg and "is missing" in msg


def test_a_directory_swapped_for_a_link_after_it_was_resolved_is_not_followed(
    tree: tuple[AdapterCatalog, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the no-follow walk closes: ``confine_file`` resolves a path under the root, then a directory on
    it becomes a link to outside before the open."""
    catalog, root, outside = tree
    (root / "blobs" / "sub").mkdir(parents=True)
    shutil.copy(root / "good" / WEIGHTS_FILE, root / "blobs" / "sub" / "w")
    a = copy_config(root / "good", root / "a")
    (a / WEIGHTS_FILE).symlink_to(root / "blobs" / "sub" / "w")
    (outside / "sub").mkdir()
    shutil.copy(outside / "evil" / WEIGHTS_FILE, outside / "sub" / "w")
    real_confine = AdapterRoots.confine_file

    def confine_then_swap(self: AdapterRoots, path: Path) -> Path:
        real = real_confine(self, path)
        if real.name == "w":  # the fault: after the check, before the open
            (root / "blobs" / "sub").rename(root / "blobs" / "moved")
            (root / "blobs" / "sub").symlink_to(outside / "sub", target_is_directory=True)
        return real

    monkeypatch.setattr(AdapterRoots, "confine_file", confine_then_swap)
    msg = refused(lambda: catalog.register("a", "a"), AdapterChangedError)
    assert "became a symlink" in msg and "not followed" in msg and "a" not in catalog


# -- item 1: only regular files, never a hang -------------------------------------------------------------------


def special(kind: str, path: Path) -> None:
    """Put a non-regular file of ``kind`` at ``path`` (replacing what is there)."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    else:
        path.symlink_to(kind)  # a device or a /proc or /sys file


@pytest.mark.parametrize("which", [WEIGHTS_FILE, CONFIG_FILE])
@pytest.mark.parametrize(("kind", "error", "says"), [
    ("fifo", AdapterPathError, "is a FIFO (named pipe), not a regular file"),
    ("directory", AdapterPathError, "is a directory, not a regular file"),
    ("socket", AdapterPathError, "is a socket, not a regular file"),
    ("/dev/zero", AdapterPathError, "(/dev/zero) is a character device, not a regular file"),
    ("/proc/self/status", AdapterPathError, "says it is empty but holds bytes: a /proc or /sys file"),
    ("/sys/kernel/mm/transparent_hugepage/enabled", AdapterFormatError, "a /proc or /sys file"),
])
def test_special_files_are_refused_without_a_hang(
    tmp_path: Path, which: str, kind: str, error: type[Exception], says: str
) -> None:
    """Even with ``/`` as the root (confinement passes), a FIFO with no writer, a device, a directory, a
    socket and the /proc and /sys files that misstate their size are refused, each by its kind."""
    if kind.startswith("/") and not Path(kind).exists():
        pytest.skip(f"{kind} does not exist on this machine")
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=("/",), model="tiny", max_rank=16))
    good = catalog.register("a", adapter(tmp_path / "a", 0))
    special(kind, tmp_path / "a" / which)
    if kind.startswith("/sys") and which == WEIGHTS_FILE:  # 4096 bytes of text: no safetensors header in them
        says = "is not a readable safetensors file (its header length"
    msg = refused(lambda: catalog.register("a", tmp_path / "a"), error)
    assert str(tmp_path / "a" / which) in msg and says in msg
    assert catalog.get("a") == good  # the registered version stays


def test_a_huge_config_is_refused_unread(tmp_path: Path, make_catalog: Callable[..., AdapterCatalog]) -> None:
    a = adapter(tmp_path / "a", 0)
    with open(a / CONFIG_FILE, "r+b") as f:
        f.truncate(2 * MiB)  # sparse: its size alone says it is no adapter config
    msg = refused(lambda: make_catalog(tmp_path), AdapterFormatError)
    assert str(a / CONFIG_FILE) in msg and f"{2 * MiB} bytes, more than the {MiB}" in msg


# -- item 1: a file that changes while it is registered -----------------------------------------------------


@pytest.mark.parametrize("fault", ["grow", "shrink", "rewrite"])
def test_a_weights_file_that_changes_while_it_is_registered_is_refused(
    tree: tuple[AdapterCatalog, Path, Path], monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The fault is injected right after registration has read the file's bytes, before its checks."""
    catalog, root, outside = tree
    good = catalog.register("good", "good")
    weights = root / "good" / WEIGHTS_FILE
    other = (outside / "evil" / WEIGHTS_FILE).read_bytes()
    real_chunks = files_module._chunks

    def chunks_then_change(fd: int, size: int, what: Path, chunk: int = files_module.BLOCK_BYTES) -> Iterator[bytes]:
        yield from real_chunks(fd, size, what, chunk)
        if what == weights:
            with open(weights, "r+b") as f:
                if fault == "grow":
                    f.seek(0, os.SEEK_END)
                    f.write(b"\0" * 64)
                elif fault == "shrink":
                    f.truncate(size - 64)
                else:
                    f.write(other)  # another adapter of the same size, in place

    monkeypatch.setattr(files_module, "_chunks", chunks_then_change)
    msg = refused(lambda: catalog.register("good", "good"), AdapterChangedError)
    assert str(weights) in msg
    assert {"grow": "grew while it was read", "shrink": "changed while it was being registered (its size changed",
            "rewrite": "changed while it was being registered (it was written in place"}[fault] in msg
    assert catalog.get("good") == good


# -- item 2: no bytes of another content under a version ----------------------------------------------------


@pytest.fixture
def changed(tree: tuple[AdapterCatalog, Path, Path]) -> tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor]:
    """The catalog, ``good`` registered, the path of a same-size other adapter's weights, ``good``'s shard."""
    catalog, _, outside = tree
    spec = catalog.register("good", "good")
    other = outside / "evil" / WEIGHTS_FILE
    assert other.stat().st_size == spec.file_bytes and other.read_bytes() != spec.weights.read_bytes()
    return catalog, spec, other, read(spec)


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("verify", ["identity", "sample", "content"])
@pytest.mark.parametrize("how", ["in-place", "rename-over", "truncate", "fifo", "/dev/zero", "delete"])
def test_a_read_under_an_old_version_refuses_other_bytes(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor], how: str, verify: str, readers: int
) -> None:
    catalog, spec, other, _ = changed
    if how == "in-place":
        with open(spec.weights, "r+b") as f:
            f.write(other.read_bytes())
    elif how == "rename-over":
        shutil.copy(other, spec.path / "tmp")
        os.replace(spec.path / "tmp", spec.weights)
    elif how == "truncate":
        os.truncate(spec.weights, spec.file_bytes // 2)
    elif how == "delete":
        spec.weights.unlink()
    else:
        special(how, spec.path / "tmp")
        os.replace(spec.path / "tmp", spec.weights)
    msg = refused(lambda: read(spec, verify, readers=readers), AdapterChangedError)
    assert str(spec.weights) in msg and spec.version in msg and "register" in msg
    assert {"in-place": "its bytes are not the ones registered", "rename-over": "its bytes are not the ones registered",
            "truncate": "changed size", "fifo": "is now a FIFO", "/dev/zero": "is now a character device",
            "delete": "is gone"}[how] in msg
    if how in ("in-place", "rename-over"):  # the new content is a new version, with the new bytes
        new = catalog.register("good", "good")
        assert new.version != spec.version and torch.equal(read(new, readers=readers), read_other(other, new))


def read_other(other: Path, like: AdapterSpec, tp: int = 1, rank: int = 0) -> torch.Tensor:
    """The shard of the adapter whose weights are ``other`` (registered on its own; ``like`` for its version)."""
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(other.parent),), model="tiny", max_rank=16))
    spec = catalog.register("other", other.parent)
    assert spec.version != like.version or other.read_bytes() == like.weights.read_bytes()
    return read(spec, tp=tp, rank=rank)


def test_the_same_bytes_under_a_new_identity_are_accepted(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor],
) -> None:
    """A re-sync that writes the same bytes (a copy renamed over it, a touch) keeps the version readable."""
    _, spec, _, before = changed
    shutil.copy(spec.weights, spec.path / "tmp")
    os.replace(spec.path / "tmp", spec.weights)
    os.utime(spec.weights)
    assert spec.source is not None and spec.source.identity != FileIdentity.of(os.stat(spec.weights))
    assert torch.equal(read(spec, "identity"), before)
    assert torch.equal(read(spec, "content"), before)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("fault", ["rewrite", "grow", "shrink"])
def test_a_file_changed_during_a_read_is_refused(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor], monkeypatch: pytest.MonkeyPatch, fault: str,
    readers: int, dtype: torch.dtype
) -> None:
    """The fault lands right after the slices were read (one part of a read alone or split over three threads:
    positioned reads for a bf16 shard, reads that convert for fp32), before the checks that follow; every
    chunk's check then sees it."""
    _, spec, other, _ = changed
    name = "_run_task"
    real_copy = getattr(reader_module, name)
    lock = threading.Lock()

    def copy_then_change(*args: Any) -> Any:
        copied = real_copy(*args)
        with lock, open(spec.weights, "r+b") as f:
            if fault == "rewrite":
                f.write(other.read_bytes())
            elif fault == "grow":
                f.seek(0, os.SEEK_END)
                f.write(b"\0" * 64)
            else:
                f.truncate(spec.file_bytes - 64)
        return copied

    monkeypatch.setattr(reader_module, name, copy_then_change)
    msg = refused(lambda: read(spec, "identity", readers=readers, dtype=dtype), AdapterChangedError)
    assert "while it was read" in msg or "are not the ones registered" in msg or "shrank while it was read" in msg
    assert spec.version in msg


def unseen_write(spec: AdapterSpec, other: Path, registered_after_ns: int) -> AdapterSpec:
    """``other``'s bytes written in place, with a source that believes the new stat is the registered one: a
    file system whose timestamps did not move (a coarse tick, a lying FUSE). ``registered_after_ns``: how long
    after the file's change its registration came (below RACY_NS: racy)."""
    with open(spec.weights, "r+b") as f:
        f.write(other.read_bytes())
    assert spec.source is not None
    now = FileIdentity.of(os.stat(spec.weights))
    return spec.__class__(**{**spec.__dict__, "source": spec.source._replace(
        identity=now, registered_ns=now.ctime_ns + registered_after_ns)})


@pytest.mark.parametrize("verify", ["sample", "content"])
def test_content_checks_catch_a_write_that_stat_does_not_show(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor], verify: str
) -> None:
    _, spec, other, _ = changed
    blind = unseen_write(spec, other, 10 * files_module.RACY_NS)
    msg = refused(lambda: read(blind, verify), AdapterChangedError)
    assert "are not the ones registered" in msg


def test_identity_mode_trusts_stat_except_for_a_racy_version(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor],
) -> None:
    """``identity`` reads no content: where stat cannot show a write, it returns the new bytes (the mode's
    documented limit), unless the version is racy (registered within RACY_NS of the file's change), which
    is checked in full in every mode."""
    _, spec, other, before = changed
    racy = unseen_write(spec, other, files_module.RACY_NS // 2)
    assert racy.source is not None and racy.source.racy
    assert "are not the ones registered" in refused(lambda: read(racy, "identity"), AdapterChangedError)
    settled = racy.__class__(**{**racy.__dict__, "source": racy.source._replace(
        registered_ns=racy.source.identity.ctime_ns + 10 * files_module.RACY_NS)})
    assert not torch.equal(read(settled, "identity"), before)  # the limit, measured: stat is all it has


def test_a_racy_version_is_checked_until_a_check_after_its_window(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor],
) -> None:
    _, spec, _, before = changed
    assert spec.source is not None
    old = spec.source.identity
    past = old._replace(ctime_ns=old.ctime_ns - 10 * files_module.RACY_NS)  # racy at registration, settled now
    src = spec.source._replace(identity=past, registered_ns=past.ctime_ns + 1)
    index = proof_module.parse_index(spec.weights.read_bytes()[: src.header_bytes], src.identity.size)
    entries = shard_layout(spec, TINY, 1, 0, F32).entries
    every = proof_module._blocks_to_check(src, index, entries, "identity")
    assert src.racy and every == list(range(len(src.block_crcs)))
    with open(spec.weights, "rb") as f, reader_module._mapped(f.fileno()) as mapped:
        proof_module._check_blocks(mapped, src, every)
    assert proof_module._blocks_to_check(src, index, entries, "identity") == []  # proven: stat shows the rest
    assert torch.equal(read(spec), before)


# -- the host tier: old bytes stay served, the tier stays whole -----------------------------------------------


@pytest.fixture(params=["thread", "process"])
def tier(request: pytest.FixtureRequest) -> Iterator[HostTier]:
    tier = HostTier(HostTierConfig(host_bytes=MiB, read_threads=1, pin=False, reads=request.param))
    try:
        yield tier
    finally:
        tier.close()


def layout(spec: AdapterSpec, tp: int = 1, rank: int = 0) -> ShardLayout:
    return shard_layout(spec, TINY, tp, rank, F32)


def test_requests_on_the_old_version_keep_the_old_bytes_or_fail_cleanly(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor], tier: HostTier
) -> None:
    """Overwritten in place by a same-size adapter: the rank that staged the old version still serves it (the
    old bytes); the other rank, which had not, is refused (in a reader process too) and its tier is as it
    was; the re-registered content is a new version with the new bytes on both."""
    catalog, spec, other, _ = changed
    rank1 = HostTier(HostTierConfig(host_bytes=MiB, read_threads=1, pin=False, reads=tier.reads))
    try:
        old0 = read(spec, tp=2, rank=0)
        staged = tier.fetch(spec, layout(spec, 2, 0))[0].result(timeout=120)
        tier.release(staged.key)
        with open(spec.weights, "r+b") as f:
            f.write(other.read_bytes())
        hit, was_hit = tier.fetch(spec, layout(spec, 2, 0))
        assert was_hit and torch.equal(hit.result(timeout=10).tensor, old0)  # the old bytes, from the host tier
        tier.release(staged.key)
        future, was_hit = rank1.fetch(spec, layout(spec, 2, 1))
        with pytest.raises(AdapterChangedError, match="are not the ones registered"):
            future.result(timeout=120)
        assert not was_hit and not rank1._entries and rank1.arena.used_bytes == 0 and rank1.bytes_read == 0
        rank1.check_integrity()
        new = catalog.register("good", "good")
        for t, rank in ((tier, 0), (rank1, 1)):
            entry = t.fetch(new, layout(new, 2, rank))[0].result(timeout=120)
            assert torch.equal(entry.tensor, read_other(other, new, 2, rank))
            t.check_integrity()
        assert not torch.equal(read(new, tp=2, rank=0), old0)
    finally:
        rank1.close()


def test_a_fifo_put_over_the_weights_does_not_hang_a_reader_process(
    changed: tuple[AdapterCatalog, AdapterSpec, Path, torch.Tensor],
) -> None:
    """The reader process stats the path before it opens it: a FIFO (no writer) there is refused, not opened;
    the error keeps its class across the process boundary, and the process serves the next read."""
    _, spec, _, before = changed
    tier = HostTier(HostTierConfig(host_bytes=MiB, read_threads=1, pin=False, reads="process"))
    try:
        data = spec.weights.read_bytes()
        special("fifo", spec.weights)
        future, _ = tier.fetch(spec, layout(spec))
        with pytest.raises(AdapterChangedError, match=r"is now a FIFO .* refused without reading it"):
            future.result(timeout=120)
        assert not tier._entries and tier.arena.used_bytes == 0
        spec.weights.unlink()
        spec.weights.write_bytes(data)  # the same bytes back: the version reads again
        entry = tier.fetch(spec, layout(spec))[0].result(timeout=120)
        assert torch.equal(entry.tensor, before) and tier._reader._all[0].restarts == 0
        tier.check_integrity()
    finally:
        tier.close()


# -- the invariant, under any sequence of changes --------------------------------------------------------------


class _Later:
    """``time`` for ``peft``: a registration 2 s after now (every file is settled by then)."""

    @staticmethod
    def time_ns() -> int:
        import time

        return time.time_ns() + 2 * files_module.RACY_NS


CHANGES = ["in-place", "rename-over", "restore", "touch", "register", "grow", "truncate"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(CHANGES), st.integers(0, 2), st.sampled_from(["identity",
                                                                                               "sample", "content"]),
                                st.sampled_from([1, 3])),
                      min_size=1, max_size=12))
@pytest.mark.parametrize("mode", ["content", "identity"])
def test_a_read_returns_its_versions_bytes_or_refuses(tmp_path_factory: pytest.TempPathFactory,
                                                       monkeypatch: pytest.MonkeyPatch, mode: str,
                                                       steps: list[tuple[str, int, str, int]]) -> None:
    """Invariant: after any sequence of in-place writes, renames over, restores, touches, size changes and
    re-registrations, a read under any version ever registered returns exactly that version's bytes, or
    raises AdapterChangedError, whether one thread reads it or three split it; registering the same bytes always
    gives the same content version. Identity versions (registered as if 2 s after each file's last change:
    ``peft``'s clock moved) are read right after their registration, which pins the bytes they name."""
    base = tmp_path_factory.mktemp("inv")
    if mode == "identity":
        monkeypatch.setenv("LORA_CACHE_PIN_DIR", str(tmp_path_factory.mktemp("pins")))
        monkeypatch.setattr(peft_module, "time", _Later)
    contents = [adapter(base / f"c{i}", i) / WEIGHTS_FILE for i in range(3)]
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(base),), model="tiny", max_rank=16,
                                           local_versions=mode))
    target = base / "a"
    copy_config(base / "c0", target)
    shutil.copy(contents[0], target / WEIGHTS_FILE)
    truth = {0: catalog.register("c0", base / "c0")}  # content index -> its spec (its version, its bytes)
    shards = {k: read(s) for k, s in truth.items()}
    versions = [catalog.register("a", target)]
    held = {versions[0].version: 0}
    weights = target / WEIGHTS_FILE
    assert versions[0].version == truth[0].version or mode == "identity"
    assert versions[0].source is not None and versions[0].source.pinned == (mode == "content")
    assert torch.equal(read(versions[0]), shards[0])
    for op, k, verify, readers in steps:
        if op == "in-place":
            with open(weights, "r+b") as f:
                f.write(contents[k].read_bytes())
        elif op == "rename-over" or op == "restore":
            shutil.copy(contents[k if op == "rename-over" else held[versions[-1].version]], base / "tmp")
            os.replace(base / "tmp", weights)
        elif op == "touch":
            os.utime(weights)
        elif op == "grow":
            with open(weights, "ab") as f:
                f.write(b"\0" * 8)
        elif op == "truncate":
            os.truncate(weights, 1000)
        else:
            try:
                spec = catalog.register("a", target)
            except AdapterError:
                continue  # a grown or truncated file is no adapter: nothing registered
            k_now = next((i for i, c in enumerate(contents) if c.read_bytes() == weights.read_bytes()), None)
            if k_now is not None:
                truth.setdefault(k_now, catalog.register(f"c{k_now}", base / f"c{k_now}"))
                shards.setdefault(k_now, read(truth[k_now]))
                assert spec.version == truth[k_now].version or mode == "identity"  # same bytes, same version
                held[spec.version] = k_now
                versions.append(spec)
        for spec in versions:
            try:
                got = read(spec, verify, readers=readers)
            except AdapterChangedError:
                continue
            assert torch.equal(got, shards[held[spec.version]]), f"{spec.version} returned other bytes after {op}"
