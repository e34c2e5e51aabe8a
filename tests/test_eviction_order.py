"""The host tiers' eviction order (``workers.staging.eviction``), the plain core the real tier and the simulator's
share: the victim is always idle, read-once before protected, oldest first; the ghost history stays within the
tier's bytes and gives protection back once; under ``popular``, the least asked-for adapter first, one touched lately
after every other, and LRU's order until a ranking comes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lora_cache.vocab import AdapterKey
from workers.staging.eviction import EvictionOrder, victim


@dataclass
class Entry:
    nbytes: int
    protected: bool = False
    refs: int = 0
    touched: float = 0.0


def k(i: int) -> AdapterKey:
    return AdapterKey(f"a{i}", "v1")


def test_the_victim_is_the_oldest_idle_read_once_entry_else_the_oldest_idle_protected_one() -> None:
    entries = {k(0): Entry(1, protected=True), k(1): Entry(1, refs=1), k(2): Entry(1), k(3): Entry(1)}
    idle = lambda e: e.refs == 0  # noqa: E731
    assert victim(entries.items(), idle) == k(2)
    entries[k(2)].protected = entries[k(3)].protected = True
    assert victim(entries.items(), idle) == k(0)
    for e in entries.values():
        e.refs = 1
    assert victim(entries.items(), idle) is None


def test_a_key_let_go_of_comes_back_protected_once_and_the_history_is_bounded_by_bytes() -> None:
    order = EvictionOrder(capacity=10)  # segmented: the strategy these rules are for
    assert not order.admitted(k(0), speculative=False) and order.admitted(k(1), speculative=True)
    for i in range(4):
        order.evicted(k(i), 4)  # 16 bytes let go of: only the newest two fit in 10
    assert order.ghosts() == [k(2), k(3)]
    assert order.admitted(k(3), speculative=False) and order.returned == 1
    assert not order.admitted(k(3), speculative=False)  # once: a second read of it is read-once again
    assert not order.admitted(k(0), speculative=False)  # fell out of the history
    order.evicted(k(2), 6)  # again: its bytes are its latest
    order.check_integrity()
    order.forget("a2")
    assert order.ghosts() == [] and order.returned == 1
    with pytest.raises(ValueError, match="capacity is -1"):
        EvictionOrder(-1)
    with pytest.raises(ValueError, match="eviction 'mru' is not one of lru, popular, segmented"):
        EvictionOrder(10, "mru")


def test_lru_protects_nothing_and_remembers_nothing() -> None:
    order = EvictionOrder(capacity=10, kind="lru")
    assert not order.admitted(k(0), speculative=True) and not order.segmented
    order.evicted(k(0), 4)
    assert order.ghosts() == [] and not order.admitted(k(0), speculative=False) and order.returned == 0


def test_the_simulators_tier_lets_go_in_the_real_tiers_order() -> None:
    """``bench.sim.host_tier`` with ``segmented``: the sequence of tests/test_host_tier.py's scan-resistance test,
    in bytes (eight shards fill the tier), leaves the same shards."""
    from bench.sim.calibration import load_calibration
    from bench.sim.events import Loop
    from bench.sim.host_tier import SimHostTier

    loop = Loop()
    tier = SimHostTier(loop, load_calibration("h200-llama8b"), 8 << 20, read_threads=1, eviction="segmented")

    def staged(i: int, speculative: bool = False) -> None:
        entry, _ = tier.fetch(k(i), 1 << 20, speculative=speculative)
        loop.run(lambda: entry.staged.done)
        tier.release(k(i))

    staged(0)
    staged(1, speculative=True)
    for i in range(2, 8):
        staged(i)
    staged(0)  # used again
    for i in (8, 9):
        staged(i)
    assert [key.name for key in tier.entries] == ["a1", "a4", "a5", "a6", "a7", "a0", "a8", "a9"]
    assert tier.order.ghosts() == [k(2), k(3)]
    staged(2)  # came back protected
    assert tier.entries[k(2)].protected and tier.order.returned == 1
    tier.check_integrity()


@given(st.lists(st.tuples(st.sampled_from(["fetch", "warm", "evict", "ref", "unref", "forget"]),
                          st.integers(0, 7), st.integers(1, 5)), max_size=60))
def test_the_order_holds_its_rules_under_any_sequence(ops: list[tuple[str, int, int]]) -> None:
    order = EvictionOrder(capacity=12)
    entries: dict[AdapterKey, Entry] = {}
    for op, i, n in ops:
        key = k(i)
        if op in ("fetch", "warm"):
            if key in entries:
                entries[key].protected = True  # used again
                entries[key] = entries.pop(key)  # most recent last
            else:
                was_ghost = key in order.ghosts()
                entries[key] = Entry(n, protected=order.admitted(key, op == "warm"))
                assert entries[key].protected == (op == "warm" or was_ghost)
        elif op == "evict":
            gone = victim(entries.items(), lambda e: e.refs == 0)
            idle = [x for x, e in entries.items() if e.refs == 0]
            if gone is None:
                assert not idle
                continue
            read_once = [x for x in idle if not entries[x].protected]
            assert gone == (read_once[0] if read_once else idle[0])
            order.evicted(gone, entries.pop(gone).nbytes)
            assert order.ghosts()[-1] == gone  # remembered newest last
        elif op == "ref" and key in entries:
            entries[key].refs += 1
        elif op == "unref" and key in entries and entries[key].refs:
            entries[key].refs -= 1
        elif op == "forget":
            order.forget(key.name)
            assert key not in order.ghosts()
        order.check_integrity()
        assert not set(order.ghosts()) & set(entries)  # a key is staged or remembered, never both


def test_popular_lets_go_of_the_least_asked_for_first_and_of_one_touched_lately_last() -> None:
    order = EvictionOrder(capacity=100, kind="popular", recent_s=10.0)
    entries = {k(i): Entry(1, touched=float(i)) for i in range(5)}  # oldest first
    idle = lambda e: e.refs == 0  # noqa: E731
    assert order.victim(entries.items(), idle, now=100.0) == k(0)  # no ranking yet: the oldest, as LRU
    order.ranked(["a3", "a0", "a4", "a1"])  # a2 not ranked: below every ranked one
    assert order.victim(entries.items(), idle, now=100.0) == k(2)
    entries[k(2)].refs = 1  # busy: never
    assert order.victim(entries.items(), idle, now=100.0) == k(1)  # the lowest ranked
    assert order.victim(entries.items(), idle, now=10.5) == k(0)  # a0 alone was touched over 10 s ago
    assert order.victim(entries.items(), idle, now=0.5) == k(1)  # all touched lately: by rank again
    order.ranked(["a3", "a3", "a1"])  # a repeated name keeps its first place
    assert order.ranking() == ["a3", "a1"] and order.rankings == 2
    for e in entries.values():
        e.refs = 1
    assert order.victim(entries.items(), idle, now=100.0) is None
    order.check_integrity()
    with pytest.raises(ValueError, match="recent_s is -1"):
        EvictionOrder(10, "popular", recent_s=-1)


@pytest.mark.parametrize("kind", ["lru", "segmented"])
def test_other_orders_ignore_a_ranking(kind: str) -> None:
    order = EvictionOrder(capacity=10, kind=kind)
    order.ranked(["a1", "a0"])
    entries = {k(0): Entry(1), k(1): Entry(1)}
    assert order.ranking() == [] and order.victim(entries.items(), lambda e: True, now=0.0) == k(0)
    order.check_integrity()


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2), st.floats(0, 30)), min_size=1, max_size=12),
       st.one_of(st.none(), st.permutations([f"a{i}" for i in range(12)]).map(lambda p: p[:8])),
       st.floats(0, 20), st.floats(0, 40))
def test_the_popular_victim_is_idle_the_lowest_ranked_of_its_class_and_lru_without_a_ranking(
        rows: list[tuple[int, int, float]], ranking: list[str] | None, recent_s: float, now: float) -> None:
    """Over any tier: the victim is idle; no idle entry outside the recent window is left for one inside it; none
    left is ranked lower, or equal and older; with no ranking (and no window) it is LRU's victim."""
    entries = {k(i): Entry(1, refs=refs, touched=t) for i, refs, t in rows}
    order = EvictionOrder(capacity=100, kind="popular", recent_s=recent_s)
    if ranking is not None:
        order.ranked(ranking)
    idle = lambda e: e.refs == 0  # noqa: E731
    gone = order.victim(entries.items(), idle, now)
    keys = [x for x, e in entries.items() if idle(e)]
    if not keys:
        assert gone is None
        return
    assert gone in keys
    place = {name: i for i, name in enumerate(order.ranking())}

    def score(x: AdapterKey) -> tuple[bool, int]:
        return (recent_s > 0 and entries[x].touched > now - recent_s, -place.get(x.name, len(place)))

    assert all(score(gone) < score(x) or (score(gone) == score(x) and keys.index(gone) <= keys.index(x))
               for x in keys)
    if ranking is None and recent_s == 0:
        assert gone == victim(entries.items(), idle)


def test_the_simulators_tier_lets_go_in_the_real_tiers_popular_order() -> None:
    """``bench.sim.host_tier`` with ``popular`` and no window: tests/test_host_tier.py's ranking test's sequence
    leaves the same shards."""
    from bench.sim.calibration import load_calibration
    from bench.sim.events import Loop
    from bench.sim.host_tier import SimHostTier

    loop = Loop()
    tier = SimHostTier(loop, load_calibration("h200-llama8b"), 8 << 20, read_threads=1, eviction="popular",
                       recent_s=0.0)

    def staged(i: int, release: bool = True) -> None:
        entry, _ = tier.fetch(k(i), 1 << 20)
        loop.run(lambda: entry.staged.done)
        if release:
            tier.release(k(i))

    def names(*ix: int) -> list[str]:
        return [f"a{i}" for i in ix]

    for i in range(9):
        staged(i)
    assert [key.name for key in tier.entries] == names(*range(1, 9))
    tier.order.ranked(names(3, 1, 8, 6, 2))
    for i in (9, 0):
        staged(i)
    assert [key.name for key in tier.entries] == names(1, 2, 3, 6, 7, 8, 9, 0)
    staged(9, release=False)
    tier.order.ranked(names(3, 1, 6, 8, 0, 2))
    staged(4)
    staged(5)
    assert [key.name for key in tier.entries] == names(1, 2, 3, 6, 8, 0, 9, 5)
    tier.order.ranked(names(3, 1, 6, 8, 0, 5, 2))
    staged(4)
    assert [key.name for key in tier.entries] == names(1, 3, 6, 8, 0, 9, 5, 4)
    tier.release(k(9))
    tier.check_integrity()
