"""The slot table: FREE / LOADING / READY, references, LRU of idle slots, capacity (its state machine, pages
and all: tests/test_pages.py)."""

from __future__ import annotations

import pytest

from lora_cache.errors import CapacityError
from lora_cache.vocab import AdapterKey
from workers.gpu.slots import SlotPhase, SlotTable


def k(name: str) -> AdapterKey:
    return AdapterKey(name, "v1")


def ready(table: SlotTable, name: str) -> int:
    index, _ = table.reserve(k(name))
    table.mark_ready(index)
    return index


def test_free_loading_ready() -> None:
    table = SlotTable(2)
    assert table.count(SlotPhase.FREE) == 2 and table.lookup(k("a")) is None
    index, evicted = table.reserve(k("a"))
    assert (index, evicted) == (0, ())
    slot = table.lookup(k("a"))
    assert (
        slot is table.slots[0] and slot.state is SlotPhase.LOADING and slot.key == k("a") and slot.refs == 0
    )
    assert not table.evict(k("a"))  # a loading slot is never evicted
    table.mark_ready(0)
    assert (
        slot.state is SlotPhase.READY
        and table.count(SlotPhase.READY) == 1
        and table.count(SlotPhase.FREE) == 1
    )
    table.check_integrity()
    assert table.evict(k("a"))
    assert slot.state is SlotPhase.FREE and slot.key is None and table.lookup(k("a")) is None
    table.check_integrity()


def test_fail_frees_the_slot() -> None:
    table = SlotTable(1)
    index, _ = table.reserve(k("a"))
    table.fail(index)
    assert table.slots[0].state is SlotPhase.FREE and table.lookup(k("a")) is None
    table.check_integrity()
    assert table.reserve(k("b")) == (0, ())  # the failed slot is usable again
    table.incref(0)
    with pytest.raises(AssertionError, match="cannot fail slot 0"):
        table.fail(0)  # a load with waiters holding references is not failed under them
    table.decref(0)
    table.mark_ready(0)
    with pytest.raises(AssertionError, match="cannot fail slot 0"):
        table.fail(0)


def test_references() -> None:
    table = SlotTable(2)
    index, _ = table.reserve(k("a"))
    table.incref(index)  # acquire of a loading adapter: the batch waits for the copy on the GPU
    table.mark_ready(index)
    assert index not in table._idle  # ready but referenced: not idle
    table.incref(index)
    assert table.slots[index].refs == 2 and not table.evict(k("a"))
    table.decref(index)
    assert not table.evict(k("a"))
    table.decref(index)
    assert table.slots[index].refs == 0 and index in table._idle
    with pytest.raises(AssertionError, match="released more often than acquired"):
        table.decref(index)
    assert table.slots[index].refs == 0
    with pytest.raises(AssertionError, match="slot 1 is free"):
        table.incref(1)
    table.check_integrity()


def test_evict_absent_is_false() -> None:
    table = SlotTable(1)
    assert not table.evict(k("nope"))
    ready(table, "a")
    assert not table.evict(AdapterKey("a", "v2"))  # another version of the same adapter is absent


def test_lru_order_of_idle_slots() -> None:
    table = SlotTable(3)
    a, b, c = ready(table, "a"), ready(table, "b"), ready(table, "c")
    table.incref(a)
    table.decref(a)  # using a makes it the most recent
    index, evicted = table.reserve(k("d"))
    assert (index, evicted) == (b, ((b, k("b")),))
    table.mark_ready(index)
    assert table.reserve(k("e")) == (c, ((c, k("c")),))
    table.mark_ready(c)
    assert table.reserve(k("f")) == (a, ((a, k("a")),))
    table.check_integrity()


def test_free_slots_before_eviction() -> None:
    table = SlotTable(3)
    a = ready(table, "a")
    b = ready(table, "b")
    assert table.evict(k("a"))
    c, evicted_c = table.reserve(k("c"))
    d, evicted_d = table.reserve(k("d"))
    assert evicted_c == evicted_d == () and {c, d} == {0, 1, 2} - {b}  # the unused slot and a's freed one
    assert a in (c, d)
    assert table.reserve(k("e")) == (b, ((b, k("b")),))  # only now is an idle slot evicted


def test_capacity_error_when_all_busy() -> None:
    table = SlotTable(3)
    table.reserve(k("loading"))
    table.incref(ready(table, "held"))
    ready(table, "idle")
    assert [e.key for e in table.reserve(k("x"))[1]] == [k("idle")]  # the one idle slot goes
    with pytest.raises(CapacityError) as e:
        table.reserve(k("y"))
    msg = str(e.value)
    assert str(k("y")) in msg and "all 3 slots are loading or in use" in msg and "configure more slots" in msg
    assert table.lookup(k("y")) is None and table.lookup(k("held")) is not None
    table.check_integrity()


def test_a_fence_keeps_every_ready_slot_until_lifted_and_the_lru_order_with_it() -> None:
    """What an engine reports READY stays until its step holds it: under a fence no READY slot, idle or held, is
    evicted, reserved over or lent (a load finds no room); lifted, the slots idle all along return in their LRU
    places, one used meanwhile as the most recent, and one held all along stays held."""
    table = SlotTable(5)
    a, b, c, held = ready(table, "a"), ready(table, "b"), ready(table, "c"), ready(table, "held")
    table.incref(held)
    table.fence()
    assert table.fenced and not table.evict(k("a")) and not table.evict(k("c"))
    table.check_integrity()
    loading, evicted = table.reserve(k("new"))  # the free slot, nothing evicted
    assert evicted == ()
    with pytest.raises(CapacityError):
        table.reserve(k("more"))
    with pytest.raises(CapacityError):
        table.lend(2)
    table.decref(held)  # let go of under the fence: still kept
    table.incref(b)  # used under the fence (a step's acquire) ...
    table.decref(b)
    table.mark_ready(loading)  # ... a load that lands meanwhile was never offered: evictable
    assert table.evict(k("new"))
    table.check_integrity()
    assert table.unfence() and not table.fenced and not table.unfence()
    table.check_integrity()
    assert table.reserve(k("x"))[1] == ()  # the slot "new" left
    order = [table.reserve(k(f"x{i}"))[1][0].slot for i in range(4)]
    assert order == [a, c, b, held]  # a and c in their places; b and held, used under the fence, after them


def test_misuse_asserts() -> None:
    table = SlotTable(2)
    ready(table, "a")
    with pytest.raises(AssertionError, match="already has slot"):
        table.reserve(k("a"))
    with pytest.raises(AssertionError, match="is ready, not loading"):
        table.mark_ready(0)
    with pytest.raises(AssertionError, match="is free, not loading"):
        table.mark_ready(1)

# the state machine of the table (slots and their pages) against a model: tests/test_pages.py


def test_the_first_free_page_taken_at_once_is_the_one_the_full_search_takes() -> None:
    """``SlotTable._window``'s fast path (a one-page shard, a free slot and a free page: the first free page) takes
    what the full search (``_search``) takes, over tables with loading, idle and used slots of one and two pages,
    and pages lent to the engine."""
    import random

    rng = random.Random(7)
    taken = 0
    for _ in range(500):
        table = SlotTable(rng.randint(2, 8), num_pages=rng.randint(8, 16))
        for i in range(rng.randint(0, 10)):
            try:
                index, _ = table.reserve(AdapterKey(f"a{i}", "v"), rng.choice([1, 1, 2]))
            except CapacityError:
                break
            if rng.random() < 0.7:
                table.mark_ready(index)
                if rng.random() < 0.3:
                    table.incref(index)
            elif rng.random() < 0.3:
                table.fail(index)
        if rng.random() < 0.3 and table.free_pages():
            table.lend(1)
        assert table._window(1) == table._search(1), table.owner
        taken += table._window(1)[0] >= 0 and not table._window(1)[1]
    assert taken > 100  # the case of the fast path (a free page, no eviction) came up often
