"""GPU slot bookkeeping, plain Python: per-slot state, reference counts, LRU of idle ready slots, and the pool's
pages each slot holds.

A slot is FREE, LOADING (reserved, copy not yet complete) or READY. Eviction takes only READY slots
with no references (invariants 2 and 3); LOADING slots are never handed to another adapter.

Issue 43: a slot is a row of the kernels' metadata, not a fixed share of the pool. The pool is ``num_pages``
pages, and a slot holds a run of contiguous pages, as many as its shard needs (a rank-16 adapter a quarter of a
rank-64 one's): one H2D copy per chunk still lands in one range, and the kernels read the shard at the slot's
offsets, unchanged. A load that needs ``k`` pages takes the run of ``k`` free or idle pages whose newest evicted
adapter was least recently used (ties: fewer evicted, fewer pages evicted; then single pages from the pool's start
and runs from its end, so that free pages stay together between them: without it the planner's bytes fitted where
no run was free, and the simulator's `global` made 8x the loads). With one page per slot (pages sized for the
largest rank, the default) this is the plain LRU of slots it was before. Why runs and not S-LoRA's
scattered pages: docs/decisions.md, "GPU memory in runs of contiguous pages".

A pool that breathes (issue 43 item 3): ``lend`` gives whole pages back to the engine (free pages first, then those
of idle adapters, least recently used first, the adapters the caller would keep last); a lent page is neither free
nor held, no load is placed over it, and ``reclaim`` returns it. Pages held by loading or in-use adapters are never
lent: asking for more than the free and idle pages is refused before anything changes.

A fence (``fence``/``unfence``): what an engine reports READY stays resident until its step holds it. Between the
report that offers a version for admission and the step's acquire, the controller's evictions and other loads'
room could take an idle READY slot; an older version past ``keep_versions`` then retires and the admitted request
fails on that rank. A fenced slot is neither idle nor referenced: no eviction, reservation or lending takes it, and
it returns to the LRU list in its place (its use, if any, counted) when the fence lifts.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Container, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from lora_cache.errors import ConfigError, SlotsBusyError
from lora_cache.vocab import AdapterKey


class SlotPhase(Enum):
    """Where one GPU slot is in its load (the planner's ``SlotState`` is a rank's view of an adapter, IN_USE too)."""

    FREE = "free"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    index: int
    state: SlotPhase = SlotPhase.FREE
    key: AdapterKey | None = None
    refs: int = 0
    first_page: int = 0  # the run of pages it holds: first_page .. first_page + pages - 1 (none while FREE)
    pages: int = 0

    @property
    def page_range(self) -> range:
        return range(self.first_page, self.first_page + self.pages)


FREE_PAGE, LENT_PAGE = -1, -2  # ``SlotTable.owner`` of a page no slot holds: free, or lent to the engine


class Evicted(NamedTuple):
    """An adapter a reservation evicted: the slot it left and its key."""

    slot: int
    key: AdapterKey


class SlotTable:
    """Which adapter each slot holds, and which pages. Not thread-safe: the worker cache's lock guards it."""

    def __init__(self, num_slots: int, num_pages: int | None = None) -> None:
        self.slots = [Slot(i) for i in range(num_slots)]
        self.num_pages = num_slots if num_pages is None else num_pages
        assert self.num_pages >= 1, f"a pool of {self.num_pages} pages"
        self.owner: list[int] = [FREE_PAGE] * self.num_pages  # the slot holding each page, or FREE / LENT_PAGE
        self._by_key: dict[AdapterKey, int] = {}
        self._free: deque[int] = deque(range(num_slots))
        self._idle: OrderedDict[int, None] = OrderedDict()  # READY and unreferenced, LRU first
        self._fenced: dict[int, bool] = {}  # READY slots kept until ``unfence`` -> whether idle (and unused) since

    def lookup(self, key: AdapterKey) -> Slot | None:
        index = self._by_key.get(key)
        return None if index is None else self.slots[index]

    def reserve(self, key: AdapterKey, pages: int = 1) -> tuple[int, tuple[Evicted, ...]]:
        """A slot holding a run of ``pages`` pages for ``key``, in LOADING state, and the adapters evicted to make
        room (oldest first; none if free pages and a free slot sufficed)."""
        assert key not in self._by_key, f"{key} already has slot {self._by_key[key]}"
        if not 1 <= pages <= self.num_pages:
            raise SlotsBusyError(f"no GPU room for {key}: its shard needs {pages} pages and the pool has "
                                 f"{self.num_pages}; configure more pages (pool_pages) or larger ones (page_rank)")
        first, victims = self._window(pages)
        if first < 0:
            lent = f", {self.lent_pages()} lent to the engine" if self.lent_pages() else ""
            raise SlotsBusyError(f"no GPU slot for {key}: all {len(self.slots)} slots are loading or in use (no run "
                                 f"of {pages} of the {self.num_pages} pages{lent} is free or idle); release finished "
                                 "batches or configure more slots")
        evicted = tuple(Evicted(v, self._evict_idle(v)) for v in victims)
        index = victims[0] if victims else self._free.popleft()
        if victims:
            self._free.remove(index)
        slot = self.slots[index]
        slot.state, slot.key, slot.first_page, slot.pages = SlotPhase.LOADING, key, first, pages
        for p in slot.page_range:
            self.owner[p] = index
        self._by_key[key] = index
        return index, evicted

    def _window(self, pages: int) -> tuple[int, list[int]]:
        """The first page of the run to take, and the idle slots to evict for it, LRU first; (-1, []) if none. A
        one-page shard with a free slot and a free page takes the first free page at once: the search's choice (its
        score (-1, 0, 0, p) beats every other), without its ~0.1 ms of Python over a 64-slot pool (issue 44 item 5)."""
        if pages == 1 and self._free and FREE_PAGE in self.owner:
            return self.owner.index(FREE_PAGE), []
        return self._search(pages)

    def _search(self, pages: int) -> tuple[int, list[int]]:
        """``_window``'s search over every run of ``pages`` pages, scored."""
        rank = {index: i for i, index in enumerate(self._idle)}  # LRU position of each idle slot
        best: tuple[int, int, int, int] | None = None
        best_victims: list[int] = []
        p = 0
        while p + pages <= self.num_pages:
            victims: list[int] = []
            for q in range(p, p + pages):
                owner = self.owner[q]
                if owner == LENT_PAGE or (owner >= 0 and owner not in rank):  # lent, loading or in use: no run
                    p = q + 1
                    break
                if owner >= 0 and (not victims or victims[-1] != owner):
                    victims.append(owner)
            else:
                if not victims and not self._free:  # free pages but every slot taken: one slot must go too
                    victims = list(itertools.islice(self._idle, 1))
                    if not victims:
                        p += 1
                        continue
                victims.sort(key=rank.__getitem__)
                # single pages from the pool's start, runs from its end: free pages stay together between them
                score = (rank[victims[-1]] if victims else -1, len(victims),
                         sum(self.slots[v].pages for v in victims), p if pages == 1 else -p)
                if best is None or score < best:
                    best, best_victims = score, victims
                p += 1
        return (-1, []) if best is None else (abs(best[3]), best_victims)

    def _evict_idle(self, index: int) -> AdapterKey:
        del self._idle[index]
        key = self._drop(index)
        assert key is not None
        self._free.append(index)
        return key

    def lend(self, count: int, keep: Container[AdapterKey] = ()) -> tuple[tuple[int, ...], tuple[Evicted, ...]]:
        """``count`` pages lent to the engine (issue 43 item 3), and the adapters evicted for them, oldest first.

        Free pages go first, those in the shortest free stretches first (long ones stay for runs); then idle adapters
        are evicted, least recently used first, those in ``keep`` (needed soon) last. A page held by a loading or
        in-use adapter is never lent: asking for more pages than are free or idle raises ``SlotsBusyError`` and
        changes nothing."""
        if count < 1:
            raise ConfigError(f"lend {count} pages: give back at least one page")
        idle_pages = sum(self.slots[i].pages for i in self._idle)
        free = self.free_pages()
        if count > free + idle_pages:
            busy = self.num_pages - free - idle_pages - self.lent_pages()
            raise SlotsBusyError(f"cannot give back {count} GPU pages: {free} are free and {idle_pages} held by idle "
                                 f"adapters; {busy} are held by loading or in-use adapters and "
                                 f"{self.lent_pages()} are lent already; ask for at most {free + idle_pages} pages "
                                 "now, or again once batches release their adapters")
        order = sorted(self._idle, key=lambda i: self.slots[i].key in keep)  # stable: LRU within each group
        evicted: list[Evicted] = []
        for index in order:
            if free >= count:
                break
            free += self.slots[index].pages
            evicted.append(Evicted(index, self._evict_idle(index)))
        pages = self._fragments(count)
        for p in pages:
            self.owner[p] = LENT_PAGE
        return pages, tuple(evicted)

    def _fragments(self, count: int) -> tuple[int, ...]:
        """``count`` free pages, from the shortest stretches of free pages first, each from its end."""
        stretches: list[range] = []
        p = 0
        while p < self.num_pages:
            if self.owner[p] != FREE_PAGE:
                p += 1
                continue
            start = p
            while p < self.num_pages and self.owner[p] == FREE_PAGE:
                p += 1
            stretches.append(range(start, p))
        pages: list[int] = []
        for stretch in sorted(stretches, key=len):
            pages += reversed(stretch[-(count - len(pages)):])
            if len(pages) == count:
                break
        return tuple(sorted(pages))

    def reclaim(self, pages: Iterable[int]) -> None:
        """Lent pages back in the pool, free; a page not lent is refused, naming it, and nothing changes."""
        pages = list(pages)
        wrong = [p for p in pages if not 0 <= p < self.num_pages or self.owner[p] != LENT_PAGE]
        if wrong or len(set(pages)) != len(pages):
            raise ConfigError(f"cannot take back pages {wrong or pages}: only pages lent (SlotTable.lend) and each "
                              f"once; {self.lent_pages()} of {self.num_pages} are lent now")
        for p in pages:
            self.owner[p] = FREE_PAGE

    def lent_pages(self) -> int:
        return self.owner.count(LENT_PAGE)

    def mark_ready(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.state is SlotPhase.LOADING, f"slot {index} is {slot.state.value}, not loading"
        slot.state = SlotPhase.READY
        if slot.refs == 0:
            self._idle[index] = None

    def fail(self, index: int) -> None:
        """A load that never reached the GPU: the slot (and its pages) become free again."""
        slot = self.slots[index]
        assert slot.state is SlotPhase.LOADING and slot.refs == 0, f"cannot fail slot {index}: {slot}"
        self._drop(index)
        self._free.append(index)

    def incref(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.state is not SlotPhase.FREE, f"slot {index} is free"
        slot.refs += 1
        self._idle.pop(index, None)
        if index in self._fenced:
            self._fenced[index] = False  # used: the most recently used once the fence lifts

    def decref(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.refs > 0, f"slot {index} released more often than acquired"
        slot.refs -= 1
        if slot.refs == 0 and slot.state is SlotPhase.READY and index not in self._fenced:
            self._idle[index] = None

    def fence(self) -> None:
        """Keep every READY slot, idle or held, from eviction, reservation and lending until ``unfence`` (the
        module's docstring): the idle ones leave the LRU list, their order kept."""
        self.unfence()
        self._fenced = {i: True for i in self._idle}
        self._fenced.update((s.index, False) for s in self.slots if s.state is SlotPhase.READY
                            and s.index not in self._fenced)
        self._idle.clear()

    def unfence(self) -> bool:
        """Lift the fence: the fenced slots idle now go back to the LRU list, those idle all along in their old
        places (the least recently used first), those used meanwhile as the most recent. True if any went back."""
        if not self._fenced:
            return False
        fenced, self._fenced = self._fenced, {}
        back = [i for i in fenced if self.slots[i].state is SlotPhase.READY and self.slots[i].refs == 0]
        for i in reversed([i for i in back if fenced[i]]):
            self._idle[i] = None
            self._idle.move_to_end(i, last=False)
        for i in back:
            if not fenced[i]:
                self._idle[i] = None
        return bool(back)

    @property
    def fenced(self) -> bool:
        """Whether a fence keeps some slot now (a load that found no room may wait for it to lift)."""
        return bool(self._fenced)

    def evict(self, key: AdapterKey) -> bool:
        """Free ``key``'s slot if it is READY and unreferenced; False if it is absent or busy."""
        index = self._by_key.get(key)
        if index is None or index not in self._idle:
            return False
        self._evict_idle(index)
        return True

    def _drop(self, index: int) -> AdapterKey | None:
        slot = self.slots[index]
        key, slot.key, slot.state = slot.key, None, SlotPhase.FREE
        for p in slot.page_range:
            self.owner[p] = FREE_PAGE
        slot.first_page = slot.pages = 0
        if key is not None:
            del self._by_key[key]
        return key

    def count(self, state: SlotPhase) -> int:
        return sum(s.state is state for s in self.slots)

    def free_pages(self) -> int:
        return self.owner.count(FREE_PAGE)

    def check_integrity(self) -> None:
        for s in self.slots:
            assert s.refs >= 0, f"slot {s.index} has negative refs"
            assert (s.state is SlotPhase.FREE) == (s.key is None), f"slot {s.index}: state/key mismatch {s}"
            assert s.state is not SlotPhase.FREE or s.refs == 0, f"free slot {s.index} has references"
            assert (s.state is SlotPhase.FREE) == (s.pages == 0), f"slot {s.index}: pages and state disagree {s}"
            assert (s.index in self._idle) == (s.state is SlotPhase.READY and s.refs == 0
                                               and s.index not in self._fenced), f"idle list wrong: {s}"
            assert s.index not in self._fenced or s.state is SlotPhase.READY, f"a fence on a slot not READY: {s}"
            assert (s.index in self._free) == (s.state is SlotPhase.FREE), f"free list wrong: {s}"
            assert all(self.owner[p] == s.index for p in s.page_range), f"slot {s.index} does not own its pages"
            if s.key is not None:
                assert self._by_key[s.key] == s.index, f"index of {s.key} is wrong"
        # no page shared by two live slots: each owned page is in its owner's run, and only there
        held = self.num_pages - self.free_pages() - self.lent_pages()
        assert sum(s.pages for s in self.slots) == held, "a page has two owners"
        assert all(o < 0 or p in self.slots[o].page_range for p, o in enumerate(self.owner)), "stale page owner"
        assert len(self._by_key) == sum(s.key is not None for s in self.slots), "key index has stale entries"
        assert len(set(self._free)) == len(self._free), "free list has duplicates"
