"""KV rows borrowed from the adapter pool as the batch grows (issue 43 item 3: the pool that breathes, its engine).

The engine keeps ``kv_rows`` KV rows of its own (its ``KVCache``; one more is the decode graphs' padding row). Up to
``max_running`` requests may run: the rows past its own are borrowed from the rank's adapter pool, whole pages lent
by ``PoolLender.give_back``, and given back when the batch shrinks. The rule (rank 0 decides, every rank follows):

- **Grow** when a request could start now but for a KV row: its adapter admissible, the step's prompt tokens and
  distinct adapters within bounds, every own row and every borrowed row in use. The round's plan asks every rank to
  hold one more borrowed row per such request (``StepPlan.kv_rows``), up to ``max_running - kv_rows``.
- **Lend only what is idle, and never the batch's room.** Each rank borrows through ``give_back``: free pages first,
  then idle adapters least recently used first, the adapters its plan wants (running and admissible requests') last;
  never a page a loading or in-use adapter holds, and never below the pages a batch's ``max_adapters`` adapters of
  the max rank take (the bound the engine's pool is checked against at start, so no request fails for room). A rank
  that cannot lend more holds fewer rows; the next round's report is the minimum over ranks, and rank 0 starts
  requests only in rows every rank holds.
- **Shrink** when borrowed rows stayed unused for ``kv_return_s``: the rows above the highest one in use go back
  (``take_back``), and the adapter pool grows by their pages (a "capacity" delta to the controller). Rows are taken
  from the lowest borrowed id, so the top ones empty first.

A borrowed row's keys and values per layer (a slab ``[kv_heads / tp, max_seq_len, head_dim]`` each) lie inside the
lent pages, a whole number of slabs per page. Steps with a borrowed row run eagerly (the decode graphs read the own
rows by index): the cost of a batch larger than the own KV cache, paid only while it is.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from lora_cache.errors import CapacityError, ConfigError
from lora_cache.vocab import AdapterKey
from workers.gpu.lend import Lease, PoolLender

if TYPE_CHECKING:
    from workers.engine.config import EngineConfig
    from workers.engine.scheduler import StepPlan


class RowBook:
    """Rank 0's KV rows: ``own`` rows (ids ``0 .. own - 1``; ``own`` is the graphs' padding row), then up to
    ``borrowable`` borrowed ones (ids ``own + 1 ...``), of which the first ``held`` are held on every rank."""

    def __init__(self, own: int, borrowable: int = 0, return_s: float = 1.0) -> None:
        self.own, self.borrowable, self.return_s = own, borrowable, return_s
        self.free_own = deque(range(own))
        self.used: set[int] = set()  # borrowed rows in use
        self.held = 0  # borrowed rows every rank holds (the last round's report, the minimum over ranks)
        self.target = 0  # borrowed rows the last plan asked the ranks to hold
        self._unused_since: float | None = None  # since when a borrowed row the ranks hold has been unused

    @property
    def first_borrowed(self) -> int:
        return self.own + 1

    def capacity(self) -> int:
        """Rows a request may start in now: the own ones and those borrowed on every rank."""
        return self.own + self.held

    def take(self) -> int:
        """A row for a request starting now: an own one first, then the lowest free borrowed one."""
        if self.free_own:
            return self.free_own.popleft()
        for row in range(self.first_borrowed, self.first_borrowed + self.held):
            if row not in self.used:
                self.used.add(row)
                return row
        raise CapacityError(f"no KV row free: {self.own} own rows and {len(self.used)} borrowed ones in use "
                            f"(held on every rank: {self.held})")

    def give(self, row: int) -> None:
        if row < self.own:
            self.free_own.append(row)
        else:
            self.used.discard(row)

    def plan(self, now: float, short: int) -> int:
        """The borrowed rows every rank should hold after this round, given ``short`` requests that could start but
        for a row (the rule in the module's docstring)."""
        if not self.borrowable:
            return 0
        top = max(self.used, default=self.own) - self.own  # rows up to the highest in use stay
        want = min(self.borrowable, len(self.used) + short)
        if want > self.held or top >= self.held:  # growing (or a report behind what is in use): no return now
            self._unused_since = None
            self.target = max(want, top)
            return self.target
        if self.held > max(want, top):
            self._unused_since = now if self._unused_since is None else self._unused_since
            if now - self._unused_since >= self.return_s:
                self._unused_since = None
                self.target = max(want, top)
                return self.target
        else:
            self._unused_since = None
        self.target = self.held
        return self.target


class BorrowedRows:
    """One rank's borrowed KV rows: a lease of whole pool pages per row, its per-layer K and V slabs views of them
    (``KVCache.borrowed``). ``adjust`` grows or shrinks them to the plan's count; ``held`` is this rank's count."""

    def __init__(self, kv: Any, lender: PoolLender, first: int, most: int, layers: int, slab: tuple[int, int, int],
                 reserve_bytes: int) -> None:
        self.kv, self.lender, self.first, self.most, self.layers, self.slab = kv, lender, first, most, layers, slab
        self.reserve_bytes = reserve_bytes  # never lent: a batch's max_adapters adapters of the max rank
        self.slab_numel = slab[0] * slab[1] * slab[2]
        page_numel = lender.page_bytes // lender.flat.element_size()
        self.per_page = page_numel // self.slab_numel
        if most and self.per_page < 1:
            raise ConfigError(f"kv_rows: a borrowed KV row's slab of one layer ({self.slab_numel} elements, "
                              f"{list(slab)}) is larger than a pool page ({page_numel} elements); lower max_seq_len, "
                              "raise page_rank, or set kv_rows to max_running (no borrowed rows)")
        self.pages_per_row = -(-2 * layers // max(1, self.per_page))
        self.leases: list[Lease] = []
        self.refused = 0  # rounds a rank could not lend a row asked for (no free or idle pages)
        self.borrow_ms: list[float] = []  # host time of each row's give_back

    @property
    def held(self) -> int:
        return len(self.leases)

    def row_bytes(self) -> int:
        return self.pages_per_row * self.lender.page_bytes

    def adjust(self, target: int, keep: Collection[str] = ()) -> None:
        """Hold ``target`` borrowed rows (at most ``most``): lend rows of pages (``keep``: adapter names evicted last)
        until a rank's pool cannot, or give the top ones back. Called by every rank at the same round, before the
        step, with the step's adapters held (never lent)."""
        target = min(target, self.most)
        while self.held < target:
            if self.lender.capacity_bytes() - self.row_bytes() < self.reserve_bytes:
                self.refused += 1  # the pages left must hold a whole batch's adapters: no request fails for room
                return
            start = time.perf_counter()
            try:
                lease = self.lender.give_back(self.row_bytes(), keep)
            except CapacityError:
                self.refused += 1
                return
            self.borrow_ms.append((time.perf_counter() - start) * 1e3)
            self.lender.wait(lease)  # on the compute stream: the engine's writes follow the pages' last readers
            self.kv.borrowed[self.first + self.held] = self._slabs(lease)
            self.leases.append(lease)
        while self.held > target:
            self.give_back_top()

    def give_back_top(self) -> None:
        """Return the highest borrowed row's pages; the first load into them waits for the compute stream's
        position now (every step that used the row was issued before)."""
        lease = self.leases.pop()
        self.kv.borrowed.pop(self.first + self.held, None)
        self.lender.take_back(lease)

    def close(self) -> None:
        while self.leases:
            self.give_back_top()

    def _slabs(self, lease: Lease) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V ``[kv_heads, max_len, head_dim]`` views of the lease's pages, zeroed (on the compute
        stream: after ``wait``)."""
        views = []
        for j in range(2 * self.layers):
            page, at = divmod(j, self.per_page)
            view = lease.views[page][at * self.slab_numel : (at + 1) * self.slab_numel].view(self.slab)
            view.zero_()
            views.append(view)
        return views[0::2], views[1::2]

    def summary(self) -> dict[str, Any]:
        """What the rank borrowed over its life (``RankStats.kv``)."""
        ms = sorted(self.borrow_ms)
        return {"rows_borrowed": len(ms), "refused": self.refused, "row_bytes": self.row_bytes(),
                "borrow_ms_p50": ms[len(ms) // 2] if ms else None, "borrow_ms_max": ms[-1] if ms else None}


def borrowed_rows(config: EngineConfig, kv: Any, cache: Any, own: int) -> BorrowedRows | None:
    """A rank's borrowed rows past its ``own`` (``kv_rows``), up to max_running; None: none configured. ``cache``:
    the engine's (a worker's ``WorkerCache`` or an ``Attachment``), whose pool lends the pages."""
    if own >= config.max_running:
        return None
    lender = getattr(cache, "lender", None)
    if lender is None:
        raise ConfigError(f"kv_rows {config.kv_rows} < max_running {config.max_running} borrows KV rows from the "
                          "adapter pool, and this engine's cache lends no pages; set kv_rows to 0")
    shape = config.shape()
    slab = (shape.num_kv_heads // config.tp, config.max_seq_len, shape.head_dim)
    inner = getattr(cache, "cache", cache)  # an attachment's WorkerCache, or the cache itself
    reserve = config.max_adapters * inner.load_path.pages_for(inner.slot_numel) * lender.page_bytes
    return BorrowedRows(kv, lender, own + 1, config.max_running - own, config.layers, slab, reserve)


def plan_adapters(plan: StepPlan) -> set[str]:
    """The adapter names a round's plan runs, holds or wants: evicted last for a borrowed row."""
    refs = (*plan.wanted, *plan.hold, *(it.ref for it in plan.items if it.ref is not None))
    return {ref.name if isinstance(ref, AdapterKey) else ref.partition("@")[0] for ref in refs}


def kv_report(rows: torch.Tensor, lend: BorrowedRows | None) -> torch.Tensor:
    """A rank's round report with its borrowed rows' count appended as one more row (reduced by the minimum over
    ranks with the version exchange's rows: the rows every rank holds); unchanged without borrowed rows."""
    if lend is None:
        return rows
    held = torch.zeros((1, rows.shape[1]), dtype=rows.dtype)
    held[0, 0] = lend.held
    return torch.cat([rows, held])


def split_report(reduced: torch.Tensor, lend: BorrowedRows | None) -> tuple[torch.Tensor, int]:
    """The reduced report -> the version exchange's rows and the borrowed KV rows every rank holds."""
    if lend is None:
        return reduced, 0
    return reduced[:-1], int(reduced[-1, 0])
