"""lora_cache.runtime.heap: the live heap leaves full collections while a process serves, and comes back after."""

from __future__ import annotations

import gc
import weakref

from lora_cache.runtime import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_takes_the_live_heap_out_of_full_collections_and_thaw_returns_it() -> None:
    # No automatic collection between the freeze and the count: a thread an earlier test left running (gRPC,
    # Ray) that allocates meanwhile would have its survivors promoted into generation 2 (seen once, 2026-11-26)
    gc.disable()
    try:
        frozen = heap.freeze()
        assert frozen == gc.get_freeze_count() > 1000  # pytest, torch and friends
        assert len(gc.get_objects(generation=2)) < frozen // 100  # a full collection walks none of them
        gc.enable()
        garbage = weakref.ref(Node())  # made after the freeze: still collected
        gc.collect()
        assert garbage() is None
    finally:
        gc.enable()
        heap.thaw()
    assert gc.get_freeze_count() == 0
    assert len(gc.get_objects(generation=2)) >= frozen // 2  # back where a full collection sees them


def test_freeze_collects_first_so_no_garbage_is_kept() -> None:
    kept = weakref.ref(Node())  # garbage already, alive only through its cycle
    try:
        heap.freeze()
        assert kept() is None
    finally:
        heap.thaw()


def test_pauses_time_each_collection_while_started() -> None:
    pauses = heap.Pauses()
    pauses.start()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.stop()
    gc.collect()  # stopped: not counted
    summary = pauses.summary()
    assert pauses.collections[2] == summary["gc_full"] == 1 and summary["gc_collections"] >= 2
    assert 0 < summary["gc_longest_ms"] <= summary["gc_total_ms"]
