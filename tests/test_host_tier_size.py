"""The host tier's size: a share of this host's available memory over its GPU ranks, capped by the operator
(issue 30, item 2), resolved once per rank; the benchmark's tier the same for every policy, and its miss cost
per tier reported."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.figures import PolicyRun, figures
from bench.report import table
from bench.run import build_parser, configs
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.errors import ConfigError
from workers.cache import WorkerCache, WorkerConfig
from workers.engine.timings import RequestRecord
from workers.reads.threads import ranks_on_host
from workers.staging.host_config import (
    AUTO_MAX_BYTES,
    AUTO_MIN_BYTES,
    AUTO_SHARE,
    HostTierConfig,
    auto_host_bytes,
    available_memory,
)
from workers.staging.host_tier import HostTier

GiB = 1 << 30


@pytest.fixture
def catalog(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    return make_catalog(tiny_adapters(count=2, rank="8")[0].parent)


def test_auto_is_a_share_of_available_memory_over_the_ranks_capped_and_floored() -> None:
    assert HostTierConfig().host_bytes == 0 and HostTierConfig().auto  # the default follows the host
    assert auto_host_bytes(512 * GiB, 8) == 16 * GiB  # 0.25 x 512 GiB over 8 ranks
    assert auto_host_bytes(512 * GiB, 4, share=0.5) == AUTO_MAX_BYTES  # 64 GiB each, capped at the default cap
    assert auto_host_bytes(512 * GiB, 4, cap=8 * GiB) == 8 * GiB  # the operator's cap
    assert auto_host_bytes(1 * GiB, 8) == AUTO_MIN_BYTES  # a small or busy host: the floor
    assert auto_host_bytes(1 * GiB, 8, cap=64 << 20) == 64 << 20  # ... but never above the cap
    assert auto_host_bytes(0, 1) == AUTO_MIN_BYTES
    assert auto_host_bytes(10 * GiB + 12345, 3) % (1 << 20) == 0  # whole MiB


def test_sized_resolves_auto_once_and_leaves_a_given_size() -> None:
    auto = HostTierConfig(host_share=0.5, host_max_bytes=64 * GiB)
    assert auto.sized(4, available=100 * GiB).host_bytes == 12_800 << 20  # 0.5 x 100 GiB / 4
    assert not auto.sized(4, available=100 * GiB).auto
    given = HostTierConfig(host_bytes=3 * GiB)
    assert given.sized(8, available=1) is given
    here = HostTierConfig(host_max_bytes=1 << 40).sized(2)  # this host's own MemAvailable
    assert here.host_bytes == auto_host_bytes(available_memory(), 2) or here.host_bytes > 0


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"host_bytes": 1000}, "host_bytes"),
        ({"host_share": 0.0}, "host_share"),
        ({"host_share": 0.95}, "host_share"),
        ({"host_max_bytes": 10}, "host_max_bytes"),
    ],
)
def test_bad_sizes_are_refused_with_the_fix(kw: dict[str, float], word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        HostTierConfig(**kw)  # type: ignore[arg-type]


def test_available_memory_reads_this_host() -> None:
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert 0 < available_memory() <= total


def test_a_rank_resolves_its_tier_from_the_host(catalog: AdapterCatalog) -> None:
    """A WorkerCache left at the default sizes its tier once (what it reports to the controller), within the
    operator's cap; its arena holds exactly that."""
    config = WorkerConfig(num_slots=2, device="cpu", host=HostTierConfig(host_max_bytes=96 << 20, pin=False))
    cache = WorkerCache(config, catalog)
    try:
        host = cache.config.host
        assert not host.auto and host.host_bytes == cache.host.arena.capacity == cache.host.config.host_bytes
        expected = auto_host_bytes(available_memory(), ranks_on_host(1), AUTO_SHARE, 96 << 20)
        assert host.host_bytes == expected == 96 << 20  # this container has far more than 4 x 96 MiB free
    finally:
        cache.close()
    tier = HostTier(HostTierConfig(host_max_bytes=64 << 20, pin=False), ranks_here=2)
    try:
        assert tier.arena.capacity == tier.config.host_bytes == 64 << 20
    finally:
        tier.close()


def test_the_cli_has_the_sizing_options() -> None:
    from workers.engine.__main__ import build_parser as engine_parser

    text = engine_parser().format_help()
    assert "--host-share" in text and "--host-max-bytes" in text


def test_the_benchmark_states_one_tier_for_every_policy() -> None:
    bench, _ = configs(build_parser().parse_args(["--scenario", "zipf", "--engine", "sim"]))
    assert bench.host_bytes == 16 * GiB  # the named scenarios' realistic tier
    bench, _ = configs(build_parser().parse_args(["--quick"]))
    assert bench.host_bytes == 2 * GiB
    bench, _ = configs(build_parser().parse_args(["--scenario", "seed", "--host-bytes", "0"]))
    assert bench.host_bytes == HostTierConfig().sized(ranks_on_host(bench.tp)).host_bytes or bench.host_bytes > 0


def test_miss_cost_per_tier_in_figures_and_table() -> None:
    records = [
        RequestRecord(i, "a", 8, 2, 0.1 * i, 0.1 * i, (0.1 * i + 0.05, 0.1 * i + 0.06), 0.01 * (i % 2))
        for i in range(6)
    ]
    loads = [
        {"t_s": 0.1, "nbytes": 10, "ready_ms": 3.0, "disk_ms": None, "host_hit": True},
        {"t_s": 0.2, "nbytes": 10, "ready_ms": 40.0, "disk_ms": 30.0, "host_hit": False},
        {"t_s": 0.3, "nbytes": 10, "ready_ms": 60.0, "disk_ms": 50.0, "host_hit": False},
    ]
    f = figures(PolicyRun("global", "real", records, [], loads))
    assert f["gpu_hits"] == 3 and f["host_hit_loads"] == 1 and f["disk_loads"] == 2
    assert f["host_hit_ready_ms_p50"] == 3.0 and f["disk_ready_ms_p50"] == 50.0 and f["disk_read_ms_p50"] == 40.0
    text = table({"global": f}, [])
    assert "miss cost per tier" in text and "| global | 3 | 1 | 3.000 / 3.000 | 2 | 50.0 / 59.8 | 40.0 |" in text
