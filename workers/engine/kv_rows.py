"""The engine's KV cache in the adapter pool, its rows borrowed as the batch grows (issue 43 item 3, the engine).

With ``kv_rows`` > 0 the engine keeps its KV cache in the rank's adapter pool: ``kv_rows`` rows (and the decode
graphs' padding row) are whole pages lent by the pool at start (``PoolLender.give_back``) and kept; up to
``max_running`` requests may run, the rows past the own ones borrowed from the pool as the batch grows and given
back when it shrinks. The rule (rank 0 decides, every rank follows):

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

A row's keys and values per layer (a slab ``[kv_heads / tp, max_seq_len, head_dim]`` each) lie inside its lent
pages, a whole number of slabs per page, wherever the pages are. ``PooledKV`` views the pool as slabs and keeps a
device table of every row's slab numbers; a decode step stores and gathers its items' keys and values through it
(the own cache's ops and bytes for rows out of order), so the decode graphs capture the table and replay over any
rows, borrowed or not. Why: docs/decisions.md, "The reference engine keeps its KV cache in the adapter pool".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from lora_cache.errors import CapacityError, ConfigError
from lora_cache.vocab import AdapterKey
from workers.engine.model import StepInputs, StepTables, attend_decode, attend_prefill
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
        floor = max(min(self.borrowable, len(self.used) + short), top)  # the rows wanted now
        if floor >= self.held:  # growing, or holding what is wanted: nothing to give back
            self._unused_since = None
            self.target = floor
        else:  # rows unused above the floor: given back once unused for return_s
            self._unused_since = now if self._unused_since is None else self._unused_since
            returning = now - self._unused_since >= self.return_s
            self._unused_since = None if returning else self._unused_since
            self.target = floor if returning else self.held
        return self.target


class PooledKV:
    """The engine's KV cache in the adapter pool's pages (``kv_rows``): the pool viewed as slabs ``[kv_heads,
    max_len, head_dim]`` (``slabs``), each row's per-layer K and V slabs among those its lent pages hold, wherever
    they are. A device table of every row's slab numbers (``table``: refilled when rows come and go, never
    reallocated) lets a decode step store and gather its items' keys and values through it with the own cache's
    ops (an index per item, the same bytes): the decode graphs capture the table, not the rows. A prefill reads each
    row's slabs as views."""

    def __init__(self, flat: torch.Tensor, layers: int, slab: tuple[int, int, int], rows: int,
                 device: torch.device) -> None:
        self.layers, self.slab = layers, slab
        numel = slab[0] * slab[1] * slab[2]
        self.slabs = flat[: flat.numel() // numel * numel].view(-1, *slab)
        self.table = torch.zeros((rows, layers, 2), dtype=torch.int64, device=device)
        self.held: dict[int, list[int]] = {}  # row -> its slab numbers [K0, V0, K1, V1, ...]

    def place(self, row: int, numbers: list[int]) -> None:
        """Row ``row``'s slabs are these (2 per layer, K then V), zeroed; on the current (compute) stream."""
        for n in numbers:
            self.slabs[n].zero_()
        self.held[row] = numbers
        table = torch.tensor(numbers, dtype=torch.int64).view(self.layers, 2)
        self.table[row].copy_(table.to(self.table.device, non_blocking=True))

    def alias(self, row: int, to: int) -> None:
        """Row ``row`` (given back) points at row ``to``'s slabs: a plan that used it by mistake would write those,
        never the pool's pages that went back to adapters."""
        self.held.pop(row, None)
        self.table[row].copy_(self.table[to])

    def row(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (numbers := self.held.get(row)) is None:
            raise LookupError(f"KV row {row} is not held on this rank (held: {sorted(self.held)}): a plan ran a "
                              "request in a row this rank does not hold")
        return self.slabs[numbers[2 * layer]], self.slabs[numbers[2 * layer + 1]]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs,
               tables: StepTables) -> torch.Tensor:
        """``KVCache.attend`` over the pooled rows: the same math and ops, each item's slabs found in ``table``."""
        if step.prefill:
            return attend_prefill(lambda row: self.row(layer, row), q, k, v, step)
        at = self.table[:, layer].index_select(0, step.rows)  # [items, 2]: each item's K and V slab
        ks, vs = at[:, 0], at[:, 1]
        self.slabs[ks, :, step.positions], self.slabs[vs, :, step.positions] = k, v
        keys = self.slabs[:, :, : step.kv_len].index_select(0, ks)  # [items, kv_heads, kv_len, hd]
        values = self.slabs[:, :, : step.kv_len].index_select(0, vs)
        return attend_decode(q, keys, values, tables)


class BorrowedRows:
    """One rank's KV rows in the pool: ``permanent`` rows lent at start and kept (the own rows and the graphs'
    padding row, ids ``0 .. first - 1``), then up to ``most`` borrowed ones (ids ``first ...``), a lease of whole
    pages each (``PooledKV`` holds their slabs). ``adjust`` grows or shrinks the borrowed ones to the plan's count;
    ``held`` is this rank's count of them."""

    def __init__(self, lender: PoolLender, first: int, most: int, layers: int, slab: tuple[int, int, int],
                 reserve_bytes: int, device: torch.device) -> None:
        self.lender, self.first, self.most, self.layers, self.slab = lender, first, most, layers, slab
        self.reserve_bytes = reserve_bytes  # never lent: a batch's max_adapters adapters of the max rank
        self.slab_numel = slab[0] * slab[1] * slab[2]
        self.page_numel = lender.page_bytes // lender.flat.element_size()
        self.per_page, self.pages_per_row = row_pages(slab, layers, self.page_numel)
        self.kv = PooledKV(lender.flat, layers, slab, first + most, device)
        self.own_leases: list[Lease] = []  # the own rows' and the padding row's, for the engine's life
        self.leases: list[Lease] = []  # the borrowed rows', lowest row first
        self.refused = 0  # rounds a rank could not lend a row asked for (no free or idle pages)
        self.borrow_ms: list[float] = []  # host time of each borrowed row's give_back
        for row in range(first):  # the own rows and the padding row, lent for the engine's life
            lease = self._lend(())
            if lease is None:
                pages = (lender.capacity_bytes() + row * self.row_bytes()) // lender.page_bytes  # before this start
                self.close()  # what this start lent goes back: a refused start leaves the pool as it was
                refuse_pool(pages, first, self.pages_per_row, -(-reserve_bytes // lender.page_bytes))
            self._place(row, lease)
            self.own_leases.append(lease)

    @property
    def held(self) -> int:
        return len(self.leases)

    def row_bytes(self) -> int:
        return self.pages_per_row * self.lender.page_bytes

    def adjust(self, target: int, keep: Collection[str] = ()) -> None:
        """Hold ``target`` borrowed rows (at most ``most``): lend rows of pages (``keep``: adapter names evicted last)
        until the pool cannot, or give the top ones back. Called by every rank at the same round, before the step,
        on the compute stream, with the step's adapters held (never lent)."""
        target = min(target, self.most)
        while self.held < target:
            start = time.perf_counter()
            lease = self._lend(keep)
            if lease is None:
                self.refused += 1
                return
            self.borrow_ms.append((time.perf_counter() - start) * 1e3)
            self._place(self.first + self.held, lease)
            self.leases.append(lease)
        while self.held > target:
            self.give_back_top()

    def give_back_top(self) -> None:
        """Return the highest borrowed row's pages: its table entry points at the padding row first, then the
        first load into the pages waits for the compute stream's position (every step that used it was issued)."""
        lease = self.leases.pop()
        self.kv.alias(self.first + self.held, self.first - 1)
        self.lender.take_back(lease)

    def close(self) -> None:
        """Every row's pages back to the pool: the borrowed ones, then the own ones (those a refused start lent too)."""
        while self.leases:
            self.give_back_top()
        for lease in reversed(self.own_leases):
            self.lender.take_back(lease)
        self.own_leases = []

    def _lend(self, keep: Collection[str]) -> Lease | None:
        """A row's pages, or None if lending them would leave less than a batch's room (or the pool refuses)."""
        if self.lender.capacity_bytes() - self.row_bytes() < self.reserve_bytes:
            return None  # the pages left must hold a whole batch's adapters: no request fails for room
        try:
            return self.lender.give_back(self.row_bytes(), keep)
        except CapacityError:
            return None

    def _place(self, row: int, lease: Lease) -> None:
        self.lender.wait(lease)  # on the compute stream: the engine's writes follow the pages' last readers
        numbers = []
        for j in range(2 * self.layers):
            page, at = divmod(j, self.per_page)
            numbers.append(-(-lease.pages[page] * self.page_numel // self.slab_numel) + at)  # the page's first whole
        self.kv.place(row, numbers)

    def summary(self) -> dict[str, Any]:
        """What the rank borrowed over its life (``RankStats.kv``)."""
        ms = sorted(self.borrow_ms)
        return {"rows_borrowed": len(ms), "refused": self.refused, "row_bytes": self.row_bytes(),
                "own_rows": self.first, "borrow_ms_p50": ms[len(ms) // 2] if ms else None,
                "borrow_ms_max": ms[-1] if ms else None}


def kv_slab(config: EngineConfig) -> tuple[int, int, int]:
    """One layer's K (or V) of one KV row on one rank: [kv_heads / tp, max_seq_len, head_dim]."""
    shape = config.shape()
    return shape.num_kv_heads // config.tp, config.max_seq_len, shape.head_dim


def row_pages(slab: tuple[int, int, int], layers: int, page_numel: int) -> tuple[int, int]:
    """(slabs a page holds whole wherever it starts, pages a KV row takes); a slab larger than a page is refused."""
    slab_numel = slab[0] * slab[1] * slab[2]
    per_page = (page_numel if page_numel % slab_numel == 0 else page_numel - slab_numel + 1) // slab_numel
    if per_page < 1:
        raise ConfigError(f"kv_rows: a KV row's slab of one layer ({slab_numel} elements, {list(slab)}) is larger "
                          f"than a pool page ({page_numel} elements); lower max_seq_len, raise page_rank, or set "
                          "kv_rows to 0 (the engine's own KV cache)")
    return per_page, -(-2 * layers // per_page)


def refuse_pool(pages: int, rows: int, row_pages: int, reserve_pages: int) -> NoReturn:
    raise ConfigError(f"kv_rows: the pool ({pages} pages) cannot lend {rows} KV rows of {row_pages} pages each beside "
                      f"a batch's adapters ({reserve_pages} pages); give pool_pages >= "
                      f"{rows * row_pages + reserve_pages} or fewer kv_rows")


def check_pool(config: EngineConfig, page_numel: int, pages: int, adapter_pages: int) -> None:
    """Before anything starts: a pool of ``pages`` pages of ``page_numel`` elements can lend the engine's own KV rows
    and its padding row beside a batch's ``max_adapters`` adapters of ``adapter_pages`` pages each (the bound
    ``BorrowedRows`` holds at start); a clear error naming the fix if not."""
    if not config.kv_rows:
        return
    _, per_row = row_pages(kv_slab(config), config.layers, page_numel)
    if pages - (config.kv_rows + 1) * per_row < config.max_adapters * adapter_pages:
        refuse_pool(pages, config.kv_rows + 1, per_row, config.max_adapters * adapter_pages)


def borrowed_rows(config: EngineConfig, cache: Any, device: torch.device) -> BorrowedRows | None:
    """A rank's KV rows in the pool (``kv_rows`` > 0): its own rows and the padding row lent at start, up to
    max_running borrowed as the batch grows; None: ``kv_rows`` 0, the engine's own ``KVCache``. ``cache``: the
    engine's (a worker's ``WorkerCache`` or an ``Attachment``), whose pool lends the pages."""
    if not config.kv_rows:
        return None
    lender = getattr(cache, "lender", None)
    if lender is None:
        raise ConfigError(f"kv_rows {config.kv_rows} keeps the KV cache in the adapter pool, and this engine's cache "
                          "lends no pages; set kv_rows to 0")
    slab = kv_slab(config)
    inner = getattr(cache, "cache", cache)  # an attachment's WorkerCache, or the cache itself
    reserve = config.max_adapters * inner.load_path.pages_for(inner.slot_numel) * lender.page_bytes
    return BorrowedRows(lender, config.kv_rows + 1, config.max_running - config.kv_rows, config.layers, slab,
                        reserve, device)


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
