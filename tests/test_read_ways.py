"""``HostTierConfig.direct_reads`` "auto" (issue 42, ``workers.staging.read_ways``): a cold read goes the way its file
system and size class measured faster. The plain core: it tries both ways first, then takes the faster by median
and tries the other now and then; classes are apart; a file system that refused ``O_DIRECT`` is read through the page
cache. The tier: warm stages' real reads of real files alternate, then follow the choice; a read a request waits for
never tries a way; only reads that ran alone are timed; every staged shard is the one a page-cache read stages,
whichever way it went."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import workers.staging.host_tier as host_tier_module
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.shapes import SHAPES
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from tests.pages import direct_refused
from workers.reads.shard import read_shard
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostTier
from workers.staging.read_ways import WAYS, ReadWays, Ticket, device_of, size_class
from workers.staging.tier_reads import ThreadReads

BF16 = torch.bfloat16
MB = 1 << 20


def timed(ways: ReadWays, dev: int, nbytes: int, rate: dict[str, float]) -> str:
    """Send one read and time it at ``rate[way]`` bytes per second; the way it went."""
    way = ways.way(dev, nbytes)
    ways.timed(Ticket(dev, size_class(nbytes), way, 1), nbytes, nbytes / rate[way], way == "direct")
    return way


def test_a_class_tries_each_way_then_takes_the_fastest_and_rechecks_the_others() -> None:
    ways = ReadWays(explore=3, recheck=5)
    rate = {"direct": 2e9, "preadv": 1.5e9, "ahead": 1e9}
    first = [timed(ways, 1, 300 * MB, rate) for _ in range(9)]
    assert first == ["direct", "preadv", "ahead"] * 3  # in turn, direct first
    assert ways.chosen(1, 300 * MB) == "direct"
    after = [timed(ways, 1, 300 * MB, rate) for _ in range(10)]  # reads 10..19 of the class: 10 and 15 recheck
    assert after == ["preadv"] + ["direct"] * 4 + ["ahead"] + ["direct"] * 4  # the ways not chosen, in turn
    report = ways.report()[f"1:{size_class(300 * MB)}"]
    assert report["chosen"] == "direct"
    assert report["direct"] == {"GBps": pytest.approx(2.0), "timed": 8}  # the newest 8 kept
    assert report["preadv"] == {"GBps": pytest.approx(1.5), "timed": 4}
    assert report["ahead"] == {"GBps": pytest.approx(1.0), "timed": 4}


def test_a_device_that_slows_one_way_down_is_followed(caplog: pytest.LogCaptureFixture) -> None:
    """The newest rates decide: once direct reads slow below the page cache's, the rechecks bring the choice over.
    Each choice and each change of it is logged once, for the operator."""
    caplog.set_level(logging.INFO, logger="workers.staging.read_ways")
    ways = ReadWays(explore=2, recheck=2)
    rate = {"direct": 2e9, "preadv": 1e9, "ahead": 0.8e9}
    for _ in range(6):
        timed(ways, 1, 80 * MB, rate)
    assert ways.chosen(1, 80 * MB) == "direct"
    rate["direct"] = 0.5e9
    for _ in range(20):
        timed(ways, 1, 80 * MB, rate)
    assert ways.chosen(1, 80 * MB) == "preadv"
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2 and "now go by O_DIRECT" in told[0] and "now go through the page cache (" in told[1], told
    assert "shards up to 128 MB on file system 1" in told[0] and "ahead 0.80 GB/s" in told[0]


def test_size_classes_and_file_systems_choose_apart() -> None:
    ways = ReadWays(explore=1, recheck=100)
    for _ in range(3):
        timed(ways, 1, 300 * MB, {"direct": 2e9, "preadv": 1e9, "ahead": 1e9})  # large reads: direct fastest
        timed(ways, 1, 80 * MB, {"direct": 1e9, "preadv": 2e9, "ahead": 1e9})  # small reads: the page cache
        timed(ways, 2, 300 * MB, {"direct": 1e9, "preadv": 1e9, "ahead": 2e9})  # another file system: asked ahead
    assert (ways.chosen(1, 300 * MB), ways.chosen(1, 80 * MB), ways.chosen(2, 300 * MB)) == ("direct", "preadv",
                                                                                             "ahead")
    assert ways.chosen(1, 290 * MB) == "direct"  # the same power of two: the same class
    assert ways.chosen(3, 300 * MB) is None  # never read: nothing chosen yet


def test_a_file_system_that_refused_o_direct_is_read_the_other_ways_from_then_on() -> None:
    ways = ReadWays(explore=2, recheck=2)
    way = ways.way(7, 100 * MB)
    assert way == "direct"
    ways.timed(Ticket(7, size_class(100 * MB), way, 1), 100 * MB, 0.05, direct=False)  # it fell back
    assert 7 in ways.refused
    sent = [timed(ways, 7, n, {"direct": 9e9, "preadv": 1e9, "ahead": 2e9}) for n in (100 * MB, 300 * MB) * 8]
    assert "direct" not in sent and {"preadv", "ahead"} <= set(sent)
    assert ways.chosen(7, 100 * MB) == ways.chosen(7, 300 * MB) == "ahead"
    assert ways.report()[f"7:{size_class(100 * MB)}"]["chosen"] == "ahead"


def test_bad_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="explore is 0 and recheck 5; give explore >= 1"):
        ReadWays(explore=0, recheck=5)
    with pytest.raises(ValueError, match="recheck >= 2"):
        ReadWays(explore=2, recheck=1)


@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.sampled_from([16 * MB, 64 * MB, 256 * MB]),
                          st.floats(0.2e9, 4e9), st.floats(0.2e9, 4e9), st.floats(0.2e9, 4e9)),
                min_size=1, max_size=60))
def test_outside_its_rechecks_a_class_never_goes_a_way_it_measured_slower(
        reads: list[tuple[int, int, float, float, float]]) -> None:
    """Whatever the rates: once a class has explored, a read that is not its recheck goes the way of the highest
    median of the rates timed so far; while it explores, each way is tried before any is tried again."""
    ways = ReadWays(explore=2, recheck=4)
    seen: dict[tuple[int, int], dict[str, list[float]]] = {}
    sent: dict[tuple[int, int], int] = {}
    for dev, nbytes, *rates in reads:
        rate = dict(zip(WAYS, rates, strict=True))
        key = (dev, size_class(nbytes))
        got = seen.setdefault(key, {w: [] for w in WAYS})
        sent[key] = sent.get(key, 0) + 1
        way = timed(ways, dev, nbytes, rate)
        explored = all(len(v) >= 2 for v in got.values())
        if explored and sent[key] % 4:
            medians = {w: sorted(v[-8:])[(len(v[-8:]) - 1) // 2: len(v[-8:]) // 2 + 1] for w, v in got.items()}
            mean = {w: sum(m) / len(m) for w, m in medians.items()}
            assert way == max(WAYS, key=lambda w: (mean[w], -WAYS.index(w)))
        elif not explored:
            assert len(got[way]) == min(len(v) for v in got.values())
        got[way].append(nbytes / (nbytes / rate[way]))  # as the core computes it


# -- the tier: real reads of real files ----------------------------------------------------------------------------


@pytest.fixture
def cold_catalog(tmp_path: Path, make_catalog: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> AdapterCatalog:
    """Twelve tiny rank-16 adapters on a file system that takes ``O_DIRECT``, each read as if out of the page cache
    (the way a read goes is the thing tested; whether a file is cold is ``is_cold``'s, tested with direct reads)."""
    why = direct_refused(tmp_path)
    if why:
        pytest.skip(why)
    paths = make_adapters(tmp_path / "ad", SynthConfig(model="tiny", count=12, rank="16", seed=9))
    monkeypatch.setattr(host_tier_module, "is_cold", lambda spec: True)
    catalog: AdapterCatalog = make_catalog(paths[0].parent)
    return catalog


def auto_tier(catalog: AdapterCatalog, explore: int, recheck: int) -> tuple[HostTier, int, int]:
    """An auto tier over real threads, its core set to ``explore`` / ``recheck``; (tier, the catalog's file system,
    a shard's bytes: its size class)."""
    t = HostTier(HostTierConfig(host_bytes=8 * MB, read_threads=2, read_parallel=2, pin=False, reads="thread",
                                direct_reads="auto"))
    t.cold.ways = ReadWays(explore=explore, recheck=recheck)
    first = catalog.get(catalog.names()[0])
    dev, nbytes = device_of(first), shard_layout(first, SHAPES["tiny"], 1, 0, BF16).nbytes
    assert dev is not None
    return t, dev, nbytes


def went_direct(entry: Any) -> bool:
    return any(phase == "direct" for phase, _ in entry.marks)


def test_an_auto_tier_tries_each_way_then_follows_what_its_own_reads_measured(cold_catalog: AdapterCatalog) -> None:
    """One read at a time: warm stages' reads take the three ways in turn (each really by its way: an ``O_DIRECT``
    open or none, the file asked for ahead or not) until each has two timed, the class then chooses the fastest by
    what they measured, and the next warm reads go that way but the recheck. Demand reads never try a way: the page
    cache while the class explores, the chosen way after; they are timed too. Every read ran alone and is timed;
    every shard is the one a page-cache read stages."""
    t, dev, nbytes = auto_tier(cold_catalog, explore=2, recheck=3)
    # a demand read first, then warm reads until the class chooses, then demand and warm reads in turn
    warm = [False, True, True, True, True, True, False, True, False, True, False, True]
    try:
        warm_ways: list[str] = []
        demand_ways: list[str] = []
        wanted_warm: list[str] = []
        wanted_demand: list[str] = []
        warm_sent = 0
        for name, speculative in zip(cold_catalog.names(), warm, strict=True):
            spec = cold_catalog.get(name)
            lay = shard_layout(spec, SHAPES["tiny"], 1, 0, BF16)
            chosen = t.cold.ways.chosen(dev, nbytes)  # what the reads before this one chose
            asked = t.asked_ahead
            if speculative:
                warm_sent += 1
                if chosen is not None:  # every 3rd warm read of the class rechecks a way not chosen, each in turn
                    others = [w for w in WAYS if w != chosen]
                    wanted_warm.append(chosen if warm_sent % 3 else others[(warm_sent // 3) % len(others)])
                with t.demand.speculative():
                    entry = t.fetch(spec, lay, count=False)[0].result(timeout=60)
                assert entry.speculative
            else:
                wanted_demand.append(chosen or "preadv")
                entry = t.fetch(spec, lay)[0].result(timeout=60)
            want = torch.zeros(lay.numel, dtype=lay.dtype)
            read_shard(spec, lay, want)
            assert torch.equal(entry.tensor, want)
            assert entry.ticket is not None
            assert went_direct(entry) == (entry.ticket.way == "direct") == (entry.how == "direct")
            assert t.asked_ahead - asked == (entry.ticket.way == "ahead")  # asked ahead exactly when sent that way
            (warm_ways if speculative else demand_ways).append(entry.ticket.way)
        # the first demand read timed the page cache, so the warm reads explore: direct, preadv, ahead, direct, ahead
        assert warm_ways[:5] == ["direct", "preadv", "ahead", "direct", "ahead"]
        assert warm_ways[5:] == wanted_warm and len(wanted_warm) == 3
        assert demand_ways == wanted_demand and demand_ways[0] == "preadv" and len(demand_ways) == 4
        report = t.cold.ways.report()[f"{dev}:{size_class(nbytes)}"]
        assert report["chosen"] == t.cold.ways.chosen(dev, nbytes) is not None
        timed_reads = sum(report[w]["timed"] for w in WAYS)  # type: ignore[index]
        assert timed_reads == len(warm), f"every read ran alone, each is timed: {report}"
        assert t.cold.went == {w: (warm_ways + demand_ways).count(w) for w in WAYS}  # counted by the way each went
        t.check_integrity()
    finally:
        t.close()


def test_a_read_a_request_waits_for_never_tries_a_way(cold_catalog: AdapterCatalog) -> None:
    """Demand reads alone, however many, go through the page cache while nothing is chosen (what ``off`` does: a
    service with no warm stages never leaves it), are timed, and never open ``O_DIRECT`` or ask ahead; once the class
    has chosen (here ``direct``, measured faster), they go that way."""
    t, dev, nbytes = auto_tier(cold_catalog, explore=1, recheck=2)
    names = cold_catalog.names()
    try:
        for name in names[:6]:
            spec = cold_catalog.get(name)
            lay = shard_layout(spec, SHAPES["tiny"], 1, 0, BF16)
            entry = t.fetch(spec, lay)[0].result(timeout=60)
            assert (entry.how, entry.ticket is not None and entry.ticket.way) == ("preadv", "preadv")
            assert not went_direct(entry)
        assert t.asked_ahead == 0
        report = t.cold.ways.report()[f"{dev}:{size_class(nbytes)}"]
        assert report["chosen"] is None and report["preadv"]["timed"] == 6  # type: ignore[index]
        for way, rate in (("direct", 1e12), ("ahead", 1.0)):  # what warm reads would have measured
            t.cold.ways.timed(Ticket(dev, size_class(nbytes), way, 0), nbytes, nbytes / rate, way == "direct")
        assert t.cold.ways.chosen(dev, nbytes) == "direct"
        spec = cold_catalog.get(names[6])
        lay = shard_layout(spec, SHAPES["tiny"], 1, 0, BF16)
        entry = t.fetch(spec, lay)[0].result(timeout=60)
        want = torch.zeros(lay.numel, dtype=lay.dtype)
        read_shard(spec, lay, want)
        assert torch.equal(entry.tensor, want)
        assert entry.how == "direct" and went_direct(entry)
        t.check_integrity()
    finally:
        t.close()


def test_reads_that_overlap_are_not_timed(cold_catalog: AdapterCatalog, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two warm stages' reads in flight at once (the first held until the second is dispatched): neither is timed,
    since a shared device's rate says nothing of either way, and the second, which started beside the first, is not
    sent to explore: it goes through the page cache while its class explores. Both stage the right bytes; a read
    alone after them is timed."""
    second_sent = threading.Event()
    real_read = ThreadReads.read
    held: list[str] = []

    def read(self: ThreadReads, spec: Any, entry: Any) -> int:
        if not held:
            held.append(spec.name)
            assert second_sent.wait(30), "the second read was never dispatched"
        return real_read(self, spec, entry)

    monkeypatch.setattr(ThreadReads, "read", read)
    t = HostTier(HostTierConfig(host_bytes=8 * MB, read_threads=2, read_parallel=1, pin=False, reads="thread",
                                direct_reads="auto"))
    try:
        names = cold_catalog.names()
        specs = [cold_catalog.get(n) for n in names[:3]]
        lays = [shard_layout(s, SHAPES["tiny"], 1, 0, BF16) for s in specs]
        with t.demand.speculative():  # warm stages' reads: the ones that explore
            first = t.fetch(specs[0], lays[0], count=False)[0]
            second = t.fetch(specs[1], lays[1], count=False)[0]
        second_sent.set()
        for fut, spec, lay in zip((first, second), specs, lays):
            want = torch.zeros(lay.numel, dtype=lay.dtype)
            read_shard(spec, lay, want)
            assert torch.equal(fut.result(timeout=60).tensor, want)
        assert (first.result().how, first.result().ticket is not None) == ("direct", True)  # started alone: explores
        assert (second.result().how, second.result().ticket) == ("preadv", None)  # started beside it: untimed
        assert not went_direct(second.result())
        report = t.cold.ways.report()
        assert all(v[w]["timed"] == 0 for v in report.values() for w in WAYS), report  # type: ignore[index]
        t.fetch(specs[2], lays[2])[0].result(timeout=60)
        report = t.cold.ways.report()
        assert sum(v[w]["timed"] for v in report.values() for w in WAYS) == 1, report  # type: ignore[index]
    finally:
        t.close()


def test_a_direct_read_whose_runs_the_device_refused_is_not_timed_as_direct(
        cold_catalog: AdapterCatalog, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose logical block is larger than 4 KiB takes the ``O_DIRECT`` open and refuses the aligned reads
    (EINVAL): the read's runs then go through the page cache (``positioned.read_task``). A warm read sent to explore
    ``direct`` that went so measured the page cache: it is not a rate of ``direct``, and the file system reads the
    other two ways from then on. Every shard is a page-cache read's."""
    import errno

    import workers.reads.positioned as positioned

    def refusing(dfd: int, dest: torch.Tensor, runs: Any) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(positioned, "read_runs_direct", refusing)
    monkeypatch.setattr(positioned, "_REFUSED", [])
    t, dev, nbytes = auto_tier(cold_catalog, explore=1, recheck=100)
    names = cold_catalog.names()
    try:
        sent: list[str] = []
        for name in names[:5]:
            spec = cold_catalog.get(name)
            lay = shard_layout(spec, SHAPES["tiny"], 1, 0, BF16)
            with t.demand.speculative():
                entry = t.fetch(spec, lay, count=False)[0].result(timeout=60)
            assert entry.ticket is not None
            sent.append(entry.ticket.way)
            if entry.ticket.way == "direct":
                assert {p for p, _ in entry.marks} >= {"direct", "direct refused"}
            want = torch.zeros(lay.numel, dtype=lay.dtype)
            read_shard(spec, lay, want)
            assert torch.equal(entry.tensor, want)
        assert sent[0] == "direct" and "direct" not in sent[1:], sent  # refused once: never sent that way again
        assert dev in t.cold.ways.refused
        report = t.cold.ways.report()[f"{dev}:{size_class(nbytes)}"]
        assert report["direct"]["timed"] == 0, report  # type: ignore[index]
        assert report["chosen"] in ("preadv", "ahead")
        t.check_integrity()
    finally:
        t.close()
