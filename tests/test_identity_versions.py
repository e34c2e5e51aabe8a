"""A local adapter's version from its file's identity (issue 29, item 1's start-up goal): registration reads the
config and the safetensors header, not the weights; the first read on the machine pins the content (every
block's CRC) for every later read of every process there; a read still returns its version's bytes or refuses.

The files here are seconds old, so a registration "after the racy window" moves the registration's clock
(``Later``), as ``tests/test_known_versions.py`` does. A file system that does not show a write in stat (the
case the content checks are for) is stood in for as ``tests/test_adapter_files.py`` does: a source whose
registered identity is the file's new one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lora_cache.adapters.catalog as catalog_module
import lora_cache.adapters.files as files_module
import lora_cache.adapters.peft as peft_module
import workers.reads.proof as proof_module
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.files import HOST, RACY_NS, FileIdentity, content_crcs, load_pin
from lora_cache.adapters.peft import WEIGHTS_FILE, AdapterSpec
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import write_adapter
from lora_cache.errors import AdapterChangedError, AdapterPathError
from tests.small_fs import fill, mounted_tmpfs
from workers.cache import WorkerCache, WorkerConfig
from workers.control.outbox import Outbox
from workers.control.rank import WorkerControl
from workers.reads.shard import read_shard
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostTier

TINY = SHAPES["tiny"]
F32 = torch.float32


class Later:
    """``time`` for ``peft``: registrations happen ``2 * RACY_NS`` after now (the files are settled by then)."""

    @staticmethod
    def time_ns() -> int:
        return time.time_ns() + 2 * RACY_NS


def adapter(directory: Path, seed: int) -> Path:
    return write_adapter(
        directory, TINY, 8, 16.0, list(MODULE_ORDER), torch.bfloat16, torch.Generator().manual_seed(seed)
    )


def fresh_process() -> None:
    """Forget what this process pinned or accepted, as another rank's process would not know it."""
    proof_module._PINS.clear()
    proof_module._ACCEPTED.clear()


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A root with adapters ``a`` and ``b`` (same size, other bytes); this test's own pin directory."""
    monkeypatch.setenv("LORA_CACHE_PIN_DIR", str(tmp_path / "pins"))
    monkeypatch.setattr(peft_module, "time", Later)
    adapter(tmp_path / "root" / "a", 0)
    adapter(tmp_path / "root" / "b", 1)
    fresh_process()
    yield tmp_path / "root"
    fresh_process()


def catalog(root: Path, versions: str = "identity") -> AdapterCatalog:
    return AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=16, local_versions=versions))


def read(spec: AdapterSpec, verify: str = "sample", tp: int = 1, rank: int = 0) -> torch.Tensor:
    lay = shard_layout(spec, TINY, tp, rank, F32)
    dest = torch.full((lay.numel,), float("nan"), dtype=F32)
    read_shard(spec, lay, dest, verify)
    return dest


def file_of(spec: AdapterSpec) -> Path:
    """``spec``'s weights file (a local adapter's)."""
    assert isinstance(spec.weights, Path)
    return spec.weights


def as_if_unseen(spec: AdapterSpec, path: Path | None = None) -> AdapterSpec:
    """``spec`` as a file system that did not show the last write would present it: its registered identity is
    the file's stat now (``path``: another file standing in for the same one, read at another moment)."""
    assert spec.source is not None
    weights = path or file_of(spec)
    source = spec.source._replace(path=str(weights), identity=FileIdentity.of(os.stat(weights)))
    return spec.__class__(**{**spec.__dict__, "source": source})


def test_registration_reads_no_weights_and_the_first_read_pins_the_content(root: Path) -> None:
    spec = catalog(root).register("a", root / "a")
    assert spec.source is not None and not spec.source.pinned and len(spec.source.block_crcs) == 0
    content = catalog(root, "content").register("a", root / "a")
    assert content.source is not None and content.source.pinned and content.version != spec.version
    assert catalog(root).register("a", root / "a").version == spec.version  # the same file, the same version
    assert load_pin(spec.source) is None
    assert torch.equal(read(spec, "content"), read(content, "content"))
    with open(file_of(spec), "rb") as f:
        assert load_pin(spec.source) == content_crcs(f.fileno(), spec.file_bytes, file_of(spec))
    fresh_process()  # another process takes the pin: reads check against it
    assert torch.equal(read(spec, "content", 2, 1), read(content, "content", 2, 1))


@pytest.mark.parametrize("read_before", [False, True])
@pytest.mark.parametrize("verify", ["identity", "sample", "content"])
def test_an_in_place_rewrite_with_the_same_size_and_mtime_is_refused(
    root: Path, read_before: bool, verify: str
) -> None:
    """``touch -d``: other bytes written in place, the mtime put back; only ctime shows it. Refused whether or
    not a read pinned the content first (without a pin nothing proves the new bytes are the version's)."""
    spec = catalog(root).register("a", root / "a")
    if read_before:
        read(spec)
    before = os.stat(file_of(spec))
    with open(file_of(spec), "r+b") as f:
        f.write((root / "b" / WEIGHTS_FILE).read_bytes())
    os.utime(file_of(spec), ns=(before.st_atime_ns, before.st_mtime_ns))
    now = os.stat(file_of(spec))
    assert (now.st_size, now.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    fresh_process()
    with pytest.raises(AdapterChangedError, match=f"registered as version {spec.version}"):
        read(spec, verify)
    new = catalog(root).register("a", root / "a")  # registered again: a new version, the new bytes
    b = catalog(root).register("b", root / "b")
    assert new.version != spec.version and torch.equal(read(new, verify), read(b, verify))


def test_the_same_bytes_under_a_new_identity_need_a_pinned_content(root: Path) -> None:
    """A copy renamed over the file with the same bytes: accepted once a read pinned the content (every block
    proven), refused before (nothing to prove them against)."""
    first = catalog(root).register("a", root / "a")
    before = read(first)
    data = file_of(first).read_bytes()
    (root / "a" / "tmp").write_bytes(data)
    os.replace(root / "a" / "tmp", file_of(first))
    fresh_process()
    assert torch.equal(read(first, "identity"), before)  # pinned by the read before: proven block by block
    adapter(root / "d", 2)
    unread = catalog(root).register("d", root / "d")
    (root / "d" / "tmp").write_bytes(file_of(unread).read_bytes())
    os.replace(root / "d" / "tmp", file_of(unread))
    with pytest.raises(AdapterChangedError, match="no read pinned its content"):
        read(unread)


@pytest.mark.parametrize("verify", ["sample", "content"])
def test_a_later_process_checks_its_bytes_against_the_first_reads_pin(root: Path, verify: str) -> None:
    """Rank 0 reads first (pins); then the file holds other bytes with the same stat (a file system that does
    not show the write); rank 1's first read, in another process, is refused: its content is the pinned one,
    not whatever it reads (pinning per process would serve two contents under one version)."""
    spec = catalog(root).register("a", root / "a")
    read(spec, verify, 2, 0)
    with open(file_of(spec), "r+b") as f:
        f.write((root / "b" / WEIGHTS_FILE).read_bytes())
    fresh_process()
    with pytest.raises(AdapterChangedError, match="are not the ones registered"):
        read(as_if_unseen(spec), verify, 2, 1)


def test_two_first_reads_at_once_pin_one_content(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks read an unpinned version at once and see different bytes under one stat (the second reads at
    another moment of a file system that does not show the write: ``b``'s bytes stand in). Both hash before
    either publishes; the first to publish pins; the other finds the pin and is refused."""
    spec = catalog(root).register("a", root / "a")
    b_bytes = (root / "b" / WEIGHTS_FILE).read_bytes()
    (root / "a2").mkdir()
    (root / "a2" / WEIGHTS_FILE).write_bytes(b_bytes)
    late = as_if_unseen(spec, root / "a2" / WEIGHTS_FILE)
    hashed, first_published = threading.Barrier(2, timeout=30), threading.Event()
    real_crcs, real_publish = proof_module.content_crcs, proof_module.publish_pin

    def crcs_then_wait(*args: Any) -> Any:
        out = real_crcs(*args)
        hashed.wait()  # both have hashed: neither found a pin
        return out

    def publish(source: Any, crcs: Any) -> Any:
        if source.path != str(file_of(spec)):
            assert first_published.wait(30)
            return real_publish(source, crcs)
        try:
            return real_publish(source, crcs)
        finally:
            first_published.set()

    monkeypatch.setattr(proof_module, "content_crcs", crcs_then_wait)
    monkeypatch.setattr(proof_module, "publish_pin", publish)
    results: dict[str, Any] = {}

    def run(label: str, s: AdapterSpec) -> Callable[[], None]:
        def go() -> None:
            try:
                results[label] = read(s, "identity")
            except Exception as e:
                results[label] = e

        return go

    threads = [threading.Thread(target=run("first", spec)), threading.Thread(target=run("late", late))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.setattr(proof_module, "content_crcs", real_crcs)
    monkeypatch.setattr(proof_module, "publish_pin", real_publish)
    content = catalog(root, "content").register("a", root / "a")
    assert isinstance(results["first"], torch.Tensor) and torch.equal(results["first"], read(content))
    assert isinstance(results["late"], AdapterChangedError), results["late"]
    assert "another read pinned" in str(results["late"])
    assert sorted(p.name for p in Path(os.environ["LORA_CACHE_PIN_DIR"]).iterdir()) == [f"{spec.version}.crc"]


def test_reader_processes_share_the_pin(root: Path) -> None:
    """Two host tiers with reader processes (two ranks): one pin, both reads proven against it."""
    spec = catalog(root).register("a", root / "a")
    tiers = [HostTier(HostTierConfig(host_bytes=1 << 20, read_threads=1, pin=False, reads="process")) for _ in range(2)]
    try:
        got = [
            t.fetch(spec, shard_layout(spec, TINY, 2, r, F32))[0].result(timeout=120).tensor
            for r, t in enumerate(tiers)
        ]
        assert [p.name for p in Path(os.environ["LORA_CACHE_PIN_DIR"]).iterdir()] == [f"{spec.version}.crc"]
        content = catalog(root, "content").register("a", root / "a")
        for r, g in enumerate(got):
            assert torch.equal(g, read(content, "content", 2, r))
    finally:
        for t in tiers:
            t.close()


def quiet_outbox() -> Outbox:
    """A rank's outbox with no controller behind it: its deltas go nowhere. The default send would retry them
    through Ray for the rest of the run, into whichever test's cluster is up (a thread of this module once called
    Ray in tests/test_ray_gcs_ft.py). Close it when done."""
    return Outbox("r/0", flush_s=60.0, send=lambda *_: None)


def test_a_rank_on_another_machine_refuses_an_identity_version_and_says_how(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank's own identity of the file says nothing of the bytes the controller's machine saw: refused, with
    the fix (content versions, or a store), not taken under the controller's version."""
    controller = catalog(root).register("a", root / "a")
    known = controller.known
    assert known is not None and known.host == HOST
    rank = catalog(root)
    cache = WorkerCache(
        WorkerConfig(num_slots=1, device="cpu", host=HostTierConfig(host_bytes=1 << 20, pin=False)), rank
    )
    outbox = quiet_outbox()
    try:
        control = WorkerControl("r", rank, cache, outbox)
        assert control.register_adapter("a", str(root / "a"), known) == controller.version  # same machine: taken
        for module in (files_module, peft_module, catalog_module):  # the rank now runs on another boot
            monkeypatch.setattr(module, "HOST", "another-boot")
        with pytest.raises(AdapterChangedError, match=r"another machine.*--local-versions content"):
            control.register_adapter("a", str(root / "a"), known)
    finally:
        outbox.close()
        cache.close()


def test_a_content_version_stays_one_once_its_file_settles(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file registered within its racy window gets a content version; read again once settled (by a rank given
    the controller's version, a restore, a re-registration) its unchanged bytes keep that version: an identity
    version there would be a spurious new version (a rank would refuse the controller's)."""
    monkeypatch.setattr(peft_module, "time", time)  # the real clock: the file was written just now
    racy = catalog(root).register("a", root / "a")
    assert racy.source is not None and racy.source.racy and racy.source.pinned
    monkeypatch.setattr(peft_module, "time", Later)  # settled now
    again = catalog(root).read("a", root / "a", racy.known)
    assert again.version == racy.version
    rank = catalog(root)
    cache = WorkerCache(
        WorkerConfig(num_slots=1, device="cpu", host=HostTierConfig(host_bytes=1 << 20, pin=False)), rank
    )
    outbox = quiet_outbox()
    try:
        control = WorkerControl("r", rank, cache, outbox)
        assert control.register_adapter("a", str(root / "a"), racy.known) == racy.version
    finally:
        outbox.close()
        cache.close()
    with open(file_of(racy), "r+b") as f:  # other bytes: a new version, as before
        f.write((root / "b" / WEIGHTS_FILE).read_bytes())
    assert catalog(root).read("a", root / "a", racy.known).version != racy.version


def test_a_rank_parses_only_the_adapters_it_loads_and_a_bad_first_load_changes_nothing(root: Path) -> None:
    """Lazy specs (issue 29 item 2): a rank taking N registrations on the controller's word (each adapter with
    its own module table) holds none of them parsed; the first prefetch of one builds its spec (the controller's
    version, modules and dtype) and loads it; a file rewritten after the registration fails its first load with
    ``AdapterChangedError``, nothing parsed or reserved for it, the cache as it was."""
    names = [f"t{i}" for i in range(len(MODULE_ORDER))]
    for i, name in enumerate(names):  # distinct targets: distinct module tables
        write_adapter(
            root / name,
            TINY,
            8,
            16.0,
            list(MODULE_ORDER)[: i + 1],
            torch.bfloat16,
            torch.Generator().manual_seed(10 + i),
        )
    specs = {name: catalog(root).register(name, root / name) for name in names}
    assert len({s.modules for s in specs.values()}) == len(names)
    rank = catalog(root)
    cache = WorkerCache(
        WorkerConfig(num_slots=2, device="cpu", host=HostTierConfig(host_bytes=1 << 20, pin=False)), rank
    )
    outbox = quiet_outbox()
    try:
        control = WorkerControl("r", rank, cache, outbox)
        for name in names:
            assert control.register_adapter(name, str(root / name), specs[name].known) == specs[name].version
        assert rank.parsed() == [] and rank.parses == 0 and (control.taken, control.hashed) == (len(names), 0)
        assert rank.versions(names[2]) == [specs[names[2]].version]  # versions and names need no parse
        first = names[2]
        cache.prefetch(first).result(timeout=30)
        assert rank.parsed() == [(first, specs[first].version)] and rank.parses == 1
        built = rank.get(first)
        assert (built.version, built.modules, built.dtype) == (
            specs[first].version,
            specs[first].modules,
            specs[first].dtype,
        )
        assert {(k.name, k.version) for k in cache.ready_keys()} == {(first, specs[first].version)}

        bad = names[3]
        adapter(root / bad, 99)  # rewritten after its registration: other bytes, another identity
        residency, used = cache.residency(), cache.stats()["host_bytes_used"]
        with pytest.raises(AdapterChangedError, match=repr(bad)):
            cache.prefetch(bad)
        assert rank.parsed() == [(first, specs[first].version)]
        assert cache.residency() == residency and cache.stats()["host_bytes_used"] == used
        assert rank.current(bad) == specs[bad].version  # still registered; refused on every load until re-registered
        with pytest.raises(AdapterChangedError):
            cache.stage(bad)
    finally:
        outbox.close()
        cache.close()


def test_a_pin_that_finds_a_full_disk_refuses_the_read_naming_the_pin_dir_and_the_fix(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: the read failed with a bare "[Errno 28] No space left on device" (the pin directory is in the
    temporary directory by default, often Ray's temp disk)."""
    spec = catalog(root).register("a", root / "a")
    with mounted_tmpfs("1m") as small:
        pins = small / "pins"
        pins.mkdir(mode=0o700)
        fill(small)
        monkeypatch.setenv("LORA_CACHE_PIN_DIR", str(pins))
        with pytest.raises(AdapterPathError) as info:
            read(spec, "content")
        message = str(info.value)
        assert f"{pins}, where identity versions' contents are pinned, has no room" in message, message
        assert "free space there, or set LORA_CACHE_PIN_DIR to a private directory with room" in message, message
        assert list(pins.iterdir()) == []  # no half-written pin left
        (small / "fill").unlink()
        assert read(spec, "content").isfinite().all()  # room again: the same read pins and serves
