"""A push's passes over its bytes on several threads (issue 44 item 5): the content version (version 2: the config,
the size and each block's hash) is the same however the bytes are read and however many threads hash them; the
push area's file written through a shared mapping holds exactly the bytes and is settled when the write returns;
the client's payload copied in groups is safetensors' own bytes."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from lora_cache.adapters import passes
from lora_cache.adapters.files import BLOCK_BYTES, FileIdentity, digest_weights
from lora_cache.adapters.passes import PASS_BYTES
from lora_cache.adapters.pushed import digest, write_spread
from lora_cache.adapters.serialize import safetensors_bytes
from lora_cache.errors import ConfigError

SIZES = [9, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, PASS_BYTES, PASS_BYTES + 1, 2 * PASS_BYTES + 3 * BLOCK_BYTES]


def weights_of(size: int, seed: int) -> bytes:
    """``size`` bytes led by a safetensors length prefix (what ``digest`` reads of a header), the rest random."""
    body = bytearray(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.uint8).numpy().tobytes())
    body[:8] = min(64, size - 8).to_bytes(8, "little")
    return bytes(body)


def file_digest(path: Path, config: bytes, header_bytes: int) -> tuple[str, int, tuple[int, ...]]:
    fd = os.open(path, os.O_RDONLY)
    try:
        version, header_crc, crcs = digest_weights(fd, FileIdentity.of(os.fstat(fd)), path, config, header_bytes)
    finally:
        os.close(fd)
    return version, header_crc, tuple(crcs)


@contextlib.contextmanager
def pass_threads(n: int) -> Iterator[None]:
    """The push's passes on ``n`` threads of their own while the block runs (``passes.passes``)."""
    pool, saved = ThreadPoolExecutor(n, "test-pass"), list(passes._POOL)
    passes._POOL[:] = [pool]
    try:
        yield
    finally:
        passes._POOL[:] = saved
        if pool is not None:
            pool.shutdown()


@settings(max_examples=12, deadline=None)
@given(size=st.sampled_from(SIZES), seed=st.integers(0, 3), n=st.sampled_from([1, 3, 8]))
def test_a_content_version_is_the_same_however_its_bytes_are_read(tmp_path_factory: pytest.TempPathFactory,
                                                                    size: int, seed: int, n: int) -> None:
    """The version, the header's CRC and every block's CRC of a push hashed from memory on ``n`` threads are those
    of its file hashed in one pass, at every size about a block's and a thread's span's edges."""
    data = weights_of(size, seed)
    path = tmp_path_factory.mktemp("v") / "w"
    path.write_bytes(data)
    with pass_threads(n):
        content = digest(b"{}", data)
    assert (content.version, content.header_crc, tuple(content.block_crcs)) == \
        file_digest(path, b"{}", content.header_bytes)
    assert len(content.block_crcs) == -(-size // BLOCK_BYTES)


def test_other_bytes_config_or_order_give_another_version() -> None:
    """A byte changed in any block, two blocks swapped, a byte more or less, or another config: another version."""
    data = weights_of(3 * BLOCK_BYTES + 17, 0)
    variants = [data]
    for at in (8, BLOCK_BYTES - 1, 2 * BLOCK_BYTES + 5, len(data) - 1):
        flipped = bytearray(data)
        flipped[at] ^= 1
        variants.append(bytes(flipped))
    variants += [data[:BLOCK_BYTES] + data[2 * BLOCK_BYTES:3 * BLOCK_BYTES] + data[BLOCK_BYTES:2 * BLOCK_BYTES]
                 + data[3 * BLOCK_BYTES:], data + b"\0", data[:-1]]
    with pass_threads(4):
        versions = {digest(b"{}", v).version for v in variants} | {digest(b'{"r":8}', data).version}
    assert len(versions) == len(variants) + 1


def test_a_spread_write_holds_the_bytes_and_is_settled_when_it_returns(tmp_path: Path) -> None:
    """``write_spread`` leaves exactly the bytes (at span edges too), its file's identity does not change after it
    returns (the push's version is proven by that identity on every rank), it never writes over a file already
    there, and an empty write leaves an empty file."""
    for size in (PASS_BYTES - 1, PASS_BYTES, 2 * PASS_BYTES + 7):
        data = weights_of(size, size)
        path = tmp_path / f"w{size}"
        with pass_threads(4):
            write_spread(path, data)
        first = FileIdentity.of(os.stat(path))
        assert path.read_bytes() == data
        assert FileIdentity.of(os.stat(path)) == first
        with pytest.raises(FileExistsError):
            write_spread(path, b"other bytes")
        assert path.read_bytes() == data
    write_spread(tmp_path / "empty", b"")
    assert (tmp_path / "empty").read_bytes() == b""


def test_a_payload_copied_in_groups_is_safetensors_own_bytes() -> None:
    """CPU tensors of one dtype, more than one thread's span of them, copied in groups on 3 threads: the bytes
    ``safetensors.torch.save`` writes (so a version does not depend on how the client copied its tensors)."""
    g = torch.Generator().manual_seed(1)
    tensors = {f"layers.{i}.lora_{ab}.weight": torch.randn(shape, generator=g).to(torch.bfloat16)
               for i in range(12) for ab, shape in (("A", (8, 4096)), ("B", (300_000, 8)))}
    tensors["big.lora_B.weight"] = torch.randn(PASS_BYTES // 2 + 3, generator=g).to(torch.bfloat16)
    assert sum(t.numel() * 2 for t in tensors.values()) > 4 * PASS_BYTES
    with pass_threads(3):
        assert bytes(safetensors_bytes(tensors)) == save(tensors)


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_a_hashing_pass_gives_every_thread_whole_blocks_up_to_the_limit(threads: int) -> None:
    """``task_bytes``: whole blocks, at most the limit; below it, the blocks dealt out in one round (at most one task
    a thread, each as long as the longest a thread would have with one block a task: the same makespan)."""
    from lora_cache.adapters.passes import task_bytes

    with pass_threads(threads):
        for nbytes in (0, 1, BLOCK_BYTES, 11 * BLOCK_BYTES + 5, 84 << 20, 1 << 31):
            task = task_bytes(nbytes, PASS_BYTES)
            assert task % BLOCK_BYTES == 0 and BLOCK_BYTES <= task <= PASS_BYTES
            blocks = -(-nbytes // BLOCK_BYTES)
            if task < PASS_BYTES:
                assert -(-nbytes // task) <= threads
                assert task // BLOCK_BYTES == max(1, -(-blocks // threads))
            if nbytes >= threads * PASS_BYTES:
                assert task == PASS_BYTES


def test_the_pass_threads_are_the_operators_or_one_per_usable_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(passes.THREADS_ENV, raising=False)
    usable = len(os.sched_getaffinity(0))
    assert passes.pass_threads() == min(passes.PASS_THREADS, usable)
    monkeypatch.setenv(passes.THREADS_ENV, "4")
    assert passes.pass_threads() == 4  # an operator leaving the node's other cores to its engines
    monkeypatch.setenv(passes.THREADS_ENV, "40")
    assert passes.pass_threads() == 40  # past PASS_THREADS if asked
    for bad in ("0", "-2", "four", "2.5", "1000"):
        monkeypatch.setenv(passes.THREADS_ENV, bad)
        with pytest.raises(ConfigError, match=f"LORA_CACHE_PUSH_THREADS={bad!r}.*whole number from 1 to 256"):
            passes.pass_threads()


def _own_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.parametrize("setting, nicer", [("", passes.PASS_NICE), ("0", 0), ("3", 3), ("19", 19)])
def test_the_pass_threads_run_nicer_than_the_process_that_pushes(monkeypatch: pytest.MonkeyPatch, setting: str,
                                                                 nicer: int) -> None:
    """A push's passes yield the cores to the engines beside them: each pool thread's niceness is the pushing
    thread's plus ``pass_nice()`` (at most 19), the pushing thread's own is unchanged, and a pass still runs."""
    monkeypatch.setenv(passes.NICE_ENV, setting)
    own = _own_niceness()
    saved = list(passes._POOL)
    passes._POOL[:] = []
    pool = None
    try:
        pool = passes.passes()  # this setting's own pool; the saved one is put back below
        seen = set(pool.map(lambda _: (_own_niceness(), threading.get_native_id()), range(64)))
        assert {n for n, _ in seen} == {min(19, own + nicer)}
        assert all(tid != threading.get_native_id() for _, tid in seen)
        assert _own_niceness() == own
        assert digest(b"{}", weights_of(PASS_BYTES + 1, 0)).version  # the pass itself is unchanged
    finally:
        passes._POOL[:] = saved
        if pool is not None:
            pool.shutdown()


def test_a_pass_niceness_that_is_not_one_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("-1", "20", "ten", "2.5"):
        monkeypatch.setenv(passes.NICE_ENV, bad)
        with pytest.raises(ConfigError, match=f"LORA_CACHE_PUSH_NICE={bad!r}.*whole number from 0.*to 19"):
            passes.pass_nice()
