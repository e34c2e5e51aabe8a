"""Fault injection without Ray (issue 35, items 4 and 8): an adapter file appended to or cut short while a CPU
reader in the same process reads it (a worker's reader threads: alone, and split over three).

Before issue 35 the single reader copied from a mapped file, and a file cut short under the mapping raised
SIGBUS in the reading process: the whole worker died. Each case runs in a child process so that such a death
fails the test instead of killing pytest. The read must fail with ``AdapterChangedError``, the host tier stay as
it was (entries, arena, bytes read), and the next read of the file, once restored, give its registered bytes.
The Ray half of the suite is tests/test_ray_faults.py; figures in bench/RESULTS.md.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fault_tally import Tally

F32 = torch.float32
CHANGES = ("truncate", "append", "truncate-to-header")


@pytest.fixture(scope="module")
def tally() -> Iterator[Tally]:
    t = Tally("test_faults (CPU, in-process readers)")
    yield t
    t.report()


def change_mid_read(root: str, readers: int, results: Any) -> None:
    """In a child: register two adapters, stage one, then read the other while its file is changed after the open
    (once each of ``CHANGES``); put (change, outcome, tier unchanged, reread equal) for each."""
    from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
    from lora_cache.adapters.shapes import SHAPES
    from lora_cache.adapters.shards import shard_layout
    from lora_cache.errors import AdapterChangedError
    from lora_cache.vocab import AdapterKey
    from tests.conftest import expected_entries
    from workers.reads import shard as reader_module
    from workers.staging.host_config import HostTierConfig
    from workers.staging.host_tier import HostTier

    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(root,), model="tiny", max_rank=16))
    catalog.register_dir(Path(root))
    tier = HostTier(
        HostTierConfig(host_bytes=1 << 20, read_threads=2, read_parallel=readers, pin=False, reads="thread")
    )
    try:
        staged = catalog.get("adapter-001")
        tier.fetch(staged, shard_layout(staged, SHAPES["tiny"], 1, 0, F32))[0].result(timeout=60)
        tier.release(AdapterKey(staged.name, staged.version))
        spec = catalog.get("adapter-000")
        layout = shard_layout(spec, SHAPES["tiny"], 1, 0, F32)
        pristine = spec.weights.read_bytes()
        for change in CHANGES:
            before = (list(tier._entries), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read)
            _arm(reader_module, spec.weights, change, spec.source.header_bytes)  # type: ignore[union-attr]
            try:
                tier.fetch(spec, layout)[0].result(timeout=60)
                outcome = "read"
            except AdapterChangedError as e:
                outcome = f"AdapterChangedError: {e}"
            except Exception as e:  # any other failure is a finding
                outcome = f"{type(e).__name__}: {e}"
            finally:
                _disarm(reader_module)
            unchanged = (list(tier._entries), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read) == before
            tier.check_integrity()
            _restore(spec.weights, pristine)
            entry = tier.fetch(spec, layout)[0].result(timeout=60)
            want = expected_entries(spec, layout)
            equal = all(
                torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape), want[(e.layer, e.module, e.ab)])
                for e in layout.entries
            )
            tier.release(AdapterKey(spec.name, spec.version))
            tier.drop(AdapterKey(spec.name, spec.version))
            results.put((change, outcome, unchanged, equal))
    finally:
        tier.close()


_REAL: dict[str, Any] = {}


def _arm(reader_module: Any, weights: Path, change: str, header_bytes: int) -> None:
    """The change lands once, after the file was opened and checked, before its first byte is read: wherever the
    read copies from (a mapped file before issue 35, positioned reads now)."""
    done = [False]

    def changed_first(real: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            if not done[0]:
                done[0] = True
                _change(weights, change, header_bytes)
            return real(*args)

        return wrapper

    for name in ("_copy_slices", "_run_task"):
        _REAL[name] = getattr(reader_module, name)
        setattr(reader_module, name, changed_first(_REAL[name]))


def _disarm(reader_module: Any) -> None:
    for name, real in _REAL.items():
        setattr(reader_module, name, real)


def _change(weights: Path, change: str, header_bytes: int) -> None:
    with open(weights, "r+b") as f:
        if change == "append":
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * 4096)
        elif change == "truncate":
            f.truncate(os.fstat(f.fileno()).st_size // 2)
        else:
            f.truncate(header_bytes + 8)


def _restore(weights: Path, pristine: bytes) -> None:
    """The registered bytes back, as a new file (a new identity: the read checks every block once, then takes it)."""
    tmp = weights.with_suffix(".restore")
    tmp.write_bytes(pristine)
    os.replace(tmp, weights)


@pytest.mark.parametrize("readers", [1, 3])
def test_a_file_changed_mid_read_fails_the_read_not_the_process(
    tmp_path: Path, tiny_adapters: Any, tally: Tally, readers: int
) -> None:
    paths = tiny_adapters(count=2, rank="16")
    root = paths[0].parent
    shutil.rmtree(root / "__pycache__", ignore_errors=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=change_mid_read, args=(str(root), readers, results))
    child.start()
    child.join(300)
    seen = []
    while not results.empty():
        seen.append(results.get())
    for change, outcome, unchanged, equal in seen:
        ok = outcome.startswith("AdapterChangedError") and unchanged and equal
        tally.record(f"{change} mid-read, {readers} reader(s) in-process", survived=ok, lost=int(not equal))
    if child.exitcode == -signal.SIGBUS:
        tally.record(f"{CHANGES[len(seen)]} mid-read, {readers} reader(s) in-process", survived=False)
    assert child.exitcode == 0, (
        f"the reading process died (exit {child.exitcode}"
        f"{', SIGBUS' if child.exitcode == -signal.SIGBUS else ''}) after {seen}"
    )
    assert [s[0] for s in seen] == list(CHANGES)
    for change, outcome, unchanged, equal in seen:
        assert outcome.startswith("AdapterChangedError"), (change, outcome)
        assert "version" in outcome and "adapter-000" in outcome, outcome
        assert unchanged, f"{change}: the host tier changed"
        assert equal, f"{change}: the restored file's read is not its registered bytes"
