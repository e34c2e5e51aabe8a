"""Issue 43 item 3, the engine's side: KV rows borrowed from the adapter pool as the batch grows.

The reference engine keeps ``kv_rows`` KV rows of its own and runs up to ``max_running`` requests: the rows past its
own are whole pool pages lent by the rank's ``PoolLender`` (idle adapters evicted, never an in-use one, never below a
batch's room), held on every TP rank before a request starts in one, and given back once unused. Held here: a
request computes the same outputs in a borrowed row as in an own one (TP 1 and TP 2, on the CPU; with CUDA graphs
on a GPU); the rows are grown only for requests short of a row, never taken below one in use, and given back
after ``kv_return_s``; a pool with no page to spare lends none and the stream is served in the own rows; bad
settings are refused before serving, naming the fix."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_cache.errors import CapacityError, ConfigError
from tests.test_engine import REQUESTS, adapters, check_served, engine_config  # noqa: F401  (adapters: a fixture)
from workers.engine import EngineResult, Request, run_engine
from workers.engine.kv_rows import RowBook

# every request at once: the batch outgrows one own row at the first round
BURST = [r._replace(arrival_s=0.0) for r in REQUESTS]


def borrowing(**kw: object) -> dict[str, object]:
    """One own KV row, up to 4 running: 16 pages of rank 16, of which 8 stay for a batch's 2 adapters of rank 64."""
    return dict(admission="ondemand", page_rank=16, pool_pages=16, num_slots=6, kv_rows=1, kv_return_s=0.0) | kw


@pytest.fixture(scope="module")
def own_rows(adapters: Path) -> EngineResult:  # noqa: F811
    return run_engine(engine_config(adapters, admission="ondemand", page_rank=16, pool_pages=16, num_slots=6), BURST)


def same_outputs(a: EngineResult, b: EngineResult, tol: float = 1e-5) -> None:
    for one, two in zip(a.records, b.records, strict=True):
        assert one.outputs is not None and two.outputs is not None
        torch.testing.assert_close(two.outputs, one.outputs, rtol=tol, atol=tol)


def batched_over(result: EngineResult, rows: int) -> bool:
    """Whether some step ran more requests than ``rows`` (so some ran in a borrowed row)."""
    ends: dict[float, int] = {}
    for r in result.records:
        for t in r.token_s:
            ends[t] = ends.get(t, 0) + 1
    return max(ends.values()) > rows


@pytest.mark.parametrize("tp", [1, 2])
def test_requests_in_borrowed_rows_compute_what_own_rows_do(adapters: Path, own_rows: EngineResult,  # noqa: F811
                                                            tp: int) -> None:
    config = engine_config(adapters, **borrowing(tp=tp, admission="ondemand" if tp == 1 else "overlap"))
    result = run_engine(config, BURST)
    check_served(result, config, BURST)
    assert batched_over(result, 1), "the burst ran in borrowed rows"
    assert not batched_over(own_rows, 4)
    same_outputs(own_rows, result, 1e-5 if tp == 1 else 1e-4)
    kv = [s.kv for s in result.ranks]
    assert all(k["rows_borrowed"] >= 1 for k in kv), kv
    assert all(s.cache["load_failures"] == 0 for s in result.ranks)


def test_a_pool_with_no_page_to_spare_lends_none_and_serves_in_its_own_rows(adapters: Path,  # noqa: F811
                                                                            own_rows: EngineResult) -> None:
    """10 pages of rank 16: the own row and the padding row (a page each) lent at start, and 8 pages, exactly a
    batch's 2 adapters of rank 64, that may not be lent: no row is borrowed, nothing fails."""
    config = engine_config(adapters, **borrowing(pool_pages=10))
    result = run_engine(config, BURST)
    check_served(result, config, BURST)
    assert not batched_over(result, 1)
    kv = result.ranks[0].kv
    assert kv["rows_borrowed"] == 0 and kv["refused"] >= 1, kv
    # fewer pages than own_rows' pool: other batches, so fp32 sums in another order (4.8e-5 apart on an AMD EPYC's
    # kernels, 0 on others); another adapter's or version's weights are 0.1-1 apart
    same_outputs(own_rows, result, 1e-4)


@pytest.mark.parametrize(("kw", "words"), [
    (dict(kv_rows=5), "kv_rows must be within 0..max_running (4), got 5"),
    (dict(kv_rows=-1), "kv_rows must be within 0..max_running (4), got -1"),
    (dict(kv_return_s=-1.0), "kv_return_s must be >= 0"),
    (dict(page_rank=1, pool_pages=128, max_seq_len=2048, max_prefill_tokens=24),
     r"slab of one layer \(65536 elements, \[2, 2048, 16\]\) is larger than a pool page \(2048 elements\); "
     "lower max_seq_len, raise page_rank"),
    (dict(pool_pages=9), r"the pool \(9 pages\) cannot lend 2 KV rows of 1 pages each beside a batch's adapters "
                         r"\(8 pages\); give pool_pages >= 10 or fewer kv_rows"),
])
def test_bad_kv_row_settings_are_refused_before_serving(adapters: Path, kw: dict[str, object],  # noqa: F811
                                                        words: str) -> None:
    with pytest.raises(ConfigError, match=words if "\\" in words else words.replace("(", r"\(").replace(")", r"\)")):
        run_engine(engine_config(adapters, **borrowing(**kw)), [Request(0, None, 2, 1)])


# -- the rule (rank 0's RowBook), on its own --------------------------------------------------------------
def test_rows_are_own_first_then_the_lowest_borrowed_one_every_rank_holds() -> None:
    book = RowBook(2, 3, return_s=1.0)
    assert book.plan(0.0, short=0) == 0
    assert [book.take(), book.take()] == [0, 1] and book.capacity() == 2
    with pytest.raises(CapacityError, match="no KV row free: 2 own rows and 0 borrowed ones in use"):
        book.take()
    assert book.plan(0.0, short=5) == 3, "grown for the requests short of a row, up to the borrowable rows"
    book.held = 2  # one rank could lend only two
    assert [book.take(), book.take()] == [3, 4] and book.capacity() == 4
    book.give(3)
    assert book.take() == 3


def test_borrowed_rows_go_back_after_return_s_and_never_below_one_in_use() -> None:
    book = RowBook(1, 3, return_s=1.0)
    book.take()
    assert book.plan(0.0, short=3) == 3
    book.held = 3
    rows = [book.take() for _ in range(3)]
    assert rows == [2, 3, 4]
    book.give(2)
    book.give(3)  # the top row (4) is still in use
    assert book.plan(1.0, short=0) == 3 and book.plan(5.0, short=0) == 3
    book.give(4)
    assert book.plan(6.0, short=0) == 3, "unused since 6.0: kept a while"
    assert book.plan(6.5, short=1) == 3
    assert book.plan(7.0, short=0) == 0, "given back after return_s"
    book.held = 0
    assert book.plan(7.5, short=1) == 1


@settings(max_examples=200, deadline=None)  # pure bookkeeping: no time limit on a loaded CI machine
@given(st.lists(st.tuples(st.sampled_from(["take", "give", "plan", "report"]), st.integers(0, 4)), max_size=60))
def test_the_plan_never_drops_a_row_in_use_and_takes_only_rows_every_rank_holds(ops: list[tuple[str, int]]) -> None:
    book = RowBook(2, 3, return_s=0.5)
    running: list[int] = []
    now = 0.0
    for op, n in ops:
        now += 0.3
        if op == "take" and len(running) < book.capacity():
            row = book.take()
            assert row not in running and (row < 2 or 3 <= row < 3 + book.held)
            running.append(row)
        elif op == "give" and running:
            book.give(running.pop(n % len(running)))
        elif op == "plan":
            target = book.plan(now, short=n)
            assert target <= 3
            assert target >= max((r - 2 for r in running if r > 2), default=0), "a row in use is never given back"
        elif op == "report":  # the ranks did what the last plan asked, or some could lend less
            book.held = max(min(book.target, n), max((r - 2 for r in running if r > 2), default=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_borrowed_rows_with_decode_graphs_compute_what_own_rows_do(adapters: Path) -> None:  # noqa: F811
    """On a GPU: steps whose rows are all own replay the decode graphs, steps with a borrowed row run eagerly over
    the lent pages; the outputs are the own rows' run's."""
    from tests.test_engine import gpu_config

    own = run_engine(gpu_config(adapters, dtype="float32", page_rank=16, pool_pages=16, num_slots=6), BURST)
    config = gpu_config(adapters, dtype="float32", page_rank=16, pool_pages=16, num_slots=6, kv_rows=1,
                        kv_return_s=0.0)
    result = run_engine(config, BURST)
    check_served(result, config, BURST)
    assert batched_over(result, 1) and result.ranks[0].kv["rows_borrowed"] >= 1
    same_outputs(own, result, 1e-4)


# -- a rank's rows in the pool (BorrowedRows, PooledKV), on a real worker cache ------------------------------------
def test_pooled_rows_are_whole_lent_pages_each_its_own_and_given_back_rows_point_at_the_padding_row(
        tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., Any],
        make_cache: Callable[..., Any]) -> None:
    from workers.engine.kv_rows import BorrowedRows

    catalog = make_catalog(tiny_adapters(count=4, rank="16")[0].parent, max_rank=16)
    cache = make_cache(catalog, num_slots=8, page_rank=16, pool_pages=8, host_bytes=8 << 20)
    lender = cache.lender
    full = lender.capacity_bytes()
    rows = BorrowedRows(lender, first=2, most=3, layers=2, slab=(2, 32, 16), reserve_bytes=2 * lender.page_bytes,
                        device=cache.device)
    assert lender.capacity_bytes() == full - 2 * rows.row_bytes(), "the own row and the padding row, lent at start"
    rows.adjust(5)
    assert rows.held == 3 and rows.refused == 0
    rows.adjust(5)  # the pool keeps 2 pages for a batch: a fourth row is never lent
    spans = [(int(v.data_ptr()), int(v.data_ptr()) + v.numel() * v.element_size())
             for row in range(5) for layer in range(2) for v in rows.kv.row(layer, row)]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "no two slabs share a byte"
    pages = {p for lease in (*rows.own_leases, *rows.leases) for p in lease.pages}
    assert len(pages) == 5 * rows.pages_per_row
    assert lender.capacity_bytes() >= rows.reserve_bytes
    rows.adjust(1)
    assert rows.held == 1 and sorted(rows.kv.held) == [0, 1, 2]
    for row in (3, 4):
        assert torch.equal(rows.kv.table[row], rows.kv.table[1]), "a returned row points at the padding row"
    page = rows.page_numel * cache.pool.element_size()
    for row in range(3):  # each slab inside one of its row's lent pages
        lent = {p for lease in (*rows.own_leases, *rows.leases) for p in lease.pages}
        for layer in range(2):
            for view in rows.kv.row(layer, row):
                first = (view.data_ptr() - lender.flat.data_ptr()) // page
                last = (view.data_ptr() + view.numel() * view.element_size() - 1 - lender.flat.data_ptr()) // page
                assert first == last and first in lent
    rows.close()
    assert lender.capacity_bytes() == full
    small = (2, 32, 16)
    with pytest.raises(ConfigError, match=r"the pool \(8 pages\) cannot lend 5 KV rows of 1 pages each beside a "
                                          r"batch's adapters \(4 pages\); give pool_pages >= 9"):
        BorrowedRows(lender, first=5, most=0, layers=2, slab=small, reserve_bytes=4 * lender.page_bytes,
                     device=cache.device)
    assert lender.capacity_bytes() == full, "a refused start gives back what it lent"
    cache.check_integrity()
    cache.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True), st.integers(1, 32), st.integers(0, 9))
def test_pooled_kv_decode_computes_what_the_own_kv_cache_does(rows: list[int], kv_len: int, seed: int) -> None:
    """The torch twin: the same keys and values written through ``PooledKV``'s table (slabs scattered in a flat
    buffer, out of order) and into a ``KVCache``, a decode step's attention over any rows is the same."""
    from workers.engine.kv_rows import PooledKV
    from workers.engine.model import KVCache, StepInputs, step_tables

    g = torch.Generator().manual_seed(seed)
    layers, kvh, max_len, hd, heads = 2, 2, 32, 16, 4
    own = KVCache(layers, 6, kvh, max_len, hd, torch.float32, torch.device("cpu"))
    pooled = PooledKV(torch.zeros(40 * kvh * max_len * hd + 7), layers, (kvh, max_len, hd), 6, torch.device("cpu"))
    order = torch.randperm(40, generator=g).tolist()  # each row's 2 * layers slabs anywhere in the buffer
    for row in range(6):
        pooled.place(row, [order[4 * row + j] for j in range(2 * layers)])
        for layer in range(layers):
            k, v = torch.randn(2, kvh, max_len, hd, generator=g)
            own.k[layer][row].copy_(k)
            own.v[layer][row].copy_(v)
            pk, pv = pooled.row(layer, row)
            pk.copy_(k)
            pv.copy_(v)
    positions = torch.randint(0, kv_len, (len(rows),), generator=g)
    positions[0] = kv_len - 1
    step = StepInputs(False, (), positions, torch.tensor(rows), torch.arange(len(rows)), kv_len)
    tables = step_tables(step, None, torch.float32)
    for layer in range(layers):
        q = torch.randn(len(rows), heads, hd, generator=g)
        k, v = torch.randn(2, len(rows), kvh, hd, generator=g)
        got, want = pooled.attend(layer, q, k, v, step, tables), own.attend(layer, q, k, v, step, tables)
        torch.testing.assert_close(got, want)
        for i, row in enumerate(rows):  # the step's token stored in each item's row
            assert torch.equal(pooled.row(layer, row)[0][:, int(positions[i])], k[i])


def test_the_benchmark_refuses_kv_rows_on_the_simulator() -> None:
    from bench.config import BenchConfig

    with pytest.raises(ConfigError, match="--kv-rows 2: the simulator does not model the engine's KV cache; it needs "
                                          "--engine real"):
        BenchConfig(engine="sim", kv_rows=2)


@pytest.mark.ray
@pytest.mark.parametrize("fleet", [["--replicas", "2", "--tp", "1"], ["--attach", "--replicas", "1", "--tp", "2"]],
                         ids=["hosted-2x1", "attached-1x2"])
def test_the_benchmark_serves_with_engines_whose_kv_cache_is_in_the_pool(tmp_path: Path, fleet: list[str]) -> None:
    """``bench.run --quick --kv-rows 1``: engines hosted in worker actors on a real local Ray (two replicas), or in
    processes of their own attached through the seam (one replica of TP 2), keep one KV row each in the adapter
    pool and borrow more as their batches grow, while the controller plans the pool they leave: every request is
    served, and the ranks report the rows they borrowed (every rank of a TP replica)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", *fleet, "--kv-rows", "1", "--page-rank", "16",
                           "--pool-pages", "24", "--arrivals", "poisson:60", "--policies", "global", "--out",
                           str(tmp_path), "--no-plots"], cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    requests = doc["config"]["workload"]["requests"]
    assert (doc["figures"]["global"]["completed"], doc["figures"]["global"]["failed"]) == (requests, 0)
    kv = [r["kv"] for r in doc["ranks"]["global"]]
    assert len(kv) == 2 and all(k["own_rows"] == 2 for k in kv), kv  # the own row and the padding row
    assert sum(k["rows_borrowed"] for k in kv) >= 1, kv
    if "--attach" in fleet:  # one replica: both ranks were told to borrow (a copy in flight may delay one)
        assert all(k["rows_borrowed"] >= 1 for k in kv), kv


def test_a_pool_too_small_for_the_kv_rows_is_refused_before_anything_starts(adapters: Path) -> None:  # noqa: F811
    """``check_pool`` (``bench.run --kv-rows`` calls it before the service starts) holds the bound a rank's
    ``BorrowedRows`` holds at start: the own rows, the padding row and a batch's adapters fit the pool, or a clear
    error names the pool size to give."""
    from workers.cache import WorkerConfig, pool_pages
    from workers.engine.kv_rows import check_pool

    config = engine_config(adapters, **borrowing())
    page, _ = pool_pages(WorkerConfig(num_slots=6, page_rank=16, pool_pages=16), config.shape(), 64, torch.float32)
    check_pool(config, page, 10, 4)  # 2 rows of a page each and 2 adapters of 4 pages
    with pytest.raises(ConfigError, match=r"the pool \(9 pages\) cannot lend 2 KV rows of 1 pages each beside a "
                                          r"batch's adapters \(8 pages\); give pool_pages >= 10 or fewer kv_rows"):
        check_pool(config, page, 9, 4)
    check_pool(engine_config(adapters), page, 1, 4)  # kv_rows 0: the engine's own KV cache, nothing to check


def test_a_kv_rows_run_gets_the_catalog_of_the_run_with_its_own_kv_cache() -> None:
    """At equal GPU bytes, ``--kv-rows`` gives the pool the bytes of the engine's own KV cache too (max_running rows
    and the padding row): the workload's catalog and auto warm-up count the adapters' share only, so the run compares
    with the one whose engine keeps its own KV cache beside the rest of the pool (the same adapters, the same check
    that there are more adapters than slots)."""
    from bench.config import BenchConfig
    from bench.real import own_kv_pages

    common = dict(engine="real", model="llama-3.1-8b", max_rank=64, page_rank=16, slots=15, gpus="no")
    own = BenchConfig(pool_pages=32, **common)  # type: ignore[arg-type]
    pooled = BenchConfig(pool_pages=164, kv_rows=8, **common)  # type: ignore[arg-type]
    kv = own_kv_pages(pooled)  # 33 rows, each 32 layers' K and V at max_seq_len 2048 in 4 pages of 8B rank 16
    assert kv == 33 * 4
    assert own.byte_slots() == pooled.byte_slots(kv) == 8
    assert pooled.byte_slots() == 41  # without the KV cache's share: 16 adapters would be refused as too few
