"""The host arena pinned in the background (issue 30 item 3): the worker starts while it pins, the first copy
waits for the pinning and then succeeds. On the CPU the pinning thread populates the shared mapping's pages
(what stands for pinning there); the fault point ``pin_arena`` holds it. With a GPU, the real cudaHostRegister."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.vocab import AdapterKey
from tests.waiting import wait_for
from workers import faults
from workers.cache import WorkerCache, WorkerConfig
from workers.staging.arena import HostArena
from workers.staging.host_config import HostTierConfig


@pytest.fixture
def held_pinning() -> Iterator[tuple[threading.Event, threading.Event]]:
    """(arrived, release): the next arena's background pinning stops at its start until ``release`` is set."""
    arrived, release = threading.Event(), threading.Event()

    def hold(_: AdapterKey) -> None:
        arrived.set()
        release.wait(120)

    faults.arm("pin_arena", "arena", hold)
    try:
        yield arrived, release
    finally:
        release.set()
        faults._armed.pop(("pin_arena", "arena"), None)


def test_a_load_before_the_pinning_ends_waits_for_it_then_succeeds(
    tiny_adapters: Callable[..., list[Path]],
    make_catalog: Callable[..., AdapterCatalog],
    file_slices: Callable,
    held_pinning: tuple[threading.Event, threading.Event],
) -> None:
    arrived, release = held_pinning
    paths = tiny_adapters(count=1, rank="16")
    catalog = make_catalog(paths[0].parent)
    name = catalog.names()[0]
    host = HostTierConfig(host_bytes=1 << 20, read_threads=1, pin=False, reads="process")
    cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", host=host), catalog)  # returns while it pins
    try:
        assert arrived.wait(30), "the arena's pinning never started"
        arena = cache.host.arena
        assert arena.pin_pending
        load = cache.prefetch(name)
        key = AdapterKey(name, catalog.get(name).version)
        wait_for(lambda: cache.host.contains(key), "the read into the arena (not held by the pinning)")
        wait_for(lambda: arena.pin_waiters == 1, "the load's copy waiting for the pinning")
        assert not load.done(), "a copy ran from the arena before its pinning ended"
        assert cache.residency() == [] or all(r["state"] != "ready" for r in cache.residency())
        release.set()
        record = load.result(timeout=60)
        assert not arena.pin_pending and arena.pin_error == "" and arena.pin_waiters == 0
        spec, layout = catalog.get(name), cache.layout_of(name)
        slot = cache.shard(record.slot)
        for (layer, module, ab), want in file_slices(spec, layout).items():
            e = layout.entry(layer, module, ab)
            assert torch.equal(slot[e.offset : e.offset + e.numel].view(e.shape), want)
        assert cache.prefetch(name).result(timeout=10).slot == record.slot  # READY: no second load
        cache.check_integrity()
    finally:
        release.set()
        cache.close()


def test_when_pinned_runs_at_once_after_the_pinning_and_for_an_arena_pinned_in_place() -> None:
    ran: list[str] = []
    arena = HostArena(1 << 20, pin=False, shared=True, background=True)
    try:
        assert arena.wait_pinned(30)
        arena.when_pinned(lambda: ran.append("after"))
        assert ran == ["after"] and arena.pin_s >= 0 and arena.pin_error == ""
    finally:
        arena.close()
    plain = HostArena(1 << 20, pin=False, shared=True)
    try:
        plain.when_pinned(lambda: ran.append("in place"))
        assert ran == ["after", "in place"] and not plain.pin_pending
    finally:
        plain.close()


def test_closing_an_arena_waits_for_its_pinning(held_pinning: tuple[threading.Event, threading.Event]) -> None:
    arrived, release = held_pinning
    arena = HostArena(1 << 20, pin=False, shared=True, background=True)
    assert arrived.wait(30)
    ran: list[int] = []
    arena.when_pinned(lambda: ran.append(1))
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (arena.close(), closed.set()))
    closer.start()
    assert not closed.wait(0.2), "the arena closed under a pinning still under way"
    release.set()
    closer.join(30)
    assert closed.is_set() and ran == [1]


@pytest.mark.gpu
def test_a_gpu_arena_pinned_in_the_background_is_pinned_and_copies_from_it_are_right() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    arena = HostArena(64 << 20, pin=True, shared=True, background=True)
    try:
        assert arena.wait_pinned(120) and arena.pin_error == ""
        assert arena.buffer.is_pinned()
        arena.buffer[: 1 << 20].copy_(torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)[: 1 << 20])
        gpu = arena.buffer[: 1 << 20].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(gpu.cpu(), arena.buffer[: 1 << 20])
    finally:
        arena.close()
