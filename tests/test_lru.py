"""``workers.lru.BoundedLRU``: the bound, the eviction order, and threads racing on one key (a barrier, no sleep)."""

from __future__ import annotations

import threading

import pytest

from workers.lru import BoundedLRU


def test_the_oldest_goes_first_and_get_makes_a_hit_the_newest() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(3)
    for i, key in enumerate("abc"):
        lru.put(key, i)
    assert lru.get("a") == 0  # a is the newest now: b goes next
    lru.put("d", 3)
    assert [k for k, _ in lru.items()] == ["c", "a", "d"]
    assert lru.peek("c") == 2  # a peek keeps c the oldest
    lru.put("e", 4)
    assert [k for k, _ in lru.items()] == ["a", "d", "e"] and lru.get("c") is None
    lru.check_integrity()


def test_put_replaces_in_place_unless_refresh() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    lru.put("a", 0)
    lru.put("b", 1)
    lru.put("a", 10, refresh=False)  # as an OrderedDict assignment: a stays the oldest
    lru.put("c", 2)
    assert dict(lru.items()) == {"b": 1, "c": 2}
    lru.put("b", 11)  # refreshed: c is the oldest now
    lru.put("d", 3)
    assert dict(lru.items()) == {"b": 11, "d": 3}
    assert lru.pop("b") == 11 and lru.pop("b") is None and len(lru) == 1
    lru.clear()
    assert len(lru) == 0
    lru.check_integrity()


def test_get_or_create_makes_once_and_the_value_grows_in_place() -> None:
    lru: BoundedLRU[str, set[int]] = BoundedLRU(2)
    lru.get_or_create("a", set).update({1})
    lru.get_or_create("b", set)
    lru.get_or_create("a", set).update({2})  # a is the newest again: b goes when c comes
    lru.get_or_create("c", set)
    assert dict(lru.items()) == {"a": {1, 2}, "c": set()}
    lru.check_integrity()


def test_the_limit_must_hold_one() -> None:
    with pytest.raises(ValueError, match="limit"):
        BoundedLRU(0)


def test_threads_racing_on_one_key_make_it_once_and_the_bound_holds() -> None:
    lru: BoundedLRU[int, list[int]] = BoundedLRU(8)
    threads_n, made = 8, []
    start, asked = threading.Barrier(threads_n, timeout=30), threading.Barrier(threads_n, timeout=30)

    def make() -> list[int]:
        made.append(1)
        return []

    def work(i: int) -> None:
        start.wait()  # every thread asks at once
        lru.get_or_create(-1, make).append(i)
        asked.wait()  # no put evicts the key before every thread has asked for it
        for k in range(200):
            lru.put(i * 1000 + k, [k])
            lru.get(i * 1000 + k)
            lru.peek(-1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert len(made) == 1, "the racing threads made the value more than once"
    assert lru.peek(-1) is None  # evicted by the puts since: the bound held
    assert len(lru) == 8
    lru.check_integrity()
