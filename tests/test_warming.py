"""The fleet's host tiers as one cache (lora_cache/planner/warming.py): what each replica keeps warm, and the
speculative stages the planner sends for it."""

from __future__ import annotations

from typing import Any

import pytest

from lora_cache.errors import ConfigError
from lora_cache.planner import Planner, PlannerConfig
from lora_cache.planner.popularity import Popularity
from lora_cache.planner.records import AdapterInfo, ReplicaSpec, ResidencyEntry, SlotState
from lora_cache.planner.rendezvous import preference
from lora_cache.vocab import Ranking, Stage


def make(replicas: int = 3, adapters: int = 12, host_bytes: int | None = 1000, policy: str = "global",
         sizes: dict[int, int] | None = None, disk_bytes: int | None = None, objects: dict[int, int] | None = None,
         **config: object) -> Planner:
    """``disk_bytes``: each rank's part of its node's disk tier; ``objects``: adapter index -> its object's bytes in
    a store (the others are local files)."""
    specs = [ReplicaSpec(f"r{r}", (f"r{r}/w0",), 2, None, host_bytes, disk_bytes) for r in range(replicas)]
    infos = [AdapterInfo(f"a{i}", "v1", (sizes or {}).get(i, 100), (objects or {}).get(i, 0)) for i in range(adapters)]
    config.setdefault("warm_host_share", 0.5)
    config.setdefault("warm_min_miss_s", 0.0)  # warm without measuring: the controller's gate is tested below
    for name in ("place_homes", "max_prefetches_per_plan", "stage_host_share"):  # GPU placement and popularity
        config.setdefault(name, 0 if name != "place_homes" else False)  # stages apart: warming alone here
    return Planner(PlannerConfig(policy=policy, **config), 1, infos, specs)  # type: ignore[arg-type]


def warm_stages(planner: Planner, now: float, disk: bool = False) -> dict[str, list[Stage]]:
    """Each worker's warm stages in the next plan: host ones, or (``disk``) disk ones."""
    plan = planner.plan_all(now)
    out = {c.worker: [s for s in c.stages if s.speculative and s.disk == disk] for c in plan.workers}
    return {w: keys for w, keys in out.items() if keys}


def test_one_copy_of_as_much_of_the_catalog_as_fits_before_any_second() -> None:
    """3 replicas x 500 warm bytes hold 15 shards of 100: all 12 adapters get exactly one copy, each on the first
    replica of its rendezvous order with room, within every budget."""
    planner = make()
    stages = warm_stages(planner, 0.0)
    placed = [s.adapter for keys in stages.values() for s in keys]
    assert sorted(placed) == sorted(f"a{i}" for i in range(12)), "each adapter warmed exactly once"
    for worker, keys in stages.items():
        assert len(keys) * 100 <= 500, f"{worker} warms over its budget"
    book = planner._replan.warming
    for replica in ("r0", "r1", "r2"):
        for key in book.warm(replica):
            first = preference(key.name, ["r0", "r1", "r2"])[0]
            # a replica other than the first in rendezvous order only because the first was full
            assert replica == first or len(book.warm(first)) * 100 + 100 > 500
    planner.check_integrity()


def test_requested_adapters_first_then_unseen_smallest_first() -> None:
    """One replica, room for 3 shards: the requested adapter first, then the never-requested ones by size."""
    # 650 bytes of shards: more than the tier (600), so the share (300) bounds the warm set
    planner = make(replicas=1, adapters=5, host_bytes=600, sizes={0: 300, 1: 100, 2: 50, 3: 100, 4: 100})
    planner.record_request("a4", "r0", 0.0)
    stages = warm_stages(planner, 0.0)["r0/w0"]
    assert [s.adapter for s in stages] == ["a4", "a2", "a1"]  # 100 + 50 + 100 of 300, then a3 (100) fits no more
    assert [s.priority for s in stages] == sorted(s.priority for s in stages)


def test_requested_adapters_by_the_store_time_a_copy_saves_per_byte() -> None:
    """A copy saves a miss's store read: a large shard costs more to hold and more to miss. Where a read's time is
    its bytes (no reads timed yet, or a device), the busier adapter comes first whatever its size (a0: 2 requests,
    400 bytes, before a1: 1 request, 100 bytes; by count per byte a1 came first and a busy rank-64 adapter was left
    to the store); where a read costs mostly a fixed latency (an object store far away), the smaller saves more
    per byte."""
    def order(read_s: Any) -> list[str]:
        planner = make(replicas=1, adapters=2, host_bytes=2000, sizes={0: 400, 1: 100})
        planner.set_warming(True, read_s)
        for _ in range(2):
            planner.record_request("a0", "r0", 0.0)
        planner.record_request("a1", "r0", 0.0)
        return [s.adapter for s in warm_stages(planner, 0.0)["r0/w0"]]

    assert order(None) == ["a0", "a1"]
    assert order(lambda n: n / 1e9) == ["a0", "a1"]  # 1 GB/s, no fixed cost: the count decides
    assert order(lambda n: 0.05 + n / 1e12) == ["a1", "a0"]  # 50 ms a read whatever its size: the small first


@pytest.mark.parametrize("replicas, host_bytes", [(1, 1000), (2, 500)])
def test_host_tiers_that_hold_the_catalog_warm_all_of_it_whatever_the_share(replicas: int, host_bytes: int) -> None:
    """800 bytes of shards: more than the share's budgets (500 in all), within the whole tiers (1,000 in all). Every
    adapter gets its one copy, each tier within its whole bytes, and no second copy: those stay within the share
    (the first copies took more than it). With one more adapter the catalog outgrows the tiers, and the share bounds
    the warm set again."""
    planner = make(replicas=replicas, adapters=8, host_bytes=host_bytes)
    for _ in range(3):
        planner.record_request("a3", "r0", 0.0)
    stages = warm_stages(planner, 0.0)
    placed = sorted(s.adapter for keys in stages.values() for s in keys)
    assert placed == sorted(f"a{i}" for i in range(8)), "each adapter warmed exactly once"
    for worker, keys in stages.items():
        assert len(keys) * 100 <= host_bytes, f"{worker} warms more than its tier holds"
    planner.check_integrity()

    bigger = make(replicas=replicas, adapters=11, host_bytes=host_bytes)  # 1,100 bytes: the share's 500 in all
    assert sum(len(keys) for keys in warm_stages(bigger, 0.0).values()) * 100 <= replicas * host_bytes // 2


def test_second_copies_only_once_every_adapter_has_one() -> None:
    planner = make(replicas=2, adapters=3, host_bytes=1000)  # 2 x 500 bytes: 10 shards' room for 3 adapters
    planner.record_request("a1", "r0", 0.0)
    stages = warm_stages(planner, 0.0)
    copies = [s.adapter for keys in stages.values() for s in keys]
    assert sorted(copies) == ["a0", "a1", "a1", "a2"], "the requested adapter alone gets a second copy"


def test_warm_stages_are_resent_at_each_assignment_and_never_name_what_a_rank_holds() -> None:
    planner = make(replicas=1, adapters=3, host_bytes=1000, warm_refresh_s=5.0)
    first = warm_stages(planner, 0.0)["r0/w0"]
    assert {s.adapter for s in first} == {"a0", "a1", "a2"}
    assert warm_stages(planner, 1.0) == {}, "sent once per assignment"
    planner.advance(2.0)
    planner.update_residency("r0/w0", ResidencyEntry("a1", "v1", SlotState.READY))  # now in a GPU slot
    again = warm_stages(planner, 6.0)["r0/w0"]  # a new assignment: sent again, LRU places refreshed
    assert {s.adapter for s in again} == {"a0", "a2"}
    planner.check_integrity()


def test_no_warming_without_a_host_tier_for_the_queue_policy_or_at_share_zero() -> None:
    assert warm_stages(make(host_bytes=None), 0.0) == {}
    assert warm_stages(make(policy="queue"), 0.0) == {}
    assert warm_stages(make(warm_host_share=0.0), 0.0) == {}


def test_an_unregistered_adapter_leaves_the_warm_sets_at_once() -> None:
    planner = make(replicas=1, adapters=3)
    warm_stages(planner, 0.0)
    planner.remove_adapter("a1", 1.0)
    assert "a1" not in {k.name for k in planner._replan.warming.warm("r0")}
    planner.check_integrity()


def test_disk_tiers_keep_the_store_adapters_the_host_tiers_cannot_in_the_same_order() -> None:
    """One replica, a host warm budget of 2 shards (400 bytes at share 0.5), a disk budget of 4 objects (0.8 x 500
    bytes of disk): the store adapters after the host's warm set, in its order, go to the disk tier only, within its
    bytes (counting the host's own: they are fetched through it); adapters of local files never; each stage once
    per assignment, after the host's."""
    objects = {i: 100 for i in range(8) if i != 3}  # a3 is local files
    planner = make(replicas=1, adapters=8, host_bytes=400, disk_bytes=500, objects=objects, sizes={0: 200},
                   warm_disk_share=0.8)
    planner.record_request("a5", "r0", 0.0)
    host = [s.adapter for s in warm_stages(planner, 0.0)["r0/w0"]]
    assert len(host) == 2 and host[0] == "a5", "requested first, then one unseen 100-byte adapter"
    book = planner._replan.warming
    disk = [k.name for k in book.warm_disk("r0")]
    assert "a3" not in disk and not set(host) & set(disk), "local files, or what the host tier warms"
    assert sum(objects[int(n[1:])] for n in [*host, *disk]) <= 400, "the disk budget holds the host's too"
    assert len(disk) == 2, "as many store adapters as the disk's budget holds beyond the host's"
    order = [k.name for k in book._disk["r0"]]
    assert order[:2] == host, "the disk set follows the warm set's order"
    planner2 = make(replicas=1, adapters=8, host_bytes=400, disk_bytes=500, objects=objects, sizes={0: 200},
                    warm_disk_share=0.8)
    planner2.record_request("a5", "r0", 0.0)
    plan = planner2.plan_all(0.0).for_worker("r0/w0")
    assert plan is not None
    stages = [s for s in plan.stages if s.speculative]
    assert [s.adapter for s in stages if s.disk] == disk and all(s.speculative for s in stages)
    last_host = max(s.priority for s in stages if not s.disk)
    assert all(s.priority > last_host for s in stages if s.disk), "disk stages after the host's"
    assert warm_stages(planner2, 1.0, disk=True) == {}, "sent once per assignment"
    assert {s.adapter for s in warm_stages(planner2, 6.0, disk=True)["r0/w0"]} == set(disk), "again at the next"
    planner2.check_integrity()


@pytest.mark.parametrize("replicas", [1, 3])
def test_one_disk_copy_of_every_store_adapter_before_any_second_and_none_without_a_disk(replicas: int) -> None:
    objects = {i: 100 for i in range(12)}
    planner = make(replicas=replicas, adapters=12, host_bytes=200, disk_bytes=2000, objects=objects,
                   warm_disk_share=0.8)
    warm_stages(planner, 0.0)
    book = planner._replan.warming
    placed = [k.name for r in ("r0", "r1", "r2") for k in book._disk.get(r, ())]
    assert sorted(set(placed)) == sorted(f"a{i}" for i in range(12)), "every store adapter on some node's disk"
    assert len(placed) == 12, "one copy each: no second copy of an adapter nobody asked for"
    planner.check_integrity()
    assert warm_stages(make(replicas=replicas, objects=objects), 0.0, disk=True) == {}, "no disk tier reported"
    assert warm_stages(make(replicas=replicas, objects=objects, disk_bytes=2000, warm_disk_share=0.0), 0.0,
                       disk=True) == {}, "share 0"
    assert warm_stages(make(replicas=replicas, disk_bytes=2000), 0.0, disk=True) == {}, "local files only"
    assert warm_stages(make(replicas=replicas, objects=objects, disk_bytes=2000, policy="queue"), 0.0,
                       disk=True) == {}, "the queue policy"


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("warm_disk_share", 1.5, "warm_disk_share is 1.5; give a share in [0, 1]"),
    ("warm_host_share", 1.5, "warm_host_share is 1.5; give a share in [0, 1]"),
    ("warm_host_share", -0.1, "give a share in [0, 1]"),
    ("warm_refresh_s", 0.0, "warm_refresh_s is 0.0; give seconds > 0"),
])
def test_bad_warm_settings_name_the_field_the_value_and_the_fix(field: str, value: float, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        PlannerConfig(**{field: value})  # type: ignore[arg-type]


def test_warming_waits_until_the_workers_reads_are_measured_to_hurt(tiny_adapters: Any) -> None:
    """The controller warms only once the workers' own reads from storage of the largest shard take
    ``warm_min_miss_s`` (their READY reports carry each read's seconds): a page-cache read (~50 ms for an 8B r64
    shard) never turns it on, a device read (~0.28 s) does, and slow prefetch-to-READY times alone (a loaded fleet
    waiting for slots on a fast store) do not."""
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.controller.core import ControllerConfig, ControllerCore
    from lora_cache.routing.clock import WARM_MIN_SAMPLES
    from lora_cache.vocab import Prefetch, WorkerId

    paths = tiny_adapters(4)
    catalog = CatalogConfig(adapter_roots=(str(paths[0].parent),), model="tiny", max_rank=16)
    gate = PlannerConfig().warm_min_miss_s  # the default

    def core_after(ready_s: float, read_s: float) -> ControllerCore:
        """Loads of every adapter on one worker, READY ``ready_s`` after their prefetch, each having read its
        shard from storage in ``read_s`` (its READY report's read_s)."""
        core = ControllerCore(ControllerConfig(catalog=catalog, planner=PlannerConfig(policy="global")), epoch=1)
        for p in paths:
            core.register_adapter(p.name, str(p))
        core.add_replica("r0", 1, 8)
        worker = WorkerId("r0", 0)
        for k in range(int(WARM_MIN_SAMPLES) + 1):
            now = 10.0 * k
            core.report_queue("r0", [(p.name, now) for p in paths], now)
            sent = [c for c in core.plan(now).get(worker, []) if isinstance(c, Prefetch)]
            core.worker_report(worker, [(c.adapter, c.version, "ready", "", read_s) for c in sent], now + ready_s)
            core.worker_report(worker, [(c.adapter, c.version, "gone", "") for c in sent], now + ready_s)
            core.plan(now + ready_s)
        return core

    fresh = ControllerCore(ControllerConfig(catalog=catalog, planner=PlannerConfig()), epoch=1)
    assert not fresh.status()["warming"]["on"], "nothing measured yet"
    page_cache = core_after(ready_s=0.4, read_s=0.05)
    assert page_cache.status()["warming"]["read_samples"] >= WARM_MIN_SAMPLES, "the reads were not fitted"
    assert not page_cache.status()["warming"]["on"], "slow READYs over fast reads: a page-cache miss does not pay"
    assert not page_cache.planner.warming
    device = core_after(ready_s=0.4, read_s=2 * gate)
    assert device.status()["warming"]["on"] and device.planner.warming, "a device read of the largest shard does"
    hits = core_after(ready_s=0.4, read_s=0.0)  # host-tier hits read nothing: no sample
    assert hits.status()["warming"]["read_samples"] == 0 and not hits.planner.warming


def test_set_warming_off_sends_no_warm_stage_unless_the_gate_is_zero() -> None:
    planner = make(warm_min_miss_s=0.05)
    assert warm_stages(planner, 0.0) == {}, "off until the controller turns it on"
    planner.set_warming(True)
    assert warm_stages(planner, 1.0)


def rankings(planner: Planner, now: float) -> dict[str, Ranking]:
    """Each worker's ranking in the next plan (warming.py, point 5), where one is sent."""
    return {c.worker: c.ranking for c in planner.plan_all(now).workers if c.ranking is not None}


def test_every_rank_gets_the_fleets_ranking_when_it_changed_at_most_every_rank_refresh_s() -> None:
    """Requested adapters by fleet-wide rate, most first, as long as twice the rank's host tier holds them, then the
    replica's warm keys; sent at the first plan, not again while it is unchanged, again once the rates reorder it,
    never sooner than ``rank_refresh_s`` after the last."""
    planner = make(replicas=2, adapters=12, host_bytes=300, rank_refresh_s=2.0)  # 600 bytes: six shards ranked
    for name, times in (("a3", 4), ("a7", 3), ("a1", 2), ("a0", 1)):
        for _ in range(times):
            planner.record_request(name, "r1", 0.0)  # on one replica: the counts are the fleet's
    first = rankings(planner, 0.0)
    assert first == {w: Ranking(("a3", "a7", "a1", "a0"), 1) for w in ("r0/w0", "r1/w0")}
    assert rankings(planner, 6.0) == {}, "the same ranking: not sent again"
    for name in ("a9", "a8", "a6", "a5", "a4", "a2", "a0"):
        for _ in range(6):
            planner.record_request(name, "r0", 7.0)
    assert rankings(planner, 7.5) == {}, "computed at 6.0: not again before 8.0"
    again = rankings(planner, 8.0)
    assert set(again) == {"r0/w0", "r1/w0"}
    names = again["r0/w0"].names
    # 600 bytes of 100-byte shards: the six asked for 6 times in the last second (2/s over their 3 s minimum age)
    # before a0 (7 requests over 8 s) and the rest; then the replica's warm keys the six leave out
    assert names[:6] == ("a2", "a4", "a5", "a6", "a8", "a9")
    warm = [k.name for k in planner._replan.warming.warm("r0") if k.name not in names[:6]]
    assert list(names[6:]) == warm
    planner.check_integrity()


def test_no_ranking_where_nothing_is_warmed() -> None:
    """The queue policy, no host tier, or warming off: no ranking (the tiers' popular order stays LRU's)."""
    for planner in (make(policy="queue"), make(host_bytes=None), make(warm_host_share=0.0)):
        planner.record_request("a1", "r0", 0.0)
        assert rankings(planner, 0.0) == {}


@pytest.mark.parametrize("short_s, first", [(15.0, "new"), (0.0, "old")])
def test_the_ranking_reads_each_adapters_rate_now_with_the_short_rate_kept(short_s: float, first: str) -> None:
    """An adapter asked for at 1/s for five minutes, then a new one at 2/s for 20 s: with the short rate kept (read
    over the new one's own age, the old one's capped by its time without a request) the new one ranks first; with the
    60 s counts alone the old one still does. An unregistered adapter leaves every counter."""
    pop = Popularity(60.0, 100, short_s, 3.0)
    for t in range(300):
        pop.observe("old", "r0", float(t))
    for i in range(40):
        pop.observe("new", "r1", 300.0 + i / 2)
    pop.observe("gone", "r0", 310.0)
    assert pop.hottest(320.0, 10)[0] == first
    assert pop.hottest(320.0, 1) == (["new", "old"] if short_s else ["old"])  # each counter's top one
    pop.forget("gone")
    assert "gone" not in pop.hottest(320.0, 10)
    pop.check_integrity()
    pop.observe("old", "r0", 900.0)  # ten minutes later, the new one long stopped
    assert pop.hottest(900.0, 10) == ["old", "new"]
    pop.check_integrity()


@pytest.mark.parametrize("idle_k, first", [(3.0, "b"), (0.0, "a")])
def test_an_adapter_that_stopped_falls_below_one_asked_for_now_within_seconds(idle_k: float, first: str) -> None:
    """a at 1/s and b at 0.5/s for five minutes, then a stops: 10 s later a ranks at most 3 / 10 = 0.3/s, below b
    (still 0.5/s); with no cap a's counts keep it first for most of a half-life."""
    pop = Popularity(60.0, 100, 15.0, idle_k)
    for t in range(300):
        pop.observe("a", "r0", float(t))
        if t % 2 == 0:
            pop.observe("b", "r0", float(t))
    assert pop.hottest(300.0, 10) == ["a", "b"]
    for t in range(300, 311, 2):
        pop.observe("b", "r0", float(t))
    assert pop.hottest(310.0, 10)[0] == first
    pop.check_integrity()
